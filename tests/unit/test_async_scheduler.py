"""Async scheduling at the scheduler: two steps in flight (step N+1 scheduled before step N
is committed) give every request the same tokens and finish as one step at a time, under
eos and outside stops, aborts, max_tokens, max_model_len, prefix caching with a host tier,
preemption by recompute and swap, the priority policy and n > 1 forks.

The fake worker keeps its own token rows, as the real runner does (a sampled token is fed
to the next step from there), and simulates the KV cache: each computed position writes
(token, position) into its slot, and every position a step attends to must hold the
request's own token there. So a block registered before it was written, reused while still
read, or copied before its writer ran, fails the step. Steps run in order, either at once
when submitted ("eager") or only when their result is awaited ("lazy": the scheduler then
runs a whole step ahead of the forward); check_integrity runs after every commit.
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from dataclasses import dataclass

import pytest

from pagoda.config import EngineArgs
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.model_runner import ModelRunnerOutput

BLOCK_SIZE = 4
EOS = 2
STOP = 13  # a token that ends its request from outside the scheduler (a stop string)


def sample(tokens: list[int]) -> int:
    """The fake model: the next token depends on the history only (so a recompute after
    preemption gives the same one); eos and STOP now and then."""
    value = (sum(tokens[-3:]) * 31 + len(tokens) * 7) % 97
    return EOS if value % 23 == 0 else value + 3


@dataclass
class Row:
    tokens: list[int]
    blocks: list[int]
    num_computed: int


class FakeWorker:
    def __init__(self) -> None:
        self.kv: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tier: dict[int, list] = {}
        self.rows: dict[str, Row] = {}

    def _copies(self, out: SchedulerOutput) -> None:
        empty = [None] * BLOCK_SIZE
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.kv.get(d, empty))
        for d, h in out.blocks_to_offload:
            self.tier[h] = list(self.kv.get(d, empty))
        for s, d in out.blocks_to_copy:
            self.kv[d] = list(self.kv.get(s, empty))
        for h, d in out.blocks_to_swap_in:
            self.kv[d] = list(self.host[h])
        for h, d in out.blocks_to_onload:
            self.kv[d] = list(self.tier[h])

    def _apply_diffs(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows
            self.rows[new.req_id] = Row(list(new.token_ids), list(new.block_ids[0]),
                                        new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            row = self.rows[cached.req_id]
            row.blocks += cached.new_block_ids[0]
            row.num_computed = cached.num_computed_tokens

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._copies(out)
        self._apply_diffs(out)
        result = ModelRunnerOutput()
        for req_id, n in out.num_scheduled_tokens.items():
            row = self.rows[req_id]
            start = row.num_computed
            assert start + n <= len(row.tokens), f"{req_id}: scheduled past its known tokens"
            for p in range(start):
                block = self.kv.get(row.blocks[p // BLOCK_SIZE], [None] * BLOCK_SIZE)
                assert block[p % BLOCK_SIZE] == (row.tokens[p], p), (
                    f"{req_id} reads position {p}: {block[p % BLOCK_SIZE]}, "
                    f"not its token {row.tokens[p]}")
            for p in range(start, start + n):
                block = self.kv.setdefault(row.blocks[p // BLOCK_SIZE], [None] * BLOCK_SIZE)
                block[p % BLOCK_SIZE] = (row.tokens[p], p)
            if start + n == len(row.tokens):
                token = sample(row.tokens)
                row.tokens.append(token)
                result.sampled_token_ids[req_id] = [token]
        return result


def make_requests(num: int, seed: int, shared_prefix: int = 0, n: int = 1) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 90) for _ in range(shared_prefix)]
    reqs = []
    for i in range(num):
        prompt = prefix + [rng.randrange(3, 90) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(max_tokens=rng.randint(1, 14))
        for j in range(n):
            reqs.append(Request(f"r{i}#{j}", prompt, params, eos_token_id=EOS,
                                priority=rng.randint(0, 2), fork_of=f"r{i}#0" if j else None))
    return reqs


def make_scheduler(config: dict) -> Scheduler:
    kv = KVCacheManager(config.get("num_blocks", 200), BLOCK_SIZE,
                        enable_caching=config.get("caching", False),
                        num_host_tier_blocks=config.get("host_tier", 0))
    return Scheduler(kv, max_num_seqs=config.get("max_num_seqs", 8),
                     max_num_batched_tokens=config.get("budget", 24),
                     max_model_len=config.get("max_model_len", 64),
                     policy=config.get("policy", "fcfs"),
                     preemption_mode=config.get("preemption", "recompute"),
                     num_host_blocks=config.get("host_blocks", 0))


def after_commit(sched: Scheduler, core, abort_at: dict[str, int]) -> None:
    """What the engine does after a commit: outside stops (STOP, like a stop string) and
    aborts (a request reaching its abort_at count of tokens)."""
    for c in core:
        req = sched.requests.get(c.req_id)
        if req is None or req.is_finished:
            continue
        if STOP in c.new_token_ids:
            sched.finish_requests(c.req_id, RequestStatus.FINISHED_STOPPED)
        elif abort_at.get(c.req_id) == req.num_output_tokens:
            sched.finish_requests(c.req_id, RequestStatus.FINISHED_ABORTED)


def run(config: dict, reqs: list[Request], mode: str, abort_at: dict[str, int]) -> dict:
    """Serve `reqs` to the end: "sync" (schedule, execute, commit), "eager" or "lazy"
    (two steps in flight, as engine/step_pipeline.py). Returns per request its tokens and
    final status."""
    sched, worker = make_scheduler(config), FakeWorker()
    for req in reqs:
        sched.add_request(req)
    in_flight: deque = deque()
    depth = 1 if mode == "sync" else 2
    for _ in range(2000):
        if not (sched.has_unfinished_requests() or in_flight):
            break
        while len(in_flight) < depth and (not in_flight or sched.has_unfinished_requests()):
            out = sched.schedule()
            in_flight.append((out, None if mode == "lazy" else worker.execute(out)))
        out, result = in_flight.popleft()
        core = sched.update_from_output(out, result or worker.execute(out))
        after_commit(sched, core, abort_at)
        sched.check_integrity()
    else:
        raise AssertionError("no progress")
    assert sched.kv.usage == 0.0
    pool = sched.preemptor.host_pool
    assert pool is None or pool.num_free_blocks == pool.num_blocks
    return {r.req_id: (r.output_token_ids, r.status) for r in reqs}, sched


CONFIGS = {
    "plain": {},
    "max_model_len": {"max_model_len": 28},
    "prefix_caching": {"caching": True, "shared": 9},
    # NOTE: prompts longer than the budget: a chunk in flight must not be registered.
    "long_prefix": {"caching": True, "shared": 30},
    "host_tier": {"caching": True, "shared": 9, "num_blocks": 14, "host_tier": 12},
    "recompute": {"num_blocks": 12},
    "swap": {"num_blocks": 12, "preemption": "swap", "host_blocks": 40},
    "swap_small_pool": {"num_blocks": 12, "preemption": "swap", "host_blocks": 5},
    "priority": {"num_blocks": 12, "policy": "priority", "max_num_seqs": 4},
    "fork": {"caching": True, "n": 3, "num_blocks": 30},
}


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_steps_in_flight_give_the_tokens_of_one(name: str, mode: str) -> None:
    config = CONFIGS[name]
    shape = (config.get("shared", 0), config.get("n", 1))
    for seed in range(4):
        abort_at = {f"r{i}#0": 2 for i in range(0, 12, 5)}
        expected, _ = run(config, make_requests(12, seed, *shape), "sync", abort_at)
        got, sched = run(config, make_requests(12, seed, *shape), mode, abort_at)
        assert got == expected, f"seed {seed}"
        statuses = {status for _, status in expected.values()}
        assert RequestStatus.FINISHED_ABORTED in statuses
        if name in ("recompute", "swap", "swap_small_pool", "priority"):
            assert sched.num_preemptions > 0


def test_the_scenarios_cover_eos_outside_stops_and_length() -> None:
    """The fake model's workload really exercises each kind of finish."""
    seen = set()
    for seed in range(4):
        result, _ = run({}, make_requests(12, seed), "eager", {})
        seen |= {status for _, status in result.values()}
        seen |= {"STOP" for tokens, _ in result.values() if STOP in tokens}
    assert {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, "STOP"} <= seen


def test_a_step_past_a_stop_is_dropped_and_its_blocks_freed_at_once() -> None:
    """A request that ends at step N (eos) was scheduled for step N+1 already: its blocks
    are free after N's commit, N+1's token is never appended, and the block N+1 fills
    (eos at position 3) is never registered in the prefix cache."""
    sched, worker = make_scheduler({"caching": True}), FakeWorker()
    prompt = [5, 6, 7]
    while sample(prompt) != EOS:
        prompt = [prompt[0] + 1, *prompt[1:]]
    req = Request("a", prompt, SamplingParams(max_tokens=5), eos_token_id=EOS)
    sched.add_request(req)
    first = sched.schedule()
    second = sched.schedule()  # NOTE: scheduled before the first step is committed
    assert second.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    sched.update_from_output(first, worker.execute(first))
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [EOS]
    assert sched.kv.usage == 0.0
    core = sched.update_from_output(second, worker.execute(second))
    assert core == [] and req.output_token_ids == [EOS]
    assert not sched.kv.block_pool.cached_block_hash_to_block
    sched.check_integrity()


def test_requests_known_to_end_are_not_scheduled_ahead() -> None:
    """max_tokens reached by the placeholders: the request gets no step past it."""
    sched = make_scheduler({})
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add_request(req)
    sched.schedule()
    assert sched.schedule().is_empty


def test_registration_waits_for_the_step_that_writes_the_block() -> None:
    """A block that a step in flight fills is not registered by the commit before it
    (were that step to fail, the cache would offer K/V nobody wrote)."""
    sched, worker = make_scheduler({"caching": True, "budget": 4}), FakeWorker()
    req = Request("a", list(range(10, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(req)
    first = sched.schedule()  # positions 0..3: block 0
    second = sched.schedule()  # positions 4..7: block 1, in flight at the first commit
    sched.update_from_output(first, worker.execute(first))
    assert len(sched.kv.block_pool.cached_block_hash_to_block) == 1
    sched.check_integrity()
    sched.update_from_output(second, worker.execute(second))
    assert len(sched.kv.block_pool.cached_block_hash_to_block) == 2


def test_the_flag_and_its_refusal_with_speculative_decoding() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"]))
    assert args.create_engine_config().scheduler.async_scheduling is True
    assert EngineArgs().create_engine_config().scheduler.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling and speculative_config"):
        EngineArgs(async_scheduling=True, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
