"""GGUF linears run from their blocks (--gguf-native): float32 greedy output equals the
dequantized path token for token, logprobs to 1e-5 (the reference computes the same
arithmetic), for the embedded SmolLM2 Q4_1 and for a tiny file holding every native type;
no dequantized copy of a native weight is kept; "auto" follows the kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagoda import LLM, SamplingParams
from pagoda.models.factory import build_model
from pagoda.models.loader import load_checkpoint
from pagoda.ops import wquant
from pagoda.ops.registry import Kernel
from pagoda.quant.gguf import native_enabled
from tests.gguf_helpers import write_llama_gguf
from tests.helpers import bf16_packs

CPU = torch.device("cpu")


def greedy(model: str | None, prompts: list[str], max_tokens: int, **kwargs):
    llm = LLM(model, dtype="float32", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.kv_cache_manager.usage == 0.0
    return [(o.outputs[0].token_ids,
             [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


def assert_same_greedy(native, dequantized) -> None:
    """Same tokens; logprobs equal but for the float32 summation order a multithreaded
    matmul may pick per call (the weights and the arithmetic are the same)."""
    for (ids, lps), (ref_ids, ref_lps) in zip(native, dequantized, strict=True):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=1e-5)


def test_embedded_smollm2_q4_1_native_equals_the_dequantized_path(monkeypatch):
    # NOTE: the reference of gguf_linear (the CPU kernels quantize activations to int8,
    # another product: tests/unit/test_quant_kernels.py compares them with their reference).
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    prompts = ["The capital of France is", "def fib(n):"]
    assert_same_greedy(greedy(None, prompts, 4, gguf_native="on"),
                       greedy(None, prompts, 4, gguf_native="off"))


def test_native_layers_hold_only_their_blocks():
    model = build_model(load_checkpoint(None), torch.float32, CPU, 64, gguf_native="on")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.weight.shape == (576 + 2 * 192, 576 // 32 * 20)
    assert isinstance(qkv.quant_weight, wquant.GGUFWeight)
    assert qkv.quant_weight.qtype == T.Q4_1 and qkv.quant_weight.shape == (960, 576)
    assert {p.dtype for n, p in model.named_parameters() if "proj" in n} == {torch.uint8}
    # The Q8_0 embedding (tied head) stays a dense table.
    assert model.model.embed_tokens.weight.dtype == torch.float32


# Layer 0: one type per packed layer. Layer 1: gate Q4_K beside up Q6_K (a packed layer
# whose parts differ stays dequantized). The untied head is Q6_K.
MIXED_TYPES = {
    "blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q4_K, "blk.0.attn_v.weight": T.Q4_K,
    "blk.0.attn_output.weight": T.Q5_K, "blk.0.ffn_gate.weight": T.Q6_K,
    "blk.0.ffn_up.weight": T.Q6_K, "blk.0.ffn_down.weight": T.Q8_0,
    "blk.1.attn_q.weight": T.Q4_0, "blk.1.attn_k.weight": T.Q4_0, "blk.1.attn_v.weight": T.Q4_0,
    "blk.1.attn_output.weight": T.Q4_1, "blk.1.ffn_gate.weight": T.Q4_K,
    "blk.1.ffn_up.weight": T.Q6_K, "blk.1.ffn_down.weight": T.Q5_K,
    "output.weight": T.Q6_K,
}


@pytest.fixture(scope="module")
def mixed_gguf(tiny_model, tmp_path_factory) -> Path:
    # NOTE: K-quant blocks hold 256 values: every input size here is a multiple of 256.
    hf_dir = tiny_model("LlamaForCausalLM", hidden_size=256, intermediate_size=512,
                        head_dim=64)
    out = tmp_path_factory.mktemp("gguf_native") / "mixed.gguf"
    return write_llama_gguf(hf_dir, out, qtypes=MIXED_TYPES)


def test_every_native_type_equals_the_dequantized_path(mixed_gguf, monkeypatch):
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")  # the reference, as above
    prompts = ["Hello there", "Once upon a time, in a land"]
    assert_same_greedy(greedy(str(mixed_gguf), prompts, 6, gguf_native="on"),
                       greedy(str(mixed_gguf), prompts, 6, gguf_native="off"))


def test_which_layers_run_natively(mixed_gguf):
    model = build_model(load_checkpoint(mixed_gguf), torch.float32, CPU, 64,
                        gguf_native="on")
    layers = model.model.layers
    native = {
        "qkv0": layers[0].self_attn.qkv_proj, "o0": layers[0].self_attn.o_proj,
        "gate_up0": layers[0].mlp.gate_up_proj, "down0": layers[0].mlp.down_proj,
        "qkv1": layers[1].self_attn.qkv_proj, "o1": layers[1].self_attn.o_proj,
        "down1": layers[1].mlp.down_proj, "lm_head": model.lm_head,
    }
    qtypes = {name: layer.quant_weight.qtype for name, layer in native.items()}
    assert qtypes == {"qkv0": T.Q4_K, "o0": T.Q5_K, "gate_up0": T.Q6_K, "down0": T.Q8_0,
                      "qkv1": T.Q4_0, "o1": T.Q4_1, "down1": T.Q5_K, "lm_head": T.Q6_K}
    mixed = layers[1].mlp.gate_up_proj
    assert type(mixed.quant_method).__name__ == "UnquantizedLinearMethod"
    assert mixed.weight.dtype == torch.float32


def test_auto_runs_natively_exactly_where_a_kernel_takes_the_dtype(monkeypatch):
    def fake(resolved):
        return Kernel("fake", lambda handle, x, w, bias=None: None, frozenset({torch.bfloat16}),
                      resolve=lambda: resolved)

    monkeypatch.setitem(wquant.gguf_linear._kernels, "cpu", [fake(True)])
    assert native_enabled("auto", CPU, torch.bfloat16)
    assert not native_enabled("auto", CPU, torch.float32)
    monkeypatch.setitem(wquant.gguf_linear._kernels, "cpu", [fake(None)])  # not built here
    assert not native_enabled("auto", CPU, torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        assert native_enabled("on", CPU, dtype) and not native_enabled("off", CPU, dtype)
    with pytest.raises(ValueError, match="gguf_native must be one of"):
        native_enabled("sometimes", CPU, torch.float32)


def test_auto_bf16_runs_the_kernels_and_float32_builds_no_kernel_layout():
    from pagoda.ops import quant_cpu

    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels are disabled, unbuildable or not for this CPU")
    model = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_weight, wquant.GGUFWeight) and "cpp" in qkv.quant_weight.kernel_data
    x = torch.randn(3, 576).to(torch.bfloat16)
    assert wquant.gguf_linear.select(x, qkv.quant_weight) is not wquant.gguf_linear.reference
    # The layout holds the Q4_1 blocks bit for bit, so it is the only copy: 0.625 bytes a
    # weight; state_dict() shows the blocks as loaded (float32 keeps them, no layout).
    lay = qkv.quant_weight.layout
    assert qkv.quant_weight.raw is None and qkv.weight.data_ptr() == lay.codes.data_ptr()
    nbytes = sum(t.numel() * t.element_size() for t in (lay.codes, lay.scales, lay.offsets))
    assert nbytes / (960 * 576) == pytest.approx(0.625)
    # The tied head (Q8_0 token table) runs from its blocks too; its lookups give exactly
    # the dense bf16 table's rows.
    embed = model.model.embed_tokens
    assert model.lm_head is embed and embed.weight.dtype == torch.uint8
    assert embed.quant_weight.qtype == T.Q8_0 and "cpp" in embed.quant_weight.kernel_data
    dense = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64, gguf_native="off")
    ids = torch.tensor([[0, 5, 49151], [17, 17, 2]])
    assert torch.equal(embed(ids), dense.model.embed_tokens(ids))
    logits = embed.compute_logits(dense.model.embed_tokens(ids[0]))
    assert logits.shape == (3, 49152) and logits.dtype == torch.bfloat16
    # float32 never runs the kernels (int8 activations): its native layers hold only blocks.
    native32 = build_model(load_checkpoint(None), torch.float32, CPU, 64, gguf_native="on")
    qkv32 = native32.model.layers[0].self_attn.qkv_proj
    assert not qkv32.quant_weight.kernel_data and qkv32.quant_weight.raw is not None
    assert torch.equal(qkv.state_dict()["weight"], qkv32.weight)
    assert embed.quant_weight.raw is None  # Q8_0: the lookups read the layout


def test_fused_layers_run_native_projections_as_op_by_op(mixed_gguf, monkeypatch):
    """bf16 with the kernels: the whole-layer calls (models/fused_decoder.py) take every
    native type and the dequantized packed layer beside them, bit for bit the op-by-op run."""
    from pagoda.ops import cpu_kernels, quant_cpu

    if quant_cpu.resolve() is None or cpu_kernels.kernel_for("fused_ops") is None:
        pytest.skip("the quant or fused-op CPU kernels do not run here")
    if not bf16_packs():  # NOTE: the dequantized layer's weight must be oneDNN-packed
        pytest.skip("oneDNN packs no bf16 weight on this CPU: the dense layer runs op by op")

    def run():
        llm = LLM(str(mixed_gguf), dtype="bfloat16", max_model_len=128, gguf_native="on")
        outs = llm.generate(["Once upon a time, in a land"],
                            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                           logprobs=0, prompt_logprobs=0), use_tqdm=False)
        stack = llm.llm_engine.executor.worker.model.fused_stack()
        return stack, [(o.outputs[0].token_ids,
                        [next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]],
                        [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                       for o in outs]

    stack, fused = run()
    assert stack is not None
    monkeypatch.setenv("PAGODA_DISABLE_FUSED_LAYERS", "1")
    no_stack, plain = run()
    assert no_stack is None and fused == plain
