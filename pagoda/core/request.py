"""One request's state inside the engine: the scheduler's only view of a sequence.

There are no prefill/decode phases: `num_computed_tokens` catches up with `num_tokens`
(prompt + outputs so far). A chunked prefill, a prefix-cache hit and a recompute after
preemption are all just different values of that counter.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > RequestStatus.PREEMPTED` means finished.

    SWAPPED: preempted with its KV copied to the host pool; it waits with
    `num_computed_tokens` kept. PREEMPTED: preempted by recompute (`num_computed_tokens` 0).
    """

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# SLA classes and their rank under the priority policy (lower is served first). NOTE: the
# default class is "interactive": a request that says nothing is assumed to have a user
# waiting on it, so existing clients keep today's order; throughput work opts into "async"
# (someone waits, but not at a keyboard) or "batch" (offline jobs).
SLA_CLASS_RANKS: dict[str, int] = {"interactive": 0, "async": 1, "batch": 2}
DEFAULT_SLA_CLASS = "interactive"
# Time-to-first-token targets per class, in seconds (configurable: a CPU is far slower).
DEFAULT_SLA_TTFT_TARGETS_S: dict[str, float] = {"interactive": 0.2, "async": 2.0, "batch": 60.0}

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Lower is served first (vLLM's convention); orders requests within an SLA class.
    priority: int = 0
    sla_class: str = DEFAULT_SLA_CLASS
    # NOTE: extra keys folded into this request's block hashes (e.g. a cache salt) so that
    # requests that must not share KV never hit each other's cached blocks.
    cache_salt: str | None = None
    # n > 1: the id of the group's first sample, whose computed prompt this sample forks
    # (shares) instead of computing it again; None for the first sample and n == 1.
    fork_of: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Async scheduling (several steps in flight): tokens this request was scheduled in
    # steps not yet committed (counted in num_computed_tokens, their K/V maybe unwritten),
    # and the sampled tokens those steps will return (not in all_token_ids yet). Both 0
    # between the steps of a synchronous engine.
    num_tokens_in_flight: int = 0
    num_output_placeholders: int = 0
    # Draft tokens the proposer guessed to follow all_token_ids (speculative decoding);
    # not part of the sequence until the step that verifies them accepts them.
    spec_token_ids: list[int] = field(default_factory=list)
    # This request's own per-draft acceptance rate (spec_decode/adaptive.py), None before
    # its first verification.
    spec_acceptance: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Hashes of this request's full blocks, filled in as blocks fill (prefix caching).
    block_hashes: list = field(default_factory=list)
    # Number of prompt tokens served from the prefix cache at first scheduling.
    num_cached_tokens: int = -1
    # Timestamps (time.monotonic) for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if self.sla_class not in SLA_CLASS_RANKS:
            raise ValueError(
                f"sla_class must be one of {list(SLA_CLASS_RANKS)}, got {self.sla_class!r}"
            )
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_num_tokens(self) -> int | None:
        """The most tokens (prompt + outputs) this request can reach, None if unbounded
        here (max_tokens None: the engine's length limit applies)."""
        max_tokens = self.sampling_params.max_tokens
        return None if max_tokens is None else self.num_prompt_tokens + max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
