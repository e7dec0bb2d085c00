"""Quantized KV caches (int8, fp8 e4m3): the reference quantizer's formats, and the C++
kernels against the reference: the fused rotary + cache write code for code, the paged
attention read (decode and prefill rows) over several block sizes, head dims and GQA."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda import ops
from pagoda.ops import reference
from pagoda.ops.kv_quant import dequantize, quantize

CODES = [torch.int8, torch.uint8]  # uint8: fp8 e4m3fn bits


def test_reference_quantize_formats() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * 4
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0, values 0
    for code in CODES:
        codes, scales = quantize(x, code)
        assert codes.dtype == code and scales.shape == (5, 3) and scales[0, 0] == 0
        back = dequantize(codes, scales, torch.float32)
        assert torch.equal(back[0, 0], torch.zeros(64))
        amax = x.abs().amax(-1, keepdim=True)
        # int8: half a step of amax / 127; e4m3: 3 mantissa bits, half an ulp = 1/16 relative
        # (values near zero are subnormal steps of 2^-9 * scale).
        bound = amax / 254 if code == torch.int8 else x.abs() / 16 + amax / 448 * 2**-10
        assert ((back - x).abs() <= bound * 1.0001 + 1e-7).all()
        # The largest element maps to the largest code exactly.
        top = back.abs().amax(-1)
        assert torch.allclose(top, amax[..., 0], rtol=1e-6)


def _rotary_case(seed: int, dtype=torch.bfloat16, tokens=7, heads=4, kv_heads=2, d=64):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, d, generator=g) * 3).to(dtype)
    qkv[0, heads] = 0.0  # a zero k row
    qkv[1, heads + 1, :5] = 1e-3  # tiny values: fp8 subnormals
    angles = torch.rand(64, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(6 * 8, generator=g)[:tokens]
    return qkv, cos, sin, positions, slots, heads, kv_heads


@pytest.mark.parametrize("code", CODES)
def test_fused_rotary_write_quantizes_like_the_reference(fused_ext, code) -> None:
    qkv, cos, sin, positions, slots, h, hk = _rotary_case(seed=1)
    results = []
    for fn in (ops.rotary_and_cache, reference.rotary_and_cache):
        caches = [torch.zeros(6, 8, hk, 64, dtype=code) for _ in range(2)]
        scales = [torch.zeros(6, 8, hk) for _ in range(2)]
        x = qkv.clone()
        fn(x, cos, sin, positions, *caches, slots, h, hk, *scales)
        results.append((x, caches, scales))
    assert ops.rotary_and_cache.select(qkv, cos, sin, positions, *results[0][1]) is not (
        ops.rotary_and_cache.reference
    ), "the C++ kernel should take a quantized cache"
    (x_k, c_k, s_k), (x_r, _, _) = results
    # NOTE: the fused rotary rounds once per output, the reference's composed ops more
    # often, so the rotated rows may differ by a bf16 ulp; the codes of the kernel's own
    # rows must be the reference's quantization of them, code for code.
    torch.testing.assert_close(x_k, x_r, rtol=1e-2, atol=1e-2)
    for rows, cache, scale in ((x_k[:, h:h + hk], c_k[0], s_k[0]),
                               (x_k[:, h + hk:], c_k[1], s_k[1])):
        codes, scales = quantize(rows, code)
        assert torch.equal(cache.view(-1, hk, 64)[slots], codes)
        assert torch.equal(scale.view(-1, hk)[slots], scales)
    untouched = torch.ones(6 * 8, dtype=torch.bool)
    untouched[slots] = False
    assert not c_k[0].view(-1, hk, 64)[untouched].any()


def test_fp8_encoder_matches_torch_on_edge_values(ext) -> None:
    """Ties, subnormals, the largest code and negative zero, through the fused write with an
    identity rotation (cos 1, sin 0): the kernel's codes equal torch's float8 conversion."""
    d = 64
    vals = torch.tensor([448.0, -448.0, 0.0, -0.0, 2**-6, 2**-7, 3 * 2**-10, 2**-9, 2**-10,
                         1.0625, 1.1875, 0.01, -0.0155, 300.0, 17.0, 5 * 2**-11])
    row = torch.cat([vals, torch.linspace(-448, 448, d - len(vals))]).to(torch.bfloat16)
    qkv = torch.stack([row, row, row])[None].contiguous()  # 1 token, 1 q head, 1 kv head
    cos, sin = torch.ones(1, d // 2, dtype=torch.bfloat16), torch.zeros(1, d // 2,
                                                                        dtype=torch.bfloat16)
    caches = [torch.zeros(1, 1, 1, d, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.zeros(1, 1, 1) for _ in range(2)]
    ops.rotary_and_cache(qkv, cos, sin, torch.zeros(1, dtype=torch.long), *caches,
                         torch.zeros(1, dtype=torch.long), 1, 1, *scales)
    assert scales[0].item() == 1.0  # amax 448 -> scale 1: the codes are the values' own
    # NOTE: the rotated row, not `row`: rotation can turn -0.0 into +0.0.
    assert torch.equal(qkv[0, 1].abs(), row.abs())
    want = qkv[0, 1].float().to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(caches[0][0, 0, 0], want)


def _attention_case(seq_lens, hk, group, d, block_size, code, q_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 2 * sum(nb) + 3
    shape = (num_blocks, block_size, hk, d)
    k_codes, k_scale = quantize(torch.randn(shape, generator=g) * 2, code)
    v_codes, v_scale = quantize(torch.randn(shape, generator=g), code)
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(nb) + 1, dtype=torch.long)
    taken = 0
    for i, n in enumerate(nb):
        tables[i, :n] = ids[taken:taken + n]
        taken += n
    q = torch.randn(len(seq_lens), hk * group, d, generator=g).to(q_dtype)
    return q, k_codes, v_codes, tables, torch.tensor(seq_lens), k_scale, v_scale


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize(
    ("d", "block_size", "hk", "group"),
    [(64, 16, 2, 4), (64, 8, 1, 3), (96, 32, 2, 2), (128, 16, 4, 1), (128, 1, 2, 2), (48, 16, 2, 2)],
)
def test_paged_attention_reads_quantized_cache(ext, code, d, block_size, hk, group) -> None:
    """Head dim 48 takes the portable path; the others the AVX-512 one."""
    seq_lens = [1, 17, 40, 100, 5]
    q, kc, vc, tables, lens, ks, vs = _attention_case(seq_lens, hk, group, d, block_size, code,
                                                      torch.float32)
    args = (q, kc, vc, tables, lens, d**-0.5, None, None, ks, vs)
    kernel = ops.paged_attention.select(*args)
    assert kernel is not ops.paged_attention.reference
    got, want = kernel(*args), reference.paged_attention(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for window in (1, 9):
        args_w = (*args[:6], window, None, ks, vs)
        torch.testing.assert_close(kernel(*args_w), reference.paged_attention(*args_w),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize(("d", "block_size", "hk", "group"),
                         [(64, 16, 2, 4), (96, 8, 2, 3), (128, 32, 2, 2), (64, 16, 3, 3),
                          (32, 16, 1, 1), (256, 32, 1, 2)])
def test_paged_attention_bf16_q_on_quantized_cache(ext, code, d, block_size, hk, group) -> None:
    """A bf16 q takes the code paths (int8: int16 q and weights, vpdpwssd; fp8: vdpbf16ps),
    with partial first and last tiles (odd lengths, windows), scales staged per range (block
    sizes that are multiples of 16) or read per row (8), and contexts of many tiles."""
    q, kc, vc, tables, lens, ks, vs = _attention_case([3, 33, 64, 17, 301], hk, group, d,
                                                      block_size, code, torch.bfloat16,
                                                      seed=3)
    args = (q, kc, vc, tables, lens, 0.125, None, None, ks, vs)
    kernel = ops.paged_attention.select(*args)
    assert kernel is not ops.paged_attention.reference
    # NOTE: the kernel keeps the dequantized rows in float32; the reference rounds them to
    # q's dtype (bf16) first, hence the bf16-sized tolerance.
    want = reference.paged_attention(q.float(), kc, vc, tables, lens, 0.125, None, None, ks, vs)
    torch.testing.assert_close(kernel(*args).float(), want, rtol=2e-2, atol=2e-2)
    windowed = (*args[:6], 7, None, ks, vs)
    want = reference.paged_attention(q.float(), kc, vc, tables, lens, 0.125, 7, None, ks, vs)
    torch.testing.assert_close(kernel(*windowed).float(), want, rtol=2e-2, atol=2e-2)


def test_kernels_refuse_missing_or_stray_scales(ext) -> None:
    q, kc, vc, tables, lens, ks, vs = _attention_case([4], 1, 1, 64, 16, torch.int8,
                                                      torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        ext.paged_decode_attention(out, q, kc, vc, tables, lens, 1.0, -1)
    with pytest.raises(RuntimeError, match="quantized caches only"):
        ext.paged_decode_attention(out, q, kc.float(), vc.float(), tables, lens, 1.0, -1, ks, vs)
    with pytest.raises(RuntimeError, match=r"float32 \[N, bs, Hk\]"):
        ext.paged_decode_attention(out, q, kc, vc, tables, lens, 1.0, -1, ks[:1], vs)


@pytest.mark.parametrize("code", CODES)
def test_prefetch_level_leaves_quantized_outputs_bit_identical(ext, code) -> None:
    """The code paths share decode attention's prefetcher (two tiles ahead): the L1 and L2
    levels (cpu_kernels.configure_kv_prefetch) give the same bits."""
    q, kc, vc, tables, lens, ks, vs = _attention_case([3, 33, 64, 17, 301] * 3, 3, 3, 64, 16,
                                                      code, torch.bfloat16, seed=5)
    args = (q, kc, vc, tables, lens, 0.125, None, None, ks, vs)
    kernel = ops.paged_attention.select(*args)
    assert kernel is not ops.paged_attention.reference
    before = ext.kv_prefetch_l2()
    outs = []
    try:
        for l2 in (False, True):
            ext.set_kv_prefetch_l2(l2)
            outs.append(kernel(*args))
    finally:
        ext.set_kv_prefetch_l2(before)
    assert torch.equal(outs[0], outs[1])
