"""The engine end to end on the GPU in float32: greedy tokens equal transformers' on the
same device, alone and in a batch, with chunked prefill and a sliding window."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams
from tests.gpu.conftest import DEVICE
from tests.model.test_llama_family_vs_hf import random_prompts

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
MAX_TOKENS = 12


def _hf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(DEVICE).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([p], device=DEVICE),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=DEVICE),
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                pad_token_id=0,
            )
        outs.append(seq[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize(
    ("arch", "overrides", "engine_kwargs"),
    [
        ("LlamaForCausalLM", {}, {}),
        ("Qwen3ForCausalLM", {}, {}),
        ("MistralForCausalLM", {"sliding_window": 16}, {}),
        ("LlamaForCausalLM", {}, {"max_num_batched_tokens": 32, "block_size": 8}),
    ],
)
def test_greedy_matches_transformers(arch, overrides, engine_kwargs, tiny_model) -> None:
    path = tiny_model(arch, **overrides)
    prompts = random_prompts(6, seed=11, hi=60)
    llm = LLM(str(path), dtype="float32", device=DEVICE.type, max_model_len=256,
              **engine_kwargs)
    assert llm.llm_engine.device.type == DEVICE.type
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(path, prompts)
    assert llm.llm_engine.kv_cache_manager.usage == 0.0
