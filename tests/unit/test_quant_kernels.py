"""The CPU quantized-linear kernels (ops/quant_cpu.py) against the wquant references.

Tolerances, and why: below GEMM_MIN_ROWS rows, gguf_linear and wq_linear quantize the
activations to int8 per block (32 values; 16 for Q6_K), so they are compared with the exact
product of those quantized activations (`_quantized_acts`, the kernel's rounding rule
replayed) and the dequantized weight, in float64: what is left is float32 summation order
(atol 2e-5 of the largest output; bf16 outputs also carry their final rounding, 2**-8
relative). From GEMM_MIN_ROWS rows on, the weight is dequantized and multiplied densely,
so the reference itself is the comparison (float32: summation order; bf16: the weight and
the output rounded to bf16). int8_linear (W8A8) is exact: equal to the reference bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.ops import quant_cpu, quant_layouts, wquant
from pagoda.ops.registry import OPS

gguf_quants = pytest.importorskip("gguf.quants")

MS = [1, 3, 17, 64, 300]
QUANTIZABLE = {quant_layouts.Q4_0: "Q4_0", quant_layouts.Q4_1: "Q4_1", quant_layouts.Q8_0: "Q8_0"}
KQUANTS = {quant_layouts.Q4_K: "Q4_K", quant_layouts.Q5_K: "Q5_K", quant_layouts.Q6_K: "Q6_K"}


@pytest.fixture(scope="module")
def qext():
    """The built quant extension, allowed to run on this CPU; else the test is skipped."""
    ext = quant_cpu.resolve()
    if ext is None:
        pytest.skip("the quant CPU kernels are disabled, unbuildable or not for this CPU")
    return ext


def _quantized_acts(x: torch.Tensor, block: int) -> torch.Tensor:
    """x with each block rounded as the kernel does: d = max|x| / 127, round(x * (1 / d)) * d."""
    m, k = x.shape
    kp = -(-k // block) * block
    xp = torch.zeros(m, kp)
    xp[:, :k] = x.float()
    xb = xp.view(m, -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).view(m, kp)[:, :k].double()


def _check_against_acts(y, x, w_deq, bias, block: int) -> None:
    ref = _quantized_acts(x, block) @ w_deq.double().T
    if bias is not None:
        ref = ref + bias.double()
    scale = ref.abs().max().item()
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * scale)
    else:
        torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=2e-5 * scale)


def _check(op, x, w, bias, block: int) -> None:
    y = op(x, w, bias)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    if x.shape[0] < quant_cpu.GEMM_MIN_ROWS:
        _check_against_acts(y, x, _deq(w), bias, block)
    else:
        ref = op.reference(x, w, bias)
        tol = 1e-5 if x.dtype == torch.float32 else 2e-2
        scale = ref.abs().max().item()
        torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * scale)


def _deq(w) -> torch.Tensor:
    return w.dequantize().to(torch.float32)


def _random_kquant_blocks(qtype: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant super-blocks: random codes and sub-block scales, finite float16 d / dmin."""
    nbytes = quant_layouts.GGUF_BLOCK[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    if qtype == quant_layouts.Q6_K:
        raw[:, 208:210] = d
    else:
        dmin = rng.uniform(0.001, 0.01, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
        raw[:, 0:2], raw[:, 2:4] = d, dmin
    return raw


def _gguf_weight(qtype: int, n: int, k: int, seed: int) -> wquant.GGUFWeight:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        raw = gguf_quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    else:
        values = quant_layouts.GGUF_BLOCK[qtype][0]
        raw = _random_kquant_blocks(qtype, n * k // values, rng).reshape(n, -1)
    w = wquant.GGUFWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (n, k))
    wquant.prepare("gguf_linear", w, "cpu")
    return w


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *KQUANTS],
                         ids=[*QUANTIZABLE.values(), *KQUANTS.values()])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gguf_linear_matches_reference(qext, qtype: int, dtype: torch.dtype) -> None:
    k = 96 if qtype in QUANTIZABLE else 512  # 96: three blocks, an odd count (padded pair)
    for n, k_ in ((37, k), (64, 2 * k + (256 if qtype in KQUANTS else 32))):
        w = _gguf_weight(qtype, n, k_, seed=n + qtype)
        assert "cpp" in w.kernel_data
        block = 16 if qtype == quant_layouts.Q6_K else 32
        for m in MS:
            x = torch.randn(m, k_, generator=torch.Generator().manual_seed(m)).to(dtype)
            bias = torch.randn(n).to(dtype) if m % 2 else None
            _check(wquant.gguf_linear, x, w, bias, block)


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *KQUANTS],
                         ids=[*QUANTIZABLE.values(), *KQUANTS.values()])
def test_gguf_layout_dequantizes_exactly(qext, qtype: int) -> None:
    w = _gguf_weight(qtype, 19, 512, seed=qtype)
    lay = w.kernel_data["cpp"]
    dense = qext.q_dequantize(lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, 512,
                              torch.float32)
    torch.testing.assert_close(dense, _deq(w), rtol=1e-6, atol=1e-7)


def _group_weight(bits: int, n: int, k: int, group: int, perm: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g).float()
    p = torch.randperm(k, generator=g) if perm else None
    w = wquant.GroupQuantWeight(q, scales, zeros, bits, group, p)
    wquant.prepare("wq_linear", w, "cpu")
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,k", [(32, 200), (64, 576), (128, 576), (100, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_wq_linear_matches_reference(qext, bits: int, group: int, k: int, dtype) -> None:
    w = _group_weight(bits, 37, k, group, perm=group == 64, seed=bits * group)
    assert "cpp" in w.kernel_data
    for m in MS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(37).to(dtype) if m % 2 else None
        xp = x if w.perm is None else x.index_select(-1, w.perm)
        y = wquant.wq_linear(x, w, bias)
        if m < quant_cpu.GEMM_MIN_ROWS:
            _check_against_acts(y, xp, _deq(w), bias, 32)
        else:
            ref = wquant.wq_linear_reference(x, w, bias)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.float(), ref.float(), rtol=tol,
                                       atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_reference(qext, m: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m)
    for n, k in ((37, 100), (64, 576)):
        w = wquant.Int8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                              torch.rand(n, generator=g) * 0.01)
        wquant.prepare("int8_linear", w, "cpu")
        x = torch.randn(m, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g) if m % 2 else None
        assert wquant.int8_linear.select(x, w, bias) is not wquant.int8_linear.reference
        y = wquant.int8_linear(x, w, bias)
        assert torch.equal(y, wquant.int8_linear_reference(x, w, bias))


def test_three_dim_activations(qext) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 40, 128, seed=1)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    y = wquant.gguf_linear(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.reshape(6, 40), wquant.gguf_linear(x.reshape(6, 128), w))


# ---- the fallback: the reference, never a crash -------------------------------------------
def _runs_reference(op, *args) -> bool:
    return OPS[op.name].select(*args) is op.reference


def test_prepared_weight_takes_the_kernel(qext) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 8, 64, seed=2)
    assert not _runs_reference(wquant.gguf_linear, torch.randn(1, 64).to(torch.bfloat16), w)
    # float32 (exact against transformers) keeps the reference: the kernel rounds the
    # activations to int8.
    assert _runs_reference(wquant.gguf_linear, torch.randn(1, 64), w)
    g = _group_weight(4, 8, 64, 32, perm=False, seed=5)
    assert _runs_reference(wquant.wq_linear, torch.randn(1, 64), g)


def test_disabled_kernels_fall_back_to_reference(qext, monkeypatch) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 8, 64, seed=3)
    x = torch.randn(2, 64).to(torch.bfloat16)
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    assert _runs_reference(wquant.gguf_linear, x, w)
    assert torch.equal(wquant.gguf_linear(x, w), wquant.gguf_linear_reference(x, w))
    fresh = wquant.GGUFWeight(w.raw, w.qtype, w.shape)
    wquant.prepare("gguf_linear", fresh, "cpu")
    assert not fresh.kernel_data


def test_cpu_without_the_instructions_falls_back(qext, monkeypatch) -> None:
    assert not quant_cpu.isa_allows(["avx512f", "avx512bw", "avx512vl"], frozenset({"avx2"}))
    assert not quant_cpu.isa_allows(["avx512f"], frozenset({"avx512f", "avx512bw", "avx512vl"}))
    w = _gguf_weight(quant_layouts.Q8_0, 8, 64, seed=4)
    monkeypatch.setattr(quant_cpu, "_allowed", False)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert _runs_reference(wquant.gguf_linear, x, w)
    assert torch.equal(wquant.gguf_linear(x, w), wquant.gguf_linear_reference(x, w))


def test_unsupported_weights_run_the_reference(qext) -> None:
    w3 = _group_weight(3, 8, 64, 32, perm=False, seed=5)  # 3 bits: no kernel layout
    w_odd_group = _group_weight(4, 8, 96, 48, perm=False, seed=6)  # group 48: not a multiple of 32
    for w in (w3, w_odd_group):
        assert not w.kernel_data
        x = torch.randn(2, w.shape[1]).to(torch.bfloat16)
        assert _runs_reference(wquant.wq_linear, x, w)
        assert torch.equal(wquant.wq_linear(x, w), wquant.wq_linear_reference(x, w))
    unprepared = wquant.GGUFWeight(_gguf_weight(quant_layouts.Q4_0, 8, 64, 7).raw,
                                   quant_layouts.Q4_0, (8, 64))
    assert _runs_reference(wquant.gguf_linear, torch.randn(1, 64).to(torch.bfloat16),
                           unprepared)


def test_layout_rejects_a_wrong_raw_shape() -> None:
    with pytest.raises(ValueError, match="does not hold"):
        quant_layouts.from_gguf(torch.zeros(4, 19, dtype=torch.uint8), quant_layouts.Q4_0, (4, 32))


def test_failed_build_falls_back(qext, monkeypatch) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 8, 64, seed=8)
    monkeypatch.setattr(quant_cpu, "_module", None)
    monkeypatch.setattr(quant_cpu, "_load_failed", True)
    assert quant_cpu.resolve() is None
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert _runs_reference(wquant.gguf_linear, x, w)
    assert torch.equal(wquant.gguf_linear(x, w), wquant.gguf_linear_reference(x, w))
