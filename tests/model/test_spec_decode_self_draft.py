"""The quantized self-draft (spec_decode/self_draft.py), greedy float32: output identical
with speculation on and off (tiny Llama, the embedded SmolLM2 GGUF; rtn and gptq; under
forced preemption), drafts accepted and counted, the draft's memory no more than its
quantized linears, bad configs refused at start naming the field."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.ops import quant_cpu, wquant
from pagoda.spec_decode.self_draft import SelfDraftLinearMethod, draft_extra_weight_bytes
from tests.model.test_perplexity import TEXT
from tests.model.test_spec_decode import (
    MAX_TOKENS,
    SMOLLM2_PROMPT,
    prompts_for,
    run,
    small,  # noqa: F401 (a fixture)
    smollm2_expected,  # noqa: F401 (a fixture)
)

RTN = {"method": "quantized_self_draft", "num_speculative_tokens": 3, "quantization": "rtn",
       "adaptive": False}


@pytest.fixture
def calib_file(tmp_path) -> str:
    path = tmp_path / "calib.txt"
    path.write_text(TEXT * 3)
    return str(path)


def self_draft_linears(model) -> list:
    return [m for m in model.modules()
            if isinstance(getattr(m, "quant_method", None), SelfDraftLinearMethod)]


@pytest.mark.parametrize("engine_kwargs", [{}, {"num_gpu_blocks_override": 10,
                                                "max_model_len": 96}])
def test_rtn_greedy_identical_and_drafts_accepted(small, engine_kwargs) -> None:  # noqa: F811
    path, prompts, expected = small
    got, stats = run(path, prompts, speculative_config=RTN, **engine_kwargs)
    assert got == expected
    # NOTE: int4 weights are not the target's: most drafts but not all are accepted.
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens_per_pos[0] > 0
    if engine_kwargs:
        assert stats.num_preemptions > 0


def test_gptq_greedy_identical(tiny_model, calib_file) -> None:
    # NOTE: the full vocabulary: the calibration text's token ids must be rows of the table.
    path = tiny_model("LlamaForCausalLM")
    prompts = prompts_for(49152, 4, seed=5)
    expected, _ = run(path, prompts)
    spec = {**RTN, "quantization": "gptq", "calib_data": calib_file, "bits": 8,
            "group_size": 32}
    got, stats = run(path, prompts, speculative_config=spec)
    assert got == expected
    assert stats.spec_decode_num_accepted_tokens > 0


def test_draft_holds_only_its_quantized_linears(small) -> None:  # noqa: F811
    path, _, _ = small
    llm = LLM(str(path), dtype="float32", speculative_config=RTN)
    worker = llm.llm_engine.executor.worker
    target, draft = worker.model, worker.runner.proposer.model
    linears = self_draft_linears(draft)
    assert len(linears) == 4 * target.spec.num_layers
    assert all("weight" not in m._parameters for m in linears)
    assert all(isinstance(m.quant_weight, wquant.GroupQuantWeight) for m in linears)
    assert draft.model.embed_tokens is target.model.embed_tokens
    assert draft.lm_head is target.lm_head and draft.rotary is target.rotary
    from pagoda.benchmarks.quant import weight_bytes

    quantized = sum(weight_bytes(m) for m in linears)
    assert draft_extra_weight_bytes(draft, target) == quantized
    dense = sum(m.weight.numel() * m.weight.element_size() for name, m in target.named_modules()
                if ".layers." in name and hasattr(m, "quant_method"))
    assert quantized < dense / 3  # float32: 1 byte a code, scales and zeros per 64


def test_smollm2_gguf_greedy_identical(smollm2_expected) -> None:  # noqa: F811
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(dtype="float32", speculative_config=RTN)
    got = llm.generate(SMOLLM2_PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == smollm2_expected
    stats = llm.llm_engine.get_stats()
    # NOTE: the target's own weights: its int4 copy agrees with it on most tokens.
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 2
    llm.llm_engine.check_integrity()


def test_first_layers_draft_greedy_identical(small) -> None:  # noqa: F811
    """num_layers: the draft is the target's first layers, then its norm and LM head."""
    path, prompts, expected = small
    llm = LLM(str(path), dtype="float32", speculative_config={**RTN, "num_layers": 1})
    worker = llm.llm_engine.executor.worker
    target, draft = worker.model, worker.runner.proposer.model
    assert (target.spec.num_layers, draft.spec.num_layers) == (2, 1)
    assert len(self_draft_linears(draft)) == 4
    assert draft.model.norm is target.model.norm and draft.lm_head is target.lm_head
    assert len(worker.runner.proposer.kv_caches) == 1
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[o.outputs[0].token_ids] for o in outs] == expected
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize(("change", "field"), [
    ({"group_size": 48}, "speculative_config.group_size"),
    ({"num_layers": 3}, "speculative_config.num_layers"),
    ({"num_layers": 0}, "speculative_config.num_layers"),
    ({"quantization": "gptq", "calib_data": "/nonexistent/calib.txt"},
     "speculative_config.calib_data"),
])
def test_bad_config_refused_at_start(small, change, field) -> None:  # noqa: F811
    path, _, _ = small
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LLM(str(path), dtype="float32", speculative_config={**RTN, **change})


def test_quantized_target_refused(small, tmp_path) -> None:  # noqa: F811
    from pagoda.quant.calibrate.command import quantize_to_dir

    path, _, _ = small
    quantized = tmp_path / "rtn"
    quantize_to_dir(str(path), quantized, "rtn", 4, 32)
    with pytest.raises(ValueError, match=r"quantized_self_draft quantizes a dense checkpoint"):
        LLM(str(quantized), dtype="float32", speculative_config=RTN)


def test_bf16_draft_runs_the_kernels(small) -> None:  # noqa: F811
    """bf16, the dtype the CPU kernels take (their layout is built): drafts are accepted.
    NOTE: no equality with speculation off here: a bf16 forward of k + 1 rows need not
    round like one of a single row; exactness is float32's (the tests above)."""
    path, prompts, _ = small
    llm = LLM(str(path), dtype="bfloat16", speculative_config=RTN)
    draft = llm.llm_engine.executor.worker.runner.proposer.model
    if quant_cpu.resolve() is not None:
        assert all(quant_cpu.NAME in m.quant_weight.kernel_data
                   for m in self_draft_linears(draft))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params,
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0

