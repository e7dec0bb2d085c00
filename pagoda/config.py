"""All engine configuration, typed and in one place. Each component receives its slice."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

import torch

from pagoda.core.preemption import PREEMPTION_MODES
from pagoda.core.request import DEFAULT_SLA_TTFT_TARGETS_S, SLA_CLASS_RANKS
from pagoda.core.request_queue import DEFAULT_AGING_INTERVAL_S, SCHEDULING_POLICIES
from pagoda.cpu_features import cpu_info
from pagoda.quant.base import quantization_methods

# --kv-host-compression values (worker/kv_compress.py).
HOST_COMPRESSIONS = ("none", "int8", "int4")
from pagoda.spec_decode.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# --kv-cache-dtype values (vLLM's flag); None = the model dtype.
GGUF_NATIVE_MODES = ("auto", "on", "off")
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    # Quantized (ops/kv_quant.py): codes plus a float32 scale per token and kv head.
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
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


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: "auto" = the model's, else the named one."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def _amx_listed() -> bool:
    """Whether the CPU lists amx_bf16: the condition both engine limits' defaults follow."""
    return "amx_bf16" in cpu_info()[1]


def default_max_num_seqs() -> int:
    """256 (vLLM's CPU default) on a CPU that lists amx_bf16, else 64. With AMX a step's
    products of 128+ rows run oneDNN's AMX GEMM (ops/quant_cpu.py), so more sequences per
    step cost less per token; without it a step is compute-bound from a few dozen rows and
    64 measured best (docs/architecture.md, Defaults)."""
    return 256 if _amx_listed() else 64


def default_max_num_batched_tokens() -> int:
    """4096 (vLLM's CPU default) on a CPU that lists amx_bf16, else 2048. With AMX a
    4096-row product runs nearer the GEMM's peak than two of 2048, and a burst of prompts
    is prefilled in fewer, cheaper steps; without it 2048 measured best
    (docs/architecture.md, Defaults)."""
    return 4096 if _amx_listed() else 2048


def cpu_has_bf16() -> bool:
    flags = cpu_info()[1]
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class ModelConfig:
    model: str | None  # HF dir or .gguf file; None = the embedded default
    dtype: str | torch.dtype
    max_model_len: int | None  # None = the model's max_position_embeddings
    seed: int
    attn_backend: str
    # Quantization (pagoda.quant): None = what config.json's quantization_config says (or
    # dense); a name must match the checkpoint's, or quantizes a dense one at load.
    quantization: str | None = None
    # GGUF files: keep the linears' supported blocks (GGUFWeight) instead of dequantizing
    # them: "on", "off", or "auto" = on where the device has a gguf_linear kernel.
    gguf_native: str = "auto"


@dataclass
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    # NOTE: on CPU the pool is sized by bytes, not a fraction: the KV cache shares RAM with
    # everything else on the machine. None = min(4 GiB, 25% of available RAM).
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    # Host memory (GiB) for swap preemption's block pool; allocated only when
    # preemption_mode is "swap". Pinned when the device is CUDA.
    swap_space: float
    # Host memory (GiB) for the prefix cache's second tier (vLLM's flag name): cached
    # blocks the device pool evicts are kept there and loaded back on a later hit.
    # 0 = off. Its own buffer, apart from swap_space (pinned when the device is CUDA).
    kv_offloading_size: float
    # The KV cache's element type, independent of the model's: "auto" = the model dtype.
    kv_cache_dtype: str
    # Attention sinks (StreamingLLM), opt-in: full-attention layers keep the first
    # attention_sinks tokens and the last streaming_window (None: off) tokens.
    attention_sinks: int = 0
    streaming_window: int | None = None
    # How the host pools (swap, host tier) keep blocks: "none" (as on the device), "int8" or
    # "int4" codes with a scale per token and kv head (worker/kv_compress.py).
    kv_host_compression: str = "none"
    # Free blocks held for each running request's growth, after its last block, so that its
    # table is a few runs of consecutive blocks (core/kv_cache_manager.py; 0: off). 8
    # measured best on the long workload (docs/architecture.md, Block placement).
    kv_growth_reserve_blocks: int = 8


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    # "fcfs" or "priority" (SLA class, then request priority, then arrival; with aging).
    scheduling_policy: str
    # "recompute" or "swap" (to the host pool of cache.swap_space; recompute when full).
    preemption_mode: str
    # Priority policy: a request ranks one SLA class better per this many seconds it
    # arrived before another (inf: no aging).
    aging_interval_s: float
    # Time-to-first-token target per SLA class (seconds): counted as met or missed in the
    # scheduler's stats; every class has one.
    sla_ttft_targets_s: dict[str, float]
    # Schedule step N+1 while step N runs (engine/step_pipeline.py).
    async_scheduling: bool = False
    # Most decode steps plain requests run in one engine step while nothing waits
    # (core/scheduler.py, decode bursts; 1: off).
    decode_burst: int = 1


@dataclass
class EngineConfig:
    """The engine's configuration in slices; built by `EngineArgs.create_engine_config()`,
    which holds every default."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    # How the engine reaches its workers (pagoda.worker.executor.EXECUTORS): "uni" = one
    # worker in this process.
    distributed_executor_backend: str
    # Speculative decoding (spec_decode/config.py); None: off.
    speculative: SpeculativeConfig | None = None

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
        if s.decode_burst < 1:
            raise ValueError(f"decode_burst must be >= 1, got {s.decode_burst}")
        if s.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {s.max_num_batched_tokens}"
            )
        m = self.model.max_model_len
        if m is not None and m < 1:
            raise ValueError(f"max_model_len must be >= 1, got {m}")
        self._validate_quantization()
        if c.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {c.attention_sinks}")
        if c.streaming_window is not None and c.streaming_window < 1:
            raise ValueError(f"streaming_window must be >= 1, got {c.streaming_window}")
        if c.attention_sinks and c.streaming_window is None:
            raise ValueError("attention_sinks needs streaming_window (the tokens kept after "
                             "the sinks)")
        if c.streaming_window is not None and self.speculative is not None:
            # NOTE: drafts are written past a row's tokens, which a growing stream lacks.
            raise ValueError("attention sinks (streaming_window) and speculative_config "
                             "cannot be combined yet")
        self._validate_preemption_and_policy()
        if s.async_scheduling and self.speculative is not None:
            # NOTE: the next step's drafts come from this step's tokens (see
            # engine/step_pipeline.py).
            raise ValueError("async_scheduling and speculative_config cannot be combined: "
                             "a step's draft tokens are only known once the step before "
                             "it has run")

    def _validate_quantization(self) -> None:
        q = self.model.quantization
        if q is not None and q not in quantization_methods():
            raise ValueError(f"quantization must be one of {quantization_methods()}, got {q!r}")
        if self.model.gguf_native not in GGUF_NATIVE_MODES:
            raise ValueError(f"gguf_native must be one of {list(GGUF_NATIVE_MODES)}, "
                             f"got {self.model.gguf_native!r}")

    def _validate_preemption_and_policy(self) -> None:
        c, s = self.cache, self.scheduler
        if not c.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {c.swap_space}")
        if not c.kv_offloading_size >= 0:
            raise ValueError(
                f"kv_offloading_size must be >= 0 GiB, got {c.kv_offloading_size}"
            )
        if c.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {c.kv_cache_dtype!r}"
            )
        if c.kv_growth_reserve_blocks < 0:
            raise ValueError(
                f"kv_growth_reserve_blocks must be >= 0, got {c.kv_growth_reserve_blocks}")
        if c.kv_host_compression not in HOST_COMPRESSIONS:
            raise ValueError(f"kv_host_compression must be one of {list(HOST_COMPRESSIONS)}, "
                             f"got {c.kv_host_compression!r}")
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


@dataclass
class EngineArgs:
    """Every engine option with its default, in one place: `pagoda generate/chat/serve`
    (`add_cli_args` / `from_cli_args`), `LLM(...)` and the server all build their
    `EngineConfig` from one of these. Flag names are the fields' (vLLM's names)."""

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = field(default_factory=default_max_num_seqs)
    max_num_batched_tokens: int = field(default_factory=default_max_num_batched_tokens)
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    device: str = "auto"
    attn_backend: str = "torch_paged"
    distributed_executor_backend: str = "uni"
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    kv_offloading_size: float = 0.0
    aging_interval_s: float = DEFAULT_AGING_INTERVAL_S
    # Classes not given keep DEFAULT_SLA_TTFT_TARGETS_S.
    sla_ttft_targets_s: dict[str, float] | None = None
    # Quantization (issue 11): see ModelConfig.quantization / gguf_native.
    quantization: str | None = None
    gguf_native: str = "auto"
    # Attention sinks (StreamingLLM): keep the first attention_sinks and the last
    # streaming_window tokens in full-attention layers (None: keep all).
    attention_sinks: int = 0
    streaming_window: int | None = None
    # kvquant: compressed KV blocks in the host pools (swap, host tier).
    kv_host_compression: str = "none"
    # Block placement: free blocks held after each running request's last one (0: off).
    kv_growth_reserve_blocks: int = 8
    # Speculative decoding, vLLM's form: a dict or its JSON text, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}.
    speculative_config: dict | str | None = None
    # async: schedule the next step (and detokenize the last) while a step's forward runs.
    async_scheduling: bool = False
    # While nothing waits, greedy requests in decode run up to this many decode steps per
    # engine step, in one extension call (1: off; see docs/architecture.md, "Decode bursts").
    decode_burst: int = 8
    # split (issue 10): `pagoda serve` runs the engine in a child process (the API server
    # keeps HTTP and tokenization); the server's only (LLM(...) runs in-process). On by
    # default since session 22 (docs/architecture.md, "Engine-core process").
    engine_process: bool = True

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        """Add one flag per field to `p`, defaulting to the field's default."""
        d = cls()
        bool_flag = argparse.BooleanOptionalAction
        p.add_argument("--model", default=d.model, help="HF directory or .gguf file "
                       "(default: the embedded SmolLM2-135M-Instruct GGUF)")
        p.add_argument("--dtype", default=d.dtype, choices=["auto", *_DTYPES])
        p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                       choices=list(KV_CACHE_DTYPES), help="the KV cache's element type "
                       "(auto: the model's dtype; fp8 = fp8_e4m3 and int8 store codes with a "
                       "scale per token and kv head)")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory_bytes", "num_gpu_blocks_override", "seed"):
            p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
        p.add_argument("--kv-growth-reserve-blocks", type=int,
                       default=d.kv_growth_reserve_blocks,
                       help="free KV blocks held after each running request's last block for "
                       "its growth, so that its blocks stay consecutive in memory and decode "
                       "attention streams them faster (0: off; reservations count as free "
                       "and are given up when nothing else is free)")
        p.add_argument("--gpu-memory-utilization", type=float,
                       default=d.gpu_memory_utilization)
        p.add_argument("--enable-prefix-caching", action=bool_flag,
                       default=d.enable_prefix_caching)
        p.add_argument("--enable-chunked-prefill", action=bool_flag,
                       default=d.enable_chunked_prefill)
        p.add_argument("--device", default=d.device)
        p.add_argument("--attn-backend", default=d.attn_backend)
        p.add_argument("--distributed-executor-backend", default=d.distributed_executor_backend,
                       help="uni: one worker in this process")
        p.add_argument("--scheduling-policy", default=d.scheduling_policy,
                       choices=sorted(SCHEDULING_POLICIES), help="priority: SLA class, then "
                       "request priority (lower first), then arrival, with aging")
        p.add_argument("--preemption-mode", default=d.preemption_mode,
                       choices=list(PREEMPTION_MODES))
        p.add_argument("--swap-space", type=float, default=d.swap_space,
                       help="GiB of host memory for swapped-out KV blocks (swap mode only)")
        p.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size,
                       help="GiB of host memory for the prefix cache's second tier: cached "
                       "blocks evicted from the KV cache are kept there and loaded back on a "
                       "later prefix hit (0: off)")
        p.add_argument("--kv-host-compression", default=d.kv_host_compression,
                       choices=list(HOST_COMPRESSIONS), help="how the host pools (swap, "
                       "prefix-cache host tier) keep KV blocks: none (as on the device), int8 "
                       "or int4 codes with a scale per token and kv head (more blocks per GiB, "
                       "a small accuracy cost when they come back)")
        p.add_argument("--aging-interval-s", type=float, default=d.aging_interval_s,
                       help="priority policy: a request ranks one SLA class better per this "
                       "many seconds it arrived before another")
        p.add_argument("--sla-ttft-target", dest="sla_ttft_targets_s", action="append",
                       default=None, metavar="CLASS=SECONDS", type=sla_seconds_arg,
                       help="time-to-first-token target of an SLA class (interactive, "
                       "async, batch); repeatable")
        p.add_argument("--quantization", default=d.quantization,
                       help="quantization method: by default the checkpoint's "
                       "(config.json quantization_config); int8 (W8A8), int8_wo (int8 "
                       "weight-only) and fp8 also quantize a dense checkpoint at load")
        p.add_argument("--gguf-native", default=d.gguf_native, choices=list(GGUF_NATIVE_MODES),
                       help="GGUF files: run Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K linears from their "
                       "blocks (on), dequantize them at load (off), or on where the device "
                       "has a native kernel (auto)")
        p.add_argument("--attention-sinks", type=int, default=d.attention_sinks,
                       help="StreamingLLM: tokens kept from the start of each sequence "
                       "(with --streaming-window)")
        p.add_argument("--streaming-window", type=int, default=d.streaming_window,
                       help="StreamingLLM: the last tokens kept; generation may then run "
                       "past max_model_len with bounded KV memory")
        p.add_argument("--speculative-config", default=d.speculative_config,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                       '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                       '"prompt_lookup_min": 2}\', \'{"method": "draft_model", '
                       '"model": PATH, "num_speculative_tokens": 4}\' or \'{"method": '
                       '"quantized_self_draft", "num_speculative_tokens": 4, '
                       '"quantization": "rtn"}\'')
        p.add_argument("--async-scheduling", action=bool_flag, default=d.async_scheduling,
                       help="schedule step N+1, and commit and detokenize step N - 1, while "
                       "step N's forward runs (the forward on a worker thread)")
        p.add_argument("--decode-burst", type=int, default=d.decode_burst,
                       help="while nothing waits, requests in decode that ask for no "
                       "logprobs (penalties, logit_bias, top-p/k and min-p run in the "
                       "kernel) take up to this many decode steps per engine step, "
                       "in one call: "
                       "the same tokens with less host work per token, streamed in chunks "
                       "of up to this many; with `pagoda serve` a request arriving "
                       "meanwhile ends the burst after its current step (1: off)")
        p.add_argument("--engine-process", action=bool_flag, default=d.engine_process,
                       help="serve: run the engine (model, scheduler, detokenization) in a "
                       "child process of its own, apart from the HTTP server's (the default; "
                       "--no-engine-process: on a thread of the server's process)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed by a parser given `add_cli_args`."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        if values["sla_ttft_targets_s"] is not None:
            values["sla_ttft_targets_s"] = dict(values["sla_ttft_targets_s"])
        return cls(**values)

    def create_engine_config(self) -> EngineConfig:
        """The validated EngineConfig; raises ValueError naming a bad field."""
        config = EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype,
                              max_model_len=self.max_model_len, seed=self.seed,
                              attn_backend=self.attn_backend, quantization=self.quantization,
                              gguf_native=self.gguf_native),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space=self.swap_space,
                kv_offloading_size=self.kv_offloading_size,
                kv_cache_dtype=self.kv_cache_dtype,
                attention_sinks=self.attention_sinks,
                streaming_window=self.streaming_window,
                kv_host_compression=self.kv_host_compression,
                kv_growth_reserve_blocks=self.kv_growth_reserve_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                scheduling_policy=self.scheduling_policy,
                preemption_mode=self.preemption_mode,
                aging_interval_s=self.aging_interval_s,
                sla_ttft_targets_s={**DEFAULT_SLA_TTFT_TARGETS_S,
                                    **(self.sla_ttft_targets_s or {})},
                async_scheduling=self.async_scheduling,
                decode_burst=self.decode_burst,
            ),
            device=self.device,
            distributed_executor_backend=self.distributed_executor_backend,
            speculative=SpeculativeConfig.parse(self.speculative_config),
        )
        config.validate()
        return config


def sla_seconds_arg(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name.strip(), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CLASS=SECONDS, got {text!r}") from None


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
