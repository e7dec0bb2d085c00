"""The model runner: one scheduler step -> one flat variable-length batch -> one forward.

It keeps each request's tokens and block table across steps (the scheduler sends diffs),
builds token ids, positions, slot mapping and block tables with vectorised numpy ops,
computes logits only where something is sampled (or prompt logprobs are wanted), and samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagoda.attention.backend import AttentionMetadata, PrefillSeq
from pagoda.core.scheduler import NewRequestData, SchedulerOutput
from pagoda.layers.sampler import Sampler, SamplingMetadata, compute_topk_logprobs
from pagoda.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    want_prompt_logprobs: bool


@dataclass
class ModelRunnerOutput:
    # req_id -> the tokens the step produced, in order; absent = nothing sampled (e.g. a
    # prefill chunk that does not reach the end of the prompt).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> per sampled token: (ids [K+1], logprobs [K+1], rank of the sampled token)
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # req_id -> (first position, ids [N][K+1], logprobs [N][K+1], ranks [N])
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        vocab_size: int,
        eos_token_ids: set[int],
        device: torch.device,
        host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        host_tier_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        # Swap preemption's host pool: the device cache's per-layer layout, own block ids.
        self.host_kv_caches = host_kv_caches
        # The prefix cache's host tier: same layout, own slot ids, its own buffer.
        self.host_tier_kv_caches = host_tier_kv_caches
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

    # ---- state diffs -----------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _new_state(new)
        for cached in out.scheduled_cached_reqs:
            self.requests[cached.req_id].block_ids.extend(cached.new_block_ids)

    # ---- one step --------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.swap_blocks(out)
        self._update_states(out)
        result = ModelRunnerOutput()
        if out.is_empty:
            return result
        # NOTE: decodes first (the attention backend's batch layout contract).
        req_ids = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in req_ids]
        query_lens = np.array([out.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        starts = self._chunk_starts(out, req_ids)
        input_ids, positions, md = self._prepare_inputs(states, starts, query_lens)
        hidden = self.model(input_ids, positions, self.kv_caches, md)

        cu = np.cumsum(query_lens)
        seq_ends = starts + query_lens
        sample_rows = [i for i, s in enumerate(states) if seq_ends[i] == len(s.token_ids)]
        self._prompt_logprobs(states, starts, query_lens, cu, hidden, result)
        if sample_rows:
            self._sample(states, sample_rows, cu, hidden, result)
        return result

    def swap_blocks(self, out: SchedulerOutput) -> None:
        """Copy the step's blocks between the device cache and host memory (swap pool and
        prefix-cache host tier), in every layer, before anything reads or writes the cache.

        NOTE: every device -> host copy first: a device block that a swap-out frees or an
        offload evicts may be the target of a swap-in, a host-tier load or new tokens in the
        same step. (The host tier never hands a slot a load reads to an offload of the same
        step, so host slots need no such order.)
        """
        if out.blocks_to_swap_out:
            _copy_blocks(self.kv_caches, self.host_kv_caches, out.blocks_to_swap_out)
        if out.blocks_to_offload:
            _copy_blocks(self.kv_caches, self.host_tier_kv_caches, out.blocks_to_offload)
        if out.blocks_to_copy:
            _copy_blocks(self.kv_caches, self.kv_caches, out.blocks_to_copy)
        if out.blocks_to_swap_in:
            _copy_blocks(self.host_kv_caches, self.kv_caches, out.blocks_to_swap_in)
        if out.blocks_to_onload:
            _copy_blocks(self.host_tier_kv_caches, self.kv_caches, out.blocks_to_onload)

    @staticmethod
    def _chunk_starts(out: SchedulerOutput, req_ids: list[str]) -> np.ndarray:
        """Each request's first new position: its num_computed_tokens before this step."""
        start = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        start.update({d.req_id: d.num_computed_tokens for d in out.scheduled_cached_reqs})
        return np.array([start[r] for r in req_ids], dtype=np.int64)

    def _prepare_inputs(
        self, states: list[CachedRequestState], starts: np.ndarray, query_lens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        num_tokens = int(query_lens.sum())
        token_ids: list[int] = []
        for s, start, n in zip(states, starts.tolist(), query_lens.tolist()):
            token_ids.extend(s.token_ids[start : start + n])
        cu = np.cumsum(query_lens)
        req_of_token = np.repeat(np.arange(len(states)), query_lens)
        positions = np.arange(num_tokens) - np.repeat(cu - query_lens, query_lens)
        positions += starts[req_of_token]

        seq_lens = starts + query_lens
        blocks_needed = (seq_lens + self.block_size - 1) // self.block_size
        block_tables = np.zeros((len(states), int(blocks_needed.max())), dtype=np.int64)
        for i, s in enumerate(states):
            block_tables[i, : blocks_needed[i]] = s.block_ids[: blocks_needed[i]]
        slot_mapping = (
            block_tables[req_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        num_decodes = int((query_lens == 1).sum())
        bt = torch.from_numpy(block_tables)
        prefills = [
            PrefillSeq(int(cu[i] - query_lens[i]), int(query_lens[i]), int(seq_lens[i]),
                       bt[i, : blocks_needed[i]])
            for i in range(num_decodes, len(states))
        ]
        # NOTE: decode rows come first, so with no prefill these are the decode tables.
        token_tables = bt if num_decodes == len(states) else torch.from_numpy(
            block_tables[req_of_token]
        )
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            num_decode_tokens=num_decodes,
            decode_block_tables=bt[:num_decodes].to(self.device) if num_decodes else None,
            decode_seq_lens=torch.from_numpy(seq_lens[:num_decodes]).to(self.device)
            if num_decodes
            else None,
            decode_max_seq_len=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
            prefills=prefills,
            token_block_tables=token_tables.to(self.device),
            token_seq_lens=torch.from_numpy(positions + 1).to(self.device),
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return ids, torch.from_numpy(positions).to(self.device), md

    def _sample(
        self,
        states: list[CachedRequestState],
        rows: list[int],
        cu: np.ndarray,
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        idx = torch.as_tensor(cu[rows] - 1, device=hidden.device)
        logits = self.model.compute_logits(hidden[idx])
        chosen = [states[i] for i in rows]
        md = SamplingMetadata.build(
            params=[s.sampling_params for s in chosen],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in chosen],
            output_token_ids=[s.token_ids[s.num_prompt_tokens :] for s in chosen],
            generators=[s.generator for s in chosen],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=logits.device,
        )
        sampled = self.sampler(logits, md)
        token_ids = sampled.sampled_token_ids.tolist()
        for j, s in enumerate(chosen):
            s.token_ids.append(token_ids[j])
            result.sampled_token_ids[s.req_id] = [token_ids[j]]
            k = s.sampling_params.logprobs
            if k is not None and sampled.logprobs is not None:
                result.logprobs[s.req_id] = [(
                    sampled.logprob_token_ids[j, : k + 1].tolist(),
                    sampled.logprobs[j, : k + 1].tolist(),
                    int(sampled.sampled_token_ranks[j]),
                )]

    def _prompt_logprobs(
        self,
        states: list[CachedRequestState],
        starts: np.ndarray,
        query_lens: np.ndarray,
        cu: np.ndarray,
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        for i, s in enumerate(states):
            if not s.want_prompt_logprobs:
                continue
            start = int(starts[i])
            # Logits at position p score prompt token p + 1.
            end = min(start + int(query_lens[i]), s.num_prompt_tokens - 1)
            if end <= start:
                continue
            q0 = int(cu[i] - query_lens[i])
            logits = self.model.compute_logits(hidden[q0 : q0 + end - start])
            targets = torch.tensor(s.token_ids[start + 1 : end + 1], device=logits.device)
            ids, lps, ranks = compute_topk_logprobs(
                logits, targets, s.sampling_params.prompt_logprobs
            )
            result.prompt_logprobs[s.req_id] = (
                start + 1, ids.tolist(), lps.tolist(), ranks.tolist()
            )


def _copy_blocks(
    src_caches: list[tuple[torch.Tensor, torch.Tensor]],
    dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
    pairs: list[tuple[int, int]],
) -> None:
    """dst[d] = src[s] for every (s, d) in `pairs`, in each layer's K and V."""
    src_ids, dst_ids = zip(*pairs, strict=True)
    src_idx = torch.tensor(src_ids, device=src_caches[0][0].device)
    dst_idx = torch.tensor(dst_ids, device=dst_caches[0][0].device)
    for src_kv, dst_kv in zip(src_caches, dst_caches, strict=True):
        for src, dst in zip(src_kv, dst_kv, strict=True):
            dst[dst_idx] = src[src_idx].to(dst.device)


def _new_state(new: NewRequestData) -> CachedRequestState:
    return CachedRequestState(
        req_id=new.req_id,
        token_ids=list(new.token_ids),
        num_prompt_tokens=new.num_prompt_tokens,
        block_ids=list(new.block_ids),
        sampling_params=new.sampling_params,
        generator=new.generator,
        want_prompt_logprobs=new.want_prompt_logprobs,
    )
