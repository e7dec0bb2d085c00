"""KVCacheSpec: bytes per token and block for each kind, layer grouping, and the dtype flag."""

from __future__ import annotations

import pytest
import torch

from pagoda.config import EngineArgs, resolve_kv_cache_dtype
from pagoda.core.kv_cache_spec import AttentionKind, KVCacheSpec, bytes_per_block, group_layers


def test_bytes_per_token_and_block() -> None:
    full = KVCacheSpec(AttentionKind.FULL, (0, 1, 2), 16, 3, 64, torch.bfloat16)
    # K and V, 3 heads x 64, 2 bytes, 3 layers.
    assert full.bytes_per_token == 2 * 3 * 64 * 2 * 3
    assert full.bytes_per_block == full.bytes_per_token * 16
    mla = KVCacheSpec(AttentionKind.MLA, (0,), 16, 1, 576, torch.float32)
    assert mla.num_tensors_per_layer == 1 and mla.bytes_per_token == 576 * 4
    assert bytes_per_block([full, mla]) == full.bytes_per_block + mla.bytes_per_block


def test_sliding_window_spec_needs_its_window() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheSpec(AttentionKind.SLIDING_WINDOW, (0,), 16, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheSpec(AttentionKind.FULL, (0,), 16, 1, 8, torch.float32, sliding_window=4)


def test_layers_group_by_window() -> None:
    specs = group_layers([None, 128, None, 128], 16, 2, 8, torch.float16)
    assert [(s.kind, s.layer_ids, s.sliding_window) for s in specs] == [
        (AttentionKind.FULL, (0, 2), None),
        (AttentionKind.SLIDING_WINDOW, (1, 3), 128),
    ]
    assert len(group_layers([None] * 5, 16, 2, 8, torch.float16)) == 1


def test_kv_cache_dtype_is_independent_of_the_model_dtype() -> None:
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("fp4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4").create_engine_config()


@pytest.mark.parametrize(("name", "codes"), [("int8", torch.int8), ("fp8", torch.uint8),
                                              ("fp8_e4m3", torch.uint8)])
def test_quantized_spec_counts_codes_and_scales(name, codes) -> None:
    dtype = resolve_kv_cache_dtype(name, torch.bfloat16)
    spec = KVCacheSpec(AttentionKind.FULL, (0, 1), 16, 4, 64, dtype)
    assert spec.quantized
    # Per layer: K and V codes (1 byte each) + a float32 scale per kv head for each.
    assert spec.bytes_per_token == 2 * (2 * 4 * 64 + 2 * 4 * 4)
    assert spec.layer_tensors() == [((16, 4, 64), codes)] * 2 + [((16, 4), torch.float32)] * 2
    bf16 = KVCacheSpec(AttentionKind.FULL, (0, 1), 16, 4, 64, torch.bfloat16)
    assert not bf16.quantized and len(bf16.layer_tensors()) == 2
    # Close to twice the blocks in the same memory (head dim 64: 128 / 68 bytes per head).
    assert bf16.bytes_per_block / spec.bytes_per_block == pytest.approx(128 / 68)
