"""One-row int4_awq GEMV in CUDA C++ (w4_stream.cu), bound by streaming the weights from HBM.

Every warp streams its own 16-row tiles into registers a chunk of groups ahead and sums on the
int8 tensor cores, x an exact split into int8 halves a group of 128 (split_int8_x /
w4_split_int8_reference are its plain-torch twin). Small blocks, x's split the only shared
memory, so they share SMs with the kernels around them. Plain, with bias, with the folded
RMSNorm (rms_eps) and as a gate-out; any K that is a multiple of 128. CUDA only (NVRTC,
kernels/cuda/launch.py).

On by default on sm_90 and newer (it waits on PDL's griddepcontrol): maybe_stream routes
int4_awq's one-row calls here instead of the Triton kernels' tuner; envs.CUDA_GEMV
(SLIPSTREAM_CUDA_GEMV=0) turns it off. If NVRTC cannot compile it, a warning says so and the
Triton kernels serve every call.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from slipstream import envs
from slipstream.kernels.cuda.launch import compile_kernel
from slipstream.kernels.gemv.dense import num_sms
from slipstream.kernels.gemv.int4_common import packed_words
from slipstream.quantization import utils as qu

_log = logging.getLogger(__name__)
ROWS = 16
GROUP = 128


@dataclass(frozen=True)
class StreamConfig:
    """warps a block; ksplit warps share a tile (K / ksplit each); depth groups a warp has in
    flight (in registers); min_blocks an SM (the register budget)."""
    warps: int = 8
    ksplit: int = 1
    depth: int = 2
    min_blocks: int = 2

    @classmethod
    def parse(cls, spec: str) -> StreamConfig:
        """'warps:ksplit:depth:min_blocks' (the form benchmarks and tests write)."""
        return cls(*(int(v) for v in spec.split(":")))


def shared_bytes(k: int, warps: int) -> int:
    """x's split (256 bytes a group), each group's (step, sum), partial rows and squares,
    rounded up to 128 bytes."""
    ng = k // GROUP
    head = ng * 256 + ng * 8 + 2 * warps * ROWS * 4 + warps * 4
    return -(-head // 128) * 128


def config_ok(cfg: StreamConfig, k: int) -> bool:
    ng = k // GROUP
    return (k % GROUP == 0 and cfg.warps % cfg.ksplit == 0
            and (cfg.ksplit == 1 or cfg.warps // cfg.ksplit <= 15)
            and ng % cfg.ksplit == 0 and (ng // cfg.ksplit) % cfg.depth == 0)


def supported(n: int, k: int, group_size: int, gate_out: bool = False) -> bool:
    """Groups of 128 and 16-row tiles (gate-out: 8 gate + 8 up rows a tile)."""
    return group_size == GROUP and k % GROUP == 0 and k > 0 and n > 0 and n % ROWS == 0


def default_config(n: int, k: int, gate_out: bool, sms: int) -> StreamConfig:
    """16 warps a block (one block an SM's register budget), each 16-row tile over 8 of them
    (K / 8 a warp, two tiles a block), two groups in flight a warp: the fastest of the configs
    tried at Llama-3.1-8B's shapes (docs/history/kernels.md). Fewer warps a tile where K has
    fewer groups; one group a chunk where a warp's share is odd."""
    ng = k // GROUP
    ksplit = 8
    while ng % ksplit:
        ksplit //= 2
    depth = 2 if (ng // ksplit) % 2 == 0 else 1
    return StreamConfig(16, ksplit, depth, 1)


def w4_gemv_stream(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor, bias: torch.Tensor | None = None, *,
                   rms_eps: float = 0.0, gate_out: bool = False,
                   config: StreamConfig | None = None, grid: int | None = None,
                   pdl: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [K] or [1, K]; qweight uint8 [N, K/2]; scales fp16 / zeros uint8 [N, K/128];
    bias bf16 [N]. rms_eps > 0: the product of x / rms(x). gate_out: a [gate | up] weight,
    returns SiLU(gate) * up [.., N/2]."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if not supported(n, k, k // scales.shape[1], gate_out):
        raise ValueError(f"w4_gemv_stream: unsupported shape N={n} K={k} (groups of {GROUP}, "
                         f"N % {ROWS})")
    cfg = config or default_config(n, k, gate_out, num_sms(x.device))
    if not config_ok(cfg, k):
        raise ValueError(f"w4_gemv_stream: {cfg} does not split K={k} (groups a warp must be "
                         f"a multiple of depth; at most 15 shared tiles a block)")
    x = cuda_one_row_operands("w4_gemv_stream", x, qweight, scales, zeros, bias, GROUP)
    defines = (("K", k), ("WARPS", cfg.warps), ("KSPLIT", cfg.ksplit), ("DEPTH", cfg.depth),
               ("MINB", cfg.min_blocks), ("BIAS", int(bias is not None)),
               ("RMS", int(rms_eps > 0)), ("GATE_OUT", int(gate_out)))
    kernel = compile_kernel("w4_stream.cu", "w4_gemv_stream", defines, x.device.index or 0,
                            shared_bytes(k, cfg.warps))
    n_out = n // 2 if gate_out else n
    if out is None:
        out = torch.empty(x.shape[:-1] + (n_out,), dtype=x.dtype, device=x.device)
    n_tiles = n // ROWS
    slots = cfg.warps // cfg.ksplit
    blocks = grid or min(-(-n_tiles // slots), num_sms(x.device) * cfg.min_blocks)
    kernel.launch(blocks, cfg.warps * 32,
                  [x, qweight, scales, zeros, bias if bias is not None else out, out, n_tiles,
                   n // 2, float(rms_eps)], pdl)
    return out


def maybe_stream(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                 gate_out: bool = False, rms_eps: float = 0.0) -> torch.Tensor | None:
    """w4_gemv_stream for int4_awq's one-row calls (unless envs.CUDA_GEMV is off) on sm_90+,
    when the shape fits; else None (the caller's Triton path). Compiled on the first eager
    call: a shape first seen during a CUDA-graph capture stays on the Triton path."""
    k = x.shape[-1]
    if not (envs.CUDA_GEMV.get() and cuda_one_row_call(x, qweight, scales, zeros, bias)):
        return None
    if x.device.index in _BROKEN or torch.cuda.get_device_capability(x.device)[0] < 9:
        return None
    n = qweight.shape[0]
    if not supported(n, k, group_size, gate_out):
        return None
    cfg = default_config(n, k, gate_out, num_sms(x.device))
    if not config_ok(cfg, k):
        return None
    variant = (n, k, cfg, bias is not None, rms_eps > 0, gate_out, x.device.index)
    if torch.cuda.is_current_stream_capturing() and variant not in _COMPILED:
        return None
    try:
        out = w4_gemv_stream(x.reshape(1, k), qweight, scales, zeros, bias, rms_eps=rms_eps,
                             gate_out=gate_out, config=cfg)
    except (RuntimeError, OSError, ImportError) as exc:  # no NVRTC, or no build for this GPU
        if variant in _COMPILED:
            raise
        _BROKEN.add(x.device.index)
        _log.warning("the CUDA C++ int4 GEMV (w4_stream.cu) is unavailable, the Triton kernels "
                     "serve int4 one-row calls instead: %s", exc)
        return None
    _COMPILED.add(variant)
    return out.reshape(x.shape[:-1] + out.shape[-1:])


_COMPILED: set[tuple] = set()  # maybe_stream's variants compiled by an eager call
_BROKEN: set[int | None] = set()  # devices where the kernel failed to build


def cuda_one_row_call(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether an int4 call is one w4_stream.cu takes:
    one bf16 row of x on CUDA, contiguous weights with uint8 zeros (not float ones) and a
    contiguous bf16 bias or none."""
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype == torch.bfloat16
            and zeros.dtype == torch.uint8
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous())


def cuda_one_row_operands(name: str, x: torch.Tensor, qweight: torch.Tensor,
                          scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                          group_size: int) -> torch.Tensor:
    """w4_stream.cu's operand checks (a ValueError naming `name` and the reason);
    returns x contiguous and 16-byte aligned for their 128-bit loads."""
    k = x.shape[-1]
    if x.numel() != k or x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: one bf16 row of x, got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.numel() != qweight.shape[0]
                             or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be contiguous bf16 [N], got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    packed_words(qweight, scales, zeros, group_size, k)  # the layout's shape and dtype checks
    if zeros.dtype != torch.uint8:
        raise ValueError(f"{name}: uint8 zero points only, got {zeros.dtype} (float zeros run "
                         f"the Triton kernels)")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError(f"{name}: qweight, scales and zeros must be contiguous")
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous().clone()
    return x


def split_int8_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq int32 [..., K], step float32 [..., K/128]): w4_stream.cu's x numerics.
    Per group of 128, xq = round(x / step) with step = max|x| / 32512, so that xq splits exactly
    into int8 halves hi * 256 + lo, hi = (xq + 128) >> 8 (a 15-bit fixed point a group)."""
    g = x.float().unflatten(-1, (-1, GROUP))
    amax = g.abs().amax(-1)
    step = torch.where(amax > 0, amax / 32512.0, torch.ones_like(amax))
    inv = torch.where(amax > 0, 32512.0 / amax, torch.zeros_like(amax))
    # float32 product then round-half-even: the kernel's __float2int_rn(v * inv)
    xq = torch.round(g * inv[..., None]).to(torch.int32)
    return xq.flatten(-2), step


def w4_split_int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor) -> torch.Tensor:
    """The plain-torch twin of w4_gemv_stream's numerics: per row n and group g,
    s[n,g] * step[g] * sum_k (q - z) xq, the sum exact in integers. Output in x's dtype."""
    xq, step = split_int8_x(x)
    # float64 holds every integer here exactly (|sum| < 2^26), and unlike int64 it has a
    # matmul on CUDA
    q = qu.unpack_int4_rows(qweight).to(torch.float64)  # [N, K]
    n, k = q.shape
    xg = xq.to(torch.float64).unflatten(-1, (-1, GROUP))
    dots = torch.einsum("ngk,...gk->...ng", q.view(n, k // GROUP, GROUP), xg)
    exact = dots - zeros.to(torch.float64) * xg.sum(-1)[..., None, :]
    out = (scales.float() * step[..., None, :] * exact.float()).sum(-1)
    return out.to(x.dtype)
