"""Memory soak of a real `pagoda serve`: RSS growth per 1,000 requests on a warm server.

Starts the server on 127.0.0.1 (debug endpoints on), reports the KV pool's resident size
(torch.zeros writes it, so it is resident from the start; the figure says so or not),
runs a warm-up, then random requests for --minutes: completions and chat, mixed prompt and
output lengths, streamed or not, n up to 3, some seeded, some with logprobs, some sharing a
prefix (prefix-cache hits), a share abandoned part-way (a closed connection = an abort).
Samples /debug/memory every --sample-s seconds, prints the series and the growth per 1,000
requests (least-squares slope of RSS over requests done, and last minus first), and ends
with /debug/integrity: ok, no orphan, no block in use. Exit 1 if the engine is not clean
or a request failed unexpectedly.

    .venv/bin/python scripts/soak_memory.py --minutes 20 [--model X.gguf] [-- serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "river", "ran", "past", "a", "quiet", "town", "where", "people", "told",
         "old", "stories", "of", "kings,", "storms,", "ships", "and", "strange", "lights",
         "over", "distant", "hills", "every", "winter", "night"]
PREFIXES = [" ".join(random.Random(i).choices(WORDS, k=160)) for i in range(4)]


@dataclass
class Tally:
    done: int = 0
    ok: int = 0
    abandoned: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < 10:
            self.failures.append(what[:300])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    model = [args.model] if args.model else []
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "soak",
           "--enable-debug-endpoints", "--disable-uvicorn-access-log",
           "--max-num-seqs", str(args.max_num_seqs), *args.serve_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_path.open("w"),
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"server did not start; see {log_path}")


def random_body(rng: random.Random, max_prompt_words: int,
                max_output_tokens: int) -> tuple[str, dict]:
    """One random request: (path, body)."""
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, max_prompt_words)))
    if rng.random() < 0.3:
        text = rng.choice(PREFIXES) + " " + text
    body: dict = {"model": "soak", "max_tokens": rng.randint(1, max_output_tokens), "ignore_eos": True,
                  "n": rng.choice((1, 1, 1, 2, 3)), "stream": rng.random() < 0.5,
                  "temperature": rng.choice((0.0, 0.8))}
    if rng.random() < 0.2:
        body["seed"] = rng.randrange(2 ** 31)
    if rng.random() < 0.5:
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 3)
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                      args: argparse.Namespace) -> None:
    path, body = random_body(rng, args.max_prompt_words, args.max_output_tokens)
    abandon_after = rng.randint(0, 8) if rng.random() < 0.2 else None
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    tally.fail(f"{r.status_code} {(await r.aread())[:200]!r}")
                    return
                num_events = 0
                async for line in r.aiter_lines():
                    num_events += line.startswith("data: ")
                    if abandon_after is not None and num_events > abandon_after:
                        tally.abandoned += 1
                        return  # NOTE: leaving the block closes the connection: an abort
                    if '"error"' in line:
                        tally.fail(line)
                        return
        elif abandon_after is not None:
            try:
                await asyncio.wait_for(client.post(path, json=body),
                                       timeout=0.05 * (abandon_after + 1))
            except TimeoutError:
                tally.abandoned += 1
                return
        else:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                tally.fail(f"{r.status_code} {r.text[:200]}")
                return
        tally.ok += 1
    except httpx.HTTPError as exc:
        tally.fail(f"{type(exc).__name__}: {exc}")
    finally:
        tally.done += 1


async def memory(client: httpx.AsyncClient, trim: bool = False) -> dict:
    r = await client.get("/debug/memory", params={"trim": "true"} if trim else None,
                         timeout=120.0)
    r.raise_for_status()
    return r.json()


async def run_load(url: str, args: argparse.Namespace, tally: Tally, until: float) -> None:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < until:
                await one_request(client, rng, tally, args)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


async def soak(url: str, args: argparse.Namespace) -> tuple[list[dict], Tally]:
    """Warm-up, then the measured soak; returns the samples (t_s, requests, memory)."""
    tally = Tally()
    start = time.monotonic()
    end = start + 60 * (args.warmup_minutes + args.minutes)
    load = asyncio.create_task(run_load(url, args, tally, end))
    samples: list[dict] = []
    async with httpx.AsyncClient(base_url=url) as client:
        await asyncio.sleep(60 * args.warmup_minutes)
        while True:
            mem = await memory(client)
            sample = {"t_s": round(time.monotonic() - start), "requests": tally.done, **mem}
            samples.append(sample)
            print(f"t={sample['t_s']:>5} s  requests={tally.done:>6}  "
                  f"rss={mem['rss_bytes'] / 2**20:8.1f} MiB  "
                  f"py_objects={mem['num_py_objects']}", flush=True)
            if time.monotonic() >= end or load.done():
                break
            await asyncio.sleep(min(args.sample_s, max(end - time.monotonic(), 0.1)))
    await load
    return samples, tally


def growth_per_1000(samples: list[dict], key: str = "rss_bytes",
                    unit: float = 2 ** 20) -> tuple[float, float]:
    """Growth of `key` in `unit`s per 1,000 requests: (least-squares slope, last - first)."""
    xs = [s["requests"] for s in samples]
    ys = [s[key] / unit for s in samples]
    if len(xs) < 2 or xs[-1] == xs[0]:
        return 0.0, 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 1000 * slope, 1000 * (ys[-1] - ys[0]) / (xs[-1] - xs[0])


def final_checks(url: str) -> tuple[dict, dict]:
    """Waits for the engine to drain; its integrity report and memory after malloc_trim."""
    with httpx.Client(base_url=url, timeout=120.0) as client:
        deadline = time.monotonic() + 120
        while True:
            report = client.get("/debug/integrity").json()
            if report["num_unfinished"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        trimmed = client.get("/debug/memory", params={"trim": "true"}).json()
    return report, trimmed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--warmup-minutes", type=float, default=1.0)
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-prompt-words", type=int, default=400)
    p.add_argument("--max-output-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, default=Path("soak_server.log"))
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("serve_args", nargs="*", help="more `pagoda serve` flags, after --")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, url = start_server(args, args.log)
    try:
        first = httpx.get(url + "/debug/memory", timeout=60).json()
        print(f"KV pool: {first['kv_pool_bytes'] / 2**20:.1f} MiB, resident "
              f"{first['kv_pool_resident_bytes'] / 2**20:.1f} MiB; RSS at start "
              f"{first['rss_bytes'] / 2**20:.1f} MiB", flush=True)
        samples, tally = asyncio.run(soak(url, args))
        report, trimmed = final_checks(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    slope, overall = growth_per_1000(samples)
    # NOTE: the first minutes fill the capped caches; the second half says whether RSS
    # is still rising.
    late_slope, _ = growth_per_1000(samples[len(samples) // 2:])
    py_slope, _ = growth_per_1000(samples, "num_py_objects", unit=1)
    print(f"requests: {tally.done} ({tally.ok} ok, {tally.abandoned} abandoned, "
          f"{tally.failed} failed) in {args.minutes:g} min after {args.warmup_minutes:g} "
          f"min warm-up, concurrency {args.concurrency}")
    print(f"RSS growth per 1,000 requests: {slope:+.1f} MiB (least squares), "
          f"{overall:+.1f} MiB (last - first), {late_slope:+.1f} MiB over the second half "
          f"(least squares); Python objects {py_slope:+.0f} "
          f"per 1,000; RSS after malloc_trim at the end "
          f"{trimmed['rss_after_trim_bytes'] / 2**20:.1f} MiB "
          f"(before {trimmed['rss_bytes'] / 2**20:.1f})")
    print(f"integrity: {json.dumps(report)}")
    for f in tally.failures:
        print(f"failure: {f}")
    clean = (report["ok"] and report["num_orphans"] == 0 and report["num_unfinished"] == 0
             and report["kv_cache_usage"] == 0.0)
    if args.json_out:
        args.json_out.write_text(json.dumps(
            {"samples": samples, "tally": vars(tally), "integrity": report, "clean": clean,
             "growth_mib_per_1000": slope, "growth_last_first": overall,
             "growth_second_half": late_slope,
             "trimmed": trimmed, "start": first}, indent=1))
    return 0 if clean and tally.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
