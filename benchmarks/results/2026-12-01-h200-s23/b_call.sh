# session 23, device call 2: GPU tests, W1 on the short-chain default, PRELOAD on top of it, tinygemm probe
source benchmarks/device_env.sh
t0=$(date +%s); el() { echo "($(( $(date +%s) - t0 )) s)"; }
timeout 60 $PY -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_gemv_int4.py -k whole_k > $OUT/w4_test.log 2>&1
echo "whole-K test $(el): $(tail -1 $OUT/w4_test.log)"; grep -E "max error" $OUT/w4_test.log | head -8
timeout 100 $PY -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/kernels/test_triton_paged_attention.py tests/kernels/test_attention_rope_fused.py > $OUT/attn_tests.log 2>&1
echo "attention tests $(el): $(tail -1 $OUT/attn_tests.log)"; grep -E "^FAILED" $OUT/attn_tests.log | head
timeout 390 $PY benchmarks/bench_quant.py --methods none,fp8+head,int4_awq+head --output-json $OUT/w1.json > $OUT/w1.log 2>&1
echo "W1 $(el)"; tail -5 $OUT/w1.log
for q in int4_awq fp8; do
  (( $(date +%s) - t0 > 500 )) && break
  timeout 60 $PY benchmarks/bench_step_parts.py --quantization $q --quantize-lm-head --ctx 256 --parts full \
    --attn-variants _PRELOAD=1,_SHORT_CHAIN_TILES=0 --output-json $OUT/parts_$q.json > $OUT/parts_$q.log 2>&1
  echo "parts $q $(el)"; grep -E "^full" $OUT/parts_$q.log
done
(( $(date +%s) - t0 < 540 )) && timeout $(( 590 - $(date +%s) + t0 )) $PY scratch/probe/tinygemm.py 2>&1 | grep -v -E "^(INFO|WARNING)" | tail -5
true
