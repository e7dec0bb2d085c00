"""The worker: owns the device, the model and its kernels, the KV tensors (one set per
`KVCacheSpec` group, plus the host buffers of swap and of the prefix cache's host tier),
the model runner and the RNG state (the global torch seed and the per-request generators,
which live in the runner).

Start-up order (driven by the executor): build -> `kv_cache_specs()` ->
`determine_num_blocks()` -> `initialize_kv_cache(...)` -> `execute_model(...)` per step.
"""

from __future__ import annotations

import gc
import logging

import torch

from pagoda.attention.backend import get_backend
from pagoda.config import (
    EngineConfig,
    available_memory_bytes,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from pagoda.core.kv_cache_spec import (
    KVCacheSpec,
    bytes_per_block,
    group_layers,
    retentions_for,
)
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.cpu_features import request_amx_tiles
from pagoda.models.factory import build_model
from pagoda.models.loader import Checkpoint
from pagoda.ops import gemm_dispatch
from pagoda.ops import registry as ops_registry
from pagoda.ops.cpu_kernels import load_extension
from pagoda.quant.gguf import prefers_bf16
from pagoda.spec_decode.proposer import ProposerContext, create_proposer
from pagoda.worker.block_copies import LayerCaches, swap_blocks
from pagoda.worker.burst_interrupt import BurstInterrupt
from pagoda.worker.host_alloc import huge_page_zeros
from pagoda.worker.kv_compress import host_layer_tensors, pool_format
from pagoda.worker.model_runner import ModelRunner, ModelRunnerOutput
from pagoda.worker.omp_team import omp_team_for

logger = logging.getLogger(__name__)

_CPU_KV_DEFAULT_CAP = 4 << 30


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        ckpt: Checkpoint,
        max_model_len: int,
        eos_token_ids: set[int],
    ) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if config.model.dtype == "auto" and prefers_bf16(
                ckpt, config.model.quantization, config.model.gguf_native, self.device):
            self.dtype = torch.bfloat16
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.checkpoint = ckpt  # NOTE: the quantized self-draft proposer reads it again
        torch.manual_seed(config.model.seed)
        if self.device.type == "cpu":
            # NOTE: before the first GEMM: a tile instruction without the permission faults.
            request_amx_tiles()
            # NOTE: build (or load the cached build of) the C++ kernels now, so the first
            # request does not pay the compile time.
            load_extension()
            # NOTE: once per process, before the model: which kernel wide bf16 GEMMs take.
            if self.dtype == torch.bfloat16:
                gemm_dispatch.configure()
        # NOTE: ops resolve their kernels once per engine (the environment may have changed
        # since an earlier engine in this process: PAGODA_DISABLE_CPU_KERNELS in tests).
        ops_registry.refresh()
        self.model = build_model(
            ckpt, self.dtype, self.device, max_model_len, config.model.attn_backend,
            config.model.quantization, config.model.gguf_native,
        )
        c = config.cache
        if c.streaming_window is not None:
            self.model.set_attention_sinks(c.attention_sinks, c.streaming_window)
        self.kv_caches: LayerCaches = []
        self.host_kv_caches: LayerCaches | None = None
        self.host_tier_kv_caches: LayerCaches | None = None
        self.runner: ModelRunner | None = None
        self.kv_formats = ("plain", "plain")  # (device, host pools): kv_compress.py
        # NOTE: made here, on the thread that runs the steps (OpenMP's count is per thread).
        self.omp_team = omp_team_for(self.device)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The model's layer groups, derived from its config, in the KV cache dtype."""
        spec = self.model.spec
        return group_layers(spec.sliding_windows, self.config.cache.block_size,
                            spec.num_kv_heads, spec.head_dim, self.kv_cache_dtype)

    def determine_num_blocks(self) -> int:
        """How many blocks the device KV cache gets: the memory budget over the bytes of one
        block in every group (or the configured override)."""
        c = self.config.cache
        per_block = bytes_per_block(self.kv_cache_specs())
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        if self.device.type == "cuda":
            # NOTE: an engine closed earlier in this process leaves its cache with PyTorch's
            # caching allocator, which mem_get_info counts as used: give it back first
            # (without this, a second LLM in one process got 0 blocks on an H200).
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * c.gpu_memory_utilization - (total - free)
        elif c.kv_cache_memory_bytes is not None:
            budget = c.kv_cache_memory_bytes
        else:
            # NOTE: more blocks than max_num_seqs full-length sequences can use only hold
            # prefix cache; don't take RAM for that by default.
            max_useful = self.config.scheduler.max_num_seqs * self.max_model_len
            # NOTE: + 1 for the reserved null block.
            useful = (-(-max_useful // c.block_size) + 1) * per_block
            budget = min(_CPU_KV_DEFAULT_CAP, available_memory_bytes() // 4, useful)
        return max(int(budget // per_block), 0)

    def initialize_kv_cache(
        self, num_blocks: int, num_swap_blocks: int | None, num_host_tier_blocks: int | None
    ) -> None:
        """Allocate the device cache (per group), the host buffers (None: none) and the
        runner over them."""
        specs = self.kv_cache_specs()
        compression = self.config.cache.kv_host_compression
        self.kv_formats = (pool_format(specs[0]), pool_format(specs[0], compression))
        self.kv_caches = allocate_kv_caches(specs, num_blocks, self.device, pin=False, zero=True)
        pin = self.device.type == "cuda"
        # NOTE: torch.empty for the host buffers: a block is written by a swap-out
        # (offload) before it is read, and untouched pages of a large pool are never
        # committed on the CPU.
        if num_swap_blocks is not None:
            self.host_kv_caches = allocate_kv_caches(specs, num_swap_blocks, None, pin,
                                                     zero=False, compression=compression)
        if num_host_tier_blocks is not None:
            self.host_tier_kv_caches = allocate_kv_caches(specs, num_host_tier_blocks, None,
                                                          pin, zero=False, compression=compression)
        s, c = self.config.scheduler, self.config.cache
        retentions = retentions_for(specs, c.attention_sinks, c.streaming_window)
        proposer = None
        if self.config.speculative is not None:
            proposer = create_proposer(self.config.speculative, ProposerContext(
                vocab_size=self.model.spec.vocab_size, device=self.device, dtype=self.dtype,
                max_model_len=self.max_model_len, max_num_seqs=s.max_num_seqs,
                block_size=self.config.cache.block_size, target_checkpoint=self.checkpoint,
                target_model=self.model))
        self.runner = ModelRunner(
            self.model, self.kv_caches, get_backend(self.config.model.attn_backend),
            self.config.cache.block_size, self.model.spec.vocab_size, self.eos_token_ids,
            self.device, self.dtype, max_num_reqs=s.max_num_seqs,
            max_model_len=self.max_model_len, max_num_batched_tokens=s.max_num_batched_tokens,
            kv_groups=[(r, spec.layer_ids) for r, spec in zip(retentions, specs, strict=True)],
            streaming=c.streaming_window is not None,
            proposer=proposer,
        )

    def supports_decode_burst(self) -> bool:
        """Whether the runner runs decode bursts (`ModelRunner.supports_decode_burst`)."""
        return self.runner.supports_decode_burst()

    def burst_interrupt(self) -> BurstInterrupt:
        """The flag that ends the runner's decode bursts early (worker/burst_interrupt.py)."""
        return self.runner.burst_interrupt

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The step's block copies, then its forward and sampling."""
        swap_blocks(out, self.kv_caches, self.host_kv_caches, self.host_tier_kv_caches,
                    *self.kv_formats)
        result = self.runner.execute_model(out)
        if self.omp_team is not None:
            self.omp_team.tick()
        return result


def allocate_kv_caches(
    specs: list[KVCacheSpec], num_blocks: int, device: torch.device | None, pin: bool,
    zero: bool,
    compression: str = "none",
) -> LayerCaches:
    """Per layer (in layer order) its group's tensors (`spec.layer_tensors()`, each with
    num_blocks in front: K, V and, quantized, their scales; a host pool's in its
    `compression` format: kv_compress.py); on `device` (None: the host)."""
    on_host = device is None or device.type == "cpu"

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if zero and on_host and not pin:
            return huge_page_zeros(shape, dtype)  # read at random: host_alloc.py
        alloc = torch.zeros if zero else torch.empty
        return alloc(shape, dtype=dtype, device=device, pin_memory=pin)

    by_layer: dict[int, tuple[torch.Tensor, ...]] = {}
    for spec in specs:
        for layer in spec.layer_ids:
            by_layer[layer] = tuple(
                make((num_blocks, *shape), dtype)
                for shape, dtype in host_layer_tensors(spec, compression)
            )
    return [by_layer[i] for i in range(len(by_layer))]
