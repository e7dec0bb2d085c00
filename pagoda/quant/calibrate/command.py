"""`pagoda quantize MODEL OUT_DIR --method gptq|awq|rtn ...`: flags and the whole run."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="HF safetensors directory (bf16/fp32) or .gguf file; omitted: the "
                   "embedded SmolLM2 GGUF")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the quantized HF directory to write")
    p.add_argument("--method", required=True, choices=["gptq", "awq", "rtn"])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale (-1: one group per output channel)")
    p.add_argument("--act-order", action="store_true",
                   help="gptq: quantize columns in decreasing Hessian diagonal (desc_act)")
    p.add_argument("--static-groups", action="store_true",
                   help="gptq: fit each group's scale/zero on the weight before any update, "
                   "groups in column order (with --act-order: g_idx stays unpermuted)")
    p.add_argument("--mse-clip", action="store_true",
                   help="gptq and rtn: search each group's range (shrink factors) for the "
                   "lowest squared error instead of min/max")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="symmetric grid (default: gptq and rtn symmetric, awq with zero point)")
    p.add_argument("--calib-data", default="calib",
                   help="a .txt or .jsonl ({\"text\": ...} lines) file, or a built-in "
                   "corpus: 'calib' (fortunes) or 'howto' (the Python HOWTOs and FAQ); "
                   "unused by rtn")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="calibration samples per forward")
    p.add_argument("--damp-percent", type=float, default=0.01,
                   help="gptq: dampening added to the Hessian's diagonal, as a fraction of "
                   "its mean")
    p.add_argument("--awq-search-tokens", type=int, default=None,
                   help="awq: calibration tokens (evenly strided) its scale search scores "
                   "(default 4096); the search's time is proportional")


def quantize_to_dir(model: str | None, out_dir: str | Path, method: str, bits: int = 4,
                    group_size: int = 128, act_order: bool = False, sym: bool | None = None,
                    calib_data: str = "calib", num_samples: int = 128, seq_len: int = 512,
                    batch_size: int = 8, damp_percent: float = 0.01,
                    loaded: tuple | None = None,
                    awq_search_tokens: int | None = None, static_groups: bool = False,
                    mse_clip: bool = False) -> tuple[Any, dict]:
    """Quantize and write OUT_DIR; returns (the in-memory quantized transformers model,
    the quantizations by linear name). `loaded`: load_float_model(model)'s result, to
    quantize (in place) instead of loading the model again. `awq_search_tokens`: None is
    runner.AWQ_SEARCH_TOKENS."""
    import torch

    from pagoda.eval.corpus import load_text
    from pagoda.quant.calibrate.export import load_float_model, write_checkpoint
    from pagoda.quant.calibrate.rtn import QuantSpec
    from pagoda.quant.calibrate.runner import (
        AWQ_SEARCH_TOKENS,
        CalibrationConfig,
        calibration_batch,
        quantize_model,
    )

    if sym is None:
        sym = method != "awq"
    # NOTE: gptq and rtn write GPTQ v1 (zeros stored minus one), AWQ its zeros as they are.
    if mse_clip and method == "awq":
        raise ValueError("mse_clip is for gptq and rtn (awq has its own clipping search)")
    spec = QuantSpec(bits, group_size, sym, min_zero=0 if method == "awq" else 1,
                     mse_clip=mse_clip)
    cfg = CalibrationConfig(method, spec, act_order, batch_size, damp_percent,
                            static_groups,
                            AWQ_SEARCH_TOKENS if awq_search_tokens is None
                            else awq_search_tokens)
    hf_model, tokenizer, source_dir = loaded or load_float_model(model)
    source_dtype = getattr(hf_model.config, "dtype", None)
    dtype = source_dtype if isinstance(source_dtype, torch.dtype) and \
        source_dtype.is_floating_point else torch.float16
    calib = None
    if method != "rtn":
        calib = calibration_batch(tokenizer, load_text(calib_data), num_samples, seq_len)
    quantized = quantize_model(hf_model, calib, cfg)
    write_checkpoint(hf_model, tokenizer, quantized, cfg, out_dir, source_dir, dtype)
    return hf_model, quantized


def run_quantize(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    _, quantized = quantize_to_dir(
        args.model, args.out_dir, args.method, args.bits, args.group_size, args.act_order,
        args.sym, args.calib_data, args.num_samples, args.seq_len, args.batch_size,
        args.damp_percent, awq_search_tokens=args.awq_search_tokens,
        static_groups=args.static_groups, mse_clip=args.mse_clip)
    print(f"{args.method}: {len(quantized)} linears quantized to {args.bits} bits "
          f"(group {args.group_size}) in {time.perf_counter() - start:.1f} s -> {args.out_dir}")
    return 0
