"""The runner's persistent per-request state: one slot (row) per running request.

Each slot holds its request's token ids (preallocated to max_model_len), token count,
prompt length and block table row; the scheduler's diffs update them in place (new
requests fill a free slot, new block ids append to the row, sampled tokens append to the
ids), so a step never rebuilds a request's history or table. Slots are assigned on add
(the lowest free one) and freed on finish or preemption; freed slots are reused, never
condensed, because a step gathers its rows by slot index anyway.

| array | shape | holds |
|---|---|---|
| token_ids | [max_num_reqs, max_model_len] int64 | prompt then output tokens |
| num_tokens | [max_num_reqs] | valid entries of token_ids |
| num_prompt_tokens | [max_num_reqs] | prompt part of token_ids |
| num_computed_tokens | [max_num_reqs] | K/V in the cache before this step (from the diff) |
| block_tables | [num_groups, max_num_reqs, max_blocks_per_req] int64 | per KV cache group: |
| | | block ids, num_blocks valid (`block_table` = group 0's) |
| num_blocks | [max_num_reqs] | valid entries of each group's row (the same in every group) |
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagoda.sampling_params import SamplingParams


@dataclass(slots=True)
class SlotState:
    """The per-slot values that are objects, not numbers."""

    req_id: str
    sampling_params: SamplingParams
    # Prompt logprobs are wanted until the prompt has been computed once in full.
    want_prompt_logprobs: bool

    @property
    def uses_penalties(self) -> bool:
        p = self.sampling_params
        return (
            p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
        )


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
        num_groups: int = 1, growable: bool = False,
    ) -> None:
        """`growable`: rows grow (doubling) past max_model_len instead of refusing, for
        streams that outlive it (attention sinks)."""
        self.growable = growable
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = np.zeros((num_groups, max_num_reqs, max_blocks_per_req),
                                     dtype=np.int64)
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.slots: list[SlotState | None] = [None] * max_num_reqs
        self.req_id_to_slot: dict[str, int] = {}
        self._free_slots = list(range(max_num_reqs))  # a heap: the lowest slot first

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_slot)

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        block_ids: Sequence[list[int]],
        sampling_params: SamplingParams,
        want_prompt_logprobs: bool,
    ) -> int:
        """Put a request in the lowest free slot (its history copied once); returns it."""
        if req_id in self.req_id_to_slot:
            raise ValueError(f"request {req_id!r} already has slot {self.req_id_to_slot[req_id]}")
        if not self._free_slots:
            raise RuntimeError(f"the input batch is full ({self.max_num_reqs} requests)")
        n = len(token_ids)
        if n > self.token_ids.shape[1] and self.growable:
            self._grow_tokens(n)
        if n > self.token_ids.shape[1]:
            raise ValueError(f"request {req_id!r} has {n} tokens > max_model_len "
                             f"{self.max_model_len}")
        slot = heapq.heappop(self._free_slots)
        self.token_ids[slot, :n] = token_ids
        self.num_tokens[slot] = n
        self.num_prompt_tokens[slot] = num_prompt_tokens
        self.num_blocks[slot] = 0
        self.slots[slot] = SlotState(req_id, sampling_params, want_prompt_logprobs)
        self.req_id_to_slot[req_id] = slot
        self.append_block_ids(slot, block_ids)
        return slot

    def remove_request(self, req_id: str) -> int | None:
        """Free `req_id`'s slot for reuse; returns it (None for an unknown id)."""
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is None:
            return None
        self.slots[slot] = None
        heapq.heappush(self._free_slots, slot)
        return slot

    def append_block_ids(self, slot: int, block_ids: Sequence[list[int]]) -> None:
        """Append one id list per KV cache group (all as long) to the slot's rows."""
        if len(block_ids) != len(self.block_tables):
            raise ValueError(f"{len(block_ids)} block id lists for {len(self.block_tables)} "
                             "KV cache groups")
        start = int(self.num_blocks[slot])
        end = start + len(block_ids[0])
        if end > self.block_tables.shape[2] and self.growable:
            self.block_tables = _grown(self.block_tables, end)
            self.block_table = self.block_tables[0]
        if end > self.block_table.shape[1]:
            raise ValueError(f"slot {slot}: {end} blocks > {self.block_table.shape[1]} per request")
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            if len(ids) != end - start:
                raise ValueError(f"slot {slot}: KV cache groups got unequal block counts")
            table[slot, start:end] = ids
        self.num_blocks[slot] = end

    def truncate_block_ids(self, slot: int, num_blocks: int) -> None:
        """Keep the slot's first `num_blocks` block ids (the scheduler freed the rest)."""
        self.num_blocks[slot] = min(int(self.num_blocks[slot]), num_blocks)

    def write_drafts(self, slot: int, token_ids: list[int]) -> None:
        """Put draft tokens right after the slot's tokens, without counting them: the
        step reads them as inputs, and only the accepted ones are appended after it."""
        start = int(self.num_tokens[slot])
        self.token_ids[slot, start : start + len(token_ids)] = token_ids

    def extend_tokens(self, slot: int, token_ids: list[int]) -> None:
        """Append several tokens to one slot (accepted drafts and the token after them)."""
        start = int(self.num_tokens[slot])
        self.token_ids[slot, start : start + len(token_ids)] = token_ids
        self.num_tokens[slot] = start + len(token_ids)

    def append_tokens(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """One new token per slot in `slots` (distinct), vectorised."""
        if self.growable and len(slots) and self.num_tokens[slots].max() >= self.token_ids.shape[1]:
            self._grow_tokens(int(self.num_tokens[slots].max()) + 1)
        self.token_ids[slots, self.num_tokens[slots]] = token_ids
        self.num_tokens[slots] += 1

    def prompt_view(self, slot: int) -> np.ndarray:
        """The slot's prompt tokens: a view into token_ids (no copy)."""
        return self.token_ids[slot, : self.num_prompt_tokens[slot]]

    def output_view(self, slot: int) -> np.ndarray:
        """The slot's output tokens so far: a view into token_ids (no copy)."""
        return self.token_ids[slot, self.num_prompt_tokens[slot] : self.num_tokens[slot]]

    def _grow_tokens(self, n: int) -> None:
        self.token_ids = _grown(self.token_ids, n)


def _grown(a: np.ndarray, n: int) -> np.ndarray:
    """`a` with its last axis widened to at least n (doubling), zeros after the old end."""
    width = a.shape[-1]
    while width < n:
        width *= 2
    out = np.zeros((*a.shape[:-1], width), dtype=a.dtype)
    out[..., : a.shape[-1]] = a
    return out
