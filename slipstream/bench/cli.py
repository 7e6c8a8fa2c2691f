"""CLI of `slipstream bench latency|throughput` (vLLM-style flags).

`add_bench_parsers(subparsers)` adds the `bench` group and returns its sub-subparsers so other
modes (`bench serve`) can join it. Standalone: `python -m slipstream.bench.cli throughput ...`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from slipstream.bench.datasets import DATASETS
from slipstream.engine.args import EngineArgs


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:  # retune the engine defaults to the bench's needs
        if action.dest == "model":
            action.help = ("checkpoint directory or a known shape name (llama-3.1-8b, "
                           "llama-3.1-70b, qwen3-0.6b, smollm2-135m: implies --load-format "
                           "dummy)")
    parser.set_defaults(max_num_seqs=None)  # None: latency -> --batch-size, else the engine's
    parser.add_argument("--max-batch-size", dest="max_num_seqs", type=int,
                        default=argparse.SUPPRESS, help="alias of --max-num-seqs")
    parser.add_argument("--output-json", default=None, help="write the full result here")
    parser.add_argument("--label", default=None, help="workload name in the report (e.g. W2)")


def _add_latency(bench_sub) -> None:
    p = bench_sub.add_parser("latency", help="batch-B decode speed, TTFT, %% of speed of light")
    _add_engine_flags(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=5)
    p.set_defaults(func=latency_main)


def _add_throughput(bench_sub) -> None:
    p = bench_sub.add_parser("throughput", help="N requests at once: tok/s and latencies")
    _add_engine_flags(p)
    p.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: fixed lengths; w5: BENCHMARKS.md's mixed workload")
    p.add_argument("--input-len", type=int, default=128, help="random dataset only")
    p.add_argument("--output-len", type=int, default=128, help="random dataset only")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default: 1000 (random), 256 (w5)")
    p.add_argument("--warmup-requests", type=int, default=16,
                   help="short untimed requests run first (0: none)")
    p.add_argument("--baseline", choices=("hf",), default=None,
                   help="also run the workload through transformers generate, same process")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch of the baseline")
    p.add_argument("--hf-num-requests", type=int, default=None,
                   help="baseline runs only the first N requests (default: all)")
    p.set_defaults(func=throughput_main)


def add_bench_parsers(subparsers) -> argparse._SubParsersAction:
    """Add `bench` with `latency` and `throughput`; returns bench's sub-subparsers."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: bench latency (batch-B decode), bench throughput (N requests "
        "offline), bench serve (against a running server)",
        description="Benchmarks. MODE is latency, throughput or serve; `slipstream bench MODE "
        "--help` lists its flags.")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="MODE")
    bench_sub.required = True
    _add_latency(bench_sub)
    _add_throughput(bench_sub)
    return bench_sub


def _finish(result: dict, output_json: str | None) -> int:
    from slipstream.bench import report

    report.write_json(result, output_json)
    if output_json:
        print(f"[bench] wrote {output_json}", flush=True)
    report.print_result(result)  # the table goes last: a device reply keeps only the tail
    return 0


def latency_main(args: argparse.Namespace) -> int:
    from slipstream.bench.latency import run_latency

    return _finish(run_latency(args), args.output_json)


def throughput_main(args: argparse.Namespace) -> int:
    from slipstream.bench.throughput import run_throughput

    return _finish(run_throughput(args), args.output_json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.bench.cli")
    sub = parser.add_subparsers(dest="command")
    add_bench_parsers(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        argv = ["bench", *argv]  # `python -m slipstream.bench.cli throughput ...`
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
