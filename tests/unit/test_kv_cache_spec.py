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
        resolve_kv_cache_dtype("fp8", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4").create_engine_config()
