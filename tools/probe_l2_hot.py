"""How much faster a one-row GEMV runs when its weights are already in L2: the ceiling of any L2
prefetch (kernels/attention/l2_spans.py). Llama-3.1-8B shapes that fit the H200's 50 MB L2, int4_awq
(the tuner's choice) and bf16 (the engine's linear), each graph-timed three ways:

- cold: cycling through weight copies past L2 (as the tuner times them, as a decode step runs);
- hot: the same weights every call (served from L2 after the first);
- prefetched: cold copies, each call after a bulk L2 prefetch of its weights and a 12 us spin
  (the time of prefetch + spin alone subtracted), the decode step's situation at its best.

    python tools/probe_l2_hot.py [--output-json F]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slipstream.kernels import triton_ops
from slipstream.kernels.attention.l2_prefetch import prefetch
from slipstream.kernels.attention.l2_spans import span_table
from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.tuning import _replay_us, weight_copies
from slipstream.quantization import utils as qu

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up_half": (14336, 4096),
          "down": (4096, 14336)}


def times(fn, args: tuple[torch.Tensor, ...], weights_of) -> dict:
    cold = weight_copies(args)
    tables = [span_table([list(weights_of(a))], 1 << 40, a[0].device) for a in cold]
    by_id = {id(a[1]): t for a, t in zip(cold, tables, strict=True)}
    dev = args[0].device

    def warmed(a):
        prefetch(by_id[id(a[1])])
        pdl.spin(dev, 12.0)

    out = {"cold_us": _replay_us(lambda a: fn(*a), cold, 24, 7),
           "hot_us": _replay_us(lambda a: fn(*a), [args], 24, 7)}
    both = _replay_us(lambda a: (warmed(a), fn(*a)), cold, 24, 7)
    out["prefetched_us"] = both - _replay_us(warmed, cold, 24, 7)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json")
    ns = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        q, s, z = qu.quantize_int4_groupwise(w, 128)
        packed = (qu.pack_int4_rows(q), s.half(), z)
        r4 = times(lambda x, *p: gemv_int4.int4_linear(x, *p, 128), (x, *packed), lambda a: a[1:])
        rows.append({"shape": name, "format": "int4", "mb": sum(
            t.numel() * t.element_size() for t in packed) / 1e6, **r4})
        if 2 * n * k <= 40e6:
            r16 = times(triton_ops.linear, (x, w), lambda a: a[1:])
            rows.append({"shape": name, "format": "bf16", "mb": 2 * n * k / 1e6, **r16})
        for r in rows[-2:]:
            if r["shape"] == name:
                print(f"{name:<13} {r['format']:<5} {r['mb']:6.1f} MB  cold {r['cold_us']:6.1f} "
                      f"hot {r['hot_us']:6.1f} prefetched {r['prefetched_us']:6.1f} us",
                      flush=True)
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
