"""`bench` argument parsing: the subparser group, vLLM-style flags, shape names."""
from __future__ import annotations

import argparse

from slipstream.bench.cli import add_bench_parsers


def _parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    return parser, add_bench_parsers(sub)


def test_bench_group_accepts_modes_from_other_modules():
    parser, bench_sub = _parser()
    serve = bench_sub.add_parser("serve")  # what `bench serve` does from its own module
    serve.add_argument("--request-rate", type=float)
    ns = parser.parse_args(["bench", "serve", "--request-rate", "2"])
    assert ns.bench_command == "serve" and ns.request_rate == 2.0


def test_throughput_flags():
    parser, _ = _parser()
    ns = parser.parse_args([
        "bench", "throughput", "--model", "llama-3.1-8b", "--load-format", "dummy",
        "--input-len", "1000", "--output-len", "900", "--num-requests", "77", "--dataset", "w5",
        "--max-num-tokens", "8192", "--max-batch-size", "512", "--max-model-len", "4096",
        "--enforce-eager", "--dtype", "bfloat16", "--baseline", "hf", "--hf-batch-size", "256",
        "--output-json", "x.json"])
    assert (ns.input_len, ns.output_len, ns.num_requests, ns.dataset) == (1000, 900, 77, "w5")
    assert (ns.max_num_tokens, ns.max_num_seqs, ns.max_model_len) == (8192, 512, 4096)
    assert ns.enforce_eager and ns.dtype == "bfloat16" and ns.baseline == "hf"
    assert ns.hf_batch_size == 256 and ns.output_json == "x.json"
    assert ns.func.__name__ == "throughput_main"


def test_latency_defaults_are_w1_and_batch_follows_batch_size():
    parser, _ = _parser()
    ns = parser.parse_args(["bench", "latency", "--model", "qwen3-0.6b"])
    assert (ns.batch_size, ns.input_len, ns.output_len) == (1, 128, 256)
    assert ns.max_num_seqs is None  # filled from --batch-size at run time
    assert parser.parse_args(["bench", "latency", "--max-num-seqs", "4"]).max_num_seqs == 4


def test_shape_name_implies_dummy_weights():
    from slipstream.bench.throughput import prepare_model

    parser, _ = _parser()
    ns = parser.parse_args(["bench", "throughput", "--model", "qwen3-0.6b"])
    model_dir, shape = prepare_model(ns)
    assert shape == "qwen3-0.6b" and ns.load_format == "dummy"
    assert (__import__("pathlib").Path(model_dir) / "config.json").is_file()


def test_engine_kwargs_stay_within_the_llm_keywords(tiny_model_dir):
    from slipstream.bench.throughput import engine_kwargs

    parser, _ = _parser()
    ns = parser.parse_args(["bench", "throughput", "--max-batch-size", "8"])
    kw = engine_kwargs(ns, str(tiny_model_dir), "float32", 100)
    assert kw["max_num_seqs"] == 8 and kw["max_model_len"] == 100 and kw["dtype"] == "float32"
    assert "device" not in kw and "enforce_eager" not in kw and "quantization" not in kw
    ns = parser.parse_args(["bench", "throughput", "--enforce-eager", "--device", "cpu",
                            "--no-prefix-caching"])
    kw = engine_kwargs(ns, str(tiny_model_dir), "float32", 100)
    assert kw["enforce_eager"] is True and kw["device"] == "cpu"
    assert kw["enable_prefix_caching"] is False
    # Every engine flag the bench parses reaches LLM (--quantize-lm-head was once dropped).
    ns = parser.parse_args(["bench", "latency", "--quantization", "fp8", "--quantize-lm-head",
                            "--decode-steps", "4", "--kv-cache-dtype", "fp8"])
    kw = engine_kwargs(ns, str(tiny_model_dir), "float32", 100)
    assert kw["quantize_lm_head"] is True and kw["decode_steps"] == 4
    assert kw["quantization"] == "fp8" and kw["kv_cache_dtype"] == "fp8"


def test_slipstream_cli_wires_bench_in():
    from slipstream.cli import build_parser

    ns = build_parser().parse_args(["bench", "throughput", "--num-requests", "3"])
    assert ns.func.__name__ == "throughput_main" and ns.num_requests == 3
