"""Quantized KV caches (int8, fp8) through the whole engine on a tiny model with head dim 64
(the C++ kernels' vector paths): outputs complete and identical with and without
preemption (recompute and swap) and host-tier loads, which must carry the scales; the
teacher-forced logprob error against the bf16 cache is bounded."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams

QUANTIZED = ["int8", "fp8"]
MODEL = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64}


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("LlamaForCausalLM", **MODEL)


def _prompts(n: int, seed: int, shared: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(shared)]
    return [{"prompt_token_ids": (prefix if i % 3 == 0 else []) +
             [rng.randrange(3, 49152) for _ in range(rng.randint(3, 70))]} for i in range(n)]


def _greedy(llm: LLM, inputs: list[dict]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    assert all(len(t) == 12 for t in outs)
    return outs


def _block_gib(llm: LLM) -> float:
    return llm.llm_engine.kv_block_bytes / (1 << 30)


@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_host_tier_keep_quantized_outputs(path, kv, mode) -> None:
    inputs = _prompts(30, seed=5, shared=40)
    plain = LLM(str(path), dtype="float32", max_model_len=160, kv_cache_dtype=kv,
                enable_prefix_caching=False)
    worker = plain.llm_engine.executor.worker
    assert len(worker.kv_caches[0]) == 4 and worker.kv_caches[0][2].dtype == torch.float32
    expected = _greedy(plain, inputs)
    block = _block_gib(plain)
    llm = LLM(str(path), dtype="float32", max_model_len=160, kv_cache_dtype=kv,
              num_gpu_blocks_override=12, preemption_mode=mode, swap_space=64 * block,
              kv_offloading_size=256 * block)
    engine = llm.llm_engine
    for _ in range(2):  # the second pass loads what the first left in the host tier
        assert _greedy(llm, inputs) == expected
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_host_hits > 0
    assert (mode == "swap") == (stats.num_swaps > 0)


def test_copies_without_scales_would_show(path) -> None:
    """The check above can fail: host-tier loads that leave the scales behind change the
    outputs (the scales of a loaded block are then whatever the device block held)."""
    from pagoda.worker import block_copies

    inputs = _prompts(30, seed=5, shared=40)
    plain = LLM(str(path), dtype="float32", max_model_len=160, kv_cache_dtype="int8",
                enable_prefix_caching=False)
    expected = _greedy(plain, inputs)
    real = block_copies.copy_blocks

    def codes_only(src, dst, pairs, *formats):
        real([layer[:2] for layer in src], [layer[:2] for layer in dst], pairs, *formats)

    llm = LLM(str(path), dtype="float32", max_model_len=160, kv_cache_dtype="int8",
              num_gpu_blocks_override=12, kv_offloading_size=256 * _block_gib(plain))
    _greedy(llm, inputs)
    block_copies.copy_blocks = codes_only
    try:
        got = _greedy(llm, inputs)
    finally:
        block_copies.copy_blocks = real
    assert got != expected


def _prompt_logprobs(path, kv: str, inputs: list[dict]) -> torch.Tensor:
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    values = []
    for out in llm.generate(inputs, params, use_tqdm=False):
        ids = out.prompt_token_ids
        for tok, lp in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
            values.append(lp[tok].logprob)
    return torch.tensor(values)


def test_logprob_error_against_bf16_kv_is_bounded(path, capsys) -> None:
    inputs = _prompts(6, seed=9, shared=0)
    inputs = [{"prompt_token_ids": p["prompt_token_ids"] * 3} for p in inputs]
    base = _prompt_logprobs(path, "auto", inputs)
    report = {}
    for kv in QUANTIZED:
        err = (_prompt_logprobs(path, kv, inputs) - base).abs()
        report[kv] = (err.mean().item(), err.max().item())
    with capsys.disabled():
        print("\nprompt-logprob |error| vs bf16 KV (mean, max):",
              {k: tuple(round(x, 4) for x in v) for k, v in report.items()})
    # NOTE: bounds about twice the measured errors (int8 0.067 / 0.75, fp8 0.26 / 1.72): this
    # random-weight model's attention is far peakier than a trained one's (SmolLM2-135M on
    # real text: 0.060 / 1.05 and 0.107 / 2.87); a cache read with wrong scales or rows is
    # off by several nats. int8 keeps ~7 bits per value, e4m3 ~4: fp8 is allowed more.
    assert report["int8"][0] < 0.15 and report["int8"][1] < 1.5
    assert report["fp8"][0] < 0.5 and report["fp8"][1] < 3.5
    assert report["fp8"][0] > report["int8"][0] > 0


@pytest.mark.parametrize(("kv", "compression"), [("auto", "int8"), ("auto", "int4"),
                                                 ("int8", "int4"), ("int8", "int8")])
def test_compressed_host_pools_complete_and_hold_more(path, kv, compression) -> None:
    """Swapped-out and host-tier blocks kept compressed: every request completes, the
    pools hold more blocks per GiB, and the compressed history comes back (host hits). An
    int8 pool under an int8 cache is the same format: outputs identical to no compression."""
    inputs = _prompts(30, seed=5, shared=40)
    common = {"dtype": "float32", "max_model_len": 160, "kv_cache_dtype": kv,
              "num_gpu_blocks_override": 12, "preemption_mode": "swap", "swap_space": 0.002,
              "kv_offloading_size": 0.004}
    plain = LLM(str(path), **common)
    expected = _greedy(plain, inputs)
    llm = LLM(str(path), **common, kv_host_compression=compression)
    engine = llm.llm_engine
    host = engine.executor.worker.host_tier_kv_caches[0]
    assert host[0].dtype == (torch.int8 if compression == "int8" else torch.uint8)
    ratio = plain.llm_engine.host_block_bytes / engine.host_block_bytes
    # Bytes per 64-dim head of a float32 cache: 256; int8 codes + scale: 68; int4: 36.
    assert ratio == pytest.approx({("auto", "int8"): 256 / 68, ("auto", "int4"): 256 / 36,
                                   ("int8", "int4"): 68 / 36, ("int8", "int8"): 1.0}[
                                       (kv, compression)])
    assert engine.kv_cache_manager.host_tier.num_slots == pytest.approx(
        plain.llm_engine.kv_cache_manager.host_tier.num_slots * ratio, rel=0.01)
    for _ in range(2):
        got = _greedy(llm, inputs)
    stats = engine.get_stats()
    assert stats.num_swaps > 0 and stats.prefix_cache_host_hits > 0
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    if kv == compression:
        assert got == expected
    elif compression == "int8":
        # NOTE: lossy: a reply may drift after a compressed block comes back, most don't
        # (int4 drifts in most replies of this peaky random model: only completion counts).
        assert same >= len(inputs) // 2
