"""dtype "auto" on a CPU without bf16 arithmetic: bfloat16 for a GGUF file all of whose
linears run from their blocks (quant/gguf.py prefers_bf16), float32 otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

import pagoda.config
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.loader import load_checkpoint
from pagoda.ops import quant_cpu
from pagoda.quant import gguf as qg

CPU = torch.device("cpu")
LAYER = "model.layers.0."
SMOLLM2 = {LAYER + "self_attn.q_proj": T.Q4_1, LAYER + "self_attn.k_proj": T.Q4_1,
           LAYER + "self_attn.v_proj": T.Q4_1, LAYER + "self_attn.o_proj": T.Q4_1,
           LAYER + "mlp.gate_proj": T.Q4_1, LAYER + "mlp.up_proj": T.Q4_1,
           LAYER + "mlp.down_proj": T.Q4_1, "model.embed_tokens": T.Q8_0}


def _all_linears_native(types) -> bool:
    config = qg.GGUFNativeConfig(types)
    config.packed_modules_mapping = dict(LlamaForCausalLM.packed_modules_mapping)
    return config.all_linears_native()


def test_all_linears_native_needs_native_types_and_one_type_per_packed_layer():
    assert _all_linears_native(SMOLLM2)
    # Q4_K_M-style: a Q6_K v_proj beside Q4_K q/k leaves the packed qkv dequantized.
    assert _all_linears_native({**SMOLLM2, LAYER + "self_attn.v_proj": T.Q6_K,
                                LAYER + "self_attn.q_proj": T.Q6_K,
                                LAYER + "self_attn.k_proj": T.Q6_K})
    assert not _all_linears_native({**SMOLLM2, LAYER + "self_attn.v_proj": T.Q6_K})
    assert not _all_linears_native({**SMOLLM2, LAYER + "mlp.up_proj": T.Q8_0})
    assert not _all_linears_native({**SMOLLM2, "lm_head": T.F16})
    assert not _all_linears_native({})


def test_prefers_bf16_only_without_bf16_arithmetic(monkeypatch):
    ckpt = load_checkpoint(None)
    monkeypatch.setattr(pagoda.config, "cpu_has_bf16", lambda: False)
    kernels_here = quant_cpu.resolve() is not None
    assert qg.prefers_bf16(ckpt, None, "auto", CPU) == kernels_here
    assert qg.prefers_bf16(ckpt, None, "on", CPU) == kernels_here
    assert not qg.prefers_bf16(ckpt, None, "off", CPU)
    assert not qg.prefers_bf16(ckpt, "int8", "auto", CPU)
    assert not qg.prefers_bf16(SimpleNamespace(format="safetensors"), None, "auto", CPU)
    assert not qg.prefers_bf16(ckpt, None, "auto", torch.device("meta"))
    monkeypatch.setattr(pagoda.config, "cpu_has_bf16", lambda: True)
    assert not qg.prefers_bf16(ckpt, None, "auto", CPU)


def test_auto_dtype_of_the_embedded_model_without_bf16_arithmetic(monkeypatch):
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here: auto stays float32")
    from pagoda import LLM

    monkeypatch.setattr(pagoda.config, "cpu_has_bf16", lambda: False)
    auto = LLM(max_model_len=64)
    assert auto.llm_engine.executor.worker.dtype == torch.bfloat16
    qkv = auto.llm_engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert "cpp" in qkv.quant_weight.kernel_data
    del auto
    explicit = LLM(max_model_len=64, dtype="float32")
    assert explicit.llm_engine.executor.worker.dtype == torch.float32
