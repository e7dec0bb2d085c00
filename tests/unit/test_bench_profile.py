"""`pagoda bench profile`: every section in the report, timers that add up and go away,
and the ONEDNN_VERBOSE parser on both ISAs' lines."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from pagoda.benchmarks import step_profile as profile
from pagoda.benchmarks.onednn_probe import parse_verbose
from pagoda.benchmarks.profile_report import format_report
from pagoda.benchmarks.step_timer import PHASES, PhaseClock, StepInstrumentation
from pagoda.entrypoints.cli import build_parser
from pagoda.ops.registry import Op

ARCH = "LlamaForCausalLM"

AMX_LOG = """\
onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with float16, Intel DL Boost and bfloat16 support and Intel AMX with bfloat16 and 8-bit integer support
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:bf16::blocked:ab::f0 dst:bf16::blocked:AB16b32a2b::f0,attr-scratchpad:user,,960x576,1.2
onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core_amx,forward_inference,src:bf16::blocked:ab::f0 wei:bf16::blocked:AB16b32a2b::f0 bia:undef::undef::: dst:bf16::blocked:ab::f0,attr-scratchpad:user,,mb64ic576oc960,0.3
"""
AVX512_LOG = """\
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with Intel DL Boost and bfloat16 support
onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core_bf16,forward_inference,src:bf16::blocked:ab::f0 wei:bf16::blocked:AB16b64a2b::f0 bia:undef::undef::: dst:bf16::blocked:ab::f0,attr-scratchpad:user,,mb1ic576oc1536,6.37891
unrelated line
"""


def test_parse_verbose_amx_line():
    isa, execs = parse_verbose(AMX_LOG)
    assert "AMX" in isa
    gemm = [e for e in execs if e.kind == "inner_product"]
    assert len(gemm) == 1 and gemm[0].isa == "avx512_core_amx"
    assert gemm[0].weight_layout == "AB16b32a2b" and gemm[0].problem == "mb64ic576oc960"
    assert [e.kind for e in execs] == ["reorder", "inner_product"]


def test_parse_verbose_avx512_line():
    isa, execs = parse_verbose(AVX512_LOG)
    assert isa == "Intel AVX-512 with Intel DL Boost and bfloat16 support"
    assert [(e.isa, e.weight_layout) for e in execs] == [("avx512_core_bf16", "AB16b64a2b")]


def test_phase_clock_times_are_exclusive():
    clock = PhaseClock()
    inner = clock.wrap("forward: GEMMs", lambda: sum(range(20000)))
    outer = clock.wrap("forward: other", lambda: [inner() for _ in range(3)])
    outer()
    assert clock.seconds["forward: GEMMs"] > 0 and clock.seconds["forward: other"] > 0
    clock.reset()
    assert set(clock.seconds) == set(PHASES) and not any(clock.seconds.values())


def test_cli_has_bench_profile():
    args = build_parser().parse_args(["bench", "profile", "--num-seqs", "3", "--steps", "2"])
    assert args.num_seqs == 3 and args.steps == 2 and args.context_len == 1000


def test_a_small_prefill_case_keeps_the_decode_setup_short():
    # NOTE: one engine serves every case; its budget once was --prefill-tokens, so the
    # decode case's 128 x 840 prompt tokens took 6,720 steps to prefill, and the output
    # tokens it then asked for pushed max_model_len past SmolLM2's 8,192.
    args = build_parser().parse_args(["bench", "profile", "--num-seqs", "128",
                                      "--context-len", "840", "--prefill-tokens", "16"])
    assert profile._budget(args) >= profile.DEFAULT_PREFILL_TOKENS
    assert args.context_len + profile._decode_max_tokens(args) <= 8192 - 7000


@pytest.fixture(scope="module")
def report(tiny_model) -> dict:
    p = argparse.ArgumentParser()
    profile.add_step_profile_args(p)
    model = str(tiny_model(ARCH))
    args = p.parse_args(["--model", model, "--num-seqs", "4", "--context-len", "40",
                         "--prefill-tokens", "64", "--prefill-seqs", "2", "--steps", "2",
                         "--single-context-len", "20", "--single-steps", "6"])
    original_call = Op.__dict__["__call__"]
    result = profile.run_step_profile(args)
    assert Op.__dict__["__call__"] is original_call  # NOTE: the class patches are undone
    return result


def test_report_has_every_section(report, capsys):
    assert set(profile.SECTIONS) <= set(report)
    text = format_report(report)
    for header in ("machine", "decode", "prefill", "single stream", "dispatch", "oneDNN"):
        assert f"== {header}" in text or f"== pagoda bench profile: {header}" in text
    for phase in PHASES:
        assert phase in text
    for flag in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx_vnni"):
        assert f"{flag}=" in text
    assert "amx     :" in text and "weight-bandwidth floor" in text


def test_cases_time_the_right_steps(report):
    assert report["decode"]["tokens_per_step"] == 4
    assert report["prefill"]["tokens_per_step"] == 64
    assert report["single"]["tokens_per_step"] == 1
    for case in ("decode", "prefill", "single"):
        c = report[case]
        assert c["step_ms"] == pytest.approx(sum(c["phases_ms"].values()))
        # NOTE: with the fused decoder stack the GEMMs run inside the layer calls.
        gemm_phase = "forward: layer calls" if report["dispatch"]["fused_layers"] else (
            "forward: GEMMs")
        assert c["phases_ms"][gemm_phase] > 0 and c["phases_ms"]["sampling"] > 0
        assert c["phases_ms"]["forward: attention"] > 0 and c["phases_ms"]["lm_head"] > 0
    assert report["single"]["weight_floor"]["ratio"] > 0
    if report["dispatch"]["fused_layers"]:
        # NOTE: decode steps again as the engine runs them: every layer in one call.
        assert report["decode"]["one_call_step_ms"] > 0
        assert report["single"]["one_call_step_ms"] > 0
        # NOTE: the batch-1 one-call figure is a median of its own, longer run of steps.
        assert report["single"]["one_call_steps"] == 6
        assert report["decode"]["one_call_steps"] == 2
        assert "step total, one call" in format_report(report)
        assert "median of 6 steps" in format_report(report)
        # NOTE: then 6 more tokens with decode bursts (the engine's default of 8).
        single = report["single"]
        assert single["decode_burst"] == 8
        assert single["burst_tokens"] >= 6 and single["burst_steps"] < single["burst_tokens"]
        assert single["burst_ms_per_token"] > 0 and single["weight_floor"]["burst_ratio"] > 0
        assert "per token, bursts" in format_report(report)


def test_dispatch_names_every_op_and_gemm(report):
    d = report["dispatch"]
    assert {"paged_attention", "fused_add_rms_norm"} <= set(d["ops"])
    # NOTE: the fused decoder stack calls SiLU*mul inside its layer calls, not as an op.
    assert d["fused_layers"] or "silu_and_mul" in d["ops"]
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"} <= set(d["gemms"])
    assert all(d["ops"].values())
    if "cpp" in d["ops"]["paged_attention"]:
        assert d["kv_prefetch"].startswith(("L1 (", "L2 ("))
        assert "decode K/V prefetch" in format_report(report)


def test_onednn_section_reports_gemms_or_an_error(report):
    o = report["onednn"]
    assert o.get("gemms") or o.get("error")
    for g in o.get("gemms", []):
        assert g["isa"] and g["weight_layout"]


def test_instrumentation_is_removed(tiny_model):
    from pagoda import LLM
    from pagoda.benchmarks.step_timer import StepInstrumentation

    engine = LLM(model=str(tiny_model(ARCH)), dtype="bfloat16", max_model_len=64).llm_engine
    runner = engine.executor.worker.runner
    sampler = runner.sampler
    with StepInstrumentation(engine):
        assert "step" in vars(engine) and "forward" in vars(runner.model)
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler)
    assert "forward" not in vars(runner.model) and runner.sampler is sampler


@pytest.mark.parametrize("tied", [False, True])
def test_weight_floor_counts_the_bytes_a_step_reads(tiny_model, monkeypatch, tied):
    """The batch-1 floor's bytes are the weights as a step reads them: a dense bf16 model's
    equal the roofline's parameter count at 2 bytes; int8 linears count about a byte a
    weight (their kernel layout, not also the codes kept beside it), not bf16's two (which
    the floor once assumed for every model)."""
    from pagoda import LLM
    from pagoda.benchmarks import roofline as rl

    monkeypatch.setattr(rl, "measure_read_bandwidth", lambda num_bytes: 1e10)
    model_dir = str(tiny_model(ARCH, tie_word_embeddings=tied))
    read = {}
    for quantization in (None, "int8_wo"):
        llm = LLM(model_dir, dtype="bfloat16", quantization=quantization,
                  num_gpu_blocks_override=40)
        read[quantization] = profile._weight_floor(llm.llm_engine)["weight_bytes"]
        shape = rl.shape_from_hf_config(llm.llm_engine.hf_config)
        del llm
    assert read[None] == shape.weight_params_read_per_step * 2
    # NOTE: int8 saves a byte per linear weight (the head stays bf16), less its layout's
    # scales (an eighth of a byte a weight at the tiny model's sizes).
    saved = read[None] - read["int8_wo"]
    assert 0.8 * shape.linear_params < saved <= shape.linear_params


def _fake_engine(head_op: Op, x: torch.Tensor) -> SimpleNamespace:
    """The parts of an engine StepInstrumentation wraps; its model's head calls `head_op`."""
    model = SimpleNamespace(forward=lambda: None, modules=list,
                            compute_logits=lambda: head_op(x))
    runner = SimpleNamespace(model=model, sampler=None, **{
        name: (lambda: None) for name in ("_update_states", "_step_batch", "_prepare_inputs",
                                          "_sample")})
    return SimpleNamespace(
        step=lambda: None, executor=SimpleNamespace(worker=SimpleNamespace(runner=runner)),
        scheduler=SimpleNamespace(update_from_output=None, schedule=None),
        output_processor=SimpleNamespace(process=None))


def test_a_quantized_heads_op_is_lm_head_time():
    """A quantized head runs its GEMM as an op (gguf_linear) inside compute_logits: that is
    lm_head time, not "fused ops" (it was, before the fix)."""
    x = torch.randn(256, 256)
    head_op = Op("test_head_gemm", lambda t: [t @ t for _ in range(20)])
    engine = _fake_engine(head_op, x)
    with StepInstrumentation(engine) as inst:
        engine.executor.worker.runner.model.compute_logits()
    seconds = inst.clock.seconds
    assert seconds["lm_head"] > 0 and seconds["forward: fused ops"] == 0


def test_a_quantized_linears_op_is_gemm_time():
    """A quantized linear's op (gguf_linear) called by the layers is GEMM time, not "fused
    ops" (it was, with the fused decoder layers off)."""
    x = torch.randn(256, 256)
    gemm_op = Op("gguf_linear", lambda t: [t @ t for _ in range(20)])
    engine = _fake_engine(Op("test_head", lambda t: t), x)
    engine.executor.worker.runner.model.forward = lambda: gemm_op(x)
    with StepInstrumentation(engine) as inst:
        engine.executor.worker.runner.model.forward()
    seconds = inst.clock.seconds
    assert seconds["forward: GEMMs"] > 0 and seconds["forward: fused ops"] == 0
