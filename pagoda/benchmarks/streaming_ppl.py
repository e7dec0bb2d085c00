"""Perplexity over one long stream of real text: dense attention, naive window truncation,
and attention sinks (StreamingLLM) with the same cache size.

The text is the plain-text licences Debian installs in /usr/share/common-licenses (real
English prose, no download), tokenized and cut to `--num-tokens`. Each mode scores every
token with prompt logprobs in one request (chunked prefill): dense reads the whole
context; `window` keeps the last S + W tokens (S = 0: the oldest are evicted);
`sinks` keeps the first S and the last W. Printed per segment, so that a collapse once the
stream outgrows the cache (the paper's finding for window truncation) shows.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

LICENSES = Path("/usr/share/common-licenses")
TEXT_FILES = ("GPL-3", "GFDL-1.3", "Apache-2.0", "LGPL-3", "MPL-2.0", "Artistic")


def add_streaming_ppl_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--cache-tokens", type=int, default=256,
                   help="tokens the window and sink modes keep (S + W)")
    p.add_argument("--attention-sinks", type=int, default=4)
    p.add_argument("--segment", type=int, default=512, help="tokens per reported segment")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--json", default=None, help="also write the report here")


def load_text() -> str:
    parts = [(LICENSES / name).read_text() for name in TEXT_FILES if (LICENSES / name).exists()]
    if not parts:
        raise FileNotFoundError(f"no licence texts under {LICENSES}")
    return "\n\n".join(parts)


def _token_logprobs(args: argparse.Namespace, token_ids: list[int], **engine_kwargs: Any
                    ) -> tuple[list[float], float]:
    from pagoda import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=len(token_ids) + 1,
              max_num_batched_tokens=args.max_num_batched_tokens, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lps = [entry[t].logprob for t, entry in zip(token_ids[1:], out.prompt_logprobs[1:],
                                                strict=True)]
    return lps, elapsed


def _ppl(lps: list[float]) -> float:
    return math.exp(-sum(lps) / len(lps)) if lps else float("nan")


def run_streaming_ppl(args: argparse.Namespace) -> dict[str, Any]:
    from pagoda.models.loader import load_checkpoint

    tokenizer = load_checkpoint(args.model).tokenizer
    token_ids = tokenizer(load_text())["input_ids"][: args.num_tokens]
    s, cache = args.attention_sinks, args.cache_tokens
    modes = {
        "dense": {},
        "window": {"attention_sinks": 0, "streaming_window": cache},
        "sinks": {"attention_sinks": s, "streaming_window": cache - s},
    }
    print(f"# streaming perplexity: {platform.processor() or platform.machine()}, model "
          f"{args.model or 'embedded SmolLM2-135M'}, {len(token_ids)} tokens of "
          f"{LICENSES} texts, cache {cache} tokens (sinks: S={s}, W={cache - s}), "
          f"segments of {args.segment}")
    report: dict[str, Any] = {"num_tokens": len(token_ids), "cache_tokens": cache,
                              "attention_sinks": s, "modes": {}}
    for name, kwargs in modes.items():
        lps, elapsed = _token_logprobs(args, token_ids, **kwargs)
        segments = [_ppl(lps[i : i + args.segment]) for i in range(0, len(lps), args.segment)]
        report["modes"][name] = {"ppl": _ppl(lps), "ppl_past_cache": _ppl(lps[cache:]),
                                 "segments": segments, "seconds": elapsed}
        print(f"{name:>7}: ppl {_ppl(lps):8.3f}  past the cache {_ppl(lps[cache:]):8.3f}  "
              f"segments " + " ".join(f"{x:.2f}" for x in segments) + f"  ({elapsed:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return report
