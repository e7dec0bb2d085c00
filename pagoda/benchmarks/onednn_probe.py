"""What oneDNN runs for pagoda's GEMMs: its ISA (AVX-512 bf16 or AMX) and the packed
weight layout, read from `ONEDNN_VERBOSE=1` in a child process.

The child (`python -m pagoda.benchmarks.onednn_probe ...`) packs weights of the model's
projection shapes the way `quant/unquantized.py` does and multiplies at 1 and 64 rows;
the parent parses the verbose lines. A child because oneDNN reads the variable once, when
it first runs, and its lines go to the process's stdout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

PROBE_ROWS = (1, 64)


@dataclass(frozen=True, slots=True)
class OneDnnExec:
    """One executed primitive: kind (inner_product, matmul, reorder), implementation
    (e.g. brg_matmul:avx512_core_amx), its ISA, the weight's layout tag and the shape."""

    kind: str
    implementation: str
    isa: str
    weight_layout: str
    problem: str


def parse_verbose(text: str) -> tuple[str | None, list[OneDnnExec]]:
    """(oneDNN's ISA info line, the executed primitives) of ONEDNN_VERBOSE output.

    Lines look like `onednn_verbose,v1,primitive,exec,cpu,KIND,IMPL,PROP,MEMORY DESCS,
    ATTRS,AUX,PROBLEM,MS` (v1 format); older ones lack `v1,primitive,`."""
    isa_info, execs = None, []
    for line in text.splitlines():
        if not line.startswith("onednn_verbose"):
            continue
        fields = line.split(",")
        if "info" in fields[:3] and ",isa:" in line:
            # NOTE: the ISA's description itself may hold commas.
            isa_info = line.partition(",isa:")[2]
            continue
        if "exec" not in fields[:4]:
            continue
        at = fields.index("exec") + 1
        if len(fields) < at + 5 or fields[at] != "cpu":
            continue
        kind, impl, mds = fields[at + 1], fields[at + 2], fields[at + 4]
        problem = fields[-2] if len(fields) >= at + 8 else ""
        execs.append(OneDnnExec(kind, impl, impl.partition(":")[2] or impl,
                                _layout(mds, "wei" if kind != "reorder" else "dst"), problem))
    return isa_info, execs


def _layout(mds: str, arg: str) -> str:
    """The layout tag of memory descriptor `arg` (`wei:bf16::blocked:AB16b64a2b::f0`)."""
    for md in mds.split():
        if md.startswith(arg + ":"):
            parts = md.split(":")
            return parts[4] if len(parts) > 4 else md
    return ""


def probe(shapes: list[tuple[int, int]], dtype: str = "bfloat16",
          timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the child over (out, in) weight shapes; oneDNN's ISA line and the GEMM
    primitives it executed (reorders of the packing left out), or an "error"."""
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    args = [sys.executable, "-m", "pagoda.benchmarks.onednn_probe", dtype]
    args += [f"{o}x{i}" for o, i in shapes]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the probe took over {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": f"the probe exited {proc.returncode}: {proc.stderr[-500:]}"}
    isa_info, execs = parse_verbose(proc.stdout)
    gemms = [asdict(e) for e in execs if e.kind != "reorder"]
    if not gemms:
        return {"isa_info": isa_info, "gemms": [],
                "error": "no GEMM primitive ran through oneDNN (weights not packed?)"}
    return {"isa_info": isa_info, "gemms": gemms}


def _child(dtype_name: str, shapes: list[str]) -> None:
    import torch

    from pagoda.quant.unquantized import can_pack, pack_weight, packed_linear

    dtype = getattr(torch, dtype_name)
    for shape in shapes:
        out_features, in_features = (int(x) for x in shape.split("x"))
        weight = torch.randn(out_features, in_features, dtype=dtype)
        packed = pack_weight(weight) if can_pack(weight) else None
        if packed is None:
            print(f"probe: {shape} {dtype_name} does not pack", file=sys.stderr)
            continue
        for rows in PROBE_ROWS:
            packed_linear(torch.randn(rows, in_features, dtype=dtype), packed)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2:])
