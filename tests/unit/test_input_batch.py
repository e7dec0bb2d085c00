"""The runner's persistent input batch: slots reused after a finish, the scheduler's diffs
applied in place, a step gathered from the arrays (ids, positions, slots), histories handed
to the sampler as views (no copy), and only penalty rows' histories read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.attention.backend import get_backend
from pagoda.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.layers.sampler import SamplingMetadata
from pagoda.sampling_params import SamplingParams
from pagoda.worker import model_runner
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.model_runner import ModelRunner

BS, VOCAB = 4, 50


class NextIdModel:
    """Hidden state = the token id; the logits make (id + 1) % VOCAB the clear argmax."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], list[int]]] = []

    def __call__(self, input_ids, positions, kv_caches, md):
        self.calls.append((input_ids.tolist(), positions.tolist(), md.slot_mapping.tolist()))
        return input_ids.float().unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = hidden[:, 0].long()
        logits = torch.zeros(len(ids), VOCAB)
        logits[torch.arange(len(ids)), (ids + 1) % VOCAB] = 10.0
        return logits


def make_runner(max_num_reqs: int = 2) -> tuple[ModelRunner, NextIdModel]:
    model = NextIdModel()
    runner = ModelRunner(model, [], get_backend("torch_paged"), BS, VOCAB, set(),
                         torch.device("cpu"), torch.float32, max_num_reqs=max_num_reqs,
                         max_model_len=32, max_num_batched_tokens=64)
    return runner, model


def new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0,
        params: SamplingParams | None = None) -> NewRequestData:
    return NewRequestData(req_id, tokens, len(tokens), (blocks,), computed,
                          params or SamplingParams(temperature=0.0), False)


def sched_out(new_reqs=(), cached=(), num_scheduled=None, finished=(), preempted=()):
    num_scheduled = num_scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=set(finished), preempted_req_ids=set(preempted),
    )


def test_slots_are_reused_after_finish() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=8, max_blocks_per_req=2)
    assert batch.add_request("a", [1, 2, 3], 3, ([5],), SamplingParams(), False) == 0
    assert batch.add_request("b", [4], 1, ([6],), SamplingParams(), False) == 1
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request("c", [7], 1, ([7],), SamplingParams(), False)
    assert batch.remove_request("a") == 0
    assert batch.remove_request("a") is None
    assert batch.add_request("c", [7, 8], 2, ([9],), SamplingParams(), False) == 0
    assert batch.token_ids[0, :2].tolist() == [7, 8] and batch.num_tokens[0] == 2
    assert batch.block_table[0, :1].tolist() == [9] and batch.num_blocks[0] == 1
    assert batch.req_id_to_slot == {"b": 1, "c": 0}


def test_steps_apply_diffs_and_gather_from_the_arrays() -> None:
    runner, model = make_runner()
    # Step 1: two prefills. Blocks of 4 tokens: "a" in blocks [3, 1], "b" in block [2].
    out = runner.execute_model(sched_out(
        [new("a", [5, 6, 7, 8, 9], [3, 1]), new("b", [10, 11], [2])],
        num_scheduled={"a": 5, "b": 2}))
    assert model.calls[-1] == ([5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 0, 1],
                               [12, 13, 14, 15, 4, 8, 9])
    assert out.sampled_token_ids == {"a": [10], "b": [12]}
    # Step 2: decodes, as diffs; "b" gets no block, "a" none either.
    out = runner.execute_model(sched_out(
        cached=[CachedRequestData("a", ([],), 5), CachedRequestData("b", ([],), 2)],
        num_scheduled={"a": 1, "b": 1}))
    assert model.calls[-1] == ([10, 12], [5, 2], [5, 10])
    assert out.sampled_token_ids == {"a": [11], "b": [13]}
    # Step 3: "b" crosses into a new block (7); "a" finishes; "c" takes "a"'s slot.
    out = runner.execute_model(sched_out(
        [new("c", [20, 21, 22], [0])], [CachedRequestData("b", ([7],), 3)],
        num_scheduled={"b": 1, "c": 3}, finished=["a"]))
    batch = runner.input_batch
    assert batch.req_id_to_slot == {"b": 1, "c": 0}
    assert batch.block_table[1, :2].tolist() == [2, 7]
    # Decode "b" first (position 3, slot 2 * 4 + 3), then "c"'s prefill.
    assert model.calls[-1] == ([13, 20, 21, 22], [3, 0, 1, 2], [11, 0, 1, 2])
    assert out.sampled_token_ids == {"b": [14], "c": [23]}
    assert batch.token_ids[1, : batch.num_tokens[1]].tolist() == [10, 11, 12, 13, 14]


def test_partial_prefill_chunk_samples_nothing() -> None:
    runner, model = make_runner()
    out = runner.execute_model(sched_out([new("a", [5, 6, 7, 8, 9], [3, 1])],
                                         num_scheduled={"a": 3}))
    assert out.sampled_token_ids == {}
    out = runner.execute_model(sched_out(cached=[CachedRequestData("a", ([],), 3)],
                                         num_scheduled={"a": 2}))
    assert model.calls[-1] == ([8, 9], [3, 4], [15, 4])
    assert out.sampled_token_ids == {"a": [10]}


def test_sampler_gets_views_of_the_token_array(monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-step copy of any request's history: the sampler is handed views."""
    seen: list[tuple[list, list]] = []

    class Spy(SamplingMetadata):
        @classmethod
        def build(cls, params, prompt_token_ids, output_token_ids, *args, **kwargs):
            seen.append((prompt_token_ids, output_token_ids))
            return SamplingMetadata.build(params, prompt_token_ids, output_token_ids,
                                          *args, **kwargs)

    monkeypatch.setattr(model_runner, "SamplingMetadata", Spy)
    runner, _ = make_runner()
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    runner.execute_model(sched_out([new("a", [5, 6], [0], params=penalised), new("b", [8], [1])],
                                   num_scheduled={"a": 2, "b": 1}))
    runner.execute_model(sched_out(
        cached=[CachedRequestData("a", ([],), 2), CachedRequestData("b", ([],), 1)],
        num_scheduled={"a": 1, "b": 1}))
    token_ids = runner.input_batch.token_ids
    prompts, outputs = seen[-1]
    # Both decode: rows in the scheduler's order, "a" ([5, 6] -> 7) then "b" ([8] -> 9).
    assert [p.tolist() for p in prompts] == [[5, 6], [8]]
    assert [o.tolist() for o in outputs] == [[7], [9]]
    for view in (*prompts, *outputs):
        assert isinstance(view, np.ndarray) and np.shares_memory(view, token_ids)


class Unreadable:
    """A history of known length that fails if anything reads its tokens."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise AssertionError("a history without penalties was read")

    def __array__(self, *args, **kwargs):
        raise AssertionError("a history without penalties was read")

    def __getitem__(self, item):
        raise AssertionError("a history without penalties was read")


def test_sampler_reads_only_penalty_rows_histories() -> None:
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, min_tokens=3)]
    md = SamplingMetadata.build(
        params, [[1, 2], Unreadable(4)], [[2, 3], Unreadable(1)], [None, None], {0}, 6,
        torch.device("cpu"))
    assert md.seen_token_mask[0].tolist() == [False, True, True, True, False, False]
    assert not md.seen_token_mask[1].any()
    assert md.output_token_counts[0].tolist() == [0, 0, 1, 1, 0, 0]
    # Row 1 has 1 of its min_tokens 3: its stop token (eos 0) is banned, by length alone.
    assert md.banned_tokens[0].tolist() == [1] and md.banned_tokens[1].tolist() == [0]


def test_a_step_beyond_the_given_blocks_is_refused() -> None:
    runner, _ = make_runner()
    with pytest.raises(RuntimeError, match="needs 2 blocks"):
        runner.execute_model(sched_out([new("a", [5, 6, 7, 8, 9], [3])],
                                       num_scheduled={"a": 5}))
