"""The printout of `pagoda bench profile` (profile.py builds the report dict)."""

from __future__ import annotations

from typing import Any

from pagoda.benchmarks.step_timer import PHASES


def _machine(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    flags = " ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["isa"].items())
    omp = ", ".join(f"{k}={v}" for k, v in m["openmp_env"].items() if v is not None) or "unset"
    return [
        "== pagoda bench profile: machine ==",
        (f"cpu     : {m['cpu']}, {m['num_cpus']} CPUs, torch {m['torch']} "
        f"({m['torch_threads']} threads)"),
        f"isa     : {flags}",
        f"amx     : {'usable' if m['amx']['usable'] else 'not used'} ({m['amx']['reason']})",
        f"openmp  : {omp}",
        f"model   : {report['model']}, dtype {report['dtype']}",
        ("NOTE: other processes on this machine change absolute times; compare phases "
        "within one run."),
    ]


def _case(title: str, case: dict[str, Any]) -> list[str]:
    lines = [(f"== {title}: {case['tokens_per_step']:.0f} tokens/step, "
             f"{case['num_steps']} timed steps =="),
             f"{'phase':<22}{'ms/step':>10}{'share':>8}"]
    total = case["step_ms"] or 1.0
    for phase in PHASES:
        ms = case["phases_ms"][phase]
        lines.append(f"{phase:<22}{ms:>10.2f}{ms / total:>8.1%}")
    lines.append(f"{'step total':<22}{case['step_ms']:>10.2f}   "
                 f"({case['tokens_per_s']:,.0f} tokens/s)")
    if (one_call := case.get("one_call_step_ms")) is not None:
        lines.append(f"{'step total, one call':<22}{one_call:>10.2f}   (median of "
                     f"{case.get('one_call_steps', case['num_steps'])} steps as the engine "
                     "runs them: every layer and its attention in one C++ call)")
    if (burst := case.get("burst_ms_per_token")) is not None:
        lines.append(f"{'per token, bursts':<22}{burst:>10.2f}   (median of "
                     f"{case['burst_steps']} steps, {case['burst_tokens']} tokens, each step "
                     f"up to {case['decode_burst']} decode steps in one call: decode bursts)")
    floor = case.get("weight_floor")
    if floor:
        lines.append(
            f"weight-bandwidth floor: {floor['weight_bytes'] / 1e6:.0f} MB of weights / "
            f"{floor['read_bandwidth_gb_s']:.1f} GB/s = {floor['floor_ms']:.2f} ms; "
            f"the step is {floor['ratio']:.2f}x the floor (target <= 1.5x)")
        if "burst_ratio" in floor:
            lines.append(f"with decode bursts a token takes {floor['burst_ratio']:.2f}x the "
                         "floor")
    return lines


def _dispatch(d: dict[str, Any]) -> list[str]:
    lines = ["== dispatch (what each op ran in the warm-up steps) =="]
    lines += [f"op   {name:<20}: {', '.join(kernels)}" for name, kernels in d["ops"].items()]
    lines += [f"gemm {name:<20}: {how}" for name, how in d["gemms"].items()]
    if (wide := d.get("wide_bf16_gemm")) is not None:
        rows = wide.get("fp32_min_rows")
        how = "oneDNN bf16 at every row count" if rows is None else f"float32 from {rows} rows"
        detail = wide.get("timings", wide.get("reason", ""))
        lines.append(f"wide bf16 GEMMs          : {how} ({wide.get('mode')}; {detail})")
    lines.append(f"attention backend        : {d['attention_backend']}")
    if d.get("kv_prefetch"):
        lines.append(f"decode K/V prefetch      : {d['kv_prefetch']}")
    lines.append("fused decoder layers     : " + ("on (one C++ call per layer between attention "
                 "calls)" if d.get("fused_layers") else "off (op by op)"))
    return lines


def _onednn(o: dict[str, Any]) -> list[str]:
    lines = ["== oneDNN (ONEDNN_VERBOSE=1, the model's GEMM shapes at 1 and 64 rows) =="]
    if "skipped" in o:
        return [*lines, f"skipped: {o['skipped']}"]
    if o.get("isa_info"):
        lines.append(f"oneDNN isa: {o['isa_info']}")
    if o.get("error"):
        lines.append(f"error: {o['error']}")
    kinds: dict[tuple[str, str], list[str]] = {}
    for g in o.get("gemms", []):
        kinds.setdefault((g["implementation"], g["weight_layout"]), []).append(g["problem"])
    for (impl, layout), problems in kinds.items():
        lines.append(f"{impl} (weights {layout}): {' '.join(problems)}")
    return lines


def format_report(report: dict[str, Any]) -> str:
    lines = _machine(report)
    d = report["decode"]
    lines += _case(f"decode: {d['num_seqs']} sequences at {d['context_len']} tokens", d)
    p = report["prefill"]
    lines += _case(f"prefill: {p['num_seqs']} x {p['prompt_len']} new tokens", p)
    s = report["single"]
    lines += _case(f"single stream: batch-1 decode at {s['context_len']} tokens", s)
    lines += _dispatch(report["dispatch"])
    lines += _onednn(report["onednn"])
    return "\n".join(lines)


def print_report(report: dict[str, Any]) -> None:
    print(format_report(report), flush=True)
