"""`pagoda bench quant`'s own arithmetic: resident weight bytes, the issue's targets, and the
reuse of calibrated directories."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagoda import LLM
from pagoda.benchmarks import quant
from pagoda.benchmarks.quant import _holds_weight_class, targets, weight_bytes
from pagoda.quant.calibrate import command, export
from pagoda.quant.calibrate.command import quantize_to_dir
from tests.model.test_perplexity import TEXT


def test_weight_bytes_counts_dense_and_quantized_weights(tiny_model, tmp_path, monkeypatch):
    # NOTE: without the CPU kernels' layouts, a second copy of the codes (docs/quantization.md:
    # the codes are held twice while the kernels are on); this counts the checkpoint's bytes.
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    src = tiny_model("LlamaForCausalLM")
    dense = LLM(str(src), dtype="float32").llm_engine.executor.worker.model
    num_params = sum(p.numel() for p in dense.parameters())
    assert weight_bytes(dense) >= 4 * num_params
    assert not _holds_weight_class(dense, "GroupQuantWeight")

    calib = tmp_path / "c.txt"
    calib.write_text(TEXT * 3)
    quantize_to_dir(str(src), tmp_path / "q", "rtn", 4, 32, calib_data=str(calib))
    quant = LLM(str(tmp_path / "q"), dtype="float32").llm_engine.executor.worker.model
    assert _holds_weight_class(quant, "GroupQuantWeight")
    linear = sum(m.quant_weight.qweight.numel() for m in quant.modules()
                 if getattr(m, "quant_weight", None) is not None)
    # Dense linears (4 bytes a weight) replaced by at least their codes, at most 4 bytes less.
    assert 0 < weight_bytes(quant) < weight_bytes(dense) - 2 * linear


def test_targets_compare_against_the_better_rtn():
    results = {
        "bf16": {"perplexity": 10.0, "throughput_tok_s": 100.0},
        "rtn int4 g64 sym": {"perplexity": 18.0},
        "rtn int4 g64 asym": {"perplexity": 14.0, "throughput_tok_s": 120.0},
        "gptq int4 g64": {"perplexity": 12.0, "decode_ms_per_token": 5.0},
        "awq int4 g64": {"perplexity": 12.5, "throughput_tok_s": 90.0},
        "llama.cpp": {"decode_ms_per_token": 6.0},
    }
    lines = targets(results)
    assert lines[0].startswith("PASS  gptq") and "<= 12.000" in lines[0]
    assert lines[1].startswith("FAIL  awq")
    assert lines[2].startswith("n/a   gguf q4_1 native decode")
    assert lines[3].startswith("PASS  gptq int4 g64 decode")
    assert lines[4].startswith("PASS  rtn int4 g64 asym throughput")
    assert lines[6].startswith("FAIL  awq int4 g64 throughput")


def test_targets_also_compare_against_the_searched_rtn_grid():
    results = {
        "bf16": {"perplexity": 10.0},
        "rtn int4 g64 sym": {"perplexity": 18.0},
        "rtn int4 g64 asym": {"perplexity": 14.0},
        "rtn int4 g64 asym mse": {"perplexity": 13.0},
        "gptq int4 g64": {"perplexity": 11.8},
    }
    lines = targets(results)
    assert lines[0].startswith("PASS  gptq") and "<= 12.000" in lines[0]
    assert lines[1].startswith("FAIL  gptq") and "<= 11.500" in lines[1]
    assert "best RTN incl. mse" in lines[1]
    assert lines[2].startswith("n/a   awq")


def test_calibrated_dirs_are_reused_only_when_calibrated_the_same_way(tmp_path, monkeypatch):
    calls = []

    def fake_quantize(model, out, method, *args, **kwargs):
        calls.append(Path(out).name)
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(command, "quantize_to_dir", fake_quantize)
    monkeypatch.setattr(export, "load_float_model", lambda _m: (object(), None, None))
    monkeypatch.setattr(quant, "_FLOAT_MODEL", [])
    parser = argparse.ArgumentParser()
    quant.add_quant_args(parser)
    args = parser.parse_args(["--work-dir", str(tmp_path)])
    gptq = next(r for r in quant.ROWS if r.name == "gptq int4 g64")
    first = quant._quantized_dir(gptq, args)
    assert quant._quantized_dir(gptq, args) == first and len(calls) == 1
    args.calib_data = "calib"
    assert quant._quantized_dir(gptq, args) != first and len(calls) == 2
    args.gptq_damp_percent = 0.1
    assert "damp0.1" in quant._quantized_dir(gptq, args).name and len(calls) == 3
    awq = next(r for r in quant.ROWS if r.name == "awq int4 g64")
    args.awq_search_tokens = 1024
    assert quant._quantized_dir(awq, args).name == "awq-asym-g64-calib-n64-l512-s1024"
    args.gptq_act_order = args.gptq_static_groups = args.gptq_mse_clip = True
    assert quant._quantized_dir(gptq, args).name == \
        "gptq-asym-g64-calib-n64-l512-damp0.1-act-static-mse"
    rtn_mse = next(r for r in quant.ROWS if r.name == "rtn int4 g64 asym mse")
    assert quant._quantized_dir(rtn_mse, args).name == "rtn-asym-g64-mse"
