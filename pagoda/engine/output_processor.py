"""Turns the scheduler's per-step token outputs into RequestOutputs: detokenization, stop
strings, logprobs, and the fan-in of n > 1 samples into one parent request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagoda.core.request import DEFAULT_SLA_CLASS, RequestStatus
from pagoda.core.scheduler import EngineCoreOutput
from pagoda.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagoda.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries everything so far
    DELTA = "delta"  # only what is new since the last output (streaming)
    FINAL_ONLY = "final"  # one output, when the request finishes (offline generate)


@dataclass
class _Sample:
    index: int
    req_id: str
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    finish_sent: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        kind: OutputKind,
        arrival_time: float,
        sla_class: str = DEFAULT_SLA_CLASS,
    ) -> None:
        samples = []
        for i, child in enumerate(child_ids):
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                if params.detokenize
                else None
            )
            samples.append(
                _Sample(i, child, detok, logprobs=[] if params.logprobs is not None else None,
                        cumulative_logprob=0.0 if params.logprobs is not None else None)
            )
            self.child_to_parent[child] = (request_id, i)
        prompt_lps: list | None = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] * len(prompt_token_ids)
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, kind, samples,
            RequestMetrics(arrival_time=arrival_time, sla_class=sla_class), prompt_lps,
        )

    def remove(self, request_id: str) -> list[str]:
        """Forgets a request; returns its child ids that may still be in the scheduler."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for s in state.samples:
            self.child_to_parent.pop(s.req_id, None)
        return [s.req_id for s in state.samples if s.finish_reason is None]

    def process(
        self, core_outputs: list[EngineCoreOutput], scheduler
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs to hand out, child ids finished here by a stop string)."""
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for co in core_outputs:
            parent = self.child_to_parent.get(co.req_id)
            if parent is None:
                continue
            state = self.requests[parent[0]]
            sample = state.samples[parent[1]]
            self._absorb(state, sample, co, scheduler, stopped)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            out = self._make_output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                self.remove(state.request_id)
        return outputs, stopped

    def finish_aborted(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Marks every unfinished sample aborted; returns the final output, if any."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = reason
        out = self._make_output(state)
        self.remove(request_id)
        return out

    def _absorb(self, state: RequestState, sample: _Sample, co: EngineCoreOutput,
                scheduler, stopped: list[str]) -> None:
        req = scheduler.requests.get(co.req_id)
        if req is not None and state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = req.first_scheduled_time
            state.num_cached_tokens = max(req.num_cached_tokens, 0)
        if co.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, co.new_prompt_logprobs)
        if not co.new_token_ids:
            return
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.monotonic()
        new_token_ids, new_logprobs = co.new_token_ids, co.new_logprobs
        finish = co.finish_status
        if sample.detok is not None:
            num_before = sample.detok.num_output_tokens
            stop_str = sample.detok.update(new_token_ids, finish == RequestStatus.FINISHED_STOPPED)
            if stop_str is not None:
                # NOTE: the tokens after the one that completed the stop string (a step may
                # return several) are not part of the output.
                num_kept = sample.detok.num_output_tokens - num_before
                new_token_ids = new_token_ids[:num_kept]
                new_logprobs = new_logprobs[:num_kept] if new_logprobs is not None else None
                # NOTE: a stop string that completes on the step that also hits max_tokens
                # still cut the text, so it is the reason reported (as vLLM does); only a
                # request the scheduler has not finished yet must be stopped there.
                if finish is None:
                    stopped.append(co.req_id)
                finish, co.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        sample.token_ids.extend(new_token_ids)
        if new_logprobs is not None and sample.logprobs is not None:
            self._add_logprobs(sample, new_logprobs)
        if finish is not None:
            sample.finish_reason = finish.finish_reason
            sample.stop_reason = co.stop_reason
            state.metrics.finished_time = time.monotonic()
            if req is not None:
                state.metrics.num_preemptions = max(state.metrics.num_preemptions,
                                                    req.num_preemptions)

    def _add_logprobs(self, sample: _Sample, new_logprobs: list[tuple]) -> None:
        for ids, lps, rank in new_logprobs:
            entry = {ids[0]: Logprob(lps[0], rank, self._decode(ids[0]))}
            for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                entry.setdefault(tid, Logprob(lp, r, self._decode(tid)))
            sample.logprobs.append(entry)
            sample.cumulative_logprob += lps[0]

    def _add_prompt_logprobs(self, state: RequestState, chunk: tuple) -> None:
        first, ids, lps, ranks = chunk
        for j, (row_ids, row_lps, rank) in enumerate(zip(ids, lps, ranks)):
            entry = {row_ids[0]: Logprob(row_lps[0], rank, self._decode(row_ids[0]))}
            for r, (tid, lp) in enumerate(zip(row_ids[1:], row_lps[1:]), start=1):
                entry.setdefault(tid, Logprob(lp, r, self._decode(tid)))
            state.prompt_logprobs[first + j] = entry

    def _decode(self, token_id: int) -> str:
        return decode_token(self.tokenizer, token_id)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finished
        if state.kind is OutputKind.FINAL_ONLY and not finished:
            return None
        delta = state.kind is OutputKind.DELTA
        completions = []
        for s in state.samples:
            nothing_new = s.num_sent_tokens == len(s.token_ids) and (
                s.finish_reason is None or s.finish_sent
            )
            if delta and nothing_new:
                continue
            text = s.detok.get_next_output_text(s.finish_reason is not None, delta) if (
                s.detok is not None) else ""
            start = s.num_sent_tokens if delta else 0
            lp_start = s.num_sent_logprobs if delta else 0
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=s.token_ids[start:],
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=s.logprobs[lp_start:] if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
            s.num_sent_tokens = len(s.token_ids)
            s.finish_sent = s.finish_reason is not None
            s.num_sent_logprobs = len(s.logprobs) if s.logprobs is not None else 0
        if delta and not completions:
            return None
        prompt_lps = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_lps = None
        if prompt_lps is not None and (finished or delta):
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )
