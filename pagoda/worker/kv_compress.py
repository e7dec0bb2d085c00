"""Compressed KV blocks for the host pools (the seed's "memory KV cache"): blocks nobody is
reading (the prefix cache's host tier, swapped-out requests) are kept as int8 or int4 codes
with a float32 scale per token and kv head, and decompressed when they come back.

Formats (`--kv-host-compression`): "none" (the device cache's own layout, copied as is),
"int8" (the int8 KV cache's layout and rounding: ops/kv_quant.py), "int4" (symmetric,
scale = amax / 7, codes in [-7, 7] stored + 8 as two nibbles per byte, element 2i in the
low nibble). A host pool in the device cache's layout is copied block for block; otherwise
every copy dequantizes its source to float32 and quantizes into the destination's format
(a quantized device cache requantizes what comes back: int8 onto an int8 cache with the
scale it was stored with reproduces the codes).

Only fixed-size formats: a host slot has one size, so the host pools' slot accounting stays
as it is. A lossless pass (zlib) over the codes was measured (`pagoda bench kv-quant`) and
is not applied: see docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.config import HOST_COMPRESSIONS
from pagoda.core.kv_cache_spec import KVCacheSpec
from pagoda.ops.kv_quant import SCALE_DTYPE, dequantize, quantize

_INT4_MAX = 7.0


def host_layer_tensors(spec: KVCacheSpec, compression: str) -> list[tuple[tuple, torch.dtype]]:
    """(shape of one block, dtype) of each host tensor of one layer of `spec`."""
    if compression == "none":
        return spec.layer_tensors()
    n = spec.num_tensors_per_layer
    scales = [((spec.block_size, spec.num_kv_heads), SCALE_DTYPE)] * n
    if compression == "int8":
        codes = [(spec.layer_shape, torch.int8)] * n
    elif compression == "int4":
        if spec.head_size % 2:
            raise ValueError(f"kv_host_compression int4 needs an even head size, got "
                             f"{spec.head_size}")
        bs, hk, d = spec.layer_shape
        codes = [((bs, hk, d // 2), torch.uint8)] * n
    else:
        raise ValueError(f"kv_host_compression must be one of {list(HOST_COMPRESSIONS)}, "
                         f"got {compression!r}")
    return codes + scales


def host_bytes_per_block(specs: Sequence[KVCacheSpec], compression: str) -> int:
    """Bytes one host block takes over every group in `compression`."""
    total = 0
    for spec in specs:
        per_layer = sum(
            torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in host_layer_tensors(spec, compression)
        )
        total += per_layer * len(spec.layer_ids)
    return total


def pack_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (nibble pairs [..., D / 2] uint8, scales [...] float32)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / _INT4_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (torch.round(xf / safe[..., None]).clamp(-_INT4_MAX, _INT4_MAX) + 8).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """pack_int4's output -> float32 values [..., D]."""
    lo = (packed & 0xF).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    codes = torch.stack((lo, hi), dim=-1).flatten(-2)
    return codes.float() * scales[..., None]


def pool_format(spec: KVCacheSpec, compression: str = "none") -> str:
    """The format of a pool's blocks: the device cache's ("plain", "int8", "fp8") when
    `compression` is "none", else the compression's."""
    if compression != "none":
        return compression
    if not spec.quantized:
        return "plain"
    return "int8" if spec.dtype == torch.int8 else "fp8"


def decode_blocks(tensors: Sequence[torch.Tensor], idx: torch.Tensor, fmt: str,
                  dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Blocks `idx` of one layer's tensors in format `fmt` -> their K and V values."""
    if fmt == "plain":
        return [t[idx].to(dtype) for t in tensors]
    n = len(tensors) // 2
    if fmt == "int4":
        return [unpack_int4(tensors[i][idx], tensors[n + i][idx]).to(dtype) for i in range(n)]
    return [dequantize(tensors[i][idx], tensors[n + i][idx], dtype) for i in range(n)]


def encode_blocks(values: Sequence[torch.Tensor], fmt: str,
                  plain_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """K and V values of some blocks -> the tensors of format `fmt` (codes, then scales);
    "plain" casts to `plain_dtype`."""
    if fmt == "plain":
        return [v.to(plain_dtype) for v in values]
    pairs = [pack_int4(v) if fmt == "int4" else
             quantize(v, torch.int8 if fmt == "int8" else torch.uint8) for v in values]
    return [c for c, _ in pairs] + [s for _, s in pairs]


def convert_blocks(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                   src_idx: torch.Tensor, dst_idx: torch.Tensor, src_fmt: str,
                   dst_fmt: str) -> None:
    """dst[dst_idx] = src[src_idx] for one layer, converting between the two formats."""
    values = [v.to(dst[0].device) for v in decode_blocks(src, src_idx, src_fmt)]
    for out, t in zip(dst, encode_blocks(values, dst_fmt, dst[0].dtype), strict=True):
        out[dst_idx] = t
