"""penalize_rows (the sampler's logit_bias and penalties, and a penalised decode burst's):
the C++ kernel computes what the torch reference computes (the repetition penalty and the
bias bit for bit; the frequency term within a rounding, where the compiler may fuse its
product and sum), leaves masked tokens masked, and refuses bad tables; the sampler's CPU
path runs it."""
from __future__ import annotations

import pytest
import torch

from pagoda.layers.sampler import Penalties, Sampler, SamplingMetadata
from pagoda.ops import reference
from pagoda.sampling_params import SamplingParams
from tests.helpers import spy_on_extension

INF = float("inf")


def _tables(rows: int, n: int, seed: int) -> tuple[torch.Tensor, Penalties]:
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(rows, n, generator=g)
    x[0, :7] = -INF  # masked tokens (a min_tokens ban) stay masked
    counts = torch.randint(0, 4, (rows, n), generator=g).float()
    counts[counts < 3] = 0  # most tokens never came out
    seen = (counts > 0) | (torch.rand(rows, n, generator=g) < 0.05)  # and the prompt's
    bias_rows = torch.tensor([0, 1, 1, rows - 1])
    bias_ids = torch.tensor([3, 0, n - 1, 11 % n])
    pen = Penalties(1 + torch.rand(rows, generator=g), seen,
                    torch.rand(rows, generator=g) * 2 - 1, torch.rand(rows, generator=g) * 2 - 1,
                    counts, bias_rows, bias_ids, torch.tensor([5.0, -100.0, 100.0, 0.5]))
    return x, pen


@pytest.mark.parametrize("n", [7, 49157])
def test_kernel_computes_what_the_reference_computes(ext, n: int) -> None:
    x, pen = _tables(6, n, n)
    rep_only = pen._replace(frequency=None, presence=None, counts=None, bias_rows=None,
                            bias_ids=None, bias_values=None)
    bias_only = Penalties(*(None,) * 5, *pen[5:])
    for p in (rep_only, bias_only):  # one rounding each: equal bits
        assert torch.equal(ext.penalize_rows(x.clone(), *p),
                           reference.penalize_rows(x.clone(), *p))
    got = ext.penalize_rows(x.clone(), *pen)
    want = reference.penalize_rows(x.clone(), *pen)
    assert torch.equal(got.isinf(), want.isinf()) and (got[0, :7] == -INF).all()
    finite = want.isfinite()
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)
    untouched = ~pen.seen & (pen.counts == 0)
    untouched[pen.bias_rows, pen.bias_ids] = False
    assert torch.equal(got[untouched], x[untouched])


def test_refuses_bad_tables(ext) -> None:
    x, pen = _tables(3, 50, 1)
    with pytest.raises(RuntimeError, match="repetition comes with seen"):
        ext.penalize_rows(x, pen.repetition)
    with pytest.raises(RuntimeError, match="frequency, presence and counts come together"):
        ext.penalize_rows(x, None, None, pen.frequency, pen.presence)
    with pytest.raises(RuntimeError, match="seen must be a contiguous Bool"):
        ext.penalize_rows(x, pen.repetition, pen.seen[:, :10])
    with pytest.raises(RuntimeError, match=r"bias entry 1 \(row 1, token 50\) is outside"):
        ext.penalize_rows(x, *(None,) * 5, torch.tensor([0, 1]), torch.tensor([3, 50]),
                          torch.tensor([1.0, 2.0]))
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        ext.penalize_rows(x.bfloat16(), *pen)


def test_sampler_runs_the_kernel(ext, monkeypatch) -> None:
    """A batch with penalties and a bias samples through the kernel, and its greedy rows
    pick the penalised argmax."""
    calls = spy_on_extension(ext, monkeypatch)
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0], [1.0, 3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, logit_bias={3: 3.5})]
    md = SamplingMetadata.build(params, [[1], [1]], [[], []], [None, None], set(), 4,
                                torch.device("cpu"))
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, 3]
    assert "penalize_rows" in calls
