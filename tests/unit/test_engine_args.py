"""EngineArgs is the one source of engine defaults: the CLI, LLM(...) and the server build
the same EngineConfig from it; `import pagoda` leaves the environment alone while the
entrypoints set OpenMP up before torch loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from pagoda import llm as llm_module
from pagoda.config import EngineArgs, EngineConfig
from pagoda.entrypoints import cli
from pagoda.entrypoints.openai import server
from pagoda.memory_env import CACHE_CAPACITY_VARS

ROOT = Path(__file__).resolve().parents[2]


class CapturedEngine:
    """Stands in for LLMEngine: records the config it was built with."""

    configs: ClassVar[list[EngineConfig]] = []

    def __init__(self, config: EngineConfig) -> None:
        CapturedEngine.configs.append(config)
        self.tokenizer, self.model_path = None, "/m/tiny"
        self.max_model_len, self.vocab_size = 64, 100
        self.device = torch.device("cpu")


def _server_config(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> EngineConfig:
    """The config `pagoda serve argv` builds its engine from, in whichever mode the flags
    choose (both front ends replaced: one builds on a thread, the other in a child)."""
    started: list[str] = []

    def build(factory, max_queued_requests=None):
        started.append("thread")
        return SimpleNamespace(engine=factory(), metrics=None)

    def spawn(factory, policy, max_queued_requests=None, setup=None):
        started.append("process")
        return SimpleNamespace(engine=factory(), metrics=None,
                               process=SimpleNamespace(pid=os.getpid()))

    monkeypatch.setattr(server, "AsyncLLMEngine", SimpleNamespace(build=build))
    monkeypatch.setattr(server, "EngineCoreClient", SimpleNamespace(spawn=spawn))
    monkeypatch.setattr("pagoda.engine.llm_engine.LLMEngine", CapturedEngine)
    server.build_state(cli.build_parser().parse_args(["serve", *argv]))
    assert started == ["thread" if "--no-engine-process" in argv else "process"]
    return CapturedEngine.configs[-1]


def test_cli_llm_and_server_defaults_are_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = EngineArgs().create_engine_config()
    for command in (["generate", "hi"], ["chat"], ["serve"]):
        args = cli.build_parser().parse_args(command)
        assert cli.engine_args(args).create_engine_config() == expected, command
    monkeypatch.setattr(llm_module, "LLMEngine", CapturedEngine)
    llm_module.LLM()
    assert CapturedEngine.configs[-1] == expected
    assert _server_config([], monkeypatch) == expected
    assert _server_config(["--no-engine-process"], monkeypatch) == expected


def test_every_engine_arg_has_a_flag_and_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert set(vars(parser.parse_args([]))) == {f.name for f in dataclasses.fields(EngineArgs)}
    argv = ["--model", "/m", "--dtype", "float32", "--kv-cache-dtype", "bfloat16",
            "--max-num-seqs", "3", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--sla-ttft-target", "batch=9", "--preemption-mode", "swap"]
    got = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert got == EngineArgs(model="/m", dtype="float32", kv_cache_dtype="bfloat16",
                             max_num_seqs=3, enable_prefix_caching=False,
                             enable_chunked_prefill=False, sla_ttft_targets_s={"batch": 9.0},
                             preemption_mode="swap")
    # The server takes the model positionally, and builds no LLM.
    config = _server_config(["/m/tiny", "--max-num-seqs", "3"], monkeypatch)
    assert config.model.model == "/m/tiny" and config.scheduler.max_num_seqs == 3


def test_llm_rejects_an_unknown_engine_arg() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        llm_module.LLM(max_num_seq=3)


def _probe(code: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", *CACHE_CAPACITY_VARS)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, check=True,
        capture_output=True, text=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


_REPORT = ("import json, os, sys; print(json.dumps({'same': dict(os.environ) == before, "
           "'spin': os.environ.get('GOMP_SPINCOUNT'), 'torch': 'torch' in sys.modules}))")


def test_import_pagoda_leaves_the_environment_alone() -> None:
    got = _probe("import os; before = dict(os.environ); import pagoda; " + _REPORT)
    assert got == {"same": True, "spin": None, "torch": False}


_CLI_MAIN = """
import json, os, sys
import pagoda.entrypoints.cli as cli
seen = {}

class Parser:
    def parse_args(self, argv):
        return type("Args", (), {"func": staticmethod(lambda args: 0)})()

def build_parser():
    seen.update(spin=os.environ.get("GOMP_SPINCOUNT"), torch="torch" in sys.modules)
    return Parser()

cli.build_parser = build_parser
cli.main([])
print(json.dumps(seen))
"""


def test_entrypoints_set_openmp_before_torch_loads() -> None:
    # The CLI: main() sets it before anything it runs has loaded torch.
    assert _probe(_CLI_MAIN) == {"spin": "3000", "torch": False}
    # The offline entrypoint sets it as it loads (its imports bring torch in).
    got = _probe("import os; before = dict(os.environ); from pagoda import LLM; " + _REPORT)
    assert got == {"same": False, "spin": "3000", "torch": True}
    # Effective only while torch is not loaded (libgomp reads it when torch loads it).
    code = ("import json, pagoda.omp_env as o; first = o.apply_openmp_defaults(); "
            "import torch; print(json.dumps([first, o.apply_openmp_defaults()]))")
    assert _probe(code) == [True, False]
    # An explicit choice in the environment wins.
    got = _probe("import os; before = dict(os.environ); import pagoda.llm; " + _REPORT,
                 OMP_WAIT_POLICY="PASSIVE", **dict.fromkeys(CACHE_CAPACITY_VARS, "7"))
    assert got == {"same": True, "spin": None, "torch": True}


@pytest.mark.parametrize(("flags", "want"), [({"avx512f", "avx512_bf16", "amx_bf16"}, (256, 4096)),
                                             ({"avx512f", "avx512_bf16"}, (64, 2048)),
                                             (set(), (64, 2048))])
def test_limits_default_follows_amx(monkeypatch, flags: set[str], want: tuple[int, int]) -> None:
    """max_num_seqs / max_num_batched_tokens: 256 / 4096 (vLLM's CPU defaults) where the CPU
    lists amx_bf16, else 64 / 2048; the CLI's defaults are the same, and an explicit value
    wins."""
    from pagoda import config

    monkeypatch.setattr(config, "cpu_info", lambda: ("cpu", frozenset(flags)))
    args = EngineArgs()
    assert (args.max_num_seqs, args.max_num_batched_tokens) == want
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    parsed = p.parse_args([])
    assert (parsed.max_num_seqs, parsed.max_num_batched_tokens) == want
    assert EngineArgs(max_num_seqs=8, max_num_batched_tokens=64).max_num_batched_tokens == 64
    explicit = EngineArgs.from_cli_args(p.parse_args(["--max-num-seqs", "5",
                                                      "--max-num-batched-tokens", "96"]))
    assert (explicit.max_num_seqs, explicit.max_num_batched_tokens) == (5, 96)
