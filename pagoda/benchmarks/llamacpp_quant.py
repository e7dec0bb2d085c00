"""llama.cpp's numbers for `pagoda bench quant`, run in llama-cpp-python's own interpreter.

`python llamacpp_quant.py SPEC.json` reads {gguf, windows: [[token ids], num_scored]...,
decode_prompt, decode_tokens, threads} and prints one JSON line: perplexity and tokens
scored over the same windows pagoda scores (the same token ids: no tokenizer round trip),
and single-stream greedy decode ms/token. This file imports nothing from pagoda: that
interpreter has no torch.
"""

from __future__ import annotations

import json
import math
import sys
import time


def main(spec_path: str) -> int:
    import numpy as np
    from llama_cpp import Llama

    with open(spec_path) as f:
        spec = json.load(f)
    n_ctx = max(len(ids) for ids, _ in spec["windows"]) + spec["decode_tokens"] + 8
    llm = Llama(model_path=spec["gguf"], n_ctx=n_ctx, logits_all=True, verbose=False,
                n_threads=spec["threads"], n_batch=512)
    nll, count = 0.0, 0
    start = time.perf_counter()
    for ids, num_scored in spec["windows"]:
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        for p in range(len(ids) - num_scored, len(ids)):
            row = scores[p - 1]
            m = row.max()
            nll -= row[ids[p]] - (m + math.log(np.exp(row - m).sum()))
        count += num_scored
    ppl_s = time.perf_counter() - start

    prompt = spec["decode_prompt"]
    llm.reset()
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[len(prompt) - 1]))
    start = time.perf_counter()
    for _ in range(spec["decode_tokens"]):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode_ms = (time.perf_counter() - start) * 1000 / spec["decode_tokens"]
    print(json.dumps({"perplexity": math.exp(nll / count), "num_tokens_scored": count,
                      "ppl_seconds": ppl_s, "decode_ms_per_token": decode_ms}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
