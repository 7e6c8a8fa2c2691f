"""The floor of each part of an engine step: its counted work (GEMM and attention FLOPs, K/V
and activation bytes) at the peaks measured on this device (`measure_peaks`), for the step
profile (step_profile.py, docs/profiling.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.models.sizes import dtype_bytes, linear_parameters

# Reference peaks (dense; TFLOP/s, TB/s of device copy counting read + write). H200: measured
# on the lent machine (BENCHMARKS.md); H100 SXM: the same kernels' usual share of its spec.
PEAKS = {
    "H200": {"bf16_tflops": 792.0, "fp8_tflops": 1435.0, "copy_tbs": 4.14},
    "H100": {"bf16_tflops": 720.0, "fp8_tflops": 1300.0, "copy_tbs": 2.95},
}


PARTS = (
    "prefill_gemm",
    "decode_gemm",
    "prefill_attention",
    "decode_attention",
    "small",
    "copies",
    "host_gap",
)
PART_NAMES = {
    "prefill_gemm": "prefill GEMM",
    "decode_gemm": "decode GEMM",
    "prefill_attention": "attention prefill",
    "decode_attention": "attention decode",
    "small": "norms and small kernels",
    "copies": "copies (host <-> device)",
    "host_gap": "host gap (idle GPU)",
}


@dataclass
class StepWork:
    """One step's tokens: prefill chunks (query length, start position), decode contexts."""

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode_ctx: list[int] = field(default_factory=list)
    sampled: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(q for q, _ in self.prefill)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + len(self.decode_ctx)


def step_work(sched_out) -> StepWork:
    work = StepWork()
    for seq in sched_out.seqs:
        if seq.num_tokens == 1 and seq.start_pos >= seq.request.num_prompt_tokens:
            work.decode_ctx.append(seq.start_pos + 1)
        else:
            work.prefill.append((seq.num_tokens, seq.start_pos))
        work.sampled += int(seq.needs_sample)
    return work


@dataclass(frozen=True)
class ModelShape:
    """What the floors need of a model (per rank)."""

    linear_params: int
    head_params: int
    weight_bytes_per_param: float
    layers: int
    heads: int
    head_dim: int
    hidden: int
    intermediate: int
    kv_bytes_per_token: int  # K and V, all layers
    act_bytes: int  # bytes of one activation element

    @staticmethod
    def from_config(
        cfg: dict[str, Any], dtype: str, quantization: str | None, kv_elem_bytes: int
    ) -> ModelShape:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        elem = dtype_bytes(dtype)
        per_param = {"fp8": 1.0, "int8_wo": 1.0, "w8a8_sq": 1.0, "int4_awq": 0.53}.get(
            quantization or "", float(elem)
        )
        return ModelShape(
            linear_params=linear_parameters(cfg),
            head_params=cfg["vocab_size"] * cfg["hidden_size"],
            weight_bytes_per_param=per_param,
            layers=cfg["num_hidden_layers"],
            heads=heads,
            head_dim=head_dim,
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            kv_bytes_per_token=2 * cfg["num_hidden_layers"] * kv_heads * head_dim * kv_elem_bytes,
            act_bytes=elem,
        )


@dataclass(frozen=True)
class Peaks:
    gemm_flops: float  # FLOP/s of the GEMMs (fp8 with fp8 weights)
    bf16_flops: float  # FLOP/s for attention's math
    copy_bytes: float  # bytes/s, read + write counted


def floors(work: StepWork, model: ModelShape, peaks: Peaks) -> dict[str, float]:
    """Seconds each part of the step cannot go below."""
    tokens = work.tokens
    if tokens == 0:
        return dict.fromkeys(PARTS, 0.0)
    gemm_flops = 2 * tokens * model.linear_params + 2 * work.sampled * model.head_params
    gemm_bytes = model.linear_params * model.weight_bytes_per_param + model.head_params * model.act_bytes
    gemm = max(gemm_flops / peaks.gemm_flops, gemm_bytes / peaks.copy_bytes)
    prefill_share = work.prefill_tokens / tokens
    attn_prefill_flops = sum(
        4 * model.layers * model.heads * model.head_dim * q * (start + (q + 1) / 2)
        for q, start in work.prefill
    )
    decode_bytes = sum(work.decode_ctx) * model.kv_bytes_per_token
    small_bytes = tokens * model.layers * model.act_bytes * (4 * model.hidden + 3 * model.intermediate)
    return {
        "prefill_gemm": gemm * prefill_share,
        "decode_gemm": gemm * (1 - prefill_share),
        "prefill_attention": attn_prefill_flops / peaks.bf16_flops,
        "decode_attention": decode_bytes / peaks.copy_bytes,
        "small": small_bytes / peaks.copy_bytes,
        "copies": 0.0,
        "host_gap": 0.0,
    }


def measure_peaks(device: torch.device, fp8: bool) -> Peaks:
    """A large GEMM in bf16 (fp8 with fp8 weights) and a device copy, timed here."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    bf16 = 2 * n**3 / _timed(lambda: a @ b, cuda)
    gemm = bf16
    if fp8 and cuda:
        af, bf = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        gemm = 2 * n**3 / _timed(lambda: torch._scaled_mm(af, bf, one, one, out_dtype=torch.bfloat16), cuda)
    src = torch.empty(256 << 20 if cuda else 16 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / _timed(lambda: dst.copy_(src), cuda)
    return Peaks(gemm_flops=gemm, bf16_flops=bf16, copy_bytes=copy)


def _timed(fn, cuda: bool, reps: int = 10) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def reference_peaks(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAKS.items() if k in name), None)
