#!/usr/bin/env bash
# lowbit serve against llama-cpp-python's server, side by side in one run, on the default model:
# both started with the same thread count, both benched by `lowbit bench` with the same prompts
# (same seed) at concurrency 1, 4 and 16, then one comparison chart.
#
#   bash tests/bench/peers.sh [OUT_DIR]            (default: bench_results)
#
# Environment: THREADS (default: all cores), NUM_PROMPTS (32), INPUT_LEN (256), OUTPUT_LEN (128),
# LEVELS (1,4,16), PYTHON (python3). Needs llama-cpp-python's server extras:
#   pip install sse_starlette starlette_context pydantic_settings
# Writes OUT_DIR/lowbit.json, OUT_DIR/llama-cpp-python.json, OUT_DIR/peers.png and both servers' logs.
# llama-cpp-python runs with --interrupt_requests False so it queues requests instead of cancelling
# the running one; it decodes one request at a time either way.
set -euo pipefail

PY="${PYTHON:-python3}"
OUT="${1:-bench_results}"
THREADS="${THREADS:-$(nproc)}"
NUM_PROMPTS="${NUM_PROMPTS:-32}"
INPUT_LEN="${INPUT_LEN:-256}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
LEVELS="${LEVELS:-1,4,16}"
mkdir -p "$OUT"

"$PY" -c "import llama_cpp.server.app" 2>/dev/null || {
    echo "peers.sh: llama-cpp-python's server is missing: pip install sse_starlette starlette_context pydantic_settings" >&2
    exit 2
}
GGUF="$("$PY" -c "from lowbit.runtime.load.registry import resolve; print(resolve(None))")"
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
P_LOWBIT="$(free_port)"
P_LLAMA="$(free_port)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_ready() {  # URL NAME LOG
    for _ in $(seq 1 600); do
        if "$PY" -c "import httpx, sys; sys.exit(httpx.get('$1/models', timeout=2).status_code != 200)" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    echo "peers.sh: $2 did not start; its log:" >&2
    tail -n 20 "$3" >&2
    exit 1
}

echo "== starting both servers: $GGUF, $THREADS threads" >&2
"$PY" -m lowbit.runtime.cli serve "$GGUF" --port "$P_LOWBIT" --threads "$THREADS" --max-num-seqs 16 \
    --kv-memory 256MiB --log-level warning >"$OUT/lowbit_serve.log" 2>&1 &
PIDS+=($!)
"$PY" -m llama_cpp.server --model "$GGUF" --port "$P_LLAMA" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --n_ctx 4096 --interrupt_requests False >"$OUT/llama_cpp_server.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$P_LOWBIT/v1" "lowbit serve" "$OUT/lowbit_serve.log"
wait_ready "http://127.0.0.1:$P_LLAMA/v1" "llama-cpp-python" "$OUT/llama_cpp_server.log"

COMMON=(--concurrency "$LEVELS" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN"
        --ignore-eos --seed 0 --tokenizer "$GGUF")
echo "== lowbit serve" >&2
"$PY" -m lowbit.runtime.cli bench --base-url "http://127.0.0.1:$P_LOWBIT/v1" "${COMMON[@]}" --label "lowbit serve" \
    --out "$OUT/lowbit.json"
echo "== llama-cpp-python server" >&2
"$PY" -m lowbit.runtime.cli bench --base-url "http://127.0.0.1:$P_LLAMA/v1" "${COMMON[@]}" \
    --label "llama-cpp-python server" --out "$OUT/llama-cpp-python.json"
"$PY" -m lowbit.runtime.cli bench plot "$OUT/lowbit.json" "$OUT/llama-cpp-python.json" -o "$OUT/peers.png"
"$PY" - "$OUT/lowbit.json" "$OUT/llama-cpp-python.json" <<'PYEOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
print("\nlowbit / llama-cpp-python, same prompts and load:")
for ra, rb in zip(a["results"], b["results"]):
    ratio = lambda k: ra[k] / rb[k] if ra[k] and rb[k] else float("nan")
    print(f"  c={ra['max_concurrency']:<3} output tok/s {ra['output_throughput']:7.1f} vs {rb['output_throughput']:7.1f} "
          f"({ratio('output_throughput'):.2f}x)   median TTFT {ra['median_ttft_ms']:8.0f} vs {rb['median_ttft_ms']:8.0f} ms"
          f"   median TPOT {ra['median_tpot_ms']:6.1f} vs {rb['median_tpot_ms']:6.1f} ms")
PYEOF
