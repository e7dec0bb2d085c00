"""`pagoda generate` as a user runs it: a subprocess that prints the greedy chat reply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagoda import LLM, SamplingParams


def pagoda_command() -> list[str]:
    """The installed console script, or the module when the package is not installed."""
    script = Path(sys.executable).with_name("pagoda")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "pagoda.entrypoints.cli"]


def test_generate_prints_the_greedy_chat_reply(tiny_model) -> None:
    path = tiny_model("LlamaForCausalLM")
    # NOTE: one thread: on a shared, busy machine torch's spinning worker threads make a
    # tiny model's steps many times slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*pagoda_command(), "generate", "--model", str(path), "--dtype", "float32",
         "--max-tokens", "5", "hi"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    (out,) = llm.chat([{"role": "user", "content": "hi"}],
                      SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].text.strip()
    assert proc.stdout == out.outputs[0].text + "\n"
