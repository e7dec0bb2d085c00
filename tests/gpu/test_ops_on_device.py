"""The reference ops and the paged backend on the GPU against the same code on the CPU
(float32; TF32 off, so the only differences are summation orders)."""

from __future__ import annotations

import pytest
import torch

from pagoda import ops
from pagoda.attention.backend import AttentionMetadata, PrefillSeq
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.ops import reference, wquant
from tests.gpu.conftest import DEVICE

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
TOL = {"atol": 1e-5, "rtol": 1e-5}
BLOCK_SIZE, HK, H, D = 16, 2, 6, 64


def _both(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    return tensors, tuple(t.to(DEVICE) for t in tensors)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == DEVICE.type
    torch.testing.assert_close(got.cpu(), want, **TOL)


def test_no_kernel_but_fp8s_is_registered_for_the_device_yet() -> None:
    """fp8_linear's torch._scaled_mm kernel (ops/fp8_cuda.py) is the only CUDA kernel so far;
    every other op runs its PyTorch reference there."""
    x = torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE)
    if DEVICE.type == "cuda":
        with_kernel = [op.name for op in ops.OPS.values() if op.kernel_for(x) is not None]
        assert with_kernel == ["fp8_linear"]
        assert ops.fused_ops_for(x) is None


def test_elementwise_ops() -> None:
    g = torch.Generator().manual_seed(0)
    (x, r, w), (xd, rd, wd) = _both(*(torch.randn(n, 96, generator=g) for n in (5, 5, 1)))
    w, wd = w[0], wd[0]
    _close(ops.rms_norm(xd, wd, 1e-5), ops.rms_norm(x, w, 1e-5))
    for got, want in zip(ops.fused_add_rms_norm(xd, rd, wd, 1e-5),
                         reference.fused_add_rms_norm(x, r, w, 1e-5)):
        _close(got, want)
    _close(ops.silu_and_mul(xd), reference.silu_and_mul(x))


def test_rotary_and_cache() -> None:
    g = torch.Generator().manual_seed(1)
    t, num_blocks = 7, 8
    qkv = torch.randn(t, H + 2 * HK, D, generator=g)
    cos, sin = torch.randn(50, D // 2, generator=g), torch.randn(50, D // 2, generator=g)
    positions = torch.randint(0, 50, (t,), generator=g)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:t]
    caches = [torch.zeros(num_blocks, BLOCK_SIZE, HK, D) for _ in range(2)]
    cpu, dev = _both(qkv, cos, sin, positions, *caches, slots)
    reference.rotary_and_cache(*cpu, H, HK)
    ops.rotary_and_cache(*dev, H, HK)
    for got, want in zip((dev[0], dev[4], dev[5]), (cpu[0], cpu[4], cpu[5])):
        _close(got, want)


def _paged_case(seq_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    nb = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(nb) + 4
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(nb), dtype=torch.int64)
    taken = 0
    for i, n in enumerate(nb):
        tables[i, :n] = ids[taken : taken + n]
        taken += n
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HK, D, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, HK, D, generator=g)
    return k_cache, v_cache, tables, torch.tensor(seq_lens)


@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention(window: int | None) -> None:
    k_cache, v_cache, tables, lens = _paged_case([1, 17, 70, 33], seed=2)
    q = torch.randn(4, H, D, generator=torch.Generator().manual_seed(3))
    cpu, dev = _both(q, k_cache, v_cache, tables, lens)
    want = reference.paged_attention(*cpu, D**-0.5, window)
    _close(ops.paged_attention(*dev, D**-0.5, window, 70), want)


@pytest.mark.parametrize("window", [None, 9])
def test_paged_backend_step(window: int | None) -> None:
    """One step: two decodes, a prefill reading a cached prefix, a fresh prefill."""
    decode_lens, prefills = [40, 5], [(6, 30), (11, 11)]
    seq_lens = decode_lens + [s for _, s in prefills]
    k_cache, v_cache, tables, _ = _paged_case(seq_lens, seed=4)
    g = torch.Generator().manual_seed(5)
    t = len(decode_lens) + sum(q for q, _ in prefills)
    q, k, v = torch.randn(t, H, D, generator=g), *torch.randn(2, t, HK, D, generator=g)
    slots, seqs, start = [], [], len(decode_lens)
    for n in decode_lens:
        slots.append(tables[len(slots), (n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    for i, (query_len, seq_len) in enumerate(prefills, start=len(decode_lens)):
        pos = torch.arange(seq_len - query_len, seq_len)
        slots.extend((tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).tolist())
        seqs.append((start, query_len, seq_len, tables[i]))
        start += query_len

    def run(device: torch.device) -> torch.Tensor:
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=tables[: len(decode_lens)].to(device),
            decode_seq_lens=torch.tensor(decode_lens, device=device),
            decode_max_seq_len=max(decode_lens),
            prefills=[PrefillSeq(a, b, c, bt.to(device)) for a, b, c, bt in seqs],
        )
        cache = (k_cache.clone().to(device), v_cache.clone().to(device))
        backend = TorchPagedAttention(H, HK, D, window)
        return backend.forward(q.to(device), k.to(device), v.to(device), cache, md)

    _close(run(DEVICE), run(torch.device("cpu")))


@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor_scale", "channel_scales"])
def test_fp8_linear_scaled_mm(per_channel: bool) -> None:
    """fp8_linear's CUDA kernel: per-token e4m3 activations through torch._scaled_mm, against
    that rounding of x replayed here times the dequantized weight, in float64 (what is left:
    the bf16 output's rounding, twice with the bias)."""
    if DEVICE.type != "cuda" or torch.cuda.get_device_capability(DEVICE) < (8, 9):
        pytest.skip("torch._scaled_mm needs a CUDA device of compute capability 8.9+")
    fp8, top = torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)
    g = torch.Generator().manual_seed(3)
    n, k, m = 64, 128, 5
    w32 = torch.randn(n, k, generator=g)
    scale = (w32.abs().amax(1) if per_channel else w32.abs().amax().reshape(1)) / top
    codes = (w32 / (scale[:, None] if per_channel else scale)).to(fp8)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    w = wquant.Fp8Weight(codes.to(DEVICE), scale.to(DEVICE))
    args = (x.to(DEVICE), w, bias.to(DEVICE))
    assert wquant.fp8_linear.select(*args) is not wquant.fp8_linear.reference
    y = wquant.fp8_linear(*args)
    assert y.dtype == torch.bfloat16 and y.device.type == "cuda"
    xf = x.float()
    s_x = (xf.abs().amax(1, keepdim=True) / top).clamp(min=1e-12)
    xq = (xf / s_x).clamp(-top, top).to(fp8).double() * s_x.double()
    ref = xq @ wquant.Fp8Weight(codes, scale).dequantize().double().T + bias.double()
    torch.testing.assert_close(y.cpu().double(), ref, rtol=2**-7,
                               atol=1e-3 * ref.abs().max().item())
