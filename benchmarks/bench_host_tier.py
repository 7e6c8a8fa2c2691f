"""Multi-turn chat whose prefixes do not fit the device KV cache, with and without the host tier.

    python benchmarks/bench_host_tier.py [--model DIR | --shape NAME] [--conversations 200]
        [--turns 8] [--user-len 80] [--output-len 32] [--gpu-kv-mib 128] [--host-kv-mib 2048]
Each conversation's turn t is its whole history (earlier prompts and replies) plus user_len new
tokens; every conversation's turn t runs as one batch, turn after turn, so by the time a
conversation comes back its prefix has been pushed out of a small device cache by the others.
Three configurations in the same process: no host tier; the tier with kv_offload_mode="auto"
(copies only where the measured cost model finds them cheaper than recomputing); the tier
with "always". Each reports the prefix hit rate (device + host), host hit tokens, host hit
blocks left to recompute, mean and p90 time to first token, and tokens per second (prompt +
output). `--shape llama-3.1-8b` (bench/shapes.py) runs a realistic size with random weights
(load_format="dummy"), where copies are much cheaper than recomputing.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

from slipstream import LLM, SamplingParams
from slipstream.assets import default_model_path
from slipstream.bench.shapes import SHAPES, materialize_shape


def run(args, model: str, host_bytes: int | None, mode: str = "auto") -> dict:
    extra = {"load_format": "dummy"} if args.shape else {}
    llm = LLM(model, kv_cache_memory=args.gpu_kv_mib << 20, kv_cache_host_memory=host_bytes,
              kv_offload_mode=mode, max_num_seqs=args.max_num_seqs,
              max_num_tokens=args.max_num_tokens, max_model_len=args.max_model_len, **extra)
    vocab = llm.engine_config.model.vocab_size
    rng = random.Random(0)
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttfts, tokens = [], 0
    start = time.perf_counter()
    for _ in range(args.turns):
        prompts = [h + [rng.randrange(10, vocab) for _ in range(args.user_len)] for h in history]
        for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
            history[i] = prompts[i] + out.outputs[0].token_ids
            ttfts.append(out.metrics.time_to_first_token)
            tokens += len(prompts[i]) + len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    stats = llm.get_stats()
    result = {
        "host_tier_mib": (host_bytes or 0) >> 20, "mode": mode if host_bytes else "-",
        "wall_s": wall, "tok_s": tokens / wall,
        "host_blocks_recomputed": llm.engine.scheduler.kv.host_blocks_recomputed,
        "tier_cost": _cost_line(llm),
        "prefix_hit_rate": stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1),
        "host_hit_tokens": stats["host_cache_hits"], "offloaded_blocks": stats["host_blocks_offloaded"],
        "ttft_mean_ms": 1e3 * statistics.mean(ttfts),
        "ttft_p90_ms": 1e3 * statistics.quantiles(ttfts, n=10)[-1],
        "preemptions": stats["num_preemptions"],
    }
    del llm
    gc.collect()
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - CPU runs
        pass
    return result


def _cost_line(llm: LLM) -> str | None:
    """The cost model's measured rates and its choice at the longest sequence."""
    cost = llm.engine.scheduler.kv.tier_cost
    if cost is None:
        return None
    max_len = llm.engine.scheduler.max_seq_len
    return (f"copies {cost.copy_bytes_per_s / 1e9:.1f} GB/s ({cost.block_bytes >> 10} KiB a "
            f"block), matmuls {cost.flops_per_s / 1e12:.3g} TFLOP/s: a block costs "
            f"{cost.copy_seconds(1) * 1e6:.1f} us to copy, {cost.recompute_seconds(1, 0) * 1e6:.1f}"
            f"-{cost.recompute_seconds(1, max_len - cost.block_size) * 1e6:.1f} us to recompute")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="a known model shape with random weights instead of a checkpoint")
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-len", type=int, default=80)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--gpu-kv-mib", type=int, default=128)
    ap.add_argument("--host-kv-mib", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.shape and args.model:
        ap.error("--model and --shape are exclusive")
    model = (str(materialize_shape(args.shape)) if args.shape
             else args.model or str(default_model_path()))
    host = args.host_kv_mib << 20
    rows = [run(args, model, None), run(args, model, host, "auto"),
            run(args, model, host, "always")]
    print(f"{args.shape or 'model ' + Path(model).name}: {args.conversations} conversations x "
          f"{args.turns} turns ({args.user_len} new + {args.output_len} out tokens a turn), "
          f"device KV {args.gpu_kv_mib} MiB")
    print(f"{'host MiB':>8} {'mode':>6} {'hit rate':>9} {'host hits':>10} {'recomp':>7} "
          f"{'TTFT ms':>8} {'p90 ms':>8} {'tok/s':>9} {'wall s':>7} {'preempt':>8}")
    for r in rows:
        print(f"{r['host_tier_mib']:>8} {r['mode']:>6} {r['prefix_hit_rate']:9.1%} "
              f"{r['host_hit_tokens']:>10} {r['host_blocks_recomputed']:>7} "
              f"{r['ttft_mean_ms']:8.1f} {r['ttft_p90_ms']:8.1f} {r['tok_s']:9.0f} "
              f"{r['wall_s']:7.1f} {r['preemptions']:>8}")
    if rows[1]["tier_cost"]:
        print("auto:", rows[1]["tier_cost"])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
