"""`pagoda bench serve`: latency and throughput of OpenAI-compatible servers under load.

Any server that speaks /v1/completions or /v1/chat/completions with SSE streaming works
(pagoda, vLLM, llama.cpp). Every target gets the same seeded workload (workload.py:
random prompt token ids without special tokens, output lengths forced with `ignore_eos`,
greedy), sent at a fixed concurrency, or as a Poisson process at --request-rate (both
bound the load when both are given). Several --base-url values run one after the other
in the same run, and the table gives each target's ratio to the first one.

Per request, from the client's side: TTFT (send -> first chunk with text), ITL (gaps
between chunks with text), TPOT ((e2e - TTFT) / (output tokens - 1)), end-to-end latency.
Output tokens come from the server's usage (stream_options.include_usage) when it sends
one, else from the count of text chunks. Goodput: requests per second that met every SLA
of --goodput (vLLM's syntax, milliseconds: `ttft:2000 tpot:200 e2el:60000`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagoda.benchmarks import workload as wl_mod
from pagoda.benchmarks.serve_launch import add_launch_args, launch_specs, launched
from pagoda.benchmarks.serve_report import plot, print_setup, print_table, print_target
from pagoda.benchmarks.workload import Workload, make_workload, workload_stats

DEFAULT_NUM_PROMPTS = 64
DEFAULT_GOODPUT = ("ttft:2000", "tpot:200")
_PERCENTILES = (50, 90, 99)


def _int_pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return (int(lo), int(hi or lo))


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        nargs="+",
        default=["http://127.0.0.1:8000"],
        help="one or more servers; ratios are against the first",
    )
    p.add_argument("--label", nargs="+", default=None, help="a name per --base-url")
    p.add_argument(
        "--model",
        default=None,
        help="model name in requests (default: each server's first /v1/models id)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder or .gguf whose vocabulary the prompts use (default: embedded)",
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument(
        "--prompt-format",
        choices=["tokens", "text"],
        default="tokens",
        help="send prompt token ids (exact lengths) or their decoded text; chat always sends text",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"default {DEFAULT_NUM_PROMPTS} ({wl_mod.QUICK_NUM_REQUESTS} quick)",
    )
    p.add_argument(
        "--input-len",
        type=_int_pair,
        default=None,
        metavar="MIN,MAX",
        help="prompt lengths (default 100,1024; quick 32,128)",
    )
    p.add_argument(
        "--output-len",
        type=_int_pair,
        default=None,
        metavar="MIN,MAX",
        help="output lengths (default 100,1024; quick 32,128)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="every request's temperature (default 0: greedy; the OpenAI API's "
                        "default is 1)")
    p.add_argument("--top-p", type=_top_p, default=1.0,
                   help="every request's top_p (default 1: off)")
    p.add_argument("--quick", action="store_true", help="a small smoke-sized workload")
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 8, 32],
        metavar="N,N,...",
        help="the most requests in flight; one run per value",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: all at once)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=list(DEFAULT_GOODPUT),
        metavar="KEY:MS",
        help="SLA for goodput: ttft, tpot, e2el in milliseconds",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let end-of-sequence stop requests early (lengths then vary)",
    )
    p.add_argument("--api-key", default=None, help="default: $PAGODA_API_KEY or $OPENAI_API_KEY")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--num-warmup", type=int, default=2, help="untimed requests per target")
    p.add_argument("--output-json", default=None)
    p.add_argument("--save-detailed", action="store_true",
                   help="--output-json also holds every request: when it was sent (s from the "
                   "run's start), TTFT, end-to-end latency, gaps between chunks, lengths, error")
    p.add_argument("--plot", default=None, help="write a PNG of the results here")
    p.add_argument("--workload", choices=sorted(wl_mod.WORKLOAD_PRESETS), default=None,
                   help="a named workload (short: 64 x 26-254 / 16-127; long: 256 x "
                   "100-1024 / 100-1023); explicit length flags override it")
    add_launch_args(p)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    expected_output_len: int
    output_len: int = 0
    start: float = 0.0  # seconds from the run's start to the send (after the concurrency wait)
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`["ttft:2000", "tpot:200"]` -> {"ttft": 2.0, "tpot": 0.2} (seconds)."""
    sla = {}
    for item in items:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS, e2el:MS; got {item!r}")
        sla[key] = float(ms) / 1000
    return sla


def _temperature(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"temperature must be in [0, 2], got {text}")
    return value


def _top_p(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"top_p must be in (0, 1], got {text}")
    return value


def _payload(
    args: argparse.Namespace, model: str, prompt: list[int], text: str | None, max_tokens: int
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.top_p < 1.0:
        body["top_p"] = args.top_p
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text if args.prompt_format == "text" else prompt
    return "/v1/completions", body


async def _send(client: Any, path: str, body: dict[str, Any], result: RequestResult,
                run_start: float = 0.0) -> None:
    """Streams one request into `result` (never raises: failures are recorded)."""
    start = time.perf_counter()
    result.start = start - run_start if run_start else 0.0
    last, num_chunks, usage = None, 0, None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return
                usage = chunk.get("usage") or usage
                if not _chunk_text(chunk):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                num_chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"
        return
    result.e2e = time.perf_counter() - start
    result.output_len = (usage or {}).get("completion_tokens") or num_chunks
    result.ok = last is not None


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    texts: list[str | None],
    concurrency: int,
    args: argparse.Namespace,
) -> tuple[list[RequestResult], float]:
    """Sends the workload; returns per-request results and the wall time of the run."""
    import httpx

    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=base_url, timeout=args.timeout, limits=limits, headers=headers
    ) as client:
        for (prompt, out_len), text in list(zip(workload, texts))[: args.num_warmup]:
            await _send(
                client,
                *_payload(args, model, prompt[:16], text and text[:64], min(out_len, 4)),
                RequestResult(False, 0, 0),
            )

        async def one(i: int) -> RequestResult:
            prompt, out_len = workload[i]
            result = RequestResult(False, len(prompt), out_len)
            async with sem:
                await _send(client, *_payload(args, model, prompt, texts[i], out_len), result,
                            start)
            return result

        tasks = []
        start = time.perf_counter()
        for i in range(len(workload)):
            tasks.append(asyncio.create_task(one(i)))
            if args.request_rate != float("inf") and i + 1 < len(workload):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def detailed(results: list[RequestResult]) -> list[dict[str, Any]]:
    """One record per request, in workload order (--save-detailed): times in ms but `start_s`."""
    return [{"start_s": r.start, "ok": r.ok, "prompt_len": r.prompt_len,
             "expected_output_len": r.expected_output_len, "output_len": r.output_len,
             "ttft_ms": r.ttft * 1000 if r.ok else None, "e2e_ms": r.e2e * 1000 if r.ok else None,
             "itl_ms": [x * 1000 for x in r.itls], "error": r.error} for r in results]


def _dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in _PERCENTILES}}
    arr = np.asarray(values) * 1000
    return {
        "mean": float(arr.mean()),
        **{f"p{q}": float(np.percentile(arr, q)) for q in _PERCENTILES},
    }


def summarize(
    results: list[RequestResult], elapsed: float, sla: dict[str, float]
) -> dict[str, Any]:
    """Latency distributions (ms), throughput and goodput of one run."""
    ok = [r for r in results if r.ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]

    def meets(r: RequestResult) -> bool:
        t = r.tpot if r.tpot is not None else 0.0
        return (
            r.ttft <= sla.get("ttft", float("inf"))
            and t <= sla.get("tpot", float("inf"))
            and r.e2e <= sla.get("e2el", float("inf"))
        )

    num_output = sum(r.output_len for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_failed": len(errors),
        "first_errors": errors[:3],
        "num_short": sum(r.output_len < r.expected_output_len for r in ok),
        "elapsed_s": elapsed,
        "num_prompt_tokens": sum(r.prompt_len for r in ok),
        "num_output_tokens": num_output,
        "output_tokens_per_s": num_output / elapsed,
        "requests_per_s": len(ok) / elapsed,
        "goodput_requests_per_s": sum(meets(r) for r in ok) / elapsed,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "itl_ms": _dist([x for r in ok for x in r.itls]),
        "tpot_ms": _dist(tpots),
        "e2e_ms": _dist([r.e2e for r in ok]),
    }


async def _server_info(base_url: str, api_key: str | None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info: dict[str, Any] = {"base_url": base_url}
    async with httpx.AsyncClient(base_url=base_url, timeout=30, headers=headers) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        models = r.json().get("data") or []
        info["models"] = [m.get("id") for m in models]
        info["max_model_len"] = models[0].get("max_model_len") if models else None
        try:
            v = await client.get("/version")
            info["version"] = v.json().get("version") if v.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info["version"] = None
    return info


def _workload_shape(args: argparse.Namespace) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(num prompts, prompt lengths, output lengths): explicit flags, else --workload, else
    --quick's or the full-size defaults."""
    quick = args.quick
    preset = wl_mod.WORKLOAD_PRESETS.get(args.workload or "")
    num = args.num_prompts or (preset[0] if preset else
                               wl_mod.QUICK_NUM_REQUESTS if quick else DEFAULT_NUM_PROMPTS)
    in_len = args.input_len or (preset[1] if preset else
                                wl_mod.QUICK_INPUT_LEN if quick else wl_mod.DEFAULT_INPUT_LEN)
    out_len = args.output_len or (preset[2] if preset else
                                  wl_mod.QUICK_OUTPUT_LEN if quick else wl_mod.DEFAULT_OUTPUT_LEN)
    return num, in_len, out_len


def _targets(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(label, context manager yielding the base URL) per target, in run order."""
    if args.launch:
        return [(spec.label, launched(spec, args.launch_timeout))
                for spec in launch_specs(args)]
    labels = args.label or [u.split("//")[-1] for u in args.base_url]
    if len(labels) != len(args.base_url):
        raise ValueError("give one --label per --base-url")
    return [(label, contextlib.nullcontext(url)) for label, url in zip(labels, args.base_url)]


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Runs every (target, concurrency); prints setup and table; returns the report."""
    from pagoda.benchmarks.hf_baseline import load_tokenizer, resolve_model
    from pagoda.benchmarks.roofline import describe_machine

    num, in_len, out_len = _workload_shape(args)
    args.api_key = (
        args.api_key or os.environ.get("PAGODA_API_KEY") or os.environ.get("OPENAI_API_KEY")
    )
    sla = parse_goodput(args.goodput)
    if args.save_detailed and not args.output_json:
        raise ValueError("--save-detailed writes into --output-json: give one")
    targets = _targets(args)
    src = resolve_model(args.tokenizer or (args.launch_model if args.launch else None))
    tokenizer = load_tokenizer(src)
    workload = make_workload(num, in_len, out_len, args.seed, tokenizer=tokenizer)
    as_text = args.endpoint == "chat" or args.prompt_format == "text"
    texts = [tokenizer.decode(p) if as_text else None for p, _ in workload]
    setup = {
        "machine": describe_machine(),
        "tokenizer": src.label,
        "endpoint": args.endpoint,
        "prompt_format": "text" if as_text else "tokens",
        "seed": args.seed,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "workload_preset": args.workload,
        "input_len": list(in_len),
        "output_len": list(out_len),
        "workload": asdict(workload_stats(workload)),
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "ignore_eos": not args.no_ignore_eos,
        "goodput_sla_s": sla,
        "targets": {},
    }
    print_setup(setup)
    runs = []
    for label, server in targets:
        with server as url:
            info = asyncio.run(_server_info(url, args.api_key))
            setup["targets"][label] = info
            print_target(label, info)
            model = args.model or (info["models"] or [None])[0]
            for conc in args.concurrency:
                print(f"-- {label}: concurrency {conc} ...", flush=True)
                results, elapsed = asyncio.run(run_load(url, model, workload, texts, conc, args))
                run = {"label": label, "base_url": url, "model": model,
                       "concurrency": conc, "summary": summarize(results, elapsed, sla)}
                if args.save_detailed:
                    run["requests"] = detailed(results)
                runs.append(run)
    print_table(runs)
    report = {"setup": setup, "runs": runs}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return report
