"""argmax_rows (the sampler's greedy pick, and the exponential race's): the C++ kernel picks
exactly torch.argmax's index, ties, signed zeros, infinities and NaNs included, and the
sampler runs it."""
from __future__ import annotations

import pytest
import torch

from pagoda import ops
from pagoda.layers.sampler import Sampler, SamplingMetadata
from pagoda.sampling_params import SamplingParams
from tests.helpers import spy_on_extension

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# row lengths: below one vector, whole vectors of 8 and 16 lanes, tails, the vocabulary
LENGTHS = (1, 7, 8, 15, 16, 17, 33, 49152, 49157)


def _want(x: torch.Tensor) -> torch.Tensor:
    return x.double().argmax(dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_random_rows_equal_torch(ext, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    rows = 64 if n >= 49152 else 5  # 64 x 49,152 takes the parallel path
    x = torch.randn(rows, n, generator=g).to(dtype)
    assert torch.equal(ext.argmax_rows(x), _want(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_zeros_infinities_and_nans(ext, dtype: torch.dtype) -> None:
    n = 53  # three 16-lane vectors and a tail of 5
    nan, inf = float("nan"), float("inf")
    cases = []
    for at in [(3, 40), (17, 50), (50, 52), (0, 16, 32)]:  # equal maxima: the first wins
        row = torch.full((n,), -5.0)
        row[list(at)] = 2.5
        cases.append(row)
    zeros = torch.full((n,), -1.0)
    zeros[[9, 30]] = torch.tensor([-0.0, 0.0])  # -0 == +0: the first
    cases.append(zeros)
    zeros2 = zeros.clone()
    zeros2[[9, 30]] = torch.tensor([0.0, -0.0])
    cases.append(zeros2)
    cases.append(torch.full((n,), -inf))  # all -inf: index 0
    infs = torch.randn(n)
    infs[[20, 44]] = inf
    cases.append(infs)
    for at in [(5,), (40, 7), (51,), (18, 50)]:  # a NaN is the maximum: the first NaN
        row = torch.randn(n)
        row[list(at)] = nan
        row[2] = inf
        cases.append(row)
    x = torch.stack(cases).to(dtype)
    got = ext.argmax_rows(x)
    want = x.float().argmax(dim=-1)
    assert torch.equal(got, want), (got, want)
    assert got.tolist()[:7] == [3, 17, 50, 0, 9, 9, 0]


def test_refuses_bad_input(ext) -> None:
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.argmax_rows(torch.zeros(4, 6)[:, ::2])
    with pytest.raises(RuntimeError, match="n > 0"):
        ext.argmax_rows(torch.zeros(3, 0))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ext.argmax_rows(torch.zeros(2, 5, dtype=torch.float64))


def test_op_dispatch_and_fallback(ext, monkeypatch) -> None:
    calls = spy_on_extension(ext, monkeypatch)
    x = torch.randn(3, 100).to(torch.bfloat16)
    assert torch.equal(ops.argmax_rows(x), _want(x))
    assert "argmax_rows" in calls
    calls.clear()
    strided = torch.randn(3, 200)[:, ::2]  # not contiguous: the reference
    assert torch.equal(ops.argmax_rows(strided), _want(strided))
    assert "argmax_rows" not in calls


def test_sampler_picks_through_the_kernel(ext, monkeypatch) -> None:
    """Greedy rows take the argmax kernel and the random rows' exponential race its own
    (race_rows), and the greedy ids are torch.argmax's."""
    calls = spy_on_extension(ext, monkeypatch)
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    gens = [None, torch.Generator().manual_seed(3), None, None]
    md = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, gens, set(), 1000,
                                torch.device("cpu"))
    out = Sampler()(logits.to(torch.bfloat16), md)
    greedy = logits.to(torch.bfloat16).float().argmax(dim=-1)
    assert out.sampled_token_ids[0] == greedy[0] and out.sampled_token_ids[2] == greedy[2]
    assert calls.count("argmax_rows") == 1 and calls.count("race_rows") == 1
