"""ops/gemm_dispatch.py: the start-up choice between oneDNN's bf16 kernel and a float32
product on the widened weight for wide bf16 GEMMs; what each mode does, what the probe
decides from, and that the model's two paths (whole-layer calls, op by op) agree with it."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from pagoda.ops import gemm_dispatch
from pagoda.quant.unquantized import pack_weight, packed_linear
from tests.helpers import bf16_packs

needs_mkldnn = pytest.mark.skipif(
    not bf16_packs(),
    reason="no oneDNN in this torch, or oneDNN packs no bf16 weight on this CPU (no AVX-512)",
)


def _weights(n: int = 48, k: int = 80, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return w, b, pack_weight(w)


def _onednn(x, packed, b):
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


@needs_mkldnn
def test_bf16_mode_keeps_onednn_at_every_row_count(wide_gemm) -> None:
    assert wide_gemm("bf16") is None
    assert gemm_dispatch.active_min_rows == sys.maxsize
    _, b, packed = _weights()
    for rows in (1, 127, 128, 600):
        x = torch.randn(rows, 80).to(torch.bfloat16)
        assert torch.equal(packed_linear(x, packed, b), _onednn(x, packed, b))


@needs_mkldnn
def test_fp32_mode_widens_from_its_threshold(wide_gemm) -> None:
    rows_from = wide_gemm("fp32")
    assert rows_from == gemm_dispatch.FORCED_MIN_ROWS
    w, b, packed = _weights()
    for rows in (1, rows_from - 1):  # below: oneDNN's bf16 kernel, bit for bit
        x = torch.randn(rows, 80).to(torch.bfloat16)
        assert torch.equal(packed_linear(x, packed, b), _onednn(x, packed, b))
    for rows in (rows_from, 3 * rows_from + 5):
        x = torch.randn(rows, 80).to(torch.bfloat16)
        out = packed_linear(x, packed, b)
        # exactly the float32 product of the same bf16 values, rounded once to bf16
        want = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
        assert out.dtype == torch.bfloat16 and torch.equal(out, want)
        # and within bf16 rounding of oneDNN's bf16 result (same products, another order)
        torch.testing.assert_close(out.float(), _onednn(x, packed, b).float(),
                                   rtol=2 ** -7, atol=2 ** -7 * w.abs().sum(1).max().item())
    # float16 activations never widen (only bf16 products are probed)
    w16 = torch.randn(48, 80).to(torch.float16)
    if (p16 := pack_weight(w16)) is not None:
        x = torch.randn(rows_from, 80).to(torch.float16)
        assert torch.equal(packed_linear(x, p16), _onednn(x, p16, None))


def test_unknown_mode_is_refused(wide_gemm) -> None:
    with pytest.raises(ValueError, match="PAGODA_WIDE_GEMM='fast'"):
        wide_gemm("fast")


def test_auto_probe_decides_from_its_own_timings(wide_gemm) -> None:
    chosen = wide_gemm("auto")
    report = gemm_dispatch.probe_report()
    if not bf16_packs():  # nothing to time: bf16 linears stay on F.linear, never widened
        assert chosen is None and report["reason"] == "oneDNN does not pack bf16 here"
        assert gemm_dispatch.active_min_rows == sys.maxsize
        return
    timings = report["timings"]
    assert report["fp32_min_rows"] == chosen and report["mode"] == "auto"
    assert list(timings) == list(gemm_dispatch.PROBE_ROWS[: len(timings)])
    wins = [r for r, t in timings.items() if t["bf16_ms"] >= gemm_dispatch.MARGIN * t["fp32_ms"]]
    if chosen is None:  # every row count tried, float32 never far enough ahead
        assert not wins and len(timings) == len(gemm_dispatch.PROBE_ROWS)
    else:  # the first row count where float32 won, and the probe stopped there
        assert wins == [chosen] and list(timings)[-1] == chosen
    assert gemm_dispatch.active_min_rows == (sys.maxsize if chosen is None else chosen)
    # decided once: a second call does not probe again
    assert gemm_dispatch.configure() == chosen and gemm_dispatch.probe_report() == report


@needs_mkldnn
def test_model_paths_agree_under_the_fp32_path(tiny_model, wide_gemm, monkeypatch) -> None:
    """With wide products in float32, a prefill wide enough to widen gives the same prompt
    logprobs and greedy tokens with the whole-layer calls on and off: the stack hands
    such batches to the op-by-op path, whose linears widen. Without that hand-over the
    stack's bf16 GEMMs would give other logprobs than the op-by-op path's float32 ones."""
    from pagoda import LLM, SamplingParams
    from pagoda.ops import cpu_kernels

    if cpu_kernels.kernels_disabled() or cpu_kernels.kernel_for("fused_ops") is None:
        pytest.skip("the fused-op kernels do not run here (no extension, or neither AVX-512 "
                    "BW/VL nor AVX2 + FMA + F16C)")
    rows_from = wide_gemm("fp32")
    # NOTE: sums long enough that oneDNN's bf16 order and float32's differ after rounding
    model_dir = tiny_model("LlamaForCausalLM", hidden_size=512, intermediate_size=1536)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist()
               for n in (rows_from + 20, 11)]

    def run():
        llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=512)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0,
                                           ignore_eos=True), use_tqdm=False)
        stack = llm.llm_engine.executor.worker.model.fused_stack()
        return [([next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]],
                 o.outputs[0].token_ids) for o in outs], stack

    fused, stack = run()
    assert stack is not None and stack.has_dense
    assert stack.widens(torch.empty(rows_from, 1)) and not stack.widens(torch.empty(2, 1))
    monkeypatch.setenv("PAGODA_DISABLE_FUSED_LAYERS", "1")
    plain, no_stack = run()
    assert no_stack is None
    assert fused == plain
