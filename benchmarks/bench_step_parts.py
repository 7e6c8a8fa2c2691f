"""Where a batch-1 decode step's GPU time goes, part by part, in a CUDA graph: see
slipstream/bench/step_parts.py (`python -m slipstream.bench.step_parts` is the same command).

    python benchmarks/bench_step_parts.py --quantization fp8 --quantize-lm-head --ctx 256
"""
from slipstream.bench.step_parts import main

if __name__ == "__main__":
    main()
