"""The vLLM peer's options (modes, limits, commands), the named workloads, the launcher
of `bench serve --launch` and the throughput table's shape; no vLLM needed."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import pytest

from pagoda.benchmarks import serve, serve_launch, throughput, vllm_peer
from pagoda.benchmarks.serve_launch import LaunchSpec, launched, parse_launch
from pagoda.benchmarks.throughput_report import peer_columns, print_table
from pagoda.benchmarks.vllm_peer import (
    distinct_vllm_modes,
    parse_vllm_modes,
    vllm_limits,
    vllm_serve_argv,
)
from pagoda.benchmarks.workload import WORKLOAD_PRESETS, rotated
from pagoda.entrypoints.cli import build_parser


def test_vllm_modes_parse_in_order_and_refuse_unknown_ones():
    assert parse_vllm_modes("pagoda-limits,defaults") == ["pagoda-limits", "defaults"]
    assert parse_vllm_modes("defaults, defaults") == ["defaults"]
    with pytest.raises(ValueError, match="--vllm-modes"):
        parse_vllm_modes("fast")
    with pytest.raises(ValueError, match="--vllm-modes"):
        parse_vllm_modes("")


def test_vllm_limits_per_mode():
    assert vllm_limits("defaults", 64, 2048) == (256, 4096)
    assert vllm_limits("pagoda-limits", 64, 2048) == (64, 2048)


def test_vllm_modes_run_once_where_pagoda_limits_are_vllm_defaults():
    both = ["defaults", "pagoda-limits"]
    assert distinct_vllm_modes(both, 256, 4096) == ["defaults"]
    assert distinct_vllm_modes(both, 64, 2048) == both
    assert distinct_vllm_modes(both, 256, 2048) == both
    assert distinct_vllm_modes(["pagoda-limits"], 256, 4096) == ["pagoda-limits"]


def test_vllm_serve_command_has_the_limits_and_no_prefix_caching(tmp_path):
    argv = vllm_serve_argv("/venv/bin/python", tmp_path, 8123, "bfloat16", 256, 4096, "vllm")
    assert argv[0] == "/venv/bin/python" and argv[1].endswith("vllm_peer.py")
    assert argv[2:4] == ["serve", str(tmp_path)]
    joined = " ".join(argv)
    for flag in ("--port 8123", "--max-num-seqs 256", "--max-num-batched-tokens 4096",
                 "--no-enable-prefix-caching", "--dtype bfloat16"):
        assert flag in joined


def test_vllm_env_binds_every_core_and_preloads_what_exists(tmp_path):
    python = tmp_path / "bin" / "python"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_peer.vllm_env(str(python), 3, None, preload=True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    plain = vllm_peer.vllm_env(str(python), 3, None, preload=False)
    assert plain.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD")


def test_the_named_workloads():
    assert WORKLOAD_PRESETS["short"] == (64, (26, 254), (16, 127))
    assert WORKLOAD_PRESETS["long"] == (256, (100, 1024), (100, 1023))


def _throughput_args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["bench", "throughput", *argv])
    throughput._apply_defaults(args)
    return args


def test_throughput_workload_preset_and_override():
    args = _throughput_args("--workload", "short")
    assert (args.num_requests, args.input_len, args.output_len) == (64, (26, 254), (16, 127))
    args = _throughput_args("--workload", "long", "--num-requests", "8")
    assert (args.num_requests, args.input_len, args.output_len) == (8, (100, 1024), (100, 1023))
    assert args.vllm_modes == ["defaults", "pagoda-limits"]


def test_throughput_runs_vllm_once_per_mode():
    names = throughput.run_names(["pagoda", "vllm", "transformers"], ["defaults", "pagoda-limits"])
    assert names == ["pagoda", "vllm (defaults)", "vllm (pagoda-limits)", "transformers"]


def test_throughput_runs_each_kv_cache_dtype_per_system():
    args = _throughput_args("--vllm-modes", "pagoda-limits", "--kv-cache-dtypes", "auto,int8",
                            "--vllm-kv-cache-dtypes", "auto,fp8")
    args.systems = ["pagoda", "vllm"]  # NOTE: as run_throughput splits --systems
    assert throughput._runs(args) == [
        ("pagoda", "pagoda", "auto"), ("pagoda kv=int8", "pagoda", "int8"),
        ("vllm (pagoda-limits)", "vllm (pagoda-limits)", "auto"),
        ("vllm (pagoda-limits, kv=fp8)", "vllm (pagoda-limits)", "fp8"),
    ]


def _result(tps: float, **extra) -> dict:
    return {"output_tokens_per_s": tps, "requests_per_s": 1.0, "total_tokens_per_s": 2 * tps,
            "valid": True, **extra}


def test_throughput_table_has_a_ratio_column_per_vllm_mode(capsys):
    results = {
        "pagoda": _result(600.0),
        "vllm (defaults)": _result(500.0, settings={"max_num_seqs": 256,
                                                    "max_num_batched_tokens": 4096}),
        "vllm (pagoda-limits)": _result(400.0, settings={"max_num_seqs": 64,
                                                         "max_num_batched_tokens": 2048}),
        "transformers": _result(60.0, best_batch_size=16, num_requests_run=64),
    }
    assert [t for t, _ in peer_columns(results)] == [
        "vs transformers", "vs vLLM defaults", "vs vLLM pagoda-limits"]
    print_table(results)
    out = capsys.readouterr().out
    header, pagoda_row = out.splitlines()[1], out.splitlines()[2]
    assert "vs vLLM defaults" in header and "vs vLLM pagoda-limits" in header
    assert pagoda_row.split()[4:7] == ["10.00x", "1.20x", "1.50x"]
    assert "max_num_seqs 256" in out and "max_num_batched_tokens 2048" in out
    assert "its largest batch tried" not in out
    results["transformers"] = _result(60.0, best_batch_size=32, num_requests_run=64,
                                      best_at_largest_batch=True)
    print_table(results)
    assert "(batch 32, 64 requests)  NOTE: its largest batch tried" in capsys.readouterr().out


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *argv])


def test_serve_workload_preset_and_launch_flags():
    args = _serve_args("--workload", "long", "--launch", "pagoda,vllm")
    assert serve._workload_shape(args) == (256, (100, 1024), (100, 1023))
    assert args.launch == ["pagoda", "vllm"] and args.vllm_modes == ["defaults", "pagoda-limits"]
    args = _serve_args("--workload", "short", "--num-prompts", "5")
    assert serve._workload_shape(args) == (5, (26, 254), (16, 127))
    with pytest.raises(ValueError, match="--launch"):
        parse_launch("pagoda,llama")
    # Alternating variants against drift: repeats are kept, and labelled by their turn.
    args = _serve_args("--launch", "pagoda-thread,pagoda-core,pagoda-thread,pagoda-core")
    specs = serve_launch.launch_specs(args)
    assert [s.label for s in specs] == ["pagoda-thread", "pagoda-core", "pagoda-thread #2",
                                        "pagoda-core #2"]
    assert [s.argv.count("--engine-process") for s in specs] == [0, 1, 0, 1]
    assert [s.argv.count("--no-engine-process") for s in specs] == [1, 0, 1, 0]


def test_launch_specs_pagoda_then_vllm_per_mode(tmp_path, monkeypatch):
    fake_python = tmp_path / "python"
    fake_python.write_text("")
    monkeypatch.setattr(vllm_peer, "prepare_hf_dir", lambda src, dtype: tmp_path)
    args = _serve_args("--launch", "pagoda,vllm", "--vllm-python", str(fake_python),
                       "--max-num-seqs", "32", "--launch-port", "9000")
    specs = serve_launch.launch_specs(args)
    assert [(s.label, s.port) for s in specs] == [
        ("pagoda", 9000), ("vllm defaults", 9001), ("vllm pagoda-limits", 9002)]
    pagoda_argv = " ".join(specs[0].argv)
    assert "--no-enable-prefix-caching" in pagoda_argv and "--max-num-seqs 32" in pagoda_argv
    assert "--max-num-seqs 256" in " ".join(specs[1].argv)
    assert "--max-num-seqs 32" in " ".join(specs[2].argv)
    assert specs[1].env["VLLM_TARGET_DEVICE"] == "cpu"
    # At vLLM's own limits the two modes are one server.
    args = _serve_args("--launch", "pagoda,vllm", "--vllm-python", str(fake_python),
                       "--max-num-seqs", "256", "--max-num-batched-tokens", "4096")
    assert [s.label for s in serve_launch.launch_specs(args)] == ["pagoda", "vllm defaults"]


def test_launch_vllm_without_an_interpreter_is_a_clear_error(tmp_path):
    args = _serve_args("--launch", "vllm", "--vllm-python", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="vLLM's interpreter"):
        serve_launch.launch_specs(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launched_waits_for_the_server_and_stops_it(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": []}')
    port = _free_port()
    spec = LaunchSpec("fake", [sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(tmp_path)], port)
    with launched(spec, timeout_s=60) as url:
        assert url == f"http://127.0.0.1:{port}"
        assert serve_launch._ready(url)
    assert not serve_launch._ready(url)


def test_launched_reports_a_server_that_exits(tmp_path):
    spec = LaunchSpec("broken", [sys.executable, "-c", "print('no model'); raise SystemExit(3)"],
                      _free_port())
    with pytest.raises(RuntimeError, match="exited with 3") as info, launched(spec, 60):
        pass
    assert "no model" in str(info.value)


def test_default_vllm_python_prefers_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_VLLM_PYTHON", str(tmp_path / "py"))
    assert vllm_peer.default_vllm_python() == str(tmp_path / "py")
    monkeypatch.delenv("PAGODA_VLLM_PYTHON")
    found = vllm_peer.default_vllm_python()
    assert found is None or Path(found).exists()


def test_no_benchmark_module_shadows_the_standard_library():
    # NOTE: vllm_peer.py runs as a script from this folder (sys.path[0] there).
    folder = Path(vllm_peer.__file__).parent
    names = {p.stem for p in folder.glob("*.py")}
    assert not names & set(sys.stdlib_module_names)


def test_vllm_spec_closed_loop_keeps_concurrency_in_flight():
    """bench spec's vLLM child: c requests in flight, the next added as one finishes, each
    output back at its prompt's index (whatever id vLLM uses inside)."""
    from types import SimpleNamespace

    from pagoda.benchmarks.spec_vllm import _closed_loop

    class FakeEngine:
        def __init__(self):
            self.running, self.most = [], 0

        def add_request(self, name, prompt, params):
            self.running.append((name + "-x", prompt["prompt_token_ids"]))
            self.most = max(self.most, len(self.running))
            return name + "-x"

        def has_unfinished_requests(self):
            return bool(self.running)

        def step(self):
            rid, tokens = self.running.pop(0)
            return [SimpleNamespace(request_id=rid, finished=True,
                                    outputs=[SimpleNamespace(token_ids=tokens[::-1])])]

    engine = FakeEngine()
    prompts = [[i, i + 1] for i in range(5)]
    assert _closed_loop(engine, prompts, None, 2, "t") == [p[::-1] for p in prompts]
    assert engine.most == 2


def test_peer_dtype_is_the_peers_faster_one_on_this_cpu(monkeypatch):
    """--peer-dtype auto: bf16 where the CPU has bf16 arithmetic, else float32 (on such a
    CPU oneDNN has no bf16 GEMM: a peer in bf16 would be measured at its slowest)."""
    from argparse import Namespace

    import pagoda.config
    from pagoda.benchmarks.throughput import peer_dtype

    monkeypatch.setattr(pagoda.config, "cpu_has_bf16", lambda: False)
    assert peer_dtype(Namespace(peer_dtype="auto")) == "float32"
    assert peer_dtype(Namespace(peer_dtype="bfloat16")) == "bfloat16"
    monkeypatch.setattr(pagoda.config, "cpu_has_bf16", lambda: True)
    assert peer_dtype(Namespace(peer_dtype="auto")) == "bfloat16"
    assert peer_dtype(Namespace(peer_dtype="float32")) == "float32"


def test_throughput_rounds_rotate_and_report_medians(tiny_model, monkeypatch, capsys):
    # NOTE: per round (pagoda, vllm) tok/s; a drifting machine's rounds disagree, the
    # ratio of the runs side by side is what holds.
    speeds = {"pagoda": [100.0, 300.0, 200.0], "vllm (defaults)": [100.0, 150.0, 100.0]}
    calls: list[str] = []

    def fake_run_system(name, workload, src, args, kv="auto"):
        calls.append(name)
        extra = {"settings": {"max_num_seqs": 256, "max_num_batched_tokens": 4096}} if (
            name.startswith("vllm")) else {}
        return _result(speeds[name][sum(c == name for c in calls) - 1], **extra)

    monkeypatch.setattr(throughput, "run_system", fake_run_system)
    args = _throughput_args("--model", str(tiny_model("LlamaForCausalLM")), "--quick",
                            "--systems", "pagoda,vllm", "--vllm-modes", "defaults",
                            "--no-roofline", "--rounds", "3")
    report = throughput.run_throughput(args)
    assert calls == ["pagoda", "vllm (defaults)", "vllm (defaults)", "pagoda",
                     "pagoda", "vllm (defaults)"]
    results = report["results"]
    assert list(results) == ["pagoda", "vllm (defaults)"]
    assert results["pagoda"]["output_tokens_per_s"] == 200.0
    assert results["pagoda"]["rounds_output_tokens_per_s"] == [100.0, 300.0, 200.0]
    assert results["vllm (defaults)"]["output_tokens_per_s"] == 100.0
    ratios = report["round_ratios"]["vllm (defaults)"]
    assert ratios == {"per_round": [1.0, 2.0, 2.0], "median": 2.0}
    out = capsys.readouterr().out
    assert "round 3 of 3" in out and "1.00x, 2.00x, 2.00x; median 2.00x" in out


def test_median_round_counts_a_failed_round_lowest():
    failed = {"system": "pagoda", "error": "boom", "valid": False}
    chosen = throughput.median_round([_result(50.0), failed, _result(70.0)])
    assert chosen["output_tokens_per_s"] == 50.0
    assert chosen["rounds_output_tokens_per_s"] == [50.0, None, 70.0]
    assert rotated([1, 2, 3], 4) == [2, 3, 1]
