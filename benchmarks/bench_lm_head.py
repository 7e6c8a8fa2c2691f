"""The quantized LM head's decode GEMV alone, per format (quantize_lm_head): Llama-3.1-8B's
128256 x 4096 head at 1-4 rows, graph-timed over weight copies past L2 (kernels/runtime/tuning.py).

    python benchmarks/bench_lm_head.py --formats int8_wo,int4 --output-json $OUT/lm_head.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
from slipstream.layers.embedding import LMHead


def time_head(fmt: str, m: int, vocab: int, hidden: int) -> dict:
    head = LMHead(vocab, hidden, torch.bfloat16).cuda()
    head.weight.data.normal_(0, 0.02)
    head.quantize(fmt)
    stored = head.quantized_tensors()
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    head.quantized_linear(x, *stored)  # the tuner's measurement, outside the timing
    us = graph_time_us(lambda a: head.quantized_linear(x, *a), weight_copies(stored))
    nbytes = sum(t.numel() * t.element_size() for t in stored)
    return {"format": fmt, "m": m, "us": round(us, 2), "mb": round(nbytes / 1e6, 1),
            "tb_s": round(nbytes / us / 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8_wo,int4")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--output-json", default="")
    ns = ap.parse_args()
    rows = [time_head(fmt, int(m), ns.vocab, ns.hidden)
            for fmt in ns.formats.split(",") for m in ns.ms.split(",")]
    for r in rows:
        print(f"{r['format']:8} M={r['m']:<3} {r['us']:8.2f} us  {r['mb']:7.1f} MB  {r['tb_s']} TB/s")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                        rows=rows), indent=1))


if __name__ == "__main__":
    main()
