"""Perplexity of a model on a text, through the engine's own path (prompt logprobs).

The text is tokenized once and cut into sliding windows of `seq_len` tokens that start
`stride` tokens apart; each window is one request with `prompt_logprobs=0` and scores only
the tokens it adds past the previous window's end (the first window scores every token but
its first), so every token is scored at most once, with at least `seq_len - stride` tokens
of context before it (at stride == seq_len the token that opens a window has none and is not
scored). perplexity = exp(mean negative log
likelihood over the scored tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Window:
    """Tokens [begin, end) of the text; the last `num_scored` of them are scored."""

    begin: int
    end: int
    num_scored: int


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float
    num_tokens_scored: int
    nll_sum: float  # natural log
    num_windows: int
    seconds: float

    def summary(self) -> str:
        return (f"perplexity {self.perplexity:.4f}  tokens scored {self.num_tokens_scored}  "
                f"windows {self.num_windows}  time {self.seconds:.2f} s")


def sliding_windows(num_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """The windows over `num_tokens` tokens (see the module docstring)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text must have at least 2 tokens to score, got {num_tokens}")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + seq_len, num_tokens)
        num_scored = end - max(prev_end, begin + 1)
        windows.append(Window(begin, end, num_scored))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def tokenize_text(tokenizer: Any, text: str, max_tokens: int | None = None) -> list[int]:
    """The text's token ids as the tokenizer encodes a prompt (its own special-token rule),
    cut to the first `max_tokens` when given."""
    ids = list(tokenizer(text)["input_ids"])
    return ids if max_tokens is None else ids[:max_tokens]


def perplexity(llm: Any, token_ids: list[int], seq_len: int = 1024,
               stride: int = 512) -> PerplexityResult:
    """Perplexity of `llm` (a pagoda LLM) on `token_ids`, all windows submitted at once so
    the scheduler batches them. The model must take prompts of `seq_len` tokens."""
    from pagoda.sampling_params import SamplingParams

    windows = sliding_windows(len(token_ids), seq_len, stride)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": token_ids[w.begin : w.end]} for w in windows]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    nll_sum = 0.0
    num_scored = 0
    for w, out in zip(windows, outputs):
        entries = out.prompt_logprobs
        length = w.end - w.begin
        for p in range(length - w.num_scored, length):
            token = token_ids[w.begin + p]
            nll_sum -= entries[p][token].logprob
        num_scored += w.num_scored
    return PerplexityResult(math.exp(nll_sum / num_scored), num_scored, nll_sum,
                            len(windows), seconds)


def transformers_perplexity(model: Any, token_ids: list[int], seq_len: int = 1024,
                            stride: int = 512) -> PerplexityResult:
    """The same windows scored by a transformers causal LM in memory (the oracle, and the
    way to score a model `pagoda quantize` leaves in memory against its reloaded OUT_DIR)."""
    import torch

    windows = sliding_windows(len(token_ids), seq_len, stride)
    nll_sum = 0.0
    num_scored = 0
    start = time.perf_counter()
    for w in windows:
        ids = torch.tensor([token_ids[w.begin : w.end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        first = w.end - w.begin - w.num_scored  # the first scored position in the window
        targets = ids[0, first:]
        # NOTE: the token at position p is predicted by the logits at p - 1.
        nll_sum -= logprobs[first - 1 : -1].gather(1, targets.unsqueeze(1)).double().sum().item()
        num_scored += w.num_scored
    return PerplexityResult(math.exp(nll_sum / num_scored), num_scored, nll_sum,
                            len(windows), time.perf_counter() - start)


def add_perplexity_args(p: Any) -> None:
    """`pagoda eval perplexity` flags beyond the engine's."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF directory or .gguf file, as --model (default: the embedded model)")
    p.add_argument("--data", default="eval",
                   help="a .txt file, a .jsonl file of {\"text\": ...} lines, or a built-in "
                   "corpus: 'eval' (the Python tutorial, package python3-doc), 'howto' "
                   "(the Python HOWTOs and FAQ) or 'calib' (fortunes)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per window")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    p.add_argument("--max-eval-tokens", type=int, default=None,
                   help="score only the text's first this many tokens")


def run_perplexity(args: Any) -> PerplexityResult:
    """Load the model from the engine flags, print and return its perplexity."""
    from pagoda.entrypoints.cli import engine_args
    from pagoda.eval.corpus import load_text
    from pagoda.llm import LLM

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.max_model_len is None:
        args.max_model_len = args.seq_len + 1
    llm = LLM(**vars(engine_args(args)))
    ids = tokenize_text(llm.get_tokenizer(), load_text(args.data), args.max_eval_tokens)
    result = perplexity(llm, ids, args.seq_len, args.stride)
    print(f"model {args.model or 'embedded SmolLM2'}  data {args.data}  seq_len {args.seq_len}"
          f"  stride {args.stride}")
    print(result.summary())
    return result
