"""Verification of draft tokens: the rejection sampler that keeps the output distribution
exactly the target's (speculative sampling, Leviathan et al. / Chen et al., 2023).

Each speculating row r brings k_r draft tokens d_0..d_{k-1} and the target's logits at
k_r + 1 positions (position j scores the token after d_{j-1}). With p_j the target's
processed distribution at position j (every stage of layers/sampler.py, through
`Sampler.process`, so temperature, top-k/p, min-p, penalties, logit_bias and min_tokens
bans act exactly as without speculation) and q_j the proposer's:
- greedy rows accept d_j while it equals the argmax of p_j; the token after the accepted
  run is that argmax;
- random rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
  rejection they sample from norm(max(0, p_j - q_j)) and stop; when all k are accepted
  they sample a bonus token from p_k.
q is one-hot at the draft (deterministic proposers) unless the caller gives `draft_probs`.

Seeded rows draw, from their own generator, k_r uniforms and then one vocabulary-size
vector for the final token (the exponential race of `random_sample`), whatever the batch:
their streams stay reproducible. Logprobs (from the raw logits, as the sampler) are given
for every virtual row: the runner keeps those of the emitted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.layers.sampler import (
    Sampler,
    SamplingMetadata,
    compute_topk_logprobs,
    random_sample,
)


def acceptance_probs(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) elementwise: the chance that a draft d is accepted."""
    return (p_draft / q_draft).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised (the exponential race needs no normalisation); rows
    that come out all zero (p == q) fall back to p."""
    res = (p - q).clamp_min(0.0)
    empty = res.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, res)


@dataclass(slots=True)
class RejectionOutput:
    """Per row: the accepted drafts then one target token; logprobs per virtual row (row
    r's positions start at sum of (k_i + 1) over rows i < r), None when no row asked."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprob_token_ids: torch.Tensor | None  # [N, K+1]
    logprobs: torch.Tensor | None  # [N, K+1]
    sampled_token_ranks: torch.Tensor | None  # [N]


class RejectionSampler:
    """Stateless; see the module docstring for the rule."""

    def __call__(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        draft_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        draft_probs: list[torch.Tensor] | None = None,
    ) -> RejectionOutput:
        """`logits` [N, V]: the target's raw logits at the N = sum(k_r + 1) virtual rows,
        row r's positions contiguous; `md` describes those N rows (row r's params repeated,
        histories extended by its drafts). `generators[r]`: row r's, or None.
        `draft_probs[r]` [k_r, V]: the proposer's q at row r's drafts (None: one-hot).
        """
        device = logits.device
        num_rows = len(draft_token_ids)
        num_drafts = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64)
        max_k = int(num_drafts.max())
        starts = torch.zeros(num_rows, dtype=torch.int64)
        torch.cumsum(num_drafts[:-1] + 1, dim=0, out=starts[1:])
        positions = torch.arange(max_k + 1)
        # [R, K+1] virtual row of each position, padded by repeating the row's last one.
        index = (starts[:, None] + torch.minimum(positions, num_drafts[:, None])).to(device)
        valid = (positions[:max_k] < num_drafts[:, None]).to(device)  # [R, K]
        drafts = torch.zeros(num_rows, max_k, dtype=torch.int64)
        for r, d in enumerate(draft_token_ids):
            drafts[r, : len(d)] = torch.tensor(d, dtype=torch.int64)
        drafts = drafts.to(device)
        greedy_ids, probs = Sampler.process(logits, md)
        accepted = torch.zeros(num_rows, max_k, dtype=torch.bool, device=device)
        if greedy_ids is not None:
            target = greedy_ids[index]
            greedy_rows = (torch.ones(num_rows, dtype=torch.bool, device=device)
                           if md.greedy_mask is None else md.greedy_mask[starts.to(device)])
            accepted |= greedy_rows[:, None] & (drafts == target[:, :max_k])
        q = _draft_q(draft_probs, drafts, probs, valid) if probs is not None else None
        if probs is not None:
            p = probs[index]  # [R, K+1, V]
            p_draft = p[:, :max_k].gather(-1, drafts[..., None]).squeeze(-1)
            q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
            u = _uniforms(num_rows, max_k, num_drafts, generators, device)
            random_ok = u < acceptance_probs(p_draft, q_draft)
            accepted = torch.where(greedy_rows[:, None], accepted, random_ok) if (
                greedy_ids is not None) else random_ok
        accepted &= valid
        num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # [R]
        rows = torch.arange(num_rows, device=device)
        final = self._final_tokens(p if probs is not None else None, q, num_accepted,
                                   num_drafts.to(device), generators, md)
        if greedy_ids is not None:
            final_greedy = target[rows, num_accepted]
            final = final_greedy if final is None else torch.where(greedy_rows, final_greedy,
                                                                   final)
        return self._output(logits, md, drafts, num_accepted, final, index, num_drafts)

    @staticmethod
    def _final_tokens(
        p: torch.Tensor | None, q: torch.Tensor | None, num_accepted: torch.Tensor,
        num_drafts: torch.Tensor, generators: list[torch.Generator | None],
        md: SamplingMetadata,
    ) -> torch.Tensor | None:
        """Random rows' token after the accepted run: from the residual at the first
        rejection, or the bonus from p_k; None when every row is greedy."""
        if p is None:
            return None
        rows = torch.arange(p.shape[0], device=p.device)
        p_at = p[rows, num_accepted]  # [R, V]
        rejected = num_accepted < num_drafts
        q_at = q[rows, num_accepted.clamp(max=q.shape[1] - 1)]
        dist = torch.where(rejected[:, None], residual_distribution(p_at, q_at), p_at)
        gens = {r: g for r, g in enumerate(generators) if g is not None}
        return random_sample(dist, gens)

    @staticmethod
    def _output(
        logits: torch.Tensor, md: SamplingMetadata, drafts: torch.Tensor,
        num_accepted: torch.Tensor, final: torch.Tensor, index: torch.Tensor,
        num_drafts: torch.Tensor,
    ) -> RejectionOutput:
        accepted_list = num_accepted.tolist()
        drafts_list, final_list = drafts.tolist(), final.tolist()
        token_ids = [d[:a] + [f] for d, a, f in zip(drafts_list, accepted_list, final_list)]
        if md.max_num_logprobs is None:
            return RejectionOutput(token_ids, accepted_list, None, None, None)
        # NOTE: each virtual row is scored with the token emitted at its position (rows
        # past the accepted run with their draft; the runner drops those).
        emitted = torch.cat([drafts, drafts[:, :1]], dim=1)
        emitted[torch.arange(len(final)), num_accepted] = final
        virtual = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        virtual[index] = emitted
        ids, lps, ranks = compute_topk_logprobs(logits, virtual, md.max_num_logprobs)
        return RejectionOutput(token_ids, accepted_list, ids.cpu(), lps.cpu(), ranks.cpu())


def _draft_q(
    draft_probs: list[torch.Tensor] | None, drafts: torch.Tensor, probs: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """q [R, K, V]: the given draft distributions, or one-hot at each draft."""
    num_rows, max_k = drafts.shape
    if draft_probs is None:
        q = torch.zeros(num_rows, max_k, probs.shape[-1], device=probs.device)
        q.scatter_(-1, drafts[..., None], 1.0)
    else:
        q = torch.zeros(num_rows, max_k, probs.shape[-1], device=probs.device)
        for r, qr in enumerate(draft_probs):
            q[r, : len(qr)] = qr.to(device=probs.device, dtype=torch.float32)
    # NOTE: padding positions get q = 1 at their (unused) draft, never 0 / 0.
    q[~valid] = 0.0
    q[~valid, 0] = 1.0
    return q


def _uniforms(
    num_rows: int, max_k: int, num_drafts: torch.Tensor,
    generators: list[torch.Generator | None], device: torch.device,
) -> torch.Tensor:
    """[R, K] uniforms in [0, 1): seeded rows draw exactly k_r from their generator."""
    u = torch.rand(num_rows, max_k)
    for r, gen in enumerate(generators):
        if gen is not None:
            k = int(num_drafts[r])
            u[r, :k] = torch.rand(k, generator=gen, device=gen.device).cpu()
    return u.to(device)
