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

import os

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
from pagoda.cpu_features import amx_bf16_usable
from pagoda.layers.rotary import rotate_by

# A request whose query rows times G (query heads per kv head) are fewer takes the decode
# kernel's rows instead of the tiled prefill kernel, which computes lane blocks of 16 query
# vectors (8 in its AVX2 build). NOTE (measured on AVX-512, one thread, 9 / 3 heads x 64,
# bf16, context 1,000): 16 requests of 2 rows (6 vectors each) ran 2x faster as rows, of 5
# rows (15) at parity, of 16 rows 1.6x slower as rows. Not measured on AVX2.
TILED_MIN_QUERY_VECTORS = 16
# A bf16 prefill with nothing cached before it, of at least this many tokens, runs PyTorch's
# SDPA (its CPU flash kernel, whose GEMMs oneDNN runs on AMX tiles) on the chunk's own K/V
# where the CPU has AMX. NOTE (measured on an AMX Xeon, SmolLM2's 9 / 3 heads x 64, 2,048
# prompt tokens a step, attention ms per step, tiled kernel -> SDPA): 1 x 2,048 939 -> 330,
# 4 x 512 304 -> 159, 16 x 128 139 -> 87, 32 x 64 112-115 -> 89-94, 64 x 32 104 -> 103-108.
SDPA_MIN_QUERY_LEN = 64
_sdpa_prefill: bool | None = None


def sdpa_prefill_enabled() -> bool:
    """Whether long fresh bf16 prefills take SDPA (decided once per process):
    `PAGODA_PREFILL_SDPA` on / off, or auto (the default): where the CPU lists amx_bf16 and
    AMX tiles were granted, unless the tiled kernel runs on them itself."""
    global _sdpa_prefill
    if _sdpa_prefill is None:
        mode = os.environ.get("PAGODA_PREFILL_SDPA", "auto").strip().lower() or "auto"
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"PAGODA_PREFILL_SDPA={mode!r}: expected auto, on or off")
        if mode == "auto":
            # NOTE: the tiled kernel's AMX path, where it runs, is as fast as SDPA on long
            # prompts and faster on short ones (ops/cpu_kernels.py), and reads the cache.
            mode = "on" if amx_bf16_usable() and not ops.prefill_attention_on_amx() else "off"
        _sdpa_prefill = mode == "on"
    return _sdpa_prefill


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
            out = self._forward_kernels(q, k, v, k_cache, v_cache, md, scales)
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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, md: AttentionMetadata, scales: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """A step with prefills through kernels that read the paged cache in place: the
        prefill rows through the tiled prefill kernel and the decode rows through the decode
        kernel, long fresh bf16 prefills on an AMX CPU through SDPA on their own K/V
        (`_sdpa_takes`); where the tiled one cannot run, every row through the decode
        kernel as its own query row. None: no kernel runs here (the caller takes SDPA)."""
        nd = md.num_decode_tokens
        tiled_kernel = (md.prefill_seq_lens is not None
                        and ops.paged_prefill_attention.kernel_for(q) is not None)
        split = (self._tiled_split(md, self._sdpa_takes(q, k_cache, scales))
                 if tiled_kernel else None)
        if split is not None:
            arrays, rows, fresh = split
            args = (q, k_cache, v_cache, *arrays, self.scale, self.sliding_window, *scales)
            tiled = ops.paged_prefill_attention.select(*args)
            if tiled is not ops.paged_prefill_attention.reference:
                # NOTE: rows of no tiled request are unwritten, filled here
                out = tiled(*args) if arrays[0].shape[0] else torch.empty_like(q)
                if rows is not None:
                    if rows.numel():
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
                for start, length in fresh:
                    s = slice(start, start + length)
                    out[s] = self._prefill(q[s], k[s], v[s])
                return out
        if md.token_seq_lens is not None:
            # NOTE: each prefill token as its own decode row still runs 2-3x faster than
            # SDPA's CPU flash kernel (head_dim 64, bf16, without AMX); the reference would
            # gather a context per token: not that.
            args = (
                q, k_cache, v_cache, md.token_block_tables, md.token_seq_lens, self.scale,
                self.sliding_window, None, *scales,
            )
            kernel = ops.paged_attention.select(*args)
            if kernel is not ops.paged_attention.reference:
                return kernel(*args)
        return None

    def _sdpa_takes(self, q: torch.Tensor, k_cache: torch.Tensor,
                    scales: list[torch.Tensor]) -> bool:
        """Whether fresh prefills of SDPA_MIN_QUERY_LEN tokens run SDPA here: a CPU with AMX
        (oneDNN's bf16 GEMM on tiles), a bf16 q and cache (the stored K/V are the chunk's
        own, bit for bit), no sliding window. `PAGODA_PREFILL_SDPA` = auto / on / off."""
        if (q.dtype != torch.bfloat16 or k_cache.dtype != q.dtype or scales
                or self.sliding_window is not None or q.device.type != "cpu"):
            return False
        return sdpa_prefill_enabled()

    def _tiled_split(
        self, md: AttentionMetadata, sdpa: bool = False
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, list[tuple[int, int]]] | None:
        """The prefill arrays (tables, starts, query lens, seq lens) of the requests with at
        least TILED_MIN_QUERY_VECTORS query vectors, the flat rows left to the decode
        kernel when some request has fewer or runs SDPA (None: the decode rows only), and
        the (query start, length) of the requests that run SDPA (with `sdpa`: those of
        SDPA_MIN_QUERY_LEN tokens with nothing cached before them); None: no request has
        enough. Derived once per step (the metadata's memo)."""
        group = self.num_heads // self.num_kv_heads
        key = ("tiled_split", group, sdpa)
        if key in md.memo:
            return md.memo[key]
        lens = md.prefill_query_lens
        fresh = torch.zeros_like(lens, dtype=torch.bool)
        if sdpa:
            fresh = (lens >= SDPA_MIN_QUERY_LEN) & (md.prefill_seq_lens == lens)
        tiled = (lens * group >= TILED_MIN_QUERY_VECTORS) & ~fresh
        arrays = (md.prefill_block_tables, md.prefill_query_starts, lens, md.prefill_seq_lens)
        sdpa_seqs = [(int(a), int(n)) for a, n in zip(md.prefill_query_starts[fresh].tolist(),
                                                      lens[fresh].tolist(), strict=True)]
        if bool(tiled.all()):
            split = (arrays, None, sdpa_seqs)
        elif not bool((tiled | fresh).any()):
            split = None
        else:
            nd = md.num_decode_tokens
            row_kernel = ~torch.repeat_interleave(tiled | fresh, lens)  # over the prefill rows
            rows = torch.cat([torch.arange(nd, device=lens.device),
                              nd + row_kernel.nonzero()[:, 0]])
            split = (tuple(a[tiled] for a in arrays), rows, sdpa_seqs)
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
