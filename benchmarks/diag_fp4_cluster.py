"""K split across a thread-block cluster, its partial sums added through distributed shared memory, for the fp4
CUDA form at M=16 (issue 18: 3x bf16 at 4096x14336).

    python -m benchmarks.diag_fp4_cluster [--shape 4096x14336] [--ms 16] [--rep-ms 30] [--out FILE]
    python -m benchmarks.diag_fp4_cluster --registers   (no GPU: nvcc's registers for sm_90 of each config)

The reading it tests (s42, not yet measured): at M=16 and 4096x14336 the default gives each of its 128 blocks 32 rows
over all of K, so every block reads all of x (16 x 14336 bf16, 459 KB) from L2: 59 MB of x against 33 MB of weights
and scales. ``diag_fp4_xring --x-pinned`` bounds what that traffic costs; this is a way to remove most of it. A
cluster of CL blocks (sm_90: blocks on one GPC, each able to read the others' shared memory) takes CL times the
rows over 1/CL of K each, so each block reads 1/CL of x: CL=2 halves x's traffic, CL=4 quarters it, for the same
128 blocks. The partial sums never go to global memory: each block leaves its fp32 sums in its own shared memory,
the cluster waits at one barrier, the first block adds the others' (``mapa`` + ``ld.shared::cluster``) and stores
bf16, and a second barrier keeps the others' shared memory until it has. s43's split of K (``diag_fp4_splitk``)
added the partials through global memory, after the kernel or by the last block to arrive, and was slower than the
default on an H200; the cluster's sum costs two barriers and CL - 1 reads of 32 lanes' sums.

A kernel-source variant, as ``diag_fp4_xring``'s (the cost model hashes the kernel's source): edits to the kernel as
built, ``CL`` a template argument after the others with ``__cluster_dims__(1, CL, 1)``; the grid's second axis is the
cluster's rank and the kernel's own split of K (``chunks_per_split``). Every row's output is checked against the
default's. Written in s47 with no GPU: nvcc 13.0 builds it for sm_90 (``--registers``); not yet run.
"""

from __future__ import annotations


import torch

from kpt_compiler.kernels import _fp4_cuda

from ._fp4_diag import NT_COMMENT, Rows, arguments, build, edited, launch, sm90_registers, warps_an_sm

AS_BUILT = _fp4_cuda.SOURCE

CLUSTER_PTX = r"""
__device__ __forceinline__ void cluster_sync() {  // every thread of every block of the cluster; orders shared memory
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ float load_peer(unsigned local, unsigned rank) {  // block rank's float at our address
  unsigned a;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
  return v;
}
"""

EDITS = [
    (NT_COMMENT, "\n" + CLUSTER_PTX + NT_COMMENT),
    ("__global__ void __launch_bounds__(RW * WK * 32)",
     "__global__ void __cluster_dims__(1, CL, 1) __launch_bounds__(RW * WK * 32)"),
    # every thread stays for the cluster's barriers: the other warps add the WK sums too, into sums no one reads
    ("    __syncthreads();\n    if (warp != 0) return;\n", "    __syncthreads();\n"),
    ("  const float f = 256.f * gs[0];",
     "  {  // the cluster's blocks add their sums: the first reads the others' from their shared memory\n"
     "    __shared__ float part[RW][RT * NT * 4][32];\n"
     "    if (warp == 0)\n"
     "#pragma unroll\n"
     "      for (int i = 0; i < RT * NT * 4; ++i) part[rw][i][lane] = acc[i / (NT * 4)][(i / 4) % NT][i % 4];\n"
     "    cluster_sync();\n"
     "    const unsigned rank = cluster_rank();\n"
     "    if (rank == 0 && warp == 0) {\n"
     "      const unsigned mine = shared_address(&part[rw][0][lane]);\n"
     "      for (unsigned r = 1; r < CL; ++r)\n"
     "#pragma unroll\n"
     "        for (int i = 0; i < RT * NT * 4; ++i)\n"
     "          acc[i / (NT * 4)][(i / 4) % NT][i % 4] += load_peer(mine + 128 * i, r);\n"
     "    }\n"
     "    cluster_sync();  // the others' sums stay until the first has read them\n"
     "    if (rank != 0 || warp != 0) return;\n"
     "  }\n"
     "  const float f = 256.f * gs[0];"),
]


def source() -> str:
    return edited(AS_BUILT, [("int RT>\n__global__", "int RT, int CL>\n__global__")] + EDITS, "diag_fp4_cluster")


def _targs(cfg: dict) -> str:
    return f"{cfg['nt']}, {cfg['rw']}, {cfg['wk']}, {cfg['depth']}, {int(cfg['async'])}, {cfg['rt']}, {cfg['cl']}"


def _dynamic(cfg: dict) -> int:
    return _fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], int(cfg["async"]), cfg["rt"], cfg["nt"])


def _part(cfg: dict) -> int:
    """The variant's static ``part`` (a block's sums, which the cluster's first block reads), beside ``red``."""
    return cfg["rw"] * cfg["rt"] * cfg["nt"] * 4 * 32 * 4


_BUILT: dict = {}


def fp4_cluster(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """The variant at ``cfg`` (``cl`` blocks a cluster, each 1/cl of K), into a new bf16 output."""
    key = tuple(sorted(cfg.items()))
    if key not in _BUILT:
        _BUILT[key] = build(source(), f"fp4_mma_sync<{_targs(cfg)}>", cfg, _dynamic(cfg), _part(cfg))
    return launch(_BUILT[key], x2, q, cfg, _dynamic(cfg), split=cfg["cl"])


def configs(m: int) -> list[dict]:
    """CL 1 (the kernel as built, through the variant: the control), 2 and 4, at about one block an SM at
    4096x14336 (128 blocks: rows a block times CL constant), the ring, 2 chunks in flight; two token tiles from M=9.
    From M=9 also x through the ring (async 2, s49): the default (CL 1, 12 warps along K, 2 row tiles a warp) and CL
    2 at 4 row tiles a warp with 8 and 10 warps along K (12 would need 244 KB of shared memory a block)."""
    nt = 1 if m <= 8 else 2
    rows = [(1, 1, 8, 2, True), (2, 1, 8, 4, True), (2, 2, 4, 2, True), (4, 2, 4, 4, True), (4, 4, 2, 2, True),
            (2, 1, 8, 2, True)]
    if m > 8:
        rows += [(1, 1, 12, 2, 2), (2, 1, 8, 4, 2), (2, 1, 10, 4, 2)]
    return [dict(cuda=True, nt=nt, rw=rw, wk=wk, depth=2, split_k=1, rt=rt, cl=cl, **{"async": a})
            for cl, rw, wk, rt, a in rows]


def registers(cfg: dict) -> int:
    """ptxas's registers for sm_90 (nvcc on PATH) of the variant's build of ``cfg``."""
    return sm90_registers(source(), _targs(cfg))


def main() -> None:
    p = arguments(__doc__, "16")
    args = p.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    if args.registers:
        print("| M | config (cl, rw, wk, rt, async), the ring at depth 2 | registers | warps an SM (registers, "
              f"shared memory) | blocks at {args.shape} |\n| --- | --- | --- | --- | --- |")
        for m in (int(v) for v in args.ms.split(",")):
            for c in configs(m):
                r = registers(c)
                shared = _dynamic(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"], c["rt"]) + _part(c)
                blocks = -(-n // (16 * c["rt"] * c["rw"])) * c["cl"]
                print(f"| {m} | {(c['cl'], c['rw'], c['wk'], c['rt'], int(c['async']))} | {r} | "
                      f"{warps_an_sm(r, c['rw'] * c['wk'], shared)} | {blocks} |")
        return
    t = Rows(n, k, args.rep_ms)
    for m, x, ref in t.each_m(args.ms):
        for cfg in configs(m):
            ring = "ring, x through it" if cfg["async"] == 2 else "ring"
            tag = f"cl={cfg['cl']} rw={cfg['rw']} wk={cfg['wk']} rt={cfg['rt']} {ring} depth 2"
            if cfg["cl"] == 1:  # the as-built kernel at the same config, beside the variant's control
                t.row(m, f"{tag}, as built", lambda q, c=cfg: _fp4_cuda.fp4_linear_cuda(
                    x, q.packed, q.scales, q.global_scale, {a: b for a, b in c.items() if a != "cl"}), ref)
            t.row(m, f"{tag}, cluster", lambda q, c=cfg: fp4_cluster(x, q, c), ref)
    t.finish(None, args.out)


if __name__ == "__main__":
    main()
