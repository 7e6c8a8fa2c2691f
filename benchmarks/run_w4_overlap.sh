#!/usr/bin/env bash
# One device call: does the one-row int4 GEMV overlap its loads with its products?
# probe_w4_overlap.py times the whole-K tile loop as it runs, its products alone and with two
# tiles requested ahead; then Nsight Compute reads gate_up's n4 loop at 6 an SM for the
# warps' stall reasons, the issue rate and the DRAM throughput. LOADS=1 first times the loop's
# loads alone (probe_w4_loads.py); NCU_SELECT: other --int4-configs substrings, ';'-separated.
#
#   bash benchmarks/run_w4_overlap.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
if [[ -n ${LOADS:-} ]]; then  # LOADS=1: first the loads alone (probe_w4_loads.py, ~1 min)
  timeout 200 "$PY" benchmarks/probe_w4_loads.py --output-json "$RESULTS/w4_loads.json" \
    > "$RESULTS/w4_loads.log" 2>&1
  grep -v -i warn "$RESULTS/w4_loads.log" | tail -30
fi
timeout 300 "$PY" benchmarks/probe_w4_overlap.py --output-json "$RESULTS/w4_overlap.json" \
  > "$RESULTS/w4_overlap.log" 2>&1
echo "probe: exit $?"
grep -v -i warn "$RESULTS/w4_overlap.log" | tail -20
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
METRICS="gpu__time_duration.sum,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed"
METRICS+=",smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active"
METRICS+=",smsp__warps_eligible.avg.per_cycle_active"
METRICS+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
IFS=";" read -r -a selects <<< "${NCU_SELECT:-loop 6/SM n4}"
for sel in "${selects[@]}"; do
  log="$RESULTS/ncu_$(echo "$sel" | tr ' /' '__').log"
  timeout 150 "$NCU" --clock-control none --profile-from-start off --metrics "$METRICS" \
    "$PY" benchmarks/ncu_linears.py --formats int4 --ms 1 --shapes gate_up \
    --int4-configs "$sel" > "$log" 2>&1
  echo "== $sel (exit $?)"
  grep -E "int4 gate_up|duration|registers|dram__|issue_active|warps_active|warps_eligible|stalled" "$log" \
    | awk '{ if ($NF+0 >= 0.05 || $0 !~ /stalled/) print }' | head -40
done
