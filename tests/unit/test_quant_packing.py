"""The checkpoint packings (pagoda/quant/packing.py) and the quantized-linear references
(pagoda/ops/wquant.py)."""

import pytest
import torch

from pagoda.ops import wquant
from pagoda.quant import packing


def test_gptq_word_layout_by_hand():
    # Rows 0..7 of one column hold 1..8: word = sum(v_i << 4i).
    codes = torch.arange(1, 9, dtype=torch.uint8).reshape(8, 1)
    zeros = torch.tensor([[8]])
    qweight, qzeros = packing.pack_gptq(codes, zeros.repeat(1, 8), 4)
    expected = sum((i + 1) << (4 * i) for i in range(8))
    assert qweight.shape == (1, 1) and qweight.item() == expected - (1 << 32)
    # Symmetric 4-bit zero 8 is stored as 7 in every nibble.
    assert qzeros.item() == 0x77777777


def test_awq_word_layout_by_hand():
    codes = torch.arange(8, dtype=torch.uint8).reshape(1, 8)  # column j holds j
    qweight, _ = packing.pack_awq(codes, torch.zeros(1, 8, dtype=torch.uint8))
    word = qweight.item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == list(packing.AWQ_ORDER)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (64, 48), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 1 << bits, (4, 48), generator=g)
    qweight, qzeros = packing.pack_gptq(codes, zeros, bits)
    assert qweight.dtype == torch.int32 and qweight.shape == (64 * bits // 32, 48)
    back, back_zeros = packing.unpack_gptq(qweight, qzeros, bits)
    assert torch.equal(back, codes)
    # Zero 0 wraps when stored minus one: readers that add one get 2**bits, as in AutoGPTQ.
    assert torch.equal(back_zeros % (1 << bits), zeros.to(torch.int16))


def test_awq_round_trip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (2, 64), generator=g, dtype=torch.uint8)
    qweight, qzeros = packing.pack_awq(codes, zeros)
    assert qweight.shape == (32, 8) and qzeros.shape == (2, 8)
    back, back_zeros = packing.unpack_awq(qweight, qzeros)
    assert torch.equal(back, codes) and torch.equal(back_zeros, zeros)


def test_packing_refuses_bad_input():
    with pytest.raises(ValueError, match="bits"):
        packing.pack_int32(torch.zeros(8, 1), 3, 0)
    with pytest.raises(ValueError, match="multiple of 8"):
        packing.pack_int32(torch.zeros(6, 1), 4, 0)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        packing.pack_int32(torch.full((8, 1), 16), 4, 0)


def test_gptq_group_order():
    g_idx = torch.arange(8) // 4
    assert packing.gptq_group_order(g_idx, 4) is None
    shuffled = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0])
    perm = packing.gptq_group_order(shuffled, 4)
    assert torch.equal(shuffled[perm], torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match="g_idx"):
        packing.gptq_group_order(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), 4)


def test_wq_linear_reference_matches_dense():
    g = torch.Generator().manual_seed(1)
    n, k, gs = 16, 32, 8
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // gs, generator=g) + 0.1
    zeros = torch.randint(0, 16, (n, k // gs), generator=g).float()
    perm = torch.randperm(k, generator=g)
    w = wquant.GroupQuantWeight(codes, scales, zeros, bits=4, group_size=gs, perm=perm)
    dense = (codes.float() - zeros.repeat_interleave(gs, 1)) * scales.repeat_interleave(gs, 1)
    x = torch.randn(3, k, generator=g)
    assert torch.allclose(wquant.wq_linear(x, w, None), x[:, perm] @ dense.T, atol=1e-4)
    with pytest.raises(ValueError, match="scales"):
        wquant.GroupQuantWeight(codes, scales[:, :1], zeros, bits=4, group_size=gs)


def test_int8_and_fp8_references():
    g = torch.Generator().manual_seed(2)
    qweight = torch.randint(-127, 128, (8, 16), generator=g, dtype=torch.int8)
    scales = torch.rand(8, generator=g)
    x = torch.randn(2, 16, generator=g)
    y = wquant.int8_linear(x, wquant.Int8Weight(qweight, scales), None)
    s_t = x.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x / s_t).clamp(-127, 127)
    assert torch.allclose(y, (xq @ qweight.float().T) * s_t * scales, atol=1e-4)
    w8 = torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn)
    block_scale = torch.rand(1, 2, generator=g) + 0.5
    fw = wquant.Fp8Weight(w8, block_scale, block=(8, 8))
    dense = w8.float() * block_scale.repeat_interleave(8, 1)
    assert torch.allclose(wquant.fp8_linear(x, fw, None), x @ dense.T, atol=1e-4)
