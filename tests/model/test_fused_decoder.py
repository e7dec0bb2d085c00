"""The whole-layer kernel calls (models/fused_decoder.py) give bit for bit the op-by-op
result: same prompt logprobs and greedy tokens in bf16, with the fused stack on and off
(`PAGODA_DISABLE_FUSED_LAYERS=1`), over prefill, chunked prefill, decode (decode-only steps:
every layer and its attention in one call), q/k/v biases, a sliding window and a quantized
KV cache. And the stack is built only where it applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.ops import cpu_kernels
from tests.helpers import bf16_packs

# (arch, config overrides, engine kwargs)
CASES = [
    ("LlamaForCausalLM", {}, {}),
    ("Qwen2ForCausalLM", {}, {}),  # q/k/v biases
    ("MistralForCausalLM", {"sliding_window": 32}, {}),
    ("LlamaForCausalLM", {}, {"max_num_batched_tokens": 48, "max_num_seqs": 4}),
    ("LlamaForCausalLM", {}, {"kv_cache_dtype": "int8"}),
]


def _needs_fused_kernels(dense: bool = False) -> None:
    """Skip where the whole-layer calls cannot run (`dense`: on a dense bf16 model, whose
    layers need oneDNN-packed weights)."""
    if cpu_kernels.kernels_disabled() or cpu_kernels.kernel_for("fused_ops") is None:
        pytest.skip("the fused-op kernels do not run here (no extension, or neither AVX-512 "
                    "BW/VL nor AVX2 + FMA + F16C)")
    if dense and not bf16_packs():
        pytest.skip("oneDNN packs no bf16 weight on this CPU (no AVX-512): a dense model's "
                    "layers run op by op")


def _run(model_dir: Path, prompts: list[list[int]], max_model_len: int = 256, **engine_kwargs):
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=max_model_len, **engine_kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=0, logprobs=0,
                       ignore_eos=True),
        use_tqdm=False,
    )
    stack = llm.llm_engine.executor.worker.model.fused_stack()
    results = [([next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]],
                o.outputs[0].token_ids,
                [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
               for o in outs]
    return results, stack


@pytest.mark.parametrize(("arch", "overrides", "engine_kwargs"), CASES)
def test_fused_layers_equal_op_by_op(
    arch: str, overrides: dict, engine_kwargs: dict, tiny_model,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _needs_fused_kernels(dense=True)
    model_dir = tiny_model(arch, **overrides)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (70, 9, 41)]

    fused, stack = _run(model_dir, prompts, **engine_kwargs)
    assert stack is not None, "the fused stack did not apply"
    # NOTE: the decode-only steps ran every layer, attention included, in one call.
    assert stack.decode_steps > 0
    monkeypatch.setenv("PAGODA_DISABLE_FUSED_LAYERS", "1")
    plain, no_stack = _run(model_dir, prompts, **engine_kwargs)
    assert no_stack is None
    assert fused == plain


# (arch, config overrides, engine kwargs). max_num_seqs=1: every decode step is one token,
# which a quantized bf16 stack runs in one OpenMP region (decoder_layer_cpu.cpp's
# one_region_stack); two requests at a time take the per-op calls.
INT4_CASES = [
    ("LlamaForCausalLM", {}, {}),
    ("LlamaForCausalLM", {}, {"max_num_seqs": 1}),
    ("Qwen2ForCausalLM", {}, {"max_num_seqs": 1, "kv_cache_dtype": "int8"}),  # biases
    ("MistralForCausalLM", {"sliding_window": 32},
     {"max_num_seqs": 1, "kv_cache_dtype": "fp8_e4m3"}),
]


@pytest.mark.parametrize(("arch", "overrides", "engine_kwargs"), INT4_CASES)
def test_fused_layers_with_int4_projections_equal_op_by_op(
    arch: str, overrides: dict, engine_kwargs: dict, tiny_model, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RTN int4 g32 (GPTQ format): the projections run the quant kernel inside the
    whole-layer calls, bit for bit as op by op."""
    from pagoda.ops import quant_cpu
    from pagoda.quant.calibrate.command import quantize_to_dir

    _needs_fused_kernels()
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here")
    out = tmp_path / "rtn"
    quantize_to_dir(str(tiny_model(arch, **overrides)), out, "rtn", 4, 32)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (33, 7)]
    fused, stack = _run(out, prompts, **engine_kwargs)
    assert stack is not None, "the fused stack did not apply"
    assert stack.decode_steps > 0
    assert stack.decode.one_region, "every projection has a GemvPlan: one region applies"
    monkeypatch.setenv("PAGODA_DISABLE_FUSED_LAYERS", "1")
    plain, no_stack = _run(out, prompts, **engine_kwargs)
    assert no_stack is None
    assert fused == plain


# Contexts past one part of decode attention (512 positions) with few kv heads a CPU:
# the kernel splits each range into parts that threads take apart (the one-region stack
# writes every head's rotary and cache row first); a window of 520 starts the range between
# part boundaries; one kv head lets two requests at a time split too (the per-op calls).
# NOTE: head dim 32, a vector path of the decode kernel (the tiny default 16 is portable).
LONG = {"max_position_embeddings": 2048, "head_dim": 32}
SPLIT_CASES = [
    ("LlamaForCausalLM", LONG, {"max_num_seqs": 1}),
    ("LlamaForCausalLM", {**LONG, "num_key_value_heads": 1}, {}),
    ("MistralForCausalLM", {**LONG, "sliding_window": 520}, {"max_num_seqs": 1}),
]


@pytest.mark.parametrize(("arch", "overrides", "engine_kwargs"), SPLIT_CASES)
def test_fused_layers_over_split_ranges_equal_op_by_op(
    arch: str, overrides: dict, engine_kwargs: dict, tiny_model, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagoda.ops import quant_cpu
    from pagoda.quant.calibrate.command import quantize_to_dir

    _needs_fused_kernels()
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here")
    if cpu_kernels.load_extension().decode_split_cpus() < 2:
        pytest.skip("one CPU: no call has fewer than two kv heads a CPU, none splits")
    out = tmp_path / "rtn"
    quantize_to_dir(str(tiny_model(arch, **overrides)), out, "rtn", 4, 32)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (600, 505)]
    ext = cpu_kernels.load_extension()
    before = ext.decode_parts_run()
    fused, stack = _run(out, prompts, max_model_len=1024, **engine_kwargs)
    assert stack is not None and stack.decode_steps > 0
    assert ext.decode_parts_run() > before, "no decode range was split"
    if engine_kwargs.get("max_num_seqs") == 1:
        assert stack.decode.one_region
    monkeypatch.setenv("PAGODA_DISABLE_FUSED_LAYERS", "1")
    plain, _ = _run(out, prompts, max_model_len=1024, **engine_kwargs)
    assert fused == plain


def test_fused_stack_only_where_it_applies(tiny_model) -> None:
    _needs_fused_kernels(dense=True)
    model_dir = tiny_model("LlamaForCausalLM")
    fp32 = LLM(str(model_dir), dtype="float32", max_model_len=64)
    # NOTE: float32 keeps F.linear (the oracle path), so nothing is packed.
    assert fp32.llm_engine.executor.worker.model.fused_stack() is None
    qwen3 = LLM(str(tiny_model("Qwen3ForCausalLM")), dtype="bfloat16", max_model_len=64)
    assert qwen3.llm_engine.executor.worker.model.fused_stack() is None  # q/k norm
    bf16 = LLM(str(model_dir), dtype="bfloat16", max_model_len=64)
    model = bf16.llm_engine.executor.worker.model
    assert model.fused_stack() is not None
    model.to(torch.float32)  # the weights the stack held are gone: rebuilt (ineligible)
    assert model.fused_stack() is None


def test_decoder_layer_refuses_dense_weights() -> None:
    _needs_fused_kernels()
    ext = cpu_kernels.kernel_for("fused_ops")
    w, n = torch.zeros(8, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="oneDNN-packed or QuantWeight"):
        ext.DecoderLayer(input_norm=n, post_norm=n, qkv_w=w, o_w=w, gate_up_w=w, down_w=w,
                         qkv_b=None, o_b=None, gate_up_b=None, down_b=None, eps=1e-5,
                         num_heads=1, num_kv_heads=1, head_dim=8)
