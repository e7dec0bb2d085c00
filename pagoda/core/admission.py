"""The scheduler's waiting phase: admitting waiting requests into the step's budget.

The head of the policy's queue is admitted while the budget, `max_num_seqs` and the blocks
allow: a prefix-cache hit (device, then host tier) or a swap-in first, then its new tokens
(fewer than remain: chunked prefill). Under the priority policy a waiting request that
outranks the policy's victim among the requests already running preempts it when
`max_num_seqs` is reached or the blocks run out; the victim's work of this step is undone
(it was scheduled in the running phase), its tokens go back to the budget, and nothing of
it was registered.

n > 1: the later samples of a request wait until its first sample has computed the
prompt, then fork from it (shared full blocks, a copy of the partly filled last one).
A waiting sample is skipped past: the requests behind it are admitted meanwhile.

`WaitingAdmission` is a part of `Scheduler` (core/scheduler.py), split out by concept: its
methods read and change the scheduler's queues, block manager and step output.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.preemption import Preemptor
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import RequestQueue
from pagoda.core.scheduler_output import NewRequestData, SchedulerOutput

_WAIT_FOR_PARENT = object()  # a forked sample's parent is still computing the prompt


class WaitingAdmission:
    """The waiting phase of `Scheduler.schedule()` (see the module docstring)."""

    kv: KVCacheManager
    preemptor: Preemptor
    waiting: RequestQueue
    running: list[Request]
    requests: dict[str, Request]
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    _preempt: Callable[[Request, SchedulerOutput], None]  # Scheduler's, shared with running

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        now = time.monotonic()
        admitted: set[str] = set()
        preempted: set[str] = set()
        skipped: list[Request] = []
        while len(self.waiting):
            budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
            req = self.waiting.peek()
            # NOTE: a request preempted in this step waits for the next one: admitting it
            # again at once would only copy or recompute what was just given up.
            if budget <= 0 or req.req_id in preempted:
                break
            if self._fork_parent(req, self._wants_prompt_logprobs(req)) is _WAIT_FOR_PARENT:
                # NOTE: taken out of the queue for this pass only, so that the requests
                # behind it are not held up by a wait that is not theirs.
                skipped.append(self.waiting.pop())
                continue
            if len(self.running) >= self.max_num_seqs:
                if self._preempt_for(req, out, admitted, preempted):
                    continue
                break
            n = self._admit(req, budget, out, now)
            if n == 0:
                break
            if n is None:
                if self._preempt_for(req, out, admitted, preempted):
                    continue
                break
            admitted.add(req.req_id)
        self.waiting.requeue(skipped)

    def _admit(self, req: Request, budget: int, out: SchedulerOutput, now: float) -> int | None:
        """Move the waiting head `req` to running with up to `budget` new tokens; returns
        that count, 0 if its prompt would have to be split with chunked prefill off, or
        None if the blocks are short (no change in any case). Not for a sample that waits
        to fork from its group's first one.
        """
        want_prompt_logprobs = self._wants_prompt_logprobs(req)
        parent = self._fork_parent(req, want_prompt_logprobs)
        if parent is not None:
            return self._admit_fork(req, parent, budget, out, now)
        if req.status == RequestStatus.SWAPPED:
            computed_blocks, num_computed = [], req.num_computed_tokens
        elif want_prompt_logprobs:
            computed_blocks, num_computed = [], 0
        else:
            computed_blocks, num_computed = self.kv.get_computed_blocks(req)
        n = req.num_tokens - num_computed
        if n > budget:
            if not self.enable_chunked_prefill:
                return 0
            n = budget
        if req.status == RequestStatus.SWAPPED:
            swapped_in = self.preemptor.swap_in(req, n)
            if swapped_in is None:
                return None
            out.blocks_to_swap_in.extend(swapped_in[1])
        else:
            if self.kv.allocate_slots(req, n, computed_blocks, num_computed) is None:
                return None
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.num_computed_tokens = num_computed
        return self._start_running(req, n, num_computed, want_prompt_logprobs, out, now)

    def _start_running(
        self, req: Request, n: int, num_computed: int, want_prompt_logprobs: bool,
        out: SchedulerOutput, now: float,
    ) -> int:
        """Move the waiting head `req` (its blocks allocated) to running with `n` tokens."""
        self.waiting.pop()
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled_new_reqs.append(
            NewRequestData(
                req_id=req.req_id,
                token_ids=list(req.all_token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                # NOTE: a snapshot: the live lists grow at the next schedule(), which
                # may run before this step's runner reads them (async scheduling).
                block_ids=tuple(list(ids) for ids in self.kv.get_group_block_ids(req.req_id)),
                num_computed_tokens=num_computed,
                sampling_params=req.sampling_params,
                want_prompt_logprobs=want_prompt_logprobs,
            )
        )
        out.num_scheduled_tokens[req.req_id] = n
        out.total_num_scheduled_tokens += n
        return n

    @staticmethod
    def _wants_prompt_logprobs(req: Request) -> bool:
        # NOTE: prompt logprobs need logits at every prompt position, so such a request
        # skips the prefix cache until its prompt has been computed once in full.
        return req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 0

    def _fork_parent(self, req: Request, want_prompt_logprobs: bool) -> Request | None | object:
        """For a later sample of an n > 1 request that has not started: its group's first
        sample if that one runs with its prompt computed (fork from it), _WAIT_FOR_PARENT
        while that one is still computing its prompt, else None (admit as usual)."""
        if req.fork_of is None or req.num_output_tokens or req.num_preemptions:
            return None
        if not self.kv.supports_fork:
            return None
        if want_prompt_logprobs or req.status != RequestStatus.WAITING:
            return None
        parent = self.requests.get(req.fork_of)
        if parent is None or parent.status != RequestStatus.RUNNING:
            return None
        if parent.num_computed_tokens < req.num_prompt_tokens:
            # NOTE: it progresses every step it runs, so this wait always ends.
            return _WAIT_FOR_PARENT
        return parent

    def _admit_fork(
        self, req: Request, parent: Request, budget: int, out: SchedulerOutput, now: float
    ) -> int | None:
        """Admit `req` sharing `parent`'s computed prompt but its last token, which it
        computes itself for its own first sample; None if the blocks are short."""
        if budget < 1:
            return 0
        num_shared = req.num_prompt_tokens - 1
        copies = self.kv.fork(parent, req, num_shared)
        if copies is None:
            return None
        req.num_computed_tokens = num_shared
        if self.kv.allocate_slots(req, 1) is None:
            self.kv.free(req)
            req.num_computed_tokens = 0
            return None
        out.blocks_to_copy.extend(copies)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_shared
        return self._start_running(req, 1, num_shared, False, out, now)

    def _preempt_for(
        self, req: Request, out: SchedulerOutput, admitted: set[str], preempted: set[str]
    ) -> bool:
        """Preempt the policy's victim among the requests that ran before this waiting
        phase if waiting `req` outranks it (never under FCFS); whether one was preempted.
        """
        candidates = (
            [r for r in self.running if r.req_id not in admitted] if admitted else self.running
        )
        if not candidates:
            return False
        victim = self.waiting.pick_victim(candidates)
        if not self.waiting.outranks(req, victim):
            return False
        # NOTE: the victim was scheduled in the running phase of this step: undo that
        # before its blocks go (its num_computed_tokens only advances at the end, and its
        # blocks are only registered at commit, so nothing else needs undoing).
        n = out.num_scheduled_tokens.pop(victim.req_id, 0)
        out.scheduled_spec_decode_tokens.pop(victim.req_id, None)
        if n:
            out.total_num_scheduled_tokens -= n
            out.scheduled_cached_reqs = [
                c for c in out.scheduled_cached_reqs if c.req_id != victim.req_id
            ]
        self.running.remove(victim)
        self._preempt(victim, out)
        preempted.add(victim.req_id)
        return True
