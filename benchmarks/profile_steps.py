"""Per-step time breakdown of W2 / W3 / W4 against each part's floor (torch.profiler): see
slipstream/bench/step_profile.py (`python -m slipstream.bench.step_profile` is the same command).

    python benchmarks/profile_steps.py --model llama-3.1-8b [--quantization fp8 --kv-cache-dtype fp8]
"""

from slipstream.bench.step_profile import main

if __name__ == "__main__":
    raise SystemExit(main())
