"""All engine configuration, typed and in one place. Each component receives its slice."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pagoda.core.preemption import PREEMPTION_MODES
from pagoda.core.request import DEFAULT_SLA_TTFT_TARGETS_S, SLA_CLASS_RANKS
from pagoda.core.request_queue import DEFAULT_AGING_INTERVAL_S, SCHEDULING_POLICIES

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 where the device computes it natively, else float32. An explicit
    dtype is taken as given: float16 runs on every CPU (PyTorch converts per op where the
    CPU has no float16 arithmetic; oneDNN packs float16 weights only with AVX512_FP16 or
    AVX_NE_CONVERT, elsewhere the linears stay on F.linear)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {dtype!r}")
    return _DTYPES[dtype]


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class ModelConfig:
    model: str | None = None  # HF dir or .gguf file; None = the embedded default
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0
    attn_backend: str = "torch_paged"


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # NOTE: on CPU the pool is sized by bytes, not a fraction: the KV cache shares RAM with
    # everything else on the machine. None = min(4 GiB, 25% of available RAM).
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Host memory (GiB) for swap preemption's block pool; allocated only when
    # preemption_mode is "swap". Pinned when the device is CUDA.
    swap_space: float = 4.0
    # Host memory (GiB) for the prefix cache's second tier (vLLM's flag name): cached
    # blocks the device pool evicts are kept there and loaded back on a later hit.
    # 0 = off. Its own buffer, apart from swap_space (pinned when the device is CUDA).
    kv_offloading_size: float = 0.0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 0  # filled in by the engine once the model is known
    # "fcfs" or "priority" (SLA class, then request priority, then arrival; with aging).
    scheduling_policy: str = "fcfs"
    # "recompute" or "swap" (to the host pool of cache.swap_space; recompute when full).
    preemption_mode: str = "recompute"
    # Priority policy: a request ranks one SLA class better per this many seconds it
    # arrived before another (inf: no aging).
    aging_interval_s: float = DEFAULT_AGING_INTERVAL_S
    # Time-to-first-token target per SLA class (seconds): counted as met or missed in the
    # scheduler's stats. Classes not given keep their default.
    sla_ttft_targets_s: dict[str, float] = field(
        default_factory=lambda: dict(DEFAULT_SLA_TTFT_TARGETS_S)
    )


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"

    def validate(self) -> None:
        c, s = self.cache, self.scheduler
        if c.block_size < 1 or c.block_size & (c.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {c.block_size}")
        if not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}"
            )
        if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {c.kv_cache_memory_bytes}")
        if c.num_gpu_blocks_override is not None and c.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {c.num_gpu_blocks_override}"
            )
        if s.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {s.max_num_seqs}")
        if s.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {s.max_num_batched_tokens}"
            )
        m = self.model.max_model_len
        if m is not None and m < 1:
            raise ValueError(f"max_model_len must be >= 1, got {m}")
        self._validate_preemption_and_policy()

    def _validate_preemption_and_policy(self) -> None:
        c, s = self.cache, self.scheduler
        if not c.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {c.swap_space}")
        if not c.kv_offloading_size >= 0:
            raise ValueError(
                f"kv_offloading_size must be >= 0 GiB, got {c.kv_offloading_size}"
            )
        if c.kv_offloading_size > 0 and not c.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size > 0 (the prefix cache's host tier) needs "
                "enable_prefix_caching"
            )
        if s.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {sorted(SCHEDULING_POLICIES)}, "
                f"got {s.scheduling_policy!r}"
            )
        if s.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {list(PREEMPTION_MODES)}, "
                f"got {s.preemption_mode!r}"
            )
        if not s.aging_interval_s > 0:
            raise ValueError(f"aging_interval_s must be > 0, got {s.aging_interval_s}")
        for name, target in s.sla_ttft_targets_s.items():
            if name not in SLA_CLASS_RANKS:
                raise ValueError(
                    f"sla_ttft_targets_s: unknown SLA class {name!r}; "
                    f"classes are {list(SLA_CLASS_RANKS)}"
                )
            if not target > 0:
                raise ValueError(f"sla_ttft_targets_s[{name!r}] must be > 0, got {target}")


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
