"""The block layout of the CPU quantized-linear kernels (csrc/quant_cpu.cpp), built from
each weight format once at load.

Every format becomes unsigned codes q (4 or 8 bits) in blocks of `block` input columns with
one scale s and one offset m per (row, block): w = s * q + m. Rows are padded to a
multiple of 64 columns (codes 0, s = m = 0: padded columns add nothing). 4-bit codes of the
two blocks of each 64-column register share bytes: byte j = code(b, j) | code(b + 1, j) << 4.
s and m are stored as float16 when that is exact for every element (the GGUF types whose
block scales are float16: half the scale bytes), else float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# gguf.GGMLQuantizationType values (not imported: gguf is needed only to load a GGUF file).
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
QK_K = 256


@dataclass(frozen=True)
class BlockLayout:
    codes: torch.Tensor  # uint8 [N, padded K * bits / 8]
    scales: torch.Tensor  # float16 or float32 [N, padded K / block]
    offsets: torch.Tensor  # same dtype and shape as scales
    bits: int
    block: int
    shape: tuple[int, int]  # the logical [N, K]


def _fits_half(t: torch.Tensor) -> bool:
    h = t.to(torch.float16)
    return bool(torch.isfinite(h).all()) and torch.equal(h.to(torch.float32), t)


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
         block: int) -> BlockLayout:
    """codes uint8 [N, K] (values < 2**bits), scales/offsets float32 [N, ceil(K / block)]."""
    n, k = codes.shape
    kp = -(-k // 64) * 64
    nbp = kp // block
    c = torch.zeros(n, kp, dtype=torch.uint8)
    c[:, :k] = codes
    s = torch.zeros(n, nbp, dtype=torch.float32)
    m = torch.zeros(n, nbp, dtype=torch.float32)
    s[:, : scales.shape[1]] = scales
    m[:, : offsets.shape[1]] = offsets
    if bits == 4:
        pairs = c.view(n, kp // 64, 2, 32)
        c = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(n, kp // 2)
    if _fits_half(s) and _fits_half(m):
        s, m = s.to(torch.float16), m.to(torch.float16)
    return BlockLayout(c.contiguous(), s.contiguous(), m.contiguous(), bits, block, (n, k))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles first, then high (Q4_0 / Q4_1)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _kquant_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-block scales and mins of a Q4_K / Q5_K super-block ([nb, 12] -> 2x [nb, 8])."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Blocks [nb, bytes] -> (codes [nb, values], s, m [nb, sub-blocks], bits, block)."""
    if qtype == Q4_0:
        d = _f16(raw[:, 0:2])
        return _nibbles(raw[:, 2:18]), d, -8.0 * d, 4, 32
    if qtype == Q4_1:
        return _nibbles(raw[:, 4:20]), _f16(raw[:, 0:2]), _f16(raw[:, 2:4]), 4, 32
    if qtype == Q8_0:
        d = _f16(raw[:, 0:2])
        codes = (raw[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128.0 * d, 8, 32
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
        sc, mn = _kquant_scale_min(raw[:, 4:16])
        if qtype == Q4_K:
            qs = raw[:, 16:144].reshape(-1, 4, 1, 32)
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K)
            bits = 4
        else:
            qh, qs = raw[:, 16:48], raw[:, 48:176].reshape(-1, 4, 1, 32)
            low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            codes, bits = (low | (high << 4)).reshape(-1, QK_K), 8
        return codes, d * sc, -(dmin * mn), bits, 32
    if qtype == Q6_K:
        ql, qh = raw[:, 0:128].reshape(-1, 2, 1, 64), raw[:, 128:192].reshape(-1, 2, 1, 32)
        sc = raw[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(raw[:, 208:210])
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        codes = (low | (high << 4)).reshape(-1, QK_K)  # q + 32, in [0, 64)
        s = d * sc
        return codes, s, -32.0 * s, 8, 16
    raise ValueError(f"no CPU kernel layout for GGUF quant type {qtype}")


GGUF_BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (QK_K, 144),
              Q5_K: (QK_K, 176), Q6_K: (QK_K, 210)}


def from_gguf(raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> BlockLayout:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) in the kernel layout."""
    n, k = shape
    values, nbytes = GGUF_BLOCK[qtype]
    if k % values or tuple(raw.shape) != (n, k // values * nbytes):
        raise ValueError(f"GGUF type {qtype}: raw {list(raw.shape)} does not hold [{n}, {k}]")
    blocks = raw.cpu().numpy().reshape(-1, nbytes)
    codes, s, m, bits, block = _decode(blocks, qtype)
    return pack(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)),
                torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32).reshape(n, -1)),
                torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32).reshape(n, -1)),
                bits, block)


def from_group_quant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int, group_size: int) -> BlockLayout:
    """Group-wise codes (w = (q - zero) * scale per group of group_size, a multiple of 32
    or at least K) as blocks of 32: s = scale, m = -zero * scale of the block's group."""
    k = qweight.shape[1]
    group_of_block = torch.arange(-(-k // 32)) * 32 // group_size
    s = scales.float()[:, group_of_block]
    m = -(zeros.float()[:, group_of_block] * s)
    return pack(qweight.cpu(), s.cpu(), m.cpu(), bits, 32)


def int8_codes(qweight: torch.Tensor) -> torch.Tensor:
    """W8A8 codes for i8_linear: int8 weight + 128 as uint8 [N, K padded to 64]."""
    n, k = qweight.shape
    kp = -(-k // 64) * 64
    codes = torch.full((n, kp), 128, dtype=torch.uint8)
    codes[:, :k] = (qweight.cpu().to(torch.int16) + 128).to(torch.uint8)
    return codes
