"""Instruction mix of a Triton kernel's main loop for sm_90, compiled on a machine without a GPU.

    python tools/sass_loop.py qgemv --weight i8 --bit-convert 3 --block-n 8 --block-k 1024 --stages 4
    python tools/sass_loop.py attention --kv fp8e4nv --num-warps 2
    python tools/sass_loop.py attention --split --num-warps 8 --stages 3 [--short-chain 2]
    python tools/sass_loop.py w4 --block-n 128 --block-k 128 --num-warps 8 --bit-convert 2 --chain
    python tools/sass_loop.py w4mma --num-warps 4 --tiles 2 [--wide] [--groups 4]
    python tools/sass_loop.py w4 --block-n 16 --num-warps 4 --bit-convert 2 --chain --whole-k 4096
    python tools/sass_loop.py w4loop --block-n 16 --num-warps 4 [--whole-k 14336] [--gate-out]
Compiles with Triton's bundled ptxas (pointers and strides marked 16-divisible, as a real launch
specialises them), disassembles with its nvdisasm and prints the histogram of the longest loop:
a quick, device-free way to count the instructions a kernel spends per element. The kernel's
registers a thread (cuobjdump's resource usage) come first.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_ALIGNED_INTS = ("N", "K", "k_per_split")  # multiples of 16 in every launch that matters


def compile_sass(kernel, types: dict[str, str], constexprs: dict, num_warps: int,
                 num_stages: int = 1) -> tuple[str, int]:
    """(SASS text, registers a thread) of `kernel` for sm_90; pointers, strides and _ALIGNED_INTS
    are marked 16-divisible. A constexpr without a default must be given."""
    signature = inspect.signature(kernel.fn).parameters
    params = list(signature)
    # constexprs left out take their defaults (a kernel's later options, off)
    constexprs = {**{n: p.default for n, p in signature.items()
                     if "constexpr" in str(p.annotation) and p.default is not p.empty},
                  **constexprs}
    sig, attrs = {}, {}
    for i, name in enumerate(params):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "*i32" if name.endswith("_ptr") else "i32")
        if sig[name].startswith("*") or name.startswith("stride") or name in _ALIGNED_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {(params.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([f"{tools}/nvdisasm", "-c", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", path], capture_output=True,
                               text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    return sass, int(regs.group(1)) if regs else -1


def loop_opcodes(sass: str, whole: bool = False) -> list[str]:
    """The opcodes (with their modifiers) of the longest backward branch's body (the main
    loop), in order; whole: of the whole kernel."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    ops = []
    for line in lines if whole else lines[best[0]:best[1] + 1]:
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)", line)
        if m:
            ops.append(m.group(1) + m.group(2))
    return ops


def loop_histogram(sass: str) -> collections.Counter:
    """Opcode counts of the main loop (loop_opcodes); loads and stores keep their widths."""
    counts: collections.Counter = collections.Counter()
    for op in loop_opcodes(sass):
        base = op.split(".")[0]
        counts[op if base in ("LDG", "LDS", "STS", "STG") else base] += 1
    return counts


def qgemv_case(ns) -> tuple:
    from slipstream.kernels.gemv.dense import gemv_kernel
    types = dict(x_ptr="*bf16", w_ptr=f"*{ns.weight}", s_ptr="*fp32", bias_ptr="*bf16",
                 out_ptr="*bf16", ws_ptr="*fp32")
    consts = dict(BLOCK_N=ns.block_n, BLOCK_K=ns.block_k, SPLIT=False, EVEN_K=True,
                  HAS_BIAS=False, PREFETCH=ns.prefetch, BIT_CONVERT=ns.bit_convert, GATED=False,
                  USE_PDL=False, STAGES=ns.stages, GATE_OUT=False, HAS_SCALE=True)
    return gemv_kernel, types, consts, ns.block_n * ns.block_k / (32 * ns.num_warps)


def attention_case(ns) -> tuple:
    from slipstream.kernels.attention.paged import _paged_attn_kernel
    kv = f"*{ns.kv}"
    types = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, out_ptr="*bf16", part_out_ptr="*fp32",
                 part_lse_ptr="*fp32", ks_ptr="*fp32", vs_ptr="*fp32", kn_ptr="*bf16",
                 vn_ptr="*bf16", cs_ptr="*fp32", slot_ptr="*i64", pos_ptr="*i64",
                 qk_scale="fp32")
    # --split: W1's batch-1 launch (the KV range across programs, a merge); else large-batch
    # decode (one program a sequence and KV head).
    consts = dict(GROUP=4, GROUP_P=4, BLOCK_Q=4, BLOCK_M=16, BLOCK_D=128,
                  HEAD_DIM=128, PAGE_SIZE=16, SPLIT_KV=ns.split, DOT_PREC="tf32",
                  KV_QUANT={"bf16": 0, "fp8e4nv": 1, "i8": 2}[ns.kv], USE_PDL=ns.split,
                  FUSE_ROPE=True, DECODE=not ns.split, ASM_CVT=True,
                  SHORT_CHAIN=ns.short_chain, PRELOAD=ns.preload,
                  BLOCK_N=ns.block_n_attn)
    return _paged_attn_kernel, types, consts, ns.block_n_attn * 128 * 2 / (32 * ns.num_warps)


def w4_case(ns) -> tuple:
    from slipstream.kernels.gemv.int4 import _w4_gemv_kernel
    types = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", bias_ptr="*bf16",
                 out_ptr="*bf16", ws_ptr="*fp32")
    kp = triton.next_power_of_2(ns.whole_k) if ns.whole_k else 0
    consts = dict(GROUP=128, BLOCK_N=ns.block_n, CHUNK=ns.block_k, SPLIT=False, HAS_BIAS=False,
                  PREFETCH=ns.prefetch, USE_PDL=ns.whole_k > 0, BF16X2=ns.bit_convert,
                  CHAIN=ns.chain, STAGES=ns.stages, WHOLE_K=ns.whole_k, WHOLE_KP=kp,
                  GATE_OUT=ns.gate_out)
    return _w4_gemv_kernel, types, consts, ns.block_n * ns.block_k / (32 * ns.num_warps)


def w4loop_case(ns) -> tuple:
    """The whole-K tile loop (_w4_whole_k_loop_kernel) at K = --whole-k (default 4096)."""
    from slipstream.kernels.gemv.int4 import _w4_whole_k_loop_kernel
    k = ns.whole_k or 4096
    types = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", bias_ptr="*bf16",
                 out_ptr="*bf16")
    consts = dict(GROUP=128, BLOCK_N=ns.block_n, K=k, KP=triton.next_power_of_2(k),
                  BF16X2=2, HAS_BIAS=False, GATE_OUT=ns.gate_out, USE_PDL=True,
                  RMS_EPS=1e-5 if ns.rms else 0.0)
    return _w4_whole_k_loop_kernel, types, consts, ns.block_n * k / (32 * ns.num_warps)


def w4mma_case(ns) -> tuple:
    from slipstream.kernels.gemv.int4_mma import _w4_mma_kernel
    types = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", bias_ptr="*bf16",
                 out_ptr="*bf16", ws_ptr="*fp32")
    consts = dict(NW=ns.num_warps, TILES=ns.tiles, WIDE=ns.wide, SPLIT=False, HAS_BIAS=False,
                  ASM=True, USE_PDL=False, GATE_OUT=False, PREFETCH=ns.prefetch,
                  GROUPS=ns.groups)
    return _w4_mma_kernel, types, consts, 16 * ns.tiles * 128 * ns.groups / 32  # per lane, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("qgemv", "attention", "w4", "w4mma", "w4loop"))
    ap.add_argument("--weight", default="i8", choices=("i8", "fp8e4nv"))
    ap.add_argument("--bit-convert", type=int, default=0, help="the kernel's BIT_CONVERT (0-3)")
    ap.add_argument("--block-n", type=int, default=16)
    ap.add_argument("--block-k", type=int, default=512)
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--chain", action="store_true", help="w4: four words per packed sum (CHAIN)")
    ap.add_argument("--tiles", type=int, default=2, help="w4mma: 16-row tiles (1, 2)")
    ap.add_argument("--wide", action="store_true", help="w4mma: x rows 9-16 too (WIDE)")
    ap.add_argument("--groups", type=int, default=1, help="w4mma: groups per loop step (1, 2, 4)")
    ap.add_argument("--block-n-attn", type=int, default=64, help="attention BLOCK_N")
    ap.add_argument("--stages", type=int, default=1, help="qgemv / w4 STAGES (shared-memory pipeline)")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8e4nv", "i8"))
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--split", action="store_true", help="attention: a split decode launch")
    ap.add_argument("--whole-k", type=int, default=0, help="w4 / w4loop: K")
    ap.add_argument("--gate-out", action="store_true", help="w4 / w4loop: GATE_OUT")
    ap.add_argument("--rms", action="store_true", help="w4loop: the in-GEMV RMSNorm (RMS_EPS)")
    ap.add_argument("--short-chain", type=int, default=0, help="attention: SHORT_CHAIN tiles")
    ap.add_argument("--preload", action="store_true", help="attention (--split): PRELOAD (the "
                    "first K/V tile read before the PDL wait)")
    ap.add_argument("--ops", action="store_true", help="print the loop's opcodes in order instead")
    ap.add_argument("--all", action="store_true", help="--ops: the whole kernel's, not the loop's")
    ns = ap.parse_args()
    case = {"qgemv": qgemv_case, "attention": attention_case, "w4": w4_case,
            "w4mma": w4mma_case, "w4loop": w4loop_case}[ns.kernel]
    kernel, types, consts, elems = case(ns)
    # --stages is the qgemv / w4 STAGES constexpr; attention takes it as the launch's num_stages.
    sass, regs = compile_sass(kernel, types, consts, ns.num_warps,
                              ns.stages if ns.kernel == "attention" else 1)
    if ns.ops:
        print("\n".join(loop_opcodes(sass, ns.all)))
        return
    hist = loop_histogram(sass)
    total = sum(hist.values())
    print(f"{regs} registers a thread; {total} instructions per loop iteration, "
          f"{total / elems:.2f} per element per thread")
    for op, n in hist.most_common():
        print(f"  {op:<14} {n}")


if __name__ == "__main__":
    main()
