"""The quantization algorithms of `pagoda quantize`: the RTN grid, GPTQ's error feedback
(lower output error than RTN on correlated inputs), act_order's g_idx, AWQ's search and
clipping never worse than RTN on their own objective."""

from __future__ import annotations

import pytest
import torch

from pagoda.quant.calibrate import awq
from pagoda.quant.calibrate.gptq import HessianAccumulator, gptq_quantize
from pagoda.quant.calibrate.rtn import QuantSpec, fit_params, quantize_codes, quantize_rtn
from pagoda.quant.calibrate.runner import CalibrationConfig, _Features


def correlated_inputs(tokens: int, k: int, rank: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, rank, generator=g)
    return base @ torch.randn(rank, k, generator=g) + 0.1 * torch.randn(tokens, k, generator=g)


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return (x @ w_hat.T - x @ w.T).pow(2).mean().item()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_grid_bounds_the_rounding_error(sym, bits):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec(bits, 32, sym)
    qt = quantize_rtn(w, spec)
    assert qt.codes.dtype == torch.uint8 and int(qt.codes.max()) <= spec.maxq
    assert torch.equal(qt.scales, qt.scales.to(torch.float16).float())
    if sym:
        assert bool((qt.zeros == 1 << (bits - 1)).all())
    # Round to nearest: half a step on average (uniform rounding error has mean 1/4), and
    # never a full step (only the grid's edges, where the code saturates, exceed a half).
    err = (qt.dequantize() - w).abs() / qt.scales[:, qt.g_idx]
    assert bool((err <= 1.0 + 1e-4).all())
    assert err.mean().item() < 0.3


@pytest.mark.parametrize("sym,min_zero", [(True, 0), (False, 0), (False, 1)])
def test_rtn_fits_all_groups_at_once_as_one_by_one(sym, min_zero):
    # quantize_rtn fits every group in one [N * G, gl] call: identical to fitting each
    # group's [N, gl] columns on its own.
    w = torch.randn(40, 192, generator=torch.Generator().manual_seed(4))
    w[:3, :32] = w[:3, :32].abs()  # groups without a negative weight (the min_zero refit)
    spec = QuantSpec(4, 32, sym, min_zero=min_zero)
    qt = quantize_rtn(w, spec)
    for g in range(192 // 32):
        cols = w[:, g * 32 : (g + 1) * 32]
        scale, zero = fit_params(cols, spec)
        assert torch.equal(qt.scales[:, g], scale) and torch.equal(qt.zeros[:, g], zero)
        assert torch.equal(qt.codes[:, g * 32 : (g + 1) * 32].long(),
                           quantize_codes(cols, scale, zero, spec.maxq).long())


@pytest.mark.parametrize("sym,min_zero", [(True, 0), (False, 1)])
def test_mse_clip_never_worse_than_min_max(sym, min_zero):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(256, 64, generator=g) * torch.rand(256, 1, generator=g)
    w[::7, 0] *= 6.0  # outliers: the search should clip these rows' ranges
    plain = QuantSpec(4, 64, sym, min_zero=min_zero)
    searched = QuantSpec(4, 64, sym, min_zero=min_zero, mse_clip=True)

    def row_error(spec):
        return (quantize_rtn(w, spec).dequantize() - w).pow(2).sum(1)

    qt = quantize_rtn(w, searched)
    assert torch.equal(qt.scales, qt.scales.to(torch.float16).float())
    assert int(qt.zeros.min()) >= min_zero and int(qt.zeros.max()) <= 15
    assert bool((row_error(searched) <= row_error(plain)).all())
    assert row_error(searched).sum() < 0.97 * row_error(plain).sum()
    assert bool((qt.scales < quantize_rtn(w, plain).scales).any())


def test_fit_params_constant_row_is_finite():
    scale, zero = fit_params(torch.zeros(3, 8), QuantSpec(4, 8, False))
    assert bool((zero == 0).all())  # the grid of an all-zero row starts at zero
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())


def test_group_size_must_divide_the_input():
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        quantize_rtn(torch.randn(4, 64), QuantSpec(4, 48, True))
    with pytest.raises(ValueError, match="bits"):
        quantize_rtn(torch.randn(4, 64), QuantSpec(3, 32, True))


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_error_lower_than_rtn_on_correlated_inputs(sym):
    k, n = 256, 64
    x = correlated_inputs(2048, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    acc = HessianAccumulator(k)
    for chunk in x.split(500):
        acc.add(chunk)
    assert torch.allclose(acc.hessian, 2 * x.double().T @ x.double() / x.shape[0], rtol=1e-9)
    spec = QuantSpec(4, 64, sym)
    rtn = output_error(x, w, quantize_rtn(w, spec).dequantize())
    gptq = output_error(x, w, gptq_quantize(w, acc.hessian, spec).dequantize())
    act = output_error(x, w, gptq_quantize(w, acc.hessian, spec, act_order=True).dequantize())
    assert gptq < 0.25 * rtn
    assert act < gptq


def test_gptq_act_order_groups_follow_the_hessian_diagonal():
    k, n, gs = 128, 16, 32
    x = correlated_inputs(512, k) * torch.linspace(0.1, 3.0, k)
    acc = HessianAccumulator(k)
    acc.add(x)
    qt = gptq_quantize(torch.randn(n, k), acc.hessian, QuantSpec(4, gs, True), act_order=True)
    order = torch.argsort(torch.diag(acc.hessian), descending=True, stable=True)
    assert torch.equal(qt.g_idx[order], torch.arange(k) // gs)
    assert torch.equal(torch.bincount(qt.g_idx), torch.full((k // gs,), gs))
    # The codes sit in the weight's own column order: each column on its group's grid.
    deq = qt.dequantize()
    assert torch.equal(deq, (qt.codes.float() - qt.zeros[:, qt.g_idx]) * qt.scales[:, qt.g_idx])


def test_gptq_static_groups_keep_column_order_groups():
    k, n, gs = 128, 24, 32
    x = correlated_inputs(1024, k) * torch.linspace(0.1, 3.0, k)
    acc = HessianAccumulator(k)
    acc.add(x)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(8))
    spec = QuantSpec(4, gs, False, min_zero=1)
    qt = gptq_quantize(w, acc.hessian, spec, act_order=True, static_groups=True)
    # g_idx unpermuted, and every group's grid the one RTN fits on the weight as given.
    assert torch.equal(qt.g_idx, torch.arange(k) // gs)
    rtn = quantize_rtn(w, spec)
    assert torch.equal(qt.scales, rtn.scales) and torch.equal(qt.zeros, rtn.zeros)
    assert not torch.equal(qt.codes, rtn.codes)  # the error feedback moved codes
    assert output_error(x, w, qt.dequantize()) < 0.5 * output_error(x, w, rtn.dequantize())


def test_gptq_without_error_feedback_is_rtn():
    # A diagonal Hessian couples no columns: GPTQ's updates vanish and it rounds to nearest.
    k = 64
    w = torch.randn(8, k)
    spec = QuantSpec(4, 16, False)
    qt = gptq_quantize(w, torch.eye(k, dtype=torch.float64), spec)
    assert torch.equal(qt.codes, quantize_rtn(w, spec).codes)


def test_awq_linear_search_by_gram_picks_what_the_direct_search_picks():
    # The Gram-matrix search scores trace(D X^T X D^T): the direct search's mean squared
    # output error, so it picks the same alpha (and scales) for stacked linears.
    x = correlated_inputs(1024, 128)
    x[:, :5] *= torch.tensor([40.0, 25.0, 12.0, 6.0, 3.0])
    g = torch.Generator().manual_seed(9)
    weights = [torch.randn(96, 128, generator=g), torch.randn(32, 128, generator=g)]
    spec = QuantSpec(4, 32, False)

    def stacked(x, ws):
        return torch.cat([x @ w.T for w in ws], dim=-1)

    s_direct, alpha_direct = awq.search_scales(x, x.abs().mean(0), weights, stacked, spec)
    s_gram, alpha_gram = awq.search_scales_linear(x, x.abs().mean(0), weights, spec)
    assert alpha_direct > 0 and alpha_gram == alpha_direct
    assert torch.equal(s_gram, s_direct)


def test_awq_search_never_worse_than_rtn():
    k = 128
    x = correlated_inputs(1024, k)
    x[:, :4] *= 30.0  # a few salient channels, as in real activations
    w = torch.randn(96, k, generator=torch.Generator().manual_seed(3))
    spec = QuantSpec(4, 32, False)

    def block(x, ws):
        return x @ ws[0].T

    s, alpha = awq.search_scales(x, x.abs().mean(0), [w], block, spec)
    scaled = (quantize_rtn(w * s, spec).dequantize() / s)
    rtn = output_error(x, w, quantize_rtn(w, spec).dequantize())
    assert alpha > 0
    assert output_error(x, w, scaled) < rtn
    bound = awq.search_clip(x, w, spec)
    assert bool((bound <= w.abs().reshape(96, 4, 32).amax(-1) + 0).all())
    clipped = quantize_rtn(awq.apply_clip(w, bound, spec), spec).dequantize()
    xs = x[:: max(1, x.shape[0] // awq.CLIP_TOKENS)][: awq.CLIP_TOKENS]
    assert output_error(xs, w, clipped) <= output_error(xs, w, quantize_rtn(w, spec).dequantize())


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "smoothquant"}, "method must be one of"),
    ({"spec": QuantSpec(3, 32, True)}, "bits must be 2, 4 or 8"),
    ({"method": "rtn", "act_order": True}, "act_order and static_groups are GPTQ options"),
    ({"method": "awq", "spec": QuantSpec(4, 32, False), "static_groups": True},
     "act_order and static_groups are GPTQ options"),
    ({"damp_percent": 0.0}, "damp_percent"),
    ({"method": "awq", "spec": QuantSpec(4, 32, True)}, "zero point"),
    ({"method": "awq", "spec": QuantSpec(4, 32, False), "awq_search_tokens": 0},
     "awq_search_tokens"),
])
def test_calibration_config_errors_name_the_field(kwargs, match):
    fields = {"method": "gptq", "spec": QuantSpec(4, 32, True), **kwargs}
    with pytest.raises(ValueError, match=match):
        CalibrationConfig(**fields)


def test_quantize_refuses_mse_clip_for_awq(tmp_path):
    from pagoda.quant.calibrate.command import quantize_to_dir

    with pytest.raises(ValueError, match="mse_clip is for gptq and rtn"):
        quantize_to_dir(str(tmp_path / "no-model"), tmp_path / "out", "awq", mse_clip=True)


def test_awq_search_sees_an_evenly_strided_subsample():
    feats = _Features(10, max_rows=3)
    feats.add("x", torch.arange(6.0).reshape(6, 1))  # tokens 0-5, then 6-9 in a second batch
    feats.add("x", torch.arange(6.0, 10.0).reshape(4, 1))
    rows, mean = feats.get("x")
    assert rows.flatten().tolist() == [0.0, 4.0, 8.0]
    assert mean.item() == pytest.approx(4.5)
