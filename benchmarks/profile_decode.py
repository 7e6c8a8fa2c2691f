"""Where a step's time goes on the GPU: kernel totals (torch profiler) and host phases.

    python benchmarks/profile_decode.py --model llama-3.1-8b --batch-size 1 --steps 64
    python benchmarks/profile_decode.py --batch-size 512 --num-requests 2048 --steps 128 \
        --max-num-tokens 8192 --quantization fp8      # W2-like mixed prefill/decode steps
Prints the top CUDA kernels by total time over the profiled run, the GPU-busy share of the
wall time, and the per-phase host breakdown from the engine's step timer.
"""
from __future__ import annotations

import argparse
import time

import torch

from slipstream import LLM, SamplingParams
from slipstream.bench.shapes import resolve_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-requests", type=int, default=None, help="default: the batch size")
    p.add_argument("--max-num-tokens", type=int, default=2048)
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--top", type=int, default=22, help="kernels to list")
    ns = p.parse_args()
    num_requests = ns.num_requests or ns.batch_size
    model_dir, _ = resolve_model(ns.model)
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16",
              max_num_seqs=max(ns.batch_size, 1), max_model_len=ns.input_len + ns.steps + 64,
              enforce_eager=ns.enforce_eager, quantization=ns.quantization,
              kv_cache_dtype=ns.kv_cache_dtype,
              max_num_tokens=max(ns.max_num_tokens, ns.input_len))
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(ns.input_len)] for i in range(num_requests)]
    params = SamplingParams(max_tokens=ns.steps, ignore_eos=True, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    prompts = [[t + 1 for t in p] for p in prompts]
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or
              getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    print(f"{'kernel':<70} {'calls':>7} {'total ms':>9} {'us/call':>8}")
    for e in events[:ns.top]:
        total = getattr(e, "self_device_time_total", 0)
        print(f"{e.key[:70]:<70} {e.count:>7} {total / 1e3:>9.2f} {total / max(e.count, 1):>8.1f}")
    tokens = num_requests * ns.steps
    print(f"\nwall {wall * 1e3:.1f} ms for {num_requests} x {ns.steps} tokens "
          f"({wall / tokens * 1e6:.1f} us/token, profiler on); GPU busy {busy * 1e3:.1f} ms = "
          f"{100 * busy / wall:.0f}% of wall")
    llm.engine.timer.enabled = True
    llm.generate([[t + 2 for t in p] for p in prompts], params, use_tqdm=False)
    print("\nhost phases (synchronised; slows the run):\n" + llm.engine.timer.table())


if __name__ == "__main__":
    main()
