"""bfloat16 end to end with pagoda's CPU fast paths (packed linear weights, fused element-wise
kernels, the decode-attention kernel) against the same engine on plain PyTorch ops, both
scored against transformers in float32: the fast paths must not cost accuracy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams
from pagoda.ops import cpu_kernels
from tests.helpers import spy_on_extension

# (arch, config overrides, engine kwargs): plain; a sliding window shorter than the prompt;
# a prompt prefilled in chunks that read earlier chunks back from the paged cache.
CASES = [
    ("LlamaForCausalLM", {}, {}),
    ("Qwen2ForCausalLM", {}, {}),
    ("MistralForCausalLM", {"sliding_window": 32}, {}),
    ("LlamaForCausalLM", {}, {"max_num_batched_tokens": 48, "max_num_seqs": 4}),
    # Head dim 64: prefill chunks through the tiled prefill kernel (16 has none).
    ("LlamaForCausalLM", {"head_dim": 64}, {"max_num_batched_tokens": 48, "max_num_seqs": 4}),
    ("MistralForCausalLM", {"head_dim": 64, "sliding_window": 32}, {}),
]


def _prompt_logprobs(model_dir: Path, ids: list[int], **engine_kwargs) -> torch.Tensor:
    """pagoda bf16: the logprob of each prompt token after the first, then 8 greedy steps."""
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, **engine_kwargs)
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    lps = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
    return torch.tensor(lps, dtype=torch.float64), out.outputs[0].token_ids


@pytest.mark.parametrize(("arch", "overrides", "engine_kwargs"), CASES)
def test_fast_paths_are_as_accurate_as_pytorch_ops(
    arch: str, overrides: dict, engine_kwargs: dict, tiny_model,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if cpu_kernels.kernels_disabled() or cpu_kernels.load_extension() is None:
        pytest.skip("the C++ extension is unavailable here")
    model_dir = tiny_model(arch, **overrides)
    ids = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    oracle = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]

    with monkeypatch.context() as m:
        calls = spy_on_extension(cpu_kernels.load_extension(), m)
        fast, fast_tokens = _prompt_logprobs(model_dir, ids, **engine_kwargs)
    # NOTE: the tiled prefill kernel needs AVX-512 or AVX2 + FMA; elsewhere prefill rows take
    # the decode one.
    tiled_here = cpu_kernels.kernel_for("paged_prefill_attention") is not None
    assert ("paged_prefill_attention" in calls) == (overrides.get("head_dim") == 64 and tiled_here)
    # NOTE: decode-only steps call the decode kernel from inside the one-call stack.
    assert "paged_decode_attention" in calls or "decoder_decode_stack" in calls
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setenv("PAGODA_DISABLE_PACKED_LINEAR", "1")
    plain, plain_tokens = _prompt_logprobs(model_dir, ids, **engine_kwargs)

    fast_err = (fast - oracle).abs().mean().item()
    plain_err = (plain - oracle).abs().mean().item()
    assert plain_err > 0  # bf16 is not exact, so the comparison means something
    assert fast_err <= 1.25 * plain_err, (fast_err, plain_err)
    assert len(fast_tokens) == len(plain_tokens) == 8
