"""Native GGUF linears' dense bf16 copies (quant/gguf.py): kept where the decision says,
read by products of DENSE_COPY_ROWS rows in the Python layers and the fused decoder alike,
holding exactly the values the wide path dequantizes; on an AMX CPU every bf16 product
(q_linear_amx, the tiles, the copy) gives the same bits, so the copies change no output."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.models.factory import build_model
from pagoda.models.loader import load_checkpoint
from pagoda.ops import quant_cpu, wquant
from pagoda.quant import gguf
from tests.helpers import bf16_packs

CPU = torch.device("cpu")


def _kernels_or_skip() -> None:
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels are disabled, unbuildable or not for this CPU")
    if not bf16_packs():
        pytest.skip("oneDNN packs no bf16 weight on this CPU: no dense copy is kept")


def _amx() -> bool:
    ext = quant_cpu.resolve()
    return ext is not None and quant_cpu.amx_kernel_runs(ext)


def test_the_decision_follows_mode_dtype_amx_and_size(monkeypatch) -> None:
    monkeypatch.setattr(quant_cpu, "resolve", lambda: object())
    monkeypatch.setattr(quant_cpu, "amx_min_rows", lambda: 32)
    bf16, small = torch.bfloat16, gguf.DENSE_COPY_MAX_BYTES
    assert gguf.dense_copy_enabled("auto", bf16, CPU, small)
    assert not gguf.dense_copy_enabled("auto", bf16, CPU, small + 1)
    assert gguf.dense_copy_enabled("on", bf16, CPU, small + 1)
    assert not gguf.dense_copy_enabled("off", bf16, CPU, 0)
    assert not gguf.dense_copy_enabled("on", torch.float32, CPU, 0)
    assert not gguf.dense_copy_enabled("on", bf16, torch.device("meta"), 0)
    monkeypatch.setattr(quant_cpu, "amx_min_rows", lambda: None)  # no AMX: panel kernel
    assert not gguf.dense_copy_enabled("auto", bf16, CPU, 0)
    assert gguf.dense_copy_enabled("on", bf16, CPU, 0)
    monkeypatch.setattr(quant_cpu, "resolve", lambda: None)  # the reference runs
    assert not gguf.dense_copy_enabled("on", bf16, CPU, 0)
    monkeypatch.setenv("PAGODA_GGUF_DENSE_COPY", "sometimes")
    with pytest.raises(ValueError, match="PAGODA_GGUF_DENSE_COPY"):
        gguf.dense_copy_mode()


def test_copies_hold_the_wide_paths_values_and_serve_their_rows(monkeypatch) -> None:
    _kernels_or_skip()
    monkeypatch.setenv("PAGODA_GGUF_DENSE_COPY", "on")
    model = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.dense_weight is not None and qkv.dense_rows == gguf.DENSE_COPY_ROWS
    assert model.model.embed_tokens.dense_weight is None  # the tied head keeps none
    lay = qkv.quant_weight.kernel_data["cpp"]
    dense = quant_cpu.dense_bf16(lay)
    assert torch.equal(dense, lay.dequantize().to(torch.bfloat16))  # Q4_1: exact in float32
    assert torch.equal(qkv.dense_weight.to_dense(), dense)

    calls = []
    real = wquant.gguf_linear
    ext = quant_cpu.resolve()
    lo, hi = gguf.DENSE_COPY_ROWS
    with monkeypatch.context() as patched:
        patched.setattr(gguf.wquant, "gguf_linear",
                        lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
        for rows in (lo - 1, lo, 300, hi - 1, hi):
            x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
            y = qkv.quant_method.apply(qkv, x.to(torch.bfloat16))
            tiles = ext.q_linear_tiles(x.to(torch.bfloat16), lay.codes, lay.scales,
                                       lay.offsets, lay.bits, lay.block, lay.group,
                                       lay.zero_form, lay.shape[0], None, 1 << 30)
            if lo <= rows < hi:
                # NOTE: the copy through oneDNN's packed GEMM, the tiles through its plain
                # one: the same bits where both run on AMX tiles.
                if _amx():
                    assert torch.equal(y, tiles)
                else:
                    torch.testing.assert_close(y.float(), tiles.float(), rtol=2**-7,
                                               atol=1e-2)
    assert calls == [lo - 1, hi]  # the rows the copy serves never reach the blocks' kernel

    monkeypatch.setenv("PAGODA_GGUF_DENSE_COPY", "off")
    off = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    assert off.model.layers[0].self_attn.qkv_proj.dense_weight is None


def test_auto_keeps_no_copy_past_its_budget(monkeypatch) -> None:
    _kernels_or_skip()
    if not _amx():
        pytest.skip("auto keeps copies only where bf16 products run on AMX")
    model = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    assert model.model.layers[0].mlp.down_proj.dense_weight is not None
    monkeypatch.setattr(gguf, "DENSE_COPY_MAX_BYTES", 212_000_000)  # SmolLM2's: 212.3 MB
    model = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    assert model.model.layers[0].mlp.down_proj.dense_weight is None


def test_fused_prefill_reads_the_copies_as_op_by_op(monkeypatch) -> None:
    """A 300-token prompt (products of 300 rows: the copies) through the fused decoder and
    op by op: the same prompt logprobs and tokens; on AMX also those of a run without
    copies (q_linear_amx), bit for bit."""
    _kernels_or_skip()
    from pagoda.ops import cpu_kernels

    if cpu_kernels.kernel_for("fused_ops") is None:
        pytest.skip("the fused-op CPU kernels do not run here")
    prompt = {"prompt_token_ids": [(17 * i) % 40000 + 100 for i in range(300)]}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)

    def run(copy: str, fused: bool):
        monkeypatch.setenv("PAGODA_GGUF_DENSE_COPY", copy)
        monkeypatch.setenv("PAGODA_DISABLE_FUSED_LAYERS", "0" if fused else "1")
        llm = LLM(dtype="bfloat16", max_model_len=512, enable_prefix_caching=False)
        model = llm.llm_engine.executor.worker.model
        assert (model.model.layers[3].mlp.gate_up_proj.dense_weight is not None) == (copy == "on")
        assert (model.fused_stack() is not None) == fused
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return (out.outputs[0].token_ids,
                [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]],
                [next(iter(d.values())).logprob for d in out.outputs[0].logprobs])

    fused = run("on", True)
    assert fused == run("on", False)
    if _amx():
        assert fused == run("off", True)
