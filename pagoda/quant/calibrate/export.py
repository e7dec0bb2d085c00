"""`pagoda quantize`'s input and output: the float model, and the quantized Hugging Face
directory in the method's own standard format (no pagoda-specific field).

  gptq, rtn  GPTQ v1 (AutoGPTQ / GPTQModel): per linear `qweight`, `qzeros` (zero - 1),
             `scales` float16 [G, N], `g_idx` int32 [K]; quantization_config {quant_method
             gptq, bits, group_size, desc_act, sym, checkpoint_format gptq, ...}
  awq        AutoAWQ GEMM: `qweight` [K, N/8], `qzeros` [G, N/8] interleaved, `scales`
             float16 [G, N]; quantization_config {quant_method awq, bits, group_size,
             zero_point, version gemm}

Every other tensor (embeddings, norms, lm_head, biases) is written as the model holds it,
in the source checkpoint's dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from pagoda.quant.calibrate.rtn import QuantizedTensor
from pagoda.quant.calibrate.runner import CalibrationConfig
from pagoda.quant.packing import pack_awq, pack_gptq

# Files of a model directory that are not the tokenizer's (never copied).
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".gguf", ".pth")
_NOT_TOKENIZER_NAMES = ("config.json", "model.safetensors.index.json",
                        "pytorch_model.bin.index.json", "quantize_config.json",
                        "quant_config.json")


def load_float_model(model: str | None) -> tuple[Any, Any, Path | None]:
    """(transformers model in float32, tokenizer, source directory or None for a GGUF).
    `model`: an HF safetensors directory, a .gguf file, or None for the embedded SmolLM2
    GGUF (transformers dequantizes a GGUF's blocks to float32)."""
    import transformers

    from pagoda.models.loader import default_model_path

    path = default_model_path() if model is None else Path(model)
    if path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        directory: Path | None = None
        root = path.parent
    else:
        kwargs, directory, root = {}, path, path
    tokenizer = transformers.AutoTokenizer.from_pretrained(root, **kwargs)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        root, dtype=torch.float32, **kwargs).eval()
    # NOTE: a GGUF-loaded model carries transformers' GGUF quantizer, which save paths and
    # configs must not see (the weights are plain float32 now).
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    return hf_model, tokenizer, directory


def quantization_config(cfg: CalibrationConfig) -> dict[str, Any]:
    spec = cfg.spec
    if cfg.method == "awq":
        return {"quant_method": "awq", "bits": spec.bits, "group_size": spec.group_size,
                "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size,
            "desc_act": cfg.act_order, "sym": spec.sym, "checkpoint_format": "gptq",
            "damp_percent": cfg.damp_percent, "true_sequential": cfg.method == "gptq",
            "static_groups": cfg.static_groups}


def _packed(qt: QuantizedTensor, method: str) -> dict[str, torch.Tensor]:
    codes, zeros = qt.codes.T.contiguous(), qt.zeros.T.contiguous()
    scales = qt.scales.T.to(torch.float16).contiguous()
    if method == "awq":
        qweight, qzeros = pack_awq(codes, zeros)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    qweight, qzeros = pack_gptq(codes, zeros, qt.spec.bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales,
            "g_idx": qt.g_idx.to(torch.int32).contiguous()}


def checkpoint_tensors(model: Any, quantized: dict[str, QuantizedTensor], method: str,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor the quantized checkpoint holds, by HF name."""
    tensors: dict[str, torch.Tensor] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, value in model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if prefix in quantized or (tied and name == "lm_head.weight"):
            continue
        tensors[name] = value.detach().to(dtype).contiguous().clone()
    for prefix, qt in quantized.items():
        for suffix, t in _packed(qt, method).items():
            tensors[f"{prefix}.{suffix}"] = t
    return tensors


def write_checkpoint(model: Any, tokenizer: Any, quantized: dict[str, QuantizedTensor],
                     cfg: CalibrationConfig, out_dir: str | Path,
                     source_dir: Path | None, dtype: torch.dtype) -> Path:
    """Write OUT_DIR: model.safetensors, config.json with quantization_config, tokenizer."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, quantized, cfg.method, dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    # NOTE: a config built from GGUF metadata names no architecture; loaders need one.
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["quantization_config"] = quantization_config(cfg)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source_dir is None:
        tokenizer.save_pretrained(out)
    else:
        for item in source_dir.iterdir():
            if (item.is_file() and not item.name.endswith(_NOT_TOKENIZER)
                    and item.name not in _NOT_TOKENIZER_NAMES):
                shutil.copy(item, out / item.name)
    return out
