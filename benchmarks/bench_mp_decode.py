"""Batch-1 decode in the engine's own process against the same through one "mp" worker
(tensor_parallel_size=1, distributed_executor_backend="mp"), the worker with decode_steps as
given and with 1 (a round trip a token): output tokens/s of one request, runs alternating
between the three engines (all started first), median and spread.

    PYTHONPATH=$PWD python benchmarks/bench_mp_decode.py [--model DIR] [--runs 7]

The CPU default is the embedded model (SLIPSTREAM_DEFAULT_MODEL=embedded picks it). The script
uses only the LLM API, so it measures an older checkout too (PYTHONPATH at it).
"""
from __future__ import annotations

import argparse
import statistics
import time

from slipstream import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    common = dict(device=args.device, decode_steps=args.decode_steps, max_model_len=1024,
                  max_num_seqs=4)
    if args.device == "cpu":
        common["kv_cache_memory"] = 64 << 20
    engines = {"in-process": LLM(args.model, **common),
               "mp worker": LLM(args.model, distributed_executor_backend="mp", **common),
               "mp, 1 step": LLM(args.model, distributed_executor_backend="mp",
                                 **{**common, "decode_steps": 1})}
    prompt = {"prompt_token_ids": [(7 * i) % 200 + 3 for i in range(args.input_len)]}
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for llm in engines.values():  # warm both up
            llm.generate([prompt], params, use_tqdm=False)
        for _ in range(args.runs):
            for name, llm in engines.items():
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                rates[name].append(len(out[0].outputs[0].token_ids) / elapsed)
    finally:
        for llm in engines.values():
            llm.engine.shutdown()
    base = statistics.median(rates["in-process"])
    print(f"{'path':<12}{'tok/s median':>14}{'min':>9}{'max':>9}{'of in-process':>15}")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:<12}{med:>14.1f}{min(r):>9.1f}{max(r):>9.1f}{med / base:>15.3f}")


if __name__ == "__main__":
    main()
