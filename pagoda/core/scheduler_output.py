"""The scheduler's messages: to the runner (diffs of per-request state plus KV block copies),
back from a step (per-request outputs), and the statistics it exposes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.core.request import RequestStatus
from pagoda.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen, or must rebuild after preemption (from scratch
    after recompute; with its KV swapped back in and num_computed_tokens kept after swap)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]  # one block table per KV cache group
    num_computed_tokens: int
    sampling_params: SamplingParams  # the runner makes the generator from its seed
    # Prompt logprobs are wanted until the prompt has been computed once in full.
    want_prompt_logprobs: bool


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner knows: only what changed."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV cache group, as many in each
    num_computed_tokens: int
    # The table's length once new_block_ids are appended; None: nothing was freed since
    # the last step. Shorter than the runner's table plus new_block_ids when blocks that
    # only rejected draft tokens used were freed: the runner cuts its table first.
    num_blocks: int | None = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests finished or preempted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Those of finished_req_ids that were preempted or rolled back: they come back as new
    # requests later, so the runner keeps their generators (a seeded stream resumes where
    # its committed tokens leave it).
    preempted_req_ids: set[str] = field(default_factory=set)
    # KV block copies the runner performs before the forward, every device -> host copy
    # before any host -> device one. Swap preemption's pool: (device block, host block)
    # and (host block, device block). The prefix cache's host tier: evicted cached blocks
    # (device block, host slot) and host hits (host slot, device block).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_onload: list[tuple[int, int]] = field(default_factory=list)
    # Copy-on-write within the device cache (src block, dst block): a forked sample's copy
    # of the partly filled block it shared; done after the device -> host copies.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens this step verifies per request (their count
    # is part of num_scheduled_tokens: 1 + k), and how many the proposer should guess for
    # the next step (0: none).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens: int = 0
    # Decode bursts: plain requests (greedy, or a temperature only) in decode may run up to
    # `steps` decode steps in this one (each its one scheduled token, then each token it
    # chooses), their slots allocated for all of them; the burst stops after a step in
    # which a row chose a token of its `stop_ids`, and runs only where every row of the
    # step has the same `steps`.
    # req_id -> (steps, stop_ids).
    decode_bursts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    # Per new token, aligned with new_token_ids: (top ids [K+1], logprobs [K+1], rank of
    # the sampled token); None when the request wants no logprobs.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
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
    # Preemptions that swapped (a subset of num_preemptions); requests swapped out now;
    # fraction of host blocks in use.
    num_swaps: int = 0
    num_swapped: int = 0
    host_cache_usage: float = 0.0
    # Prompt tokens loaded from the prefix cache's host tier (a part of prefix_cache_hits,
    # counted by the same rule); fraction of its slots holding a block.
    prefix_cache_host_hits: int = 0
    host_tier_usage: float = 0.0
    # Per SLA class: first tokens so far, and how many came later than the class's target.
    sla_first_tokens: dict[str, int] = field(default_factory=dict)
    sla_ttft_misses: dict[str, int] = field(default_factory=dict)
    # Per SLA class: preemptions of requests of that class (sums to num_preemptions).
    sla_preemptions: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (vLLM's counters): verification rows with drafts, draft tokens
    # verified, drafts accepted, and accepted drafts by their position in the draft.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
