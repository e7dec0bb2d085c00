"""The fused C++ element-wise ops against PyTorch's ops and a float64 oracle, and the
layers' dispatch to them (bf16/fp16 only; float32 stays on PyTorch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import ops
from pagoda.layers.activation import silu_and_mul
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import apply_rotary
from pagoda.ops import cpu_kernels
from pagoda.ops.reference import write_kv
from tests.helpers import spy_on_extension

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


# ---- fused_add_rms_norm ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 200])  # 200 x 576 takes the parallel path
def test_add_rms_norm_matches_oracle(ext, dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden, eps = 576, 1e-5
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    res = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    want_res = x + res  # one rounding to dtype, as the kernel does
    s = want_res.double()
    oracle = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    xo, ro = x.clone(), res.clone()
    ext.fused_add_rms_norm(xo, ro, w, eps)

    assert torch.equal(ro, want_res)  # the residual sum is exact to the dtype
    # One rounding of the product (float32 math inside): within one ulp of the oracle.
    tol = 1.0 * _ulp(dtype) * oracle.abs() + 1e-6
    assert ((xo.double() - oracle).abs() <= tol).all()


def test_add_rms_norm_rejects_bad_input(ext) -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ext.fused_add_rms_norm(x, x.clone(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"\[H\]"):
        ext.fused_add_rms_norm(x, x.clone(), torch.ones(9, dtype=torch.bfloat16), 1e-6)


# ---- rms_norm --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_rms_norm_matches_oracle_and_the_fused_add(ext, dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows + 1)
    hidden, eps = 576, 1e-5
    x = (2 * torch.randn(rows, hidden, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    s = x.double()
    oracle = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    x_before = x.clone()
    out = ext.rms_norm(x, w, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(x, x_before)  # a new tensor: x untouched
    tol = 1.0 * _ulp(dtype) * oracle.abs() + 1e-6
    assert ((out.double() - oracle).abs() <= tol).all()
    # The same arithmetic as fused_add_rms_norm's (whose residual sum x + 0 is x): the
    # decode stack's first norm and the op-by-op layers' give the same bits.
    xo, zeros = x.clone(), torch.zeros_like(x)
    ext.fused_add_rms_norm(xo, zeros, w, eps)
    assert torch.equal(out, xo)


def test_rms_norm_rejects_bad_input(ext) -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ext.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"\[H\]"):
        ext.rms_norm(x, torch.ones(9, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.rms_norm(torch.zeros(8, 2, dtype=torch.bfloat16).t(), torch.ones(8, dtype=torch.bfloat16), 1e-6)


# ---- rotary_and_cache ------------------------------------------------------------------
def _rotary_case(dtype: torch.dtype, tokens: int, heads: int = 9, kv_heads: int = 3,
                 head_dim: int = 64, block_size: int = 16, num_blocks: int = 40):
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    max_pos = 300
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64),
                        1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    return qkv, cos, sin, positions, slots, k_cache, v_cache


@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotary_and_cache_float32_equals_pytorch_ops(ext, tokens: int) -> None:
    heads, kv_heads = 9, 3
    qkv, cos, sin, pos, slots, k_cache, v_cache = _rotary_case(torch.float32, tokens)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    nqk = heads + kv_heads
    rotated = apply_rotary(qkv[:, :nqk], cos[pos][:, None], sin[pos][:, None])
    write_kv(rotated[:, heads:], qkv[:, nqk:], ref_k_cache, ref_v_cache, slots)

    out = qkv.clone()
    ext.rotary_and_cache(out, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads)

    assert torch.equal(out[:, :nqk], rotated)  # no FMA contraction: bit for bit
    assert torch.equal(out[:, nqk:], qkv[:, nqk:])  # v untouched
    assert torch.equal(k_cache, ref_k_cache)
    assert torch.equal(v_cache, ref_v_cache)  # and no other slot written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_and_cache_low_precision_is_at_least_as_accurate(ext, dtype) -> None:
    heads, kv_heads, tokens = 9, 3, 64
    qkv, cos, sin, pos, slots, k_cache, v_cache = _rotary_case(dtype, tokens)
    nqk = heads + kv_heads
    oracle = apply_rotary(qkv[:, :nqk].double(), cos[pos][:, None].double(),
                          sin[pos][:, None].double())
    torch_ops = apply_rotary(qkv[:, :nqk], cos[pos][:, None], sin[pos][:, None])
    out = qkv.clone()
    ext.rotary_and_cache(out, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads)

    fused_err = (out[:, :nqk].double() - oracle).abs()
    torch_err = (torch_ops.double() - oracle).abs()
    # One rounding instead of three: within half an ulp of the exact value...
    assert (fused_err <= 0.5 * _ulp(dtype) * oracle.abs() + 1e-30).all()
    assert fused_err.mean() <= torch_err.mean()
    flat_k = k_cache.view(-1, kv_heads, qkv.shape[2])
    assert torch.equal(flat_k[slots], out[:, heads:nqk])


def test_rotary_and_cache_rejects_out_of_range(ext) -> None:
    qkv, cos, sin, pos, slots, k_cache, v_cache = _rotary_case(torch.bfloat16, 4)
    bad = pos.clone()
    bad[2] = cos.shape[0]
    with pytest.raises(RuntimeError, match="position"):
        ext.rotary_and_cache(qkv, cos, sin, bad, k_cache, v_cache, slots, 9, 3)
    bad_slots = slots.clone()
    bad_slots[0] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises(RuntimeError, match="slot"):
        ext.rotary_and_cache(qkv, cos, sin, pos, k_cache, v_cache, bad_slots, 9, 3)
    with pytest.raises(RuntimeError, match="head count"):
        ext.rotary_and_cache(qkv, cos, sin, pos, k_cache, v_cache, slots, 8, 3)


# ---- silu_and_mul ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])  # 40 x 1536 takes the parallel path
def test_silu_and_mul_matches_pytorch(ext, dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (4 * torch.randn(rows, 2 * 1536, generator=g)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up  # PyTorch rounds silu to the dtype, then the product
    out = ext.silu_and_mul(x)
    assert out.shape == (rows, 1536) and out.dtype == dtype
    # Equal up to one rounding step (exp implementations differ in the last float bits).
    tol = 2 * _ulp(dtype) * ref.double().abs() + 1e-6
    assert ((out.double() - ref.double()).abs() <= tol).all()


# ---- the layers' dispatch --------------------------------------------------------------
def test_layers_use_fused_ops_for_bf16_only(fused_ext, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.kernel_for("fused_ops") is fused_ext  # the ISA decision, made before the spy
    calls = spy_on_extension(fused_ext, monkeypatch)
    norm = RMSNorm(64, 1e-6)
    for dtype, fused in ((torch.bfloat16, True), (torch.float32, False)):
        calls.clear()
        norm.to(dtype)
        x, r = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
        want_res = x + r
        want = F.rms_norm(want_res.float(), (64,), norm.weight.float(), 1e-6)
        got, res = norm.forward_residual(x.clone(), r.clone())
        assert torch.equal(res, want_res)
        torch.testing.assert_close(got.float(), want, atol=0.02, rtol=0.02)
        y = silu_and_mul(torch.randn(3, 128).to(dtype))
        assert y.shape == (3, 64)
        normed = norm(x)
        torch.testing.assert_close(normed.float(), F.rms_norm(x.float(), (64,), norm.weight.float(), 1e-6),
                                   atol=0.02, rtol=0.02)
        assert calls == (["fused_add_rms_norm", "silu_and_mul", "rms_norm"] if fused else [])


def test_disable_env_var_keeps_pytorch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    x = torch.zeros(2, dtype=torch.bfloat16)
    assert ops.fused_ops_for(x) is None
    for op in (ops.rms_norm, ops.fused_add_rms_norm, ops.silu_and_mul, ops.rotary_and_cache):
        assert op.kernel_for(x) is None
