"""The printout of `pagoda bench throughput`: its setup and the results table, with each
system's ratio to transformers and to vLLM in each mode it ran."""

from __future__ import annotations

from typing import Any


def print_setup(setup: dict[str, Any]) -> None:
    m, w, e = setup["machine"], setup["workload"], setup["engine"]
    order = "sorted by prompt length" if setup["hf_sort"] else "arrival order"
    lines = [
        "== pagoda bench throughput: setup ==",
        (
            f"machine : {m['cpu']}, {m['num_cpus']} CPUs ({m['cpus_usable']} usable), "
            f"{m['memory_gib']} GiB, {' '.join(m['isa']) or '-'}"
        ),
        (
            f"software: python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), "
            f"transformers {m['transformers']}"
        ),
        (f"model   : {setup['model']}, dtype {setup['dtype']} (peers "
         f"{setup.get('peer_dtype', setup['dtype'])}); workload preset "
        f"{setup.get('workload_preset') or '-'}"),
        (
            f"workload: {w['num_requests']} requests, seed {setup['seed']}; prompts "
            f"{setup['input_len'][0]}..{setup['input_len'][1]} ({w['num_prompt_tokens']:,} tokens), "
            f"outputs {setup['output_len'][0]}..{setup['output_len'][1]} "
            f"({w['num_output_tokens']:,} tokens); greedy, ignore_eos"
        ),
        (
            f"engine  : max_num_seqs {e['max_num_seqs']}, max_num_batched_tokens "
            f"{e['max_num_batched_tokens']}, KV cache {e['kv_cache_gib']} GiB (pagoda and vLLM)"
        ),
        (
            f"peers   : transformers static batches {setup['hf_batch_sizes']} on the first "
            f"{setup['hf_num_requests']} requests ({order}); vLLM: {setup['vllm_python'] or '-'}"
            f" in modes {', '.join(setup['vllm_modes'])}"
            + (" (pagoda's limits are vLLM's defaults here: one run for both)"
               if setup.get("vllm_modes_merged") else "")
        ),
    ]
    print("\n".join(lines), flush=True)


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def peer_columns(results: dict[str, dict[str, Any]]) -> list[tuple[str, float | None]]:
    """The (column title, output tok/s) every row is compared with: transformers, then
    each vLLM mode that ran, in run order."""
    cols = [("vs transformers", results.get("transformers", {}).get("output_tokens_per_s"))]
    for name, r in results.items():
        if name.startswith("vllm"):
            mode = name.partition("(")[2].rstrip(")") or "vLLM"
            cols.append((f"vs vLLM {mode}", r.get("output_tokens_per_s")))
    return cols


def print_table(results: dict[str, dict[str, Any]],
                round_ratios: dict[str, dict[str, Any]] | None = None) -> None:
    cols = peer_columns(results)
    widths = [max(len(title) + 2, 9) for title, _ in cols]
    print("== results (output tok/s; ratios are this row over the column's system) ==")
    print(f"{'system':<22}{'out tok/s':>11}{'req/s':>8}{'total tok/s':>13}"
          + "".join(f"{t:>{w}}" for (t, _), w in zip(cols, widths)) + f"{'roofline':>10}")
    for name, r in results.items():
        if "output_tokens_per_s" not in r:
            print(f"{name:<22}{r.get('skipped') or r.get('error') or 'no result'}")
            continue
        tps = r["output_tokens_per_s"]
        frac = f"{r['roofline_fraction']:.1%}" if r.get("roofline_fraction") else "-"
        note = "" if r["valid"] else "  INVALID: output token count differs"
        if name == "transformers":
            note += f"  (batch {r['best_batch_size']}, {r['num_requests_run']} requests)"
            if r.get("best_at_largest_batch"):
                note += "  NOTE: its largest batch tried; a larger one may be faster"
        if name.startswith("vllm"):
            st = r["settings"]
            note += (f"  (max_num_seqs {st['max_num_seqs']}, "
                     f"max_num_batched_tokens {st['max_num_batched_tokens']})")
        print(f"{name:<22}{tps:>11,.1f}{r['requests_per_s']:>8.2f}{r['total_tokens_per_s']:>13,.1f}"
              + "".join(f"{_ratio(tps, v):>{w}}" for (_, v), w in zip(cols, widths))
              + f"{frac:>10}{note}")
    for name, r in results.items():
        if r.get("rounds_output_tokens_per_s"):
            runs = " / ".join(f"{x:,.1f}" if x else "failed" for x in r["rounds_output_tokens_per_s"])
            print(f"rounds  {name:<22}{runs} out tok/s (the row: the median round)")
    for peer, rr in (round_ratios or {}).items():
        each = ", ".join(f"{x:.2f}x" for x in rr["per_round"])
        print(f"pagoda / {peer}, round by round: {each}; median {rr['median']:.2f}x")
    waste = results.get("pagoda", {}).get("kv_waste")
    if waste:
        print(
            f"pagoda KV memory waste (allocated slots - tokens stored, over allocated; "
            f"block size {waste['block_size']}): {waste['waste_pct']:.2f}% time-averaged, "
            f"{waste['waste_pct_by_step']:.2f}% by step, over {waste['num_samples']} steps; "
            f"peak {waste['peak_blocks']} blocks (target < 4%)"
        )
