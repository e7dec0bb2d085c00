"""Draft-token proposers and their registry (`speculative_config.method` -> class).

A proposer guesses the next tokens of running requests; the target model checks them all in
the next step's forward and the rejection sampler (layers/rejection_sampler.py) keeps the
output distribution exactly the target's. Proposers are deterministic: a draft is the
proposer's single best guess, so the rejection sampler treats its distribution q as
one-hot at the proposed token.

The runner calls `propose` after each step's sampling, for the requests that sampled, with
their token histories (accepted tokens only) in the persistent `InputBatch`, and
`remove_requests` when requests finish or are preempted (a proposer with per-request state,
such as a draft model's KV, frees it there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.worker.input_batch import InputBatch


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer may need to know about the target and the engine."""

    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    block_size: int
    # The target's checkpoint and built model (quantized_self_draft reads the one and
    # shares the other's unquantized modules); None where no engine is behind the proposer.
    target_checkpoint: Any = None
    target_model: Any = None


class Proposer(ABC):
    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        self.config = config
        self.context = context

    @classmethod
    def validate_config(cls, config: SpeculativeConfig) -> None:
        """Raise ValueError naming a field of `config` this proposer cannot use."""

    @abstractmethod
    def propose(self, batch: InputBatch, slots: np.ndarray, num_tokens: int) -> list[list[int]]:
        """Up to `num_tokens` draft tokens for the request in each of `slots` (distinct),
        continuing its `batch.token_ids[slot, :batch.num_tokens[slot]]`; [] for none."""

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Drop any state kept for `req_ids` (finished or preempted)."""


ProposerClass = type[Proposer]
PROPOSERS: dict[str, ProposerClass] = {}


def register_proposer(name: str) -> Callable[[ProposerClass], ProposerClass]:
    def wrap(cls: ProposerClass) -> ProposerClass:
        PROPOSERS[name] = cls
        return cls

    return wrap


def create_proposer(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    return PROPOSERS[config.method](config, context)


# NOTE: importing the proposer modules runs their @register_proposer decorators.
from pagoda.spec_decode import draft_model, ngram, self_draft  # noqa: F401
