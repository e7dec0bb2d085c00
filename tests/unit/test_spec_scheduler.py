"""Speculative decoding in the scheduler (fake runner, real KVCacheManager): drafts are more
tokens in the one budget, cut to the budget and the request's limits; the commit takes back
rejected drafts exactly (computed tokens, blocks, prefix-cache entries); check_integrity
after every step. Also the adaptive draft-length rule."""

from __future__ import annotations

import pytest

from pagoda.core.hashing import update_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.adaptive import (
    PROBE_MIN_GAIN,
    DraftLengthPolicy,
    StepCosts,
    best_num_drafts,
    costs_for_method,
    expected_tokens,
    speculation_gain,
)
from pagoda.worker.model_runner import ModelRunnerOutput

BLOCK_SIZE = 4
EOS = 2
TOKEN = 7


def make_scheduler(k: int = 4, num_blocks: int = 32, max_num_batched_tokens: int = 64,
                   max_model_len: int = 64, enable_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
    return Scheduler(kv, 8, max_num_batched_tokens, max_model_len,
                     draft_length_policy=DraftLengthPolicy(k, adaptive=False))


def make_request(req_id: str, num_prompt_tokens: int, max_tokens: int = 20) -> Request:
    return Request(req_id=req_id, prompt_token_ids=list(range(10, 10 + num_prompt_tokens)),
                   sampling_params=SamplingParams(max_tokens=max_tokens), eos_token_id=EOS)


def commit(sched: Scheduler, out: SchedulerOutput, accept: dict[str, int] | None = None,
           final: int = TOKEN, drafts: dict[str, list[int]] | None = None) -> None:
    """Fake runner: each request accepts `accept[req_id]` drafts (default all) and gets
    `final` after them; `drafts` are the proposer's next guesses."""
    result = ModelRunnerOutput(draft_token_ids=drafts or {})
    for req_id in out.num_scheduled_tokens:
        req = sched.requests[req_id]
        spec = out.scheduled_spec_decode_tokens.get(req_id, [])
        if req.num_computed_tokens == req.num_tokens + len(spec):
            n = len(spec) if accept is None else accept.get(req_id, len(spec))
            result.sampled_token_ids[req_id] = spec[:n] + [final]
    sched.check_integrity()
    sched.update_from_output(out, result)
    sched.check_integrity()


def decode_ready(sched: Scheduler, req: Request, drafts: list[int]) -> None:
    """Prefill `req` and leave it in decode with `drafts` proposed."""
    sched.add_request(req)
    while not req.num_output_tokens:
        commit(sched, sched.schedule(), drafts={req.req_id: drafts})
    assert req.num_computed_tokens == req.num_tokens - 1


def test_drafts_are_scheduled_as_more_tokens_with_slots() -> None:
    sched = make_scheduler()
    req = make_request("a", 7)
    decode_ready(sched, req, [20, 21, 22, 23])
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.scheduled_spec_decode_tokens == {"a": [20, 21, 22, 23]}
    # positions 7..11: a third block for positions 8..11
    assert len(sched.kv.get_block_ids("a")) == 3
    assert req.num_computed_tokens == 8 + 4
    commit(sched, out)
    assert req.output_token_ids == [TOKEN, 20, 21, 22, 23, TOKEN]
    assert req.num_computed_tokens == req.num_tokens - 1 == 12


def test_rejection_rolls_back_tokens_and_blocks_exactly() -> None:
    sched = make_scheduler()
    req = make_request("a", 7)
    decode_ready(sched, req, [20, 21, 22, 23])
    blocks_before = list(sched.kv.get_block_ids("a"))
    free_before = sched.kv.num_free_blocks
    out = sched.schedule()
    ((new_block,),) = out.scheduled_cached_reqs[0].new_block_ids  # one group
    commit(sched, out, accept={"a": 0}, final=30, drafts={"a": [40, 41]})
    assert req.output_token_ids == [TOKEN, 30]
    assert req.num_computed_tokens == 8 == req.num_tokens - 1
    # The block for positions 8..11 held only rejected drafts: back in the pool, unhashed.
    assert sched.kv.get_block_ids("a") == blocks_before
    assert sched.kv.num_free_blocks == free_before
    assert sched.kv.block_pool.blocks[new_block].block_hash is None
    assert req.spec_token_ids == [40, 41]
    # The runner is told to cut its table before appending the next step's blocks.
    out = sched.schedule()
    cached = out.scheduled_cached_reqs[0]
    assert cached.num_blocks == len(sched.kv.get_block_ids("a"))
    assert cached.num_blocks - len(cached.new_block_ids[0]) == len(blocks_before)
    commit(sched, out, accept={"a": 1})


def test_partial_acceptance_keeps_the_accepted_blocks() -> None:
    sched = make_scheduler()
    req = make_request("a", 3)
    decode_ready(sched, req, [20, 21, 22, 23])  # 4 tokens, 3 computed
    out = sched.schedule()  # positions 3..7: 2 blocks
    commit(sched, out, accept={"a": 2}, final=31)
    assert req.output_token_ids == [TOKEN, 20, 21, 31]
    assert req.num_computed_tokens == 6
    assert len(sched.kv.get_block_ids("a")) == 2


def test_no_prefix_cache_entry_covers_a_rejected_token() -> None:
    sched = make_scheduler()
    req = make_request("a", 3)
    decode_ready(sched, req, [20, 21, 22, 23, 24])
    out = sched.schedule()  # positions 3..7 filled with [TOKEN, 20, 21, 22, 23]
    commit(sched, out, accept={"a": 0}, final=31)
    commit(sched, sched.schedule())  # a plain step: blocks whose tokens are accepted register
    cached = sched.kv.block_pool.cached_block_hash_to_block
    hashes = req.block_hashes
    assert len(hashes) == 1  # tokens [10, 11, 12, TOKEN]; 31 and on fill block 1
    assert set(cached) <= set(hashes)
    # A request with the rejected continuation finds nothing past the shared first block.
    other = Request("b", [10, 11, 12, TOKEN, 20, 21, 22, 23, 1],
                    SamplingParams(max_tokens=1), eos_token_id=EOS)
    update_block_hashes(other, BLOCK_SIZE)
    _, num_hit = sched.kv.get_computed_blocks(other)
    assert num_hit == BLOCK_SIZE


@pytest.mark.parametrize(("limit", "expected_k"), [
    ({"max_num_batched_tokens": 3}, 2),   # budget: 1 + 2
    ({"max_tokens": 4}, 2),               # 1 output so far: 3 more at most = 2 drafts + 1
    ({"max_model_len": 11}, 2),           # 8 tokens: up to 10 after drafts, 11 with the last
])
def test_k_is_cut_to_the_budget_and_the_request_limits(limit: dict, expected_k: int) -> None:
    sched = make_scheduler(max_num_batched_tokens=limit.get("max_num_batched_tokens", 64),
                           max_model_len=limit.get("max_model_len", 64))
    req = make_request("a", 7, max_tokens=limit.get("max_tokens", 20))
    decode_ready(sched, req, [20, 21, 22, 23])
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens.get("a", []) == [20, 21, 22, 23][:expected_k]
    assert out.num_scheduled_tokens["a"] == 1 + expected_k
    commit(sched, out)
    assert req.is_finished or req.num_computed_tokens == req.num_tokens - 1


def test_a_stop_token_inside_the_accepted_run_ends_the_request() -> None:
    sched = make_scheduler()
    req = make_request("a", 7)
    decode_ready(sched, req, [20, EOS, 22, 23])
    commit(sched, sched.schedule())
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [TOKEN, 20, EOS]
    assert sched.kv.usage == 0.0


def test_drafts_give_way_before_anyone_is_preempted() -> None:
    # 4 usable blocks: a holds 2 (7 tokens + 1), b holds 2; a's drafts would need a third.
    sched = make_scheduler(num_blocks=5, enable_caching=False)
    a, b = make_request("a", 7), make_request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    commit(sched, sched.schedule(), drafts={"a": [20, 21, 22, 23]})
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not out.scheduled_spec_decode_tokens
    assert sched.num_preemptions == 0
    commit(sched, out)


def test_preemption_and_rollback_drop_the_drafts() -> None:
    sched = make_scheduler()
    req = make_request("a", 7)
    decode_ready(sched, req, [20, 21])
    out = sched.schedule()
    sched.rollback_step(out)
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0
    sched.check_integrity()


def test_counters_follow_the_verifications() -> None:
    sched = make_scheduler()
    req = make_request("a", 7)
    decode_ready(sched, req, [20, 21, 22, 23])
    commit(sched, sched.schedule(), accept={"a": 2}, drafts={"a": [1, 3, 4]})
    commit(sched, sched.schedule(), accept={"a": 3})
    stats = sched.get_stats()
    assert stats.spec_decode_num_drafts == 2
    assert stats.spec_decode_num_draft_tokens == 7
    assert stats.spec_decode_num_accepted_tokens == 5
    assert stats.spec_decode_num_accepted_tokens_per_pos == [2, 2, 1, 0]


def test_adaptive_rule_speculates_alone_and_stops_under_load() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert best_num_drafts(0.8, 1, 4) == 4
    assert best_num_drafts(0.8, 256, 4) == 0
    assert best_num_drafts(0.0, 1, 4) == 0
    ks = [best_num_drafts(0.6, b, 4) for b in (1, 4, 16, 64, 256)]
    assert ks == sorted(ks, reverse=True)


def test_adaptive_policy_learns_the_acceptance_rate_and_probes() -> None:
    policy = DraftLengthPolicy(4)
    assert policy.num_drafts_for_step(1) > 0
    for _ in range(100):
        policy.observe(4, 0)
    assert policy.acceptance < 0.01
    ks = [policy.num_drafts_for_step(1) for _ in range(32)]
    # One probe in 16 steps: two steps in a row (one proposes, the next verifies).
    assert ks.count(1) == 4 and ks.count(0) == 28
    assert [i for i, k in enumerate(ks) if k] == [14, 15, 30, 31]
    for _ in range(100):
        policy.observe(4, 4)
    assert policy.num_drafts_for_step(1) == 4


def test_probe_steps_verify_a_draft_after_the_rule_said_zero() -> None:
    """With the estimate at 0 the rule proposes nothing; a probe must both propose (one
    step) and verify (the next), or the estimate could never recover."""
    policy = DraftLengthPolicy(4)
    policy.acceptance = 0.0
    kv = KVCacheManager(32, BLOCK_SIZE, enable_caching=True)
    sched = Scheduler(kv, 8, 64, 64, draft_length_policy=policy)
    req = make_request("a", 3, max_tokens=40)
    sched.add_request(req)
    verified = 0
    for _ in range(34):
        out = sched.schedule()
        verified += len(out.scheduled_spec_decode_tokens.get("a", []))
        # NOTE: the runner proposes only in steps with k > 0, at most k drafts.
        drafts = {"a": [20, 21, 22, 23][: out.num_spec_tokens]} if out.num_spec_tokens else {}
        commit(sched, out, accept={"a": 0}, drafts=drafts)
    assert verified == 2


def test_rule_charges_verification_and_proposing() -> None:
    """k > 0 only where the drafts' saved tokens pay for verifying and proposing them."""
    free = StepCosts(token=0.02, verify=0.0)
    verify = StepCosts(token=0.02, verify=0.1)
    # A proposer whose every draft costs more than the target's whole plain step.
    dear = StepCosts(token=0.02, verify=0.0, per_draft=1.2)
    assert best_num_drafts(0.25, 4, 4, free) > 0
    assert best_num_drafts(0.25, 4, 4, verify) == 0
    assert best_num_drafts(0.9, 1, 4, verify) == 4
    assert best_num_drafts(0.9, 1, 4, dear) == 0
    assert best_num_drafts(1.0, 1, 4, dear) == 0
    # A perfect draft that would gain under PROBE_MIN_GAIN is not probed for.
    marginal = StepCosts(token=0.042, verify=0.06, per_draft=0.89, per_draft_request=0.072,
                         per_request=0.018)
    assert best_num_drafts(1.0, 1, 4, marginal) == 4
    assert 1.0 < speculation_gain(1.0, 1, 4, marginal) < PROBE_MIN_GAIN
    policy = DraftLengthPolicy(4, costs=marginal)
    policy.acceptance = 0.0
    assert not any(policy.num_drafts_for_step(1) for _ in range(40))
    assert verify.step(4, 0) == pytest.approx(1.08)
    assert verify.step(4, 2) == pytest.approx(1 + 0.02 * 12 + 0.4)
    assert costs_for_method("a test's proposer").per_draft == 0.0
    # A self-draft of half the target's layers is charged half its proposing.
    half, full = costs_for_method("quantized_self_draft", 0.5), costs_for_method("draft_model")
    assert half.per_draft == pytest.approx(full.per_draft / 2)
    assert half.token == full.token and half.verify == full.verify


def test_k_follows_each_requests_own_acceptance() -> None:
    """Two requests in one batch, one whose drafts are always accepted and one whose drafts
    never are: the first keeps verifying every draft, the second stops (but for probes).
    One rate for the batch (about 0.5) would give both the same k."""
    kv = KVCacheManager(64, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(kv, 8, 64, 256, draft_length_policy=DraftLengthPolicy(4))
    good, bad = make_request("good", 3, max_tokens=200), make_request("bad", 3, max_tokens=200)
    sched.add_request(good)
    sched.add_request(bad)
    verified: dict[str, list[int]] = {"good": [], "bad": []}
    for _ in range(30):
        out = sched.schedule()
        for req_id, counts in verified.items():
            counts.append(len(out.scheduled_spec_decode_tokens.get(req_id, [])))
        k = out.num_spec_tokens
        commit(sched, out, accept={"bad": 0},
               drafts={r: [20, 21, 22, 23][:k] for r in verified} if k else {})
    # After a few verifications each request's own estimate rules its k.
    assert verified["good"][-20:] == [4] * 20
    assert max(verified["bad"][-20:]) <= 1  # probes verify one draft
    assert sum(verified["bad"][-20:]) <= 2
    assert good.spec_acceptance > 0.9
    assert bad.spec_acceptance < 0.1
