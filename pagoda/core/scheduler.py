"""The scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill/decode phases. Every request has `num_computed_tokens` catching up with
`num_tokens`; a step gives each chosen request up to the remaining budget of new tokens.
Chunked prefill, prefix-cache hits and recompute after preemption are all this one rule.

The waiting phase (admission, prefix hits and swap-ins, n > 1 forks, priority preemption
of a running request for a better waiting one) is core/admission.py's `WaitingAdmission`.

Commit: `update_from_output` runs once the step has returned. Only then are the blocks
the step's computed tokens filled registered in the prefix cache, and the sampled tokens
appended (one or more per request, with stop checks per token). A step that raises or is
interrupted is undone by `rollback_step` instead: nothing it allocated is registered, so
there is nothing to unregister.

Async scheduling (steps in flight): `schedule()` may run again before the last step is
committed. A request whose scheduled tokens reach its end will sample a token; until the
commit that token is a placeholder (`Request.num_output_placeholders`), and the next step
schedules the request's next position as if it were known (the runner feeds it from its
own input batch). Requests known to end with their placeholders (max_tokens,
max_model_len) are not scheduled further; one that stops otherwise (eos, a stop token or
string, an abort) has the extra step's token dropped at its commit, its blocks freed at
once. Safe because the worker runs the steps in order: the K/V a step writes is written
before anything a later step does, so the block accounting may run ahead of the forward;
only the prefix-cache registration waits for the step that wrote the blocks
(`num_tokens_in_flight`). A request preempted while its step ran keeps that step's
tokens (their computation was valid), so a seeded stream is not advanced twice.

Speculative decoding: a running request in decode carries draft tokens
(`Request.spec_token_ids`, from the runner's proposer). The step schedules 1 + k of its
tokens, k cut to the budget, to the request's max_tokens / max_model_len and to the
`DraftLengthPolicy`'s k for the step, and allocates slots for all of them. At commit the
runner's tokens are the accepted drafts plus one; `num_computed_tokens` drops back by the
rejected ones and blocks that only rejected tokens used are freed. Drafts are never in
`all_token_ids` before they are accepted, so no block hash (hence no prefix-cache entry)
ever covers a rejected token.

Decode bursts (`decode_burst` > 1): when nothing waits, no step is in flight,
speculative decoding is off and every running request is in decode,
`SamplingParams.burstable` (no logprobs) and past its min_tokens, they may run several
decode steps in one:
the step schedules each its one token as usual, allocates each slots for the same number
of tokens, up to `decode_burst` (cut to every request's max_tokens and max_model_len), and
names their stop tokens; the runner chooses the tokens one step after another in one call
and stops after a step in which a row chose a stop token. Where one request's slots are
refused, it and the rest take one token, and the runner declines the burst (it needs every
row's). At commit
`num_computed_tokens` moves on by the extra tokens computed, blocks past them go back, and
the tokens are appended with stop checks as any step's are. Only the host work between the
steps goes: the tokens are those of one step at a time. A burst may end early: the
serving loop raises the runner's interrupt flag when a request arrives or is aborted
(worker/burst_interrupt.py), and the burst stops after its decode step under way, so a
new request waits one decode step, not `decode_burst`.

Preemption (carried out by core/preemption.py, victims chosen by the policy in
core/request_queue.py):
- KV pressure while growing a running request: the policy's last running request (FCFS:
  the newest; priority: the lowest rank, newest among equals) gives its blocks back,
  inside the allocation retry loop. New requests are not admitted in that step.
- Priority policy only: a waiting request that outranks the policy's victim among the
  requests that were already running preempts it (core/admission.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping

from pagoda.core.admission import WaitingAdmission
from pagoda.core.hashing import update_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.preemption import Preemptor
from pagoda.core.request import DEFAULT_SLA_TTFT_TARGETS_S, Request, RequestStatus
from pagoda.core.request_queue import DEFAULT_AGING_INTERVAL_S, create_request_queue
from pagoda.core.scheduler_integrity import check_scheduler_integrity
from pagoda.core.scheduler_output import (  # NOTE: also imported from here by others
    CachedRequestData,
    EngineCoreOutput,
    SchedulerOutput,
    SchedulerStats,
)
from pagoda.spec_decode.adaptive import DraftLengthPolicy


class Scheduler(WaitingAdmission):
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        *,
        preemption_mode: str = "recompute",
        num_host_blocks: int = 0,
        aging_interval_s: float = DEFAULT_AGING_INTERVAL_S,
        sla_ttft_targets_s: Mapping[str, float] | None = None,
        stop_at_max_model_len: bool = True,
        draft_length_policy: DraftLengthPolicy | None = None,
        decode_burst: int = 1,
    ) -> None:
        self.kv = kv_cache_manager
        # NOTE: False with attention sinks: a stream may outgrow max_model_len.
        self.stop_at_max_model_len = stop_at_max_model_len
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(policy, aging_interval_s)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.preemptor = Preemptor(kv_cache_manager, preemption_mode, num_host_blocks)
        self.sla_ttft_targets_s = {**DEFAULT_SLA_TTFT_TARGETS_S, **(sla_ttft_targets_s or {})}
        self.sla_first_tokens: Counter[str] = Counter()
        self.sla_ttft_misses: Counter[str] = Counter()
        # Preemptions by the preempted request's SLA class (sums to num_preemptions).
        self.sla_preemptions: Counter[str] = Counter()
        # None: speculative decoding is off.
        self.draft_length_policy = draft_length_policy
        self._num_drafts_this_step = 0
        # Most decode steps plain requests may run in one step (1: no bursts).
        self.decode_burst = decode_burst
        # Steps scheduled and not yet committed or rolled back, by id(SchedulerOutput):
        # the output and its Request objects (a finished request's id may be reused by a
        # new one before the step that still ran it is committed).
        self._uncommitted: dict[int, tuple[SchedulerOutput, dict[str, Request]]] = {}

    @property
    def num_preemptions(self) -> int:
        return self.preemptor.num_preemptions

    @property
    def num_swaps(self) -> int:
        return self.preemptor.num_swaps

    # ---- admission and removal -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        update_block_hashes(request, self.block_size)
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Ends requests (abort, stop string, error) and frees their blocks, device and
        host, at once."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Take an unfinished `req` out of its queue and free it."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._free(req, status)

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.preemptor.free(req)
        self.finished_req_ids.add(req.req_id)
        # NOTE: preempted or rolled back since the last step, then ended: it will not come back.
        self.preempted_req_ids.discard(req.req_id)
        del self.requests[req.req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.waiting.order_running(self.running)
        if self.draft_length_policy is not None:
            k = self.draft_length_policy.num_drafts_for_step(
                len(self.running), [r.spec_acceptance for r in self.running])
            self._num_drafts_this_step = out.num_spec_tokens = k
        preempted = self._schedule_running(out)
        if not preempted:
            self._schedule_waiting(out)
        out.blocks_to_offload, out.blocks_to_onload = self.kv.end_step()
        self.preemptor.end_step()
        out.finished_req_ids, out.preempted_req_ids = self.finished_req_ids, self.preempted_req_ids
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        step_reqs = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = step_reqs[req_id] = self.requests[req_id]
            req.num_computed_tokens += n
            req.num_tokens_in_flight += n
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if req.num_computed_tokens - num_drafts == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # NOTE: the runner samples this step
        self._uncommitted[id(out)] = (out, step_reqs)
        return out

    def _num_new_tokens(self, req: Request) -> int:
        """The tokens running `req` can compute now: the rest of its tokens, including
        those the steps in flight will sample for it, unless those are known to end it."""
        num_known = req.num_tokens + req.num_output_placeholders
        if req.num_output_placeholders:
            params = req.sampling_params
            max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
            if req.num_output_tokens + req.num_output_placeholders >= max_tokens or (
                self.stop_at_max_model_len and num_known >= self.max_model_len
            ):
                return 0
        return num_known - req.num_computed_tokens

    def _schedule_running(self, out: SchedulerOutput) -> bool:
        preempted = False
        budget = self.max_num_batched_tokens
        step_burst = self._step_burst()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._num_new_tokens(req), budget)
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts_to_verify(req, n, budget)
            burst = step_burst
            while True:
                new_blocks = self.kv.allocate_slots(req, n + len(drafts) + burst - 1)
                if new_blocks is not None:
                    break
                if drafts or burst > 1:
                    # NOTE: drafts and bursts are optional: give them up before preempting.
                    # The rows before this one keep their slots for the burst, which the
                    # runner now declines (it needs every row's), and free them at commit.
                    drafts, burst = [], 1
                    step_burst = 1
                    continue
                # NOTE: preempt inside the retry loop: the policy's last running request
                # (not yet scheduled this step) gives its blocks back; if that is this
                # request, it waits for a later step.
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                break
            if drafts:
                out.scheduled_spec_decode_tokens[req.req_id] = drafts
                n += len(drafts)
            if burst > 1:
                out.decode_bursts[req.req_id] = (burst, self._stop_token_ids(req))
            out.scheduled_cached_reqs.append(
                CachedRequestData(req.req_id, self.kv.group_ids(new_blocks),
                                  req.num_computed_tokens,
                                  len(self.kv.get_block_ids(req.req_id)))
            )
            out.num_scheduled_tokens[req.req_id] = n
            out.total_num_scheduled_tokens += n
            budget -= n
            i += 1
        return preempted

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> list[int]:
        """The draft tokens `req` verifies this step: only in decode (its one new token
        is its last), at most the step's k and its own (by its acceptance rate), what the
        budget leaves, and one fewer than the tokens it may still produce (the step also
        emits one target token)."""
        if not req.spec_token_ids or n != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return []
        params = req.sampling_params
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        k = min(len(req.spec_token_ids), self._num_drafts_this_step, budget - 1,
                self.draft_length_policy.num_drafts_for_request(req.spec_acceptance),
                max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1)
        return req.spec_token_ids[:k] if k > 0 else []


    def _step_burst(self) -> int:
        """The decode steps every running request takes in this one (1: an ordinary step);
        see the module's note on decode bursts."""
        if (self.decode_burst <= 1 or not self.running or len(self.waiting)
                or self._uncommitted or self.draft_length_policy is not None
                or not self.stop_at_max_model_len):
            return 1
        steps = self.decode_burst
        for req in self.running:
            params = req.sampling_params
            if (req.num_output_placeholders or req.num_computed_tokens != req.num_tokens - 1
                    or not params.burstable or req.num_output_tokens < params.min_tokens):
                return 1
            max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
            steps = min(steps, max_tokens - req.num_output_tokens,
                        self.max_model_len - req.num_tokens)
        return max(1, steps)

    @staticmethod
    def _stop_token_ids(req: Request) -> list[int]:
        """The tokens `_check_stop` ends `req` on (past its min_tokens)."""
        params = req.sampling_params
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos and req.eos_token_id is not None:
            ids.add(req.eos_token_id)
        return sorted(ids)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Give `req`'s device blocks back (swap or recompute) and requeue it; the
        preemption counts against `req`'s SLA class."""
        req.spec_token_ids = []
        out.blocks_to_swap_out.extend(self.preemptor.preempt(req))
        self.sla_preemptions[req.sla_class] += 1
        self.finished_req_ids.add(req.req_id)
        self.preempted_req_ids.add(req.req_id)
        self.waiting.prepend(req)

    # ---- after the model ran ---------------------------------------------------------
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput  # noqa: F821
    ) -> list[EngineCoreOutput]:
        """Commit a step that returned: take back the rejected draft tokens, register the
        blocks its computed tokens filled, append each request's sampled tokens with stop
        checks per token (a stop discards the tokens after it), store the next drafts,
        free the requests that finished."""
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        draft_token_ids = runner_out.draft_token_ids
        _, step_reqs = self._uncommitted.pop(id(sched_out))
        for req_id, n in sched_out.num_scheduled_tokens.items():
            req = step_reqs[req_id]
            if req is not self.requests.get(req_id):
                continue  # NOTE: finished while the step ran: its tokens are dropped
            req.num_tokens_in_flight -= n
            token_ids = runner_out.sampled_token_ids.get(req_id)
            if token_ids:
                req.num_output_placeholders -= 1
            prompt_lps = runner_out.prompt_logprobs.get(req_id)
            if req.status == RequestStatus.RUNNING:
                drafts = sched_out.scheduled_spec_decode_tokens.get(req_id)
                if drafts:
                    self._reject_drafts(req, len(drafts), len(token_ids))
                burst = sched_out.decode_bursts.get(req_id)
                if burst is not None:
                    num_tokens = len(token_ids or ())
                    # NOTE: each token but the last was computed too (the next one's input).
                    req.num_computed_tokens += max(num_tokens - 1, 0)
                    if num_tokens < burst[0]:
                        self.kv.free_uncomputed_tail(req)
                # NOTE: the blocks of later steps in flight may not be written yet.
                self.kv.cache_blocks(req, req.num_computed_tokens - req.num_tokens_in_flight)
                req.spec_token_ids = draft_token_ids.get(req_id, [])
            if not token_ids:
                if prompt_lps is not None:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_lps))
                continue
            num_accepted, status = self._append_tokens(req, token_ids)
            if req.first_token_time is None:
                req.first_token_time = now
                self._observe_ttft(req, now)
            logprobs = runner_out.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    token_ids[:num_accepted],
                    new_logprobs=logprobs[:num_accepted] if logprobs is not None else None,
                    new_prompt_logprobs=prompt_lps,
                    finish_status=status,
                    stop_reason=req.stop_reason,
                )
            )
            if status is not None:
                # NOTE: a request preempted while the step ran ends from the waiting queue.
                self._finish(req, status)
        return outputs

    def _reject_drafts(self, req: Request, num_drafts: int, num_tokens: int) -> None:
        """`req` verified `num_drafts` drafts and got `num_tokens` tokens back (the
        accepted drafts plus one): its rejected drafts were not computed after all, and
        blocks only they used go back to the pool."""
        num_accepted = num_tokens - 1
        req.num_computed_tokens -= num_drafts - num_accepted
        self.kv.free_uncomputed_tail(req)
        req.spec_acceptance = self.draft_length_policy.observe(num_drafts, num_accepted,
                                                               req.spec_acceptance)

    def _append_tokens(
        self, req: Request, token_ids: list[int]
    ) -> tuple[int, RequestStatus | None]:
        """Append `token_ids` one at a time until one stops the request; returns how many
        were appended and the finish status (None: still running)."""
        status = None
        num_accepted = 0
        for token_id in token_ids:
            req.append_output_token_ids(token_id)
            num_accepted += 1
            status = self._check_stop(req)
            if status is not None:
                break
        update_block_hashes(req, self.block_size)
        return num_accepted, status

    def rollback_step(self, sched_out: SchedulerOutput) -> list[str]:
        """Undo a step whose execution raised or was interrupted (before its commit); returns
        the ids of the requests it ran. Those go back to the front of the waiting queue to
        be computed from scratch, holding no blocks (none of this step's blocks was
        registered, so no cache entry names unwritten K/V). Requests this step swapped out
        are demoted to recompute, and its host-tier offloads forgotten: their copies may
        not have happened. The runner is told to drop the batch state of every request the
        step touched (`finished_req_ids` of the next step) but to keep the generators of
        those that come back (`preempted_req_ids`): a seeded request continues its stream
        from its committed tokens. With several steps in flight, every uncommitted one is
        rolled back, newest first.
        """
        _, step_reqs = self._uncommitted.pop(id(sched_out))
        current = [req for req_id, req in step_reqs.items() if req is self.requests.get(req_id)]
        for req in current:
            # NOTE: every step in flight is rolled back: nothing of them will be committed.
            req.num_tokens_in_flight = req.num_output_placeholders = 0
        rolled_back = [req for req in current if req.status == RequestStatus.RUNNING]
        for req in rolled_back:
            self.running.remove(req)
            self._reset_to_scratch(req)
        self.waiting.requeue(rolled_back)
        for req_id in sched_out.finished_req_ids:
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.SWAPPED:
                self.waiting.remove(req)
                self._reset_to_scratch(req)
                self.waiting.prepend(req)
        self.kv.discard_offloads(sched_out.blocks_to_offload)
        self.finished_req_ids |= sched_out.finished_req_ids
        self.finished_req_ids.update(req.req_id for req in rolled_back)
        self.preempted_req_ids.update(r for r in sched_out.preempted_req_ids if r in self.requests)
        self.preempted_req_ids.update(req.req_id for req in rolled_back)
        return [req.req_id for req in rolled_back]

    def _reset_to_scratch(self, req: Request) -> None:
        """Free all `req` holds, device and host: it waits to be computed again."""
        self.preemptor.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED

    def _observe_ttft(self, req: Request, now: float) -> None:
        """Count a first token against its SLA class's TTFT target (arrival -> now)."""
        self.sla_first_tokens[req.sla_class] += 1
        if now - req.arrival_time > self.sla_ttft_targets_s[req.sla_class]:
            self.sla_ttft_misses[req.sla_class] += 1

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
        if req.num_output_tokens >= max_tokens or (
            self.stop_at_max_model_len and req.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- introspection ---------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        spec = self.draft_length_policy.counters if self.draft_length_policy else None
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            prefix_cache_host_hits=self.kv.prefix_cache_host_hits,
            host_tier_usage=self.kv.host_tier_usage,
            num_swaps=self.num_swaps,
            num_swapped=self.preemptor.num_swapped,
            host_cache_usage=self.preemptor.host_pool.usage if self.preemptor.host_pool else 0.0,
            sla_first_tokens=dict(self.sla_first_tokens),
            sla_ttft_misses=dict(self.sla_ttft_misses),
            sla_preemptions=dict(self.sla_preemptions),
            spec_decode_num_drafts=spec.num_drafts if spec else 0,
            spec_decode_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_decode_num_accepted_tokens_per_pos=(
                list(spec.num_accepted_tokens_per_pos) if spec else []),
        )

    def check_integrity(self) -> None:
        """Asserts the block accounting (device pool, prefix-cache host tier, swap host
        pool; every registered block computed) and that queues and the request map agree
        (core/scheduler_integrity.py). Between steps only."""
        check_scheduler_integrity(self)
