"""The CPU fp8_linear kernel (csrc/fp8_cpu.cpp through ops/quant_cpu.py) against the reference.

Tolerances, and why: up to FP8_GEMV_MAX_ROWS rows the kernel sums x * (code * scale) in
float32 in another order than the reference's GEMM: compared with the float64 product of the
dequantized weight, atol 2e-5 of the largest output, and the bf16 output's own rounding
(2**-8 relative). More rows dequantize the weight times its scale to bf16 first (one more
rounding per weight, 2**-9 relative) for oneDNN's bf16 GEMM: compared with the float64
product of that bf16 weight. The code -> value step itself is exact: every non-NaN code.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.ops import quant_cpu, wquant
from pagoda.ops.registry import OPS

FP8 = torch.float8_e4m3fn


def _weight(n: int, k: int, scale_kind: str, seed: int) -> wquant.Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    if scale_kind == "tensor":
        return wquant.Fp8Weight(codes, torch.tensor([0.003]))
    if scale_kind == "channel":
        return wquant.Fp8Weight(codes, torch.rand(n, generator=g) * 0.01 + 1e-4)
    bn, bk = 128, 128
    scale = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.01 + 1e-4
    return wquant.Fp8Weight(codes, scale, (bn, bk))


def _runs_reference(x, w, bias=None) -> bool:
    return OPS["fp8_linear"].select(x, w, bias) is wquant.fp8_linear.reference


CASES = [(37, 100, "channel"), (64, 576, "tensor"), (256, 320, "block")]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 64])
@pytest.mark.parametrize("n,k,scale_kind", CASES)
def test_fp8_linear_matches_reference(fp8ext, m: int, n: int, k: int, scale_kind: str) -> None:
    w = _weight(n, k, scale_kind, seed=m * 7 + n)
    wquant.prepare("fp8_linear", w, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if m % 2 else None
    assert not _runs_reference(x, w, bias)
    y = wquant.fp8_linear(x, w, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    w_deq = w.dequantize().double()
    if m <= quant_cpu.FP8_GEMV_MAX_ROWS:
        rtol, atol_frac = 2**-8, 2e-5
    else:
        w_deq, rtol, atol_frac = w_deq.to(torch.bfloat16).double(), 2**-7, 1e-3
    ref = x.double() @ w_deq.T
    if bias is not None:
        ref = ref + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol_frac * ref.abs().max().item())


def test_every_code_widens_to_its_value(fp8ext) -> None:
    # NOTE: 0x7f / 0xff are e4m3fn's NaN, which no checkpoint stores; the rest includes the
    # subnormals (exponent field 0) and both zeros.
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    w = wquant.Fp8Weight(codes.view(FP8).reshape(-1, 1).repeat(1, 16).contiguous(),
                         torch.tensor([1.0]))
    wquant.prepare("fp8_linear", w, "cpu", torch.bfloat16)
    values = codes.view(FP8).to(torch.float32)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 3] = 1.0
    y = wquant.fp8_linear(x, w)  # one product per output: exact in float32 and in bf16
    assert torch.equal(y[0].float(), values)
    lay = w.kernel_data["cpp"]
    deq = torch.empty(lay.codes.shape, dtype=torch.bfloat16)
    fp8ext.fp8_dequant(lay.codes, lay.scales, lay.kblock, deq)
    assert torch.equal(deq.float(), values.reshape(-1, 1).expand(-1, 16))


def test_preparer_skips_float32_and_blocks_it_cannot_take(fp8ext) -> None:
    w = _weight(37, 100, "channel", seed=1)
    wquant.prepare("fp8_linear", w, "cpu", torch.float32)  # float32 keeps the exact reference
    assert not w.kernel_data and _runs_reference(torch.randn(1, 100), w)
    odd = wquant.Fp8Weight(w.weight, torch.rand(1, 5) + 0.5, (64, 24))  # 24: not a multiple of 16
    wquant.prepare("fp8_linear", odd, "cpu", torch.bfloat16)
    x = torch.randn(2, 100).to(torch.bfloat16)
    assert not odd.kernel_data and _runs_reference(x, odd)
    assert torch.equal(wquant.fp8_linear(x, odd), wquant.fp8_linear_reference(x, odd))


def test_disabled_kernels_run_the_reference(fp8ext, monkeypatch) -> None:
    w = _weight(64, 576, "tensor", seed=2)
    wquant.prepare("fp8_linear", w, "cpu", torch.bfloat16)
    x = torch.randn(2, 576).to(torch.bfloat16)
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    assert _runs_reference(x, w)
    assert torch.equal(wquant.fp8_linear(x, w), wquant.fp8_linear_reference(x, w))


def test_a_build_without_the_fp8_kernels_runs_the_reference(qext, monkeypatch) -> None:
    """An AVX2 build has the block kernels but no fp8 ones: fp8 weights get no layout."""
    monkeypatch.setattr(quant_cpu, "fp8_allowed", lambda: False)
    w = _weight(64, 576, "tensor", seed=3)
    wquant.prepare("fp8_linear", w, "cpu", torch.bfloat16)
    x = torch.randn(2, 576).to(torch.bfloat16)
    assert not w.kernel_data and _runs_reference(x, w)
    assert torch.equal(wquant.fp8_linear(x, w), wquant.fp8_linear_reference(x, w))


def test_fp8_allowed_follows_the_build(qext) -> None:
    assert quant_cpu.fp8_allowed() == bool(qext.kernel_isa()["fp8"])
    # Both vector paths of the quant extension carry the fp8 kernels (AVX-512 and AVX2).
    quant_isa = set(qext.kernel_isa()["quant"])
    assert quant_cpu.fp8_allowed() == bool(quant_isa & {"avx512f", "avx2"})
