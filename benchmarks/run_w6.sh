#!/usr/bin/env bash
# W6 (BENCHMARKS.md): the OpenAI server on the Llama-3.1-8B shape (dummy weights), Poisson
# 2 req/s, 467 in / 256 out, 200 requests; TTFT and ITL median / p99. Results in ${1:-$OUT}.
# SERVE_ARGS: extra server flags (A/B runs). Run from the repository root (device_env.sh
# installs the carried wheels: FastAPI, uvicorn).
set -u
RESULTS=${1:-${OUT:-/tmp/w6}}; mkdir -p "$RESULTS"
PORT=${PORT:-8000}
source benchmarks/device_env.sh
D=$("$PY" -c "from slipstream.bench.shapes import materialize_shape; print(materialize_shape('llama-3.1-8b'))")
"$PY" -m slipstream serve --model "$D" --load-format dummy --max-model-len 1024 --port "$PORT" \
  --log-level warning --no-access-log ${SERVE_ARGS:-} > "$RESULTS/w6_server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 2; done
"$PY" -m slipstream bench serve --base-url "http://127.0.0.1:$PORT" --prompt-token-ids \
  --max-token-id 128000 --input-len 467 --output-len 256 --num-prompts "${W6_PROMPTS:-200}" \
  --request-rate 2 --num-warmups 4 --label W6 --output-json "$RESULTS/W6.json"
kill -INT $SERVER; wait $SERVER; echo "server exit $?"
# Where a request's time goes (timed one at a time beside 2 other streams, same shape): the
# server's stages against the model's prefill and decode steps (bench_serve_host.py).
# W6_STAGES=0 skips it.
if [ "${W6_STAGES:-1}" = 1 ]; then
  "$PY" benchmarks/bench_serve_host.py --model "$D" --serve-args "--load-format dummy ${SERVE_ARGS:-}" \
    --requests 20 --output-len 256 --background 2 --max-token-id 128000 --port "$((PORT + 1))" \
    --json "$RESULTS/W6_stages.json" 2>&1 | grep -v " INFO " | tail -22
fi
