"""Does the register-streaming CUDA C++ one-row int4 GEMV (kernels/cuda/w4_stream.cu) beat the Triton
one-row kernels the tuner picks, alone and in a layer's chain?

Each shape runs as the decode layer calls it: qkv with the folded norm, o plain, gate_up as the
gate-out with the norm, down plain. Rows: the production path (the tuner's measured choice),
then each stream config (warps:ksplit:depth:min_blocks; "default" = default_config),
graph-timed over weight copies past L2, back to back (idle 0) and after a one-program spin
(idle N us). --chain also times a layer's four GEMVs back to back with a 6-us spin for
attention between qkv and o, Triton against the stream kernel's default configs. Every row is
checked against the float reference first.

  python tools/probe_w4_stream.py --shapes gate_up,down,qkv,o --chain --output-json F
"""
from __future__ import annotations

import argparse

import torch

# run as a script, this folder is on the path: the shared operands and reporting
from probe_w4_overlap import SHAPES, dump_rows, print_row, random_w4

from slipstream.kernels.cuda.w4_stream import StreamConfig, w4_gemv_stream
from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv.int4_common import w4_linear_reference
from slipstream.kernels.reference import silu_and_mul
from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies

GROUP = 128
EPS = 1e-5
KIND = {"qkv": dict(rms_eps=EPS), "o": {}, "gate_up": dict(rms_eps=EPS, gate_out=True),
        "down": {}}


def _reference(x, qweight, scales, zeros, rms_eps=0.0, gate_out=False) -> torch.Tensor:
    xr = x.double()
    if rms_eps:
        xr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + rms_eps)
    out = w4_linear_reference(xr, qweight, scales, zeros, GROUP).float()
    return silu_and_mul(out.bfloat16()).float() if gate_out else out


def _triton(x, qweight, scales, zeros, rms_eps=0.0, gate_out=False):
    if gate_out:
        return gemv_int4.w4_linear_small_gate_out(x, qweight, scales, zeros, GROUP, None, rms_eps)
    if rms_eps:
        return gemv_int4.w4_linear_small_rms(x, qweight, scales, zeros, GROUP, None, rms_eps)
    return gemv_int4.w4_linear_small(x, qweight, scales, zeros, GROUP)


def _stream(cfg):
    def run(x, qweight, scales, zeros, rms_eps=0.0, gate_out=False):
        return w4_gemv_stream(x, qweight, scales, zeros, rms_eps=rms_eps, gate_out=gate_out,
                              config=cfg)
    return run


def _row(name, kernel, fn, ops, ref, idles, **extra) -> dict:
    x, words, scales, zeros = ops
    kind = KIND[name]
    row = dict(shape=name, kernel=kernel, **extra)
    try:
        out = fn(x, words.view(torch.uint8), scales, zeros, **kind)
        torch.cuda.synchronize()
        row["max_err"] = float((out.float() - ref).abs().max())
        row["ok"] = row["max_err"] <= 2e-2 * ref.abs().max().item()
        for idle in idles:
            row[f"us_idle{idle:g}"] = graph_time_us(
                lambda a: fn(x, a[0].view(torch.uint8), a[1], a[2], **kind),
                weight_copies((words, scales, zeros)), idle_before_us=idle)
    except Exception as exc:  # report and go on
        row["error"] = str(exc)[:300]
    return row


def _chain_us(fns: dict, operands: dict) -> float:
    """A layer's GEMVs back to back (fns[name] per shape), a 6-us spin for attention after qkv,
    over weight copies past L2."""
    names = ["qkv", "o", "gate_up", "down"]
    copies = [weight_copies(operands[n][1:]) for n in names]
    sets = [tuple(t for c in copies for t in c[i % len(c)]) for i in range(max(map(len, copies)))]
    device = operands["qkv"][0].device

    def layer(a):
        for i, n in enumerate(names):
            x = operands[n][0]
            fns[n](x, a[3 * i].view(torch.uint8), a[3 * i + 1], a[3 * i + 2], **KIND[n])
            if n == "qkv":
                pdl.spin(device, 6.0)
    return graph_time_us(layer, sets, min_calls=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default="")
    ap.add_argument("--shapes", default="gate_up,down,qkv,o")
    ap.add_argument("--configs", default="default,8:1:2:2,8:1:4:2,8:2:2:2,8:4:2:2,8:8:2:2,"
                                         "4:2:2:4")
    ap.add_argument("--idle", default="0,8")
    ap.add_argument("--chain", action="store_true")
    ns = ap.parse_args()
    idles = [float(v) for v in ns.idle.split(",")]
    rows, operands = [], {}
    for name in ns.shapes.split(","):
        n, k = SHAPES[name]
        ops = operands[name] = random_w4(n, k)
        x, words, scales, zeros = ops
        ref = _reference(x, words.view(torch.uint8), scales, zeros, **KIND[name])
        rows.append(_row(name, "production", _triton, ops, ref, idles))
        print_row(rows[-1])
        for spec in ns.configs.split(","):
            cfg = None if spec == "default" else StreamConfig.parse(spec)
            rows.append(_row(name, "stream", _stream(cfg), ops, ref, idles, config=spec))
            print_row(rows[-1])
    if ns.chain and set(operands) >= {"qkv", "o", "gate_up", "down"}:
        for label, fns in (("production", dict.fromkeys(operands, _triton)),
                           ("stream", dict.fromkeys(operands, _stream(None)))):
            rows.append(dict(shape="layer_chain", kernel=label, us=_chain_us(fns, operands)))
            print_row(rows[-1])
    dump_rows(ns.output_json, rows)


if __name__ == "__main__":
    main()
