"""The attention-backend interface and its registry.

A backend owns three things: how new K/V are written into the paged cache, how queries
read the cache through block tables, and the per-step metadata it needs for that: the
runner hands the step's common arrays (`CommonAttentionMetadata`) to the backend's
`build_metadata` once per step, and every layer reuses what it returns.

Batch layout contract (the runner guarantees it): the flat token batch holds the decode
requests (query length 1) first, then the requests with longer queries (prefill chunks,
recomputes), each request's tokens contiguous and in position order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

# NOTE: float32 prefills keep SDPA, the oracle path; bf16/fp16 ones may take a paged-attention
# kernel that reads each prefill token as its own query row, which needs per-token tables.
TOKEN_ROW_DTYPES = (torch.bfloat16, torch.float16)



@dataclass(slots=True)
class PrefillSeq:
    """One request with more than one new token this step."""

    query_start: int  # offset of its first new token in the flat batch
    query_len: int
    seq_len: int  # tokens in context after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks_needed] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (block_id * block_size + offset)
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64 (padded)
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    decode_max_seq_len: int
    prefills: list[PrefillSeq]
    # Every token as its own query row (kernels that handle prefill rows like decode rows):
    # its request's block table [T, max_blocks] and its causal context length (position + 1).
    token_block_tables: torch.Tensor | None = None
    token_seq_lens: torch.Tensor | None = None
    # The prefills as arrays (ops.paged_prefill_attention): per prefill request its first row
    # in the flat batch, query length, context length after this step [P] int64, and its
    # block table [P, max_blocks].
    prefill_query_starts: torch.Tensor | None = None
    prefill_query_lens: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    # Per step, what a backend derives from the above once for every layer (its row split).
    memo: dict = field(default_factory=dict)


@dataclass(slots=True)
class CommonAttentionMetadata:
    """One step's arrays every backend starts from (numpy on the host; B requests in the
    batch layout order, T tokens)."""

    query_start_loc: np.ndarray  # [B + 1] int64: request i's tokens are [q[i], q[i + 1])
    seq_lens: np.ndarray  # [B] int64: tokens in context after this step (cached + new)
    num_decodes: int  # the first num_decodes requests have query length 1
    block_tables: np.ndarray  # [B, max_blocks_this_step] int64; row i valid up to seq_lens[i]
    block_size: int
    positions: np.ndarray  # [T] int64
    req_of_token: np.ndarray  # [T] int64: the request (row) of each token
    slot_mapping: torch.Tensor  # [T] int64 on the device (the runner computes it once)
    dtype: torch.dtype  # the activations' dtype
    device: torch.device


def build_paged_metadata(c: CommonAttentionMetadata) -> AttentionMetadata:
    """The paged backends' AttentionMetadata from the step's common arrays (no per-token
    Python loops; one loop over the prefill requests)."""
    nd, num_reqs = c.num_decodes, len(c.seq_lens)
    query_lens = np.diff(c.query_start_loc)
    blocks_needed = -(-c.seq_lens // c.block_size)
    # NOTE: one copy to the device per step; the prefill tables are views of it.
    bt = torch.from_numpy(c.block_tables).to(c.device)
    prefills = [
        PrefillSeq(int(c.query_start_loc[i]), int(query_lens[i]), int(c.seq_lens[i]),
                   bt[i, : blocks_needed[i]])
        for i in range(nd, num_reqs)
    ]
    token_tables = token_seq_lens = None
    prefill_arrays: dict[str, torch.Tensor] = {}
    if prefills and c.dtype in TOKEN_ROW_DTYPES:
        # NOTE: only the kernel that reads prefill tokens as query rows needs a table per
        # token (gathered here, once per step, from the request rows).
        token_tables = torch.from_numpy(c.block_tables[c.req_of_token]).to(c.device)
        token_seq_lens = torch.from_numpy(c.positions + 1).to(c.device)
        prefill_arrays = {
            "prefill_query_starts": torch.from_numpy(c.query_start_loc[nd:num_reqs]),
            "prefill_query_lens": torch.from_numpy(query_lens[nd:]),
            "prefill_seq_lens": torch.from_numpy(c.seq_lens[nd:]),
        }
        prefill_arrays = {k: v.to(c.device) for k, v in prefill_arrays.items()}
        prefill_arrays["prefill_block_tables"] = bt[nd:]
    return AttentionMetadata(
        slot_mapping=c.slot_mapping,
        num_decode_tokens=nd,
        decode_block_tables=bt[:nd] if nd else None,
        decode_seq_lens=torch.from_numpy(c.seq_lens[:nd]).to(c.device) if nd else None,
        decode_max_seq_len=int(c.seq_lens[:nd].max()) if nd else 0,
        prefills=prefills,
        token_block_tables=token_tables,
        token_seq_lens=token_seq_lens,
        **prefill_arrays,
    )


class AttentionBackend(Protocol):
    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> AttentionMetadata:
        """This step's metadata, shared by every layer."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        kv_cache: tuple[torch.Tensor, ...],  # K, V [num_blocks, block_size, Hk, D] (+ scales)
        md: AttentionMetadata,
        kv_written: bool = False,  # True: the caller already wrote k/v into their slots
    ) -> torch.Tensor:  # [T, H * D]
        ...


BackendFactory = Callable[..., AttentionBackend]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def wrap(factory: BackendFactory) -> BackendFactory:
        _BACKENDS[name] = factory
        return factory

    return wrap


def get_backend(name: str) -> BackendFactory:
    # NOTE: importing the backend modules runs their @register_backend decorators.
    from pagoda.attention import torch_paged  # noqa: F401

    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]
