"""`slipstream quantize`: post-training quantization of a checkpoint (a directory or a GGUF file)
into a new checkpoint directory.

The lead wires `add_quantize_parser(subparsers)` into slipstream/cli.py; the output directory
loads with `LLM(model=OUTPUT)` (its config.json carries the quantization_config and, with
--kv-cache-dtype, the KV dtype whose calibrated per-layer scales the checkpoint holds).
"""
from __future__ import annotations

import argparse
import re

from slipstream.assets import default_model_path
from slipstream.quantization.checkpoint import METHODS, quantize_checkpoint
from slipstream.quantization.int4_awq import DEFAULT_GPTQ
from slipstream.quantization.kv_cache import QUANT_KV_NAMES
from slipstream.quantization.lm_head import FORMAT_NAMES, cli_choice


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize", help="quantize a checkpoint (int8_wo, fp8, int4_awq, w8a8_sq; KV cache fp8, "
                         "int8) into a new one",
        description="Post-training quantization. Calibrates on --calib-data (built-in texts when "
                    "omitted) for the methods that need it, writes a checkpoint to --output.")
    p.add_argument("--model", default=None, help="source checkpoint: a Hugging Face directory, "
                   "a .gguf file or a directory holding one (default: the embedded model)")
    p.add_argument("--method", required=True, choices=METHODS,
                   help="weight quantization; 'none' keeps the weights (KV-cache scales only)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--calib-data", default=None,
                   help=".jsonl ({'text': ...} per line), .json (list of strings) or text file")
    p.add_argument("--num-calib-samples", type=int, default=128)
    p.add_argument("--max-calib-len", type=int, default=512, help="tokens per sample at most")
    p.add_argument("--group-size", type=int, default=128,
                   help="int4_awq: input channels per scale (32, 64, 128, ...; -1: one scale per "
                        "output channel); a short last group where it does not divide a layer's "
                        "input size")
    p.add_argument("--gptq", dest="gptq", action="store_true", default=DEFAULT_GPTQ,
                   help="int4_awq: GPTQ rounding, each input column's rounding error spread onto "
                        "the columns not yet rounded" + (" (default)" if DEFAULT_GPTQ else ""))
    p.add_argument("--no-gptq", dest="gptq", action="store_false",
                   help="int4_awq: round to nearest (after the AWQ search, which then runs by "
                        "default)")
    p.add_argument("--awq", dest="awq", action="store_true", default=None,
                   help="int4_awq: activation-aware scale search (default only with --no-gptq; "
                        "with GPTQ its scales come first, without clipping)")
    p.add_argument("--no-awq", dest="awq", action="store_false",
                   help="int4_awq: no activation-aware scale search")
    p.add_argument("--alpha", type=float, default=0.5, help="w8a8_sq: migration strength")
    p.add_argument("--keep-float", type=int, default=0, metavar="N",
                   help="fp8: keep in 16 bits the N projections whose FP8 rounding changes the "
                        "model most on the calibration set (written as `ignored_layers`)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *QUANT_KV_NAMES),
                   help="fp8 / int8: calibrate per-layer K/V scales on the calibration set and "
                        "make this the checkpoint's KV-cache dtype (auto: no KV quantization)")
    p.add_argument("--quantize-lm-head", nargs="?", const=True, default=False,
                   type=cli_choice, metavar="FORMAT",
                   help="the output's config asks the engine to quantize the LM head at load "
                        "too: one byte per weight (fp8 with fp8, else int8), or the FORMAT "
                        f"named ({', '.join(FORMAT_NAMES)})")
    p.add_argument("--device", default="cpu", help="where calibration and quantization run")
    p.add_argument("--max-shard-size", default="5GB", type=parse_size,
                   help="largest weight file written (e.g. 5GB, 500MB); a bigger checkpoint is "
                        "split into shards with an index, as transformers writes them")
    p.set_defaults(func=run_quantize)
    return p


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000000' -> bytes (decimal units as transformers reads them)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def _options(ns: argparse.Namespace) -> dict:
    if ns.method == "int4_awq":
        return {"group_size": ns.group_size, "awq": ns.awq, "gptq": ns.gptq}
    if ns.method == "w8a8_sq":
        return {"alpha": ns.alpha}
    if ns.method == "fp8" and ns.keep_float:
        return {"keep_float": ns.keep_float}
    return {}


def run_quantize(ns: argparse.Namespace) -> int:
    kv = None if ns.kv_cache_dtype == "auto" else ns.kv_cache_dtype
    if ns.method == "none" and kv is None:
        raise SystemExit("slipstream quantize: --method none quantizes only the KV cache; "
                         "pass --kv-cache-dtype fp8 or int8")
    if ns.keep_float < 0 or (ns.keep_float and ns.method != "fp8"):
        raise SystemExit("--keep-float takes a count >= 0, with --method fp8")
    if ns.num_calib_samples < 1:
        raise SystemExit("--num-calib-samples must be at least 1")
    model = ns.model
    if model is None:
        model = str(default_model_path())
    out = quantize_checkpoint(model, ns.method, ns.output, calib_data=ns.calib_data,
                              num_calib_samples=ns.num_calib_samples,
                              max_calib_len=ns.max_calib_len, device=ns.device,
                              options=_options(ns), kv_cache_dtype=kv,
                              quantize_lm_head=ns.quantize_lm_head,
                              max_shard_bytes=ns.max_shard_size)
    kv_note = f" with {kv} KV-cache scales" if kv else ""
    print(f"wrote {ns.method} checkpoint{kv_note} to {out}")
    return 0
