#!/usr/bin/env bash
# The datacenter side against llama.cpp's own server, over HTTP, on the same weights:
# `llama-server -np N` on the bfloat16 GGUF that scripts/build_llama_server.sh converts from
# the engine's cached safetensors folder, then `batchlens serve --max-num-seqs N`, each
# alone on the machine, each sent the bench mix by `batchlens bench serve` (64 requests, all
# at t=0, EOS ignored). Prints both runs' output tokens/s and their ratio.
#
#   PY=.venv/bin/python scripts/serve_vs_llamacpp.sh [N (default 64)] [THREADS (default: cores)]
#
# Needs `make llama-server` first (it builds llama-server and converts the GGUF).
set -euo pipefail
N=${1:-64}
THREADS=${2:-$(nproc)}
PY=${PY:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN_DIR=$("$ROOT/scripts/build_llama_server.sh" --bin-dir)
GGUF=$(ls "$BIN_DIR"/../../gguf/*.bf16.gguf 2>/dev/null | head -1)
[[ -x "$BIN_DIR/llama-server" && -f "$GGUF" ]] || {
  echo "llama-server or its bf16 GGUF missing: run make llama-server first" >&2; exit 1; }
OUT=$(mktemp -d)
PID=
trap '[[ -n "$PID" ]] && kill "$PID" 2>/dev/null; rm -rf "$OUT"' EXIT

wait_up() {  # $1: URL that answers 200 once the server is ready
  for _ in $(seq 300); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "server at $1 did not come up" >&2; exit 1
}

run_bench() {  # $1: name, $2: port
  "$PY" -m batchlens.cli bench serve --base-url "http://127.0.0.1:$2" --dataset bench-mix \
    --ignore-eos --num-prompts 64 --json "$OUT/$1.json" > "$OUT/$1.txt"
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
}

# a slot per request, each with room for the mix's longest prompt plus its longest answer
"$BIN_DIR/llama-server" -m "$GGUF" -np "$N" -c $((N * 1024)) -t "$THREADS" --port 8391 \
  > "$OUT/llama.log" 2>&1 &
PID=$!
wait_up http://127.0.0.1:8391/health
run_bench llama 8391

OMP_NUM_THREADS=$THREADS "$PY" -m batchlens.cli serve --port 8392 --max-num-seqs "$N" \
  --log-level warning > "$OUT/batchlens.log" 2>&1 &
PID=$!
wait_up http://127.0.0.1:8392/v1/models
run_bench batchlens 8392

"$PY" - "$OUT" "$N" "$THREADS" <<'EOF'
import json, sys
out, n, threads = sys.argv[1:]
tps = {name: json.load(open(f"{out}/{name}.json"))["output_throughput"]
       for name in ("llama", "batchlens")}
print(f"bench serve, bench mix, 64 requests at t=0, {threads} threads, {n} slots / sequences:")
rows = [(f"llama-server -np {n}", f"{tps['llama']:.1f} output tokens/s"),
        (f"batchlens serve --max-num-seqs {n}", f"{tps['batchlens']:.1f} output tokens/s"),
        ("ratio", f"{tps['batchlens'] / tps['llama']:.2f}x")]
for label, value in rows:
    print(f"  {label:<36}{value:>24}")
EOF
