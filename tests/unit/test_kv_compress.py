"""Compressed host KV blocks (worker/kv_compress.py): the int4 packing, the formats' sizes
and the block conversions between a device cache and a compressed host pool."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.kv_cache_spec import AttentionKind, KVCacheSpec
from pagoda.worker.block_copies import copy_blocks
from pagoda.worker.kv_compress import (
    host_bytes_per_block,
    host_layer_tensors,
    pack_int4,
    pool_format,
    unpack_int4,
)


def _spec(dtype=torch.bfloat16) -> KVCacheSpec:
    return KVCacheSpec(AttentionKind.FULL, (0, 1), 16, 2, 64, dtype)


def test_int4_round_trip_error_is_half_a_step() -> None:
    x = torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0] = 0.0
    packed, scales = pack_int4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16, 2, 32)
    back = unpack_int4(packed, scales)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= amax / 14 * 1.0001).all()
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    # Element order survives the nibble packing (a swapped pair would break this).
    assert torch.allclose(back.abs().amax(-1), amax[..., 0])
    assert torch.equal(unpack_int4(*pack_int4(back)), back)


def test_host_formats_sizes() -> None:
    spec = _spec()
    plain = host_bytes_per_block([spec], "none")
    assert plain == spec.bytes_per_block == 2 * 2 * 16 * 2 * 64 * 2
    scales = 2 * 2 * 16 * 2 * 4
    assert host_bytes_per_block([spec], "int8") == 2 * 2 * 16 * 2 * 64 + scales
    assert host_bytes_per_block([spec], "int4") == 2 * 2 * 16 * 2 * 32 + scales
    assert [d for _, d in host_layer_tensors(spec, "int4")] == [torch.uint8] * 2 + [
        torch.float32] * 2
    assert pool_format(spec) == "plain" and pool_format(spec, "int4") == "int4"
    assert pool_format(_spec(torch.int8)) == "int8"
    assert pool_format(_spec(torch.float8_e4m3fn)) == "fp8"
    with pytest.raises(ValueError, match="kv_host_compression"):
        host_layer_tensors(spec, "zip")


def _pool(spec, n, compression="none"):
    return [tuple(torch.zeros((n, *shape), dtype=dtype)
                  for shape, dtype in host_layer_tensors(spec, compression))
            for _ in spec.layer_ids]


@pytest.mark.parametrize(("device_dtype", "compression", "tol"), [
    (torch.float32, "int8", 1 / 254), (torch.float32, "int4", 1 / 14),
    (torch.int8, "int4", 1 / 14 + 1 / 254), (torch.int8, "int8", 0.0),
])
def test_blocks_compress_on_the_way_out_and_back(device_dtype, compression, tol) -> None:
    spec = _spec(device_dtype)
    device, host = _pool(spec, 6), _pool(spec, 4, compression)
    g = torch.Generator().manual_seed(1)
    values = torch.randn(6, 16, 2, 64, generator=g)
    from pagoda.ops.kv_quant import dequantize, quantize

    for layer in device:
        if spec.quantized:
            codes, scales = quantize(values, torch.int8)
            for t, src in zip(layer, (codes, codes, scales, scales), strict=True):
                t.copy_(src)
        else:
            layer[0].copy_(values)
            layer[1].copy_(values)
    stored = (dequantize(device[0][0], device[0][2], torch.float32) if spec.quantized
              else values)
    fmts = (pool_format(spec), pool_format(spec, compression))
    copy_blocks(device, host, [(1, 0), (4, 3)], *fmts)
    copy_blocks(host, device, [(0, 2), (3, 5)], fmts[1], fmts[0])
    for layer in device:
        back = (dequantize(layer[0], layer[2], torch.float32) if spec.quantized
                else layer[0])
        amax = stored.abs().amax(-1, keepdim=True)
        for src, dst in ((1, 2), (4, 5)):
            err = (back[dst] - stored[src]).abs()
            assert (err <= amax[src] * tol * 1.0001 + 1e-7).all()
        # Blocks nobody copied are untouched.
        assert torch.equal(back[0], stored[0])
    if compression == "int8" and spec.quantized:  # the same format: copied as is
        assert torch.equal(device[0][0][2], device[0][0][1])
