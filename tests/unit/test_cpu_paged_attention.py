"""The C++ paged decode-attention kernel against the PyTorch reference and a float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.attention import cpu_kernels
from pagoda.attention.backend import AttentionMetadata
from pagoda.attention.torch_paged import TorchPagedAttention

BLOCK_SIZE = 16
HEAD_DIM = 64


def _ext_or_skip() -> None:
    if cpu_kernels.kernels_disabled():
        pytest.skip("PAGODA_DISABLE_CPU_KERNELS is set")
    if cpu_kernels.load_extension() is None:
        pytest.skip("the C++ extension could not be built here (no compiler?)")


def _make_case(
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q/caches; block tables use shuffled, non-contiguous ids and padded rows."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # NOTE: one extra padding column, never read
    num_blocks = 2 * sum(blocks_per_req) + 3
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    used = 0
    for i, nb in enumerate(blocks_per_req):
        block_tables[i, :nb] = ids[used : used + nb]
        used += nb
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int64)


def _naive(q, k_cache, v_cache, block_tables, seq_lens, window):
    """Per-request softmax(q K^T) V in float64."""
    b, h, d = q.shape
    hk = k_cache.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(seq_lens[i])
        keys = k_cache[block_tables[i]].reshape(-1, hk, d)[:n].double()
        values = v_cache[block_tables[i]].reshape(-1, hk, d)[:n].double()
        lo = 0 if window is None else max(0, n - window)
        keys, values = keys[lo:], values[lo:]
        keys = keys.repeat_interleave(h // hk, dim=1)  # [n, h, d]
        values = values.repeat_interleave(h // hk, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), keys) / math.sqrt(d)
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def _metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decode_tokens=len(seq_lens),
        decode_block_tables=block_tables,
        decode_seq_lens=seq_lens,
        decode_max_seq_len=int(seq_lens.max()),
        prefills=[],
    )


def _reference(q, k_cache, v_cache, block_tables, seq_lens, window):
    """The PyTorch decode path of the backend, with the kernel switched off."""
    _, h, d = q.shape
    attn = TorchPagedAttention(h, k_cache.shape[2], d, sliding_window=window)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
        return attn._decode(q, k_cache, v_cache, _metadata(block_tables, seq_lens))


SEQ_LENS = [1, 16, 17, 5, 32, 100, 64, 3, 250, 48]


def test_extension_builds() -> None:
    """Fails loudly where a compiler exists but the build breaks (CI has g++)."""
    if cpu_kernels.kernels_disabled():
        pytest.skip("PAGODA_DISABLE_CPU_KERNELS is set")
    assert cpu_kernels.load_extension() is not None


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 20])
def test_float32_matches_oracle_and_reference(group: int, window: int | None) -> None:
    _ext_or_skip()
    case = _make_case(SEQ_LENS, num_kv_heads=2, group=group, dtype=torch.float32, seed=group)
    q, k_cache, v_cache, bt, lens = case
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, window)
    assert out is not None and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _naive(*case, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _reference(*case, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 33])
def test_bfloat16_matches_oracle(group: int, window: int | None) -> None:
    _ext_or_skip()
    case = _make_case(SEQ_LENS, num_kv_heads=3, group=group, dtype=torch.bfloat16, seed=7)
    q, k_cache, v_cache, bt, lens = case
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, window)
    assert out is not None and out.dtype == torch.bfloat16
    # NOTE: the kernel accumulates in float32 and rounds once to bf16 (~4e-3 relative).
    torch.testing.assert_close(out.double(), _naive(*case, window), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, _reference(*case, window), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_other_head_dims_and_int32_tables(head_dim: int) -> None:
    _ext_or_skip()
    case = _make_case([7, 40, 1], 1, 4, torch.float32, head_dim=head_dim, seed=3)
    q, k_cache, v_cache, bt, lens = case
    out = cpu_kernels.paged_decode_attention(
        q, k_cache, v_cache, bt.to(torch.int32), lens, head_dim**-0.5
    )
    assert out is not None
    torch.testing.assert_close(out.double(), _naive(*case, None), atol=1e-5, rtol=1e-5)


def test_window_larger_than_context_and_long_context() -> None:
    _ext_or_skip()
    case = _make_case([3000, 5], 2, 2, torch.float32, seed=11)
    q, k_cache, v_cache, bt, lens = case
    for window in (4096, 1000, 1):
        out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.125, window)
        assert out is not None
        torch.testing.assert_close(out.double(), _naive(*case, window), atol=1e-5, rtol=1e-5)


def test_backend_decode_uses_kernel_and_matches_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _ext_or_skip()
    case = _make_case(SEQ_LENS, num_kv_heads=3, group=3, dtype=torch.float32, seed=5)
    q, k_cache, v_cache, bt, lens = case
    calls = []
    kernel = cpu_kernels.paged_decode_attention

    def spy(*args, **kwargs):
        out = kernel(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("pagoda.attention.torch_paged.paged_decode_attention", spy)
    out = TorchPagedAttention(9, 3, HEAD_DIM)._decode(q, k_cache, v_cache, _metadata(bt, lens))
    assert calls == [True]
    torch.testing.assert_close(out, _reference(*case, None), atol=1e-5, rtol=1e-5)


def test_disable_env_var_forces_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    q, k_cache, v_cache, bt, lens = _make_case([5], 1, 1, torch.float32)
    assert cpu_kernels.paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.125) is None


def test_unsupported_dtype_returns_none() -> None:
    q, k_cache, v_cache, bt, lens = _make_case([5], 1, 1, torch.float16)
    assert cpu_kernels.paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.125) is None
