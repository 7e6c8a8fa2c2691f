"""One-row int4 GEMVs on the Llama-3.1-8B shapes: the k-warps mma kernel (gemv_int4_kwarps) in
each of its configs against the kernel the tuner picks without it, for the plain product, the
product of x / rms(x) and the fused gate-out (SiLU(gate)·up), each tuned as it runs.
Graph-timed over L2-sized weight copies like the tuner; plain results checked against the
float64 reference.

  python benchmarks/bench_w4_kwarps.py --output-json $OUT/kwarps.json
"""
from __future__ import annotations

import argparse
import json
import logging

import torch

from slipstream.kernels import gemv_int4
from slipstream.kernels.gemv_int4 import KWARPS_CONFIGS, _kwarps_ok
from slipstream.kernels.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils as qu

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _weight(n: int, k: int):
    w = torch.randn(n, k, device="cuda") * 0.02
    q, s, z = qu.quantize_int4_groupwise(w, 128)
    return qu.pack_int4_rows(q), s.half(), z


def _time(fn, args) -> float:
    return graph_time_us(lambda a: fn(*a), weight_copies(args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default="")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ns = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    gemv_int4._KWARPS = True  # (only for the _kwarps_ok checks below; each pick turns it off)
    rows = []
    for name in ns.shapes.split(","):
        n, k = SHAPES[name]
        q, s, z = _weight(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = gemv_int4.w4_linear_reference(x.double(), q, s, z, 128).float()
        kinds = [("plain", False, 0.0)] + ([("gate-out", True, 0.0)] if name == "gate_up" else [])
        kinds += [("rms", False, 1e-5)] if name in ("qkv", "gate_up") else []
        for kind, gate, eps in kinds:
            gemv_int4._KWARPS = False  # the tuner's pick for this call without k-warps
            base = gemv_int4._small_choice(x, q, s, z, 128, None, gate_out=gate, rms_eps=eps)
            gemv_int4._SMALL_CHOICES.clear()
            print(f"{name} {kind}: tuner's pick {base.label()}")
            for cfg in [base] + KWARPS_CONFIGS:
                if cfg.kwarps and not _kwarps_ok(cfg, x, n, k, 128, gate):
                    continue
                if gate:
                    fn = lambda x_, q_, s_, z_, c=cfg: gemv_int4.w4_gemv_gate_out(  # noqa: E731
                        x_, q_, s_, z_, 128, None, c)
                else:
                    fn = lambda x_, q_, s_, z_, c=cfg, e=eps: gemv_int4.w4_gemv(  # noqa: E731
                        x_, q_, s_, z_, 128, None, c, rms_eps=e)
                try:
                    got = fn(x, q, s, z).float()
                    if kind == "plain":
                        err = ((got - want).norm() / want.norm()).item()
                    else:
                        err = float("nan")
                    us = _time(fn, (x, q, s, z))
                except Exception as exc:  # report and go on
                    print(f"{name:8} {kind:8} {cfg.label():45} failed: {exc}"[:200])
                    continue
                gbs = (q.numel() + s.numel() * 2 + z.numel()) / us / 1e3
                print(f"{name:8} {kind:8} {cfg.label():45} {us:7.1f} us {gbs:6.0f} GB/s "
                      f"rel err {err:.2e}")
                rows.append(dict(shape=name, n=n, k=k, kind=kind, config=cfg.label(), us=us,
                                 gbps=gbs, rel_err=err, tuner_choice=cfg is base))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
