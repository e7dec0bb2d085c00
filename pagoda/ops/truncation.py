"""The sampler's truncation in PyTorch: min-p, then top-k, then top-p, each row's cut
tokens set to -inf (`ops.truncate_rows`' reference; layers/sampler.py's order).

The CPU kernel (ops/csrc/fused_ops_cpu.cpp: truncate_rows) cuts the same tokens but where
a rounding decides: its weights are exp(x - max x) by its own polynomial, summed in fixed
lanes, where these are torch's softmax and cumsum.
"""

from __future__ import annotations

import torch


def truncate_rows(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None) -> torch.Tensor:
    """In place where it can: each row of scaled logits x [rows, n] float32 cut by its
    min_p (0: off), then top_k (<= 0 or >= n: off), then top_p (1: off). Returns the cut
    rows (x, or a new tensor)."""
    if min_p is not None:
        apply_min_p(x, min_p)
    if top_k is not None:
        n = x.shape[-1]
        top_k = torch.where((top_k <= 0) | (top_k >= n), n, top_k)
        if bool((top_k == n).all()):
            top_k = None
    max_top_k = None if top_k is None else int(top_k.max())
    return apply_top_k_top_p(x, top_k, top_p, max_top_k)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k and top-p nucleus (one sort;
    top-p alone: `_apply_top_p_by_candidates`).

    top-p acts on the distribution left by top-k: it keeps the smallest set of most
    likely tokens whose probability reaches p, i.e. a token survives while the mass of
    the tokens ranked above it is below p. `max_top_k` (if below V, every row's top_k is
    at most it) lets a partial top-k stand in for the full sort. May work in place.
    """
    if top_k is None and top_p is None:
        return logits
    if top_k is None:
        return _apply_top_p_by_candidates(logits, top_p)
    return _sorted_top_k_top_p(logits, top_k, top_p, max_top_k)


def _sorted_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """`apply_top_k_top_p` through one sort of each row, or one top-k where `max_top_k` is
    below V. May work in place."""
    vocab_size = logits.shape[-1]
    if top_k is not None and max_top_k is not None and max_top_k < vocab_size:
        sorted_logits, sorted_ids = logits.topk(max_top_k, dim=-1)
        out = torch.full_like(logits, -float("inf"))
    else:
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        out = logits
    if top_k is not None:
        positions = torch.arange(sorted_logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), -float("inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        # NOTE: rows with p == 1 are excluded explicitly: rounding can push the running
        # sum to 1 before the tail and would drop tokens that p == 1 promises to keep.
        p = top_p.unsqueeze(1)
        sorted_logits.masked_fill_((mass_above >= p) & (p < 1.0), -float("inf"))
    return out.scatter_(-1, sorted_ids, sorted_logits)


# top-p alone: how many of a row's most likely tokens its nucleus is looked for among, in
# turn, before the whole vocabulary is sorted, and how much more than p their mass must be
# (the sums' roundings are ~1e-6) for the nucleus to lie among them.
NUCLEUS_CANDIDATES = (64, 1024)
_MASS_MARGIN = 1e-4


def _apply_top_p_by_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`apply_top_k_top_p` without top-k, in place, without sorting the vocabulary where it
    can: a row's k most likely tokens (one top-k) hold its whole nucleus when their mass
    under the full softmax reaches p, since any token ranked below them has at least that
    much above it. Such a row keeps the candidates whose mass above is below p; a row whose
    candidates hold less tries the next k of NUCLEUS_CANDIDATES, then is sorted whole (flat
    distributions); rows of p == 1 are left as they are. Which k serves a row depends on the
    row alone. (At 32 rows of 49,152 logits a sort took ~60 ms, a top-64 ~1.3.)"""
    pending = (top_p < 1.0).nonzero().squeeze(1)
    vocab_size = logits.shape[-1]
    if not len(pending):
        return logits
    lse = torch.logsumexp(logits[pending], dim=-1, keepdim=True)
    for k in NUCLEUS_CANDIDATES:
        if not len(pending) or k >= vocab_size:
            break
        vals, ids = logits[pending].topk(k, dim=-1)
        probs = (vals - lse).exp_()
        mass = probs.cumsum(dim=-1)
        p = top_p[pending]
        covered = mass[:, -1] >= p + _MASS_MARGIN
        if bool(covered.any()):
            kept = vals[covered].masked_fill_(
                mass[covered] - probs[covered] >= p[covered].unsqueeze(1), -float("inf"))
            rows = torch.full((len(kept), vocab_size), -float("inf"), dtype=logits.dtype,
                              device=logits.device)
            logits[pending[covered]] = rows.scatter_(-1, ids[covered], kept)
        pending, lse = pending[~covered], lse[~covered]
    if len(pending):
        logits[pending] = _sorted_top_k_top_p(logits[pending], None, top_p[pending])
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: mask tokens whose probability is below min_p times the row's maximum."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, -float("inf"))
