"""The engine-driven benchmarks on a tiny model: what they count is exact (KV waste by
step, peak blocks, TTFT in steps); their timings are only checked to exist."""

from __future__ import annotations

import argparse

import pytest

from pagoda import LLM
from pagoda.benchmarks.throughput import _generate_measuring_kv


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("LlamaForCausalLM")


def test_throughput_kv_waste_by_step(tiny) -> None:
    """One 20-token prompt, 4 outputs, block size 16: after steps 1-3 it holds 2 blocks
    (32 slots) with 20, 21, 22 tokens stored; after step 4 it has finished (nothing held).
    By step: (12 + 11 + 10) / 96."""
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory_bytes=1 << 20)
    counts, elapsed, meter = _generate_measuring_kv(llm, [(list(range(100, 120)), 4)])
    assert counts == [4] and elapsed > 0
    assert meter.num_samples == 4 and meter.peak_blocks == 2
    assert (meter.num_slots, meter.num_wasted_slots) == (96, 33)
    assert meter.waste_pct_by_step == pytest.approx(100 * 33 / 96)
    assert 100 * 10 / 32 <= meter.waste_pct <= 100 * 12 / 32


def test_parallel_sampling_shares_the_prompts_full_blocks(tiny) -> None:
    """A 40-token prompt, n = 4 x 8 tokens, block size 16: each sample stores 47 tokens
    (3 blocks). The n samples fork the first sample's 2 full blocks: 2 + 4 x 1 = 6 blocks
    at peak, with prefix caching or without. Four separate requests admitted in the same
    step each compute the prompt, with the prefix cache too (blocks are registered when
    the step commits, so none is found in the step that computes it): 12."""
    from pagoda.benchmarks.parallel_sampling import run_parallel_sampling

    args = argparse.Namespace(model=str(tiny), dtype="float32", prompt_len=40, max_tokens=8,
                              n=4, block_size=16, seed=0, output_json=None)
    report = run_parallel_sampling(args)
    peaks = [(r["shape"], r["prefix_caching"], r["peak_blocks"]) for r in report["runs"]]
    assert peaks == [("n=4 in one request", True, 6), ("4 separate requests", True, 12),
                     ("n=4 in one request", False, 6), ("4 separate requests", False, 12)]
    assert all(r["num_output_tokens"] == 32 for r in report["runs"])
    assert report["saving"] == 0.5 and report["saving_prefix_caching_off"] == 0.5


def test_mixed_sla_priority_serves_interactive_first(tiny) -> None:
    """A batch job of 6 x (64 + 24) over 4 sequence slots and 4 interactive requests
    arriving on the step clock: under priority each one preempts a batch request and gets
    its first token in the very next step; under fcfs it waits behind the batch job. TTFT
    in steps does not depend on the machine's speed."""
    from pagoda.benchmarks.mixed_sla import run_mixed_sla
    from pagoda.entrypoints.cli import build_parser

    args = build_parser().parse_args([
        "bench", "mixed-sla", "--model", str(tiny), "--dtype", "float32",
        "--num-batch", "6", "--batch-input-len", "64", "--batch-output-len", "24",
        "--num-interactive", "4", "--interactive-input-len", "8",
        "--interactive-output-len", "4", "--interactive-rate", "0.2", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128"])
    report = run_mixed_sla(args)
    fcfs, prio = report["results"]
    assert (fcfs["policy"], prio["policy"]) == ("fcfs", "priority")
    assert fcfs["valid"] and prio["valid"]
    assert prio["interactive_ttft_steps"] == {"p50": 1.0, "p99": 1.0, "max": 1.0}
    assert fcfs["interactive_ttft_steps"]["p99"] > 5 * prio["interactive_ttft_steps"]["p99"]
    assert fcfs["num_preemptions"] == 0 and fcfs["preemptions_by_class"] == {}
    assert prio["num_preemptions"] > 0
    assert prio["preemptions_by_class"] == {"batch": prio["num_preemptions"]}
    assert fcfs["batch_output_tokens"] == prio["batch_output_tokens"] == 6 * 24
    assert prio["interactive_ttft_s"]["p99"] > 0 and fcfs["batch_output_tokens_per_s"] > 0
    assert report["comparison"]["ttft_p99_fcfs_over_priority_steps"] > 5


def test_bench_spec_reports_every_config_and_same_greedy_output(tiny, tmp_path) -> None:
    """float32 greedy: every configuration's output equals speculation off's; acceptance
    and mean accepted length where drafts were verified."""
    from pagoda.benchmarks.spec_decode import run_spec_decode

    args = argparse.Namespace(model=str(tiny), draft_model=str(tiny), dtype="float32",
                              self_draft=["rtn"], calib_data="calib", vllm_python="",
                              vllm_only=False, vllm_kv_gib=1,
                              num_speculative_tokens=3, max_tokens=8, concurrency=[1],
                              workloads=["grounded"], seed=0, rounds=2,
                              output_json=str(tmp_path / "spec.json"))
    report = run_spec_decode(args)
    runs = report["runs"]
    assert {r["config"] for r in runs} == {"off", "ngram", "ngram fixed k", "self-draft rtn",
                                           "self-draft rtn fixed k", "draft_model",
                                           "draft_model fixed k"}
    assert all(r["same_output"] for r in runs)
    # Each configuration ran twice, in turn with off: two speedups each, off's exactly 1.
    assert all(len(r["tok_per_s_rounds"]) == len(r["speedup_rounds"]) == 2 for r in runs)
    assert all(r["speedup_rounds"] == [1.0, 1.0] for r in runs if r["config"] == "off")
    for r in runs:
        if r["config"] == "self-draft rtn fixed k":
            assert r["acceptance"] > 0
            assert 0 < r["weight_bytes"]["draft_extra"] < r["weight_bytes"]["target"]
    assert report["cost_model"]["num_steps"] > 0
    (draft,) = [r for r in runs if r["config"] == "draft_model fixed k"
                and r["concurrency"] == 1]
    # The target as its own draft: all accepted; 8 tokens = 1 (prefill) + 4 (k = 3) + 3
    # (k cut to 2 by max_tokens): 3.5 tokens per verification.
    assert draft["acceptance"] == 1.0 and draft["mean_accepted_len"] == pytest.approx(3.5)
    assert (tmp_path / "spec.json").exists()
