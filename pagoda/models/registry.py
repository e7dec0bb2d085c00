"""Model architectures by the name in config.json's `architectures`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import PretrainedConfig

ModelFactory = Callable[[PretrainedConfig], nn.Module]
_MODELS: dict[str, ModelFactory] = {}


def register_model(*names: str) -> Callable[[ModelFactory], ModelFactory]:
    def wrap(factory: ModelFactory) -> ModelFactory:
        for name in names:
            _MODELS[name] = factory
        return factory

    return wrap


def supported_architectures() -> list[str]:
    _import_models()
    return sorted(_MODELS)


def resolve_model(hf_config: PretrainedConfig, source: str = "") -> ModelFactory:
    """The factory for the first architecture in the config that pagoda implements."""
    _import_models()
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    where = f" in {source}" if source else ""
    raise ValueError(
        f"unsupported architecture {archs or '(none given)'}{where}; "
        f"pagoda supports {supported_architectures()}"
    )


def _import_models() -> None:
    # NOTE: importing the modules runs their @register_model decorators.
    from pagoda.models import llama  # noqa: F401
