"""n > 1 samples fork the first sample's computed prompt: full blocks shared by reference,
the partly filled last block copied before the fork's first write (copy-on-write), with
prefix caching on or off. Exact block ids (block 0 is the null block) and ref counts;
check_integrity every step."""

from __future__ import annotations

import pytest

from pagoda.core.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from tests.unit.test_scheduler import EOS, make_scheduler, run_to_end, step


def group(n: int, num_prompt_tokens: int, max_tokens: int = 3) -> list[Request]:
    prompt = list(range(10, 10 + num_prompt_tokens))
    return [
        Request(req_id=f"r#{i}", prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens), eos_token_id=EOS,
                fork_of="r#0" if i else None)
        for i in range(n)
    ]


@pytest.mark.parametrize("caching", [False, True])
def test_later_samples_fork_and_copy_the_partial_block(caching: bool) -> None:
    sched = make_scheduler(num_blocks=16, enable_caching=caching)
    reqs = group(3, 10)  # 10 tokens: blocks of 4, 4, 2
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    # The followers wait while the first sample computes the prompt.
    assert out.num_scheduled_tokens == {"r#0": 10}
    assert sched.kv.get_block_ids("r#0") == [1, 2, 3]
    assert [r.status for r in reqs[1:]] == [RequestStatus.WAITING] * 2

    out, _ = step(sched)
    # Each follower shares blocks 1 and 2 and gets its own copy of block 3 (holding tokens
    # 8..9 of the prompt; the fork computes token 9 again for its own first sample).
    assert out.num_scheduled_tokens == {"r#0": 1, "r#1": 1, "r#2": 1}
    assert out.blocks_to_copy == [(3, 4), (3, 5)]
    assert sched.kv.get_block_ids("r#1") == [1, 2, 4]
    assert sched.kv.get_block_ids("r#2") == [1, 2, 5]
    assert [d.num_computed_tokens for d in out.scheduled_new_reqs] == [9, 9]
    pool = sched.kv.block_pool.blocks
    assert [pool[i].ref_cnt for i in range(6)] == [0, 3, 3, 1, 1, 1]
    assert reqs[1].num_cached_tokens == 9 and reqs[2].num_cached_tokens == 9

    run_to_end(sched)
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    assert sched.kv.usage == 0.0


def test_prompt_ending_on_a_block_boundary_needs_no_copy() -> None:
    sched = make_scheduler(num_blocks=16)
    reqs = group(2, 9)  # the shared 8 tokens fill blocks 1 and 2 exactly
    for r in reqs:
        sched.add_request(r)
    step(sched)
    out, _ = step(sched)
    assert out.blocks_to_copy == []
    # r#0's block 3 holds its prompt's last token; r#1 writes that token into a new block.
    assert sched.kv.get_block_ids("r#0") == [1, 2, 3]
    assert sched.kv.get_block_ids("r#1") == [1, 2, 4]
    run_to_end(sched)


def test_no_fork_when_the_first_sample_is_gone() -> None:
    """A first sample that finished with its first token (max_tokens=1) before the others
    could fork leaves them to be admitted as usual (computing the whole prompt)."""
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    reqs = group(2, 10, max_tokens=1)
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"r#0": 10}
    out, _ = step(sched)
    assert reqs[0].is_finished
    assert out.num_scheduled_tokens == {"r#1": 10} and out.blocks_to_copy == []
    run_to_end(sched)


def test_fork_waits_for_a_chunked_prompt() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=6)
    reqs = group(2, 10)
    for r in reqs:
        sched.add_request(r)
    assert step(sched)[0].num_scheduled_tokens == {"r#0": 6}
    assert step(sched)[0].num_scheduled_tokens == {"r#0": 4}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"r#0": 1, "r#1": 1}
    assert out.blocks_to_copy == [(3, 4)]
    run_to_end(sched)


def test_fork_short_of_blocks_admits_later_without_leaking() -> None:
    """3 usable blocks: r#0 holds all of them, so the fork cannot get its copy block:
    nothing changes (no shared reference left behind), and r#1 runs once r#0 is done."""
    sched = make_scheduler(num_blocks=4)
    reqs = group(2, 10, max_tokens=3)
    for r in reqs:
        sched.add_request(r)
    step(sched)
    for _ in range(2):  # r#0 decodes (10 + 2 tokens fit its 3 blocks); r#1 cannot fork
        out, _ = step(sched)
        assert out.num_scheduled_tokens == {"r#0": 1} and out.blocks_to_copy == []
        assert reqs[1].status == RequestStatus.WAITING
        assert sched.kv.get_block_ids("r#1") == []
    assert reqs[0].is_finished
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"r#1": 10}
    run_to_end(sched)
    assert all(r.is_finished for r in reqs)


def test_a_sample_waiting_for_its_parent_does_not_hold_up_the_queue() -> None:
    """r#1 waits for r#0's prompt; "other", queued behind it, is admitted in the same step
    with what is left of the budget instead of waiting for the fork."""
    sched = make_scheduler(num_blocks=16)
    reqs = group(2, 10)
    for r in reqs:
        sched.add_request(r)
    other = Request(req_id="other", prompt_token_ids=list(range(200, 206)),
                    sampling_params=SamplingParams(max_tokens=2), eos_token_id=EOS)
    sched.add_request(other)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"r#0": 10, "other": 6}
    assert sched.kv.get_block_ids("other") == [4, 5]
    # The skipped sample keeps its place in front of the queue.
    assert list(sched.waiting) == [reqs[1]]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"r#0": 1, "other": 1, "r#1": 1}
    assert out.blocks_to_copy == [(3, 6)]  # other holds 4 and 5
    run_to_end(sched)
    assert all(r.is_finished for r in [*reqs, other])
