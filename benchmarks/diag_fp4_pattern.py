"""The fp4 CUDA form's loads alone, in its access pattern and in others (issue 18, M=1 at 4096x14336).

    python -m benchmarks.diag_fp4_pattern [--rep-ms 30]
    python -m benchmarks.diag_fp4_pattern --m16      (M=16's loads: x's two token tiles too, 1 or 2 row tiles a warp)

Why (s45, ``diag_fp4_ncu --ceiling`` on an H100): a kernel that only reads the weight's 33 MB does so in 10.7 us
(3.1 TB/s), the fp4 GEMV at M=1 in 15.0-15.4 us; 3x bf16 cuBLAS needs about 13.9. ncu puts the GEMV's warps
stalled on global loads for 5.0 of every 8.8 cycles, and s32's ``diag_fp4_decode_cost`` found the kernel only
1.4% faster without its decode: the loads, not the arithmetic, set its time. This times kernels that make only the
loads (the weights' two 16-byte words a lane and the scales' two bytes, per 128-K chunk, XORed together so
that they are kept), one block of WK warps a 16-row tile as the GEMV's default does, in three patterns:
- ``interleaved``: the GEMV's: lane (g, t) reads rows g and g + 8 at bytes 64 c + 16 t of chunk c; warp w takes
  chunks w, w + WK, ...; so one load instruction reads 8 rows x 64 bytes;
- ``contiguous``: the same addresses, warp w taking a contiguous run of chunks instead;
- ``tiled``: the same bytes laid out tile by tile (16 rows x 64 bytes, 1 KB a chunk, contiguous), so one load
  instruction reads 512 contiguous bytes (a layout the weights would need repacking into);
each with AHEAD to 2 AHEAD chunks' loads in flight a warp (two buffers, a turn's loads issued before the last
turn's are used). The real GEMV runs beside them. If a pattern reads much faster than the GEMV's, the pattern is
what to change; if all are as slow, it is not.

s45's two runs (``benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-07-s45-diag-fp4-pattern-call4-*``) were made
before the two buffers: each turn's loads were used in the same turn, and ptxas put each use next to its load
(nvcc 13.0's SASS), so about one chunk was in flight a warp whatever AHEAD said. Their WK and pattern rows stand;
their "chunks ahead" did not hold more loads in flight.
"""

from __future__ import annotations

import argparse

import torch

from kpt_compiler.bench import timing_ms
from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels.fp4_linear import fp4_linear

from .bench_fp4 import rotating

N, K = 4096, 14336

SOURCE = r"""
// MODE 0 interleaved, 1 contiguous, 2 tiled; RT row tiles a warp (a block covers 16 RT rows); XT 8-token tiles of
// x read a chunk (ld.global.nc through L1, as the GEMV reads x: lane (g, t) token 8 xt + g, elements 32 t..+31).
// Two buffers of AHEAD chunks: a turn issues the next AHEAD chunks' loads, then uses the last turn's, so AHEAD to
// 2 AHEAD chunks are in flight (ptxas does not move the uses across the loop's turns; in s45's first runs, with
// the uses in the same turn as their loads, it put each use next to its load: one chunk in flight whatever AHEAD).
template <int AHEAD, int RT, int XT> struct Turn {
  uint4 lo[AHEAD][RT], hi[AHEAD][RT], xv[AHEAD][XT > 0 ? XT : 1][4];
  unsigned short sl[AHEAD][RT], sh[AHEAD][RT];
};

template <int WK, int AHEAD, int MODE, int RT = 1, int XT = 0>
__global__ void __launch_bounds__(WK * 32) loads_only(const uint4 *__restrict__ w, const unsigned char *__restrict__ s,
                                                     const uint4 *__restrict__ x, int K, unsigned *__restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int nchunks = K / 128, count = (nchunks + WK - 1 - warp) / WK;  // this warp's chunks
  const long long words = K / 32;  // uint4s a row: K / 2 bytes / 16
  unsigned acc = 0;
  auto load = [&](Turn<AHEAD, RT, XT> &b, int i0) {
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      if (i0 + a >= count) continue;
      const int i = i0 + a, c = MODE == 1 ? (warp * nchunks) / WK + i : warp + WK * i;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const long long rtile = (long long)blockIdx.x * RT + r, row = rtile * 16 + g;
        const uint4 *pl, *ph;
        const unsigned char *ql, *qh;
        if (MODE == 2) {
          const long long tile = rtile * nchunks + c;
          pl = w + tile * 64 + lane;
          ph = pl + 32;
          ql = s + tile * 128 + 2 * lane;
          qh = ql + 64;
        } else {
          pl = w + row * words + 4 * c + t;
          ph = pl + 8 * words;
          ql = s + row * (K / 16) + 8 * c + 2 * t;
          qh = ql + 8 * (K / 16);
        }
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(b.lo[a][r].x), "=r"(b.lo[a][r].y), "=r"(b.lo[a][r].z), "=r"(b.lo[a][r].w) : "l"(pl));
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(b.hi[a][r].x), "=r"(b.hi[a][r].y), "=r"(b.hi[a][r].z), "=r"(b.hi[a][r].w) : "l"(ph));
        b.sl[a][r] = *(const unsigned short *)ql;
        b.sh[a][r] = *(const unsigned short *)qh;
      }
#pragma unroll
      for (int xt = 0; xt < XT; ++xt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint4 *px = x + (long long)(8 * xt + g) * (K / 8) + 16 * c + 4 * t + q;
          asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(b.xv[a][xt][q].x), "=r"(b.xv[a][xt][q].y), "=r"(b.xv[a][xt][q].z),
                         "=r"(b.xv[a][xt][q].w) : "l"(px));
        }
    }
  };
  auto use = [&](const Turn<AHEAD, RT, XT> &b, int i0) {
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      if (i0 + a >= count) continue;
#pragma unroll
      for (int r = 0; r < RT; ++r)
        acc ^= b.lo[a][r].x ^ b.lo[a][r].y ^ b.lo[a][r].z ^ b.lo[a][r].w ^ b.hi[a][r].x ^ b.hi[a][r].y ^
               b.hi[a][r].z ^ b.hi[a][r].w ^ b.sl[a][r] ^ (b.sh[a][r] << 16);
#pragma unroll
      for (int xt = 0; xt < XT; ++xt)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc ^= b.xv[a][xt][q].x ^ b.xv[a][xt][q].y ^ b.xv[a][xt][q].z ^ b.xv[a][xt][q].w;
    }
  };
  Turn<AHEAD, RT, XT> b0, b1;
  load(b0, 0);
  for (int i0 = 0; i0 < count; i0 += 2 * AHEAD) {
    load(b1, i0 + AHEAD);
    use(b0, i0);
    load(b0, i0 + 2 * AHEAD);
    use(b1, i0 + AHEAD);
  }
  if (acc == 0x9E3779B9u) out[0] = acc;  // kept, so the loads are too; almost never stored
}
"""

MODES = {0: "interleaved", 1: "contiguous", 2: "tiled"}


def cases(m16: bool) -> list:
    """(name, template arguments, row tiles a warp) of the loads-only kernels: at M=1 each pattern at WK 8/12/16 and
    1/2/4 chunks ahead; with ``m16``, the interleaved pattern with 1 or 2 row tiles a warp and x's two token tiles
    read or not (the GEMV's M=16 loads)."""
    if not m16:
        return [(f"loads only, {MODES[mode]}, WK={wk}, {ahead} chunks ahead", f"{wk}, {ahead}, {mode}", 1)
                for mode in MODES for wk in (8, 12, 16) for ahead in (1, 2, 4)]
    return [(f"loads only, interleaved, WK={wk}, {ahead} chunks ahead, {rt} row tiles a warp, "
             f"{'x read' if xt else 'no x'}", f"{wk}, {ahead}, 0, {rt}, {xt}", rt)
            for rt in (1, 2) for xt in (0, 2) for wk in (8, 12, 16) for ahead in (1, 2)
            if (rt, xt, ahead) != (2, 2, 2)]  # two turns of that in registers: ptxas puts them on the stack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep-ms", type=float, default=30.0)
    p.add_argument("--m16", action="store_true", help="M=16's loads (x's two token tiles, 1 or 2 row tiles a warp)")
    args = p.parse_args()
    m = 16 if args.m16 else 1
    g = torch.Generator(device="cuda").manual_seed(0)
    qs = [fmt.quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02, fmt.NVFP4) for _ in range(4)]
    x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
    x16 = torch.randn(16, K, device="cuda", generator=g).bfloat16()  # the loads-only kernels' x (16 tokens)
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    nbytes = qs[0].nbytes()

    def time(fn) -> object:
        return timing_ms(rotating(fn, qs), "cuda", warmup_ms=args.rep_ms / 5, rep_ms=args.rep_ms, cuda_graph=True)

    rows = [("fp4 GEMV, default config", time(lambda q: fp4_linear(x, q, config={"cuda": True}))),
            ("fp4 GEMV, 12 warps along K (the ring)",
             time(lambda q: fp4_linear(x, q, config=dict(cuda=True, rw=1, wk=12, depth=2, split_k=1, rt=2 if m > 1
                                                           else 1, **{"async": True}))))]
    for name, targs, rt in cases(args.m16):
        kernel = torch.cuda._compile_kernel(SOURCE, f"loads_only<{targs}>", nvcc_options=["-std=c++17"])
        wk = int(targs.split(",")[0])

        def fn(q, kernel=kernel, wk=wk, rt=rt):
            kernel(grid=(N // (16 * rt), 1, 1), block=(32 * wk, 1, 1),
                   args=[q.packed.view(torch.uint8), q.scales.view(torch.uint8), x16, K, out],
                   stream=torch.cuda.current_stream())
        rows.append((name, time(fn)))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {N}x{K} NVFP4 ({nbytes / 1e6:.1f} MB), "
          f"M={m} | CUDA-graph replays over 4 copies, median of {args.rep_ms} ms\n")
    print("| kernel | us | TB/s of weight bytes |\n| --- | --- | --- |")
    for name, t in sorted(rows, key=lambda r: r[1].median):
        print(f"| {name} | {t.median * 1e3:.2f} [{t.p20 * 1e3:.2f}, {t.p80 * 1e3:.2f}] | "
              f"{nbytes / (t.median * 1e-3) / 1e12:.2f} |")


if __name__ == "__main__":
    main()
