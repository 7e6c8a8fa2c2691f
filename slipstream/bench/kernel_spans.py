"""A profiler trace as spans: each GPU kernel (or, on a CPU, each leaf compute op) sorted into
GEMM, attention, small kernels or copies, and a step's share of them (step_profile.py)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass

from slipstream.bench.step_floors import StepWork

_GEMM = re.compile(
    r"gemm|gemv|nvjet|cutlass|xmma|cublas|sm\d\d_|_scaled_mm|matmul|splitk|"
    r"_w4_|_w8_|skinny|int8|fp8_dot|aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$",
    re.IGNORECASE,
)
_ATTENTION = re.compile(r"attn|attention|flash|fmha|sdpa", re.IGNORECASE)
_CPU_OPS = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm|_scaled_dot_product_\w+|"
    r"_efficient_attention_forward|_flash_attention_forward)$"
)


def classify(name: str) -> str:
    """'gemm', 'attention' or 'small' for a kernel (or leaf aten op) name."""
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "small"


@dataclass
class Span:
    name: str
    start: float  # microseconds, the profiler's clock
    end: float
    kind: str  # 'gemm' | 'attention' | 'small' | 'copies'


def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("traceEvents", [])


def device_spans(events: list[dict], cuda: bool) -> list[Span]:
    """GPU kernels and copies (CUDA), or the leaf compute ops (CPU)."""
    spans = []
    for e in events:
        cat, name = e.get("cat", ""), e.get("name", "")
        if "ts" not in e or "dur" not in e:
            continue
        if cuda and cat == "kernel":
            kind = classify(name)
        elif cuda and cat in ("gpu_memcpy", "gpu_memset"):
            kind = "copies"
        elif not cuda and cat == "cpu_op" and _CPU_OPS.match(name):
            kind = classify(name)
        else:
            continue
        spans.append(Span(name, float(e["ts"]), float(e["ts"]) + float(e["dur"]), kind))
    return spans


def annotations(events: list[dict], prefix: str) -> list[tuple[float, float]]:
    """(start, end) of the host's `record_function(prefix + i)` ranges, in order of i."""
    found = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith(prefix):
            found[int(name[len(prefix) :])] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    return [found[i] for i in sorted(found)]


def busy_time(spans: list[Span]) -> float:
    """Length of the union of the spans (overlapping kernels counted once)."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.start > end:
            total += s.end - s.start
            end = s.end
        elif s.end > end:
            total += s.end - end
            end = s.end
    return total


def attribute(
    window: tuple[float, float], spans: list[Span], work: StepWork, floor: dict[str, float]
) -> dict[str, float]:
    """Seconds of each part in one step (kernels that start inside its host range)."""
    mine = [s for s in spans if window[0] <= s.start < window[1]]
    by_kind = {
        k: sum(s.end - s.start for s in mine if s.kind == k) * 1e-6
        for k in ("gemm", "attention", "small", "copies")
    }
    gemm_share = work.prefill_tokens / work.tokens if work.tokens else 0.0
    attn_floor = floor["prefill_attention"] + floor["decode_attention"]
    attn_share = floor["prefill_attention"] / attn_floor if attn_floor else gemm_share
    wall = (window[1] - window[0]) * 1e-6
    return {
        "prefill_gemm": by_kind["gemm"] * gemm_share,
        "decode_gemm": by_kind["gemm"] * (1 - gemm_share),
        "prefill_attention": by_kind["attention"] * attn_share,
        "decode_attention": by_kind["attention"] * (1 - attn_share),
        "small": by_kind["small"],
        "copies": by_kind["copies"],
        "host_gap": max(wall - busy_time(mine) * 1e-6, 0.0),
    }
