"""Probe: the whole-K tile loop (persist) against W1's int4 choices at one row, graph-timed over
weight copies past L2; each output checked against the reference first."""
import sys

import torch

sys.path.insert(0, ".")
from slipstream.kernels import gemv_int4  # noqa: E402
from slipstream.kernels.gemv_int4 import W4Config  # noqa: E402
from slipstream.quantization import utils as qu  # noqa: E402


def whole(bn, w, p=0):
    return W4Config(bn, 128, 1, w, 1, True, bit_convert=2, whole_k=True, persist=p)


SHAPES = {"gate_up": (28672, 4096, whole(16, 4)),
          "down": (4096, 14336, W4Config(128, 128, 0, 8, 1, 2, bit_convert=2)),
          "qkv": (6144, 4096, whole(8, 4)), "o": (4096, 4096, whole(8, 4))}
LOOPS = {4096: [whole(16, 4, 2), whole(8, 4, 4), whole(8, 4, 5), whole(4, 4, 8), whole(16, 8, 2),
                whole(8, 4, 2)],
         14336: [whole(2, 4, 3), whole(4, 8, 2), whole(2, 4, 2), whole(4, 8, 1)]}


def graph_us(fns, reps=10):
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        e.synchronize()
        best = min(best, 1e3 * s.elapsed_time(e) / (reps * len(fns)))
    return best


for name, (n, k, base) in SHAPES.items():
    copies = max(2, (400 << 20) // (n * k // 2))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ws = []
    for _ in range(copies):
        q, s, z = qu.quantize_int4_groupwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), 128)
        ws.append((qu.pack_int4_rows(q), s.half(), z))
    want = gemv_int4.w4_linear_reference(x, *ws[0], 128).float()
    for cfg in [base] + LOOPS[k]:
        try:
            got = gemv_int4.w4_gemv(x, *ws[0], 128, None, cfg).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            us = graph_us([lambda p=p, c=cfg, x=x: gemv_int4.w4_gemv(x, *p, 128, None, c) for p in ws])
            line = f"{name:8s} {cfg.label():70s} {us:6.1f} us  {n * k / 2e6 / us:.2f} TB/s  err {err:.4f}"
            if name == "gate_up":
                gx = gemv_int4.w4_gemv_gate_out(x, *ws[0], 128, None, cfg).float()
                from slipstream.kernels.reference import silu_and_mul
                ge = ((gx - silu_and_mul(got.bfloat16().float())).abs().max() / gx.abs().max()).item()
                gus = graph_us([lambda p=p, c=cfg, x=x: gemv_int4.w4_gemv_gate_out(
                    x, *p, 128, None, c) for p in ws])
                line += f"  gate-out {gus:6.1f} us err {ge:.4f}"
            print(line, flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{name:8s} {cfg.label():70s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
