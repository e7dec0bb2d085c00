"""`pagoda` command line: generate, chat, serve, bench (flags mirror vLLM's names)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# NOTE: this module imports nothing that loads torch at import time: `main` must set
# OpenMP up first (see pagoda/omp_env.py).


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags: EngineArgs' fields with EngineArgs' defaults."""
    from pagoda.config import EngineArgs

    EngineArgs.add_cli_args(p)


def engine_args(args: argparse.Namespace) -> Any:
    """The EngineArgs of parsed engine flags."""
    from pagoda.config import EngineArgs

    return EngineArgs.from_cli_args(args)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)


def _sampling(args: argparse.Namespace) -> Any:
    from pagoda.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda.llm import LLM

    llm = LLM(**vars(engine_args(args)))
    params = _sampling(args)
    if args.chat_template_off:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagoda.llm import LLM

    llm = LLM(**vars(engine_args(args)))
    params = _sampling(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagoda chat: type a message; /reset clears history, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        history.append({"role": "assistant", "content": reply})


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags of `pagoda serve` beyond the engine's (vLLM's names where they mean the same).

    NOTE: defined here, not in the server module, so that building the parser does not
    import the web stack.
    """
    from pagoda.config import sla_seconds_arg

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF directory or .gguf file, as --model (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to (default: the model argument)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $PAGODA_API_KEY); "
                   "NAME1=KEY1,NAME2=KEY2 gives each tenant its own key, and per-tenant "
                   "metrics labelled by NAME")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template itself) that replaces "
                   "the model's")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 while this many sequences wait (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs a request may ask (at most 20)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="default: proportionate to max_model_len (at least 1 MiB)")
    p.add_argument("--enable-debug-endpoints", action="store_true",
                   help="GET /debug/integrity and POST /debug/fault (for tests)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request this long after it arrived (HTTP 408, or "
                   "finish_reason 'timeout' in a stream); default: none")
    p.add_argument("--sla-max-queue-time", action="append", default=[], type=sla_seconds_arg,
                   metavar="CLASS=SECONDS", help="abort a request of this SLA class that "
                   "waited this long without being scheduled; repeatable")
    p.add_argument("--disable-dashboard", action="store_true",
                   help="do not serve the live page GET /dashboard")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: every log record is a JSON line, with one per request "
                   "(id, SLA class, tokens, TTFT, e2e, finish reason, error type)")


def cmd_serve(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai.server import run_server

    return run_server(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pagoda.benchmarks.serve import run_serve_bench

    report = run_serve_bench(args)
    return 0 if all(r["summary"]["num_failed"] == 0 for r in report["runs"]) else 1


# `pagoda bench NAME` that run and exit 0: NAME -> (module of pagoda/benchmarks, which
# defines add_<module>_args(parser) and run_<module>(args), help).
_BENCHES = {
    "throughput": ("throughput", "offline throughput vs transformers (and vLLM)"),
    "prefix-cache": ("prefix_cache", "shared system prompt: prefix caching on/off"),
    "parallel-sampling": ("parallel_sampling",
                          "KV memory of n samples of one prompt vs n separate requests"),
    "mixed-sla": ("mixed_sla", ("interactive requests over a batch job: TTFT and batch "
                                "throughput under fcfs and priority scheduling")),
    "multi-turn": ("multi_turn", ("multi-turn conversations evicted by other traffic: the "
                                  "prefix cache's host tier off/on")),
    "profile": ("step_profile", ("one engine step broken down by phase and op class (decode, "
                            "prefill, batch 1), with the CPU's ISA, AMX status, kernel "
                            "dispatch and what oneDNN runs")),
    "omp-policy": ("omp_policy", ("decode ms/token and batched tok/s under each OpenMP "
                                  "waiting policy, quiet and beside a busy process")),
    "quant": ("quant", ("quantization methods on SmolLM2: perplexity, weight bytes, decode "
                        "latency, throughput (and llama.cpp)")),
    "kernels": ("quant_kernels", ("quantized-linear CPU kernels per call vs bf16 and torch's "
                                  "int4 ops; --decode: SmolLM2 native GGUF decode ms/token")),
    "streaming-ppl": ("streaming_ppl", ("perplexity over a long real-text stream: dense, "
                                        "window truncation, attention sinks")),
    "long-context": ("long_context", ("8k-64k prompts on a tiny 131072-position yarn model: "
                                      "prefill, decode and KV bytes, dense / window / sinks")),
    "kv-quant": ("kv_quant", ("quantized KV cache formats: decode attention time, bytes "
                              "per token, perplexity")),
    "spec": ("spec_decode", ("speculative decoding (ngram, quantized self-draft, draft "
             "model; vLLM's ngram) vs off: tok/s, acceptance, mean accepted length")),
}


def _add_bench(bench_sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    mod = importlib.import_module(f"pagoda.benchmarks.{module}")
    p = bench_sub.add_parser(name, help=help_)
    getattr(mod, f"add_{module}_args")(p)

    def run(args: argparse.Namespace) -> int:
        getattr(mod, f"run_{module}")(args)
        return 0

    p.set_defaults(func=run)


def _add_quant_commands(sub: argparse._SubParsersAction) -> None:
    """`pagoda eval perplexity` and `pagoda quantize`."""
    from pagoda.eval.perplexity import add_perplexity_args

    ev = sub.add_parser("eval", help="model quality measurements")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser("perplexity", help="perplexity on a text, sliding windows "
                            "scored through the engine's prompt logprobs")
    add_perplexity_args(ppl)
    add_engine_args(ppl)

    def run_ppl(args: argparse.Namespace) -> int:
        from pagoda.eval.perplexity import run_perplexity

        run_perplexity(args)
        return 0

    ppl.set_defaults(func=run_ppl)

    from pagoda.quant.calibrate.command import add_quantize_args, run_quantize

    quantize = sub.add_parser("quantize", help="post-training quantization (GPTQ, AWQ, RTN) "
                              "into a GPTQ / AWQ Hugging Face checkpoint")
    add_quantize_args(quantize)
    quantize.set_defaults(func=run_quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply for each prompt")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--no-chat-template", dest="chat_template_off", action="store_true",
                     help="send the prompt as raw text instead of a chat message")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser("serve", help="latency and throughput of OpenAI-compatible "
                              "servers (pagoda, vLLM, llama.cpp) under load")
    from pagoda.benchmarks.serve import add_serve_bench_args

    add_serve_bench_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    for name, (module, help_) in _BENCHES.items():
        _add_bench(bench_sub, name, module, help_)
    _add_quant_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagoda.omp_env import apply_openmp_defaults

    apply_openmp_defaults()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
