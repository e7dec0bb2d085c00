"""Attention sinks through the decode kernel (ops.paged_attention with q_sink): the reference
against attention/sinks.py's per-sequence PyTorch path, and the C++ kernel (AVX-512 and
portable head dims, float32 and bf16 q, plain and quantized caches) against the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagoda import ops
from pagoda.attention.backend import CommonAttentionMetadata, build_paged_metadata
from pagoda.attention.sinks import sink_attention
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.layers.rotary import rotate_by
from pagoda.ops import reference
from pagoda.ops.kv_quant import quantize
from tests.helpers import spy_on_extension

SINKS, WINDOW = 5, 23


def _case(seq_lens, hk, group, d, block_size, seed=0):
    """q and caches; sequence i's table has real blocks where its sinks and window lie and
    the null block (0) elsewhere, as the KV cache manager leaves a streaming table."""
    g = torch.Generator().manual_seed(seed)
    width = max(math.ceil(n / block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 1
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g)
    ids = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for i, n in enumerate(seq_lens):
        win_start = max(0, n - WINDOW)
        for j in range(math.ceil(n / block_size)):
            if j * block_size < SINKS or (j + 1) * block_size > win_start:
                tables[i, j] = ids[i * width + j]
    q = torch.randn(len(seq_lens), hk * group, d, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens), inv_freq


def _q_sink(q, lens, inv_freq):
    return rotate_by(q, -(lens - SINKS - WINDOW).clamp(min=0), inv_freq)


def test_reference_equals_sink_attention() -> None:
    """Decode rows short of, at and far past S + W (a null block between sinks and window)."""
    seq_lens = [3, 20, 28, 29, 90, 200]
    q, kc, vc, tables, lens, inv_freq = _case(seq_lens, 2, 3, 64, 16)
    got = reference.paged_attention(q, kc, vc, tables, lens, 0.125, WINDOW, None, None, None,
                                    _q_sink(q, lens, inv_freq), SINKS)
    for i, n in enumerate(seq_lens):
        want = sink_attention(q[i:i + 1], n - 1, kc, vc, tables[i], SINKS, WINDOW, inv_freq,
                              0.125)
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("d", "block_size", "hk", "group", "q_dtype", "code"),
    [(64, 16, 3, 3, torch.float32, None), (96, 8, 2, 2, torch.bfloat16, None),
     (128, 16, 1, 4, torch.bfloat16, torch.int8), (64, 32, 2, 1, torch.bfloat16, torch.uint8),
     (48, 16, 2, 2, torch.float32, None)],
)
def test_kernel_sinks_match_the_reference(ext, d, block_size, hk, group, q_dtype, code) -> None:
    """Head dim 48 takes the portable path; the others the AVX-512 tiles (dot paths with a
    bf16 q); odd lengths put the sinks, the window's start and its end inside tiles."""
    seq_lens = [1, 5, 27, 28, 61, 150, 33]
    q, kc, vc, tables, lens, inv_freq = _case(seq_lens, hk, group, d, block_size, seed=d)
    q = q.to(q_dtype)
    scales = []
    if code is not None:
        (kc, ks), (vc, vs) = quantize(kc, code), quantize(vc, code)
        scales = [ks, vs]
    q_sink = _q_sink(q, lens, inv_freq)
    args = (q, kc, vc, tables, lens, d**-0.5, WINDOW, None, *(scales or [None, None]), q_sink,
            SINKS)
    kernel = ops.paged_attention.select(*args)
    assert kernel is not ops.paged_attention.reference
    want = reference.paged_attention(q.float(), *args[1:10], q_sink.float(), SINKS)
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kernel(*args).float(), want, rtol=tol, atol=tol)


def test_kernel_refuses_bad_sink_arguments(ext) -> None:
    q, kc, vc, tables, lens, _ = _case([30], 1, 1, 64, 16)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="q_sink must be"):
        ext.paged_decode_attention(out, q, kc, vc, tables, lens, 1.0, WINDOW, None, None,
                                   q[:, :, :32].contiguous(), SINKS)
    with pytest.raises(RuntimeError, match="num_sink_tokens"):
        ext.paged_decode_attention(out, q, kc, vc, tables, lens, 1.0, WINDOW, None, None, None,
                                   SINKS)


@pytest.mark.parametrize("code", [None, torch.int8])
def test_backend_sends_sink_rows_through_the_kernel(ext, monkeypatch, code) -> None:
    """A bf16 step of one decode row and one prefill chunk: one kernel call for every row,
    equal to attention/sinks.py per sequence (a quantized cache: both read its scales)."""
    _, kc, vc, tables, _, inv_freq = _case([90, 60], 2, 3, 64, 16, seed=7)
    tables = torch.arange(1, tables.numel() + 1).view_as(tables)  # every block real
    q, kc, vc = (torch.randn(7, 6, 64) / 2).bfloat16(), kc.bfloat16(), vc.bfloat16()
    scales = []
    if code is not None:
        (kc, ks), (vc, vs) = quantize(kc, code), quantize(vc, code)
        scales = [ks, vs]
    positions = np.array([89, *range(54, 60)])
    common = CommonAttentionMetadata(
        query_start_loc=np.array([0, 1, 7]), seq_lens=np.array([90, 60]), num_decodes=1,
        block_tables=tables.numpy(), block_size=16, positions=positions,
        req_of_token=np.array([0] + [1] * 6), slot_mapping=torch.empty(0, dtype=torch.long),
        dtype=torch.bfloat16, device=torch.device("cpu"))
    md = build_paged_metadata(common)
    calls = spy_on_extension(ext, monkeypatch)
    attn = TorchPagedAttention(6, 2, 64)
    attn.set_attention_sinks(SINKS, WINDOW, inv_freq)
    out = attn.forward(q, None, None, (kc, vc, *scales), md, kv_written=True).view_as(q)
    assert calls.count("paged_decode_attention") == 1
    want = torch.cat([
        sink_attention(q[:1], 89, kc, vc, tables[0], SINKS, WINDOW, inv_freq, 0.125, *scales),
        sink_attention(q[1:], 54, kc, vc, tables[1], SINKS, WINDOW, inv_freq, 0.125, *scales)])
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
