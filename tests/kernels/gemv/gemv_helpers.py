"""Shared pieces of the quantized GEMV tests: int4 weights in int4_awq's stored layout, the
relative error measure, the gate-out check, and the CUDA C++ one-row GEMVs' fused-variant and
CUDA-graph drivers."""
from __future__ import annotations

import torch

from slipstream.kernels.gemv.dense import COUNTERS
from slipstream.kernels.reference import silu_and_mul
from slipstream.quantization import utils as qu


def quantized(n: int, k: int, group: int, device: str = "cpu", seed: int = 0):
    """(packed uint8 [N, K/2], float16 scales, uint8 zeros) of a random [N, K] weight."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device)
    q, scales, zeros = qu.quantize_int4_groupwise(w, group)
    return qu.pack_int4_rows(q), scales.half(), zeros


def quantized_float_zeros(n: int, k: int, group: int, device: str = "cpu", seed: int = 0):
    """(packed uint8 [N, K/2], float16 scales d, float16 zeros -m) of a random [N, K] weight
    rounded as GGUF Q4_1 rounds a block (w = q d + m, m the group's minimum, d its range / 15;
    the layout's float zeros hold the zero point times the scale, -m). The first row's first
    group is constant (d = 0: w = m), which an in-kernel division by d would turn into NaN;
    every other group's -m / d is no integer."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) + 0.3
    w[0, :group] = 0.7
    groups = qu.pad_to_groups(w, group).reshape(n, -1, group)
    pad = groups.shape[1] * group - k
    if pad:  # the short last group's pad takes the minimum: it changes neither m nor d
        groups[:, -1, group - pad:] = groups[:, -1, :group - pad].amin(-1, keepdim=True)
    lo = groups.amin(-1)
    m, d = lo.half(), ((groups.amax(-1) - lo) / 15).half()
    q = torch.round((groups - m.float()[..., None]) / d.float().clamp_min(1e-8)[..., None])
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, -1)[:, :k]
    return qu.pack_int4_rows(q), d, -m


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def check_gate_out(got: torch.Tensor, product: torch.Tensor) -> None:
    """A one-row gate-out result equals silu_and_mul of the same config's stored [gate | up]
    product (each operand rounded to bf16 first), and the split-K counters are back at zero."""
    assert got.shape == (1, product.shape[-1] // 2) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), silu_and_mul(product.float()), atol=1e-5, rtol=1e-2)
    for buf in COUNTERS.values():
        assert int(buf.abs().sum()) == 0


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) per row in float64: the reference input of the in-GEMV RMS norm."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def fused_variant(run, bias: bool, rms_eps: float, gate_out: bool, n: int = 2048,
                  k: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(run's output, the float reference) for a one-row int4 GEMV on the GPU with a bias, the
    folded norm (rms_eps > 0) and / or as a gate-out: run(x, q, s, z, bias, rms_eps=,
    gate_out=)."""
    from slipstream.kernels.gemv.int4_common import w4_linear_reference

    q, s, z = quantized(n, k, 128, device="cuda", seed=7)
    x = (torch.randn(1, k, device="cuda") * 3).bfloat16()
    b = torch.randn(n, device="cuda").bfloat16() if bias else None
    got = run(x, q, s, z, b, rms_eps=rms_eps, gate_out=gate_out)
    xr = rms_normed(x, rms_eps) if rms_eps else x.double()
    want = w4_linear_reference(xr, q, s, z, 128, None if b is None else b.double()).float()
    if gate_out:
        want = silu_and_mul(want.bfloat16().float())
    return got, want


def replayed_in_a_graph(run, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, the float reference) after run(x, q, s, z, out=out) was captured three times back
    to back in a CUDA graph (under PDL) and replayed on a new x."""
    from slipstream.kernels.gemv.int4_common import w4_linear_reference

    q, s, z = quantized(n, k, 128, device="cuda", seed=3)
    x = torch.randn(1, k, device="cuda").bfloat16()
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    run(x, q, s, z, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            run(x, q, s, z, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    return out, w4_linear_reference(x, q, s, z, 128)
