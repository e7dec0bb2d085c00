"""Draft-model proposer: a smaller pagoda-loadable model with the target's vocabulary
guesses k tokens greedily (so q is one-hot at each draft, see proposer.py).

It keeps its own paged KV per request, in its own pool (`DRAFT_KV_BUDGET_BYTES`, block 0
the null block), and runs batched over the speculating requests: one forward catches
every request up on its accepted tokens (only those not already in its draft KV: drafts
the target accepted were written when they were guessed), then k - 1 single-token steps.
A request the pool cannot hold gets no drafts (drafts are optional, nobody is preempted
for them). `remove_requests` (finish, preemption) frees a request's blocks; the runner calls
it with the step after the finish, when it learns of it (as it frees its own slots).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.attention.backend import CommonAttentionMetadata, get_backend
from pagoda.core.kv_cache_spec import bytes_per_block, group_layers
from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.proposer import Proposer, ProposerContext, register_proposer
from pagoda.worker.input_batch import InputBatch

DRAFT_KV_BUDGET_BYTES = 1 << 30
DRAFT_BACKEND = "torch_paged"


@dataclass
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of the request whose K/V the draft holds
    pending: list[int] = field(default_factory=list)  # guessed tokens written after those


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    @classmethod
    def validate_config(cls, config: SpeculativeConfig) -> None:
        if not config.model:
            raise ValueError("speculative_config.model is required for method draft_model "
                             "(an HF directory or .gguf file)")

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        # NOTE: imported here: the worker imports the proposer registry.
        from pagoda.worker.worker import allocate_kv_caches

        super().__init__(config, context)
        self.model = self.load_draft_model()
        spec = self.model.spec
        bs = context.block_size
        specs = group_layers(spec.sliding_windows, bs, spec.num_kv_heads, spec.head_dim,
                             context.dtype)
        max_useful = context.max_num_seqs * -(-context.max_model_len // bs)
        num_blocks = min(max_useful, DRAFT_KV_BUDGET_BYTES // bytes_per_block(specs)) + 1
        self.kv_caches = allocate_kv_caches(specs, num_blocks, context.device, pin=False,
                                            zero=True)
        self._free_blocks = list(range(num_blocks - 1, 0, -1))
        self.states: dict[str, _DraftState] = {}
        self._build_metadata = get_backend(DRAFT_BACKEND).build_metadata

    def load_draft_model(self) -> torch.nn.Module:
        """The draft, built and loaded; ValueError naming the field if it cannot serve."""
        # NOTE: imported here: the worker imports the proposer registry.
        from pagoda.models.factory import build_model
        from pagoda.models.loader import load_checkpoint

        config, context = self.config, self.context
        ckpt = load_checkpoint(config.model)
        vocab_size = int(ckpt.hf_config.vocab_size)
        if vocab_size != context.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({vocab_size} "
                             f"tokens) does not match the target's ({context.vocab_size})")
        max_positions = int(ckpt.hf_config.max_position_embeddings)
        if max_positions < context.max_model_len:
            raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                             f"{max_positions} is below max_model_len {context.max_model_len}")
        return build_model(ckpt, context.dtype, context.device, context.max_model_len,
                           DRAFT_BACKEND)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def remove_requests(self, req_ids) -> None:
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self._free_blocks.extend(reversed(state.block_ids))

    @torch.inference_mode()
    def propose(self, batch: InputBatch, slots: np.ndarray, num_tokens: int) -> list[list[int]]:
        rows: list[tuple[int, _DraftState, np.ndarray]] = []
        for i, slot in enumerate(slots.tolist()):
            req_id = batch.slots[slot].req_id
            history = batch.token_ids[slot, : batch.num_tokens[slot]]
            state = self.states.setdefault(req_id, _DraftState())
            _catch_up(state, history)
            if not self._grow(state, len(history) + num_tokens - 1):
                self.remove_requests([req_id])
                continue
            rows.append((i, state, history))
        drafts: list[list[int]] = [[] for _ in range(len(slots))]
        if not rows:
            return drafts
        inputs = [history[state.num_computed :] for _, state, history in rows]
        starts = [state.num_computed for _, state, _ in rows]
        for step in range(num_tokens):
            tokens = self._forward(inputs, starts, [state for _, state, _ in rows])
            for (i, _, _), token in zip(rows, tokens):
                drafts[i].append(token)
            starts = [s + len(x) for s, x in zip(starts, inputs)]
            inputs = [np.array([t]) for t in tokens]
            if step == 0:
                for _, state, history in rows:
                    state.num_computed = len(history)
        for i, state, _ in rows:
            state.pending = drafts[i][:-1]
        return drafts

    def _grow(self, state: _DraftState, num_positions: int) -> bool:
        """Blocks for `num_positions` positions; False (no change) if the pool is short."""
        need = -(-num_positions // self.context.block_size) - len(state.block_ids)
        if need > len(self._free_blocks):
            return False
        for _ in range(max(need, 0)):
            state.block_ids.append(self._free_blocks.pop())
        return True

    def _forward(self, inputs: list[np.ndarray], starts: list[int],
                 states: list[_DraftState]) -> list[int]:
        """One forward of the draft over each row's `inputs` at positions from `starts`;
        the greedy next token of each row."""
        ctx = self.context
        bs = ctx.block_size
        # NOTE: single-token rows first (the attention backend's batch layout contract).
        order = sorted(range(len(inputs)), key=lambda r: len(inputs[r]) != 1)
        query_lens = np.array([len(inputs[r]) for r in order], dtype=np.int64)
        query_start_loc = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = np.array([starts[r] for r in order], dtype=np.int64) + query_lens
        positions = np.concatenate([np.arange(starts[r], starts[r] + len(inputs[r]))
                                    for r in order])
        max_blocks = int(-(-seq_lens.max() // bs))
        tables = np.zeros((len(order), max_blocks), dtype=np.int64)
        for j, r in enumerate(order):
            ids = states[r].block_ids[:max_blocks]
            tables[j, : len(ids)] = ids
        req_of_token = np.repeat(np.arange(len(order)), query_lens)
        slot_mapping = tables[req_of_token, positions // bs] * bs + positions % bs
        md = self._build_metadata(CommonAttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            num_decodes=int((query_lens == 1).sum()), block_tables=tables, block_size=bs,
            positions=positions, req_of_token=req_of_token,
            slot_mapping=torch.from_numpy(slot_mapping).to(ctx.device), dtype=ctx.dtype,
            device=ctx.device))
        input_ids = torch.from_numpy(np.concatenate([inputs[r] for r in order])).to(ctx.device)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(ctx.device),
                            self.kv_caches, md)
        last = torch.from_numpy(query_start_loc[1:] - 1).to(hidden.device)
        tokens = self.model.compute_logits(hidden[last]).float().argmax(dim=-1).tolist()
        out = [0] * len(order)
        for j, r in enumerate(order):
            out[r] = tokens[j]
        return out


def _catch_up(state: _DraftState, history: np.ndarray) -> None:
    """Keep the draft K/V of the guessed tokens that the request's tokens confirm; the
    last token always runs again (its logits give the first draft)."""
    num_valid = state.num_computed
    for guess in state.pending:
        if num_valid >= len(history) or int(history[num_valid]) != guess:
            break
        num_valid += 1
    state.num_computed = min(num_valid, len(history) - 1)
    state.pending = []
