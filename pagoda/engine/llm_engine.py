"""The synchronous engine: requests in, one scheduler step at a time, RequestOutputs out.

API -> engine (tokenize, validate, fan out n samples) -> scheduler -> executor (-> worker ->
runner -> model) -> scheduler update -> output processor (detokenize, stop strings,
logprobs) -> outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_cache_spec import (
    KVCacheSpec,
    bytes_per_block,
    max_blocks_held,
    retentions_for,
)
from pagoda.core.request import DEFAULT_SLA_CLASS, SLA_CLASS_RANKS, Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerStats
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.engine.gc_heap import frozen_heap
from pagoda.engine.output_processor import OutputKind, OutputProcessor
from pagoda.engine.sigint import sigint_deferred
from pagoda.engine.step_pipeline import StepPipeline
from pagoda.models.loader import load_checkpoint
from pagoda.omp_env import apply_openmp_defaults
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.adaptive import DraftLengthPolicy, costs_for_method
from pagoda.worker.burst_interrupt import BurstInterrupt
from pagoda.worker.executor import get_executor_class
from pagoda.worker.kv_compress import host_bytes_per_block
from pagoda.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
MAX_LOGPROBS = 20


class LLMEngine:
    """Scheduling and outputs; the model runs behind `self.executor`."""

    # NOTE: loading makes and drops many objects (the GGUF reader's fields: about a million
    # views); the full collections that triggers walk the imported modules too, unless they
    # are frozen (LLM() of the embedded model 5.5 -> 5.1 s).
    @frozen_heap()
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        # NOTE: effective in this process only if torch is not loaded yet (the entrypoints
        # call it first); child processes inherit it either way.
        apply_openmp_defaults()
        self.config = config
        executor_class = get_executor_class(config.distributed_executor_backend)
        ckpt = load_checkpoint(config.model.model)
        self.model_path = str(ckpt.path)
        self.tokenizer = ckpt.tokenizer
        hf = ckpt.hf_config
        self.hf_config = hf
        self.generation_config = ckpt.generation_config
        # Parent ids of the requests the last step ran if it failed (see `step`).
        self.failed_request_ids: list[str] = []
        self.max_model_len = self._max_model_len(int(hf.max_position_embeddings))
        # NOTE: attention sinks keep rotary positions inside the cache (S + W tokens), so
        # generation may run past max_model_len; only the prompt is bounded by it.
        self.streaming = config.cache.streaming_window is not None
        if self.streaming and (
            config.cache.attention_sinks + config.cache.streaming_window > self.max_model_len
        ):
            raise ValueError(
                f"attention_sinks + streaming_window ({config.cache.attention_sinks} + "
                f"{config.cache.streaming_window}) exceeds max_model_len {self.max_model_len}"
            )
        self.vocab_size = int(hf.vocab_size)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.extra_stop_ids = _generation_eos_ids(ckpt.generation_config) - {self.eos_token_id}
        eos_ids = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.executor = executor_class(config, ckpt, self.max_model_len,
                                       eos_ids | self.extra_stop_ids)
        self.kv_cache_specs = self.executor.kv_cache_specs()
        self.kv_block_bytes = bytes_per_block(self.kv_cache_specs)
        # NOTE: the host pools may keep blocks compressed (--kv-host-compression).
        self.host_block_bytes = host_bytes_per_block(self.kv_cache_specs,
                                                     config.cache.kv_host_compression)
        block_size = _shared_block_size(self.kv_cache_specs)
        self.kv_retentions = retentions_for(self.kv_cache_specs, config.cache.attention_sinks,
                                            config.cache.streaming_window)
        self.num_blocks = self._check_num_blocks(self.executor.determine_num_blocks(),
                                                 block_size)
        s = config.scheduler
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            block_size,
            enable_caching=config.cache.enable_prefix_caching,
            num_host_tier_blocks=self._num_host_tier_blocks(),
            retentions=self.kv_retentions,
            growth_reserve_blocks=config.cache.kv_growth_reserve_blocks,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=s.enable_chunked_prefill,
            policy=s.scheduling_policy,
            preemption_mode=s.preemption_mode,
            num_host_blocks=self._num_host_blocks(),
            aging_interval_s=s.aging_interval_s,
            sla_ttft_targets_s=s.sla_ttft_targets_s,
            stop_at_max_model_len=not self.streaming,
            draft_length_policy=None if config.speculative is None else DraftLengthPolicy(
                config.speculative.num_speculative_tokens, config.speculative.adaptive,
                costs_for_method(config.speculative.method, self._draft_depth(config))),
        )
        swap_pool = self.scheduler.preemptor.host_pool
        host_tier = self.kv_cache_manager.host_tier
        self.executor.initialize_kv_cache(
            self.num_blocks,
            None if swap_pool is None else swap_pool.num_blocks,
            None if host_tier is None else host_tier.num_slots,
        )
        # NOTE: with steps in flight or drafts the scheduler never bursts anyway.
        # burst_interrupt: what a serving loop raises to end a burst when a command comes
        # (engine_core.py); None where no burst runs.
        self.burst_interrupt: BurstInterrupt | None = None
        if (s.decode_burst > 1 and not s.async_scheduling and config.speculative is None
                and self.executor.supports_decode_burst()):
            self.scheduler.decode_burst = s.decode_burst
            self.burst_interrupt = self.executor.burst_interrupt()
        self.output_processor = OutputProcessor(self.tokenizer)
        # None: one step at a time (the default); else async scheduling.
        self.pipeline = StepPipeline(self.scheduler, self.executor) if (
            s.async_scheduling) else None

    def _max_model_len(self, model_max: int) -> int:
        max_model_len = self.config.model.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {model_max}"
            )
        s = self.config.scheduler
        if not s.enable_chunked_prefill and s.max_num_batched_tokens < max_model_len:
            # NOTE: without chunking a prompt is scheduled whole; a longer one than the
            # budget would wait forever.
            raise ValueError(
                f"max_num_batched_tokens {s.max_num_batched_tokens} is smaller than "
                f"max_model_len {max_model_len} with chunked prefill disabled: raise "
                "max_num_batched_tokens, lower max_model_len or enable chunked prefill"
            )
        return max_model_len

    def _check_num_blocks(self, num_blocks: int, block_size: int) -> int:
        # NOTE: block 0 is the reserved null block (core/block_pool.py): not for tokens.
        num_usable = max(num_blocks - 1, 0)
        s = self.config.scheduler
        chunk = s.max_num_batched_tokens if s.enable_chunked_prefill else self.max_model_len
        # NOTE: a request of max_model_len tokens must fit in every group at once; a
        # windowed group holds only its window (and the step's chunk).
        needed = sum(max_blocks_held(r, self.max_model_len, chunk, block_size)
                     for r in self.kv_retentions)
        if needed > num_usable:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit in the KV cache "
                f"({num_usable} usable blocks of {block_size} tokens); the largest "
                f"max_model_len that fits is {num_usable * block_size}: lower max_model_len "
                f"or give the cache more memory (kv_cache_memory_bytes / "
                f"gpu_memory_utilization)"
            )
        return num_blocks

    def _draft_depth(self, config: EngineConfig) -> float:
        """A self-draft's layers over the target's (1: a draft as deep as the target)."""
        layers = config.speculative.num_layers
        if layers is None:
            return 1.0
        return min(layers / int(self.hf_config.num_hidden_layers), 1.0)

    def _num_host_blocks(self) -> int:
        """Swap preemption's host pool size: `swap_space` GiB, only in swap mode."""
        if self.config.scheduler.preemption_mode != "swap":
            return 0
        return int(self.config.cache.swap_space * (1 << 30)) // self.host_block_bytes

    def _num_host_tier_blocks(self) -> int:
        """The prefix cache's host tier size: `kv_offloading_size` GiB (0: no tier)."""
        size = self.config.cache.kv_offloading_size
        if size <= 0:
            return 0
        num_blocks = int(size * (1 << 30)) // self.host_block_bytes
        if num_blocks == 0:
            logger.warning("kv_offloading_size %s GiB holds no KV block (%d bytes): the "
                           "host tier is off", size, self.host_block_bytes)
        return num_blocks

    # ---- requests ---------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, token ids or a dict, got {type(prompt)}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        cache_salt: str | None = None,
        sla_class: str = DEFAULT_SLA_CLASS,
    ) -> None:
        """Validates and queues a request; raises ValueError naming the problem."""
        params = params or SamplingParams()
        if sla_class not in SLA_CLASS_RANKS:
            raise ValueError(f"sla_class must be one of {list(SLA_CLASS_RANKS)}, got {sla_class!r}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        params = self._validate(token_ids, params)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        child_ids = [request_id] if params.n == 1 else [
            f"{request_id}#{i}" for i in range(params.n)
        ]
        # NOTE: every Request is built before anything is registered, so a refused one
        # leaves nothing behind.
        requests = []
        for i, child in enumerate(child_ids):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # NOTE: each sample gets its own stream; seed + i keeps them reproducible.
                child_params = params.clone()
                child_params.seed = params.seed + i
            requests.append(
                Request(
                    req_id=child,
                    fork_of=child_ids[0] if i > 0 else None,
                    prompt_token_ids=token_ids,
                    sampling_params=child_params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival_time,
                    priority=priority,
                    sla_class=sla_class,
                    cache_salt=cache_salt,
                )
            )
        self.output_processor.add_request(
            request_id, text, token_ids, params, child_ids, output_kind, arrival_time, sla_class
        )
        for req in requests:
            self.scheduler.add_request(req)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary (size {self.vocab_size})"
            )
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, which leaves no room to generate within "
                f"max_model_len {self.max_model_len}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {k}")
        # NOTE: an out-of-vocabulary logit_bias id would otherwise fail inside the sampler,
        # mid-step, and take the whole batch down with it.
        params.verify_token_ids(self.vocab_size)
        if params.max_tokens is None or self.extra_stop_ids:
            params = params.clone()
            if params.max_tokens is None:
                params.max_tokens = self.max_model_len - n
            if self.extra_stop_ids and not params.ignore_eos:
                params.stop_token_ids = sorted(set(params.stop_token_ids) | self.extra_stop_ids)
        if n + params.max_tokens > self.max_model_len and not self.streaming:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        return params

    def abort_request(self, request_ids: str | Iterable[str],
                      reason: str = "abort") -> list[RequestOutput]:
        """Aborts requests (unknown ids are ignored); frees their KV blocks at once. Their
        unfinished samples end with `reason` ("abort", or "timeout" at a deadline)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            children = [s.req_id for s in self.output_processor.requests[rid].samples] if (
                rid in self.output_processor.requests) else []
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.finish_aborted(rid, reason)
            if out is not None:
                outputs.append(out)
        return outputs

    @property
    def device(self) -> torch.device:
        return self.executor.device

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or (async scheduling) steps in flight to commit."""
        return self.scheduler.has_unfinished_requests() or bool(
            self.pipeline is not None and self.pipeline.in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and commit one step.

        If execution raises or is interrupted (KeyboardInterrupt), the step is rolled back
        (`Scheduler.rollback_step`) and the exception re-raised: its requests wait to be
        computed again, holding no blocks, and `failed_request_ids` names them (parent
        ids), for the caller to abort or retry. A Ctrl-C that arrives while the scheduler
        or the output processor is updating its state is held until that update is done,
        so an interrupt always finds the engine consistent (one held past the commit is
        raised after it, and that step's outputs are dropped).

        Async scheduling: commits the oldest step in flight, the next one already
        submitted (engine/step_pipeline.py); a failure rolls back every step in flight.
        """
        self.failed_request_ids = []
        if self.pipeline is None:
            sched_out, runner_out = self._execute_step()
        else:
            try:
                sched_out, runner_out = self.pipeline.next_result()
            except BaseException:
                with sigint_deferred():
                    self._note_failed(self.pipeline.roll_back())
                raise
        with sigint_deferred():
            if self.pipeline is not None:
                self.pipeline.pop_oldest()
            core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
            outputs, stopped = self.output_processor.process(core_outputs, self.scheduler)
            if stopped:
                self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _execute_step(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Schedule one step and run it; rolled back if the run raises."""
        sched_out = None
        try:
            with sigint_deferred():
                sched_out = self.scheduler.schedule()
            return sched_out, self.executor.execute_model(sched_out)
        except BaseException:
            if sched_out is None:  # NOTE: schedule() itself raised: nothing ran.
                raise
            with sigint_deferred():
                self._note_failed(self.scheduler.rollback_step(sched_out))
            raise

    def _note_failed(self, failed: list[str]) -> None:
        parents = self.output_processor.child_to_parent
        self.failed_request_ids = list(dict.fromkeys(parents[r][0] for r in failed
                                                     if r in parents))

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def _shared_block_size(specs: list[KVCacheSpec]) -> int:
    """The block size of every group: the manager keeps one block table per request."""
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"KV cache groups with different block sizes {sorted(sizes)} need a "
                         "manager per group, which pagoda does not have yet")
    return sizes.pop()


def _generation_eos_ids(generation_config: dict) -> set[int]:
    eos = generation_config.get("eos_token_id")
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
