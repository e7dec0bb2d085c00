"""How many draft tokens to verify per request this step, and the acceptance counters.

The rule (adaptive k). With a per-draft acceptance rate a, verifying k drafts yields on
average E(k) = (1 - a^(k+1)) / (1 - a) tokens per request per step. A decode step of B
requests costs, in units of its fixed part t0 (weights read once, the step's overheads),

    c(B, 0) = 1 + rho B                                    speculation off
    c(B, k) = 1 + rho B (k + 1) + nu B + P(B, k)           k drafts each
    P(B, k) = pi_d k + pi_dr k B + pi_r B                  the proposer's work

rho = t1 / t0 is one token in the forward; nu one request's verification beyond its tokens
(logits and processed distributions at k + 1 positions, the rejection sampler, the
commit's rollback, the multi-token query's attention); P the proposing of the next drafts
(ngram: a lookup per request; a draft model: k batched forwards of the draft). k maximises
E(k) / c(B, k) over [0, num_speculative_tokens]: a step speculates only where the tokens the
drafts save (a E(k - 1) more per request) pay for what verifying and proposing them cost,
and k = 0 otherwise (at a = 0 always). k is chosen per request, from that request's own
acceptance rate (an exponential moving average over its verifications, starting from the
rate over all requests): one request's drafts may pay where another's do not (a chat answer
that quotes a phrase beside one that never repeats), and a single rate for the batch either
speculates for both or for neither; the step's k, the most any request gets, also caps the
proposer's next guesses. While the rule says 0 for a request at a rate where a = 1 would gain
at least `PROBE_MIN_GAIN`, one probe in `PROBE_INTERVAL` steps (two steps at k = 1: a step's
k caps both its verification and its proposals) lets its estimate recover.

Measured by `pagoda bench spec --configs "ngram fixed k" "self-draft rtn fixed k"
--max-tokens 64` (SmolLM2-135M bf16, AMD EPYC, 2 CPUs shared with other jobs; its cost
fit, benchmarks/spec_cost.py, over 1,456 decode steps): t0 = 143 ms, rho = t1 / t0 =
0.042; proposing, timed apart: ngram 0.0002 t0 a draft (free), the int4 self-draft 0.89 t0
a draft plus 0.072 t0 a draft per request (its forward is as deep as the target's). The
fit's nu came out negative (-0.067: a verifying row's extra tokens cost less than a new
row's, and the load rose from 1.4 to 11 during the run, so the fit cannot separate them);
nu is instead read off the same run's measured speedups of ngram with fixed k = 4: at
concurrency 4, grounded (4.08 tokens per verification, 2.31x) gives nu = 0.056, and chat
(1.43 tokens, a = 0.3, 0.95x, a loss) stops speculating for nu >= 0.046; nu = 0.06. With
these, ngram at a = 0.9 (grounded) verifies 4 drafts at 1, 4 and 16 streams (0 at 64);
at a = 0.3 (chat) 2 alone and none at 4 or 16; the self-draft at the acceptance it reaches
here (0.8-0.9) never speculates: its k forwards cost more than the tokens they save (a
perfect draft alone would gain 1%, below PROBE_MIN_GAIN: no probes either; before that
margin its single-stream probes, each catching the draft up on every token since the last
one, measured 0.63-0.82x of off). docs/spec_decode.md has the figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

PROBE_INTERVAL = 16
# A probe costs what the rule does not charge (a draft model's catch-up on every token
# since its last proposal): probe only where perfect drafts would gain at least this.
PROBE_MIN_GAIN = 1.25
_EMA_WEIGHT = 0.1
# A request's own estimate moves faster: a few of its verifications outweigh the prior
# (the rate over all requests when it first verifies).
_OWN_EMA_WEIGHT = 0.25
_PRIOR_ACCEPTANCE = 0.6


@dataclass(frozen=True, slots=True)
class StepCosts:
    """A decode step's costs in units of its fixed part t0 (see the module docstring)."""

    token: float  # rho: one token in the forward
    verify: float  # nu: one request's verification, beyond its tokens
    # P(B, k) = per_draft * k + per_draft_request * k * B + per_request * B: proposing
    per_draft: float = 0.0
    per_draft_request: float = 0.0
    per_request: float = 0.0

    def step(self, num_reqs: int, k: int) -> float:
        """c(B, k): the step's time over t0 when each of `num_reqs` requests verifies k."""
        cost = 1.0 + self.token * num_reqs * (k + 1)
        if k > 0:
            cost += (self.verify * num_reqs + self.per_draft * k
                     + self.per_draft_request * k * num_reqs + self.per_request * num_reqs)
        return cost


TOKEN_COST_RATIO = 0.042
VERIFY_COST_RATIO = 0.06
# Proposing, by method: (per_draft, per_draft_request, per_request), measured as the module
# docstring says; draft_model is charged what the self-draft measured (a draft as deep as
# the target: on a CPU a small model's forward costs per layer more than per weight), so a
# much smaller draft speculates less than it could. A method not listed (a test's proposer)
# proposes for free.
PROPOSE_COSTS: dict[str, tuple[float, float, float]] = {
    "ngram": (0.0002, 0.0001, 0.0),
    "draft_model": (0.89, 0.072, 0.018),
    "quantized_self_draft": (0.89, 0.072, 0.018),
}
DEFAULT_COSTS = StepCosts(TOKEN_COST_RATIO, VERIFY_COST_RATIO)


def costs_for_method(method: str, draft_depth: float = 1.0) -> StepCosts:
    """The rule's costs for `method`; `draft_depth`: a draft model's layers over the
    target's (a self-draft of the first layers), which scales its proposing cost (a
    forward of this small model on a CPU costs per layer)."""
    return StepCosts(TOKEN_COST_RATIO, VERIFY_COST_RATIO,
                     *(draft_depth * c for c in PROPOSE_COSTS.get(method, (0.0, 0.0, 0.0))))


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens emitted per verification of k drafts at per-draft acceptance a."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_num_drafts(acceptance: float, num_reqs: int, max_k: int,
                    costs: StepCosts = DEFAULT_COSTS) -> int:
    """The k in [0, max_k] maximising E(k) / c(B, k) (the smaller k on a tie)."""
    return max(range(max_k + 1),
               key=lambda k: (expected_tokens(acceptance, k) / costs.step(num_reqs, k), -k))


def speculation_gain(acceptance: float, num_reqs: int, max_k: int,
                     costs: StepCosts = DEFAULT_COSTS) -> float:
    """Tokens per unit time at the best k over those of speculation off (>= 1)."""
    k = best_num_drafts(acceptance, num_reqs, max_k, costs)
    return expected_tokens(acceptance, k) * costs.step(num_reqs, 0) / costs.step(num_reqs, k)


@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters, cumulative."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class DraftLengthPolicy:
    """The scheduler's choice of k per request and step (see the module docstring) and the
    counters.

    Per step: `num_drafts_for_step(B, estimates)` first (the step's k: the most drafts any
    request may verify, which also caps the proposer's next guesses), then
    `num_drafts_for_request(estimate)` for each decoding request. An estimate is the
    request's own acceptance rate (`observe`'s return), None before its first
    verification: then the rate over all requests stands in for it.
    """

    def __init__(self, num_speculative_tokens: int, adaptive: bool = True,
                 costs: StepCosts = DEFAULT_COSTS) -> None:
        self.max_k = num_speculative_tokens
        self.adaptive = adaptive
        self.costs = costs
        self.acceptance = _PRIOR_ACCEPTANCE
        self.counters = SpecDecodeCounters(num_accepted_tokens_per_pos=[0] * self.max_k)
        self._num_steps = 0
        self._num_reqs = 1
        self._probing = False

    def num_drafts_for_step(self, num_reqs: int,
                            estimates: Iterable[float | None] = (None,)) -> int:
        """The step's k for a batch of `num_reqs` running requests whose acceptance
        estimates are `estimates`: the largest k any of them gets."""
        self._num_steps += 1
        self._num_reqs = max(num_reqs, 1)
        if not self.adaptive:
            return self.max_k
        self._probing = self._num_steps % PROBE_INTERVAL in (0, 1) and (
            speculation_gain(1.0, self._num_reqs, self.max_k, self.costs) >= PROBE_MIN_GAIN)
        return max((self.num_drafts_for_request(e) for e in estimates), default=0)

    def num_drafts_for_request(self, estimate: float | None) -> int:
        """k for one request of this step, by its own acceptance estimate."""
        if not self.adaptive:
            return self.max_k
        a = self.acceptance if estimate is None else estimate
        k = _best_num_drafts_rounded(round(a, 2), self._num_reqs, self.max_k, self.costs)
        if k == 0 and self._probing:
            # NOTE: the load would allow speculating, only the estimate says no: probe.
            # Two steps: a step's k caps both its verification and its proposals, so the
            # first proposes one draft per request and the second verifies it.
            return 1
        return k

    def observe(self, num_draft_tokens: int, num_accepted: int,
                estimate: float | None = None) -> float:
        """One request's verification: `num_accepted` of its `num_draft_tokens` drafts;
        returns that request's new acceptance estimate (`estimate`: its previous one)."""
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
        own = self.acceptance if estimate is None else estimate
        self.acceptance += _EMA_WEIGHT * (rate - self.acceptance)
        return own + _OWN_EMA_WEIGHT * (rate - own)


@lru_cache(maxsize=4096)
def _best_num_drafts_rounded(acceptance: float, num_reqs: int, max_k: int,
                             costs: StepCosts) -> int:
    """best_num_drafts at an acceptance rounded to 0.01 (each request asks every step)."""
    return best_num_drafts(acceptance, num_reqs, max_k, costs)
