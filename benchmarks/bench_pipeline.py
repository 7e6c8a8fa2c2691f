"""Pipeline parallelism with micro-batches in flight against synchronous steps, same engine.

One engine with pipeline_parallel_size P (and tensor_parallel_size T) runs the same offline
batch twice: with up to P micro-batches in flight (how it runs) and with one (each step read
before the next is scheduled, which is what it did before). Prints output tokens/s of each,
their ratio, and how often stage 0 started micro-batch n + 1 before the last stage finished n
(the ranks' own clocks). Needs T x P GPUs (or runs on the CPU with gloo).

  python benchmarks/bench_pipeline.py --model llama-3.1-8b --pp 2 [--tp 1] [--requests 64]
      [--input-len 128] [--output-len 64] [--device cuda] [--output-json FILE]
"""
from __future__ import annotations

import argparse
import json
import time

from slipstream import LLM, SamplingParams
from slipstream.bench.shapes import is_shape_name, resolve_model


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, depth: int) -> dict:
    core = llm.engine
    core.micro_batches.depth = depth
    core.micro_batches.max_in_flight = 0
    first_mb = core.runner._encoder.num_sent  # this run's micro-batches are numbered from here
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"depth": depth, "seconds": seconds, "output_tok_s": tokens / seconds,
            "max_in_flight": core.micro_batches.max_in_flight,
            "overlaps": _overlaps(core.runner.timelines(), core.runner.tp_size,
                                  core.runner.pp_size, first_mb)}


def _overlaps(timelines: dict, tp: int, pp: int, first_mb: int) -> float:
    """Share of micro-batches n (from first_mb on; the ranks keep their latest 256) that
    stage 0 follows with n + 1 before the last stage ends n."""
    first = {mb: start for mb, start, _ in timelines[0] if mb >= first_mb}
    last = {mb: end for mb, _, end in timelines[(pp - 1) * tp] if mb >= first_mb}
    pairs = [mb for mb in last if mb + 1 in first]
    return sum(first[mb + 1] < last[mb] for mb in pairs) / max(len(pairs), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", help="shape name or checkpoint directory")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()
    model_dir, label = resolve_model(ns.model)
    kwargs = {"load_format": "dummy"} if is_shape_name(ns.model) else {}
    if ns.dtype:
        kwargs["dtype"] = ns.dtype
    if ns.device == "cpu":
        kwargs["kv_cache_memory"] = 256 << 20
    llm = LLM(model_dir, device=ns.device, pipeline_parallel_size=ns.pp,
              tensor_parallel_size=ns.tp, max_num_seqs=ns.requests,
              max_model_len=ns.input_len + ns.output_len + 16, **kwargs)
    vocab = llm.engine_config.model.vocab_size
    prompts = [[(7 + 31 * i + 17 * j) % vocab for j in range(ns.input_len)]
               for i in range(ns.requests)]
    params = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    try:
        run(llm, prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), ns.pp)  # warm-up
        rows = [run(llm, prompts, params, depth) for depth in (1, ns.pp)]
    finally:
        llm.engine.shutdown()
    base = rows[0]["output_tok_s"]
    print(f"{label}: tp {ns.tp} x pp {ns.pp}, {ns.requests} requests, "
          f"{ns.input_len} in / {ns.output_len} out, {ns.device}")
    print(f"{'in flight':<12}{'tok/s':>10}{'x sync':>8}{'stage overlap':>15}")
    for r in rows:
        print(f"{r['depth']:<12}{r['output_tok_s']:>10.1f}{r['output_tok_s'] / base:>8.2f}"
              f"{r['overlaps']:>15.0%}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"model": label, "tp": ns.tp, "pp": ns.pp, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
