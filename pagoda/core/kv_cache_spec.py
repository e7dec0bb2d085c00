"""What one group of layers stores per token in the paged KV cache, and what that costs.

A `KVCacheSpec` describes a group of layers that share one layout: the attention kind (full,
sliding window of W tokens, or an MLA latent), the cache dtype (independent of the model's),
the block size and the per-token row. A quantized dtype (int8, fp8 e4m3: ops/kv_quant.py)
adds a float32 scale per token and kv head beside K and V. Pool sizing divides a memory budget by the bytes one
block takes over every group; the worker allocates the tensors per group.

Each group has its own block table per request (core/kv_cache_manager.py). What a group
keeps of a request is its `KVRetention`: everything (full attention), or the first
`num_sink_tokens` and the last `window` tokens (a sliding window; attention sinks add the
sink tokens). Blocks that hold nothing a later query reads are freed and replaced by the null
block (block 0) in the table, so the table keeps one entry per block of the sequence.
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


@dataclass(frozen=True, slots=True)
class KVRetention:
    """Which tokens of a request one group keeps: a query at position p reads the keys at
    positions k <= p with k < num_sink_tokens or k > p - window (window None: all k <= p).
    """

    window: int | None = None
    num_sink_tokens: int = 0

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a retention window must be at least 1, got {self.window}")
        if self.num_sink_tokens < 0 or (self.num_sink_tokens and self.window is None):
            raise ValueError("num_sink_tokens must be >= 0 and needs a window")

    @property
    def keeps_all(self) -> bool:
        return self.window is None

    def num_sink_blocks(self, block_size: int) -> int:
        """Leading blocks that hold a sink token (kept for the request's life)."""
        return -(-self.num_sink_tokens // block_size)

    def first_window_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block of the window that queries from position `num_computed_tokens`
        on read (0 when everything is kept); blocks before it, sink blocks aside, are never
        read again."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // block_size

    def needs_block(self, j: int, num_computed_tokens: int, block_size: int) -> bool:
        """Whether block j is read by a query at position `num_computed_tokens` or later."""
        return (j < self.num_sink_blocks(block_size)
                or j >= self.first_window_block(num_computed_tokens, block_size))

    def num_kept_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks of a table covering `num_tokens` computed tokens that this group keeps."""
        n = -(-num_tokens // block_size)
        sinks = min(n, self.num_sink_blocks(block_size))
        first = max(self.first_window_block(num_tokens, block_size), sinks)
        return sinks + max(0, n - first)


def max_blocks_held(
    retention: KVRetention, max_len: int, max_chunk: int, block_size: int
) -> int:
    """The most blocks a request of up to `max_len` tokens, computed `max_chunk` tokens a
    step at most, holds in a group with this retention at any step."""
    num_entries = -(-max_len // block_size)
    if retention.keeps_all:
        return num_entries
    # NOTE: a step from c on holds [first_window_block(c), ceil((c + n) / block_size)):
    # at most ceil((W - 1 + n) / block_size) + 1 entries, plus the sink blocks.
    span = -(-(retention.window - 1 + max_chunk) // block_size) + 1
    return min(num_entries, retention.num_sink_blocks(block_size) + span)


def retentions_for(
    specs: Sequence[KVCacheSpec], num_sink_tokens: int = 0, streaming_window: int | None = None
) -> list[KVRetention]:
    """Each group's retention: a sliding-window group keeps its window; a full-attention
    group keeps everything, or with attention sinks (StreamingLLM) the first
    `num_sink_tokens` and the last `streaming_window` tokens."""
    out = []
    for spec in specs:
        if spec.kind == AttentionKind.SLIDING_WINDOW:
            out.append(KVRetention(spec.sliding_window))
        elif streaming_window is not None:
            out.append(KVRetention(streaming_window, num_sink_tokens))
        else:
            out.append(KVRetention())
    return out


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
