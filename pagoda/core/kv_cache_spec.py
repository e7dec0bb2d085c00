"""What one group of layers stores per token in the paged KV cache, and what that costs.

A `KVCacheSpec` describes a group of layers that share one layout: the attention kind (full,
sliding window of W tokens, or an MLA latent), the cache dtype (independent of the model's),
the block size and the per-token row. A quantized dtype (int8, fp8 e4m3: ops/kv_quant.py)
adds a float32 scale per token and kv head beside K and V. Pool sizing divides a memory budget by the bytes one
block takes over every group; the worker allocates the tensors per group.

NOTE: today every group shares one block table per request (the manager is single-group),
so a sliding-window group keeps its whole context until window freeing lands; its kind
only decides the attention mask for now.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.ops.kv_quant import SCALE_DTYPE, is_quantized, storage_dtype


class AttentionKind(enum.Enum):
    FULL = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla_latent"  # one latent row per token (no separate K and V)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    kind: AttentionKind
    layer_ids: tuple[int, ...]  # the model's layers in this group, in order
    block_size: int
    num_kv_heads: int  # 1 for an MLA latent
    head_size: int  # the latent width for MLA
    dtype: torch.dtype
    sliding_window: int | None = None  # W, only for SLIDING_WINDOW

    def __post_init__(self) -> None:
        if (self.kind == AttentionKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("a sliding-window spec needs sliding_window, other kinds none")

    @property
    def num_tensors_per_layer(self) -> int:
        """K and V, or the one latent tensor of MLA."""
        return 1 if self.kind == AttentionKind.MLA else 2

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """One block of one tensor of one layer: [block_size, num_kv_heads, head_size]."""
        return (self.block_size, self.num_kv_heads, self.head_size)

    @property
    def quantized(self) -> bool:
        """Codes plus per-(token, kv head) scales instead of plain values."""
        return is_quantized(self.dtype)

    def layer_tensors(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape of one block, storage dtype) of each tensor of one layer: K and V (or the
        latent), then, when quantized, their scales [block_size, num_kv_heads]."""
        codes = [(self.layer_shape, storage_dtype(self.dtype))] * self.num_tensors_per_layer
        if not self.quantized:
            return codes
        scales = [((self.block_size, self.num_kv_heads), SCALE_DTYPE)] * len(codes)
        return codes + scales

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer of the group (scales included)."""
        per_layer = 0
        for shape, dtype in self.layer_tensors():
            elems = 1
            for n in shape[1:]:
                elems *= n
            per_layer += elems * torch.empty((), dtype=dtype).element_size()
        return per_layer * len(self.layer_ids)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def bytes_per_block(specs: Sequence[KVCacheSpec]) -> int:
    """Bytes one block id takes over all groups (each group holds that block)."""
    return sum(s.bytes_per_block for s in specs)


def group_layers(
    windows: Sequence[int | None],
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> list[KVCacheSpec]:
    """One spec per distinct layer layout of a decoder whose layer i attends to the last
    windows[i] tokens (None: all of them); groups are ordered by their first layer."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    return [
        KVCacheSpec(
            kind=AttentionKind.FULL if window is None else AttentionKind.SLIDING_WINDOW,
            layer_ids=tuple(layers),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            sliding_window=window,
        )
        for window, layers in by_window.items()
    ]
