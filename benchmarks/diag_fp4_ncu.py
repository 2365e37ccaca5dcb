"""The fp4 kernels' small-M launches, to run under Nsight Compute (ncu reads hardware counters on the lent
Firecracker machines; METHOD.md: leave the clocks alone):

    ncu --clock-control none --kernel-name regex:"_fp4_(mma|linear|gemv_h2)_kernel" --launch-count 6 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis python -m benchmarks.diag_fp4_ncu

Default: three Triton forms on NVFP4 4096x14336 (bf16 activations), each launched twice and named by its config
(fp4_linear's default would take the CUDA form where it runs): the bf16-pair MMA form (decode=3) at M=16, the
dot form with decode=2 at M=16, and the fp16-pair GEMV at M=1. ``--cuda``: the CUDA C++ form
(kernel ``fp4_mma_sync``) at its default configs, M = 1, 4 and 16, each launched twice. What ncu says about
occupancy, stalls, pipes and bandwidth is its output's, not this script's.

``--ceiling`` (no ncu) times, in CUDA-graph replays with rotating buffers as bench_fp4 does, what reading the
same number of bytes costs at best here: a sum over the bytes (int32 words), bf16 cuBLAS at M=1 on a weight
of that many bytes, and a kernel that only reads them (``READ``: 16-byte loads that skip L1, a grid-stride loop
with U loads in flight a thread, at several block sizes and blocks an SM; the fastest of them, and the next
four), against the CUDA form at M=1. It says how far the fp4 GEMV is from this card's reading speed at this
size: a GEMV of these bytes can be no faster than the fastest read of them.
"""

from __future__ import annotations

import argparse

import torch

from kpt_compiler.bench import timing_ms
from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels.fp4_linear import fp4_linear

from .bench_fp4 import rotating

N, K = 4096, 14336


def _weight(g: torch.Generator) -> fmt.Fp4Weight:
    return fmt.quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02, fmt.NVFP4)


def launches(cuda: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = _weight(g)
    x16 = torch.randn(16, K, device="cuda", generator=g).bfloat16()
    cases = ((f"cuda M={m}", x16[:m].contiguous(), {"cuda": True}) for m in (1, 4, 16)) if cuda else (
        ("mma M=16", x16, {"decode": 3, "gemv": False}), ("dot decode=2 M=16", x16, {"decode": 2}),
        ("gemv M=1", x16[:1].contiguous(), {"gemv": True}))
    for name, x, cfg in cases:
        for _ in range(2):
            fp4_linear(x, q, config=cfg)
        torch.cuda.synchronize()
        print(name, flush=True)


READ = r"""
template <int U>
__global__ void read_only(const uint4 *__restrict__ p, long long n, unsigned *__restrict__ out) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + i + u * stride));
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) out[0] = acc;  // kept, so the loads are too; almost never stored
}
"""


def read_rows(words: list, rep_ms: float) -> list:
    """``READ`` over each config (block size, blocks an SM, loads in flight a thread): (ms, name), fastest first."""
    from kpt_compiler.kernels._launch import sm_count

    sms = sm_count(torch.device("cuda"))
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    n16 = words[0].numel() // 4
    timed = []
    for u in (1, 2, 4, 8):
        kernel = torch.cuda._compile_kernel(READ, f"read_only<{u}>", nvcc_options=["-std=c++17"])
        for threads in (256, 512, 1024):
            for per_sm in (1, 2, 4, 8):
                if threads * per_sm > 2048:
                    continue
                def fn(w, kernel=kernel, threads=threads, per_sm=per_sm):
                    kernel(grid=(sms * per_sm, 1, 1), block=(threads, 1, 1), args=[w, n16, out],
                           stream=torch.cuda.current_stream())
                t = timing_ms(rotating(fn, words), "cuda", warmup_ms=rep_ms / 5, rep_ms=rep_ms, cuda_graph=True)
                timed.append((t, f"read only: U={u}, {threads} threads, {per_sm} blocks an SM"))
    return sorted(timed, key=lambda r: r[0].median)


def ceiling(rep_ms: float = 30) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    qs = [_weight(g) for _ in range(4)]
    nbytes = qs[0].nbytes()
    words = [torch.randint(0, 1 << 30, (nbytes // 4,), device="cuda", dtype=torch.int32, generator=g)
             for _ in range(4)]
    k16 = nbytes // 2 // N  # a bf16 weight N x k16 of about the same bytes
    w16 = [torch.randn(N, k16, device="cuda", generator=g).bfloat16() for _ in range(4)]
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    x16 = torch.randn(1, k16, device="cuda", generator=g).bfloat16()
    rows = (("sum of int32 words", nbytes, rotating(lambda w: w.sum(), words)),
            (f"bf16 cuBLAS M=1, {N}x{k16}", N * k16 * 2, rotating(lambda w: x16 @ w.t(), w16)),
            (f"fp4 CUDA form M=1, {N}x{K} NVFP4", nbytes,
             rotating(lambda q: fp4_linear(x, q, config={"cuda": True}), qs)),
            (f"fp4 CUDA form M=1, {N}x{K} NVFP4, 12 warps along K (the ring)", nbytes,
             rotating(lambda q: fp4_linear(x, q, config=dict(cuda=True, rw=1, wk=12, depth=2, split_k=1, rt=1,
                                                             **{"async": True})), qs)))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA-graph replays, median of {rep_ms} ms")
    print("| what | MB read | us | TB/s |\n| --- | --- | --- | --- |")
    timed = [(timing_ms(fn, "cuda", warmup_ms=rep_ms / 5, rep_ms=rep_ms, cuda_graph=True), name, b)
             for name, b, fn in rows]
    timed += [(t, name, nbytes) for t, name in read_rows(words, rep_ms / 3)[:5]]
    for t, name, b in timed:
        print(f"| {name} | {b / 1e6:.1f} | {t.median * 1e3:.2f} [{t.p20 * 1e3:.2f}, {t.p80 * 1e3:.2f}] | "
              f"{b / (t.median * 1e-3) / 1e12:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="the CUDA C++ form at M = 1, 4, 16")
    p.add_argument("--ceiling", action="store_true", help="time reading the weight's bytes at best (no ncu)")
    a = p.parse_args()
    ceiling() if a.ceiling else launches(a.cuda)


if __name__ == "__main__":
    main()
