"""The quantization algorithms of `pagoda quantize`: the RTN grid, GPTQ's error feedback
(lower output error than RTN on correlated inputs), act_order's g_idx, AWQ's search and
clipping never worse than RTN on their own objective."""

from __future__ import annotations

import pytest
import torch

from pagoda.quant.calibrate import awq
from pagoda.quant.calibrate.gptq import HessianAccumulator, gptq_quantize
from pagoda.quant.calibrate.rtn import QuantSpec, fit_params, quantize_rtn
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


def test_gptq_without_error_feedback_is_rtn():
    # A diagonal Hessian couples no columns: GPTQ's updates vanish and it rounds to nearest.
    k = 64
    w = torch.randn(8, k)
    spec = QuantSpec(4, 16, False)
    qt = gptq_quantize(w, torch.eye(k, dtype=torch.float64), spec)
    assert torch.equal(qt.codes, quantize_rtn(w, spec).codes)


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
    ({"method": "rtn", "act_order": True}, "act_order is a GPTQ option"),
    ({"damp_percent": 0.0}, "damp_percent"),
    ({"method": "awq", "spec": QuantSpec(4, 32, True)}, "zero point"),
    ({"method": "awq", "spec": QuantSpec(4, 32, False), "awq_search_tokens": 0},
     "awq_search_tokens"),
])
def test_calibration_config_errors_name_the_field(kwargs, match):
    fields = {"method": "gptq", "spec": QuantSpec(4, 32, True), **kwargs}
    with pytest.raises(ValueError, match=match):
        CalibrationConfig(**fields)


def test_awq_search_sees_an_evenly_strided_subsample():
    feats = _Features(10, max_rows=3)
    feats.add("x", torch.arange(6.0).reshape(6, 1))  # tokens 0-5, then 6-9 in a second batch
    feats.add("x", torch.arange(6.0, 10.0).reshape(4, 1))
    rows, mean = feats.get("x")
    assert rows.flatten().tolist() == [0.0, 4.0, 8.0]
    assert mean.item() == pytest.approx(4.5)
