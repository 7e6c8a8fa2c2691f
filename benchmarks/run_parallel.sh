#!/usr/bin/env bash
# One GPU: W1 bf16 (batch 1, 128 in / 256 out, Llama-3.1-8B shape, dummy weights) in the
# engine's own process (the default path; it must keep its speed) and through one "mp" worker
# process (tensor_parallel_size=1, distributed_executor_backend=mp: the multi-GPU path's
# transport and its multi-step decode, 8 steps a message, measured), then the GPU tests of
# tests/parallel. ~4 min.
#
#   bash benchmarks/run_parallel.sh [RESULTS_DIR]
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${1:-${OUT:-$HERE/benchmarks/results/parallel-$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
cd "$HERE" && source benchmarks/device_env.sh
W1=(latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128
    --output-len 256 --num-iters 3)
for name in W1_bf16 W1_bf16_mp; do
  extra=(); [[ $name == W1_bf16_mp ]] && extra=(--distributed-executor-backend mp)
  echo "=== $name"
  timeout -k 15 150 "$PY" -m slipstream.bench.cli "${W1[@]}" "${extra[@]}" --label "$name" \
    --output-json "$RESULTS/$name.json" > "$RESULTS/$name.log" 2>&1 || tail -5 "$RESULTS/$name.log"
done
timeout -k 15 120 "$PY" -m pytest -q -m gpu tests/parallel 2>&1 | tail -3
"$PY" - "$RESULTS" <<'PYEOF'
import json, pathlib, sys

rows = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("W1*.json"))}
base = (rows.get("W1_bf16") or {}).get("decode_tok_s", {}).get("median")
print(f"\n{'workload':<14}{'tok/s':>10}{'x in-process':>14}{'TTFT ms':>9}")
for name, r in rows.items():
    tok = r["decode_tok_s"]["median"]
    print(f"{name:<14}{tok:>10.1f}{(tok / base if base else float('nan')):>14.3f}"
          f"{r['ttft_ms']['median']:>9.1f}")
PYEOF
