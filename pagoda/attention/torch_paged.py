"""Paged attention in plain PyTorch: the CPU execution path and the reference for kernels.

New K/V are scattered into their slots first, then every query reads its whole context
back through its block table, so cached prefixes, earlier chunks and this step's tokens are
all read the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionMetadata, build_paged_metadata, register_backend
from pagoda.attention.cpu_kernels import FUSED_DTYPES, paged_decode_attention


@register_backend("torch_paged")
class TorchPagedAttention:
    build_metadata = staticmethod(build_paged_metadata)

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if not kv_written:
            write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        if md.prefills and q.dtype in FUSED_DTYPES and md.token_seq_lens is not None:
            # NOTE: the decode kernel, with each prefill token as its own query row, reads
            # the paged cache in place (no gather) and runs 2-3x faster than SDPA's CPU
            # flash kernel here (head_dim 64, bf16). float32 keeps SDPA, the oracle path.
            fast = paged_decode_attention(
                q, k_cache, v_cache, md.token_block_tables, md.token_seq_lens, self.scale,
                self.sliding_window,
            )
            if fast is not None:
                return fast.view(q.shape[0], -1)
        out = torch.empty_like(q)
        nd = md.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, md)
        for seq in md.prefills:
            s = slice(seq.query_start, seq.query_start + seq.query_len)
            if seq.seq_len == seq.query_len:
                # Nothing cached before this chunk: attend to its own K/V, no gather.
                keys, values = k[s], v[s]
            else:
                keys = gather_blocks(k_cache, seq.block_table[None], seq.seq_len)[0]
                values = gather_blocks(v_cache, seq.block_table[None], seq.seq_len)[0]
            out[s] = self._prefill(q[s], keys.to(q.dtype), values.to(q.dtype))
        return out.view(q.shape[0], -1)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        bt, seq_lens = md.decode_block_tables, md.decode_seq_lens
        fast = paged_decode_attention(
            q, k_cache, v_cache, bt, seq_lens, self.scale, self.sliding_window
        )
        if fast is not None:  # NOTE: None when the C++ kernel is unavailable or disabled
            return fast
        b = q.shape[0]
        # NOTE: the cache may hold another dtype than q (--kv-cache-dtype).
        keys = gather_blocks(k_cache, bt, md.decode_max_seq_len).to(q.dtype)  # [B, L, Hk, D]
        values = gather_blocks(v_cache, bt, md.decode_max_seq_len).to(q.dtype)
        key_pos = torch.arange(keys.shape[1])
        valid = key_pos[None, :] < seq_lens[:, None]
        if self.sliding_window is not None:
            valid &= key_pos[None, :] > (seq_lens[:, None] - 1 - self.sliding_window)
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out.view(b, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [Q, H, D] are the last Q of the L = len(keys) context positions."""
        query_len, seq_len = q.shape[0], keys.shape[0]
        gqa = self.num_kv_heads != self.num_heads
        # NOTE: 4-D inputs: with 3-D ones SDPA on CPU falls back to its math path (5x slower).
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, keys, values))
        if query_len == seq_len and self.sliding_window is None:
            out = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        return out[0].transpose(0, 1)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V ([T, Hk, D]) into their slots."""
    hk, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> the first max_len tokens of each table: [B, max_len, Hk, D]."""
    block_size = cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    g = cache[block_tables[:, :num_blocks]]  # [B, nb, bs, Hk, D]
    g = g.view(g.shape[0], num_blocks * block_size, cache.shape[2], cache.shape[3])
    return g[:, :max_len]
