"""The panel layout of the CPU quantized-linear kernels (csrc/quant_cpu.cpp), built from
each weight format once at load, and read back by the references (any device).

Every format becomes unsigned codes q (4 or 8 bits) with one scale s and one offset per
(row, group of `group` input columns): w = s * (q - z) (`zero_form`: GPTQ/AWQ/RTN, Q4_0,
Q8_0, Q6_K) or w = s * q + m (Q4_1, Q4_K, Q5_K). Codes are held in panels of 16 rows (N
padded to a multiple of 16, K to a multiple of 64, with code 0 and scale 0): per panel and
per 8 input columns c..c+7, 16 * bits bytes, byte 4 * r + j holding row r's code of column
c + j (8-bit: the first 64 bytes; column c + 4 + j in the next 64) or, 4-bit,
code(c + j) | code(c + 4 + j) << 4: half a byte a 4-bit code. Scales and offsets are
[panels, G, 16], panel by panel like the codes (a panel's 16 rows side by side): a
single-row product then reads each thread's scales as one sequential stream, not one cache
line per group from rows N values apart. A loaded [G, N] GPTQ/AWQ tensor is kept as it is
instead (no copy), and the kernels read both. float16 where that is exact for every
element, else float32; integer zeros in [0, 255] as uint8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# gguf.GGMLQuantizationType values (not imported: gguf is needed only to load a GGUF file).
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
QK_K = 256
PANEL = 16  # output rows per panel (one int32 lane each in the kernel)


@dataclass(frozen=True)
class BlockLayout:
    codes: torch.Tensor  # uint8 [padded N / 16, padded K * 2 * bits]
    scales: torch.Tensor  # float16 or float32 [padded N / 16, G, 16] (or [G, padded N])
    offsets: torch.Tensor  # the same shape: zeros z (zero_form; also uint8) or offsets m
    bits: int  # 4 or 8: the stored width (fewer-bit codes are held as 4-bit)
    group: int  # input columns per scale (G == 1: the whole row)
    zero_form: bool
    shape: tuple[int, int]  # the logical [N, K]
    block: int = 32  # the kernel's activation block (16 for Q6_K)

    def unpack_codes(self) -> torch.Tensor:
        """uint8 [N, K]."""
        n, k = self.shape
        panels, kp = self.codes.shape[0], self.codes.shape[1] // (2 * self.bits)
        if self.bits == 8:
            c = self.codes.view(panels, kp // 4, PANEL, 4).permute(0, 2, 1, 3)
        else:
            v = self.codes.view(panels, kp // 8, 1, PANEL, 4)
            c = torch.cat([v & 0x0F, v >> 4], dim=2).permute(0, 3, 1, 2, 4)
        return c.reshape(panels * PANEL, kp)[:n, :k]

    def scale_rows(self) -> torch.Tensor:
        """float32 [N, G]."""
        return _per_row(self.scales)[: self.shape[0]].float()

    def offset_rows(self) -> torch.Tensor:
        """float32 [N, G]: the zeros (zero_form) or the offsets m."""
        return _per_row(self.offsets)[: self.shape[0]].float()

    def row_codes(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [len(rows), K]: the codes of output rows `rows` (int64) only."""
        panels, kp = self.codes.shape[0], self.codes.shape[1] // (2 * self.bits)
        p, lane = rows // PANEL, rows % PANEL
        if self.bits == 8:
            c = self.codes.view(panels, kp // 4, PANEL, 4)[p, :, lane]
        else:
            v = self.codes.view(panels, kp // 8, PANEL, 4)[p, :, lane]
            c = torch.stack([v & 0x0F, v >> 4], dim=2)
        return c.reshape(len(rows), kp)[:, : self.shape[1]]

    def _values(self, q: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """codes [R, K] and per-group scales / offsets [R, G] -> float32 weights [R, K]."""
        g = torch.arange(q.shape[1], device=q.device) // self.group
        q, s, o = q.to(torch.float32), s[:, g], o[:, g]
        return (q - o) * s if self.zero_form else s * q + o

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (float32 arithmetic, as the formats define it)."""
        return self._values(self.unpack_codes(), self.scale_rows(), self.offset_rows())

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [len(rows), K]: rows `rows` (int64) of `dequantize()`, computed alone."""
        cols = rows.to(self.codes.device)
        return self._values(self.row_codes(cols), _rows_of(self.scales, cols).float(),
                            _rows_of(self.offsets, cols).float())


def _per_row(t: torch.Tensor) -> torch.Tensor:
    """Scales or offsets in either stored shape -> [padded N, G]."""
    if t.dim() == 2:
        return t.T
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def _rows_of(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[len(rows), G]: rows `rows` (int64) of `_per_row(t)`, without the others."""
    if t.dim() == 2:
        return t[:, rows].T
    return t[rows // PANEL, :, rows % PANEL]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] (values < 2**bits) -> the panel bytes [padded N / 16, ...]."""
    n, k = codes.shape
    np_, kp = -(-n // PANEL) * PANEL, -(-k // 64) * 64
    c = torch.zeros(np_, kp, dtype=torch.uint8, device=codes.device)
    c[:n, :k] = codes
    if bits == 8:
        out = c.view(np_ // PANEL, PANEL, kp // 4, 4).permute(0, 2, 1, 3)
    else:
        v = c.view(np_ // PANEL, PANEL, kp // 8, 2, 4).permute(0, 2, 3, 1, 4)
        out = v[:, :, 0] | (v[:, :, 1] << 4)
    return out.reshape(np_ // PANEL, -1).contiguous()


def _exact_in(t: torch.Tensor, dtype: torch.dtype) -> bool:
    if t.device.type == "meta":
        return False  # NOTE: no values to check: keep the wider type
    c = t.to(dtype)
    return bool(torch.isfinite(c.float()).all()) and torch.equal(c.to(t.dtype), t)


def _kept(t: torch.Tensor, np_: int) -> bool:
    """Whether [N, G] values are a contiguous [G, N] float32/float16 tensor seen transposed
    (GPTQ/AWQ scales as loaded), which the layout keeps as [G, N] instead of copying."""
    return t.shape[0] == np_ and t.T.is_contiguous() and t.dtype in (torch.float32,
                                                                     torch.float16)


def _columns(t: torch.Tensor, np_: int, zeros: bool, by_panel: bool) -> torch.Tensor:
    """[N, G] per-row values -> [padded N / 16, G, 16] (`by_panel`) or [G, padded N], in
    the narrowest exact dtype (a `_kept` tensor by group as it is)."""
    n = t.shape[0]
    if not by_panel and _kept(t, np_):
        return t.T
    t = t.float()
    dtype = torch.float32
    if zeros and _exact_in(t, torch.uint8):
        dtype = torch.uint8
    elif _exact_in(t, torch.float16):
        dtype = torch.float16
    out = torch.zeros(np_, t.shape[1], dtype=dtype, device=t.device)
    out[:n] = t.to(dtype)
    if not by_panel:
        return out.T.contiguous()
    return out.view(np_ // PANEL, PANEL, -1).transpose(1, 2).contiguous()


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
         group: int, zero_form: bool, block: int = 32) -> BlockLayout:
    """codes uint8 [N, K] (values < 2**bits), scales / offsets [N, G] per group of `group`
    columns (G = ceil(K / group)). Offsets follow the scales' order (the kernels read one)."""
    n, k = codes.shape
    np_ = -(-n // PANEL) * PANEL
    stored = 4 if bits <= 4 else 8
    by_panel = not _kept(scales, np_)
    return BlockLayout(pack_codes(codes, stored), _columns(scales, np_, False, by_panel),
                       _columns(offsets, np_, zero_form, by_panel), stored, group, zero_form,
                       (n, k), block)


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
    """Blocks [nb, bytes] -> (codes [nb, values], s, offset [nb, sub-blocks], bits, block):
    the offset is a zero z (w = s * (q - z)) for Q4_0 / Q8_0 / Q6_K (ZERO_FORM), else m."""
    if qtype == Q4_0:
        d = _f16(raw[:, 0:2])
        return _nibbles(raw[:, 2:18]), d, np.full_like(d, 8.0), 4, 32
    if qtype == Q4_1:
        return _nibbles(raw[:, 4:20]), _f16(raw[:, 0:2]), _f16(raw[:, 2:4]), 4, 32
    if qtype == Q8_0:
        d = _f16(raw[:, 0:2])
        codes = (raw[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, np.full_like(d, 128.0), 8, 32
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
        return codes, d * sc, np.full((len(raw), 16), 32.0, dtype=np.float32), 8, 16
    raise ValueError(f"no CPU kernel layout for GGUF quant type {qtype}")


ZERO_FORM = frozenset({Q4_0, Q8_0, Q6_K})
GGUF_BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (QK_K, 144),
              Q5_K: (QK_K, 176), Q6_K: (QK_K, 210)}


def from_gguf(raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> BlockLayout:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) in the kernel layout."""
    n, k = shape
    values, nbytes = GGUF_BLOCK[qtype]
    if k % values or tuple(raw.shape) != (n, k // values * nbytes):
        raise ValueError(f"GGUF type {qtype}: raw {list(raw.shape)} does not hold [{n}, {k}]")
    blocks = raw.cpu().numpy().reshape(-1, nbytes)
    codes, s, offset, bits, block = _decode(blocks, qtype)
    return pack(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)),
                torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32).reshape(n, -1)),
                torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(n, -1)),
                bits, group=block, zero_form=qtype in ZERO_FORM, block=block)


# The types whose blocks the layout holds bit for bit (K-quants' sub-block scales are kept
# only as products, which do not convert back).
REPACKABLE = frozenset({Q4_0, Q4_1, Q8_0})


def _f16_bytes(v: torch.Tensor) -> np.ndarray:
    """float32 [N, nb] (float16 values) -> uint8 [N, nb, 2]."""
    return v.cpu().numpy().astype(np.float16)[..., None].view(np.uint8)


def to_gguf(lay: BlockLayout, qtype: int) -> torch.Tensor:
    """The raw blocks uint8 [N, bytes per row] a REPACKABLE type's layout was built from."""
    if qtype not in REPACKABLE:
        raise ValueError(f"GGUF type {qtype}: the layout does not hold its blocks exactly")
    n, k = lay.shape
    codes = lay.unpack_codes().cpu().numpy().reshape(n, k // 32, 32)
    parts = [_f16_bytes(lay.scale_rows())]
    if qtype == Q8_0:
        parts.append((codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8))
    else:
        if qtype == Q4_1:
            parts.append(_f16_bytes(lay.offset_rows()))
        parts.append(codes[..., :16] | (codes[..., 16:] << 4))
    return torch.from_numpy(np.concatenate(parts, axis=-1).reshape(n, -1))


def int8_codes(qweight: torch.Tensor) -> torch.Tensor:
    """W8A8 codes for i8_linear: int8 weight + 128 as uint8 [N, K padded to 64]."""
    n, k = qweight.shape
    kp = -(-k // 64) * 64
    codes = torch.full((n, kp), 128, dtype=torch.uint8)
    codes[:, :k] = (qweight.cpu().to(torch.int16) + 128).to(torch.uint8)
    return codes
