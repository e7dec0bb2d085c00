"""Long prompts on a tiny long-context model: prefill time, decode ms/token and KV bytes for
dense attention, a sliding window and attention sinks (and a KV cache dtype, e.g. int8/fp8
where pagoda has it, through --kv-cache-dtype).

The model is random (seeded) with a long-context shape: 131072 positions, yarn rope
scaling (factor 4 over 32768), the embedded SmolLM2 tokenizer's vocabulary; saved with
transformers' save_pretrained into a temporary folder. The window mode is the same model as
Mistral with `sliding_window` = --window (every layer windowed); the sinks mode is the
Llama model with --attention-sinks S and --streaming-window W - S. One request at a time,
no prefix caching. KV bytes = the peak blocks held x bytes per block over every layer.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("dense", "window", "sinks")


def add_long_context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", default="8192,32768,65536",
                   help="comma-separated prompt lengths in tokens")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--window", type=int, default=4096,
                   help="tokens the window and sinks modes keep")
    p.add_argument("--attention-sinks", type=int, default=4)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report here")


def build_model_dir(out: Path, arch: str, args: argparse.Namespace) -> Path:
    """A random long-context model of `arch` (Llama or Mistral) saved in `out`."""
    import torch
    import transformers

    from pagoda.models.loader import default_model_path

    gguf = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    heads = max(args.hidden_size // 64, 1)
    kwargs: dict[str, Any] = {
        "hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 2, 1), "head_dim": 64,
        "intermediate_size": 2 * args.hidden_size, "vocab_size": len(tokenizer),
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 32768},
    }
    if arch == "MistralForCausalLM":
        kwargs["sliding_window"] = args.window
    config = transformers.AutoConfig.for_model(
        "mistral" if arch == "MistralForCausalLM" else "llama", **kwargs)
    config.architectures = [arch]
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def measure(path: Path, prompt: list[int], args: argparse.Namespace,
            **engine_kwargs: Any) -> dict[str, Any]:
    """Prefill seconds (to the first token), decode ms per token, peak KV blocks and bytes."""
    from pagoda import EngineArgs, SamplingParams
    from pagoda.engine.llm_engine import LLMEngine

    ea = EngineArgs(model=str(path), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                    max_model_len=len(prompt) + args.decode_tokens + 1, max_num_seqs=1,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_prefix_caching=False, seed=args.seed, **engine_kwargs)
    engine = LLMEngine(ea.create_engine_config())
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    req = engine.scheduler.requests["r"]
    start = time.perf_counter()
    while req.num_output_tokens == 0:
        engine.step()
    first = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    end = time.perf_counter()
    kv = engine.kv_cache_manager
    return {
        "prefill_s": first - start,
        "decode_ms_per_token": 1000 * (end - first) / args.decode_tokens,
        "peak_kv_blocks": kv.peak_num_used_blocks,
        "kv_bytes": kv.peak_num_used_blocks * engine.kv_block_bytes,
    }


def run_long_context(args: argparse.Namespace) -> dict[str, Any]:
    lens = [int(x) for x in args.prompt_lens.split(",")]
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; known: {MODES}")
    rng = random.Random(args.seed)
    report: dict[str, Any] = {"setup": vars(args).copy(), "runs": []}
    print(f"# long-context: {platform.processor() or platform.machine()}, random "
          f"{args.num_layers}-layer hidden {args.hidden_size} head_dim 64 model, 131072 "
          f"positions, yarn x4; dtype {args.dtype}, kv {args.kv_cache_dtype}; window "
          f"{args.window}, sinks {args.attention_sinks}; prompts {lens}, "
          f"{args.decode_tokens} decode tokens, seed {args.seed}")
    with tempfile.TemporaryDirectory(prefix="pagoda-long-context-") as tmp:
        llama = build_model_dir(Path(tmp) / "llama", "LlamaForCausalLM", args)
        mistral = build_model_dir(Path(tmp) / "mistral", "MistralForCausalLM", args)
        mode_setup = {
            "dense": (llama, {}),
            "window": (mistral, {}),
            "sinks": (llama, {"attention_sinks": args.attention_sinks,
                              "streaming_window": args.window - args.attention_sinks}),
        }
        print(f"{'mode':>7} {'prompt':>7} {'prefill s':>10} {'decode ms/tok':>14} "
              f"{'KV blocks':>10} {'KV MiB':>8}")
        for n in lens:
            prompt = [rng.randrange(3, 49152) for _ in range(n)]
            for mode in modes:
                path, kwargs = mode_setup[mode]
                row = {"mode": mode, "prompt_len": n, **measure(path, prompt, args, **kwargs)}
                report["runs"].append(row)
                print(f"{mode:>7} {n:>7} {row['prefill_s']:>10.2f} "
                      f"{row['decode_ms_per_token']:>14.2f} {row['peak_kv_blocks']:>10} "
                      f"{row['kv_bytes'] / 2**20:>8.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return report
