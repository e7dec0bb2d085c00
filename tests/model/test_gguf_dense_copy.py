"""Native GGUF linears' dense bf16 copies (quant/gguf.py): kept where the decision says (only
where q_linear_amx runs), in its panel layout, holding exactly the values every bf16 path
dequantizes, and read by the products of their rows in the Python layers and the fused
decoder alike; every bf16 product on AMX (q_linear_amx, the tiles, the copy) gives the same
bits, so the copies change no output."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.models.factory import build_model
from pagoda.models.loader import load_checkpoint
from pagoda.ops import quant_cpu, wquant
from pagoda.quant import gguf
from tests.helpers import panels_as_dense

CPU = torch.device("cpu")


def _amx_or_skip() -> None:
    ext = quant_cpu.resolve()
    if ext is None or not quant_cpu.amx_kernel_runs(ext):
        pytest.skip("q_linear_amx does not run here (quant kernels off, no amx_bf16, AMX "
                    "tiles refused, or not built): no dense copy is kept")


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
    monkeypatch.setattr(quant_cpu, "amx_min_rows", lambda: None)  # no AMX: nothing reads one
    assert not gguf.dense_copy_enabled("auto", bf16, CPU, 0)
    assert not gguf.dense_copy_enabled("on", bf16, CPU, 0)
    monkeypatch.setattr(quant_cpu, "amx_min_rows", lambda: 32)
    monkeypatch.setattr(quant_cpu, "resolve", lambda: None)  # the reference runs
    assert not gguf.dense_copy_enabled("on", bf16, CPU, 0)
    monkeypatch.setenv("PAGODA_GGUF_DENSE_COPY", "sometimes")
    with pytest.raises(ValueError, match="PAGODA_GGUF_DENSE_COPY"):
        gguf.dense_copy_mode()


def test_copies_hold_the_weight_and_serve_their_rows(monkeypatch) -> None:
    _amx_or_skip()
    monkeypatch.setenv("PAGODA_GGUF_DENSE_COPY", "on")
    model = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    qkv = model.model.layers[0].self_attn.qkv_proj
    lo, hi = quant_cpu.amx_min_rows(), gguf.DENSE_COPY_MAX_ROWS
    assert qkv.dense_weight is not None and qkv.dense_rows == (lo, hi)
    lay = qkv.quant_weight.kernel_data["cpp"]
    n, k = lay.shape
    assert torch.equal(panels_as_dense(qkv.dense_weight, n, k),
                       lay.dequantize().to(torch.bfloat16))  # Q4_1: exact in float32
    # The tied head (Q8_0): its copy serves the logits of the same rows; lookups read the
    # blocks.
    head = model.model.embed_tokens
    assert head.dense_weight is not None and head.dense_rows == (lo, hi)
    hlay = head.quant_weight.layout

    calls = []
    real = wquant.gguf_linear
    ext = quant_cpu.resolve()
    with monkeypatch.context() as patched:
        patched.setattr(gguf.wquant, "gguf_linear",
                        lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
        for rows in (lo - 1, lo, 300, hi - 1, hi):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            y = qkv.quant_method.apply(qkv, x)
            if lo <= rows < hi:
                amx = ext.q_linear_amx(x, lay.codes, lay.scales, lay.offsets, lay.bits,
                                       lay.block, lay.group, lay.zero_form, n, None)
                assert torch.equal(y, amx)
        assert calls == [lo - 1, hi]  # the rows a copy serves never reach the blocks' kernel
        calls.clear()
        for rows in (lo - 1, lo, 64):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            assert torch.equal(head.quant_method.apply(head, x.to(torch.bfloat16)),
                               quant_cpu.block_linear(ext, x.to(torch.bfloat16), hlay, None))
        assert calls == [lo - 1]
    ids = torch.tensor([[5, 49151, 0]])
    assert torch.equal(head(ids)[0], hlay.dequantize_rows(ids[0]).to(torch.bfloat16))

    monkeypatch.setenv("PAGODA_GGUF_DENSE_COPY", "off")
    off = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    assert off.model.layers[0].self_attn.qkv_proj.dense_weight is None
    assert off.model.embed_tokens.dense_weight is None


def test_auto_keeps_no_copy_past_its_budget(monkeypatch) -> None:
    _amx_or_skip()
    model = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    assert model.model.layers[0].mlp.down_proj.dense_weight is not None
    monkeypatch.setattr(gguf, "DENSE_COPY_MAX_BYTES", 268_900_000)  # SmolLM2's: 268.96 MB
    model = build_model(load_checkpoint(None), torch.bfloat16, CPU, 64)
    assert model.model.layers[0].mlp.down_proj.dense_weight is None


def test_fused_prefill_reads_the_copies_as_op_by_op(monkeypatch) -> None:
    """A 300-token prompt (products of 300 rows: the copies) and its decode steps through the
    fused decoder and op by op: the same prompt logprobs and tokens, and those of a run
    without copies (q_linear_amx), bit for bit."""
    _amx_or_skip()
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
    assert fused == run("off", True)
