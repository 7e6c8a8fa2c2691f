"""Where a decode step's time goes on the GPU: kernel totals (torch profiler) and host phases.

    python benchmarks/profile_decode.py --model llama-3.1-8b --batch-size 1 --steps 64
Prints the top CUDA kernels by total time over the profiled decode steps, the GPU-busy share
of the wall time, and the per-phase host breakdown from the engine's step timer.
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
    ns = p.parse_args()
    model_dir, _ = resolve_model(ns.model)
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16",
              max_num_seqs=max(ns.batch_size, 1), max_model_len=ns.input_len + ns.steps + 64,
              enforce_eager=ns.enforce_eager)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(ns.input_len)] for i in range(ns.batch_size)]
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
    for e in events[:22]:
        total = getattr(e, "self_device_time_total", 0)
        print(f"{e.key[:70]:<70} {e.count:>7} {total / 1e3:>9.2f} {total / max(e.count, 1):>8.1f}")
    steps = ns.steps
    print(f"\nwall {wall * 1e3:.1f} ms for {steps} steps ({wall / steps * 1e3:.3f} ms/step, "
          f"profiler on); GPU busy {busy * 1e3:.1f} ms = {100 * busy / wall:.0f}% of wall")
    llm.engine.timer.enabled = True
    llm.generate([[t + 2 for t in p] for p in prompts], params, use_tqdm=False)
    print("\nhost phases (synchronised; slows the run):\n" + llm.engine.timer.table())


if __name__ == "__main__":
    main()
