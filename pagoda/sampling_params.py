"""How one request wants its tokens chosen and when it wants to stop.

Names and defaults follow vLLM's `SamplingParams`, so that users switch by an import.
Every value is checked once, here, when the object is built; the sampler and the
detokenizer then trust it.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field

# Temperatures below this are treated as greedy decoding (argmax).
SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping options.

    Contract: after construction every field holds a valid, normalised value:
    `stop` and `stop_token_ids` are lists, `top_k` is 0 when disabled, `logit_bias`
    has int keys, and a greedy request (temperature < SAMPLING_EPS) has top_k/top_p/min_p
    switched off. Invalid values raise ValueError naming the parameter.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = field(default=None)
    detokenize: bool = True

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_counts()
        self._verify_sampling()
        self._verify_stops()
        if self.temperature < SAMPLING_EPS:
            # NOTE: greedy decoding is an argmax; truncation options cannot change it, so
            # they are switched off to keep the sampler's fast paths reachable.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                ) from e

    def _verify_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of != self.n:
            # NOTE: best_of > n (generate more, return the n most likely) is not
            # implemented; accepting it and returning n plain samples would silently give
            # other results than asked for.
            raise ValueError(
                f"best_of is not supported unless it equals n ({self.n}), got {self.best_of}"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # NOTE: vLLM also accepts -1 (whole vocabulary); not supported here yet.
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be non-negative, got {value}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        # NOTE: sample i of n draws from seed + i, and a generator takes a 64-bit seed: an
        # out-of-range one must fail here, not inside a step where it would fail the batch.
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - self.n:
            raise ValueError(
                f"seed must be in [-2**63, 2**63 - n] (sample i uses seed + i), got {self.seed}"
            )

    def _verify_sampling(self) -> None:
        # NOTE: written as `not (valid)` so that NaN fails every check.
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}"
            )
        for token_id, bias in (self.logit_bias or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}"
                )

    def _verify_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")

    def verify_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError if `logit_bias` or `stop_token_ids` name a token outside the
        vocabulary. The engine calls this when a request arrives, as only it knows the
        vocabulary size."""
        for token_id in self.logit_bias or {}:
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"logit_bias token id {token_id} is out of vocabulary (size {vocab_size})"
                )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise ValueError(
                    f"stop_token_ids token id {token_id} is out of vocabulary (size {vocab_size})"
                )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def plain(self) -> bool:
        """Nothing but the temperature and truncation (top-k, top-p, min-p) changes the
        logits, and nothing reports them (no penalties, logit_bias or logprobs): once
        `min_tokens` is reached, the token is the race over what the truncation leaves of
        softmax(logits / temperature), or the raw logits' argmax for a greedy request
        (`Sampler.plain`; decode bursts run these). Neither depends on the request's
        tokens so far."""
        return (self.logprobs is None and not self.logit_bias
                and self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0)

    @property
    def burstable(self) -> bool:
        """Nothing reports the logits (no logprobs): once `min_tokens` is reached, each
        token depends on the logits and the request's tokens so far only, which a decode
        burst's kernel keeps (penalties, logit_bias, temperature, truncation)."""
        return self.logprobs is None

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a stream must hold back so that it never shows part of a stop string
        that will be cut from the output."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def all_stop_token_ids(self, eos_token_ids: set[int]) -> set[int]:
        """Token ids that end this request: its stop_token_ids, plus eos unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= eos_token_ids
        return ids

    def clone(self) -> SamplingParams:
        """A deep copy: the lists and dict are not shared with this object."""
        return copy.deepcopy(self)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
