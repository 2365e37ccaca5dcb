"""The CUDA C++ source of fp4_linear's CUDA form (kernels/_fp4_cuda.py builds and launches it; the design:
docs/fp4-cuda-kernel.md): ``SOURCE``, whose ``chunk_mma_shx`` (x from the ring, async 2) is made from
``chunk_mma``'s text by ``chunk_from_shared``, so that the decode is one code. The diagnoses' variants
(benchmarks/diag_fp4_*) edit ``SOURCE`` with ``edited`` too."""

from __future__ import annotations

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b) {  // a * b - 0: the exact product (sm_80's FMA)
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

template <int SEL> __device__ __forceinline__ u32 prmt(u32 a, u32 b) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "n"(SEL));
  return d;
}

// Pair T of word w (nibbles T and T + 4: the low and high halves) as bf16 code bits (value * 2^-126), times s.
// w8 = w >> 8 brings pairs 2 and 3 to the places of 0 and 1. The pair's two nibbles are isolated, and one multiply
// by 2^a + 2^b (a = 6 - 4T', b = 12 - 4T') puts the magnitude at 6-8 and the sign at 15 of each half (the other
// copies land on bits 9 and 12-14, which the mask clears; the copies do not overlap, so the sum carries nothing).
template <int T> __device__ __forceinline__ u32 pair(u32 w, u32 w8, u32 s) {
  const u32 v = T == 0 ? (w & 0x000F000Fu) : T == 1 ? (w & 0x00F000F0u) : T == 2 ? (w8 & 0x000F000Fu)
                                                                                : (w8 & 0x00F000F0u);
  return fma_bf16x2((v * ((T & 1) ? 0x104u : 0x1040u)) & 0x81C081C0u, s);
}

// Two E4M3 scale bytes (the first in the low byte) -> each as bf16 s' = scale * 2^118 in both halves.
__device__ __forceinline__ void scale_pairs(u32 raw, u32 &first, u32 &second) {
  u32 h;
  asm("{\n.reg .b16 r;\ncvt.u16.u32 r, %1;\ncvt.rn.f16x2.e4m3x2 %0, r;\n}" : "=r"(h) : "r"(raw));
  // fp16 2^(e-15) (1 + f) -> bf16 exponent field e + 230 = (e - 15) + 118 + 127, mantissa's top 7 bits
  u32 b = ((h >> 3) & 0x0FFF0FFFu) + 0x73007300u;
  first = prmt<0x1010>(b, 0u);
  second = prmt<0x3232>(b, 0u);
}

__device__ __forceinline__ void mma(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_stream(const u32 *p) {  // weights: read once, not kept in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 load_cached(const uint4 *p) {  // x: read by every row tile, kept in L1
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ unsigned shared_address(const void *p) {
  unsigned a;
  asm("{\n.reg .u64 g;\ncvta.to.shared.u64 g, %1;\ncvt.u32.u64 %0, g;\n}" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void cp_async16(unsigned a, const void *gmem) {  // weights: L2 only, then shared
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}

__device__ __forceinline__ uint4 load_shared(unsigned a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a)
               : "memory");
  return v;
}

// One chunk of 128 K: the lane's words of rows g (lo) and g + 8 (hi), their two scale bytes each, and x's
// 32 elements per token tile, into 8 MMAs per token tile.
template <int NT>
__device__ __forceinline__ void chunk_mma(float (&acc)[NT][4], const uint4 lo, const uint4 hi, u32 s_lo, u32 s_hi,
                                          const uint4 (&xv)[NT][4]) {
  u32 sl0, sl1, sh0, sh1;  // row g (lo) and g + 8 (hi), the lane's first and second block
  scale_pairs(s_lo, sl0, sl1);
  scale_pairs(s_hi, sh0, sh1);
  const u32 wl[4] = {lo.x, lo.y, lo.z, lo.w};
  const u32 wh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 sl = j < 2 ? sl0 : sl1, sh = j < 2 ? sh0 : sh1;
    const u32 l8 = wl[j] >> 8, h8 = wh[j] >> 8;
    const u32 a0 = pair<0>(wl[j], l8, sl), a1 = pair<0>(wh[j], h8, sh), a2 = pair<1>(wl[j], l8, sl),
              a3 = pair<1>(wh[j], h8, sh);
    const u32 e0 = pair<2>(wl[j], l8, sl), e1 = pair<2>(wh[j], h8, sh), e2 = pair<3>(wl[j], l8, sl),
              e3 = pair<3>(wh[j], h8, sh);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 v = xv[nt][j];  // x[8j'..8j'+7] as pairs (0,1) (2,3) (4,5) (6,7)
      mma(acc[nt], a0, a1, a2, a3, prmt<0x5410>(v.x, v.z), prmt<0x7632>(v.x, v.z));
      mma(acc[nt], e0, e1, e2, e3, prmt<0x5410>(v.y, v.w), prmt<0x7632>(v.y, v.w));
    }
  }
}

// @chunk_mma_shx: chunk_mma with x from the ring (ASYNC 2), made from chunk_mma's text by chunk_from_shared

// NT: 8-token column tiles (M <= 8 NT); RW: 16-row tiles a block (one warp each), whose warps read the same x
// (from L1 after the first); WK: warps along K a row tile; DEPTH: chunks of weights in flight (DEPTH - 1 ahead
// of the one decoded); ASYNC: 0, the weights' loads go to registers; 1, to a ring of DEPTH chunks a warp in
// shared memory (cp.async: bytes in flight that hold no registers); 2, x's chunk too, copied whole (M=9-16:
// x's 64 registers freed, docs/fp4-cuda-kernel.md). The scales go to registers either way.
template <int NT, int RW, int WK, int DEPTH, int ASYNC, int RT>
__global__ void __launch_bounds__(RW * WK * 32) fp4_mma_sync(
    const u16 *__restrict__ x, const u32 *__restrict__ w, const unsigned char *__restrict__ s,
    const float *__restrict__ gs, void *__restrict__ y, int M, int N, int K, int chunks_per_split,
    int stride_xm, int stride_wn, int stride_sn, int stride_ys, int stride_ym, int out_f32) {
  static_assert(DEPTH % 2 == 0, "x's two buffers alternate with the chunk's parity: DEPTH must be even");
  const int lane = threadIdx.x & 31, rw = (threadIdx.x >> 5) % RW, warp = (threadIdx.x >> 5) / RW;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = (blockIdx.x * RW + rw) * 16 * RT + g;  // row tile rt: rows row0 + 16 rt and + 8
  const int nchunks = K / 128;
  const int first = blockIdx.y * chunks_per_split + warp;
  // Rows past N and tokens past M read the last row or token instead: their sums are never stored.
  const u32 *w_lo[RT], *w_hi[RT];  // chunk first + WK i: + 16 WK i words
  const unsigned char *s_lo[RT], *s_hi[RT];  // + 8 WK i bytes
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    const int r = row0 + 16 * rt;
    const long long c_lo = r < N ? r : N - 1, c_hi = r + 8 < N ? r + 8 : N - 1;
    w_lo[rt] = w + c_lo * stride_wn + 4 * t + 16 * first;
    w_hi[rt] = w + c_hi * stride_wn + 4 * t + 16 * first;
    s_lo[rt] = s + c_lo * stride_sn + 2 * t + 8 * first;
    s_hi[rt] = s + c_hi * stride_sn + 2 * t + 8 * first;
  }
  const uint4 *x_row[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const long long tok = nt * 8 + g < M ? nt * 8 + g : M - 1;
    x_row[nt] = (const uint4 *)(x + tok * stride_xm + 32 * t) + 16 * first;  // + 16 WK i
  }
  const int end_ = (int)(blockIdx.y + 1) * chunks_per_split, end = end_ < nchunks ? end_ : nchunks;
  const int count = first < end ? (end - first + WK - 1) / WK : 0;  // this warp's chunks: first + WK i

  float acc[RT][NT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[rt][nt][0] = acc[rt][nt][1] = acc[rt][nt][2] = acc[rt][nt][3] = 0.f;
  uint4 wb[ASYNC ? 1 : DEPTH][RT][2];
  u32 sb[DEPTH][RT][2];
  uint4 xb[2][NT][4];
  extern __shared__ uint4 ring_all[];  // ASYNC: DEPTH chunks a warp, [slot][row tile][row lo, hi][lane]
  // this lane's 16 bytes of row tile 0's row lo in slot 0 (a shared address); + 1024 RT a slot, + 1024 a row
  // tile, + 512 for row hi
  const unsigned ring = shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64 + lane);
  // ASYNC 2: x's chunk whole (8 NT tokens x 256 bytes) in DEPTH slots a warp after every warp's weights;
  // copy i of lane l is unit u = l % 16 of token 2 i + l / 16 (one instruction: two tokens' 256 contiguous
  // bytes), stored at unit u ^ 2 (u >> 3) ^ (token & 1) of the token's 256 bytes (8 lanes reading one step of
  // two tokens then hit 8 groups of banks)
  const unsigned xbase = shared_address(ring_all + RW * WK * DEPTH * RT * 64 + (threadIdx.x >> 5) * DEPTH * NT * 128);
  const unsigned xu = lane & 15, xdst = xbase + (lane >> 4) * 256 + ((xu ^ ((xu >> 3) << 1) ^ (lane >> 4)) << 4);
  const u16 *const xsrc = x + (long long)(lane >> 4) * stride_xm + 8 * xu + 128 * first;
  unsigned xa[NT], xc[NT];  // lane (g, t) reads token tile nt's step j at xa + slot + 16 (j ^ xc)
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + g < M ? nt * 8 + g : M - 1;
    xa[nt] = xbase + tok * 256 + 64 * t;
    xc[nt] = ((t >> 1) << 1) ^ (tok & 1);
  }

  // The loads of a warp's chunk i0 + P (P a compile-time offset) from pointers advanced by DEPTH chunks a turn
  // of the loop below, so that their offsets are immediates.
#define LOAD_W(slot, P)                                                                        \
  if (i0 + (P) < count) {                                                                      \
    _Pragma("unroll") for (int rt = 0; rt < RT; ++rt) {                                        \
      if (ASYNC) {                                                                             \
        cp_async16(ring + ((slot) * RT + rt) * 1024, w_lo[rt] + 16 * WK * (P));                \
        cp_async16(ring + ((slot) * RT + rt) * 1024 + 512, w_hi[rt] + 16 * WK * (P));          \
      } else {                                                                                 \
        wb[slot][rt][0] = load_stream(w_lo[rt] + 16 * WK * (P));                               \
        wb[slot][rt][1] = load_stream(w_hi[rt] + 16 * WK * (P));                               \
      }                                                                                        \
      sb[slot][rt][0] = *(const u16 *)(s_lo[rt] + 8 * WK * (P));                               \
      sb[slot][rt][1] = *(const u16 *)(s_hi[rt] + 8 * WK * (P));                               \
    }                                                                                          \
    if (ASYNC == 2) {  /* tokens past M not copied: their reads take token M - 1's */          \
      _Pragma("unroll") for (int i = 0; i < NT * 4; ++i)                                       \
        if (2 * i + (lane >> 4) < M)                                                           \
          cp_async16(xdst + (slot) * NT * 2048 + i * 512,                                      \
                     xsrc + 2 * i * stride_xm + 128 * WK * (i0 + (P)));                        \
    }                                                                                          \
  }                                                                                            \
  if (ASYNC) cp_async_commit();  /* a group every turn, empty or not: wait_group counts them */
#define LOAD_X(slot, P)                                                                        \
  if (ASYNC != 2 && i0 + (P) < count) {                                                                      \
    _Pragma("unroll") for (int nt = 0; nt < NT; ++nt)                                          \
      _Pragma("unroll") for (int q = 0; q < 4; ++q)                                            \
        xb[slot][nt][q] = load_cached(x_row[nt] + 16 * WK * (P) + q);                          \
  }

  int i0 = 0;
#pragma unroll
  for (int p = 0; p < DEPTH - 1; ++p) { LOAD_W(p, p) }
  LOAD_X(0, 0)
  for (; i0 < count; i0 += DEPTH) {
#pragma unroll
    for (int p = 0; p < DEPTH; ++p) {
      if (i0 + p < count) {
        if (ASYNC == 2) __syncwarp();  // every lane has read the slot that these copies overwrite
        LOAD_W((p + DEPTH - 1) % DEPTH, p + DEPTH - 1)
        LOAD_X((p + 1) % 2, p + 1)
        if (ASYNC) cp_async_wait<DEPTH - 1>();  // this chunk's group has landed: at most DEPTH - 1 pending
        if (ASYNC == 2) __syncwarp();  // and every lane's copies of x with it (a lane reads others' copies)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {  // x's registers serve every row tile of the warp
          if (ASYNC == 2)
            chunk_mma_shx<NT>(acc[rt], load_shared(ring + (p * RT + rt) * 1024),
                              load_shared(ring + (p * RT + rt) * 1024 + 512), sb[p][rt][0], sb[p][rt][1],
                              xa, xc, p * NT * 2048);
          else if (ASYNC)
            chunk_mma<NT>(acc[rt], load_shared(ring + (p * RT + rt) * 1024),
                          load_shared(ring + (p * RT + rt) * 1024 + 512), sb[p][rt][0], sb[p][rt][1], xb[p % 2]);
          else
            chunk_mma<NT>(acc[rt], wb[p][rt][0], wb[p][rt][1], sb[p][rt][0], sb[p][rt][1], xb[p % 2]);
        }
      }
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      w_lo[rt] += 16 * WK * DEPTH;
      w_hi[rt] += 16 * WK * DEPTH;
      s_lo[rt] += 8 * WK * DEPTH;
      s_hi[rt] += 8 * WK * DEPTH;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) x_row[nt] += 16 * WK * DEPTH;
  }
#undef LOAD_W
#undef LOAD_X

  if (WK > 1) {  // the warps of a row tile add their sums; the first stores
    __shared__ float red[WK][RW][RT * NT * 4][32];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][rw][(rt * NT + nt) * 4 + e][lane] = acc[rt][nt][e];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int v = 1; v < WK; ++v)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[rt][nt][e] += red[v][rw][(rt * NT + nt) * 4 + e][lane];
  }
  const float f = 256.f * gs[0];  // the decode's 2^-8 and the tensor scale
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * t + (e & 1), row = row0 + 16 * rt + (e < 2 ? 0 : 8);
        if (tok < M && row < N) {  // the sums of clamped rows and tokens are dropped here
          const long long at = (long long)tok * stride_ym + row;
          if (out_f32)
            ((float *)y)[(long long)blockIdx.y * stride_ys + at] = acc[rt][nt][e] * f;
          else
            ((u16 *)y)[at] = to_bf16(acc[rt][nt][e] * f);
        }
      }
}
"""


def edited(source: str, edits: list, who: str) -> str:
    """``source`` with each (old, new) of ``edits`` replaced in turn; each old must be there exactly once, else the
    kernel has changed under ``who``'s edits (this module's, or a diagnosis's variant: benchmarks/diag_fp4_*)."""
    for a, b in edits:
        if source.count(a) != 1:
            raise RuntimeError(f"{who}: the kernel's source no longer has {a[:60]!r} once; update its edits")
        source = source.replace(a, b)
    return source


def chunk_from_shared(source: str, name: str, targs: str, params: str, first: str, after: str) -> str:
    """``source``'s ``chunk_mma`` with x read from shared memory one 16-byte step ahead of its MMAs instead of from
    registers: ``name<targs>(..., params)``, token tile nt's step 0 at address ``first`` and step j + 1 at ``after``
    (C expressions of nt and j). Made from chunk_mma's text, so the decode is the same code."""
    start = source.index("template <int NT>\n__device__ __forceinline__ void chunk_mma(")
    fn = source[start:source.index("\n}\n", start) + 3]
    return edited(fn, [
        ("template <int NT>\n", f"template <{targs}>\n"),
        ("void chunk_mma(", f"void {name}("),
        ("const uint4 (&xv)[NT][4]) {\n",
         f"{params}) {{\n  uint4 xv[2][NT];\n#pragma unroll\n"
         f"  for (int nt = 0; nt < NT; ++nt) xv[0][nt] = load_shared({first});\n"),
        ("  for (int j = 0; j < 4; ++j) {\n",
         "  for (int j = 0; j < 4; ++j) {\n    if (j < 3) {\n#pragma unroll\n"
         f"      for (int nt = 0; nt < NT; ++nt) xv[(j + 1) & 1][nt] = load_shared({after});\n"
         "    }\n"),
        ("const uint4 v = xv[nt][j];", "const uint4 v = xv[j & 1][nt];"),
    ], "chunk_from_shared")


SHX = "// @chunk_mma_shx: chunk_mma with x from the ring (ASYNC 2), made from chunk_mma's text by chunk_from_shared\n"
SOURCE = edited(SOURCE, [(SHX,
    "// chunk_mma with x from the ring (ASYNC 2): token tile nt's step j at xa + off + 16 (j ^ xc)\n"
    + chunk_from_shared(
        SOURCE, "chunk_mma_shx", "int NT", "const unsigned (&xa)[NT], const unsigned (&xc)[NT], unsigned off",
        "xa[nt] + off + 16 * xc[nt]", "xa[nt] + off + 16 * ((j + 1) ^ xc[nt])"))], "_fp4_cuda")
