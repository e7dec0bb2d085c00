"""Block sizes: every power of two the config accepts runs the kernels and the reference
alike (tiles of 16 positions over blocks that divide the tile or span several tiles);
anything else is refused when the engine starts."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.model.test_llama_family_vs_hf import (
    assert_matches,
    hf_greedy,
    pagoda_greedy,
    random_prompts,
)


@pytest.mark.parametrize("block_size", [0, 3, 24])
def test_unsupported_block_size_is_refused_at_start(block_size: int, tiny_model) -> None:
    with pytest.raises(ValueError, match=f"block_size must be a power of two, got {block_size}"):
        LLM(str(tiny_model("LlamaForCausalLM")), dtype="float32", block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 32])
def test_float32_block_sizes_match_transformers(block_size: int, tiny_model) -> None:
    path = tiny_model("MistralForCausalLM", sliding_window=24)
    prompts = random_prompts(5, seed=block_size, hi=50)
    outs, _ = pagoda_greedy(path, prompts, block_size=block_size, max_model_len=128,
                            max_num_batched_tokens=40)
    assert_matches(outs, hf_greedy(path, prompts))


def _bf16_run(path, prompts, block_size: int, max_tokens: int = 8,
              **engine_kwargs) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(path), dtype="bfloat16", block_size=block_size, max_model_len=128,
              max_num_batched_tokens=40, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
        for o in outs
    ]


def test_bf16_kernels_give_the_same_result_for_every_block_size(tiny_model) -> None:
    """The kernel walks positions in tiles of 16 whatever the block size, and the reference
    gathers the same context: bit-identical either way."""
    path = tiny_model("LlamaForCausalLM")
    prompts = random_prompts(4, seed=3, hi=60)
    want = _bf16_run(path, prompts, 16)
    for block_size in (1, 8, 32):
        assert _bf16_run(path, prompts, block_size) == want, block_size
    assert torch.tensor([lp for _, lps in want for lp in lps]).isfinite().all()


def test_block_placement_changes_no_output(tiny_model) -> None:
    """Where a request's blocks lie (kv_growth_reserve_blocks: consecutive runs, or one
    block per run without it) changes which memory the kernels read, never what they
    compute: bit-identical tokens and logprobs."""
    path = tiny_model("LlamaForCausalLM")
    prompts = random_prompts(6, seed=5, hi=60)
    want = _bf16_run(path, prompts, 4, max_tokens=24, kv_growth_reserve_blocks=0)
    for reserve in (1, 8):
        got = _bf16_run(path, prompts, 4, max_tokens=24, kv_growth_reserve_blocks=reserve)
        assert got == want, reserve
