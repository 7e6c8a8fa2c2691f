"""Probe: PyTorch's tinygemm int4 kernel (torch._weight_int4pack_mm) at M=1 against slipstream's
tuned w4 GEMV, Llama-3.1-8B shapes, graph-timed over weight copies past L2."""
import sys

import torch

sys.path.insert(0, ".")
from slipstream.kernels import gemv_int4
from slipstream.quantization import utils as qu

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


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


for name, (n, k) in SHAPES.items():
    copies = max(2, (400 << 20) // (n * k // 2))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ours, tiny = [], []
    err = None
    for c in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        q, s, z = qu.quantize_int4_groupwise(w, 128)
        packed = qu.pack_int4_rows(q)
        sh = s.half()
        ours.append((packed, sh, z))
        # tinygemm: w = (q - 8) * scale + zero  ->  zero = (8 - z) * scale
        sc = sh.float()
        zero = (8 - z.float()) * sc
        sz = torch.stack([sc, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        q8 = (q[:, ::2].to(torch.uint8) << 4 | q[:, 1::2].to(torch.uint8)).contiguous()
        tp = torch._convert_weight_to_int4pack(q8, 8)
        tiny.append((tp, sz))
        if c == 0:
            a = gemv_int4.w4_linear_small(x, packed, sh, z, 128).float()
            b = torch._weight_int4pack_mm(x, tp, 128, sz).float()
            err = ((a - b).abs().max() / a.abs().max()).item()
    t_ours = graph_us([lambda p=p, x=x: gemv_int4.w4_linear_small(x, *p, 128) for p in ours])
    t_tiny = graph_us([lambda p=p, x=x: torch._weight_int4pack_mm(x, p[0], 128, p[1]) for p in tiny])
    mb = n * k / 2 / 1e6
    print(f"{name:8s} {mb:6.1f} MB  ours {t_ours:6.1f} us ({mb / t_ours:.2f} TB/s)  "
          f"tinygemm {t_tiny:6.1f} us ({mb / t_tiny:.2f} TB/s)  rel diff {err:.4f}", flush=True)
