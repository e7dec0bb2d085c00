"""How many draft tokens to verify per request this step, and the acceptance counters.

The rule (adaptive k). With a per-draft acceptance rate a, verifying k drafts yields on
average E(k) = (1 - a^(k+1)) / (1 - a) tokens per request per step, and a step with B
speculating requests costs about t(B, k) = t0 + t1 * B * (k + 1) (a fixed part, weights
read once, plus a part per token in the batch). The step's yield per unit time,
B * E(k) / t(B, k), is maximised over k in [0, num_speculative_tokens]; k = 0 when no k
beats plain decoding. A single stream (t1 * B small against t0) therefore speculates as
far as the acceptance rate pays for, and a large batch, whose forward cost grows with
every token, stops speculating. The acceptance rate is an exponential moving average over
verified drafts; while the rule says 0 at a low rate, one step in `PROBE_INTERVAL`
speculates with k = 1 so that the estimate can recover.

TOKEN_COST_RATIO = t1 / t0, measured by `pagoda bench spec` (its decode step-time fit over
1716 steps without a prefill, SmolLM2-135M bf16, batches of 1-80 tokens) on this machine,
AMD EPYC, 2 CPUs shared with other jobs: t0 = 271 ms, t1 = 6.0 ms per token, 0.022. With
it, at acceptance 0.8 a single stream verifies 4 drafts, 16 streams 3, 64 streams 1; at 0.5:
4, 1 and 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TOKEN_COST_RATIO = 0.022
PROBE_INTERVAL = 16
_EMA_WEIGHT = 0.1
_PRIOR_ACCEPTANCE = 0.6


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens emitted per verification of k drafts at per-draft acceptance a."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_num_drafts(acceptance: float, num_reqs: int, max_k: int,
                    token_cost_ratio: float = TOKEN_COST_RATIO) -> int:
    """The k in [0, max_k] maximising num_reqs * E(k) / (1 + ratio * num_reqs * (k + 1))."""
    def rate(k: int) -> float:
        return expected_tokens(acceptance, k) / (1.0 + token_cost_ratio * num_reqs * (k + 1))

    return max(range(max_k + 1), key=lambda k: (rate(k), -k))


@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters, cumulative."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class DraftLengthPolicy:
    """The scheduler's choice of k per step (see the module docstring) and the counters."""

    def __init__(self, num_speculative_tokens: int, adaptive: bool = True) -> None:
        self.max_k = num_speculative_tokens
        self.adaptive = adaptive
        self.acceptance = _PRIOR_ACCEPTANCE
        self.counters = SpecDecodeCounters(num_accepted_tokens_per_pos=[0] * self.max_k)
        self._num_steps = 0

    def num_drafts_for_step(self, num_reqs: int) -> int:
        """k for a step whose batch holds `num_reqs` running requests."""
        self._num_steps += 1
        if not self.adaptive:
            return self.max_k
        k = best_num_drafts(self.acceptance, max(num_reqs, 1), self.max_k)
        if k == 0 and self._num_steps % PROBE_INTERVAL == 0 and (
                best_num_drafts(1.0, max(num_reqs, 1), self.max_k) > 0):
            # NOTE: the load would allow speculating, only the estimate says no: probe.
            return 1
        return k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_draft_tokens` drafts."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_draft_tokens
        c.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.num_accepted_tokens_per_pos[pos] += 1
        # NOTE: the run stops at the first rejection, so the per-draft rate is accepted
        # over drafts looked at (the accepted ones plus the rejected one, if any).
        looked_at = min(num_accepted + 1, num_draft_tokens)
        rate = num_accepted / looked_at
        self.acceptance += _EMA_WEIGHT * (rate - self.acceptance)
