"""`pagoda bench multi-turn` on a tiny float32 model, sized to run in seconds: the host tier
recomputes fewer prompt tokens and serves host hits; replies match the tier-off run. And the
engine flag `--kv-offloading-size` reaches the engine from every command that takes it."""

from __future__ import annotations

import json

import pytest

from pagoda.benchmarks.multi_turn import percentile, run_multi_turn
from pagoda.entrypoints.cli import build_parser, engine_args


def test_bench_multi_turn_smoke(tiny_model, tmp_path, capsys) -> None:
    path = tiny_model("LlamaForCausalLM")
    out_json = tmp_path / "mt.json"
    args = build_parser().parse_args([
        "bench", "multi-turn", "--model", str(path), "--dtype", "float32",
        "--num-conversations", "2", "--num-turns", "3", "--system-len", "64",
        "--user-len", "32", "--reply-len", "8", "--burst-size", "2", "--burst-len", "96",
        "--burst-max-tokens", "2", "--num-gpu-blocks", "25", "--max-model-len", "384",
        "--kv-offloading-size", "0.002", "--output-json", str(out_json),
    ])
    report = run_multi_turn(args)
    off, on = report["off"], report["on"]
    assert off["turn_prompt_tokens"] == on["turn_prompt_tokens"]
    assert off["host_hit_tokens"] == 0 and off["host_tier_blocks"] == 0
    assert on["turn_host_hit_tokens"] > 0 and on["host_loaded_blocks"] > 0
    assert on["turn_tokens_recomputed"] < off["turn_tokens_recomputed"]
    assert report["ratios"]["recomputed_off_over_on"] > 1
    assert report["replies_identical"]
    assert len(on["turns"]) == 6 and on["ttft_turn2plus_p99_s"] >= on["ttft_turn2plus_p50_s"]
    assert json.loads(out_json.read_text())["ratios"] == report["ratios"]
    assert "recomputed off/on" in capsys.readouterr().out


def test_bench_multi_turn_rejects_a_workload_longer_than_max_model_len() -> None:
    args = build_parser().parse_args(["bench", "multi-turn", "--max-model-len", "512"])
    with pytest.raises(ValueError, match="max-model-len"):
        run_multi_turn(args)


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_kv_offloading_size_flag(command) -> None:
    args = build_parser().parse_args([*command, "--kv-offloading-size", "1.5"])
    assert engine_args(args).kv_offloading_size == 1.5
    assert engine_args(build_parser().parse_args(command)).kv_offloading_size == 0.0
