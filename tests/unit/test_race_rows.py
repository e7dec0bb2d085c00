"""race_rows (the sampler's random pick, and a sampled decode burst's): the C++ kernel's
exponential race picks token i with probability softmax(logits / t)_i; a temperature of 0
is the argmax; dividing by the temperature inside the kernel picks what torch's division
before it does (so `Sampler.plain` and the full sampler agree); low-precision logits pick as
their float32 values; NaN, infinite and masked logits are handled; bad input is refused."""
from __future__ import annotations

import pytest
import torch

from pagoda import ops
from pagoda.layers.sampler import Sampler, SamplingMetadata
from pagoda.ops import reference
from pagoda.sampling_params import SamplingParams
from tests.helpers import spy_on_extension

# row lengths: below one vector, whole vectors of 8 and 16 lanes, tails, the vocabulary
LENGTHS = (1, 7, 8, 15, 17, 1000, 49152, 49157)


def _case(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(rows, n, generator=g)
    temps = 0.1 + 1.9 * torch.rand(rows, generator=g)
    exps = torch.empty(rows, n).exponential_(generator=g)
    return logits, temps, exps


@pytest.mark.parametrize("n", LENGTHS)
def test_temperature_in_the_kernel_equals_torch_division_first(ext, n: int) -> None:
    logits, temps, exps = _case(9, n, n)
    got = ext.race_rows(logits, temps, exps)
    assert torch.equal(got, ext.race_rows(logits / temps.unsqueeze(1), None, exps))
    # The reference (softmax, then p / E) picks the same tokens away from rounding ties.
    assert torch.equal(got, reference.race_rows(logits, temps, exps))


def test_zero_temperature_rows_are_greedy(ext) -> None:
    logits, temps, exps = _case(6, 1000, 1)
    logits[0, [5, 70]] = 50.0  # equal maxima: the first
    temps[[0, 3]] = 0.0
    got = ext.race_rows(logits, temps, exps)
    assert got[0] == 5 and got[3] == logits[3].argmax()
    sampled = ext.race_rows(logits, temps.clamp_min(0.5), exps)
    assert torch.equal(got[[1, 2, 4, 5]], sampled[[1, 2, 4, 5]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_pick_as_their_float32(ext, dtype: torch.dtype) -> None:
    logits, temps, exps = _case(5, 49157, 2)
    low = logits.to(dtype)
    assert torch.equal(ext.race_rows(low, temps, exps), ext.race_rows(low.float(), temps, exps))


def test_frequencies_follow_the_softmax(ext) -> None:
    """Many draws of one row: each token's share within 5 standard errors of
    softmax(logits / t), at two temperatures and with the division done before."""
    draws, logits = 40_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    g = torch.Generator().manual_seed(3)
    for t in (0.7, 1.6):
        want = torch.softmax(logits.double() / t, dim=0)
        rows = logits.expand(draws, -1).contiguous()
        exps = torch.empty(draws, 6).exponential_(generator=g)
        for got in (ext.race_rows(rows, torch.full((draws,), t), exps),
                    ext.race_rows(rows / t, None, exps)):
            share = torch.bincount(got, minlength=6).double() / draws
            err = (want * (1 - want) / draws).sqrt()
            assert ((share - want).abs() <= 5 * err + 1e-4).all(), (t, share, want)


def test_nan_infinite_and_masked_logits(ext) -> None:
    logits, _, exps = _case(4, 100, 4)
    logits[0, [30, 60]] = float("nan")  # as argmax: the first NaN
    logits[1, [8, 9]] = float("inf")  # an infinite maximum: the first
    logits[2, :] = -float("inf")
    logits[2, [11, 77]] = 0.0  # masked but two: only those may win
    logits[3, :50] = -float("inf")
    got = ext.race_rows(logits, torch.ones(4), exps).tolist()
    assert got[0] == 30 and got[1] == 8 and got[2] in (11, 77) and got[3] >= 50
    many = logits[2:3].expand(2000, -1).contiguous()
    picks = ext.race_rows(many, None, torch.empty(2000, 100).exponential_()).unique().tolist()
    assert picks == [11, 77]


def test_refuses_bad_input(ext) -> None:
    logits, temps, exps = _case(3, 10, 5)
    with pytest.raises(RuntimeError, match="exps must be contiguous float32"):
        ext.race_rows(logits, temps, exps[:, :5])
    with pytest.raises(RuntimeError, match="exps must be contiguous float32"):
        ext.race_rows(logits, temps, exps.double())
    with pytest.raises(RuntimeError, match="temperature must be finite and non-negative"):
        ext.race_rows(logits, torch.tensor([1.0, -0.5, 1.0]), exps)
    with pytest.raises(RuntimeError, match="temperature must be a contiguous float32"):
        ext.race_rows(logits, temps[:2], exps)
    with pytest.raises(RuntimeError, match="logits must be a contiguous"):
        ext.race_rows(torch.zeros(3, 20)[:, ::2], temps, exps)


def test_op_dispatch_and_fallback(ext, monkeypatch) -> None:
    calls = spy_on_extension(ext, monkeypatch)
    logits, temps, exps = _case(3, 300, 6)
    assert torch.equal(ops.race_rows(logits, temps, exps),
                       reference.race_rows(logits, temps, exps))
    assert "race_rows" in calls
    calls.clear()
    strided = torch.randn(3, 600)[:, ::2]  # not contiguous: the reference
    ops.race_rows(strided, temps, exps)
    assert "race_rows" not in calls


def test_plain_sampler_picks_what_the_full_sampler_does(ext) -> None:
    """`Sampler.plain` (the runner's path when every row only has a temperature, and what a
    sampled burst repeats) picks the full sampler's tokens from the same seeded streams, with
    greedy and unseeded rows beside them, for float32 and bf16 logits."""
    vocab = 49152
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, seed=2), SamplingParams(temperature=1.0)]
    temps = torch.tensor([0.7, 0.0, 1.3, 1.0])
    for dtype in (torch.float32, torch.bfloat16):
        for step in range(4):
            logits = (3 * torch.randn(4, vocab, generator=torch.Generator().manual_seed(step))
                      ).to(dtype)
            gens_a = [torch.Generator().manual_seed(10 + step), None,
                      torch.Generator().manual_seed(20 + step), None]
            gens_b = [None if g is None else torch.Generator().manual_seed(g.initial_seed())
                      for g in gens_a]
            md = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, gens_a, set(), vocab,
                                        torch.device("cpu"))
            full = Sampler()(logits, md).sampled_token_ids
            plain = Sampler.plain(logits, temps, {0: gens_b[0], 2: gens_b[2]})
            assert full[[0, 1, 2]].tolist() == plain[[0, 1, 2]].tolist()
            assert plain[1] == logits[1].float().argmax()


def test_own_draws_follow_the_softmax(ext) -> None:
    """Rows that draw their own E (a seed >= 0): each row's draws differ (the row index is
    in the key), and the tokens' shares follow softmax(logits / t) within 5 standard errors."""
    draws, logits = 40_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for t, seed in ((0.7, 1), (1.6, 2**62 - 1)):
        want = torch.softmax(logits.double() / t, dim=0)
        rows = logits.expand(draws, -1).contiguous()
        got = ext.race_rows(rows, torch.full((draws,), t), None,
                            torch.full((draws,), seed, dtype=torch.int64))
        share = torch.bincount(got, minlength=6).double() / draws
        err = (want * (1 - want) / draws).sqrt()
        assert ((share - want).abs() <= 5 * err + 1e-4).all(), (t, share, want)


def test_own_draws_are_uniform_over_a_flat_row(ext) -> None:
    """Flat logits over 64 tokens at every element offset of a vector: a chi-square of the
    picks under 130 (df 63: p < 1e-6 for a uniform source), for tails too."""
    for n in (64, 61):
        draws = 64_000
        got = ext.race_rows(torch.zeros(draws, n), None, None,
                            torch.full((draws,), 12345, dtype=torch.int64))
        counts = torch.bincount(got, minlength=n).double()
        expected = draws / n
        assert ((counts - expected) ** 2 / expected).sum() < 130 + 2 * (n - 64)


def test_own_draws_repeat_with_their_seed(ext) -> None:
    logits, temps, exps = _case(64, 1000, 7)
    seeds = torch.full((64,), 99, dtype=torch.int64)
    first = ext.race_rows(logits, temps, None, seeds)
    assert torch.equal(first, ext.race_rows(logits, temps, None, seeds.clone()))
    other = ext.race_rows(logits, temps, None, torch.full((64,), 100, dtype=torch.int64))
    assert (first != other).sum() > 32
    # A row of seed -1 takes `exps`, the others their own draws.
    mixed = seeds.clone()
    mixed[[3, 10]] = -1
    got = ext.race_rows(logits, temps, exps, mixed)
    assert torch.equal(got[[3, 10]], ext.race_rows(logits, temps, exps)[[3, 10]])
    keep = torch.ones(64, dtype=torch.bool)
    keep[[3, 10]] = False
    assert torch.equal(got[keep], first[keep])


def test_own_draws_refuse_bad_seeds(ext) -> None:
    logits, temps, _ = _case(3, 10, 8)
    with pytest.raises(RuntimeError, match="row 1 has neither exps nor a seed"):
        ext.race_rows(logits, temps, None, torch.tensor([0, -1, 5]))
    with pytest.raises(RuntimeError, match="seeds must be a contiguous int64"):
        ext.race_rows(logits, temps, None, torch.tensor([0, 1]))
