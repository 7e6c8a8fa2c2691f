// One-row W4A16 GEMV (int4_awq layout, groups of 128), fed by bulk asynchronous copies.
//
// out[n] = sum_k (q[n,k] - z[n,k/128]) * s[n,k/128] * x[k] (+ bias[n])   (bf16 x, bias and out,
// fp16 s, uint8 z). RMS: of x / rms(x) (a folded RMSNorm). GATE_OUT: a [gate | up] weight of 2I
// rows, out[j] = SiLU(gate_j) * up_j.
//
// One block an SM. Warp 0 is the producer: its lanes copy whole 16-row tiles (weights, scales,
// zeros) into a ring of STAGES shared-memory stages with cp.async.bulk, each stage completed by
// an mbarrier's transaction count. Copies need no registers, so bytes in flight are bounded by
// the ring, not by the warps; and the weights are requested before the PDL wait (they are never
// written), while the kernel before still runs. Warps 1..CWARPS consume: each takes K / CWARPS
// of every tile and sums on the tensor cores with x in every column of the mma.
//
// XQ 2 (default): x of each group as integers xq = round(x / step), |xq| <= 127 * 256, split
// exactly into int8 halves hi * 256 + lo (a 15-bit fixed point a group, far finer than int4's
// own error). Even nibbles masked to bytes (q) and odd ones masked in place (16 q) feed u8 x s8
// mma (m16n8k32) with no shifts: ~0.4 instructions a weight. sum (q - z) xq is exact in int32;
// step and scale come off once a group. XQ 0: nibbles as bf16 pairs 128 + q (a shift and a
// LOP3) on bf16 mma, s (D - (128 + z) sum x) a group: ~1 instruction a weight.
//
// Compile-time constants: K (a multiple of 128 * CWARPS), CWARPS, STAGES, XQ, BIAS, RMS,
// GATE_OUT, MODE (probes). Written without CUDA headers so that NVRTC compiles it as is.

#ifndef K
#define K 4096
#endif
#ifndef CWARPS
#define CWARPS 8
#endif
#ifndef STAGES
#define STAGES 5
#endif
#ifndef XQ
#define XQ 2
#endif
#ifndef BIAS
#define BIAS 0
#endif
#ifndef RMS
#define RMS 0
#endif
#ifndef GATE_OUT
#define GATE_OUT 0
#endif
#ifndef MODE
#define MODE 0  // probes: 1 = copies alone (consumers only wait and release), 2 = math alone
#endif

#define ROWS 16
#define GROUP 128
#define NG (K / GROUP)               // groups a row
#define GPW (NG / CWARPS)            // groups a consumer warp takes of each tile
#define ROW_PITCH (K / 2 + 64)       // padded: lanes of one quarter-warp hit distinct banks
#define W_BYTES (ROWS * ROW_PITCH)
#define S_BYTES (ROWS * NG * 2)
#define Z_BYTES (ROWS * NG)
#define STAGE_BYTES ((W_BYTES + S_BYTES + Z_BYTES + 127) / 128 * 128)
#define TX_BYTES (ROWS * (K / 2 + NG * 2 + NG))
#define NBUF (STAGES + 1)            // partial-row buffers (see the reduction below)
// mbarriers (full, empty, reduced), partial rows [NBUF][CWARPS][ROWS], squares [CWARPS]
#define PARTIAL_OFF (16 * STAGES + 8 * NBUF)
#define SQUARES_OFF (PARTIAL_OFF + NBUF * CWARPS * ROWS * 4)
#define HEAD_BYTES ((SQUARES_OFF + CWARPS * 4 + 127) / 128 * 128)

static_assert(NG % CWARPS == 0, "K must split evenly over the consumer warps");

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count));
}

__device__ __forceinline__ void bar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}" :: "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Not volatile: independent products may interleave.
__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_u8(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Bytes (b0, b1, b2, b3) of four ints, low first.
__device__ __forceinline__ u32 pack4(int b0, int b1, int b2, int b3) {
  return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | ((u32)b3 << 24);
}

// Nibbles a and a + 4 of a word (16 bits apart) as the bf16 pair (128 + q_a, 128 + q_a+4), in
// one LOP3 (the compiler splits the C expression into two).
__device__ __forceinline__ u32 pair(u32 w, int a) {
  u32 r;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(r) : "r"(w >> (4 * a)));
  return r;
}

__device__ __forceinline__ float bf16_to_f32(u32 bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// The weight row copied into tile row r (GATE_OUT: rows 0-7 gate rows, 8-15 the matching up rows).
__device__ __forceinline__ long weight_row(int tile, int r, int half_n) {
  if (GATE_OUT) return r < 8 ? (long)tile * 8 + r : (long)half_n + tile * 8 + (r - 8);
  return (long)tile * ROWS + r;
}

extern "C" __global__ void __launch_bounds__((CWARPS + 1) * 32, 1)
w4_gemv_bulk(const u16* x,  // not __restrict__: the kernel before writes it (no .nc loads)
             const unsigned char* __restrict__ qweight, const u16* __restrict__ scales,
             const unsigned char* __restrict__ zeros, const u16* __restrict__ bias,
             u16* __restrict__ out, int n_tiles, int half_n, float rms_eps) {
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 base = smem_addr(smem);
  const u32 full = base, empty = base + 8 * STAGES, reduced = base + 16 * STAGES;
  float* partial = reinterpret_cast<float*>(smem + PARTIAL_OFF);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      bar_init(full + 8 * s, 1);
      bar_init(empty + 8 * s, CWARPS);
    }
    for (int b = 0; b < NBUF; ++b) bar_init(reduced + 8 * b, CWARPS * 8);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  if (warp == 0) {  // producer: lanes 0..15 copy one row of each tile
    if (MODE == 2) return;
    int s = 0;
    u32 phase = 0;
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
      bar_wait(empty + 8 * s, phase ^ 1);
      if (lane == 0) bar_expect_tx(full + 8 * s, TX_BYTES);
      __syncwarp();
      if (lane < ROWS) {  // a copy a padded weight row
        const u32 st = base + HEAD_BYTES + s * STAGE_BYTES;
        const long row = weight_row(tile, lane, half_n);
        bulk_copy(st + lane * ROW_PITCH, qweight + row * (K / 2), K / 2, full + 8 * s);
        if (lane % 8 == 0) {  // rows 0-7 and 8-15 are each contiguous (gate-out too): one copy
          bulk_copy(st + W_BYTES + lane * NG * 2, scales + row * NG, 8 * NG * 2, full + 8 * s);
          bulk_copy(st + W_BYTES + S_BYTES + lane * NG, zeros + row * NG, 8 * NG, full + 8 * s);
        }
      }
      if (++s == STAGES) {
        s = 0;
        phase ^= 1;
      }
    }
    return;
  }

  // Consumers: x is the previous kernel's output, read only after the PDL wait.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int cw = warp - 1, g = lane >> 2, t = lane & 3;
  float squares = 0.f;  // RMS: this lane's share of sum x^2
#if XQ
  // Bytes follow a weight word's nibbles: (0, 2, 4, 6) and (1, 3, 5, 7).
  u32 xh[GPW][4][2], xl[GPW][4][2];
  float step[GPW];
  int qsum[GPW];
#pragma unroll
  for (int gi = 0; gi < GPW; ++gi) {
    const int k0 = (cw * GPW + gi) * GROUP + t * 32;
    float v[32];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 r = *reinterpret_cast<const uint4*>(x + k0 + 8 * j);
      const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        v[8 * j + 2 * h] = bf16_to_f32(w[h] & 0xFFFF);
        v[8 * j + 2 * h + 1] = bf16_to_f32(w[h] >> 16);
      }
    }
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      amax = fmaxf(amax, fabsf(v[e]));
      if (RMS) squares += v[e] * v[e];
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
    step[gi] = amax > 0.f ? amax / 32512.f : 1.f;
    const float inv = amax > 0.f ? 32512.f / amax : 0.f;
    int hi[32], lo[32], sum = 0;
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      const int q = __float2int_rn(v[e] * inv);
      hi[e] = (q + 128) >> 8;
      lo[e] = q - hi[e] * 256;
      sum += q;
    }
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    qsum[gi] = sum;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int* H = hi + 8 * j;
      const int* L = lo + 8 * j;
      xh[gi][j][0] = pack4(H[0], H[2], H[4], H[6]);
      xh[gi][j][1] = pack4(H[1], H[3], H[5], H[7]);
      xl[gi][j][0] = pack4(L[0], L[2], L[4], L[6]);
      xl[gi][j][1] = pack4(L[1], L[3], L[5], L[7]);
    }
  }
#else
  u32 xp[GPW][4][4];  // [group][word][pair]: (x_8j+a, x_8j+a+4) of this lane's 32 k
  float xsum[GPW];
#pragma unroll
  for (int gi = 0; gi < GPW; ++gi) {
    const int k0 = (cw * GPW + gi) * GROUP + t * 32;
    float part = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 r = *reinterpret_cast<const uint4*>(x + k0 + 8 * j);
      xp[gi][j][0] = __byte_perm(r.x, r.z, 0x5410);
      xp[gi][j][1] = __byte_perm(r.x, r.z, 0x7632);
      xp[gi][j][2] = __byte_perm(r.y, r.w, 0x5410);
      xp[gi][j][3] = __byte_perm(r.y, r.w, 0x7632);
      const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const float a = bf16_to_f32(w[h] & 0xFFFF), b = bf16_to_f32(w[h] >> 16);
        part += a + b;
        if (RMS) squares += a * a + b * b;
      }
    }
    part += __shfl_xor_sync(0xFFFFFFFFu, part, 1);
    part += __shfl_xor_sync(0xFFFFFFFFu, part, 2);
    xsum[gi] = part;
  }
#endif
  float inv_rms = 1.f;
  if (RMS) {  // lanes of one t hold the same x: sum over t, then over the warps
    float* sq = reinterpret_cast<float*>(smem + SQUARES_OFF);
    squares += __shfl_xor_sync(0xFFFFFFFFu, squares, 1);
    squares += __shfl_xor_sync(0xFFFFFFFFu, squares, 2);
    if (lane == 0) sq[cw] = squares;
    asm volatile("bar.sync 1, %0;" :: "n"(CWARPS * 32) : "memory");
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < CWARPS; ++w) total += sq[w];
    inv_rms = rsqrtf(total / K + rms_eps);
  }

  // The warps' partial rows meet without a consumer-wide barrier: for the block's tile i, each
  // warp's writing lanes store into buffer i % NBUF and arrive on its mbarrier; warp i % CWARPS
  // waits, sums and stores. A buffer is rewritten NBUF = STAGES + 1 tiles later, which needs
  // the producer to have refilled a stage that the summing warp released only after summing.
  int s = 0, b = 0, red = cw;  // stage, partial buffer, tiles until this warp sums
  u32 phase = 0, bphase = 0;
  for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
    if (MODE != 2) bar_wait(full + 8 * s, phase);
    if (MODE == 1) {
      __syncwarp();
      if (lane == 0) bar_arrive(empty + 8 * s);
      if (++s == STAGES) {
        s = 0;
        phase ^= 1;
      }
      continue;
    }
    const unsigned char* st = smem + HEAD_BYTES + s * STAGE_BYTES;
    const u16* ss = reinterpret_cast<const u16*>(st + W_BYTES);
    const unsigned char* zz = st + W_BYTES + S_BYTES;
    float acc_lo = 0.f, acc_hi = 0.f;  // rows g and g + 8
#pragma unroll
    for (int gi = 0; gi < GPW; ++gi) {
      const int grp = cw * GPW + gi;
      const uint4 wl = *reinterpret_cast<const uint4*>(st + g * ROW_PITCH + grp * 64 + t * 16);
      const uint4 wh =
          *reinterpret_cast<const uint4*>(st + (g + 8) * ROW_PITCH + grp * 64 + t * 16);
      const u32 lo[4] = {wl.x, wl.y, wl.z, wl.w}, hi[4] = {wh.x, wh.y, wh.z, wh.w};
      const int zl = zz[g * NG + grp], zh = zz[(g + 8) * NG + grp];
      const float s_lo = f16_to_f32(ss[g * NG + grp]), s_hi = f16_to_f32(ss[(g + 8) * NG + grp]);
#if XQ
      // Two words a product: A = (row g, row g + 8) x (word j, word j + 1).
      int eh[4] = {0, 0, 0, 0}, el[4] = {0, 0, 0, 0}, oh[4] = {0, 0, 0, 0}, ol[4] = {0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        const u32 E = 0x0F0F0F0Fu, O = 0xF0F0F0F0u;
        const u32 e0 = lo[j] & E, e1 = hi[j] & E, e2 = lo[j + 1] & E, e3 = hi[j + 1] & E;
        const u32 o0 = lo[j] & O, o1 = hi[j] & O, o2 = lo[j + 1] & O, o3 = hi[j + 1] & O;
        mma_u8(eh, e0, e1, e2, e3, xh[gi][j][0], xh[gi][j + 1][0]);
        mma_u8(el, e0, e1, e2, e3, xl[gi][j][0], xl[gi][j + 1][0]);
        mma_u8(oh, o0, o1, o2, o3, xh[gi][j][1], xh[gi][j + 1][1]);
        mma_u8(ol, o0, o1, o2, o3, xl[gi][j][1], xl[gi][j + 1][1]);
      }
      // the odd sums are 16x (exact): sum (q - z) xq in int32, then the step and the scale
      const int d_lo = eh[0] * 256 + el[0] + ((oh[0] * 256 + ol[0]) >> 4);
      const int d_hi = eh[2] * 256 + el[2] + ((oh[2] * 256 + ol[2]) >> 4);
      acc_lo += s_lo * step[gi] * (float)(d_lo - zl * qsum[gi]);
      acc_hi += s_hi * step[gi] * (float)(d_hi - zh * qsum[gi]);
#else
      float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};  // two short chains
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mma_bf16(d, pair(lo[j], 0), pair(hi[j], 0), pair(lo[j], 1), pair(hi[j], 1), xp[gi][j][0],
                 xp[gi][j][1]);
        mma_bf16(e, pair(lo[j], 2), pair(hi[j], 2), pair(lo[j], 3), pair(hi[j], 3), xp[gi][j][2],
                 xp[gi][j][3]);
      }
      acc_lo += s_lo * (d[0] + e[0] - (128.f + zl) * xsum[gi]);
      acc_hi += s_hi * (d[2] + e[2] - (128.f + zh) * xsum[gi]);
#endif
    }
    __syncwarp();
    if (MODE != 2 && lane == 0) bar_arrive(empty + 8 * s);  // this warp is done with the stage
    if (++s == STAGES) {
      s = 0;
      phase ^= 1;
    }

    float* buf = partial + b * CWARPS * ROWS;
    if (t == 0) {
      buf[cw * ROWS + g] = acc_lo;
      buf[cw * ROWS + g + 8] = acc_hi;
      bar_arrive(reduced + 8 * b);  // release: this lane's two stores
    }
    if (red == 0) {
      red = CWARPS;
      bar_wait(reduced + 8 * b, bphase);
      if (lane < ROWS) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < CWARPS; ++w) sum += buf[w * ROWS + lane];
        sum *= inv_rms;
        const long row = weight_row(tile, lane, half_n);
        if (BIAS) sum += bf16_to_f32(bias[row]);
        if (GATE_OUT) {  // lane j < 8 pairs gate row j with up row j + 8 (both rounded to bf16)
          const float v = bf16_to_f32(f32_to_bf16(sum));
          const float up = __shfl_down_sync(0x0000FFFFu, v, 8);
          if (lane < 8) out[(long)tile * 8 + lane] = f32_to_bf16(v / (1.f + __expf(-v)) * up);
        } else {
          out[row] = f32_to_bf16(sum);
        }
      }
    }
    --red;
    if (++b == NBUF) {
      b = 0;
      bphase ^= 1;
    }
  }
}
