"""The integer packings of the checkpoint formats other tools write, both ways.

Codes are unsigned integers in [0, 2**bits); a weight is w = (q - zero) * scale per group of
`group_size` input columns. Every function here is exact (pure bit arithmetic), so a pack
followed by an unpack gives back the codes, and the tests check both directions against
hand-built words.

- GPTQ (AutoGPTQ / GPTQModel, "v1" layout): `qweight` int32 [K * bits / 32, N] holds 32 / bits
  consecutive input rows per word, row r * pack + i at bit i * bits. `qzeros` int32
  [G, N * bits / 32] packs along the output dim the same way and stores zero - 1 (a historical
  off-by-one every GPTQ reader undoes). `scales` [G, N] float16; `g_idx` int32 [K] gives each
  input column's group (a permutation of k // group_size under act_order / desc_act).
- AWQ (AutoAWQ's GEMM layout): 4-bit only. `qweight` int32 [K, N / 8] packs eight output
  columns per word in the interleaved order AWQ_ORDER (the nibble at bit 4 * i holds column
  8 * c + AWQ_ORDER[i]); `qzeros` int32 [G, N / 8] the same way, storing the zeros as they
  are; `scales` [G, N] float16.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# AWQ_REVERSE_ORDER[j] is the nibble that holds column j of a group of eight.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

PACKABLE_BITS = (2, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS} for int32 packing, got {bits}")
    return 32 // bits


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit codes along `dim` into int32 words, value i of a word at bit
    i * bits (the GPTQ order). codes.shape[dim] must be a multiple of 32 / bits."""
    per_word = _check_bits(bits)
    codes = codes.to(torch.int64)
    if codes.numel() and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) to pack into {bits} bits")
    dim = dim % codes.dim()
    size = codes.shape[dim]
    if size % per_word:
        raise ValueError(f"dim {dim} has {size} values, not a multiple of {per_word}")
    moved = codes.movedim(dim, -1).reshape(*codes.movedim(dim, -1).shape[:-1], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (moved << shifts).sum(dim=-1)
    # Words are unsigned 32-bit values; int32 holds them two's-complement, as the formats do.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `pack_int32`: int32 words -> uint8 codes, 32 / bits per word along `dim`."""
    per_word = _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    dim = dim % words.dim()
    moved = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    codes = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] * per_word)
    return codes.to(torch.uint8).movedim(-1, dim).contiguous()


def pack_gptq(
    codes: torch.Tensor, zeros: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [K, N] and integer zeros [G, N] -> (qweight [K*bits/32, N], qzeros [G, N*bits/32])
    in GPTQ's v1 layout (zeros stored minus one, wrapping as GPTQ writers do)."""
    stored = (zeros.to(torch.int64) - 1) % (1 << bits)
    return pack_int32(codes, bits, dim=0), pack_int32(stored, bits, dim=1)


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, qzeros) in GPTQ's v1 layout -> (codes uint8 [K, N], zeros int16 [G, N])."""
    codes = unpack_int32(qweight, bits, dim=0)
    zeros = unpack_int32(qzeros, bits, dim=1).to(torch.int16) + 1
    return codes, zeros


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [K, N] and zeros [G, N] (4-bit) -> (qweight [K, N/8], qzeros [G, N/8]) in AWQ's
    interleaved GEMM layout."""
    order = torch.tensor(AWQ_ORDER, device=codes.device)
    return _pack_interleaved(codes, order), _pack_interleaved(zeros, order)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [K, N/8], qzeros [G, N/8]) in AWQ's layout -> (codes uint8 [K, N],
    zeros uint8 [G, N])."""
    reverse = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)
    return _unpack_interleaved(qweight, reverse), _unpack_interleaved(qzeros, reverse)


def _pack_interleaved(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 output columns per word; {cols} is not a multiple of 8")
    grouped = values.reshape(rows, cols // 8, 8).index_select(-1, order)
    return pack_int32(grouped.reshape(rows, cols), 4, dim=1)


def _unpack_interleaved(words: torch.Tensor, reverse: torch.Tensor) -> torch.Tensor:
    nibbles = unpack_int32(words, 4, dim=1)
    rows, cols = nibbles.shape
    return nibbles.reshape(rows, cols // 8, 8).index_select(-1, reverse).reshape(rows, cols)


def gptq_group_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input-column permutation that makes each group contiguous (act_order checkpoints),
    or None when g_idx is already k // group_size. ValueError when g_idx does not put exactly
    group_size columns in each group (the one shape a contiguous-group kernel can take)."""
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=(k + group_size - 1) // group_size)
    expected = torch.full_like(counts, group_size)
    if k % group_size:
        expected[-1] = k % group_size
    if counts.numel() != expected.numel() or not torch.equal(counts, expected):
        raise ValueError(f"g_idx does not assign {group_size} input columns to each group")
    return torch.argsort(g_idx, stable=True)
