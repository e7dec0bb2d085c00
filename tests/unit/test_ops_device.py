"""The reference path runs on any device: every tensor it makes follows its inputs' device.

NOTE: there is no GPU here. The reference ops, the paged backend and the whole model run on
the `meta` device instead: a tensor made without `device=` lands on the CPU, and any op
mixing it with a meta tensor raises (as it would on CUDA), so a mask or index built on the
host fails these tests. Values are not checked here (meta has none): tests/gpu/ compares
them on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import ops
from pagoda.attention.backend import AttentionMetadata, PrefillSeq
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.models.llama import LlamaForCausalLM
from pagoda.ops import reference
from tests.helpers import make_tiny_config

META = torch.device("meta")
BLOCK_SIZE, NUM_BLOCKS, HK, D = 4, 16, 2, 16


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _metadata(decode_lens: list[int], prefills: list[tuple[int, int]]) -> AttentionMetadata:
    """Metadata on meta for decodes of `decode_lens` then prefills of (query_len, seq_len)."""
    nd = len(decode_lens)
    max_blocks = NUM_BLOCKS // 2
    seqs, start = [], nd
    for query_len, seq_len in prefills:
        seqs.append(PrefillSeq(start, query_len, seq_len, _meta(max_blocks, dtype=torch.int64)))
        start += query_len
    return AttentionMetadata(
        slot_mapping=_meta(start, dtype=torch.int64),
        num_decode_tokens=nd,
        decode_block_tables=_meta(nd, max_blocks, dtype=torch.int64) if nd else None,
        decode_seq_lens=_meta(nd, dtype=torch.int64) if nd else None,
        decode_max_seq_len=max(decode_lens, default=0),
        prefills=seqs,
        token_block_tables=_meta(start, max_blocks, dtype=torch.int64),
        token_seq_lens=_meta(start, dtype=torch.int64),
    )


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_backend_runs_on_meta(window: int | None, dtype: torch.dtype) -> None:
    """Decodes, a prefill with its whole context new, one reading a cached prefix."""
    md = _metadata([7, 30], [(6, 6), (5, 21)])
    t = 2 + 6 + 5
    q, k, v = _meta(t, 2 * HK, D, dtype=dtype), _meta(t, HK, D, dtype=dtype), _meta(t, HK, D)
    cache = (_meta(NUM_BLOCKS, BLOCK_SIZE, HK, D, dtype=dtype),) * 2
    out = TorchPagedAttention(2 * HK, HK, D, window).forward(q, k, v.to(dtype), cache, md)
    assert out.device == META and out.shape == (t, 2 * HK * D)


@pytest.mark.parametrize("codes", [torch.int8, torch.uint8])
def test_paged_backend_runs_on_meta_with_a_quantized_cache(codes: torch.dtype) -> None:
    """The quantizing write and the dequantizing reads (int8, fp8 bits) make nothing on
    the host either."""
    md = _metadata([7, 30], [(6, 6), (5, 21)])
    t = 2 + 6 + 5
    q, k, v = _meta(t, 2 * HK, D), _meta(t, HK, D), _meta(t, HK, D)
    cache = (*(_meta(NUM_BLOCKS, BLOCK_SIZE, HK, D, dtype=codes),) * 2,
             *(_meta(NUM_BLOCKS, BLOCK_SIZE, HK),) * 2)
    out = TorchPagedAttention(2 * HK, HK, D).forward(q, k, v, cache, md)
    assert out.device == META and out.shape == (t, 2 * HK * D)


def test_reference_ops_run_on_meta() -> None:
    x, w = _meta(3, 32), _meta(32)
    assert ops.reference.rms_norm(x, w, 1e-6).device == META
    normed, residual = reference.fused_add_rms_norm(x, _meta(3, 32), w, 1e-6)
    assert normed.device == residual.device == META
    assert reference.silu_and_mul(x).shape == (3, 16)
    qkv = _meta(3, 4 + 2 * HK, D)
    cache = (_meta(NUM_BLOCKS, BLOCK_SIZE, HK, D),) * 2
    slots, positions = _meta(3, dtype=torch.int64), _meta(3, dtype=torch.int64)
    reference.rotary_and_cache(qkv, _meta(64, D // 2), _meta(64, D // 2), positions, *cache,
                               slots, 4, HK)
    out = reference.paged_attention(
        _meta(3, 4, D), *cache, _meta(3, 5, dtype=torch.int64), _meta(3, dtype=torch.int64),
        0.25, 7, 19,
    )
    assert out.device == META and out.shape == (3, 4, D)


def test_dispatch_on_meta_takes_the_reference() -> None:
    """No kernel is registered for meta (nor for CUDA yet): every op runs its reference."""
    x = _meta(3, 32, dtype=torch.bfloat16)
    for op in ops.OPS.values():
        assert op.kernel_for(x) is None
    assert ops.fused_ops_for(x) is None


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("LlamaForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 8}),
     ("Qwen3ForCausalLM", {})],
)
def test_model_forward_runs_on_meta(arch: str, overrides: dict) -> None:
    """The whole decoder (layers, ops, backend) with every input on meta: a step of two
    decodes and a prefill chunk reading a cached prefix."""
    config = make_tiny_config(arch, **overrides)
    with torch.device(META):
        model = LlamaForCausalLM(config)
    model.init_rotary(64, torch.float32, META)
    spec = model.spec
    md = _metadata([9, 3], [(5, 13)])
    t = 2 + 5
    shape = (NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    kv_caches = [(_meta(*shape), _meta(*shape)) for _ in range(spec.num_layers)]
    hidden = model(_meta(t, dtype=torch.int64), _meta(t, dtype=torch.int64), kv_caches, md)
    logits = model.compute_logits(hidden)
    assert logits.device == META and logits.shape == (t, spec.vocab_size)
