"""H200 probe (session 24): the TMA-fed one-row int4 GEMV (slipstream/kernels/gemv_int4_tma.py
at the experiment commit) against the tuner's choice, Llama-3.1-8B shapes, graph-timed over
weight copies past L2. BNS / STS / WPS: the block_n, stages and warps swept; FAKE=1 re-reads the
first chunk's x, scales and zeros every step (wrong output, timing only)."""
import itertools
import json
import os
import time

import torch

from slipstream.kernels import gemv_int4 as G4
from slipstream.kernels import gemv_int4_tma as T
from slipstream.kernels.int4_common import packed_words, w4_linear_reference
from slipstream.kernels.tuning import graph_time_us, weight_copies

GS = 128
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def env_ints(name: str, default: str) -> list[int]:
    return [int(v) for v in os.environ.get(name, default).split(",")]


def tma_runner(n: int, k: int, gate: bool, bn: int, st: int, w: int):
    def run(a):
        out = torch.empty(1, n // 2 if gate else n, dtype=torch.bfloat16, device="cuda")
        T.launch(a[0], packed_words(a[1], a[2], a[3], GS, k), a[2], a[3], None, out, GS, bn, st,
                 w, gate_out=gate)
        return out
    return run


def probe_shape(name: str, n: int, k: int, t0: float) -> list[dict]:
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    s = (torch.rand(n, k // GS, device="cuda") * 0.02 + 0.01).half()
    z = torch.randint(0, 16, (n, k // GS), dtype=torch.uint8, device="cuda")
    x = torch.randn(1, k, device="cuda").bfloat16()
    ref = w4_linear_reference(x, q, s, z, GS).float()
    G4.w4_linear_small(x, q, s, z, GS)
    cfg = G4._small_choice(x, q, s, z, GS, None)
    sets = weight_copies((x, q, s, z))
    lines = []
    for gate in ([False, True] if name == "gate_up" else [False]):
        fn = G4.w4_gemv_gate_out if gate else G4.w4_gemv
        base = graph_time_us(lambda a, fn=fn: fn(a[0], a[1], a[2], a[3], GS, None, cfg), sets)
        want = ref
        if gate:
            g, u = ref[:, :n // 2].bfloat16().float(), ref[:, n // 2:].bfloat16().float()
            want = g * torch.sigmoid(g) * u
        line = {"layer": name + ("/gate-out" if gate else ""), "tuner": cfg.label(),
                "tuner_us": base, "tma": []}
        grid = itertools.product(env_ints("BNS", "16,32,64,128"), env_ints("STS", "3,4,6"),
                                 env_ints("WPS", "2,4,8"))
        for bn, st, w in grid:
            run = tma_runner(n, k, gate, bn, st, w)
            try:
                err = (run((x, q, s, z)).float() - want).abs().max().item()
                us = graph_time_us(run, sets)
                line["tma"].append((bn, st, w, round(us, 2), round(err / want.abs().max().item(), 4)))
            except Exception as exc:  # a tile that does not fit
                line["tma"].append((bn, st, w, None, str(exc)[:120]))
        timed = [t for t in line["tma"] if t[3] is not None]
        best = min(timed, key=lambda t: t[3], default=None)
        print(f"{line['layer']:16s} tuner {base:6.1f} us ({cfg.label()})  tma best {best}  "
              f"[{time.time() - t0:.0f}s]", flush=True)
        lines.append(line)
    return lines


def main() -> None:
    torch.manual_seed(0)
    t0 = time.time()
    res = [line for name, n, k in SHAPES for line in probe_shape(name, n, k, t0)]
    with open(os.path.join(os.environ.get("OUT", "."), "probe_tma.json"), "w") as f:
        json.dump(res, f, indent=1)
    for line in res:
        timed = sorted([t for t in line["tma"] if t[3] is not None], key=lambda t: t[3])
        print(line["layer"], timed[:6])


if __name__ == "__main__":
    main()
