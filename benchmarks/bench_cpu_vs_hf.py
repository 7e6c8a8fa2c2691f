"""slipstream against transformers on a CPU, interleaved in one process.

`slipstream bench throughput --baseline hf` times each side once, one after the other: on a
machine shared with other work the load moves between the two and one run decides the ratio.
Here every repetition times slipstream and then transformers on the same requests (random
prompts, every request generating exactly --output-len tokens; transformers in static batches
of the batch size, as the bench baseline), and the report gives the medians over repetitions
of wall-clock tokens/s and of the process's CPU time, plus the median of the per-repetition
ratios. Both sides run with the same torch thread count (the engine's choice unless
--cpu-threads) and the same weights' shape (transformers random-initialised, as the baseline).

    python benchmarks/bench_cpu_vs_hf.py --batch-sizes 1 32 --repeats 3 \
        --output-json benchmarks/results/2026-12-06-cpu/interleaved.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from slipstream import LLM, SamplingParams
from slipstream.bench.datasets import random_requests
from slipstream.bench.hf_baseline import build_hf_model, generate_batch
from slipstream.bench.report import run_meta


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _side(llm, hf, requests, batch: int):
    params = SamplingParams(temperature=0.0, max_tokens=requests[0].output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]

    def slipstream_run():
        llm.generate(prompts, params, use_tqdm=False)

    def hf_run():
        for i in range(0, len(requests), batch):
            generate_batch(hf, requests[i : i + batch], "cpu")

    return slipstream_run, hf_run


def _summary(tokens: int, runs: list[tuple[float, float]]) -> dict:
    walls = [w for w, _ in runs]
    return {
        "output_tok_s_median": tokens / statistics.median(walls),
        "wall_s": [round(w, 3) for w in walls],
        "cpu_s": [round(c, 3) for _, c in runs],
    }


def run(args: argparse.Namespace) -> dict:
    llm = LLM(
        args.model,
        dtype="float32",
        device="cpu",
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.input_len + args.output_len + 16,
        cpu_threads=args.cpu_threads,
    )
    hf = build_hf_model(llm.engine_config.model_path, "float32", "cpu")
    vocab = llm.engine_config.model.vocab_size
    cases = {b: random_requests(b, args.input_len, args.output_len, vocab, seed=b) for b in args.batch_sizes}
    runs = {b: _side(llm, hf, reqs, b) for b, reqs in cases.items()}
    for ss_run, hf_run in runs.values():  # warm-up: lazy initialisation outside the timings
        ss_run()
        hf_run()
    timings = {b: {"slipstream": [], "hf": []} for b in cases}
    for rep in range(args.repeats):
        for b, (ss_run, hf_run) in runs.items():
            timings[b]["slipstream"].append(_timed(ss_run))
            timings[b]["hf"].append(_timed(hf_run))
            print(
                f"[rep {rep + 1}/{args.repeats}] batch {b}: slipstream "
                f"{timings[b]['slipstream'][-1][0]:.2f} s, hf {timings[b]['hf'][-1][0]:.2f} s",
                flush=True,
            )
    results = []
    for b, t in timings.items():
        tokens = b * args.output_len
        ratios = [h[0] / s[0] for s, h in zip(t["slipstream"], t["hf"], strict=True)]
        cpu_ratios = [h[1] / s[1] for s, h in zip(t["slipstream"], t["hf"], strict=True)]
        results.append(
            {
                "batch_size": b,
                "slipstream": _summary(tokens, t["slipstream"]),
                "hf": _summary(tokens, t["hf"]),
                "ratio_median": statistics.median(ratios),
                "cpu_time_ratio_median": statistics.median(cpu_ratios),
            }
        )
    return {
        "benchmark": "cpu_vs_hf_interleaved",
        "model": llm.engine_config.model_path,
        "dtype": "float32",
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "cpu_threads": torch.get_num_threads(),
        "load_average_1m_end": os.getloadavg()[0],
        "results": results,
        "meta": run_meta(),
    }


def print_table(report: dict) -> None:
    print(
        f"model {report['model']}, {report['input_len']} in / {report['output_len']} out, "
        f"{report['cpu_threads']} threads, {report['repeats']} interleaved repetitions"
    )
    print(
        f"{'batch':>5} {'slipstream tok/s':>17} {'hf tok/s':>9} {'ratio (median)':>15} {'CPU-time ratio':>15}"
    )
    for r in report["results"]:
        print(
            f"{r['batch_size']:>5} {r['slipstream']['output_tok_s_median']:>17.2f} "
            f"{r['hf']['output_tok_s_median']:>9.2f} {r['ratio_median']:>15.3f} "
            f"{r['cpu_time_ratio_median']:>15.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    report = run(args)
    print_table(report)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
