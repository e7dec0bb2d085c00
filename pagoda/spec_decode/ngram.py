"""Prompt lookup (n-gram) proposer: find the request's last n tokens earlier in its own
tokens (prompt and output) and propose the tokens that followed them.

n runs from `prompt_lookup_max` down to `prompt_lookup_min`; the first n with a match
wins, and among its matches the earliest (in a copy-from-the-prompt answer that is the
prompt's span, not an earlier copy of it). One `unfold` comparison per n: no Python loop
over the history.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.proposer import Proposer, register_proposer
from pagoda.worker.input_batch import InputBatch


def ngram_propose(history: torch.Tensor, num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to `num_tokens` tokens following the earliest earlier occurrence of the longest
    suffix of `history` [L] (int64) with length in [min_n, max_n]; [] if none occurs."""
    length = history.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # NOTE: windows starting before L - n: each has at least one token after it.
        windows = history[: length - 1].unfold(0, n, 1)
        hits = (windows == history[length - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[0]) + n
            return history[start : start + num_tokens].tolist()
    return []


@register_proposer("ngram")
class NgramProposer(Proposer):
    @classmethod
    def validate_config(cls, config: SpeculativeConfig) -> None:
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")

    def propose(self, batch: InputBatch, slots: np.ndarray, num_tokens: int) -> list[list[int]]:
        hi, lo = self.config.prompt_lookup_max, self.config.prompt_lookup_min
        token_ids = torch.from_numpy(batch.token_ids)
        return [
            ngram_propose(token_ids[slot, : batch.num_tokens[slot]], num_tokens, hi, lo)
            for slot in slots.tolist()
        ]
