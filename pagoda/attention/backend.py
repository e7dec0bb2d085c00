"""The attention-backend interface and its registry.

A backend owns two things: how new K/V are written into the paged cache, and how queries
read the cache through block tables. The model runner builds one `AttentionMetadata` per
step; every layer reuses it.

Batch layout contract (the runner guarantees it): the flat token batch holds the decode
requests (query length 1) first, then the requests with longer queries (prefill chunks,
recomputes), each request's tokens contiguous and in position order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


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


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # [num_blocks, block_size, Hk, D] each
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
