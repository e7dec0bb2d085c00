"""truncate_rows (the sampler's min-p, top-k and top-p, and a truncated decode burst's): the
C++ kernel cuts the tokens the definitions cut, computed here in float64 from the ranks,
except where a rounding decides; the torch reference agrees with it on the same terms; the
race over a cut row picks only kept tokens, in their renormalised shares; `Sampler.plain`
with truncation picks the full sampler's tokens; bad settings are refused."""
from __future__ import annotations

import pytest
import torch

from pagoda import ops
from pagoda.layers.sampler import Sampler, SamplingMetadata, Truncation
from pagoda.ops import reference
from pagoda.sampling_params import SamplingParams
from tests.helpers import spy_on_extension

INF = float("inf")
# top-p's mass above a token within this of p, or min-p's ratio within this of min_p: a
# rounding may decide (the kernel sums weights of its own exp, torch its softmax).
BORDER = 1e-5


def _exact_keep(x: torch.Tensor, k: int, p: float, min_p: float) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(kept, borderline) [n] bool of one row by the definitions, in float64: min-p cuts
    probabilities below min_p times the maximum, top-k keeps the k first in rank (value
    descending, index ascending), top-p keeps a token while the mass ranked above it is
    below p."""
    n = x.numel()
    xd = x.double()
    kept = xd > -INF
    border = torch.zeros(n, dtype=torch.bool)
    if min_p > 0:
        ratio = (xd - xd.max()).exp()
        kept &= ratio >= min_p
        border |= (ratio - min_p).abs() <= BORDER
    # NOTE: a stable sort of -x ranks equal values by index, as the kernel does.
    order = torch.sort(-xd.masked_fill(~kept, -INF), stable=True).indices
    rank = torch.empty(n, dtype=torch.int64)
    rank[order] = torch.arange(n)
    if 0 < k < n:
        kept &= rank < k
    if p < 1:
        w = (xd - xd.max()).exp().masked_fill(~kept, 0.0)
        sorted_w = w[order]
        above = (sorted_w.cumsum(0) - sorted_w) / w.sum()
        cut = torch.zeros(n, dtype=torch.bool)
        cut[order] = (above >= p) & (torch.arange(n) > 0)
        kept &= ~cut
        near = torch.zeros(n, dtype=torch.bool)
        near[order] = (above - p).abs() <= BORDER
        border |= near
    return kept, border


def _rows(scale: float, rows: int, n: int, seed: int) -> torch.Tensor:
    return scale * torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))


def _check_row(got: torch.Tensor, x: torch.Tensor, k: int, p: float, min_p: float) -> None:
    kept = got > -INF
    assert torch.equal(got[kept], x[kept]), "kept tokens keep their values"
    want, border = _exact_keep(x, k, p, min_p)
    assert not ((kept != want) & ~border).any(), (k, p, min_p)
    assert kept.any()


# spreads from flat (many thousands in the nucleus: the bucketed top-p) to peaked
@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])
def test_kernel_cuts_what_the_definitions_cut(ext, scale: float) -> None:
    rows, n = 12, 49157
    x = _rows(scale, rows, n, int(scale * 10))
    settings = [(0, 0.9, 0.0), (40, 1.0, 0.0), (0, 1.0, 0.05), (40, 0.8, 0.0),
                (0, 0.95, 0.02), (300, 0.7, 0.01), (1, 0.5, 0.0), (0, 0.999, 0.0),
                (5000, 0.99, 0.0), (0, 0.5, 0.0), (n, 1.0, 0.0), (0, 0.2, 0.3)]
    top_k = torch.tensor([s[0] for s in settings])
    top_p = torch.tensor([s[1] for s in settings])
    min_p = torch.tensor([s[2] for s in settings])
    got = ext.truncate_rows(x.clone(), top_k, top_p, min_p)
    for r, (k, p, mp) in enumerate(settings):
        _check_row(got[r], x[r], k, p, mp)
    assert torch.equal(got[10], x[10])  # k = n, p = 1, min_p = 0: nothing is cut
    assert (got[6] > -INF).sum() == 1  # top-k 1: the argmax only


def test_reference_agrees_but_where_a_rounding_decides(ext) -> None:
    x = _rows(3.0, 8, 20000, 7)
    top_k = torch.tensor([0, 50, 0, 200, 0, 10, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.8, 0.95, 0.5, 0.6, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.0])
    got = ext.truncate_rows(x.clone(), top_k, top_p, min_p)
    want = reference.truncate_rows(x.clone(), top_k, top_p, min_p)
    for r in range(8):
        _, border = _exact_keep(x[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert not (((got[r] > -INF) != (want[r] > -INF)) & ~border).any(), r
    assert torch.equal(got[7], x[7])


def test_ties_and_special_values(ext) -> None:
    x = torch.zeros(5, 40)
    x[0, [3, 9, 20, 30]] = 2.0  # four equal maxima, top-k 2: the first two by index
    x[1, [5, 6]] = float("nan")  # a NaN row is left as it is (the race takes its argmax)
    x[2, 10:] = -INF  # masked tokens stay cut; the others are all equal
    x[3, 0] = INF  # an infinite maximum: left as it is
    x[4] = torch.arange(40.0)  # top-p 0 keeps the first token only
    got = ext.truncate_rows(x.clone(), torch.tensor([2, 3, 4, 1, 0]),
                            torch.tensor([1.0, 0.5, 1.0, 0.5, 0.0]), None)
    assert (got[0] > -INF).nonzero().squeeze(1).tolist() == [3, 9]
    assert torch.equal(got[1].isnan(), x[1].isnan()) and torch.equal(got[1][~x[1].isnan()],
                                                                     x[1][~x[1].isnan()])
    assert (got[2] > -INF).nonzero().squeeze(1).tolist() == [0, 1, 2, 3]
    assert torch.equal(got[3], x[3])
    assert (got[4] > -INF).nonzero().squeeze(1).tolist() == [39]


def test_race_over_a_cut_row(ext) -> None:
    """The race with truncation picks what the race over truncate_rows(logits / t) picks,
    for exps and own draws, float32 and bf16; only kept tokens win, in their
    renormalised shares."""
    rows, n = 16, 5003
    x = _rows(3.0, rows, n, 11)
    temps = 0.3 + torch.rand(rows, generator=torch.Generator().manual_seed(12))
    temps[0] = 0.0  # greedy rows skip the cut
    exps = torch.empty(rows, n).exponential_(generator=torch.Generator().manual_seed(13))
    seeds = torch.arange(rows) * 31 + 5
    seeds[::3] = -1
    cut = Truncation(torch.randint(0, 60, (rows,), generator=torch.Generator().manual_seed(14)),
                     0.6 + 0.4 * torch.rand(rows, generator=torch.Generator().manual_seed(15)),
                     torch.where(torch.arange(rows) % 2 == 0, 0.02, 0.0))
    for low in (x, x.bfloat16()):
        got = ext.race_rows(low, temps, exps, seeds, *cut)
        scaled = low.float() / torch.where(temps == 0, 1.0, temps).unsqueeze(1)
        kept = ext.truncate_rows(scaled, *cut)
        want = ext.race_rows(kept, None, exps, seeds)
        assert torch.equal(got[1:], want[1:]) and got[0] == low[0].float().argmax()
        assert (kept[1:].gather(1, got[1:].unsqueeze(1)) > -INF).all()
    draws, logits = 40_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    many = logits.expand(draws, -1).contiguous()
    for args, keep in (((torch.full((draws,), 3), None, None), 3),
                       ((None, torch.full((draws,), 0.8), None), 3),
                       ((None, None, torch.full((draws,), 0.2)), 3)):
        picks = ext.race_rows(many, torch.ones(draws), None,
                              torch.arange(draws, dtype=torch.int64) + 1, *args)
        want = torch.softmax(logits[:keep].double(), dim=0)
        share = torch.bincount(picks, minlength=6).double() / draws
        err = (want * (1 - want) / draws).sqrt()
        assert (share[keep:] == 0).all() and ((share[:keep] - want).abs() <= 5 * err).all()


def test_plain_sampler_with_truncation_picks_what_the_full_sampler_does(ext) -> None:
    """The runner's path when every row is `plain` (a burst repeats it) and the full
    sampler's (a batch beside a request with logprobs): the same seeded tokens, so a seeded
    request's tokens do not depend on the batch it runs in."""
    vocab = 49152
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_k=30, min_p=0.02, seed=2),
              SamplingParams(temperature=1.0, top_k=50, top_p=0.95),
              SamplingParams(temperature=0.9, seed=3)]
    temps = torch.tensor([p.temperature for p in params])
    cut = Truncation.of(params)
    assert cut is not None and cut.top_k.tolist() == [0, 0, 30, 50, 0]
    assert Truncation.of([SamplingParams(temperature=0.8, top_k=-1)]) is None
    for step in range(3):
        for spread in (1.0, 4.0):
            logits = spread * torch.randn(5, vocab, generator=torch.Generator().manual_seed(step))
            gens_a = [None if p.seed is None else torch.Generator().manual_seed(p.seed + step)
                      for p in params]
            gens_b = {i: torch.Generator().manual_seed(g.initial_seed())
                      for i, g in enumerate(gens_a) if g is not None}
            md = SamplingMetadata.build(params, [[1]] * 5, [[]] * 5, gens_a, set(), vocab,
                                        torch.device("cpu"))
            full = Sampler()(logits, md).sampled_token_ids
            plain = Sampler.plain(logits, temps, gens_b, cut)
            assert full[[0, 1, 2, 4]].tolist() == plain[[0, 1, 2, 4]].tolist()
            assert plain[1] == logits[1].argmax()


def test_refuses_bad_settings(ext) -> None:
    x = torch.randn(3, 10)
    with pytest.raises(RuntimeError, match="top_p must be in"):
        ext.truncate_rows(x, None, torch.tensor([0.5, 1.5, 1.0]), None)
    with pytest.raises(RuntimeError, match="min_p must be a contiguous float32"):
        ext.truncate_rows(x, None, None, torch.zeros(2))
    with pytest.raises(RuntimeError, match="top_k must be a contiguous int64"):
        ext.truncate_rows(x, torch.ones(3), None, None)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        ext.truncate_rows(x.double(), None, None, None)
    with pytest.raises(RuntimeError, match="race_rows: top_p must be in"):
        ext.race_rows(x, torch.ones(3), None, torch.zeros(3, dtype=torch.int64), None,
                      torch.tensor([0.5, -1.0, 1.0]))


def test_op_dispatch_and_fallback(ext, monkeypatch) -> None:
    calls = spy_on_extension(ext, monkeypatch)
    x = _rows(8.0, 3, 300, 16)
    top_p = torch.tensor([0.9, 0.5, 1.0])
    got = ops.truncate_rows(x.clone(), None, top_p, None)
    assert "truncate_rows" in calls
    assert torch.equal(got, reference.truncate_rows(x.clone(), None, top_p, None))
    calls.clear()
    ops.truncate_rows(x.double(), None, top_p, None)  # float64: the reference
    assert "truncate_rows" not in calls
