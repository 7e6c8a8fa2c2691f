"""Would streaming the next GEMV's weights into L2, while this one computes, pay? (int4 W1)

The int4 one-row GEMVs leave DRAM idle about half the time: a program's loads and its math
alternate, and the next kernel's programs only become resident in this one's last wave. This
times Llama-3.1-8B's MLP at one row, int4_awq as the engine runs it (gate/up with the folded
RMSNorm and SiLU·up in one launch, then down; the tuner's configs), over --layers layers of
distinct weights (more bytes than the 50 MB L2), captured in one CUDA graph and replayed:

  none:  the two GEMVs a layer, back to back (PDL on, as in the decode graph);
  P programs: the same, plus a side branch of the graph that, as each layer's gate/up starts,
         bulk-prefetches that layer's down weights (words, scales, zeros) into L2
         (cp.async.bulk.prefetch.L2 from P one-warp programs), joined at the graph's end.

A clear gain says a prefetching side branch in the decode graph is worth building (and
evict-first loads for gate/up next); none says the L2 does not keep down's 29 MB through
gate/up's 59 MB stream, or the branch steals the GEMV's SMs.

    python benchmarks/bench_l2_prefetch.py [--layers 8] [--programs 4,16,64] [--output-json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from slipstream.kernels import gemv_int4  # noqa: E402
from slipstream.quantization import utils as qu  # noqa: E402

HIDDEN, INTER, GROUP = 4096, 14336, 128
_LANES = 32  # one warp a program, each lane prefetching its own slice of a chunk


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr):
    """Program p prefetches chunks p, p + P, ... of [ptr, ptr + nbytes) into L2, each lane
    CHUNK / 32 bytes of it (a multiple of 16; a ragged tail under 16 bytes is left)."""
    lane = tl.arange(0, 32)
    slice_bytes: tl.constexpr = CHUNK // 32
    for c in range(tl.program_id(0), tl.cdiv(nbytes, CHUNK), tl.num_programs(0)):
        start = c * CHUNK + lane * slice_bytes
        size = (tl.minimum(nbytes - start, slice_bytes) // 16) * 16
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            constraints="=r,l,r", args=[ptr + start, size], dtype=tl.int32, is_pure=False,
            pack=1)


def l2_prefetch(tensors: list[torch.Tensor], programs: int, chunk: int = 1 << 16) -> None:
    """Bulk-prefetch each (contiguous) tensor's bytes into L2 from `programs` one-warp programs."""
    for t in tensors:
        flat = t.view(torch.uint8).reshape(-1)
        _l2_prefetch_kernel[(programs,)](flat, flat.numel(), CHUNK=chunk, num_warps=1)


def int4_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed words, fp16 scales, zeros) of a random [n, k] weight, the int4_awq layout."""
    q, s, z = qu.quantize_int4_groupwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
                                         GROUP)
    return qu.pack_int4_rows(q), s.half(), z


def mlp(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """One layer's MLP at one row as the engine runs it (norm folded into gate/up)."""
    h = gemv_int4.w4_linear_small_gate_out(x, *gate_up, GROUP, None, rms_eps=1e-5)
    if h is None:  # the measured gate/up config is not a one-row kernel: norm-less product
        h = gemv_int4.w4_linear_small(x, *gate_up, GROUP)
        g, u = h.float().chunk(2, dim=-1)
        h = (torch.nn.functional.silu(g) * u).to(x.dtype)
    return gemv_int4.w4_linear_small(h, *down, GROUP)


def capture(x, layers, programs: int) -> torch.cuda.CUDAGraph:
    """The MLPs of every layer in one graph; programs > 0 adds the prefetching side branch."""
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        for gate_up, down in layers:
            if programs:
                fork = torch.cuda.Event()
                fork.record(main)
                side.wait_event(fork)
                with torch.cuda.stream(side):
                    l2_prefetch(list(down), programs)
            mlp(x, gate_up, down)
        if programs:
            join = torch.cuda.Event()
            join.record(side)
            main.wait_event(join)
    return graph


def us_per_layer(graph: torch.cuda.CUDAGraph, layers: int, replays: int = 20) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / (replays * layers))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--programs", default="4,16,64", help="side-branch program counts to time")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_l2_prefetch needs a CUDA GPU (sm_90: cp.async.bulk.prefetch)")
    torch.manual_seed(0)
    layers = [(int4_weight(2 * INTER, HIDDEN), int4_weight(HIDDEN, INTER))
              for _ in range(ns.layers)]
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    want = mlp(x, *layers[0])  # tunes both shapes outside any capture
    l2_prefetch(list(layers[0][1]), 4)  # compiles the prefetch kernel outside the capture
    torch.cuda.synchronize()
    rows = []
    for programs in [0] + [int(p) for p in ns.programs.split(",") if p]:
        graph = capture(x, layers, programs)
        us = us_per_layer(graph, ns.layers)
        rows.append({"prefetch_programs": programs, "us_per_layer": us})
        print(f"{'none' if not programs else f'{programs} programs':<14} {us:7.2f} us a layer "
              f"(gate/up + down)", flush=True)
        del graph
    assert torch.isfinite(want).all()
    print("choices:", json.dumps(gemv_int4.w4_choices(), indent=1))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "layers": ns.layers, "rows": rows,
             "choices": gemv_int4.w4_choices()}, indent=1))


if __name__ == "__main__":
    main()
