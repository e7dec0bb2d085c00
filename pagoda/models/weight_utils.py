"""Loading checkpoint tensors into a model by name, through each parameter's weight_loader.

A checkpoint name is split into module path and parameter (`model.layers.3.mlp.up_proj` +
`weight`). If the module's own name (`up_proj`) is one of the parts in the model's
`packed_modules_mapping` (`{"gate_up_proj": ["gate_proj", "up_proj"]}`), the tensor goes
to the packed module's parameter (`model.layers.3.mlp.gate_up_proj.weight`) with the
shard id the packed module lists at that position (`module.shard_ids[1]`); otherwise the
name must be the parameter's own. Names are compared whole, never by substring.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pagoda.layers.linear import load_whole
from pagoda.models.loader import CheckpointError

ShardId = Any  # what a packed module's loader takes: "q" / "k" / "v", 0 / 1, ...


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """The loader of parameters that have none (norms): copy the whole tensor."""
    load_whole(param, loaded_weight)


def load_weights_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: Mapping[str, list[str]],
    ignored: frozenset[str] = frozenset(),
    source: str = "",
) -> None:
    """Load every (checkpoint name, tensor) into `model`; names in `ignored` are skipped.

    Raises CheckpointError naming the tensor (and `source`) for an unexpected name, a
    tensor given twice, a wrong shape, and, at the end, every expected tensor not given.
    """
    where = f" in {source}" if source else ""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    parts = {part: (fused, i) for fused, names in packed_modules_mapping.items()
             for i, part in enumerate(names)}
    loaded: dict[str, set[ShardId]] = {}
    for name, tensor in weights:
        if name in ignored:
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, child = module_path.rpartition(".")
        shard_id = None
        if child in parts:
            fused, index = parts[child]
            module_path = f"{parent}.{fused}" if parent else fused
            module = modules.get(module_path)
            shard_id = module.shard_ids[index] if hasattr(module, "shard_ids") else None
        target = f"{module_path}.{leaf}"
        if target not in params or (child in parts and shard_id is None):
            raise CheckpointError(f"unexpected tensor {name!r}{where}")
        done = loaded.setdefault(target, set())
        if shard_id in done or (None in done) or (shard_id is None and done):
            raise CheckpointError(f"tensor {name!r}{where} is given twice")
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        except ValueError as exc:
            raise CheckpointError(f"tensor {name!r}{where} {exc}") from exc
        done.add(shard_id)
    missing = _missing_names(params, modules, packed_modules_mapping, loaded)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint{where} is missing tensors {shown}{more}")


def _missing_names(
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    packed_modules_mapping: Mapping[str, list[str]],
    loaded: dict[str, set[ShardId]],
) -> list[str]:
    """Checkpoint names (the unpacked parts for packed modules) that were never loaded."""
    missing = []
    for target in params:
        done = loaded.get(target, set())
        module_path, _, leaf = target.rpartition(".")
        parent, _, child = module_path.rpartition(".")
        shard_ids = getattr(modules[module_path], "shard_ids", None)
        if child not in packed_modules_mapping or shard_ids is None:
            if not done:
                missing.append(target)
            continue
        if None in done:
            continue
        for part, shard_id in zip(packed_modules_mapping[child], shard_ids):
            if shard_id not in done:
                missing.append(f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}")
    return missing
