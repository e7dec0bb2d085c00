"""The ops registry: per-device dispatch to a kernel or the reference, and the boundary
(layers and backends reach kernels only through ops)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from pagoda import ops
from pagoda.ops.registry import Kernel, Op, define_op

ROOT = Path(__file__).resolve().parents[2] / "pagoda"


def _op_with(kernels: list[Kernel]) -> Op:
    op = Op("test_op", lambda x: ("reference", x))
    for k in kernels:
        op.register("cpu", k)
    return op


def test_first_accepting_kernel_runs_else_the_reference() -> None:
    bf16 = frozenset({torch.bfloat16})
    flags = {"available": True}
    op = _op_with([
        Kernel("contig", lambda h, x: (h, x), bf16,
               lambda: "contig" if flags["available"] else None, lambda x: x.is_contiguous()),
        Kernel("any", lambda h, x: (h, x), bf16, lambda: "any"),
    ])
    x = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert op(x)[0] == "contig"
    assert op(x.t())[0] == "any"  # the first kernel declines this call
    flags["available"] = False
    op.refresh()  # calls keep their resolution until then (the engine start)
    assert op(x)[0] == "any" and op.kernel_for(x).name == "any"
    assert op(x.float())[0] == "reference"  # no kernel for the dtype
    assert op(x.to("meta"))[0] == "reference"  # nor for the device
    assert op.select(x)(x)[0] == "any" and op.select(x.float()) is op.reference


def test_every_op_has_a_reference_and_no_cuda_kernel_but_fp8s() -> None:
    assert set(ops.OPS) == {
        "rms_norm", "fused_add_rms_norm", "silu_and_mul", "argmax_rows", "race_rows",
        "truncate_rows", "penalize_rows",
        "rotary_and_cache", "write_kv", "paged_attention", "paged_prefill_attention", "wq_linear", "int8_linear",
        "fp8_linear", "gguf_linear",
    }
    for op in ops.OPS.values():
        assert callable(op.reference)
        cuda = [k.name for k in op._kernels.get("cuda", ())]
        assert cuda == (["scaled_mm"] if op.name == "fp8_linear" else [])


def test_an_op_is_defined_once() -> None:
    with pytest.raises(ValueError, match="already defined"):
        define_op("rms_norm", lambda x: x)


def test_disable_env_var_sends_every_op_to_the_reference(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.zeros(2, 8, dtype=dtype)
        assert all(op.kernel_for(x) is None for op in ops.OPS.values())


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("area", ["layers", "attention", "models"])
def test_layers_and_backends_import_ops_not_kernels(area: str) -> None:
    for path in sorted((ROOT / area).glob("*.py")):
        bad = {n for n in _imports(path) if "cpu_kernels" in n or n.startswith("pagoda.ops.cpu")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_a_call_keeps_its_resolved_kernel_until_refresh(monkeypatch) -> None:
    from pagoda.ops import registry

    calls: list[str] = []
    op = Op("probe_op", lambda x: "reference")
    handle = {"value": "ext"}
    op.register(
        "cpu",
        Kernel("k", lambda h, x: h, frozenset({torch.float32}),
               lambda: calls.append("resolve") or handle["value"]),
    )
    x = torch.zeros(2)
    assert op(x) == "ext" and op(x) == "ext"
    assert calls == ["resolve"]  # resolved once, not per call
    handle["value"] = None  # the kernel becomes unavailable (e.g. disabled by the env)
    assert op(x) == "ext"  # still the cached resolution ...
    monkeypatch.setitem(registry.OPS, "probe_op", op)
    registry.refresh()
    assert op(x) == "reference"  # ... until the engine start re-resolves
    assert op(torch.zeros(2, dtype=torch.bfloat16)) == "reference"  # no kernel for the dtype
