"""Sliding-window rates and the process's resource gauges: engine busy fraction, process CPU,
resident memory, and on CUDA the device's utilisation and memory.

Every gauge here is computed when it is read (a scrape of /metrics or the dashboard's JSON),
so an idle server's rates fall back to zero without the engine thread doing anything.

| gauge (under `pagoda:`)          | value when read                                          |
|----------------------------------|----------------------------------------------------------|
| engine_busy_fraction             | seconds inside engine steps over the last `window_s`     |
|                                  | seconds, divided by `window_s` (at most 1)               |
| process_cpu_usage                | process CPU seconds (all threads) per wall second since  |
|                                  | the read before the window began (1.0 = one busy core)   |
| process_resident_memory_bytes    | resident set size now (/proc/self/statm; elsewhere the   |
|                                  | peak RSS, the only figure the standard library gives)    |
|                                  | (both gauges: with --engine-process, the server's two    |
|                                  | processes together, `watch_process`)                     |
| gpu_utilization_perc             | NVML's utilisation of the engine's device (0..1); only   |
|                                  | with pynvml importable                                   |
| gpu_memory_used_bytes / _total_  | NVML's used / total memory of the device; without NVML,  |
|                                  | torch.cuda.memory_reserved / the device's total memory   |
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

PREFIX = "pagoda:"
DEFAULT_WINDOW_S = 10.0


class SlidingWindow:
    """Amounts added at points in time; `total` sums those of the last `window_s` seconds
    and `rate` is that sum over `window_s`. Thread-safe (one writer, any readers)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, amount: float, now: float | None = None) -> None:
        with self._lock:
            self._events.append((self._clock() if now is None else now, amount))

    def total(self, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] <= now - self.window_s:
                self._events.popleft()
            return sum(amount for t, amount in self._events if t <= now)

    def rate(self, now: float | None = None) -> float:
        return self.total(now) / self.window_s


class CumulativeRate:
    """The rate of a monotone reading (e.g. CPU seconds) per wall second, over the span from
    the newest read at least `window_s` old (else the first read) to now."""

    def __init__(self, read: Callable[[], float], window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self._clock, self.window_s = read, clock, window_s
        self._samples = collections.deque([(clock(), read())])
        self._lock = threading.Lock()

    def rate(self) -> float:
        now, value = self._clock(), self._read()
        with self._lock:
            self._samples.append((now, value))
            # NOTE: keep one sample at or before the window's start as the base.
            while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
                self._samples.popleft()
            t0, v0 = self._samples[0]
        return (value - v0) / (now - t0) if now > t0 else 0.0


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # NOTE: after the ")" that ends the command name, utime and stime are the 12th
            # and 13th fields (fields 14 and 15 of proc(5)).
            rest = f.read().rpartition(")")[2].split()
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def process_resident_bytes(pid: int) -> int:
    """The resident set size of process `pid` (Linux /proc); 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def resident_memory_bytes() -> int:
    """The process's resident set size (Linux: current; elsewhere: the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # NOTE: KiB on Linux/BSD


class GpuSampler:
    """Utilisation and memory of one CUDA device, through NVML when `pynvml` imports, else
    torch.cuda's memory figures (no utilisation then). `nvml` and `cuda` can be injected."""

    def __init__(self, device_index: int, nvml: Any = None, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda, self.index = cuda, device_index
        self.nvml = nvml if nvml is not None else _import_nvml()
        self._handle = None
        if self.nvml is not None:
            try:
                self.nvml.nvmlInit()
                self._handle = _nvml_handle(self.nvml, cuda, device_index)
            except Exception:  # noqa: BLE001 - no NVML driver: fall back to torch.cuda
                self.nvml = None

    @property
    def has_utilization(self) -> bool:
        return self._handle is not None

    def utilization(self) -> float:
        return self.nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0

    def memory(self) -> tuple[int, int]:
        """(used, total) bytes."""
        if self._handle is not None:
            info = self.nvml.nvmlDeviceGetMemoryInfo(self._handle)
            return int(info.used), int(info.total)
        total = self.cuda.get_device_properties(self.index).total_memory
        return int(self.cuda.memory_reserved(self.index)), int(total)


def _import_nvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _nvml_handle(nvml: Any, cuda: Any, index: int) -> Any:
    """NVML's handle of CUDA device `index`: by UUID, since NVML numbers every device while
    CUDA numbers only the visible ones (CUDA_VISIBLE_DEVICES); by index if there is none."""
    uuid = getattr(cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        # NOTE: older drivers or torch builds: fall through to the index.
        with contextlib.suppress(Exception):
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    return nvml.nvmlDeviceGetHandleByIndex(index)


class ResourceMetrics:
    """Registers the gauges of the module table in `registry`; `observe_step` is the engine
    thread's report of one step's duration."""

    def __init__(self, registry: CollectorRegistry, model_name: str, device: str = "cpu",
                 window_s: float = DEFAULT_WINDOW_S, gpu: GpuSampler | None = None) -> None:
        self.busy = SlidingWindow(window_s)
        self.window_s = window_s
        self.cpu = CumulativeRate(time.process_time, window_s)
        self._pids: list[int] = []  # watch_process
        self._last_cpu: dict[int, float] = {}

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(PREFIX + name, doc, ["model_name"], registry=registry).labels(
                model_name).set_function(fn)

        gauge("engine_busy_fraction", "Fraction of wall time spent in engine steps.",
              lambda: min(self.busy.rate(), 1.0))
        gauge("process_cpu_usage", "Process CPU seconds per wall second (1 = one core).",
              lambda: self.cpu.rate())
        gauge("process_resident_memory_bytes", "Resident set size of the server process.",
              lambda: resident_memory_bytes() + sum(map(process_resident_bytes, self._pids)))
        if device.startswith("cuda"):
            index = int(device.partition(":")[2] or 0)
            gpu = gpu if gpu is not None else GpuSampler(index)
        self.gpu = gpu
        if gpu is not None:
            if gpu.has_utilization:
                gauge("gpu_utilization_perc", "GPU utilisation (NVML, 0..1).", gpu.utilization)
            gauge("gpu_memory_used_bytes", "GPU memory in use (NVML; else torch's reserved).",
                  lambda: gpu.memory()[0])
            gauge("gpu_memory_total_bytes", "GPU memory in total.", lambda: gpu.memory()[1])

    def observe_step(self, duration_s: float, now: float | None = None) -> None:
        self.busy.add(duration_s, now)

    def watch_process(self, pid: int) -> None:
        """Counts process `pid` (the engine core) into the CPU and RSS gauges from now on."""
        self._pids.append(pid)
        self.cpu = CumulativeRate(self._cpu_seconds, self.window_s)

    def _cpu_seconds(self) -> float:
        total = time.process_time()
        for pid in self._pids:
            # NOTE: a process that is gone keeps its last reading, so the rate never drops
            # below zero.
            seconds = process_cpu_seconds(pid)
            if seconds is not None:
                self._last_cpu[pid] = seconds
            total += self._last_cpu.get(pid, 0.0)
        return total
