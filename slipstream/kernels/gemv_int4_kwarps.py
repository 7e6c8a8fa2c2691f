"""One-row W4A16 GEMV on tensor cores with K spread over the warps (int4_awq, groups of 128).

Session 25 read the one-row chained FMA kernel as bound by instructions (with every weight in
L2 it ran only 2-6% faster; ~2.9 sm_90a instructions a weight, a floor of ~1.9 for its packed
bf16 arithmetic). Here the nibbles go straight into mma.sync A fragments (gemv_int4_mma's
unpacking: a shift and a LOP3 make two values 128 + q, exact in bf16), the mma sums (128 + q) x
in float32, and the zero and scale come off once a group: s (D - (128 + z) sum x). All in,
1.9-2.0 instructions a weight; yet on the H200 it only matches the chained kernels (session
26: gate_up 21.6 against 20.7 us, gate-out 22.4 against 22.0-23.3, down 14.8 against 14.2), so
the instruction count is not what holds the one-row GEMV back. A tuner candidate only with
SLIPSTREAM_W4_KWARPS=1 (gemv_int4.KWARPS_CONFIGS).

What differs from gemv_int4_mma (16 or 32 rows a warp over all of K): a program's NW warps split
K, warp w taking group w of each step of NW groups, so a lane needs the x pairs of one group
only (16 registers; held for the whole launch when one step covers K) and a tile's whole K is
requested at once. A lane (g, t) reads words 4t .. 4t + 3 of its group in rows g and g + 8 of
each 16-row tile: one 128-bit load a row (the K order inside the mma is free as long as x
follows it, and x is the same for every row). Programs loop over tiles (at most `persist` an
SM), requesting the next step's words, scales and zeros before this step's products; the warps'
partial sums meet in shared memory at the end of each tile.

TILES 2: 32 rows a tile; GATE_OUT (a [gate | up] weight of 2I rows) pairs gate rows j with up
rows I + j and writes SiLU(gate)·up. RMS_EPS > 0: the product of x / rms(x) (a folded RMSNorm,
models/norm_fold.py). ASM (CUDA): the mma, the 128-bit loads and the x byte permutes in PTX;
the interpreter runs their twins (mma_fragments.mma_twin), so the CPU tests check every index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv_int4_mma import _pair
from slipstream.kernels.mma_fragments import mma
from slipstream.kernels.pdl import pdl_release, pdl_wait

GROUP_SIZE = 128
_GROUP = tl.constexpr(GROUP_SIZE)
WARPS = (4, 8, 16, 32)  # a program's warps (K split over them)


@triton.jit
def _ld4(ptr, ASM: tl.constexpr, PURE: tl.constexpr = True):
    """The four int32 words at ptr (16-byte aligned), one 128-bit load on CUDA. PURE (weights,
    never written) lets the compiler move the load freely; x, written by the kernel before,
    is read with PURE False, which keeps the load after the PDL wait."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", constraints="=r,=r,=r,=r,l",
            args=[ptr], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=PURE, pack=1)
    else:
        return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)


@triton.jit
def _x_pairs4(ptr, ASM: tl.constexpr):
    """The bf16 pairs (x_a, x_a+4), a = 0..3, of the eight x at ptr (as int32 words): the order
    of a weight word's nibbles a and a + 4 (16 bits apart)."""
    r0, r1, r2, r3 = _ld4(ptr, ASM, PURE=False)
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            prmt.b32 $0, $4, $6, 0x5410;
            prmt.b32 $1, $4, $6, 0x7632;
            prmt.b32 $2, $5, $7, 0x5410;
            prmt.b32 $3, $5, $7, 0x7632;
            }""",
            constraints="=r,=r,=r,=r,r,r,r,r", args=[r0, r1, r2, r3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        u0, u1 = r0.to(tl.uint32, bitcast=True), r1.to(tl.uint32, bitcast=True)
        u2, u3 = r2.to(tl.uint32, bitcast=True), r3.to(tl.uint32, bitcast=True)
        return (((u0 & 0xFFFF) | (u2 << 16)).to(tl.int32, bitcast=True),
                ((u0 >> 16) | (u2 & 0xFFFF0000)).to(tl.int32, bitcast=True),
                ((u1 & 0xFFFF) | (u3 << 16)).to(tl.int32, bitcast=True),
                ((u1 >> 16) | (u3 & 0xFFFF0000)).to(tl.int32, bitcast=True))


@triton.jit
def _group_x(x_ptr, grp, t, ASM: tl.constexpr):
    """The lane's x pairs for group grp: words 16 grp + 4t + c (c = 0..3), four pairs each."""
    xw = x_ptr.to(tl.pointer_type(tl.int32)) + (grp * 64 + 16 * t)
    return (_x_pairs4(xw, ASM), _x_pairs4(xw + 4, ASM), _x_pairs4(xw + 8, ASM),
            _x_pairs4(xw + 12, ASM))


@triton.jit
def _group_sum(xp, one, NW: tl.constexpr, ASM: tl.constexpr):
    """sum of the group's 128 x (every lane the same): mma steps with A = the bf16 pair (1, 1)."""
    s = tl.zeros(one.shape, tl.float32)
    s0, s1, s2, s3 = s, s, s, s
    for c in tl.static_range(4):
        s0, s1, s2, s3 = mma(one, one, one, one, xp[c][0], xp[c][1], s0, s1, s2, s3, NW, ASM)
        s0, s1, s2, s3 = mma(one, one, one, one, xp[c][2], xp[c][3], s0, s1, s2, s3, NW, ASM)
    return s0


@triton.jit
def _pair_words(wp, ROW8: tl.constexpr, ASM: tl.constexpr):
    """The lane's four words at wp (row g) and ROW8 words on (row g + 8): eight a lane."""
    lo = _ld4(wp, ASM)
    hi = _ld4(wp + ROW8, ASM)
    return lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]


@triton.jit
def _pair_scales(sp, zp, ROW8: tl.constexpr):
    """(s_lo, s_hi, z_lo, z_hi) as stored (float16 scales, uint8 zeros) at sp / zp (row g) and
    ROW8 on (row g + 8)."""
    return tl.load(sp), tl.load(sp + ROW8), tl.load(zp), tl.load(zp + ROW8)


@triton.jit
def _pair_sums(w, sz, xp, sx, mask, NW: tl.constexpr, ASM: tl.constexpr):
    """(row g, row g + 8) sums over one group: eight mma steps in two independent chains (words
    0, 1 and 2, 3: half the dependent latency), then s (D - (128 + z) sum x)."""
    z = tl.zeros(sx.shape, tl.float32)
    a = _word_mmas(w[0], w[4], xp[0], z, z, z, z, mask, NW, ASM)
    b = _word_mmas(w[2], w[6], xp[2], z, z, z, z, mask, NW, ASM)
    a = _word_mmas(w[1], w[5], xp[1], a[0], a[1], a[2], a[3], mask, NW, ASM)
    b = _word_mmas(w[3], w[7], xp[3], b[0], b[1], b[2], b[3], mask, NW, ASM)
    s_lo, s_hi = sz[0].to(tl.float32), sz[1].to(tl.float32)
    z_lo, z_hi = 128.0 + sz[2].to(tl.float32), 128.0 + sz[3].to(tl.float32)
    return s_lo * ((a[0] + b[0]) - z_lo * sx), s_hi * ((a[2] + b[2]) - z_hi * sx)


@triton.jit
def _word_mmas(lw, hw, xq, d0, d1, d2, d3, mask, NW: tl.constexpr, ASM: tl.constexpr):
    """The two mma steps of one word of rows g (lw) and g + 8 (hw): nibble pairs 0, 1 against
    x pairs 0, 1, then pairs 2, 3 against x pairs 2, 3."""
    d0, d1, d2, d3 = mma(_pair(lw, mask, 0), _pair(hw, mask, 0), _pair(lw, mask, 1),
                         _pair(hw, mask, 1), xq[0], xq[1], d0, d1, d2, d3, NW, ASM)
    return mma(_pair(lw, mask, 2), _pair(hw, mask, 2), _pair(lw, mask, 3), _pair(hw, mask, 3),
               xq[2], xq[3], d0, d1, d2, d3, NW, ASM)


@triton.jit
def _step_loads(w_ptr, s_ptr, z_ptr, tile, grp, g, t, K: tl.constexpr, SECOND: tl.constexpr,
                TILES: tl.constexpr, GATE_OUT: tl.constexpr, ASM: tl.constexpr):
    """A step's words and (scale, zero)s of group grp: rows g and g + 8 of the tile's first 16
    rows, then (TILES 2) of the 16 rows SECOND on (GATE_OUT: the up rows); else the first's
    again, unused. Rows are contiguous, so each further row is a constant offset from the
    lane's one address (launch checks the layout; no tile passes N, so no clamps or masks)."""
    WPR: tl.constexpr = K // 8  # words a row
    GPR: tl.constexpr = K // _GROUP  # groups a row
    row = tile * (16 if GATE_OUT else 16 * TILES) + g
    wp = w_ptr + (row * WPR + grp * 16 + 4 * t)
    sp = s_ptr + (row * GPR + grp)
    zp = z_ptr + (row * GPR + grp)
    wa = _pair_words(wp, 8 * WPR, ASM)
    sa = _pair_scales(sp, zp, 8 * GPR)
    wb, sb = wa, sa
    if TILES == 2:
        wb = _pair_words(wp + SECOND * WPR, 8 * WPR, ASM)
        sb = _pair_scales(sp + SECOND * GPR, zp + SECOND * GPR, 8 * GPR)
    return wa, sa, wb, sb


@triton.jit
def _warp_sum(lo0, hi0, lo1, hi1, t, NW: tl.constexpr, TILES: tl.constexpr,
              GATE_OUT: tl.constexpr):
    """The tile's sums, one a lane, summed over the warps: the four lanes of a quad hold the
    same values (every column of B is x), so lane t keeps one of them first (three selects)
    and the warps meet in one shared-memory round of one value a lane. Lane (g, t) ends with
    row g + 8t of the tile (TILES 1: t < 2); GATE_OUT: t = 0, 1 gate and up row j = g,
    t = 2, 3 the same for j = g + 8."""
    if GATE_OUT:
        v = tl.where(t == 0, lo0, tl.where(t == 1, lo1, tl.where(t == 2, hi0, hi1)))
    elif TILES == 2:
        v = tl.where(t == 0, lo0, tl.where(t == 1, hi0, tl.where(t == 2, lo1, hi1)))
    else:
        v = tl.where(t == 0, lo0, hi0)
    return tl.sum(tl.reshape(v, [NW, 32]), 0)


@triton.jit
def _store_tile(lo0, hi0, lo1, hi1, t, tile, N, bias_ptr, out_ptr, scale, NW: tl.constexpr,
                TILES: tl.constexpr, GATE_OUT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The tile's row sums (_warp_sum) times scale (1 / rms(x) or 1), plus the bias, to out.
    GATE_OUT: SiLU(gate)·up at columns j, each operand rounded to out's dtype first, as
    silu_and_mul computes it from the stored projection."""
    v = _warp_sum(lo0, hi0, lo1, hi1, t, NW, TILES, GATE_OUT) * scale
    out_ty = out_ptr.dtype.element_ty
    if GATE_OUT:
        half = N // 2
        i = tl.arange(0, 16)  # [16, 2] pairs (gate, up) of column j = g + 8 (i % 2), g = i // 2
        j = tile * 16 + i // 2 + 8 * (i % 2)
        gv, uv = tl.split(tl.reshape(v, [16, 2]))
        ok = j < half
        if HAS_BIAS:
            gv += tl.load(bias_ptr + j, mask=ok, other=0.0).to(tl.float32)
            uv += tl.load(bias_ptr + half + j, mask=ok, other=0.0).to(tl.float32)
        gv = gv.to(out_ty).to(tl.float32)
        uv = uv.to(out_ty).to(tl.float32)
        tl.store(out_ptr + j, (gv * tl.sigmoid(gv) * uv).to(out_ty), mask=ok)
    else:
        ln = tl.arange(0, 32)
        rows = tile * (16 * TILES) + ln // 4 + 8 * (ln % 4)
        ok = (rows < N) & (ln % 4 < 2 * TILES)
        if HAS_BIAS:
            v += tl.load(bias_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, v.to(out_ty), mask=ok)


@triton.jit
def _inv_rms(x_ptr, K: tl.constexpr, KP: tl.constexpr, EPS: tl.constexpr):
    """1 / rms(x) as the RMSNorm kernel computes it (float32 mean of squares + eps; KP: K
    rounded up to a power of two)."""
    offs = tl.arange(0, KP)
    xs = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    return tl.math.rsqrt(tl.sum(xs * xs) / K + EPS)


@triton.jit
def _w4_kwarps_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, sixteen, N: tl.constexpr,
                      K: tl.constexpr, KP: tl.constexpr, SECOND: tl.constexpr, NW: tl.constexpr,
                      TILES: tl.constexpr, GATE_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ASM: tl.constexpr, USE_PDL: tl.constexpr = False,
                      RMS_EPS: tl.constexpr = 0.0):
    """out = x @ dequant(w)^T for one row of bf16 x (see the module docstring). Program p takes
    tiles p, p + P, ...; each tile is STEPS steps of NW groups, warp w taking group
    step NW + w. The flattened (tile, step) loop has step i + 1 in flight during step i's
    products (past the last step: the last again, no branch)."""
    STEPS: tl.constexpr = K // (_GROUP * NW)
    pdl_release(USE_PDL)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    lane = tl.arange(0, 32 * NW)
    g = (lane % 32) // 4
    t = lane % 4
    warp = lane // 32
    # mask and one are held in registers: as constants ptxas would rematerialise them before
    # every LOP3 (which takes one immediate); sixteen is the host's 16, which it cannot see.
    unit = tl.full([32 * NW], 1, tl.uint32) * (sixteen // 16).to(tl.uint32)
    mask, one = unit * 0x000F000F, (unit * 0x3F803F80).to(tl.int32, bitcast=True)
    N_TILES: tl.constexpr = (N // 2) // 16 if GATE_OUT else N // (16 * TILES)
    n_it = tl.cdiv(N_TILES - pid, n_prog) * STEPS
    # Two buffers, each consumed then refilled with the step two on; the turn is unrolled so
    # that they alternate without register moves. (Two steps in flight, three buffers, lost
    # everywhere on the H200: 106-130 registers leave fewer warps an SM.) Both are requested
    # before the PDL wait: the weights never change.
    b0 = _loads_at(w_ptr, s_ptr, z_ptr, 0, n_it, pid, n_prog, warp, g, t, K, SECOND, STEPS, NW,
                   TILES, GATE_OUT, ASM)
    b1 = _loads_at(w_ptr, s_ptr, z_ptr, 1, n_it, pid, n_prog, warp, g, t, K, SECOND, STEPS, NW,
                   TILES, GATE_OUT, ASM)
    pdl_wait(USE_PDL)  # x comes from the kernel before
    scale = 1.0
    if RMS_EPS > 0:
        scale = _inv_rms(x_ptr, K, KP, RMS_EPS)
    if STEPS == 1:  # the warp's one group: its x stays in registers for the whole launch
        xp = _group_x(x_ptr, warp, t, ASM)
        sx = _group_sum(xp, one, NW, ASM)
    else:  # read a step at a time (_consume); placeholders of the same structure
        q4 = (one, one, one, one)
        xp = (q4, q4, q4, q4)
        sx = tl.zeros([32 * NW], tl.float32)
    z = tl.zeros([32 * NW], tl.float32)
    acc = (z, z, z, z)
    for it in range(0, n_it, 2):
        acc = _consume(b0, acc, it, pid, n_prog, x_ptr, xp, sx, one, mask, warp, t, bias_ptr,
                       out_ptr, scale, N, STEPS, NW, TILES, GATE_OUT, HAS_BIAS, ASM)
        b0 = _loads_at(w_ptr, s_ptr, z_ptr, it + 2, n_it, pid, n_prog, warp, g, t, K, SECOND,
                       STEPS, NW, TILES, GATE_OUT, ASM)
        if it + 1 < n_it:
            acc = _consume(b1, acc, it + 1, pid, n_prog, x_ptr, xp, sx, one, mask, warp, t,
                           bias_ptr, out_ptr, scale, N, STEPS, NW, TILES, GATE_OUT, HAS_BIAS,
                           ASM)
        b1 = _loads_at(w_ptr, s_ptr, z_ptr, it + 3, n_it, pid, n_prog, warp, g, t, K, SECOND,
                       STEPS, NW, TILES, GATE_OUT, ASM)


@triton.jit
def _loads_at(w_ptr, s_ptr, z_ptr, it, n_it, pid, n_prog, warp, g, t, K: tl.constexpr,
              SECOND: tl.constexpr, STEPS: tl.constexpr, NW: tl.constexpr, TILES: tl.constexpr,
              GATE_OUT: tl.constexpr, ASM: tl.constexpr):
    """_step_loads of flattened step it (past the last: the last again, unused)."""
    it = tl.minimum(it, n_it - 1)
    tile = pid + (it // STEPS) * n_prog
    return _step_loads(w_ptr, s_ptr, z_ptr, tile, (it % STEPS) * NW + warp, g, t, K, SECOND,
                       TILES, GATE_OUT, ASM)


@triton.jit
def _consume(data, acc, it, pid, n_prog, x_ptr, xp, sx, one, mask, warp, t, bias_ptr, out_ptr,
             scale, N: tl.constexpr, STEPS: tl.constexpr, NW: tl.constexpr,
             TILES: tl.constexpr, GATE_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
             ASM: tl.constexpr):
    """Step it's products added to the tile's per-lane sums acc; at the tile's last step the
    sums go out (_store_tile) and start again from 0. With more than one step a tile, the
    step's x pairs are read here (the x of a launch of one step a tile stay in registers)."""
    wa, sa, wb, sb = data
    lo0, hi0, lo1, hi1 = acc
    step = it - (it // STEPS) * STEPS  # (the interpreter's int has no % with a constexpr)
    if STEPS > 1:
        xp = _group_x(x_ptr, step * NW + warp, t, ASM)
        sx = _group_sum(xp, one, NW, ASM)
    lo, hi = _pair_sums(wa, sa, xp, sx, mask, NW, ASM)
    lo0, hi0 = lo0 + lo, hi0 + hi
    if TILES == 2:
        lo, hi = _pair_sums(wb, sb, xp, sx, mask, NW, ASM)
        lo1, hi1 = lo1 + lo, hi1 + hi
    if step == STEPS - 1:
        _store_tile(lo0, hi0, lo1, hi1, t, pid + (it // STEPS) * n_prog, N, bias_ptr, out_ptr,
                    scale, NW, TILES, GATE_OUT, HAS_BIAS)
        z = tl.zeros(lo0.shape, tl.float32)
        lo0, hi0, lo1, hi1 = z, z, z, z
    return lo0, hi0, lo1, hi1


def fits(n: int, k: int, group_size: int, num_warps: int, tiles: int,
         gate_out: bool = False) -> bool:
    """Whether the kernel takes an [n, k] weight with these launch parameters: groups of 128
    split evenly over the warps, whole tiles (16 rows, 32 at TILES 2, a gate and an up tile
    for gate-out), word offsets within int32."""
    rows = n // 2 if gate_out else n
    tile_rows = 16 if gate_out else 16 * tiles
    return (group_size == GROUP_SIZE and num_warps in WARPS and tiles in (1, 2)
            and k % (GROUP_SIZE * num_warps) == 0
            and rows % tile_rows == 0 and n * k // 8 < 2**31
            and (not gate_out or (tiles == 2 and n % 2 == 0)))


def x_ok(x2: torch.Tensor) -> bool:
    """One row of bf16 x, 16-byte aligned (read 128 bits at a time)."""
    return x2.dtype == torch.bfloat16 and x2.shape[0] == 1 and x2.data_ptr() % 16 == 0


def launch(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, num_warps: int, tiles: int,
           programs_per_sm: int, sms: int, pdl_kwargs: dict, gate_out: bool = False,
           rms_eps: float = 0.0) -> None:
    """out [1, N] (gate_out: [1, N / 2]) from x2 [1, K] and an int4_awq weight (words int32
    [N, K / 8], scales float16 and zeros uint8 [N, K / 128], contiguous)."""
    n, k = words.shape[0], x2.shape[1]
    if not fits(n, k, GROUP_SIZE, num_warps, tiles, gate_out) or not x_ok(x2):
        raise ValueError(f"w4 k-warps: {num_warps} warps x {tiles} tiles do not take N={n} "
                         f"K={k}{' gate-out' if gate_out else ''} with {x2.dtype} x "
                         f"[{x2.shape[0]}, {k}]")
    words, scales, zeros = words.contiguous(), scales.contiguous(), zeros.contiguous()
    n_tiles = n // 2 // 16 if gate_out else n // (16 * tiles)
    programs = min(n_tiles, programs_per_sm * sms)
    _w4_kwarps_kernel[(programs,)](
        x2, words, scales, zeros, bias if bias is not None else out, out, 16, N=n, K=k,
        KP=triton.next_power_of_2(k), SECOND=n // 2 if gate_out else 16, NW=num_warps,
        TILES=tiles, GATE_OUT=gate_out, HAS_BIAS=bias is not None, ASM=x2.is_cuda,
        RMS_EPS=float(rms_eps), num_warps=num_warps, **pdl_kwargs)
