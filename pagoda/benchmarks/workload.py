"""A seeded, synthetic offline workload: the same requests for every system in one run.

Prompts are random token ids (not text) so that every system sees exactly the same
tokens, with no tokenizer round trip that could change prompt lengths. Special tokens are
never drawn, so a prompt cannot contain an end-of-sequence or control token.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# (prompt token ids, number of output tokens to generate)
Workload = list[tuple[list[int], int]]

DEFAULT_NUM_REQUESTS = 256
DEFAULT_INPUT_LEN = (100, 1024)
DEFAULT_OUTPUT_LEN = (100, 1024)
QUICK_NUM_REQUESTS = 16
QUICK_INPUT_LEN = (32, 128)
QUICK_OUTPUT_LEN = (32, 128)
# Named workloads (num requests, prompt lengths, output lengths), from issue 10's table:
# short requests as in the 64-request comparison, long ones as in the 256-request one.
WORKLOAD_PRESETS: dict[str, tuple[int, tuple[int, int], tuple[int, int]]] = {
    "short": (64, (26, 254), (16, 127)),
    "long": (256, (100, 1024), (100, 1023)),
}


@dataclass(slots=True, frozen=True)
class WorkloadStats:
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    min_prompt_len: int
    max_prompt_len: int
    min_output_len: int
    max_output_len: int


def special_token_ids(tokenizer: Any) -> set[int]:
    """Every id the tokenizer marks special, added control tokens included.

    NOTE: `all_special_ids` misses added tokens that are not bos/eos/unk/pad (SmolLM2 has
    fourteen such, e.g. `<file_sep>`), so the added-token table is read too.
    """
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return ids


def make_workload(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    input_len: tuple[int, int] = DEFAULT_INPUT_LEN,
    output_len: tuple[int, int] = DEFAULT_OUTPUT_LEN,
    seed: int = 0,
    vocab_size: int | None = None,
    tokenizer: Any = None,
    exclude_ids: Iterable[int] = (),
) -> Workload:
    """Build `num_requests` (prompt ids, output length) pairs, deterministic in `seed`.

    Lengths are uniform over the inclusive ranges; ids are uniform over the vocabulary
    minus special tokens (from `tokenizer` when given) and `exclude_ids`.
    """
    if tokenizer is not None:
        vocab_size = vocab_size or len(tokenizer)
        exclude = special_token_ids(tokenizer) | set(exclude_ids)
    else:
        exclude = set(exclude_ids)
    if vocab_size is None:
        raise ValueError("make_workload needs vocab_size or a tokenizer")
    for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got {(lo, hi)}")
    allowed = [i for i in range(vocab_size) if i not in exclude]
    if not allowed:
        raise ValueError("no token ids left after excluding special tokens")

    # NOTE: a private Random keeps the workload independent of torch/numpy global seeds.
    rng = random.Random(seed)
    workload: Workload = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*input_len)
        num_output = rng.randint(*output_len)
        prompt = rng.choices(allowed, k=prompt_len)
        workload.append((prompt, num_output))
    return workload


def workload_stats(workload: Workload) -> WorkloadStats:
    """Totals and ranges of a workload, for the setup printout and the roofline."""
    prompt_lens = [len(p) for p, _ in workload]
    output_lens = [o for _, o in workload]
    return WorkloadStats(
        num_requests=len(workload),
        num_prompt_tokens=sum(prompt_lens),
        num_output_tokens=sum(output_lens),
        min_prompt_len=min(prompt_lens, default=0),
        max_prompt_len=max(prompt_lens, default=0),
        min_output_len=min(output_lens, default=0),
        max_output_len=max(output_lens, default=0),
    )


def rotated(runs: list[Any], round_index: int) -> list[Any]:
    """The run order of round `round_index` of a benchmark that runs its systems in turn,
    round after round: each round starts one system later, so that none always runs first
    on a machine that drifts."""
    shift = round_index % len(runs) if runs else 0
    return runs[shift:] + runs[:shift]
