"""resource_metrics.py: exact sliding windows on a fake clock, the busy fraction, and the
GPU branch through mocks (no GPU on the test machine): NVML when pynvml is there (found by
the device's UUID), torch.cuda's memory otherwise; another process watched (the engine
core's) counted in."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pagoda.engine.resource_metrics import (
    CumulativeRate,
    GpuSampler,
    ResourceMetrics,
    SlidingWindow,
    process_cpu_seconds,
    resident_memory_bytes,
)

GiB = 1 << 30


class FakeNvml:
    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.by_uuid: list[str] = []

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.by_uuid.append(uuid)
        return "handle-" + uuid

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle-{index}"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        assert handle == "handle-GPU-1234"
        return SimpleNamespace(gpu=37, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(used=3 * GiB, total=80 * GiB, free=77 * GiB)


class FakeCuda:
    def get_device_properties(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(uuid="1234", total_memory=16 * GiB)

    def memory_reserved(self, index: int) -> int:
        return 2 * GiB


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_sliding_window_sums_the_last_window() -> None:
    w = SlidingWindow(10.0, Clock())
    w.add(30, now=101.0)
    w.add(20, now=105.0)
    assert w.total(now=106.0) == 50 and w.rate(now=106.0) == 5.0
    assert w.rate(now=111.5) == 2.0  # NOTE: the event at 101 left the window at 111
    assert w.rate(now=115.0) == 0.0


def test_cumulative_rate_over_the_window() -> None:
    clock, cpu = Clock(), [0.0]
    rate = CumulativeRate(lambda: cpu[0], 10.0, clock)
    clock.t, cpu[0] = 104.0, 2.0
    assert rate.rate() == pytest.approx(0.5)
    clock.t, cpu[0] = 112.0, 2.0
    assert rate.rate() == pytest.approx(2.0 / 12.0)  # base: the first read
    clock.t, cpu[0] = 116.0, 6.0
    assert rate.rate() == pytest.approx((6.0 - 2.0) / (116.0 - 104.0))  # base: 104 (<= 106)


def test_nvml_utilisation_and_memory_by_uuid() -> None:
    nvml = FakeNvml()
    gpu = GpuSampler(0, nvml, FakeCuda())
    assert nvml.by_uuid == ["GPU-1234"] and gpu.has_utilization
    assert gpu.utilization() == pytest.approx(0.37)
    assert gpu.memory() == (3 * GiB, 80 * GiB)


def test_without_nvml_torch_cuda_memory() -> None:
    for nvml in (None, FakeNvml(fail_init=True)):
        gpu = GpuSampler(0, nvml, FakeCuda())
        gpu.nvml = None if nvml is None else gpu.nvml
        assert not gpu.has_utilization
        assert gpu.memory() == (2 * GiB, 16 * GiB)


def gauges(registry: CollectorRegistry) -> dict[str, float]:
    return {s.name: s.value for f in registry.collect() for s in f.samples}


def test_resource_gauges_cpu_and_gpu() -> None:
    cpu_registry = CollectorRegistry()
    cpu = ResourceMetrics(cpu_registry, "m", "cpu", window_s=10.0)
    cpu.observe_step(0.5)
    cpu.observe_step(1.5)
    values = gauges(cpu_registry)
    assert values["pagoda:engine_busy_fraction"] == pytest.approx(0.2)
    assert values["pagoda:process_resident_memory_bytes"] == pytest.approx(
        resident_memory_bytes(), rel=0.2)
    assert not any(name.startswith("pagoda:gpu") for name in values)
    cpu.observe_step(20.0)
    assert gauges(cpu_registry)["pagoda:engine_busy_fraction"] == 1.0  # NOTE: capped

    gpu_registry = CollectorRegistry()
    ResourceMetrics(gpu_registry, "m", "cuda:0", gpu=GpuSampler(0, FakeNvml(), FakeCuda()))
    values = gauges(gpu_registry)
    assert values["pagoda:gpu_utilization_perc"] == pytest.approx(0.37)
    assert values["pagoda:gpu_memory_used_bytes"] == 3 * GiB
    assert values["pagoda:gpu_memory_total_bytes"] == 80 * GiB

    torch_registry = CollectorRegistry()
    ResourceMetrics(torch_registry, "m", "cuda:1", gpu=GpuSampler(1, None, FakeCuda()))
    values = gauges(torch_registry)
    assert "pagoda:gpu_utilization_perc" not in values
    assert values["pagoda:gpu_memory_used_bytes"] == 2 * GiB


def test_watch_process_adds_its_cpu_and_rss() -> None:
    """--engine-process: the gauges count the engine core's process too (here: this one
    again, so that the expected figures are known)."""
    pid = os.getpid()
    assert process_cpu_seconds(pid) == pytest.approx(time.process_time(), abs=0.5)
    assert process_cpu_seconds(2**22 + 12345) is None  # NOTE: above Linux's pid_max default
    registry = CollectorRegistry()
    metrics = ResourceMetrics(registry, "m", "cpu")
    metrics.watch_process(pid)
    assert gauges(registry)["pagoda:process_resident_memory_bytes"] == pytest.approx(
        2 * resident_memory_bytes(), rel=0.2)
    assert metrics._cpu_seconds() == pytest.approx(2 * time.process_time(), abs=1.0)
