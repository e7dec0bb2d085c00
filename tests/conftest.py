"""Session fixtures: the embedded SmolLM2 tokenizer on disk and a tiny-model factory."""

from __future__ import annotations

import os

# NOTE: before anything imports torch (see pagoda/omp_env.py for why).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers

from pagoda.models.loader import default_model_path
from tests.helpers import make_tiny_model


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """transformers' tokenizer of the embedded SmolLM2 GGUF, read once (the oracle; do not
    change it). `PAGODA_TEST_TOKENIZER_DIR` may name that tokenizer saved by save_pretrained
    instead, for a machine without the 98 MB GGUF (the GPU check's)."""
    if saved := os.environ.get("PAGODA_TEST_TOKENIZER_DIR"):
        return transformers.AutoTokenizer.from_pretrained(saved)
    gguf_path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def tokenizer_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer: transformers.PreTrainedTokenizerBase
) -> Path:
    """A folder holding the embedded SmolLM2 tokenizer (with its chat template), saved once."""
    tokenizer = smollm2_hf_tokenizer
    assert tokenizer.chat_template, "embedded GGUF lost its chat template"
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[..., Path]:
    """Factory `tiny_model(arch, **overrides) -> Path`, cached per (arch, overrides).

    Overrides go into the config (e.g. tie_word_embeddings=True, num_key_value_heads=1),
    plus `dtype` and `max_shard_size`, which go to make_tiny_model.
    """
    cache: dict[str, Path] = {}

    def build(arch: str, **overrides: Any) -> Path:
        key = arch + json.dumps(overrides, sort_keys=True, default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp(arch.removesuffix("ForCausalLM").lower())
            cache[key] = make_tiny_model(path, arch, tokenizer_dir, **overrides)
        return cache[key]

    return build


@pytest.fixture(autouse=True)
def _fresh_ops_dispatch():
    """Each test resolves the ops' kernels afresh, as each engine start does: a test that
    mocks CPU flags or the environment must not leave its resolution to the next one."""
    from pagoda.ops import registry

    registry.refresh()
    yield
    registry.refresh()


@pytest.fixture
def wide_gemm(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], int | None]:
    """set(mode) -> the threshold: PAGODA_WIDE_GEMM=mode for this test, decided afresh
    (ops/gemm_dispatch.py decides once per process); forgotten again afterwards."""
    from pagoda.ops import gemm_dispatch

    def set_mode(mode: str) -> int | None:
        monkeypatch.setenv("PAGODA_WIDE_GEMM", mode)
        gemm_dispatch.reset()
        return gemm_dispatch.configure()

    yield set_mode
    gemm_dispatch.reset()
