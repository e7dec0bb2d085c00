"""The scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill/decode phases. Every request has `num_computed_tokens` catching up with
`num_tokens`; a step gives each chosen request up to the remaining budget of new tokens.
Chunked prefill, prefix-cache hits and recompute after preemption are all this one rule.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.core.hashing import update_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import create_request_queue
from pagoda.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: object
    # Prompt logprobs are wanted until the prompt has been computed once in full.
    want_prompt_logprobs: bool


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner knows: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests finished or preempted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    # (top ids [K+1], logprobs [K+1], rank of the sampled token) for the new token.
    new_logprobs: tuple[list[int], list[float], int] | None = None
    # (first prompt position, ids [N][K+1], logprobs [N][K+1], ranks [N])
    new_prompt_logprobs: tuple | None = None
    finish_status: RequestStatus | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- admission and removal -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        update_block_hashes(request, self.block_size)
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Ends requests (abort, stop string, error) and frees their blocks at once."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req, status)

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self.finished_req_ids.add(req.req_id)
        del self.requests[req.req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(out, budget)
        budget -= out.total_num_scheduled_tokens
        if not preempted:
            self._schedule_waiting(out, budget)
        out.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        for req_id, n in out.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                new_blocks = self.kv.allocate_slots(req, n)
                if new_blocks is not None:
                    break
                # NOTE: preempt inside the retry loop: the newest running request gives
                # its blocks back; if that is this request, it waits for a later step.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                break
            out.scheduled_cached_reqs.append(
                CachedRequestData(req.req_id, [b.block_id for b in new_blocks],
                                  req.num_computed_tokens)
            )
            out.num_scheduled_tokens[req.req_id] = n
            out.total_num_scheduled_tokens += n
            budget -= n
            i += 1
        return preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            # NOTE: prompt logprobs need logits at every prompt position, so such a request
            # skips the prefix cache until its prompt has been computed once in full.
            want_prompt_logprobs = (
                req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 0
            )
            computed_blocks, num_cached = (
                ([], 0) if want_prompt_logprobs else self.kv.get_computed_blocks(req)
            )
            n = req.num_tokens - num_cached
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            new_blocks = self.kv.allocate_slots(req, n, computed_blocks, num_cached)
            if new_blocks is None:
                break
            self.waiting.pop()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=req.req_id,
                    token_ids=list(req.all_token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    block_ids=self.kv.get_block_ids(req.req_id),
                    num_computed_tokens=num_cached,
                    sampling_params=req.sampling_params,
                    generator=req.generator,
                    want_prompt_logprobs=want_prompt_logprobs,
                )
            )
            out.num_scheduled_tokens[req.req_id] = n
            out.total_num_scheduled_tokens += n
            budget -= n

    def _preempt(self, req: Request) -> None:
        """Recompute-mode preemption: free everything; the request starts over later."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(req.req_id)
        self.waiting.prepend(req)

    # ---- after the model ran ---------------------------------------------------------
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput  # noqa: F821
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for req_id in sched_out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            token_id = runner_out.sampled_token_ids.get(req_id)
            prompt_lps = runner_out.prompt_logprobs.get(req_id)
            if token_id is None:
                if prompt_lps is not None:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_lps))
                continue
            req.append_output_token_ids(token_id)
            if req.first_token_time is None:
                req.first_token_time = now
            update_block_hashes(req, self.block_size)
            status = self._check_stop(req)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    [token_id],
                    new_logprobs=runner_out.logprobs.get(req_id),
                    new_prompt_logprobs=prompt_lps,
                    finish_status=status,
                    stop_reason=req.stop_reason,
                )
            )
            if status is not None:
                self.running.remove(req)
                self._free(req, status)
        return outputs

    def _check_stop(self, req: Request) -> RequestStatus | None:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if req.num_output_tokens >= max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- introspection ---------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
        )

    def check_integrity(self) -> None:
        """Asserts the block accounting and that queues and the request map agree."""
        self.kv.check_integrity()
        for req in self.running:
            assert req.status == RequestStatus.RUNNING, f"{req.req_id} in running as {req.status}"
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req.req_id
            assert not self.kv.get_block_ids(req.req_id), f"waiting {req.req_id} holds blocks"
        assert len(self.running) + len(self.waiting) == len(self.requests), "request map drift"
