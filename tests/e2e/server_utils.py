"""Helpers for the e2e tests: a real `pagoda serve` subprocess on 127.0.0.1, polling its
engine through /debug/integrity, reading SSE. Every wait is bounded in time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
MAX_LOGPROBS = 5
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 200_000
STARTUP_TIMEOUT_S = 120.0


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, num_chars: int = 3000) -> str:
        """The log's end, after its first error where that came earlier (the cause: the
        end is often only its consequences)."""
        text = self.log_path.read_text(errors="replace")
        first = text.find("ERROR")
        head = (text[first:first + 1500] + "\n[...]\n"
                if 0 <= first < len(text) - num_chars else "")
        return head + text[-num_chars:]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then the exit code (SIGKILL and pytest.fail if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            pytest.fail(f"server did not exit on SIGTERM\n{self.log_tail()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, log_path: Path, *extra: str,
                 env: dict[str, str] | None = None) -> Server:
    """Starts `pagoda serve` and returns once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--served-model-name", MODEL_NAME, "--enable-debug-endpoints",
           "--disable-uvicorn-access-log", *extra]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}\n{server.log_tail()}")
        try:
            if httpx.get(server.url("/health"), timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server did not start in {STARTUP_TIMEOUT_S} s\n{server.log_tail()}")


def integrity(client: httpx.Client) -> dict:
    r = client.get("/debug/integrity")
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(client: httpx.Client, timeout_s: float = 10.0) -> dict:
    """Polls the engine until no request is left in it; returns the last integrity report."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = integrity(client)
        if report["num_unfinished"] == 0 and report["num_running"] == 0 and (
                report["num_waiting"] == 0):
            return report
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle after {timeout_s} s: {report}")
        time.sleep(0.02)


def sse_payloads(lines: Iterator[str]) -> list:
    """The `data:` payloads of an SSE stream, `[DONE]` included as the string."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
