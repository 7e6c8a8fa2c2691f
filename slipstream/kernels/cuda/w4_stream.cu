// One-row W4A16 GEMV (int4_awq layout, groups of 128) streaming weights through registers.
//
// out[n] = sum_k (q[n,k] - z[n,k/128]) * s[n,k/128] * x[k] (+ bias[n])   (bf16 x, bias and out,
// fp16 s, uint8 z). RMS: of x / rms(x) (a folded RMSNorm). GATE_OUT: a [gate | up] weight of 2I
// rows, out[j] = SiLU(gate_j) * up_j (a tile holds gate rows 8t..8t+7 and the same up rows).
//
// Every warp loads its own weights into registers, DEPTH groups ahead, and the block needs only
// x's split in shared memory (K / 2 bytes): small blocks that share an SM with the kernels
// around them. Bounded by the weights' HBM stream; the registers a warp holds in flight set
// how much of it is hidden.
//
// A warp takes 16-row tiles; KSPLIT warps of a block share one tile, each K / KSPLIT, and meet
// in shared memory. An item is one group (128 k) of the warp's tile: lane (g, t) loads 16 bytes
// of rows g and g + 8 (words 4t..4t+3 of the group, k = 32t .. 32t + 31).
//
// Math: x of each group as integers xq = round(x / step), |xq| <= 127 *
// 256, split exactly into int8 halves hi * 256 + lo. Even nibbles masked to bytes (q), odd ones
// in place (16 q), on u8 x s8 mma m16n8k32 (no shifts). B's columns 0-3 hold hi, 4-7 lo, so one
// product gives both: lanes t = 0, 1 hold the hi sums, t = 2, 3 the lo sums, each added to its
// own float sum with its weight (256 or 1), and the halves meet once a tile (a shuffle).
//
// Compile-time constants: K (a multiple of 128 * KSPLIT), WARPS, KSPLIT, DEPTH, MINB (blocks an
// SM for the register budget), BIAS, RMS, GATE_OUT. Written without CUDA headers so that NVRTC
// compiles it as is (it gets no include path). The plain-torch twin of its numerics is
// w4_split_int8_reference in kernels/cuda/w4_stream.py.

#ifndef K
#define K 4096
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef KSPLIT
#define KSPLIT 1
#endif
#ifndef DEPTH
#define DEPTH 4
#endif
#ifndef MINB
#define MINB 2
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

#define ROWS 16
#define GROUP 128
#define NG (K / GROUP)            // groups a row
#define GPW (NG / KSPLIT)         // groups a warp takes of its tile
#define SLOTS (WARPS / KSPLIT)    // tiles a block works on at once
// shared: x split [NG][t 4][hi, lo][8 words], (step, qsum) [NG], partials [2][WARPS][16], squares
#define XS_BYTES (NG * 256)
#define SQ_OFF XS_BYTES
#define PART_OFF (SQ_OFF + NG * 8)
#define SQUARES_OFF (PART_OFF + 2 * WARPS * ROWS * 4)

static_assert(NG % KSPLIT == 0, "K must split evenly over a tile's warps");
static_assert(WARPS % KSPLIT == 0, "a block holds whole tiles");
static_assert(KSPLIT == 1 || SLOTS <= 15, "one named barrier a shared tile slot");
static_assert(GPW % DEPTH == 0, "a warp's groups of a tile come in whole chunks");

typedef unsigned int u32;
typedef unsigned short u16;

struct W16 {  // 16 bytes of a weight row
  u32 a, b, c, d;
};

__device__ __forceinline__ W16 load_weights(const unsigned char* p) {
  W16 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.a), "=r"(r.b), "=r"(r.c), "=r"(r.d) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_u8(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// w & m in one LOP3 with m in a register (an immediate would be rematerialised each use).
__device__ __forceinline__ u32 masked(u32 w, u32 m) { return w & m; }

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

// The weight row held in tile row r (GATE_OUT: rows 0-7 gate rows, 8-15 the matching up rows).
__device__ __forceinline__ long weight_row(int tile, int r, int half_n) {
  if (GATE_OUT) return r < 8 ? (long)tile * 8 + r : (long)half_n + tile * 8 + (r - 8);
  return (long)tile * ROWS + r;
}

// Two bytes (a, b) as a u16, a low.
__device__ __forceinline__ u16 two_bytes(int a, int b) { return (u16)((a & 0xFF) | ((b & 0xFF) << 8)); }

// x's groups split into int8 halves in the layout the products read: group gr, chunk t (k
// 32t..32t+31), half (0 hi, 1 lo): 8 words (word j of the chunk's even bytes, then its odd
// bytes, j = 0..3); each warp takes groups warp, warp + WARPS, ... Returns this lane's share of
// sum x^2 (RMS).
__device__ __forceinline__ float split_x(const u16* x, unsigned char* smem, int warp, int lane) {
  float squares = 0.f;
  float2* sq = reinterpret_cast<float2*>(smem + SQ_OFF);
  constexpr int PER_WARP = (NG + WARPS - 1) / WARPS;
  u32 xw[PER_WARP][2];  // every group's x requested before the first reduction
#pragma unroll
  for (int i = 0; i < PER_WARP; ++i) {
    const int gr = min(warp + i * WARPS, NG - 1);
    const u32* src = reinterpret_cast<const u32*>(x + gr * GROUP + 4 * lane);
    xw[i][0] = src[0];
    xw[i][1] = src[1];
  }
#pragma unroll
  for (int i = 0; i < PER_WARP; ++i) {
    const int gr = warp + i * WARPS;
    if (gr >= NG) break;
    // lane l: k = 4l .. 4l + 3 of the group
    const u32 w0 = xw[i][0], w1 = xw[i][1];
    const float v[4] = {bf16_to_f32(w0 & 0xFFFF), bf16_to_f32(w0 >> 16), bf16_to_f32(w1 & 0xFFFF),
                        bf16_to_f32(w1 >> 16)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    if (RMS) squares += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const float step = amax > 0.f ? amax / 32512.f : 1.f;
    const float inv = amax > 0.f ? 32512.f / amax : 0.f;
    int hi[4], lo[4], sum = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int q = __float2int_rn(v[e] * inv);
      hi[e] = (q + 128) >> 8;
      lo[e] = q - hi[e] * 256;
      sum += q;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
    if (lane == 0) {
      float2 v2;
      v2.x = step;
      v2.y = __int_as_float(sum);
      sq[gr] = v2;
    }
    // lane l holds k 4l..4l+3: chunk l / 8, word j = (l % 8) / 2, bytes 2h, 2h + 1 (h = l % 2)
    // of that word's even and odd byte sets
    const int chunk = lane >> 3, j = (lane & 7) >> 1, h = lane & 1;
    u16* base = reinterpret_cast<u16*>(smem + gr * 256 + chunk * 64) + j * 4 + h;
    base[0] = two_bytes(hi[0], hi[2]);       // hi, even word j
    base[2] = two_bytes(hi[1], hi[3]);       // hi, odd word j
    base[16] = two_bytes(lo[0], lo[2]);      // lo (32 bytes on), even
    base[18] = two_bytes(lo[1], lo[3]);      // lo, odd
  }
  return squares;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
w4_gemv_stream(const u16* x,  // not __restrict__: the kernel before writes it (no .nc loads)
               const unsigned char* __restrict__ qweight, const u16* __restrict__ scales,
               const unsigned char* __restrict__ zeros, const u16* __restrict__ bias,
               u16* __restrict__ out, int n_tiles, int half_n, float rms_eps) {
  extern __shared__ __align__(128) unsigned char smem[];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int slot = warp / KSPLIT, kp = warp % KSPLIT;

  // This warp's tiles: (blockIdx.x + i gridDim.x) SLOTS + slot, i = 0 .. n_my - 1.
  const int first = blockIdx.x * SLOTS + slot, stride = gridDim.x * SLOTS;
  const int n_my = first < n_tiles ? 1 + (n_tiles - 1 - first) / stride : 0;

  // Items are loaded DEPTH at a time (a chunk), one chunk ahead of the products: the chunk
  // after (tile i, chunk c) is (i, c + 1), or (i + 1, 0) after a tile's last; past the warp's
  // last chunk, that one again (loaded, unused). Row g + 8 is a fixed distance from row g.
  const long d_rows = GATE_OUT ? (long)half_n : 8;
  const unsigned char* pw = qweight;  // the chunk being loaded: row g's first item
  const u16* ps = scales;
  const unsigned char* pz = zeros;
  auto aim = [&](int tile_i) {  // the first chunk of the warp's tile_i-th tile
    const long row = weight_row(first + tile_i * stride, g, half_n);
    const int grp = kp * GPW;
    pw = qweight + row * (K / 2) + grp * 64 + t * 16;
    ps = scales + row * NG + grp;
    pz = zeros + row * NG + grp;
  };
  W16 ring_l[DEPTH], ring_h[DEPTH];
  u16 ring_sl[DEPTH], ring_sh[DEPTH];
  unsigned char ring_zl[DEPTH], ring_zh[DEPTH];
  auto fill = [&](int j) {  // slot j <- item j of the chunk at the cursor
    ring_l[j] = load_weights(pw + j * 64);
    ring_h[j] = load_weights(pw + d_rows * (K / 2) + j * 64);
    ring_sl[j] = ps[j];
    ring_sh[j] = ps[d_rows * NG + j];
    ring_zl[j] = pz[j];
    ring_zh[j] = pz[d_rows * NG + j];
  };
  // The first chunk is requested before the PDL wait: weights are never written.
  if (n_my > 0) {
    aim(0);
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) fill(j);
  }

  asm volatile("griddepcontrol.wait;" ::: "memory");
  float squares = split_x(x, smem, warp, lane);
  float* sqsum = reinterpret_cast<float*>(smem + SQUARES_OFF);
  if (RMS) {
#pragma unroll
    for (int o = 16; o; o >>= 1) squares += __shfl_xor_sync(0xFFFFFFFFu, squares, o);
    if (lane == 0) sqsum[warp] = squares;
  }
  __syncthreads();
  float inv_rms = 1.f;
  if (RMS) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += sqsum[w];
    inv_rms = rsqrtf(total / K + rms_eps);
  }
  if (n_my == 0) return;

  const u32 E = 0x0F0F0F0Fu * (u32)(n_tiles > 0), O = E << 4;  // masks held in registers
  const bool hi_lane = t < 2;  // B columns 0-3 hold x's hi halves, 4-7 its lo halves
  const int weight = hi_lane ? 256 : 1;
  const int half_off = (g >= 4) * 32;  // this lane's B column: hi (g < 4) or lo
  const float2* sq = reinterpret_cast<const float2*>(smem + SQ_OFF);
  float* partial = reinterpret_cast<float*>(smem + PART_OFF);
  float acc_lo = 0.f, acc_hi = 0.f;  // rows g and g + 8 (this lane's half of x)

  for (int tile_i = 0; tile_i < n_my; ++tile_i) {
    for (int c = 0; c < GPW / DEPTH; ++c) {
      if (c + 1 < GPW / DEPTH) {  // the cursor to the next chunk
        pw += DEPTH * 64;
        ps += DEPTH;
        pz += DEPTH;
      } else if (tile_i + 1 < n_my) {
        aim(tile_i + 1);
      }
      const int grp0 = kp * GPW + c * DEPTH;
      const unsigned char* xs0 = smem + grp0 * 256 + t * 64 + half_off;
#pragma unroll
      for (int j = 0; j < DEPTH; ++j) {
        const W16 wl = ring_l[j], wh = ring_h[j];
        const float s_lo = f16_to_f32(ring_sl[j]), s_hi = f16_to_f32(ring_sh[j]);
        const int z_lo = ring_zl[j], z_hi = ring_zh[j];
        fill(j);  // this slot's next item, a chunk on
        const uint4* xs = reinterpret_cast<const uint4*>(xs0 + j * 256);
        const uint4 x01 = xs[0], x23 = xs[1];  // words 0, 1 then 2, 3: (even, odd) each
        int ev[4] = {0, 0, 0, 0}, od[4] = {0, 0, 0, 0};
        mma_u8(ev, masked(wl.a, E), masked(wh.a, E), masked(wl.b, E), masked(wh.b, E), x01.x,
               x01.z);
        mma_u8(od, masked(wl.a, O), masked(wh.a, O), masked(wl.b, O), masked(wh.b, O), x01.y,
               x01.w);
        mma_u8(ev, masked(wl.c, E), masked(wh.c, E), masked(wl.d, E), masked(wh.d, E), x23.x,
               x23.z);
        mma_u8(od, masked(wl.c, O), masked(wh.c, O), masked(wl.d, O), masked(wh.d, O), x23.y,
               x23.w);
        const float2 st = sq[grp0 + j];
        const int zq = hi_lane ? __float_as_int(st.y) : 0;  // the zero's term, once (hi lanes)
        // the odd sums are 16x (exact): this half's sum (q - z) xq in int32
        const int d_lo = (ev[0] + (od[0] >> 4)) * weight - z_lo * zq;
        const int d_hi = (ev[2] + (od[2] >> 4)) * weight - z_hi * zq;
        acc_lo += s_lo * st.x * (float)d_lo;
        acc_hi += s_hi * st.x * (float)d_hi;
      }
    }
    // the warp's share of the tile's rows is done
    acc_lo += __shfl_xor_sync(0xFFFFFFFFu, acc_lo, 2);  // hi half + lo half
    acc_hi += __shfl_xor_sync(0xFFFFFFFFu, acc_hi, 2);
    const int tile = first + tile_i * stride;
    float v_lo = acc_lo, v_hi = acc_hi;
    bool write = t == 0;
    if (KSPLIT > 1) {
      float* buf = partial + (tile_i & 1) * WARPS * ROWS;
      if (t == 0) {
        buf[warp * ROWS + g] = acc_lo;
        buf[warp * ROWS + g + 8] = acc_hi;
      }
      asm volatile("bar.sync %0, %1;" :: "r"(1 + slot), "n"(KSPLIT * 32) : "memory");
      write = false;
      if (kp == 0 && t == 0) {
        v_lo = 0.f;
        v_hi = 0.f;
#pragma unroll
        for (int w = 0; w < KSPLIT; ++w) {
          v_lo += buf[(slot * KSPLIT + w) * ROWS + g];
          v_hi += buf[(slot * KSPLIT + w) * ROWS + g + 8];
        }
        write = true;
      }
    }
    if (write) {
      v_lo *= inv_rms;
      v_hi *= inv_rms;
      const long r_lo = weight_row(tile, g, half_n), r_hi = weight_row(tile, g + 8, half_n);
      if (BIAS) {
        v_lo += bf16_to_f32(bias[r_lo]);
        v_hi += bf16_to_f32(bias[r_hi]);
      }
      if (GATE_OUT) {  // gate row g and its up row, both rounded to bf16 first
        const float gate = bf16_to_f32(f32_to_bf16(v_lo));
        const float up = bf16_to_f32(f32_to_bf16(v_hi));
        out[(long)tile * 8 + g] = f32_to_bf16(gate / (1.f + __expf(-gate)) * up);
      } else {
        out[r_lo] = f32_to_bf16(v_lo);
        out[r_hi] = f32_to_bf16(v_hi);
      }
    }
    acc_lo = 0.f;
    acc_hi = 0.f;
  }
}
