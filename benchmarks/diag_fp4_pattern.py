"""The fp4 CUDA form's loads alone, in its access pattern and in others (issue 18, M=1 at 4096x14336).

    python -m benchmarks.diag_fp4_pattern [--rep-ms 30]

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
each with AHEAD chunks' loads in flight a warp before any is used. The real GEMV runs beside them. If a pattern
reads much faster than the GEMV's, the pattern is what to change; if all are as slow, it is not.
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
template <int WK, int AHEAD, int MODE>  // MODE 0 interleaved, 1 contiguous, 2 tiled
__global__ void __launch_bounds__(WK * 32) loads_only(const uint4 *__restrict__ w, const unsigned char *__restrict__ s,
                                                     int K, unsigned *__restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int nchunks = K / 128, count = (nchunks + WK - 1 - warp) / WK;  // this warp's chunks
  const long long row = (long long)blockIdx.x * 16 + g, words = K / 32;  // uint4s a row: K / 2 bytes / 16
  unsigned acc = 0;
  for (int i0 = 0; i0 < count; i0 += AHEAD) {
    uint4 lo[AHEAD], hi[AHEAD];
    unsigned short sl[AHEAD], sh[AHEAD];
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      const int i = i0 + a < count ? i0 + a : count - 1;
      const int c = MODE == 1 ? (warp * nchunks) / WK + i : warp + WK * i;
      const uint4 *pl, *ph;
      const unsigned char *ql, *qh;
      if (MODE == 2) {
        const long long tile = (long long)blockIdx.x * nchunks + c;
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
                   : "=r"(lo[a].x), "=r"(lo[a].y), "=r"(lo[a].z), "=r"(lo[a].w) : "l"(pl));
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(hi[a].x), "=r"(hi[a].y), "=r"(hi[a].z), "=r"(hi[a].w) : "l"(ph));
      sl[a] = *(const unsigned short *)ql;
      sh[a] = *(const unsigned short *)qh;
    }
#pragma unroll
    for (int a = 0; a < AHEAD; ++a)
      acc ^= lo[a].x ^ lo[a].y ^ lo[a].z ^ lo[a].w ^ hi[a].x ^ hi[a].y ^ hi[a].z ^ hi[a].w ^ sl[a] ^ (sh[a] << 16);
  }
  if (acc == 0x9E3779B9u) out[0] = acc;  // kept, so the loads are too; almost never stored
}
"""

MODES = {0: "interleaved", 1: "contiguous", 2: "tiled"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep-ms", type=float, default=30.0)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    qs = [fmt.quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02, fmt.NVFP4) for _ in range(4)]
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    nbytes = qs[0].nbytes()

    def time(fn) -> object:
        return timing_ms(rotating(fn, qs), "cuda", warmup_ms=args.rep_ms / 5, rep_ms=args.rep_ms, cuda_graph=True)

    rows = [("fp4 GEMV, default config", time(lambda q: fp4_linear(x, q, config={"cuda": True}))),
            ("fp4 GEMV, 12 warps along K (the ring)",
             time(lambda q: fp4_linear(x, q, config=dict(cuda=True, rw=1, wk=12, depth=2, split_k=1, rt=1,
                                                           **{"async": True}))))]
    for mode in MODES:
        for wk in (8, 12, 16):
            for ahead in (1, 2, 4):
                kernel = torch.cuda._compile_kernel(SOURCE, f"loads_only<{wk}, {ahead}, {mode}>",
                                                    nvcc_options=["-std=c++17"])

                def fn(q, kernel=kernel, wk=wk):
                    kernel(grid=(N // 16, 1, 1), block=(32 * wk, 1, 1),
                           args=[q.packed.view(torch.uint8), q.scales.view(torch.uint8), K, out],
                           stream=torch.cuda.current_stream())
                rows.append((f"loads only, {MODES[mode]}, WK={wk}, {ahead} chunks ahead", time(fn)))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {N}x{K} NVFP4 ({nbytes / 1e6:.1f} MB), M=1 | "
          f"CUDA-graph replays over 4 copies, median of {args.rep_ms} ms\n")
    print("| kernel | us | TB/s |\n| --- | --- | --- |")
    for name, t in sorted(rows, key=lambda r: r[1].median):
        print(f"| {name} | {t.median * 1e3:.2f} [{t.p20 * 1e3:.2f}, {t.p80 * 1e3:.2f}] | "
              f"{nbytes / (t.median * 1e-3) / 1e12:.2f} |")


if __name__ == "__main__":
    main()
