"""The Scheduler on a real KVCacheManager with a fake runner (no model): token budget, running
before waiting, chunked prefill, preemption by recompute, frees, max_num_seqs, and
check_integrity after every step."""

from __future__ import annotations

import pytest

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import EngineCoreOutput, Scheduler, SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.model_runner import ModelRunnerOutput

BLOCK_SIZE = 4
EOS = 2
TOKEN = 7  # what the fake runner samples: never eos, never a stop token unless asked


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    enable_chunked_prefill: bool = True,
    enable_caching: bool = False,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len,
                     enable_chunked_prefill)


def make_request(req_id: str, num_prompt_tokens: int, max_tokens: int = 4,
                 first_token: int = 10, **params) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(first_token, first_token + num_prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=EOS,
    )


def fake_runner(sched: Scheduler, out: SchedulerOutput, token: int = TOKEN) -> ModelRunnerOutput:
    """Samples `token` for every request whose scheduled tokens reach its end (as the real
    runner does: a partial prefill chunk samples nothing)."""
    result = ModelRunnerOutput()
    for req_id in out.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            result.sampled_token_ids[req_id] = [token]
    return result


def step(sched: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    sched.check_integrity()
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
    core = sched.update_from_output(out, fake_runner(sched, out, token))
    sched.check_integrity()
    return out, core


def run_to_end(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched)[0])
        assert len(outs) < max_steps, "scheduler made no progress"
    assert sched.kv.usage == 0.0
    return outs


def test_budget_respected_every_step_and_all_finish() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    reqs = [make_request(f"r{i}", 30, max_tokens=5) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_end(sched)
    assert all(o.total_num_scheduled_tokens <= 32 for o in outs)
    # Prefill needs 5 * 30 tokens: the full budget is spent until it is done.
    assert [o.total_num_scheduled_tokens for o in outs[:4]] == [32, 32, 32, 32]
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [TOKEN] * 5
    assert not sched.requests


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 6, max_tokens=10))
    step(sched)
    assert sched.requests["a"].num_output_tokens == 1
    sched.add_request(make_request("b", 40, max_tokens=2))
    out, _ = step(sched)
    # "a" decodes its one token first; "b" gets what is left of the budget.
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [r.req_id for r in sched.running] == ["a", "b"]


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    req = make_request("long", 50, max_tokens=3)
    sched.add_request(req)
    chunks = []
    for _ in range(4):
        out, core = step(sched)
        chunks.append(out.num_scheduled_tokens["long"])
        if req.num_computed_tokens < req.num_prompt_tokens:
            assert not core, "a partial prefill must not produce a token"
    assert chunks == [16, 16, 16, 2]
    assert req.num_output_tokens == 1
    # Each chunk after the first goes as a diff from the runner's known state.
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 1} and out.scheduled_cached_reqs
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 50
    run_to_end(sched)
    assert req.output_token_ids == [TOKEN] * 3


def test_no_chunked_prefill_schedules_prompts_whole() -> None:
    sched = make_scheduler(max_num_batched_tokens=20, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 12))
    sched.add_request(make_request("b", 12, first_token=100))
    out, _ = step(sched)
    # "b" does not fit in what is left (8 tokens) and must not be split.
    assert out.num_scheduled_tokens == {"a": 12}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 12}
    run_to_end(sched)


def test_preempts_newest_request_and_resumes_it_by_recompute() -> None:
    # 6 blocks of 4 = 24 token slots; two requests of 8 prompt tokens growing to 20 each
    # cannot both fit, so the newer one must give its blocks back.
    sched = make_scheduler(num_blocks=6)
    old = make_request("old", 8, max_tokens=12)
    new = make_request("new", 8, max_tokens=12, first_token=100)
    sched.add_request(old)
    sched.add_request(new)
    for _ in range(40):
        out, _ = step(sched)
        if new.status == RequestStatus.PREEMPTED:
            break
    else:
        pytest.fail("no preemption happened")
    # The runner is told in the same step to drop the preempted request's state.
    assert "new" not in out.num_scheduled_tokens and "new" in out.finished_req_ids
    assert old.status == RequestStatus.RUNNING
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert sched.kv.get_block_ids("new") == []
    assert list(sched.waiting) == [new]
    assert sched.num_preemptions == 1
    num_output_before = new.num_output_tokens
    assert num_output_before > 0
    resumed = None
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        for data in out.scheduled_new_reqs:
            if data.req_id == "new":
                resumed = data
    assert sched.kv.usage == 0.0
    assert resumed is not None, "the preempted request never came back"
    # Recompute: it starts from scratch with its outputs so far, and no second pass over
    # the prompt's logprobs.
    assert resumed.num_computed_tokens == 0
    assert resumed.token_ids[:8] == new.prompt_token_ids
    assert len(resumed.token_ids) >= 8 + num_output_before
    assert not resumed.want_prompt_logprobs
    assert old.output_token_ids == [TOKEN] * 12
    assert new.output_token_ids == [TOKEN] * 12
    assert new.status == RequestStatus.FINISHED_LENGTH


def test_preempted_request_resumes_from_prefix_cache() -> None:
    sched = make_scheduler(num_blocks=6, enable_caching=True)
    sched.add_request(make_request("old", 8, max_tokens=12))
    new = make_request("new", 8, max_tokens=12, first_token=100)
    sched.add_request(new)
    while new.num_preemptions == 0:
        step(sched)
        assert sched.has_unfinished_requests()
    assert new.num_computed_tokens == 0
    run_to_end(sched)
    assert new.output_token_ids == [TOKEN] * 12


def test_finished_request_frees_its_blocks_at_once() -> None:
    sched = make_scheduler(num_blocks=16)
    assert sched.kv.num_usable_blocks == 15  # block 0 is the null block
    req = make_request("a", 10, max_tokens=2)
    sched.add_request(req)
    step(sched)
    assert sched.kv.num_free_blocks == 15 - 3 and sched.kv.get_block_ids("a") == [1, 2, 3]
    _, core = step(sched)
    assert [c.finish_status for c in core] == [RequestStatus.FINISHED_LENGTH]
    assert sched.kv.num_free_blocks == 15 and sched.kv.get_block_ids("a") == []
    assert "a" not in sched.requests and not sched.running
    assert "a" in sched.schedule().finished_req_ids


def test_stop_token_and_eos_finish_with_reason() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("stop", 5, max_tokens=10, stop_token_ids=[TOKEN]))
    _, core = step(sched)
    assert core[0].finish_status == RequestStatus.FINISHED_STOPPED
    assert core[0].stop_reason == TOKEN
    sched.add_request(make_request("eos", 5, max_tokens=10, min_tokens=2))
    _, core = step(sched, token=EOS)
    assert core[0].finish_status is None, "eos before min_tokens must not stop"
    _, core = step(sched, token=EOS)
    assert core[0].finish_status == RequestStatus.FINISHED_STOPPED
    assert core[0].stop_reason is None
    assert sched.kv.usage == 0.0


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 5, max_tokens=3, first_token=10 * i))
    out, _ = step(sched)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    outs = run_to_end(sched)
    assert max(len(o.num_scheduled_tokens) for o in outs) <= 2


def test_finish_requests_frees_running_and_waiting() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 9))
    sched.add_request(make_request("wait", 9, first_token=50))
    step(sched)
    assert sched.kv.usage > 0
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.kv.usage == 0.0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"run", "wait"}


def test_duplicate_request_id_is_rejected() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 3))
    sched.check_integrity()


def test_prompt_logprobs_survive_preemption_mid_prefill() -> None:
    # 14 blocks of 4 hold either request alone but not both; a 4-token budget makes the
    # 48-token prompt take many steps, so the older request's growth preempts it mid-prefill.
    sched = make_scheduler(num_blocks=14, max_num_batched_tokens=4, max_model_len=56)
    sched.add_request(make_request("old", 4, max_tokens=24))
    step(sched)
    req = make_request("lp", 48, max_tokens=2, first_token=100, prompt_logprobs=1)
    sched.add_request(req)
    while req.num_preemptions == 0:
        step(sched)
    assert req.num_output_tokens == 0, "preempted after its prefill: the scenario is wrong"
    while True:
        out, _ = step(sched)
        resumed = [d for d in out.scheduled_new_reqs if d.req_id == "lp"]
        if resumed:
            break
    assert resumed[0].want_prompt_logprobs


def test_same_step_duplicates_share_only_after_commit() -> None:
    """Four requests with one 10-token prompt (block size 4) admitted in one step each
    compute it: nothing is registered before the step commits, so none can hit another's
    blocks, and only the first one's full blocks are registered (the others are
    duplicates). A fifth, admitted after the commit, shares those two blocks."""
    sched = make_scheduler(enable_caching=True)
    for i in range(4):
        sched.add_request(make_request(f"s#{i}", 10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {f"s#{i}": 10 for i in range(4)}
    tables = [sched.kv.get_block_ids(f"s#{i}") for i in range(4)]
    assert tables == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    cached = sched.kv.block_pool.cached_block_hash_to_block
    assert sorted(block.block_id for block in cached.values()) == [1, 2]
    sched.add_request(make_request("late", 10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {**{f"s#{i}": 1 for i in range(4)}, "late": 2}
    assert sched.kv.get_block_ids("late") == [1, 2, 13]
    assert [sched.kv.block_pool.blocks[b].ref_cnt for b in (1, 2, 13)] == [2, 2, 1]
    run_to_end(sched)


def test_a_step_may_return_several_tokens_and_a_stop_discards_the_rest() -> None:
    """The runner's output is a list of tokens per request (speculative decoding returns
    more than one): each is appended with its own stop check, and the tokens (and their
    logprobs) after the one that stops the request are discarded."""
    sched = make_scheduler()
    stop = make_request("stop", 5, max_tokens=10, stop_token_ids=[8], logprobs=0)
    length = make_request("length", 5, max_tokens=2, first_token=50)
    going = make_request("going", 5, max_tokens=10, first_token=90)
    for r in (stop, length, going):
        sched.add_request(r)
    out = sched.schedule()
    runner_out = ModelRunnerOutput(
        sampled_token_ids={"stop": [7, 8, 9], "length": [7, 7, 7], "going": [7, 9]},
        logprobs={"stop": [([7], [-0.1], 1), ([8], [-0.2], 1), ([9], [-0.3], 1)]},
    )
    core = {c.req_id: c for c in sched.update_from_output(out, runner_out)}
    assert core["stop"].new_token_ids == [7, 8] and core["stop"].stop_reason == 8
    assert core["stop"].new_logprobs == [([7], [-0.1], 1), ([8], [-0.2], 1)]
    assert core["stop"].finish_status == RequestStatus.FINISHED_STOPPED
    assert core["length"].new_token_ids == [7, 7]
    assert core["length"].finish_status == RequestStatus.FINISHED_LENGTH
    assert core["going"].new_token_ids == [7, 9] and core["going"].finish_status is None
    assert stop.output_token_ids == [7, 8] and going.output_token_ids == [7, 9]
    assert list(sched.requests) == ["going"]
    sched.check_integrity()
