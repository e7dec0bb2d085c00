"""Next-token sampling for a batch of rows, with vLLM's semantics.

Order of processing (each stage is skipped when no row in the batch needs it):
    min_tokens bans -> logit_bias -> penalties (`ops.penalize_rows`) -> [greedy rows: argmax]
    -> temperature -> min-p -> top-k -> top-p (`ops.truncate_rows`)
    -> sample (exponential race, `race_sample`).
min-p comes before top-k/top-p, as in vLLM v1 (it is an argmax-invariant logits processor
there, applied right after temperature): top-p then measures its nucleus on the
distribution min-p left, so the two orders keep different tokens.
Logprobs are taken from the raw logits, before any of these stages (vLLM's default).

A seeded row is sampled with its own `torch.Generator`, drawing exactly one vector of
vocabulary size per step, so its tokens do not depend on what else is in the batch.
The stages that touch every logit (penalties, truncation, the race) are ops: C++ kernels on
the CPU, their PyTorch references elsewhere; a decode burst runs the same kernels in C++.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pagoda import ops
from pagoda.sampling_params import SamplingParams, SamplingType

_TINY = torch.finfo(torch.float32).tiny
TokenIds = Sequence[int] | np.ndarray


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling state of one batch, on the logits' device.

    Optional tensors are None when no row needs them, so the common cases skip whole
    stages: an all-greedy batch without penalties, bias or bans costs one argmax.
    Greedy rows hold neutral values (temperature 1, top-k/top-p/min-p off).
    """

    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; only when greedy and random rows mix
    temperature: torch.Tensor | None  # [B] float32; None when all rows are greedy
    top_k: torch.Tensor | None  # [B] int64 in [1, V], V where off
    max_top_k: int  # max of top_k (V when None): below V, a top-k replaces the full sort
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off
    min_p: torch.Tensor | None  # [B] float32, 0.0 where off
    generators: dict[int, torch.Generator]  # row -> generator, seeded random rows only
    repetition_penalty: torch.Tensor | None  # [B, 1] float32
    seen_token_mask: torch.Tensor | None  # [B, V] bool: token is in the prompt or output
    frequency_penalty: torch.Tensor | None  # [B, 1] float32
    presence_penalty: torch.Tensor | None  # [B, 1] float32
    output_token_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, values)
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids) set to -inf
    max_num_logprobs: int | None  # top-K logprobs to return; None when no row asks

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None and self.frequency_penalty is None

    @property
    def needs_processing(self) -> bool:
        """Whether any stage besides argmax/sampling touches the logits."""
        return not (
            self.no_penalties
            and self.logit_bias is None
            and self.banned_tokens is None
            and self.all_greedy
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: Sequence[TokenIds],
        output_token_ids: Sequence[TokenIds],
        generators: list[torch.Generator | None],
        eos_token_ids: set[int],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Gather the per-row options of `params` (row i = params[i]) into tensors.

        `generators[i]` is used only when row i samples randomly; it may live on the CPU
        while `device` is an accelerator. Token histories (lists or numpy arrays) are read
        only for rows that use a penalty; other rows need only their output's length.
        """
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        # Greedy rows get neutral values so that one vectorised pass serves every row.
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = _top_k_column(params, greedy, vocab_size)
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        max_logprobs = [p.logprobs for p in params if p.logprobs is not None]

        def column(values: list, dtype: torch.dtype, neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        md = cls(
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None
            if all_greedy or all_random
            else torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=None
            if all_greedy
            else torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=column(top_k, torch.int64, vocab_size),
            max_top_k=max(top_k, default=vocab_size),
            top_p=column(top_p, torch.float32, 1.0),
            min_p=column(min_p, torch.float32, 0.0),
            generators={
                i: gen
                for i, (gen, g) in enumerate(zip(generators, greedy))
                if gen is not None and not g
            },
            repetition_penalty=None,
            seen_token_mask=None,
            frequency_penalty=None,
            presence_penalty=None,
            output_token_counts=None,
            logit_bias=_build_logit_bias(params, device),
            banned_tokens=_build_banned_tokens(params, output_token_ids, eos_token_ids, device),
            max_num_logprobs=max(max_logprobs) if max_logprobs else None,
        )
        _fill_penalties(md, params, prompt_token_ids, output_token_ids, vocab_size, device)
        return md


def _top_k_column(params: list[SamplingParams], greedy: list[bool], vocab_size: int) -> list[int]:
    """Per-row k in [1, V] (V = off); all V when no random row uses top-k."""
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if all(k == vocab_size for k, g in zip(top_k, greedy) if not g):
        return [vocab_size] * len(params)
    # NOTE: greedy rows take k = 1 (the same argmax), so that a batch whose random rows
    # all use top-k still avoids sorting the whole vocabulary.
    return [1 if g else k for k, g in zip(top_k, greedy)]


def _flat_pairs(
    rows: list[int], token_lists: Mapping[int, TokenIds] | Sequence[TokenIds],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) for every token of `token_lists[r]`, r in rows; only those
    rows are read."""
    arrays = [np.asarray(token_lists[r], dtype=np.int64) for r in rows]
    ids = torch.from_numpy(np.concatenate(arrays))
    lengths = torch.tensor([len(a) for a in arrays], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    return row_idx.to(device), ids.to(device)


def _fill_penalties(
    md: SamplingMetadata,
    params: list[SamplingParams],
    prompt_token_ids: Sequence[TokenIds],
    output_token_ids: Sequence[TokenIds],
    vocab_size: int,
    device: torch.device,
) -> None:
    """Set the penalty fields of `md`; only rows that use a penalty pay for its table."""
    # NOTE: the tables are rebuilt every step from token lists; a persistent input batch
    # can later keep them on the device and update them incrementally.
    batch = len(params)
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        all_ids = {i: np.concatenate([np.asarray(prompt_token_ids[i], dtype=np.int64),
                                      np.asarray(output_token_ids[i], dtype=np.int64)])
                   for i in rep_rows}
        mask = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
        mask[_flat_pairs(rep_rows, all_ids, device)] = True
        md.seen_token_mask = mask
        md.repetition_penalty = torch.tensor(
            [[p.repetition_penalty] for p in params], dtype=torch.float32, device=device
        )
    freq_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if freq_rows:
        counts = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
        rows, ids = _flat_pairs(freq_rows, output_token_ids, device)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        md.output_token_counts = counts
        md.frequency_penalty = torch.tensor(
            [[p.frequency_penalty] for p in params], dtype=torch.float32, device=device
        )
        md.presence_penalty = torch.tensor(
            [[p.presence_penalty] for p in params], dtype=torch.float32, device=device
        )


def _build_logit_bias(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, ids, values = zip(*entries)
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _build_banned_tokens(
    params: list[SamplingParams],
    output_token_ids: Sequence[TokenIds],
    eos_token_ids: set[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stop tokens of rows that have not yet produced `min_tokens` tokens."""
    pairs = [
        (i, t)
        for i, (p, out) in enumerate(zip(params, output_token_ids))
        if len(out) < p.min_tokens
        for t in sorted(p.all_stop_token_ids(eos_token_ids))
    ]
    if not pairs:
        return None
    rows, ids = zip(*pairs)
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
    )


@dataclass(slots=True)
class SamplerOutput:
    """One step's sampled tokens; every tensor is on the CPU.

    The logprob tensors are [B, K+1]: column 0 is the sampled token, columns 1..K the
    K most likely tokens (K = max_num_logprobs). All three are None when no row asked.
    """

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None  # [B, K+1] int64
    logprobs: torch.Tensor | None  # [B, K+1] float32
    sampled_token_ranks: torch.Tensor | None  # [B] int64, 1 = most likely


class Sampler:
    """Stateless: all per-request state comes in through `SamplingMetadata`."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V] (any float dtype; math in float32).

        The caller's `logits` tensor is never modified.
        """
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        greedy_ids, scaled = self.scaled_logits(logits, md)
        if scaled is None:
            sampled = greedy_ids
        else:
            sampled = race_sample(scaled, None, md.generators)
            if greedy_ids is not None:
                sampled = torch.where(md.greedy_mask, greedy_ids, sampled)
        if raw_logprobs is None:
            return SamplerOutput(sampled.cpu(), None, None, None)
        ids, lps, ranks = _gather_topk(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled.cpu(), ids.cpu(), lps.cpu(), ranks.cpu())

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """What `__call__` samples when every row is greedy and `SamplingParams.plain` past
        its `min_tokens` (no stage touches the logits): each row's argmax, on the CPU, without
        building the metadata (a batch-1 decode step's host time is mostly cache misses,
        and the metadata is the larger part of sampling's)."""
        return ops.argmax_rows(logits).cpu()

    @staticmethod
    def plain(logits: torch.Tensor, temperature: torch.Tensor,
              generators: Mapping[int, torch.Generator],
              truncation: Truncation | None = None) -> torch.Tensor:
        """What `__call__` samples when every row is `SamplingParams.plain` past its
        `min_tokens` (only temperature and truncation touch the logits), without the
        metadata: `temperature` [B] float32 (0 for a greedy row), `generators` the seeded
        random rows', `truncation` the rows' top-k, top-p and min-p. The same tokens as
        `__call__`: the race divides by the temperature as torch's div does and cuts with
        `ops.truncate_rows`' kernel, and a decode burst repeats this call's kernel step by
        step."""
        return race_sample(logits, temperature, generators, truncation).cpu()

    @staticmethod
    def process(
        logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The processed distributions every row is sampled from: (argmax ids [B] of the
        greedy rows' processed logits, None when no row is greedy; probabilities [B, V]
        float32 after every stage, None when all rows are greedy). Rows of the other kind
        hold neutral values. The rejection sampler verifies drafts against these.
        """
        greedy_ids, scaled = Sampler.scaled_logits(logits, md)
        return greedy_ids, None if scaled is None else scaled.softmax(dim=-1)

    @staticmethod
    def scaled_logits(
        logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`process` before its softmax: the random rows' logits [B, V] float32 after
        temperature, min-p, top-k and top-p (tokens cut to -inf), None when all rows are
        greedy."""
        if md.needs_processing:
            logits = logits.to(torch.float32, copy=True)
            if md.banned_tokens is not None:
                logits[md.banned_tokens] = -float("inf")
            penalties = Penalties.of(md)
            if penalties is not None:
                ops.penalize_rows(logits, *penalties)
        # NOTE: torch's CPU argmax over [B, V] took ~15 ms at B = 64, V = 49,152; the
        # CPU kernel picks the same ids (ties and NaNs included) in a fraction of that.
        greedy_ids = None if md.all_random else ops.argmax_rows(logits)
        if md.all_greedy:
            return greedy_ids, None
        if not md.needs_processing:
            # NOTE: still the caller's tensor; the stages below work in place.
            logits = logits.to(torch.float32, copy=True)
        logits.div_(md.temperature.unsqueeze(1))
        if md.min_p is None and md.top_k is None and md.top_p is None:
            return greedy_ids, logits
        return greedy_ids, ops.truncate_rows(logits, md.top_k, md.top_p, md.min_p)


def draw_exponentials(batch: int, vocab: int, generators: Mapping[int, torch.Generator],
                      device: torch.device, out: torch.Tensor | None = None,
                      unseeded: bool = True) -> torch.Tensor:
    """E ~ Exp(1), [batch, vocab] float32 (into `out` if given) for the exponential race.

    Rows in `generators` draw their own vector from their generator (on its device), one
    vocabulary-size uniform vector per call, turned into E as a vector of its own: the
    values depend on the generator's state only, not on the batch's shape or device (CPU
    generators serve accelerator batches), nor on whether a decode burst drew them ahead.
    The other rows share one unseeded draw (`unseeded` False: they are left unset).
    """
    e = torch.empty(batch, vocab, dtype=torch.float32, device=device) if out is None else out
    if unseeded and len(generators) < batch:
        _to_exponential(e.uniform_())
    for row, gen in generators.items():
        draw = torch.rand(vocab, generator=gen, dtype=torch.float32, device=gen.device)
        e[row] = _to_exponential(draw).to(device)
    return e


def _to_exponential(u: torch.Tensor) -> torch.Tensor:
    """In place: E = -log(U) (on CPU about 4x faster than Tensor.exponential_). U == 0
    gives E = inf (a race score of 0, harmless); U near 1 gives E near 0, clamped so that
    p / E never becomes inf, or NaN for a masked token, which argmax prefers."""
    return u.log_().neg_().clamp_min_(_TINY)


def race_sample(logits: torch.Tensor, temperature: torch.Tensor | None,
                generators: Mapping[int, torch.Generator],
                truncation: Truncation | None = None) -> torch.Tensor:
    """One token per row of `logits` [B, V] by the exponential race over
    softmax(logits / temperature) (`ops.race_rows`; temperature None: 1, 0: greedy), cut by
    `truncation` where given: a seeded row with `draw_exponentials`' E from its generator,
    the others with the draws the kernel makes from `race_seeds`."""
    batch, vocab = logits.shape
    exps = draw_exponentials(batch, vocab, generators, logits.device,
                             unseeded=False) if generators else None
    return ops.race_rows(logits.contiguous(), temperature, exps,
                         race_seeds(1, batch, generators)[0],
                         *(truncation or Truncation()))


class Penalties(NamedTuple):
    """Per-row logit_bias, repetition, frequency and presence penalties as
    `ops.penalize_rows` takes them (a decode burst's too): each group None where no row
    uses it; `seen` and `counts` are the tables `SamplingMetadata` builds."""

    repetition: torch.Tensor | None = None  # [B] float32
    seen: torch.Tensor | None = None  # [B, V] bool
    frequency: torch.Tensor | None = None  # [B] float32
    presence: torch.Tensor | None = None  # [B] float32
    counts: torch.Tensor | None = None  # [B, V] float32
    bias_rows: torch.Tensor | None = None  # [E] int64
    bias_ids: torch.Tensor | None = None  # [E] int64
    bias_values: torch.Tensor | None = None  # [E] float32

    @classmethod
    def of(cls, md: SamplingMetadata) -> Penalties | None:
        """`md`'s penalties and bias; None where it has none."""
        if md.no_penalties and md.logit_bias is None:
            return None

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(-1)

        return cls(flat(md.repetition_penalty), md.seen_token_mask,
                   flat(md.frequency_penalty), flat(md.presence_penalty),
                   md.output_token_counts, *(md.logit_bias or (None, None, None)))


class Truncation(NamedTuple):
    """Per-row top-k (int64 [B], 0: off), top-p and min-p (float32 [B]; 1 and 0: off) of
    `Sampler.plain` and a decode burst; a field no row uses is None."""

    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
           ) -> Truncation | None:
        """The rows' settings (a greedy request's are off); None where no row uses any."""
        def column(values: list, dtype: torch.dtype, off: float) -> torch.Tensor | None:
            if all(v == off for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        cut = cls(column([p.top_k for p in params], torch.int64, 0),
                  column([p.top_p for p in params], torch.float32, 1.0),
                  column([p.min_p for p in params], torch.float32, 0.0))
        return None if all(f is None for f in cut) else cut


def race_seeds(steps: int, batch: int, generators: Mapping[int, torch.Generator]
               ) -> torch.Tensor:
    """int64 [steps, batch] (CPU): per step a fresh seed from torch's default generator (so
    `torch.manual_seed` repeats it) for every row not in `generators`, whose draws the race's
    kernel then makes itself (a counter hash: no vocabulary-size vector of torch uniforms and
    their logs); -1 for the rows in `generators`, which bring their own E."""
    if len(generators) == batch:
        return torch.full((steps, batch), -1, dtype=torch.int64)
    seeds = torch.randint(0, 2**62, (steps, 1), dtype=torch.int64).repeat(1, batch)
    for row in generators:
        seeds[:, row] = -1
    return seeds


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [B, V] (unnormalised, non-negative), by an exponential
    race: argmax(p / E), E ~ Exp(1) i.i.d. (`draw_exponentials`), picks token i with
    probability p_i / sum(p). Consumes `probs`. (The rejection sampler's final tokens.)"""
    batch, vocab = probs.shape
    return ops.argmax_rows(probs.div_(draw_exponentials(batch, vocab, generators,
                                                        probs.device)))


def compute_topk_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of the raw `logits` [N, V]; returns (ids [N, k+1] int64, logprobs
    [N, k+1] float32, ranks [N] int64) on the logits' device. Column 0 is `token_ids`
    [N], columns 1..k the k most likely tokens. rank = number of tokens at least as
    likely as the given one (1 = most likely). Used for sample and prompt logprobs."""
    return _gather_topk(torch.log_softmax(logits.float(), dim=-1), token_ids, k)


def _gather_topk(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    k = min(k, logprobs.shape[-1])
    if k == 0:
        return token_ids, token_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return (
        torch.cat([token_ids, top_ids], dim=1),
        torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks,
    )
