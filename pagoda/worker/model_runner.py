"""The model runner: one scheduler step -> one flat variable-length batch -> one forward.

Per-request state lives in the persistent `InputBatch` (updated from the scheduler's diffs)
and the seeded requests' generators (worker/seeded_generators.py: advanced only here, kept
across a preemption or a rolled-back step, so a request that comes back continues its
stream from its committed tokens). A step gathers token ids,
positions and the slot mapping into buffers sized once, with numpy fancy indexing (no
per-token Python loops); the attention backend builds its metadata from those arrays;
logits are computed only where something is sampled (or prompt logprobs are wanted).

Speculative decoding: a request's draft tokens (`SchedulerOutput.scheduled_spec_decode_tokens`)
are written after its tokens and read as inputs, so it is one row with query length k + 1 in
the same flat batch; logits at all k + 1 positions go to the rejection sampler, and the
accepted drafts plus one token are appended. After sampling, the proposer guesses the next
drafts of every request that sampled (`ModelRunnerOutput.draft_token_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from pagoda.core.kv_cache_spec import KVRetention
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.layers.rejection_sampler import RejectionSampler
from pagoda.layers.sampler import (
    Penalties,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    Truncation,
    compute_topk_logprobs,
    draw_exponentials,
    race_seeds,
)
from pagoda.sampling_params import SamplingType
from pagoda.spec_decode.proposer import Proposer
from pagoda.worker.block_copies import LayerCaches
from pagoda.worker.burst_interrupt import BurstInterrupt
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.seeded_generators import SeededGenerators

# The most Exp(1) draws a sampled decode burst makes ahead (float32 bytes): its steps are
# cut to fit; a burst that would get fewer than 2 steps runs as one ordinary step.
BURST_DRAW_BYTES = 64 << 20

# (top ids [K+1], logprobs [K+1], rank of the sampled token) of one sampled token.
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass
class ModelRunnerOutput:
    # req_id -> the tokens this step produced for it, in order (absent: nothing sampled).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> one entry per token of sampled_token_ids[req_id] (only if it asked).
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> (first position, ids [N][K+1], logprobs [N][K+1], ranks [N])
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)
    # req_id -> the proposer's draft tokens to follow its tokens (absent: none).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class StepBatch:
    """One step's rows (requests, decodes first) and their flat token layout."""

    req_ids: list[str]
    slots: np.ndarray  # [B] the requests' InputBatch slots
    query_lens: np.ndarray  # [B]
    starts: np.ndarray  # [B] first new position (num_computed_tokens before the step)
    query_start_loc: np.ndarray  # [B + 1]
    sample_rows: np.ndarray  # rows whose step reaches their last known token
    num_drafts: np.ndarray  # [B] draft tokens among each row's query (0: none)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: LayerCaches,
        attn_backend: type[AttentionBackend],
        block_size: int,
        vocab_size: int,
        eos_token_ids: set[int],
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        kv_groups: Sequence[tuple[KVRetention, Sequence[int]]] = (),
        streaming: bool = False,
        proposer: Proposer | None = None,
    ) -> None:
        """`kv_groups`: per KV cache group its retention and layer ids, in the scheduler's
        group order (empty: one full-attention group of every layer). `streaming`: attention
        sinks are on, so requests may outgrow max_model_len."""
        self.model = model
        self.kv_caches = kv_caches
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        self.retentions = [r for r, _ in kv_groups] or [KVRetention()]
        # NOTE: with several groups every layer reads its own group's metadata.
        self.group_of_layer = [0] * sum(len(layers) for _, layers in kv_groups)
        for g, (_, layers) in enumerate(kv_groups):
            for layer in layers:
                self.group_of_layer[layer] = g
        # NOTE: with attention sinks a stream outgrows max_model_len: rows, and the rotary
        # tables (absolute positions), grow.
        self.streaming = streaming
        self.input_batch = InputBatch(max_num_reqs, max_model_len, -(-max_model_len // block_size),
                                      num_groups=len(self.retentions),
                                      growable=streaming)
        self.rejection_sampler = RejectionSampler()
        self.proposer = proposer
        self.generators = SeededGenerators()
        # Raised by the engine while a command waits: a decode burst then ends after its step.
        self.burst_interrupt = BurstInterrupt()
        # A sampled burst's Exp(1) draws (runner._draw_burst), kept: a buffer of tens of MB
        # allocated per burst would be mapped, faulted in and unmapped every time.
        self._burst_exps: torch.Tensor | None = None
        # Per-token buffers, sized once; a step uses their first T entries.
        self._input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64)
        self._positions = torch.zeros(max_num_batched_tokens, dtype=torch.int64)
        self._slot_mappings = [torch.zeros(max_num_batched_tokens, dtype=torch.int64)
                               for _ in self.retentions]
        self._arange = np.arange(max(max_num_batched_tokens, max_num_reqs) + 1, dtype=np.int64)

    # ---- state diffs -----------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in out.finished_req_ids:
            batch.remove_request(req_id)
            if req_id not in out.preempted_req_ids:
                self.generators.remove(req_id)
        if self.proposer is not None and out.finished_req_ids:
            self.proposer.remove_requests(out.finished_req_ids)
        for new in out.scheduled_new_reqs:
            self.generators.add(new.req_id, new.sampling_params.seed, len(new.token_ids))
            slot = batch.add_request(new.req_id, new.token_ids, new.num_prompt_tokens,
                                     new.block_ids, new.sampling_params,
                                     new.want_prompt_logprobs)
            batch.num_computed_tokens[slot] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            slot = batch.req_id_to_slot[cached.req_id]
            if cached.num_blocks is not None:
                # NOTE: every group's table has the same length (freed entries are nulled).
                batch.truncate_block_ids(slot, cached.num_blocks - len(cached.new_block_ids[0]))
            if cached.new_block_ids[0]:
                batch.append_block_ids(slot, cached.new_block_ids)
            batch.num_computed_tokens[slot] = cached.num_computed_tokens
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            batch.write_drafts(batch.req_id_to_slot[req_id], drafts)

    # ---- one step --------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the diffs, run the step's forward and sample; the caller has already
        performed the step's block copies."""
        self._update_states(out)
        result = ModelRunnerOutput()
        if out.is_empty:
            return result
        step = self._step_batch(out)
        if self.streaming:
            self.model.ensure_rotary_positions(int((step.starts + step.query_lens).max()))
        input_ids, positions, md = self._prepare_inputs(step)
        if out.decode_bursts and self._decode_burst(out, step, input_ids, positions, md,
                                                    result):
            return result
        hidden = self.model(input_ids, positions, self.kv_caches, md)
        self._prompt_logprobs(step, hidden, result)
        if len(step.sample_rows):
            speculating = step.num_drafts[step.sample_rows] > 0
            plain, verifying = step.sample_rows[~speculating], step.sample_rows[speculating]
            # NOTE: one LM-head pass over the positions sampled and verified: a step that
            # mixes both would otherwise read the head's weights twice.
            idx = self._logit_positions(step, plain, verifying)
            logits = self.model.compute_logits(hidden[torch.from_numpy(idx).to(hidden.device)])
            if len(plain):
                self._sample(step, plain, logits[: len(plain)], result)
            if len(verifying):
                self._verify(step, verifying, logits[len(plain) :], result)
            if self.proposer is not None and out.num_spec_tokens > 0:
                self._propose(step, out.num_spec_tokens, result)
        return result

    def supports_decode_burst(self) -> bool:
        """Whether decode bursts run here: one KV cache group, no attention sinks, and a
        model whose `decode_burst` runs (its fused decode stack, head and token table)."""
        supports = getattr(self.model, "supports_decode_burst", None)
        return (len(self.retentions) == 1 and not self.streaming and supports is not None
                and supports())

    def _decode_burst(
        self, out: SchedulerOutput, step: StepBatch, input_ids: torch.Tensor,
        positions: torch.Tensor, md: AttentionMetadata | list[AttentionMetadata],
        result: ModelRunnerOutput,
    ) -> bool:
        """The step's decode rows, each given the same burst by the scheduler
        (`SchedulerOutput.decode_bursts`), through the model's `decode_burst`: their tokens
        appended to the batch and `result`. False where the step is not all such rows or
        the model does not run it (the step then runs as usual, one token a row)."""
        batch, bs = self.input_batch, self.block_size
        n = len(step.req_ids)
        bursts = [out.decode_bursts.get(r) for r in step.req_ids]
        if (len(step.sample_rows) != n or step.num_drafts.any() or (step.query_lens != 1).any()
                or any(b is None or b[0] != bursts[0][0] for b in bursts)
                or not self.supports_decode_burst()):
            return False
        states = [batch.slots[int(slot)] for slot in step.slots]
        temps = self._plain_temperatures(step.slots, states, burst=True)
        if temps is None:
            return False
        max_steps = bursts[0][0]
        temperature = exps = seeds = cut = None
        penalties = None
        if not all(state.sampling_params.plain for state in states):
            # NOTE: the kernel updates these tables with each step's tokens.
            penalties = Penalties.of(self._sampling_metadata(step.slots, states, {}))
        gens: dict[int, torch.Generator] = {}
        gen_states: dict[int, list[torch.Tensor]] = {}
        if any(temps):
            gens = self._plain_generators(states, temps)
            if gens:
                # NOTE: seeded rows' Exp(1) draws are made before the call, at most
                # BURST_DRAW_BYTES of them (at 64 rows of a 49,152-token vocabulary, 5 steps).
                max_steps = min(max_steps, BURST_DRAW_BYTES // (4 * n * self.vocab_size))
                if max_steps < 2:
                    return False
            temperature = torch.tensor(temps, dtype=torch.float32)
            cut = Truncation.of([state.sampling_params for state in states])
            seeds = race_seeds(max_steps, n, gens)
            exps, gen_states = self._draw_burst(max_steps, n, gens)
        stop_ids = sorted({t for _, ids in bursts for t in ids})
        # NOTE: every step's tokens must have their blocks: those of the burst's last one.
        num_blocks = self._check_blocks(step, step.starts + max_steps)
        # NOTE: the window only moves on during the burst: blocks freed before it stay unread.
        table = torch.from_numpy(self._block_tables(0, step.slots, step.starts, num_blocks))
        try:
            tokens = self.model.decode_burst(
                input_ids, positions, self.kv_caches, md, table, bs, max_steps,
                torch.tensor(stop_ids, dtype=torch.int64), self.burst_interrupt.flag,
                temperature, exps, seeds, cut, penalties)
        except BaseException:
            self._rewind(gens, gen_states, 0)
            raise
        if tokens is None:
            self._rewind(gens, gen_states, 0)
            return False
        # NOTE: each seeded row is checkpointed as it stood before the burst's draws, and
        # left as if it had drawn for the steps that ran only (a stop or an interrupt may
        # end the burst early): its stream is the one of one step at a time.
        self._rewind(gens, gen_states, 0)
        for req_id, slot in zip(step.req_ids, step.slots, strict=True):
            self.generators.checkpoint(req_id, int(batch.num_tokens[slot]))
        self._rewind(gens, gen_states, len(tokens[0]))
        for req_id, slot, row in zip(step.req_ids, step.slots, tokens, strict=True):
            batch.extend_tokens(int(slot), row)
            result.sampled_token_ids[req_id] = row
        return True

    def _draw_burst(self, steps: int, rows: int, gens: dict[int, torch.Generator]
                    ) -> tuple[torch.Tensor | None, dict[int, list[torch.Tensor]]]:
        """The seeded rows' Exp(1) draws of a burst [steps, rows, V] (a view of a buffer
        kept between bursts; None without seeded rows), each step's drawn as `Sampler.plain`
        draws them, and each seeded row's generator states: before every step's draw and
        after the last."""
        if not gens:
            return None, {}
        need = steps * rows * self.vocab_size
        if self._burst_exps is None or self._burst_exps.numel() < need:
            self._burst_exps = torch.empty(need, dtype=torch.float32)
        exps = self._burst_exps[:need].view(steps, rows, self.vocab_size)
        states: dict[int, list[torch.Tensor]] = {row: [] for row in gens}
        for i in range(steps):
            for row, gen in gens.items():
                states[row].append(gen.get_state())
            draw_exponentials(rows, self.vocab_size, gens, exps.device, out=exps[i],
                              unseeded=False)
        for row, gen in gens.items():
            states[row].append(gen.get_state())
        return exps, states

    @staticmethod
    def _rewind(gens: dict[int, torch.Generator], states: dict[int, list[torch.Tensor]],
                steps: int) -> None:
        """Each seeded row's generator as it stood after the draws of `steps` steps."""
        for row, gen in gens.items():
            gen.set_state(states[row][steps])

    def _logit_positions(self, step: StepBatch, plain: np.ndarray,
                         verifying: np.ndarray) -> np.ndarray:
        """The step's token positions to score: each plain row's last, then each verifying
        row's k + 1 (its last token and its drafts), row after row."""
        last = step.query_start_loc[plain + 1] - 1
        if not len(verifying):
            return last
        counts = step.num_drafts[verifying] + 1
        firsts = np.repeat(step.query_start_loc[verifying + 1] - counts, counts)
        offsets = self._arange[: int(counts.sum())] - np.repeat(np.cumsum(counts) - counts,
                                                                counts)
        return np.concatenate([last, firsts + offsets])

    def _step_batch(self, out: SchedulerOutput) -> StepBatch:
        batch = self.input_batch
        # NOTE: decodes first (the attention backend's batch layout contract).
        req_ids = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        n = len(req_ids)
        slots = np.fromiter((batch.req_id_to_slot[r] for r in req_ids), np.int64, n)
        query_lens = np.fromiter((out.num_scheduled_tokens[r] for r in req_ids), np.int64, n)
        starts = batch.num_computed_tokens[slots]
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        spec = out.scheduled_spec_decode_tokens
        num_drafts = np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int64, n)
        sample_rows = np.flatnonzero(starts + query_lens == batch.num_tokens[slots] + num_drafts)
        return StepBatch(req_ids, slots, query_lens, starts, query_start_loc, sample_rows,
                         num_drafts)

    def _prepare_inputs(
        self, step: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | list[AttentionMetadata]]:
        """Gather the step's token ids, positions and slots from the persistent arrays; the
        attention metadata (with several KV cache groups: one per layer, its group's)."""
        batch = self.input_batch
        num_tokens = int(step.query_start_loc[-1])
        req_of_token = np.repeat(self._arange[: len(step.slots)], step.query_lens)
        slot_of_token = step.slots[req_of_token]
        positions = self._positions.numpy()[:num_tokens]
        np.subtract(self._arange[:num_tokens], step.query_start_loc[req_of_token], out=positions)
        positions += step.starts[req_of_token]
        np.take(batch.token_ids.ravel(), slot_of_token * batch.token_ids.shape[1] + positions,
                out=self._input_ids.numpy()[:num_tokens])
        seq_lens = step.starts + step.query_lens
        max_blocks = self._check_blocks(step, seq_lens)
        mds = [
            self._group_metadata(g, step, positions, req_of_token, slot_of_token, seq_lens,
                                 max_blocks)
            for g in range(len(self.retentions))
        ]
        md = mds[0] if len(mds) == 1 else [mds[g] for g in self.group_of_layer]
        input_ids = self._input_ids[:num_tokens].to(self.device)
        return input_ids, self._positions[:num_tokens].to(self.device), md

    def _group_metadata(
        self, group: int, step: StepBatch, positions: np.ndarray, req_of_token: np.ndarray,
        slot_of_token: np.ndarray, seq_lens: np.ndarray, max_blocks: int,
    ) -> AttentionMetadata:
        """One KV cache group's slot mapping and block tables, and its metadata."""
        bs, num_tokens = self.block_size, len(positions)
        table = self.input_batch.block_tables[group]
        slot_mapping = self._slot_mappings[group].numpy()[:num_tokens]
        np.take(table.ravel(), slot_of_token * table.shape[1] + positions // bs,
                out=slot_mapping)
        slot_mapping *= bs
        slot_mapping += positions % bs
        block_tables = self._block_tables(group, step.slots, step.starts, max_blocks)
        common = CommonAttentionMetadata(
            query_start_loc=step.query_start_loc,
            seq_lens=seq_lens,
            num_decodes=int((step.query_lens == 1).sum()),
            block_tables=block_tables,
            block_size=bs,
            positions=positions,
            req_of_token=req_of_token,
            slot_mapping=self._slot_mappings[group][:num_tokens].to(self.device),
            dtype=self.dtype,
            device=self.device,
        )
        return self.attn_backend.build_metadata(common)

    def _block_tables(self, group: int, slots: np.ndarray, starts: np.ndarray,
                      max_blocks: int) -> np.ndarray:
        """The rows' first `max_blocks` block ids in `group` (a copy), those a windowed
        group's scheduler freed before `starts` nulled."""
        bs = self.block_size
        block_tables = self.input_batch.block_tables[group][slots, :max_blocks]
        retention = self.retentions[group]
        if not retention.keeps_all:
            # NOTE: the scheduler freed the blocks this step's queries do not read (the
            # runner's rows keep their old ids): null them, so nothing reads a reused block.
            first = np.fromiter((retention.first_window_block(c, bs) for c in starts.tolist()),
                                np.int64, len(starts))
            cols = np.arange(max_blocks)
            freed = (cols >= retention.num_sink_blocks(bs)) & (cols < first[:, None])
            block_tables[freed] = 0
        return block_tables

    def _check_blocks(self, step: StepBatch, seq_lens: np.ndarray) -> int:
        """The most blocks a row needs this step; RuntimeError if a row lacks some.

        NOTE: a table row is zero past its blocks: reading on would touch block 0.
        """
        needed = -(-seq_lens // self.block_size)
        short = needed > self.input_batch.num_blocks[step.slots]
        if short.any():
            row = int(np.argmax(short))
            raise RuntimeError(f"request {step.req_ids[row]!r} needs {needed[row]} blocks for "
                               f"{seq_lens[row]} tokens but was given "
                               f"{self.input_batch.num_blocks[step.slots[row]]}")
        return int(needed.max())

    def _sample(self, step: StepBatch, rows: np.ndarray, logits: torch.Tensor,
                result: ModelRunnerOutput) -> None:
        """Rows without drafts: sample one token each from `logits` (one row per row)."""
        batch = self.input_batch
        slots = step.slots[rows]
        states = [batch.slots[s] for s in slots]
        for s, state in zip(slots.tolist(), states):
            self.generators.checkpoint(state.req_id, int(batch.num_tokens[s]))
        temps = self._plain_temperatures(slots, states)
        if temps is not None:
            if any(temps):
                tokens = Sampler.plain(
                    logits, torch.tensor(temps, dtype=torch.float32, device=logits.device),
                    self._plain_generators(states, temps),
                    Truncation.of([s.sampling_params for s in states], logits.device))
            else:
                tokens = Sampler.greedy(logits)
            self._append_sampled(slots, states, tokens.numpy(), result)
            return
        md = self._sampling_metadata(slots, states, self.generators, logits.device)
        sampled = self.sampler(logits, md)
        self._append_sampled(slots, states, sampled.sampled_token_ids.numpy(), result, sampled)

    def _sampling_metadata(self, slots: np.ndarray, states: list, generators: Any,
                           device: torch.device | str = "cpu") -> SamplingMetadata:
        """The rows' `SamplingMetadata` (generators: anything with `get(req_id)`)."""
        batch = self.input_batch
        # NOTE: views into the persistent token array: only rows that use a penalty are
        # ever read in full (by the sampler), no history is copied here.
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[batch.prompt_view(s) for s in slots],
            output_token_ids=[batch.output_view(s) for s in slots],
            generators=[generators.get(s.req_id) for s in states],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=device,
        )

    def _plain_temperatures(self, slots: np.ndarray, states: list,
                            burst: bool = False) -> list[float] | None:
        """Each row's temperature (0: greedy) where every row is `SamplingParams.plain`
        (`burstable` for a burst) past its `min_tokens` (no stop token banned):
        `Sampler.plain`'s rows, or a burst's; else None."""
        batch = self.input_batch
        temps = []
        for s, state in zip(slots.tolist(), states):
            p = state.sampling_params
            eligible = p.burstable if burst else p.plain
            # NOTE: min_tokens as the sampler's ban reads it (its output so far, a view).
            if not eligible or (p.min_tokens and len(batch.output_view(s)) < p.min_tokens):
                return None
            temps.append(0.0 if p.sampling_type == SamplingType.GREEDY else p.temperature)
        return temps

    def _plain_generators(self, states: list, temps: list[float]) -> dict[int, torch.Generator]:
        """The generators of the seeded random rows, by row."""
        gens = {}
        for row, (state, t) in enumerate(zip(states, temps)):
            gen = self.generators.get(state.req_id) if t else None
            if gen is not None:
                gens[row] = gen
        return gens

    def _append_sampled(self, slots: np.ndarray, states: list, token_ids: np.ndarray,
                        result: ModelRunnerOutput, sampled: SamplerOutput | None = None) -> None:
        """Each row's sampled token into the input batch and `result` (with its logprobs,
        where `sampled` has them)."""
        self.input_batch.append_tokens(slots, token_ids)
        for j, (s, token) in enumerate(zip(states, token_ids.tolist())):
            result.sampled_token_ids[s.req_id] = [token]
            k = s.sampling_params.logprobs
            if k is not None and sampled is not None and sampled.logprobs is not None:
                result.logprobs[s.req_id] = [(
                    sampled.logprob_token_ids[j, : k + 1].tolist(),
                    sampled.logprobs[j, : k + 1].tolist(),
                    int(sampled.sampled_token_ranks[j]),
                )]

    def _verify(self, step: StepBatch, rows: np.ndarray, logits: torch.Tensor,
                result: ModelRunnerOutput) -> None:
        """Rows with drafts: the target's `logits` at each draft and after the last one
        (virtual rows, each with its history extended by the drafts before it, row after
        row), the rejection sampler's verdict, the accepted tokens appended."""
        batch = self.input_batch
        slots, num_drafts = step.slots[rows], step.num_drafts[rows]
        bases = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_drafts + 1, out=bases[1:])
        states = [batch.slots[s] for s in slots]
        params, prompts, histories = [], [], []
        for s, state, k in zip(slots.tolist(), states, num_drafts.tolist()):
            start, end = int(batch.num_prompt_tokens[s]), int(batch.num_tokens[s])
            for j in range(k + 1):
                params.append(state.sampling_params)
                prompts.append(batch.prompt_view(s))
                # NOTE: a view reaching into the drafts: position j's history.
                histories.append(batch.token_ids[s, start : end + j])
        md = SamplingMetadata.build(params, prompts, histories, [None] * len(params),
                                    self.eos_token_ids, self.vocab_size, logits.device)
        drafts = [batch.token_ids[s, batch.num_tokens[s] : batch.num_tokens[s] + k].tolist()
                  for s, k in zip(slots.tolist(), num_drafts.tolist())]
        for s, state in zip(slots.tolist(), states):
            self.generators.checkpoint(state.req_id, int(batch.num_tokens[s]))
        verdict = self.rejection_sampler(logits, md, drafts,
                                         [self.generators.get(s.req_id) for s in states])
        for r, (s, state, token_ids) in enumerate(zip(slots.tolist(), states,
                                                      verdict.token_ids)):
            batch.extend_tokens(s, token_ids)
            result.sampled_token_ids[state.req_id] = token_ids
            k = state.sampling_params.logprobs
            if k is not None and verdict.logprobs is not None:
                base = int(bases[r])
                result.logprobs[state.req_id] = [(
                    verdict.logprob_token_ids[base + j, : k + 1].tolist(),
                    verdict.logprobs[base + j, : k + 1].tolist(),
                    int(verdict.sampled_token_ranks[base + j]),
                ) for j in range(len(token_ids))]

    def _propose(self, step: StepBatch, num_tokens: int, result: ModelRunnerOutput) -> None:
        """The proposer's next drafts for every request that sampled this step."""
        slots = step.slots[step.sample_rows]
        drafts = self.proposer.propose(self.input_batch, slots, num_tokens)
        batch = self.input_batch
        for slot, tokens in zip(slots.tolist(), drafts):
            if tokens:
                result.draft_token_ids[batch.slots[slot].req_id] = tokens

    def _prompt_logprobs(
        self, step: StepBatch, hidden: torch.Tensor, result: ModelRunnerOutput
    ) -> None:
        batch = self.input_batch
        for i, slot in enumerate(step.slots.tolist()):
            s = batch.slots[slot]
            if not s.want_prompt_logprobs:
                continue
            start = int(step.starts[i])
            # Logits at position p score prompt token p + 1.
            end = min(start + int(step.query_lens[i]), int(batch.num_prompt_tokens[slot]) - 1)
            if end <= start:
                continue
            q0 = int(step.query_start_loc[i])
            logits = self.model.compute_logits(hidden[q0 : q0 + end - start])
            targets = torch.from_numpy(batch.token_ids[slot, start + 1 : end + 1].copy())
            ids, lps, ranks = compute_topk_logprobs(
                logits, targets.to(logits.device), s.sampling_params.prompt_logprobs
            )
            result.prompt_logprobs[s.req_id] = (
                start + 1, ids.tolist(), lps.tolist(), ranks.tolist()
            )
