#!/usr/bin/env bash
# Issue 10's benchmark: default `kvgate serve` (nothing tuned: the default heartbeat timeout, step budget and
# everything else) under streaming chat load at concurrency 1, 16 and 64, for a baseline commit and for the
# working tree, in one invocation. Workload (fixed seeds): chat prompts of 128-256 words (plus the chat
# template), 64-128 output tokens each with ignore_eos, greedy. Reports completed/failed, output tok/s, TTFT
# and ITL p50/p99 per level and version, and the CPU.
# Usage: bash bench/liveness_suite.sh [BASE_COMMIT] [PORT]   (about 10-15 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${1:-11f96cf}
PORT=${2:-8021}
PY=$ROOT/.venv/bin/python
OUT=${OUT:-/tmp/kvgate-liveness}
mkdir -p "$OUT"
lscpu | grep -E "Model name|^Flags" | sed 's/^Flags:.*\(avx[^ ]*\).*/&/' > "$OUT/cpu.txt"
BEFORE=$OUT/before-tree
rm -rf "$BEFORE"; git worktree prune
git worktree add -f "$BEFORE" "$BASE" -q

serve_and_bench() {  # $1: name, $2: source tree
  local name=$1 tree=$2 url=http://127.0.0.1:$PORT
  rm -f "$OUT/$name.db"*
  (cd "$tree" && PYTHONPATH="$tree" exec "$PY" -m gateway serve --host 127.0.0.1 --port "$PORT" --model smollm2 \
     --workers 1 --db "$OUT/$name.db") > "$OUT/$name.serve.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 600); do curl -sf "$url/ready" >/dev/null && break; sleep 0.5; done
  local key; key=$(sed -n 's/.*export KVGATE_API_KEY=//p' "$OUT/$name.serve.log")
  for c in 1 16 64; do
    local n=$(( c == 1 ? 8 : (c == 16 ? 32 : 64) ))
    echo "== $name c$c"
    "$PY" bench/serve.py --base-url "$url" --model smollm2 --api-key "$key" --chat --seed $((1000 + c)) \
      --max-concurrency $c --num-prompts $n --random-input-len 192 --random-output-len 96 \
      --random-range-ratio 0.3333 --max-duration 900 --output-json "$OUT/$name-c$c.json" | \
      grep -E "Successful|Failed|Output token|Median TTFT|P99 TTFT|Median ITL|P99 ITL|errors" || true
  done
  kill $server; wait $server 2>/dev/null || true
  grep -c "lost (" "$OUT/$name.serve.log" | sed "s/^/$name: 'worker lost' log lines: /" || true
}
serve_and_bench before "$BEFORE"
serve_and_bench after "$ROOT"
git worktree remove --force "$BEFORE"
cat "$OUT/cpu.txt" | head -1
