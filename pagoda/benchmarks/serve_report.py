"""Reporting for `pagoda bench serve`: the setup printout, the results table (with each
target's ratios to the first target at the same concurrency) and the PNG plot."""

from __future__ import annotations

from typing import Any


def print_setup(setup: dict[str, Any]) -> None:
    m, w = setup["machine"], setup["workload"]
    print("== pagoda bench serve: setup ==")
    print(
        f"machine : {m['cpu']}, {m['num_cpus']} CPUs ({m['cpus_usable']} usable), "
        f"{m['memory_gib']} GiB (client and servers share it)"
    )
    print(
        f"workload: {w['num_requests']} requests, seed {setup['seed']}, prompt len "
        f"{w['min_prompt_len']}..{w['max_prompt_len']} ({w['num_prompt_tokens']:,} tokens), "
        f"output len {w['min_output_len']}..{w['max_output_len']} "
        f"({w['num_output_tokens']:,} tokens), {_sampling(setup)}, "
        f"ignore_eos {setup['ignore_eos']}, "
        f"{setup['endpoint']} with {setup['prompt_format']} prompts; preset "
        f"{setup.get('workload_preset') or '-'}"
    )
    print(
        f"load    : concurrency {setup['concurrency']}, request rate {setup['request_rate']}/s;"
        f" goodput SLA {setup['goodput_sla_s']} s; tokenizer {setup['tokenizer']}"
    )
    for label, info in setup["targets"].items():
        print_target(label, info)


def print_target(label: str, info: dict[str, Any]) -> None:
    print(
        f"target  : {label} = {info['base_url']} models {info['models']} version "
        f"{info['version']} max_model_len {info['max_model_len']}",
        flush=True,
    )


def _fmt(value: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width},.1f}"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def print_table(runs: list[dict[str, Any]]) -> None:
    """One row per run; the ratios compare with the first target at the same concurrency
    (above 1x is better for tok/s, below 1x is better for TTFT p99)."""
    ref = {r["concurrency"]: r["summary"] for r in runs if r["label"] == runs[0]["label"]}
    print("== results (latencies in ms) ==")
    print(
        f"{'target':<16}{'conc':>5}{'ok':>5}{'out tok/s':>10}{'req/s':>7}{'goodput':>8}"
        f"{'TTFT p50':>9}{'p99':>8}{'ITL p50':>8}{'p99':>7}{'TPOT p50':>9}{'p99':>7}"
        f"{'E2E p50':>9}{'p99':>9}{'tok/s ratio':>12}{'TTFT99 ratio':>13}"
    )
    for run in runs:
        s = run["summary"]
        base = ref.get(run["concurrency"]) or {}
        tps_ratio = _ratio(s["output_tokens_per_s"], base.get("output_tokens_per_s"))
        ttft_ratio = _ratio(s["ttft_ms"]["p99"], (base.get("ttft_ms") or {}).get("p99"))
        print(
            f"{run['label'][:15]:<16}{run['concurrency']:>5}{s['num_ok']:>5}"
            f"{s['output_tokens_per_s']:>10,.1f}{s['requests_per_s']:>7.2f}"
            f"{s['goodput_requests_per_s']:>8.2f}{_fmt(s['ttft_ms']['p50'])}"
            f"{_fmt(s['ttft_ms']['p99'], 8)}{_fmt(s['itl_ms']['p50'], 8)}"
            f"{_fmt(s['itl_ms']['p99'], 7)}{_fmt(s['tpot_ms']['p50'])}"
            f"{_fmt(s['tpot_ms']['p99'], 7)}{_fmt(s['e2e_ms']['p50'])}"
            f"{_fmt(s['e2e_ms']['p99'])}{tps_ratio:>12}{ttft_ratio:>13}"
        )
        if s["num_failed"] or s["num_short"]:
            print(f"    {s['num_failed']} failed, {s['num_short']} short: {s['first_errors']}")


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Throughput and latency percentiles against concurrency, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        ("output_tokens_per_s", None, "output tokens/s"),
        ("ttft_ms", "TTFT", "ms"),
        ("tpot_ms", "TPOT", "ms"),
        ("e2e_ms", "end-to-end latency", "ms"),
    ]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    for ax, (key, title, unit) in zip(axes.flat, panels):
        for label in labels:
            mine = sorted((r for r in runs if r["label"] == label), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in mine]
            if title is None:
                ax.plot(xs, [r["summary"][key] for r in mine], "o-", label=label)
            else:
                for q, style in (("p50", "o-"), ("p99", "s--")):
                    ax.plot(xs, [r["summary"][key][q] for r in mine], style, label=f"{label} {q}")
        ax.set_title(title or "throughput")
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("pagoda bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sampling(setup: dict) -> str:
    """"greedy", or the requests' temperature and top_p (reports saved before they were
    recorded were greedy)."""
    t, top_p = setup.get("temperature", 0.0), setup.get("top_p", 1.0)
    if t == 0:
        return "greedy"
    return f"temperature {t:g}" + (f", top_p {top_p:g}" if top_p < 1 else "")
