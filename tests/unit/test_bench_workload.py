"""The benchmark workload: seeded, in range, free of special tokens; static batch plans."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagoda.benchmarks.hf_baseline import (
    batch_sizes_to_run,
    batch_token_counts,
    best_at_largest,
    plan_batches,
)
from pagoda.benchmarks.throughput import DEFAULT_HF_BATCH_SIZES
from pagoda.benchmarks.workload import (
    WORKLOAD_PRESETS,
    make_workload,
    special_token_ids,
    workload_stats,
)


@dataclass
class _AddedToken:
    content: str
    special: bool


class _FakeTokenizer:
    def __init__(self) -> None:
        self.all_special_ids = [0, 1, 2]
        self.added_tokens_decoder = {
            0: _AddedToken("<unk>", True),
            1: _AddedToken("<s>", True),
            2: _AddedToken("</s>", True),
            3: _AddedToken("<file_sep>", True),
            4: _AddedToken("hello", False),
        }

    def __len__(self) -> int:
        return 12


def test_same_seed_same_workload() -> None:
    a = make_workload(20, (5, 9), (3, 7), seed=3, vocab_size=100)
    b = make_workload(20, (5, 9), (3, 7), seed=3, vocab_size=100)
    c = make_workload(20, (5, 9), (3, 7), seed=4, vocab_size=100)
    assert a == b
    assert a != c


def test_lengths_and_ids_in_range() -> None:
    workload = make_workload(200, (5, 9), (3, 7), seed=0, vocab_size=50, exclude_ids=[7])
    assert len(workload) == 200
    prompt_lens = {len(p) for p, _ in workload}
    output_lens = {o for _, o in workload}
    # 200 draws over 5 values: every length appears, and nothing outside the range.
    assert prompt_lens == set(range(5, 10))
    assert output_lens == set(range(3, 8))
    ids = {t for p, _ in workload for t in p}
    assert ids <= set(range(50)) - {7}


def test_tokenizer_special_tokens_never_drawn() -> None:
    tok = _FakeTokenizer()
    assert special_token_ids(tok) == {0, 1, 2, 3}
    workload = make_workload(50, (20, 20), (1, 1), seed=0, tokenizer=tok)
    ids = {t for p, _ in workload for t in p}
    # vocab size comes from len(tokenizer); the non-special added token 4 stays allowed.
    assert ids == set(range(4, 12))


def test_fixed_lengths_and_stats() -> None:
    workload = make_workload(3, (4, 4), (6, 6), seed=1, vocab_size=10)
    stats = workload_stats(workload)
    assert (stats.num_requests, stats.num_prompt_tokens, stats.num_output_tokens) == (3, 12, 18)
    assert (stats.min_prompt_len, stats.max_prompt_len) == (4, 4)
    assert (stats.min_output_len, stats.max_output_len) == (6, 6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": None}, "vocab_size"),
        ({"vocab_size": 10, "input_len": (5, 4)}, "input_len"),
        ({"vocab_size": 10, "output_len": (0, 4)}, "output_len"),
        ({"vocab_size": 2, "exclude_ids": [0, 1]}, "no token ids"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_workload(2, **{"input_len": (1, 2), "output_len": (1, 2), **kwargs})


def test_static_batches_in_order_and_sorted() -> None:
    workload = [([1] * n, o) for n, o in [(5, 10), (2, 3), (9, 4), (1, 8), (4, 1)]]
    assert plan_batches(workload, 2, sort_by_length=False) == [[0, 1], [2, 3], [4]]
    assert plan_batches(workload, 2, sort_by_length=True) == [[3, 1], [4, 0], [2]]
    # A batch runs to its longest output; only the requested tokens count.
    assert batch_token_counts(workload, [0, 1]) == (20, 13)
    assert batch_token_counts(workload, [4]) == (1, 1)


def test_transformers_sweep_reaches_the_whole_short_workload() -> None:
    """transformers' best static batch on the short workload was its whole request count
    (64) on the AMX Xeon, past a sweep that stopped at 32: the default sweep reaches it, and
    sizes past the request count collapse to one run of all of them."""
    num_requests = WORKLOAD_PRESETS["short"][0]
    assert num_requests in batch_sizes_to_run(DEFAULT_HF_BATCH_SIZES, num_requests)
    assert batch_sizes_to_run([64, 8, 128, 16], 20) == [8, 16, 20]
    with pytest.raises(ValueError, match="batch sizes"):
        batch_sizes_to_run([0, 8], 20)


def test_best_at_the_largest_batch_is_flagged_only_below_the_request_count() -> None:
    assert best_at_largest(32, [8, 16, 32], 64)
    assert not best_at_largest(64, [8, 16, 32, 64], 64)
    assert not best_at_largest(16, [8, 16, 32], 64)
