"""Paged attention in plain PyTorch: the CPU execution path and the reference for kernels.

New K/V are scattered into their slots first, then every query reads its whole context
back through its block table, so cached prefixes, earlier chunks and this step's tokens are
all read the same way. Decode rows go through `ops.paged_attention` (the C++ kernel on CPU,
the reference elsewhere); bf16 prefill chunks through `ops.paged_prefill_attention` where a
kernel runs (CPU: tiles of query rows), else SDPA (float32 always: the oracle path). Every
tensor made here is made on the queries' device.
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
from pagoda.attention.sinks import sink_attention
from pagoda.layers.rotary import rotate_by

# A request whose query rows times G (query heads per kv head) are fewer takes the decode
# kernel's rows instead of the tiled prefill kernel, which computes lane blocks of 16 query
# vectors (8 in its AVX2 build). NOTE (measured on AVX-512, one thread, 9 / 3 heads x 64,
# bf16, context 1,000): 16 requests of 2 rows (6 vectors each) ran 2x faster as rows, of 5
# rows (15) at parity, of 16 rows 1.6x slower as rows. Not measured on AVX2.
TILED_MIN_QUERY_VECTORS = 16


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
        # (S, W, rotary inverse frequencies) with attention sinks (attention/sinks.py).
        self.sinks: tuple[int, int, torch.Tensor] | None = None

    def set_attention_sinks(self, num_sink_tokens: int, window: int, inv_freq: torch.Tensor
                            ) -> None:
        """Read the first `num_sink_tokens` and the last `window` keys, StreamingLLM's way."""
        self.sinks = (num_sink_tokens, window, inv_freq)

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
        if self.sinks is not None:
            return self._forward_sinks(q, k_cache, v_cache, md, scales)
        if md.prefills and q.dtype in TOKEN_ROW_DTYPES:
            out = self._forward_kernels(q, k_cache, v_cache, md, scales)
            if out is not None:
                return out.view(q.shape[0], -1)
        out = torch.empty_like(q)
        nd = md.num_decode_tokens
        if nd:
            out[:nd] = ops.paged_attention(
                q[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_seq_lens,
                self.scale, self.sliding_window, md.decode_max_seq_len, *scales,
            )
        for seq in md.prefills:
            s = slice(seq.query_start, seq.query_start + seq.query_len)
            key_start = 0
            if seq.seq_len == seq.query_len and not scales:
                # Nothing cached before this chunk: attend to its own K/V, no gather.
                keys, values = k[s].to(q.dtype), v[s].to(q.dtype)
            else:
                bs = k_cache.shape[1]
                if self.sliding_window is not None:
                    # NOTE: only the window's blocks (the ones before it are freed).
                    first = seq.seq_len - seq.query_len - self.sliding_window + 1
                    key_start = max(0, first) // bs * bs
                table = seq.block_table[None, key_start // bs :]
                k_scale, v_scale = scales or (None, None)
                n = seq.seq_len - key_start
                keys = ops.gather_kv(k_cache, k_scale, table, n, q.dtype)[0]
                values = ops.gather_kv(v_cache, v_scale, table, n, q.dtype)[0]
            out[s] = self._prefill(q[s], keys, values, key_start)
        return out.view(q.shape[0], -1)

    def _forward_kernels(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        md: AttentionMetadata, scales: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """A step with prefills through kernels that read the paged cache in place: the
        prefill rows through the tiled prefill kernel and the decode rows through the decode
        kernel; where the tiled one cannot run, every row through the decode kernel as its
        own query row. None: no kernel runs here (the caller takes SDPA)."""
        nd = md.num_decode_tokens
        tiled_kernel = (md.prefill_seq_lens is not None
                        and ops.paged_prefill_attention.kernel_for(q) is not None)
        split = self._tiled_split(md) if tiled_kernel else None
        if split is not None:
            arrays, rows = split
            args = (q, k_cache, v_cache, *arrays, self.scale, self.sliding_window, *scales)
            tiled = ops.paged_prefill_attention.select(*args)
            if tiled is not ops.paged_prefill_attention.reference:
                out = tiled(*args)  # NOTE: rows of no tiled request are unwritten, filled here
                if rows is not None:
                    out[rows] = ops.paged_attention(
                        q[rows], k_cache, v_cache, md.token_block_tables[rows],
                        md.token_seq_lens[rows], self.scale, self.sliding_window, None,
                        *scales,
                    )
                elif nd:
                    out[:nd] = ops.paged_attention(
                        q[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_seq_lens,
                        self.scale, self.sliding_window, md.decode_max_seq_len, *scales,
                    )
                return out
        if md.token_seq_lens is not None:
            # NOTE: each prefill token as its own decode row still runs 2-3x faster than
            # SDPA's CPU flash kernel (head_dim 64, bf16); the reference would gather a
            # context per token: not that.
            args = (
                q, k_cache, v_cache, md.token_block_tables, md.token_seq_lens, self.scale,
                self.sliding_window, None, *scales,
            )
            kernel = ops.paged_attention.select(*args)
            if kernel is not ops.paged_attention.reference:
                return kernel(*args)
        return None

    def _tiled_split(
        self, md: AttentionMetadata
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
        """The prefill arrays (tables, starts, query lens, seq lens) of the requests with at
        least TILED_MIN_QUERY_VECTORS query vectors, and the flat rows left to the decode
        kernel when some request has fewer (None: the decode rows only); None: no request
        has enough. Derived once per step (the metadata's memo)."""
        group = self.num_heads // self.num_kv_heads
        key = ("tiled_split", group)
        if key in md.memo:
            return md.memo[key]
        lens = md.prefill_query_lens
        tiled = lens * group >= TILED_MIN_QUERY_VECTORS
        arrays = (md.prefill_block_tables, md.prefill_query_starts, lens, md.prefill_seq_lens)
        if bool(tiled.all()):
            split = (arrays, None)
        elif not bool(tiled.any()):
            split = None
        else:
            nd = md.num_decode_tokens
            row_kernel = ~torch.repeat_interleave(tiled, lens)  # over the prefill rows
            rows = torch.cat([torch.arange(nd, device=lens.device),
                              nd + row_kernel.nonzero()[:, 0]])
            split = (tuple(a[tiled] for a in arrays), rows)
        md.memo[key] = split
        return split

    def _forward_sinks(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        md: AttentionMetadata, scales: list[torch.Tensor],
    ) -> torch.Tensor:
        """Every row as a query row through `ops.paged_attention` with the sinks' query
        (`_sink_rows`) where the step has a table per token, else the decode rows so and each
        prefill through `sink_attention` (the PyTorch path). `scales`: a quantized cache's
        (k_scale, v_scale), else empty."""
        k_scale, v_scale = scales or (None, None)
        if md.token_seq_lens is not None:
            out = self._sink_rows(q, k_cache, v_cache, md.token_block_tables,
                                  md.token_seq_lens, None, k_scale, v_scale)
            return out.view(q.shape[0], -1)
        out = torch.empty_like(q)
        num_sinks, window, inv_freq = self.sinks
        nd = md.num_decode_tokens
        if nd:
            out[:nd] = self._sink_rows(q[:nd], k_cache, v_cache, md.decode_block_tables,
                                       md.decode_seq_lens, md.decode_max_seq_len, k_scale,
                                       v_scale)
        for seq in md.prefills:
            s = slice(seq.query_start, seq.query_start + seq.query_len)
            out[s] = sink_attention(q[s], seq.seq_len - seq.query_len, k_cache, v_cache,
                                    seq.block_table, num_sinks, window, inv_freq, self.scale,
                                    k_scale, v_scale)
        return out.view(q.shape[0], -1)

    def _sink_rows(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None,
        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Query rows q [R, H, D] (row r at position seq_lens[r] - 1) over their sinks and
        window: the sinks read with the query rotated back by the evicted tokens."""
        num_sinks, window, inv_freq = self.sinks
        evicted = (seq_lens - (num_sinks + window)).clamp(min=0)
        q_sink = rotate_by(q, -evicted, inv_freq)
        return ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, self.scale,
                                   window, max_seq_len, k_scale, v_scale, q_sink, num_sinks)

    def _prefill(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_start: int = 0
    ) -> torch.Tensor:
        """keys hold positions [key_start, L); q [Q, H, D] are the last Q positions < L."""
        query_len, seq_len = q.shape[0], key_start + keys.shape[0]
        gqa = self.num_kv_heads != self.num_heads
        # NOTE: 4-D inputs: with 3-D ones SDPA on CPU falls back to its math path (5x slower).
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, keys, values))
        if query_len == seq_len and self.sliding_window is None:  # key_start is 0
            out = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(key_start, seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        return out[0].transpose(0, 1)
