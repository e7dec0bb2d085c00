"""A server with a short max_model_len and a large body limit: 8 MB prompts are refused by
their character count alone while /health stays fast, and schemathesis (bounded examples,
a fixed seed) finds no server error and nothing the OpenAPI schema does not document."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_utils import Server, start_server, wait_idle
from tests.e2e.test_server_errors import assert_error

MAX_MODEL_LEN = 128
BODY_BYTES = 16_000_000
HUGE = 8_000_000  # characters, as in issue 9
SCHEMATHESIS_EXAMPLES = 10


@pytest.fixture(scope="module")
def fuzzed(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("fuzzed") / "server.log"
    srv = start_server(tiny_llama, log, "--max-model-len", str(MAX_MODEL_LEN),
                       "--max-num-seqs", "16", "--max-request-body-bytes", str(BODY_BYTES))
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture
def fclient(fuzzed: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzzed.base_url, timeout=60.0) as c:
        yield c


# NOTE: "@HUGE@" stands for HUGE characters, filled in by the sender process.
HUGE_REQUESTS = [
    ("/v1/completions", {"prompt": "@HUGE@", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "@HUGE@"], "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "@HUGE@"}]},
     "messages"),
    ("/tokenize", {"prompt": "@HUGE@"}, "prompt"),
]


_SENDER = """
import json, sys, time, httpx
base, requests = sys.argv[1], json.loads(sys.argv[2])
H = int(sys.argv[3])
with httpx.Client(base_url=base, timeout=60.0) as c:
    for path, body in requests:
        body = json.loads(json.dumps(body).replace("@HUGE@", "x" * H))
        start = time.perf_counter()
        r = c.post(path, content=json.dumps(body).encode(),
                   headers={"Content-Type": "application/json"})
        print(json.dumps([r.status_code, r.json(), time.perf_counter() - start]), flush=True)
"""


def test_huge_prompts_are_refused_without_stalling_health(fuzzed: Server,
                                                          fclient: httpx.Client) -> None:
    # NOTE: sent from another process, so that this one's GIL (held while building and
    # sending 8 MB bodies) cannot delay the /health probes measured here.
    requests = [[path, body] for path, body, _ in HUGE_REQUESTS]
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, fuzzed.base_url,
                               json.dumps(requests), str(HUGE)],
                              stdout=subprocess.PIPE, text=True)
    latencies = []
    while sender.poll() is None:
        start = time.perf_counter()
        assert fclient.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.005)
    answers = [json.loads(line) for line in sender.stdout.read().splitlines()]
    print(f"/health while refusing 8 MB prompts (ms): median "
          f"{statistics.median(latencies) * 1e3:.1f}, max {max(latencies) * 1e3:.1f}, "
          f"{len(latencies)} probes; refusals (s): {[round(a[2], 2) for a in answers]}")
    assert sender.returncode == 0 and len(answers) == len(HUGE_REQUESTS)
    for (status, body, _), (*_, param) in zip(answers, HUGE_REQUESTS):
        assert status == 400 and body["error"]["param"] == param, body
        assert "characters" in body["error"]["message"], body  # refused before tokenizing
    assert len(latencies) >= 5, "the refusals ended before /health was sampled"
    # NOTE: tokenizing one of these on the event loop (or holding the GIL) took seconds.
    assert statistics.quantiles(latencies, n=10)[-1] < 0.1, latencies  # 90% within 100 ms
    assert max(latencies) < 0.5, latencies
    report = wait_idle(fclient)
    assert report["ok"] and report["num_orphans"] == 0, report


def test_longest_provable_prompt_is_still_tokenized(fclient: httpx.Client) -> None:
    """Just under the character bound, the engine's own token count decides."""
    r = fclient.post("/v1/completions", json={"prompt": "a b " * 2000, "max_tokens": 1})
    err = assert_error(r, 400, "prompt")
    assert "tokens" in err["message"] and "characters" not in err["message"], err


def test_schemathesis_finds_no_server_error(fuzzed: Server, fclient: httpx.Client,
                                            tmp_path: Path) -> None:
    cmd = [str(Path(sys.executable).with_name("schemathesis")), "run",
           fuzzed.url("/openapi.json"), "--checks",
           "not_a_server_error,status_code_conformance,content_type_conformance",
           "--max-examples", str(SCHEMATHESIS_EXAMPLES), "--seed", "1",
           "--exclude-path-regex", "^/debug", "--request-timeout", "60", "--no-color",
           "--report", "junit", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    summary = re.search(r"(\d+) generated", out)
    print(out[-1500:])
    assert proc.returncode == 0, out[-6000:]
    assert summary is not None and int(summary.group(1)) > 100, out[-3000:]
    report = wait_idle(fclient, timeout_s=60)
    assert report["ok"] and report["num_orphans"] == 0 and report["kv_cache_usage"] == 0, report
