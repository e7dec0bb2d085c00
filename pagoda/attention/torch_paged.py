"""Paged attention in plain PyTorch: the CPU execution path and the reference for kernels.

New K/V are scattered into their slots first, then every query reads its whole context
back through its block table, so cached prefixes, earlier chunks and this step's tokens are
all read the same way. Decode rows go through `ops.paged_attention` (the C++ kernel on CPU,
the reference elsewhere); prefill chunks use SDPA. Every tensor made here is made on the
queries' device.
A quantized cache (ops/kv_quant.py) is the layer's (k, v, k_scale, v_scale): the writes
quantize, the kernel reads the codes in place, the reference paths dequantize what they
gather (a prefill with nothing cached before it reads the cache too, so that every query
sees the same stored K/V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda import ops
from pagoda.attention.backend import (
    TOKEN_ROW_DTYPES,
    AttentionMetadata,
    build_paged_metadata,
    register_backend,
)


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
        kv_cache: tuple[torch.Tensor, ...],
        md: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        k_cache, v_cache, *scales = kv_cache
        if not kv_written:
            ops.write_kv(k, v, k_cache, v_cache, md.slot_mapping, *scales)
        if md.prefills and q.dtype in TOKEN_ROW_DTYPES and md.token_seq_lens is not None:
            # NOTE: a kernel that reads the paged cache in place (no gather) with each prefill
            # token as its own query row runs 2-3x faster than SDPA's CPU flash kernel here
            # (head_dim 64, bf16). The reference would gather a context per token: not that.
            args = (
                q, k_cache, v_cache, md.token_block_tables, md.token_seq_lens, self.scale,
                self.sliding_window, None, *scales,
            )
            kernel = ops.paged_attention.select(*args)
            if kernel is not ops.paged_attention.reference:
                return kernel(*args).view(q.shape[0], -1)
        out = torch.empty_like(q)
        nd = md.num_decode_tokens
        if nd:
            out[:nd] = ops.paged_attention(
                q[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_seq_lens,
                self.scale, self.sliding_window, md.decode_max_seq_len, *scales,
            )
        for seq in md.prefills:
            s = slice(seq.query_start, seq.query_start + seq.query_len)
            if seq.seq_len == seq.query_len and not scales:
                # Nothing cached before this chunk: attend to its own K/V, no gather.
                keys, values = k[s].to(q.dtype), v[s].to(q.dtype)
            else:
                table = seq.block_table[None]
                k_scale, v_scale = scales or (None, None)
                keys = ops.gather_kv(k_cache, k_scale, table, seq.seq_len, q.dtype)[0]
                values = ops.gather_kv(v_cache, v_scale, table, seq.seq_len, q.dtype)[0]
            out[s] = self._prefill(q[s], keys, values)
        return out.view(q.shape[0], -1)

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
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        return out[0].transpose(0, 1)
