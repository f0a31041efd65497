#!/usr/bin/env bash
# The serving numbers in bench/RESULTS.md, reproducibly: starts `kvgate serve` on 127.0.0.1, runs
# bench/serve.py at concurrency 1, 8, 16, the same c=16 workload on the in-process engine (gateway
# overhead), and TTFT with a 1024-token shared prefix vs an unshared prompt of the same length.
# Usage: bash bench/serve_suite.sh [PORT]   (fixed seeds; about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8011}
PY=.venv/bin/python
# Workers spawned by the gateway default to passive OpenMP waits (gateway/fleet/supervisor.py); give the in-process
# engine run the same so the overhead comparison is like for like.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
URL=http://127.0.0.1:$PORT
OUT=${OUT:-/tmp/kvgate-serve-suite}
mkdir -p "$OUT"
# A fresh store each run: its demo tenant (no quotas) is the benchmark's caller, its key read from stdout.
rm -f "$OUT/kvgate.db"*
.venv/bin/kvgate serve --host 127.0.0.1 --port "$PORT" --model smollm2 --workers 1 --log-level WARNING \
  --db "$OUT/kvgate.db" > "$OUT/serve.out" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 240); do curl -sf "$URL/ready" >/dev/null && break; sleep 0.5; done
export KVGATE_API_KEY=$(sed -n 's/.*export KVGATE_API_KEY=//p' "$OUT/serve.out")
# Each run has its own seed: the server keeps its prefix cache between runs, and a repeated workload would
# be served from it. The c16 run and the in-process engine run share seed 16, both on a cold cache.
run() { local name=$1; shift; echo "== $name"; $PY bench/serve.py --model smollm2 --api-key "$KVGATE_API_KEY" --output-json "$OUT/$name.json" "$@"; }
run c1 --seed 1 --base-url "$URL" --max-concurrency 1 --num-prompts 8 --random-input-len 256 --random-output-len 64
run c8 --seed 8 --base-url "$URL" --max-concurrency 8 --num-prompts 32 --random-input-len 256 --random-output-len 64
run c16 --seed 16 --base-url "$URL" --max-concurrency 16 --num-prompts 32 --random-input-len 256 --random-output-len 64
run noprefix --seed 100 --base-url "$URL" --max-concurrency 1 --num-prompts 8 --random-input-len 1280 --random-output-len 16
run prefix1024 --seed 101 --base-url "$URL" --max-concurrency 1 --num-prompts 8 --shared-prefix-len 1024 --random-input-len 256 --random-output-len 16
kill $SERVER; wait $SERVER 2>/dev/null || true
trap - EXIT
run c16-engine --seed 16 --backend engine --max-concurrency 16 --num-prompts 32 --random-input-len 256 --random-output-len 64
