#!/usr/bin/env bash
# The defaults sweep of docs/architecture.md ("Defaults, and the measurement behind them"):
# offline, 128 requests of the short workload's lengths, pagoda only, each
# (max_num_seqs, max_num_batched_tokens) in turn, the order rotated each round.
set -uo pipefail
cd "$(dirname "$0")/.."
P=.venv/bin/pagoda
ROUNDS=${ROUNDS:-2}
cfgs=("64 2048" "128 2048" "64 4096" "128 4096" "256 4096" "32 2048")
for r in $(seq "$ROUNDS"); do
  for i in "${!cfgs[@]}"; do
    j=$(( (i + r) % ${#cfgs[@]} )); set -- ${cfgs[$j]}
    printf "round %s seqs %-4s tokens %-5s load %s  " "$r" "$1" "$2" "$(cut -d' ' -f1 /proc/loadavg)"
    "$P" bench throughput --input-len 26,254 --output-len 16,127 --num-requests 128 \
      --systems pagoda --no-roofline --max-num-seqs "$1" --max-num-batched-tokens "$2" 2>&1 |
      awk '/^pagoda  / {print $2}'
  done
done
