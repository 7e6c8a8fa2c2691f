#!/usr/bin/env bash
# One device call: what holds the one-row int4 GEMV near 2.9 TB/s (the session-26 note).
# probe_w4_loads.py times the whole-K loop's loads alone (a checksum for the products); then
# Nsight Compute reads gate_up's one-row GEMV for the chained n4 loop (the tuner's product
# pick) and the k-warps kernel (4 warps, 1.9 instructions a weight), one profiler range each.
# NCU_SELECT: other --int4-configs substrings, separated by ';'.
#
#   bash benchmarks/run_w4_limits.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
timeout 200 "$PY" benchmarks/probe_w4_loads.py --output-json "$RESULTS/w4_loads.json" \
  > "$RESULTS/w4_loads.log" 2>&1
grep -v -i warn "$RESULTS/w4_loads.log" | tail -30
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
IFS=';' read -r -a selects <<< "${NCU_SELECT:-loop 4/SM n4;k-warps n32 warps 4 loop 4}"
for sel in "${selects[@]}"; do
  log="$RESULTS/ncu_$(echo "$sel" | tr ' /' '__').log"
  SLIPSTREAM_W4_KWARPS=1 timeout 200 "$NCU" --clock-control none --profile-from-start off \
    --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats \
    "$PY" benchmarks/ncu_linears.py --formats int4 --ms 1 --shapes gate_up \
    --int4-configs "$sel" > "$log" 2>&1
  echo "== $sel (exit $?)"
  grep -E "int4 gate_up|Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Eligible Warps|No Eligible" \
    "$log" | head -24
done
