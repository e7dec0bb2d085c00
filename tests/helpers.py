"""Shared test helpers: tiny seeded random-weight HF checkpoints built with transformers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

# NOTE: architecture -> transformers model_type; these are the tiny models tests may build.
TINY_ARCHS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    # NOTE: matches the embedded SmolLM2 tokenizer, so every token id is a valid row.
    "vocab_size": 49152,
    "max_position_embeddings": 512,
    # NOTE: a large init std makes logits far from flat, so greedy outputs differ by prompt.
    "initializer_range": 0.2,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}


def make_tiny_config(arch: str, **config_overrides: Any) -> transformers.PretrainedConfig:
    """Return the tiny config for `arch` with `config_overrides` applied on top."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_ARCHS)}")
    kwargs = {**TINY_CONFIG, **config_overrides}
    config = transformers.AutoConfig.for_model(TINY_ARCHS[arch], **kwargs)
    config.architectures = [arch]
    return config


def _perturb_defaults(model: torch.nn.Module) -> None:
    """Randomise the parameters transformers initialises to constants (norms to 1, biases to 0).

    NOTE: otherwise a loader or model that drops a norm weight or a bias still matches the
    oracle, and the test proves nothing.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))


def make_tiny_model(
    path: Path,
    arch: str,
    tokenizer_dir: Path,
    dtype: torch.dtype = torch.float32,
    *,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Save a tiny seeded random-weight `arch` model (safetensors) plus tokenizer into `path`.

    Same arguments give bit-identical weights (seed 0). `max_shard_size` forces sharding.
    Returns `path`.
    """
    config = make_tiny_config(arch, **config_overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_defaults(model)
    model = model.to(dtype).eval()
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    for item in Path(tokenizer_dir).iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    return path


def spy_on_extension(ext: Any, monkeypatch: Any) -> list[str]:
    """Put a spy in front of the loaded C++ extension `ext` (as `cpu_kernels._module`,
    until `monkeypatch` undoes it); returns the list of the names looked up on it since,
    in order: which kernels a path called."""
    from pagoda.ops import cpu_kernels

    calls: list[str] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(ext, name)

    monkeypatch.setattr(cpu_kernels, "_module", Spy())
    return calls


def bf16_packs() -> bool:
    """Whether oneDNN packs a bf16 linear weight here (it refuses on a CPU without AVX-512:
    UnquantizedLinearMethod then keeps the dense weight on F.linear)."""
    from pagoda.quant.unquantized import can_pack, pack_weight

    probe = torch.zeros(16, 16, dtype=torch.bfloat16)
    return can_pack(probe) and pack_weight(probe) is not None


def panels_as_dense(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A `dequantize_panels` copy (ops/quant_cpu.py) back as [n, k]: panel p's 32-column block
    b holds w[16 p + r, 32 b + 2 i + t] at [i][2 r + t]. Asserts its padding rows and columns
    are zeros."""
    count, kp = panels.shape[0], panels.shape[1] // 16
    w = panels.view(count, kp // 32, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(count * 16, kp)
    assert not w[n:].any() and not w[:, k:].any()
    return w[:n, :k]
