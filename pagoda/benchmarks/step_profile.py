"""`pagoda bench profile`: where one engine step's time goes, on this CPU.

NOTE: not named profile.py: vllm_peer.py runs as a script from this folder, which puts
the folder first on sys.path, where a profile.py would shadow the standard library's.

Cases (each one engine, prefix caching off, greedy, ignore_eos; the steps are timed after
a warm-up step that also records the dispatch):
- decode: `--num-seqs` sequences (64) at `--context-len` tokens of context (1,000): their
  prompts are prefilled untimed, then `--steps` decode steps are timed;
- prefill: steps of `--prefill-tokens` new tokens (2,048) over `--prefill-seqs` fresh
  prompts, each request sampling its one token in that step;
- single: batch-1 decode (context `--single-context-len`), beside the weight-bandwidth
  floor (the bytes of weights a step reads / the measured read bandwidth). Its one-call
  figure is the median of `--single-steps` steps (200): a step takes a few ms, and on a
  host whose memory bandwidth drifts a mean of five was off by 10-20% from run to run.
  Decode bursts are off for those steps; then `--single-steps` more tokens run with them
  (the engine's `decode_burst`, where the model runs bursts): the median of each step's ms
  per token.

Each step is broken down by phase (step_timer.py): scheduling, input preparation, the
forward by op class (GEMMs, attention, fused ops, other), lm_head, sampling, output
processing, detokenization. The report also prints the CPU model, the ISA flags that
decide the kernels, the AMX tile request's status, the OpenMP setting, which kernel each
op dispatched to, the GEMMs' quant method and weight packing, and what oneDNN runs for
those GEMMs (onednn_probe.py: its ISA and the packed weight layout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from pagoda.benchmarks.step_timer import PHASES, StepInstrumentation

DEFAULT_NUM_SEQS = 64
DEFAULT_CONTEXT_LEN = 1000
DEFAULT_PREFILL_TOKENS = 2048
DEFAULT_STEPS = 5
DEFAULT_SINGLE_STEPS = 200
SECTIONS = ("machine", "decode", "prefill", "single", "dispatch", "onednn")


def add_step_profile_args(p: argparse.ArgumentParser) -> None:
    """The flags of `pagoda bench profile`."""
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--gguf-native", choices=["auto", "on", "off"], default="auto",
                   help="a GGUF model's linears from their blocks or dequantized at load")
    p.add_argument("--num-seqs", type=int, default=DEFAULT_NUM_SEQS)
    p.add_argument("--context-len", type=int, default=DEFAULT_CONTEXT_LEN)
    p.add_argument("--prefill-tokens", type=int, default=DEFAULT_PREFILL_TOKENS)
    p.add_argument("--prefill-seqs", type=int, default=1)
    p.add_argument("--single-context-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps per case")
    p.add_argument("--single-steps", type=int, default=DEFAULT_SINGLE_STEPS,
                   help="batch-1 steps run in one call, timed one by one (their median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-onednn", action="store_true", help="skip the ONEDNN_VERBOSE probe")
    p.add_argument("--no-bandwidth", action="store_true",
                   help="skip measuring read bandwidth (no floor for the single case)")
    p.add_argument("--output-json", default=None)


def _budget(args: argparse.Namespace) -> int:
    """The engine's token budget: room for the prefill case's step, and never below the
    default's, or the decode case's untimed prefill of `num_seqs * context_len` tokens
    would take that many more steps (and its sequences that many more output tokens:
    `--prefill-tokens 16` with 128 x 840 asked for a max_model_len past the model's)."""
    return max(args.prefill_tokens, DEFAULT_PREFILL_TOKENS)


def _decode_max_tokens(args: argparse.Namespace) -> int:
    """Enough output tokens that no sequence finishes before the timed steps end: the
    first prompts prefilled decode while later ones still prefill."""
    prefill_steps = -(-args.num_seqs * args.context_len // _budget(args)) + 1
    return prefill_steps + 2 * args.steps + 2  # NOTE: timed, then the one-call steps


def _engine(args: argparse.Namespace) -> Any:
    from pagoda import LLM

    per_prefill = -(-args.prefill_tokens // args.prefill_seqs)
    max_len = max(args.context_len + _decode_max_tokens(args), per_prefill + 1,
                  args.single_context_len + args.steps + 2 * args.single_steps + 8)
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, enable_prefix_caching=False,
              gguf_native=args.gguf_native,
              max_num_seqs=max(args.num_seqs, args.prefill_seqs),
              max_num_batched_tokens=_budget(args), max_model_len=-(-max_len // 16) * 16)
    return llm.llm_engine


def _prompts(engine: Any, num: int, length: int, seed: int) -> list[list[int]]:
    from pagoda.benchmarks.workload import make_workload

    return [p for p, _ in make_workload(num, (length, length), (1, 1), seed,
                                        tokenizer=engine.tokenizer)]


def _add(engine: Any, tag: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    from pagoda import SamplingParams
    from pagoda.engine.output_processor import OutputKind

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params,
                           output_kind=OutputKind.FINAL_ONLY)
    return ids


def _summary(inst: StepInstrumentation, num_steps: int) -> dict[str, Any]:
    """Per-step milliseconds by phase, their total and the tokens per step."""
    ms = {phase: 1000 * s / num_steps for phase, s in inst.clock.seconds.items()}
    step_ms = sum(ms.values())
    tokens = inst.num_scheduled_tokens[-num_steps:]
    mean_tokens = sum(tokens) / max(len(tokens), 1)
    return {"phases_ms": ms, "step_ms": step_ms, "tokens_per_step": mean_tokens,
            "tokens_per_s": 1000 * mean_tokens / step_ms if step_ms else 0.0,
            "num_steps": num_steps}


def _timed_steps(engine: Any, inst: StepInstrumentation, steps: int) -> dict[str, Any]:
    """One warm-up step (recording dispatch, not timed), then `steps` timed ones."""
    inst.record_dispatch = True
    engine.step()
    inst.record_dispatch = False
    inst.clock.reset()
    for _ in range(steps):
        engine.step()
    return _summary(inst, steps)


def profile_decode(engine: Any, inst: StepInstrumentation, num_seqs: int, context_len: int,
                   steps: int, seed: int, tag: str, max_tokens: int,
                   one_call_steps: int | None = None,
                   burst_tokens: int = 0) -> dict[str, Any]:
    """`steps` decode steps of `num_seqs` sequences at about `context_len` tokens, then
    `one_call_steps` (default `steps`) more as the engine runs them, each timed: their
    median is `one_call_step_ms`. Decode bursts are off for those; then, where the engine
    runs them (one request: the batch-1 case), `burst_tokens` more tokens with them on: the median over
    those steps of each one's ms per token (`burst_ms_per_token`)."""
    ids = _add(engine, tag, _prompts(engine, num_seqs, context_len, seed), max_tokens)
    sched = engine.scheduler
    # NOTE: a burst is several steps in one call: the per-step figures are one step each.
    burst, sched.decode_burst = sched.decode_burst, 1
    try:
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in sched.running):
            engine.step()
        with inst:
            result = _timed_steps(engine, inst, steps)
        result.update(num_seqs=num_seqs, context_len=context_len)
        stack = engine.executor.worker.model.fused_stack()
        if stack is not None:
            # NOTE: the timed steps ran layer by layer (step_timer.py); the same number of
            # steps again, untimed inside, as the engine runs them: decode in one call.
            n = one_call_steps or steps
            before, times = stack.decode_steps, []
            for _ in range(n):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            if stack.decode_steps - before == n:
                result["one_call_step_ms"] = 1000 * statistics.median(times)
                result["one_call_steps"] = n
    finally:
        sched.decode_burst = burst
    result["decode_burst"] = burst
    if burst_tokens and burst > 1 and len(sched.running) == 1:
        # NOTE: per step its ms per token; their median, as the one-call figure's.
        req, per_token = sched.running[0], []
        first = req.num_output_tokens
        while req.num_output_tokens - first < burst_tokens and not req.is_finished:
            before, start = req.num_output_tokens, time.perf_counter()
            engine.step()
            per_token.append((time.perf_counter() - start) / (req.num_output_tokens - before))
        result.update(burst_ms_per_token=1000 * statistics.median(per_token),
                      burst_tokens=req.num_output_tokens - first, burst_steps=len(per_token))
    engine.abort_request(ids)
    return result


def profile_prefill(engine: Any, inst: StepInstrumentation, num_tokens: int, num_seqs: int,
                    steps: int, seed: int) -> dict[str, Any]:
    """Steps of `num_tokens` new tokens: fresh prompts each step, each sampling once."""
    length = num_tokens // num_seqs
    with inst:
        inst.record_dispatch = True
        for i in range(steps + 1):
            if i == 1:
                inst.record_dispatch = False
                inst.clock.reset()
            _add(engine, f"p{i}-", _prompts(engine, num_seqs, length, seed + i), 1)
            engine.step()
            while engine.has_unfinished_requests():  # NOTE: none left if one step took all
                engine.step()
    result = _summary(inst, steps)
    result.update(num_seqs=num_seqs, prompt_len=length)
    return result


def weight_bytes_read_per_step(model: Any) -> int:
    """The weight bytes one decode step reads, as the model holds them (a quantized weight
    counts its kernel layout's bytes, not the dtype's): every weight tensor less those a
    step reads a row of, an untied input embedding and the rotary tables. A kernel's
    scales kept outside its layout are not counted (a few % of a group-quantized weight)."""
    from pagoda.benchmarks.quant import weight_bytes

    total = weight_bytes(model, as_read=True)
    for module in model.modules():
        if "Rotary" in type(module).__name__:
            total -= weight_bytes(module, as_read=True)
    if not model.spec.tie_word_embeddings:
        total -= weight_bytes(model.model.embed_tokens, as_read=True)
    return total


def _weight_floor(engine: Any) -> dict[str, Any]:
    from pagoda.benchmarks import roofline as rl

    num_bytes = weight_bytes_read_per_step(engine.executor.worker.model)
    bandwidth = rl.measure_read_bandwidth(max(1 << 28, min(1 << 30, 4 * num_bytes)))
    return {"weight_bytes": num_bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
            "floor_ms": 1000 * num_bytes / bandwidth}


def gemm_dispatch(engine: Any) -> dict[str, str]:
    """Per projection (qkv_proj, o_proj, ..., lm_head): its quant method and weight path."""
    from pagoda.layers.linear import LinearBase
    from pagoda.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    model, seen = engine.executor.worker.runner.model, {}
    for name, module in model.named_modules():
        if isinstance(module, ParallelLMHead):
            key, weight = "lm_head", getattr(module, "weight", None)
        elif isinstance(module, VocabParallelEmbedding):
            if not getattr(module, "computes_logits", False):
                continue  # NOTE: a lookup table, no GEMM
            key, weight = "lm_head", getattr(module, "packed_logits_weight", None)
        elif isinstance(module, LinearBase):
            key, weight = name.rsplit(".", 1)[-1], getattr(module, "weight", None)
        else:
            continue
        path = "oneDNN packed weight" if getattr(weight, "is_mkldnn", False) else "dense weight"
        seen.setdefault(key, f"{type(module.quant_method).__name__}, {path}")
    return seen


def machine_section() -> dict[str, Any]:
    import torch

    from pagoda.cpu_features import cpu_info, isa_report, request_amx_tiles

    amx = request_amx_tiles()
    return {
        "cpu": cpu_info()[0], "num_cpus": os.cpu_count(), "isa": isa_report(),
        "amx": {"usable": amx.usable, "reason": amx.reason},
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "openmp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                      "OMP_NUM_THREADS")},
    }


def _kv_prefetch() -> str | None:
    """Where decode attention's K/V prefetches land in this process, and why."""
    from pagoda.cpu_features import cpu_vendor
    from pagoda.ops import cpu_kernels

    ext = cpu_kernels.kernel_for("paged_attention")
    if ext is None:
        return None
    level = "L2" if ext.kv_prefetch_l2() else "L1"
    return f"{level} (PAGODA_KV_PREFETCH={cpu_kernels.kv_prefetch_mode()}, {cpu_vendor()})"


def run_step_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Run every case; print the report; return it (the keys of SECTIONS)."""
    from pagoda.benchmarks.onednn_probe import probe
    from pagoda.benchmarks.profile_report import print_report
    from pagoda.ops import gemm_dispatch as wide_gemm

    engine = _engine(args)
    inst = StepInstrumentation(engine)
    report: dict[str, Any] = {"machine": machine_section(), "model": engine.model_path,
                              "dtype": args.dtype,
                              "gguf_native": args.gguf_native}
    report["decode"] = profile_decode(engine, inst, args.num_seqs, args.context_len,
                                      args.steps, args.seed, "d", _decode_max_tokens(args))
    report["prefill"] = profile_prefill(engine, inst, args.prefill_tokens, args.prefill_seqs,
                                        args.steps, args.seed)
    report["single"] = profile_decode(engine, inst, 1, args.single_context_len, args.steps,
                                      args.seed, "s", args.steps + 2 * args.single_steps + 3,
                                      args.single_steps, burst_tokens=args.single_steps)
    if not args.no_bandwidth:
        floor = _weight_floor(engine)
        single = report["single"]
        floor["ratio"] = single.get("one_call_step_ms", single["step_ms"]) / floor["floor_ms"]
        if "burst_ms_per_token" in single:
            floor["burst_ratio"] = single["burst_ms_per_token"] / floor["floor_ms"]
        report["single"]["weight_floor"] = floor
    report["dispatch"] = {"ops": {k: sorted(v) for k, v in sorted(inst.dispatch.items())},
                          "gemms": gemm_dispatch(engine),
                          "fused_layers": engine.executor.worker.model.fused_stack() is not None,
                          "attention_backend": engine.config.model.attn_backend,
                          "wide_bf16_gemm": wide_gemm.probe_report() or None,
                          "kv_prefetch": _kv_prefetch()}
    spec = engine.executor.worker.model.spec
    shapes = [((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, spec.hidden_size),
              (spec.hidden_size, spec.num_heads * spec.head_dim),
              (2 * spec.intermediate_size, spec.hidden_size),
              (spec.hidden_size, spec.intermediate_size)]
    report["onednn"] = ({"skipped": "--no-onednn"} if args.no_onednn
                        else probe(shapes, args.dtype))
    print_report(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report


__all__ = ["PHASES", "SECTIONS", "add_step_profile_args", "run_step_profile"]
