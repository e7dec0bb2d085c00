"""The plain PyTorch reference of every op: runs on any device (every tensor it creates is
made on its inputs' device), and is what each kernel is tested against.

Layouts: tokens are rows ([T, ...]); the paged caches are [num_blocks, block_size, Hk, D];
`slot_mapping` [T] holds flat slots (block_id * block_size + offset), all >= 0. A quantized
cache (kv_quant.py: int8 / fp8 codes) comes with its scale tensors k_scale, v_scale
[num_blocks, block_size, Hk]: writes quantize, reads dequantize (None: a plain cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.ops import truncation
from pagoda.ops.kv_quant import dequantize, quantize


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim (float32 math for low-precision x), in x's dtype."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); a kernel may reuse x's and residual's storage."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the index of each row's first maximum of x [rows, n] (a NaN counts as
    the maximum). Low-precision rows are cast first: exact, and faster than their argmax."""
    return x.float().argmax(dim=-1)


def race_rows(logits: torch.Tensor, temperature: torch.Tensor | None,
              exps: torch.Tensor | None, seeds: torch.Tensor | None = None,
              top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
              min_p: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: each row's token of the exponential race, the first maximum of
    softmax(x) / E with x = logits / temperature (none: 1), cut by `truncate_rows` where
    top_k, top_p or min_p is given, and E [rows, n] Exp(1) draws: token i with probability
    softmax(x)_i. E is `exps`, except for the rows whose `seeds` entry is >= 0 (all rows
    where `exps` is None), which draw their own. A row of temperature 0 takes its logits'
    first maximum. (The CPU kernel computes exp(x - max x) / E, the unnormalised
    probabilities: the same distribution, other roundings; its own draws come from a counter
    hash of the seed, these from torch's generator.)"""
    x = logits.float()
    e = torch.empty_like(x).exponential_() if exps is None else exps
    if seeds is not None and exps is not None:
        own = (seeds >= 0).to(x.device)
        e = torch.where(own.unsqueeze(1), torch.empty_like(x).exponential_(), exps)
    greedy = None
    if temperature is not None:
        greedy = temperature == 0
        x = x / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if top_k is not None or top_p is not None or min_p is not None:
        x = truncate_rows(x.clone(), top_k, top_p, min_p)
    raced = argmax_rows(x.softmax(dim=-1) / e)
    return raced if greedy is None else torch.where(greedy, argmax_rows(logits), raced)


def penalize_rows(x: torch.Tensor, repetition: torch.Tensor | None = None,
                  seen: torch.Tensor | None = None, frequency: torch.Tensor | None = None,
                  presence: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                  bias_rows: torch.Tensor | None = None, bias_ids: torch.Tensor | None = None,
                  bias_values: torch.Tensor | None = None) -> torch.Tensor:
    """In place, float32 rows x [rows, n]: each row's logit_bias entries (bias_rows,
    bias_ids [E], bias_values [E]) added; then, on the tokens `seen` [rows, n] bool (its
    prompt and output), positive logits divided by the row's `repetition` penalty [rows],
    the others multiplied; then frequency * count + presence * (count > 0) taken off
    (`frequency`, `presence` [rows], `counts` [rows, n]: occurrences in the output).
    Returns x."""
    if bias_rows is not None:
        x.index_put_((bias_rows, bias_ids), bias_values, accumulate=True)
    if repetition is not None:
        penalty = repetition.unsqueeze(1).expand_as(x)
        penalised = torch.where(x > 0, x / penalty, x * penalty)
        x.copy_(torch.where(seen, penalised, x))
    if frequency is not None:
        x.sub_(frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0))
    return x


def truncate_rows(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None) -> torch.Tensor:
    """Each row of scaled logits x [rows, n] float32 with the tokens its min_p (0: off),
    then top_k (<= 0 or >= n: off), then top_p (1: off) cut set to -inf, in place where it
    can (a kernel writes x): the sampler's truncation (truncation.py)."""
    return truncation.truncate_rows(x, top_k, top_p, min_p)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (neox) rotary: x [T, H, D]; cos/sin [T, 1, D/2] (broadcast over heads)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter this step's K/V ([T, Hk, D]) into their slots (quantized, with their scales,
    when the cache is)."""
    hk, d = k_cache.shape[2], k_cache.shape[3]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scale is None:
            cache.view(-1, hk, d).index_copy_(0, slot_mapping, x.to(cache.dtype))
        else:
            codes, scales = quantize(x, cache.dtype)
            cache.view(-1, hk, d).index_copy_(0, slot_mapping, codes)
            scale.view(-1, hk).index_copy_(0, slot_mapping, scales)


def rotary_and_cache(
    qkv: torch.Tensor,  # [T, H + 2 * Hk, D]: q heads, then k heads, then v heads
    cos: torch.Tensor,  # [max_positions, D / 2]
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotates q and k of `qkv` in place, then writes k and v into their cache slots."""
    nqk = num_heads + num_kv_heads
    qk = qkv[:, :nqk]
    qk.copy_(apply_rotary(qk, cos[positions][:, None], sin[positions][:, None]))
    write_kv(qkv[:, num_heads:nqk], qkv[:, nqk:], k_cache, v_cache, slot_mapping, k_scale,
             v_scale)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> the first max_len tokens of each table: [B, max_len, Hk, D]."""
    block_size = cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    # NOTE: .to is a no-op for tables already on the cache's device (the runner's decode
    # tables); a prefill's table may still be on the host.
    g = cache[block_tables[:, :num_blocks].to(cache.device)]  # [B, nb, bs, Hk, D]
    g = g.view(g.shape[0], num_blocks * block_size, cache.shape[2], cache.shape[3])
    return g[:, :max_len]


def gather_kv(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    max_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """gather_blocks in `dtype`, dequantized through `scale` for a quantized cache."""
    if scale is None:
        return gather_blocks(cache, block_tables, max_len).to(dtype)
    codes = gather_blocks(cache, block_tables, max_len)
    return dequantize(codes, gather_blocks(scale[..., None], block_tables, max_len)[..., 0],
                      dtype)


def paged_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,  # max(seq_lens), when the caller knows it (no sync)
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_sink: torch.Tensor | None = None,  # [B, H, D]: attention sinks' query
    num_sink_tokens: int = 0,
) -> torch.Tensor:
    """One query row per sequence over positions [max(0, len - window), len) of its paged
    context: [B, H, D] in q's dtype. With q_sink (attention sinks, attention/sinks.py):
    positions [0, min(S, len)) are read with q_sink and the window's others with q, in one
    softmax (S = num_sink_tokens)."""
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    b, h, d = q.shape
    keys = gather_kv(k_cache, k_scale, block_tables, max_seq_len, q.dtype)  # [B, L, Hk, D]
    values = gather_kv(v_cache, v_scale, block_tables, max_seq_len, q.dtype)
    key_pos = torch.arange(max_seq_len, device=q.device)
    lens = seq_lens.to(q.device)[:, None]
    valid = key_pos[None, :] < lens
    if sliding_window is not None:
        valid &= key_pos[None, :] > lens - 1 - sliding_window
    if q_sink is not None:
        return _sink_rows(q, q_sink, keys, values, valid, key_pos < num_sink_tokens, lens,
                          scale)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=valid[:, None, None, :],  # [B, 1, 1, L]
        scale=scale,
        enable_gqa=h != k_cache.shape[2],
    )
    return out.view(b, h, d)


def _sink_rows(q: torch.Tensor, q_sink: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               valid: torch.Tensor, sink: torch.Tensor, lens: torch.Tensor, scale: float
               ) -> torch.Tensor:
    """paged_attention's sinks case: keys / values [B, L, Hk, D], valid [B, L] (the window),
    sink [L] (positions below S); float32 softmax, [B, H, D] in q's dtype."""
    group = q.shape[1] // keys.shape[2]
    kx = keys.float().repeat_interleave(group, dim=2)  # [B, L, H, D]
    vx = values.float().repeat_interleave(group, dim=2)
    scores = torch.where(sink[None, None, :],
                         torch.einsum("bhd,blhd->bhl", q_sink.float(), kx),
                         torch.einsum("bhd,blhd->bhl", q.float(), kx)) * scale
    keep = valid | (sink[None, :] & (torch.arange(sink.shape[0], device=q.device)[None, :]
                                     < lens))
    probs = torch.softmax(scores.masked_fill(~keep[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhl,blhd->bhd", probs, vx).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: the requests' query rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, max_blocks]
    query_starts: torch.Tensor,  # [R]: request r's rows are q[query_starts[r]:][:query_lens[r]]
    query_lens: torch.Tensor,  # [R]
    seq_lens: torch.Tensor,  # [R]: context after this step; the rows are its last positions
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of several requests' query rows over their paged contexts: a row at
    position p reads positions [max(0, p - window + 1), p]. [T, H, D] in q's dtype; rows of
    no request are 0 here and unspecified in a kernel (a batch's decode rows)."""
    out = torch.zeros_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    for r, (start, query_len, seq_len) in enumerate(
        zip(query_starts.tolist(), query_lens.tolist(), seq_lens.tolist())
    ):
        table = block_tables[r : r + 1]
        keys = gather_kv(k_cache, k_scale, table, seq_len, q.dtype)[0]  # [L, Hk, D]
        values = gather_kv(v_cache, v_scale, table, seq_len, q.dtype)[0]
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        rows = slice(start, start + query_len)
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q[rows], keys, values))
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
        out[rows] = o[0].transpose(0, 1)
    return out
