"""The Triton op table: fast twins of kernels/reference.py, plus a `linear` chosen by measurement.

ops() carries the names of kernels.OP_NAMES (an op whose kernel module fails to import falls
back to its reference twin) and linear(x, weight, bias): for at most gemv.MAX_M rows it times a
few Triton GEMV / skinny-GEMM configs against cuBLAS (torch F.linear) once per shape, keeps the
fastest, and uses cuBLAS for every larger M. envs.LINEAR (SLIPSTREAM_LINEAR=torch|triton) forces
one side.
"""
from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from slipstream import envs
from slipstream.kernels import OP_NAMES, reference
from slipstream.kernels.gemv import dense as _gemv
from slipstream.kernels.runtime import tuning_cache
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies

logger = logging.getLogger(__name__)

_OP_MODULES = {
    "rms_norm": "norm_act.rms_norm", "fused_add_rms_norm": "norm_act.rms_norm",
    "silu_and_mul": "norm_act.activation", "gelu_tanh_and_mul": "norm_act.activation",
    "apply_rotary": "attention.rotary_cache",
    "write_kv_cache": "attention.rotary_cache", "rotary_and_cache_write": "attention.rotary_cache",
    "paged_attention": "attention.paged",
}
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LinearKey = tuple[int, int, int, torch.dtype, bool, int | None]
# Per shape: the Triton config to use, or None for cuBLAS.
_CHOICES: dict[_LinearKey, _gemv.GemvConfig | None] = tuning_cache.register("linear", {})


def _load_op(name: str):
    try:
        module = importlib.import_module(f"slipstream.kernels.{_OP_MODULES[name]}")
        return getattr(module, name)
    except Exception as exc:  # a kernel that cannot load must not take the engine down
        logger.warning("Triton op %s unavailable (%s); using the reference twin", name, exc)
        return getattr(reference, name)


def _m_bucket(m: int) -> int:
    """Rows share a measured choice within 1 | 2-4 | 5-16 (memory-bound: time barely moves)."""
    return 1 if m == 1 else 4 if m <= 4 else _gemv.MAX_M


def _kernel_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # A transposed weight would need a copy per call: leave those to cuBLAS.
    return (weight.dim() == 2 and weight.stride(1) == 1 and weight.dtype == x.dtype
            and x.dtype in _KERNEL_DTYPES and (bias is None or bias.dim() == 1))


def _measure(m: int, weight: torch.Tensor, bias: torch.Tensor | None,
             dtype: torch.dtype) -> _gemv.GemvConfig | None:
    """Time cuBLAS and each candidate config on random rows; return the fastest (None: cuBLAS)."""
    n, k = weight.shape
    x = torch.randn((m, k), device=weight.device, dtype=dtype)
    expect = F.linear(x, weight, bias).float()
    arg_sets = weight_copies((x, weight) if bias is None else (x, weight, bias))
    best_cfg, best_us = None, graph_time_us(lambda a: F.linear(*a), arg_sets)
    for cfg in _gemv.candidate_configs(m, n, k):
        try:
            got = _gemv.gemv(x, weight, bias, cfg).float()
            # A config that computes a wrong answer (e.g. a miscompile) must never be chosen.
            if not torch.allclose(got, expect, rtol=2e-2, atol=2e-2 * expect.abs().max().item()):
                logger.warning("gemv config %s gave a wrong result for %s; skipped", cfg, (m, n, k))
                continue
            us = graph_time_us(lambda a, cfg=cfg: _gemv.gemv(*a, config=cfg), arg_sets)
        except Exception as exc:  # e.g. out of shared memory for this tile
            logger.debug("gemv config %s failed for %s: %s", cfg, (m, n, k), exc)
            continue
        if us < best_us:
            best_cfg, best_us = cfg, us
    logger.info("linear M<=%d N=%d K=%d: %s (%.1f us)", m, n, k, best_cfg or "cuBLAS", best_us)
    return best_cfg


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           *, impl: str | None = None) -> torch.Tensor:
    """F.linear semantics (weight [N, K]). impl: "triton", "torch" or None (measured choice).

    On the CPU (and the interpreter) the automatic choice is torch; ask for impl="triton"
    explicitly to run the kernel there.
    """
    impl = impl or envs.LINEAR.get()
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    small = 0 < m <= _gemv.MAX_M and _kernel_fits(x, weight, bias)
    if impl == "triton" and small:
        return _gemv.gemv(x, weight, bias)
    if impl == "torch" or not small or not x.is_cuda:
        return F.linear(x, weight, bias)
    cfg = _choice(m, weight, bias, x)
    return F.linear(x, weight, bias) if cfg is None else _gemv.gemv(x, weight, bias, cfg)


def linear_gated(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 act) -> torch.Tensor:
    """linear(act(gate_up), weight, bias) where gate_up = [gate | up] and act is silu_and_mul:
    when the measured choice for the shape is a Triton GEMV, the activation is computed inside
    it (one launch less per layer); otherwise act runs first."""
    m = gate_up.numel() // gate_up.shape[-1] if gate_up.shape[-1] else 0
    impl = envs.LINEAR.get()
    if (gate_up.is_cuda and impl != "torch" and 0 < m <= _gemv.MAX_M
            and _kernel_fits(gate_up, weight, bias)):
        cfg = _choice(m, weight, bias, gate_up)
        if cfg is not None:
            return _gemv.gemv(gate_up, weight, bias, cfg, gated=True)
    return linear(act(gate_up), weight, bias)


def linear_gate_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    rms_eps: float = 0.0) -> torch.Tensor | None:
    """silu_and_mul(linear(x, weight, bias)) in one launch for one row of x and a [gate | up]
    weight, when the measured choice for the product is a one-row Triton GEMV; else None.
    rms_eps > 0: of x / rms(x) (see linear_rms)."""
    cfg = _one_row_choice(x, weight, bias)
    if not _gemv.gate_out_ok(1, weight.shape[0], cfg) or (
            rms_eps and not _gemv.rms_ok(1, weight.shape[0], x.shape[-1], cfg, x.device)):
        return None
    return _gemv.gemv(x, weight, bias, cfg, gate_out=True, rms_eps=rms_eps)


def linear_rms(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor | None:
    """linear(x / rms(x), weight, bias) in one launch for one row of x (an RMSNorm whose weight
    is folded into `weight`, models/norm_fold.py), when the measured choice for the product is
    a one-row Triton GEMV (gemv.rms_ok); else None (the caller runs the norm kernel)."""
    cfg = _one_row_choice(x, weight, bias)
    if not _gemv.rms_ok(1, weight.shape[0], x.shape[-1], cfg, x.device):
        return None
    return _gemv.gemv(x, weight, bias, cfg, rms_eps=eps)


def _one_row_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> _gemv.GemvConfig | None:
    """The measured config for one CUDA row of x (None: cuBLAS, or not one row)."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not x.is_cuda or m != 1 or envs.LINEAR.get() != "auto"
            or not _kernel_fits(x, weight, bias)):
        return None
    return _choice(m, weight, bias, x)


def _choice(m: int, weight: torch.Tensor, bias: torch.Tensor | None,
            x: torch.Tensor) -> _gemv.GemvConfig | None:
    """The measured config for this shape (None: cuBLAS), measuring it the first time.

    During CUDA-graph capture an unmeasured shape gets the default Triton config: capture after
    a warm-up pass so that every shape has been measured.
    """
    n, k = weight.shape
    key = (_m_bucket(m), n, k, x.dtype, bias is not None, x.device.index)
    if key not in _CHOICES:
        if torch.cuda.is_current_stream_capturing():
            return _gemv.default_config(m, n, k)
        _CHOICES[key] = _measure(key[0], weight, bias, x.dtype)
    return _CHOICES[key]


def linear_choices() -> dict[str, str]:
    """The per-shape choices made so far, for the start-up log and the build record."""
    return {f"M<={m} N={n} K={k} {str(dt).removeprefix('torch.')}{' +bias' if b else ''}":
            ("cuBLAS" if cfg is None else repr(cfg))
            for (m, n, k, dt, b, _), cfg in _CHOICES.items()}


def ops() -> SimpleNamespace:
    """The fused ops, same names and signatures as kernels.reference, plus `linear`."""
    table = {name: _load_op(name) for name in OP_NAMES}
    return SimpleNamespace(**table, linear=linear, name="triton")
