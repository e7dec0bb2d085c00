"""Attention with sinks (StreamingLLM) over the paged cache, in plain PyTorch.

A query at position p reads the first S keys (the sinks) and the keys in (p - W, p] (its
window); nothing else of its sequence is kept (core/kv_cache_manager.py frees it). Rotary
positions are taken within that cache, as the paper does: the query sits at cache position
p - d, where d = max(0, p - (S + W - 1)) is the number of tokens evicted between the sinks
and the window, and a key keeps its rank in the cache.

Keys are stored rotated at their absolute positions (the ordinary fused rotary + KV write).
RoPE scores depend only on the query-key distance, so a window key, whose distance to the
query is the same in the cache as in the sequence, is read as stored. Only the sinks' scores
need the cache distance: the query is rotated back by d for them (R(p - d) = R(-d) R(p)).
That is one rotation per query and head, instead of re-rotating the whole cache every step
(keys stored un-rotated and rotated at read: S + W rotations per query).
"""

from __future__ import annotations

import torch

from pagoda.layers.rotary import rotate_by
from pagoda.ops import gather_blocks
from pagoda.ops.kv_quant import dequantize


def gather_range(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int
                 ) -> torch.Tensor:
    """Positions [start, end) of one sequence's paged `cache`: [end - start, Hk, D]."""
    if end <= start:
        return cache.new_empty((0, *cache.shape[2:]))
    bs = cache.shape[1]
    first = start // bs
    rows = gather_blocks(cache, block_table[None, first:], end - first * bs)[0]
    return rows[start - first * bs :]


def gather_values(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
                  start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """gather_range in `dtype`, dequantized through `scale` for a quantized cache."""
    rows = gather_range(cache, block_table, start, end)
    if scale is None:
        return rows.to(dtype)
    return dequantize(rows, gather_range(scale[..., None], block_table, start, end)[..., 0],
                      dtype)


def sink_attention(
    q: torch.Tensor,  # [Q, H, D]: the queries of one sequence at positions [p0, p0 + Q)
    first_position: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_blocks] covering position p0 + Q - 1
    num_sink_tokens: int,
    window: int,
    inv_freq: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,  # a quantized cache's scales (ops/kv_quant.py)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Q, H, D] in q's dtype: each query over its sinks and window, positions in the cache."""
    num_q, num_heads, _ = q.shape
    last = first_position + num_q - 1
    pos = torch.arange(first_position, last + 1, device=q.device)
    num_sinks = min(num_sink_tokens, last + 1)
    win_start = max(num_sinks, first_position - window + 1)
    keys, values = ([gather_values(cache, sc, block_table, a, b, q.dtype)
                     for a, b in ((0, num_sinks), (win_start, last + 1))]
                    for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)))
    group = num_heads // k_cache.shape[2]
    evicted = (pos - (num_sink_tokens + window - 1)).clamp(min=0)
    queries = [rotate_by(q, -evicted, inv_freq), q]
    key_pos = [torch.arange(num_sinks, device=q.device),
               torch.arange(win_start, last + 1, device=q.device)]
    scores, vals = [], []
    for part, (qx, kx, vx, kp) in enumerate(zip(queries, keys, values, key_pos, strict=True)):
        kx = kx.repeat_interleave(group, dim=1)  # [L, H, D]
        s = torch.einsum("qhd,khd->hqk", qx, kx) * scale
        valid = kp[None, :] <= pos[:, None]
        if part == 1:  # the window (the sinks are read by every query past them)
            valid &= kp[None, :] > pos[:, None] - window
        scores.append(s.masked_fill(~valid[None], float("-inf")))
        vals.append(vx.repeat_interleave(group, dim=1))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, torch.cat(vals, dim=0))
