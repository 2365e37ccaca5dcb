"""Split-K for the fp4 CUDA form with the partial sums added inside the kernel (issue 18, M=16 at 4096x14336).

    python -m benchmarks.diag_fp4_splitk [--shape 4096x14336] [--ms 1,16] [--rep-ms 30] [--out FILE]

The reading it tests (s42, not measured): at M=16 and 4096x14336 the default config runs one row group of 2 row
tiles a block with 8 warps along K, so every one of its 128 blocks reads all of x (16 tokens x 14336, 459 KB)
from L2: about 59 MB of x against 33 MB of weights. Blocks of several row groups (RW warps that share x through
L1) over 1/split of K read 1/split of x each. ``fp4_linear_cuda`` already splits K across blocks, but it writes
fp32 partial sums and adds them with two more kernels (``out.sum(0).to(bfloat16)``). The variant here adds them
in the kernel: each row group's warp 0 stores its fp32 partials, counts itself in on a per-row-group counter
(``atomicAdd`` after ``__threadfence``), and the last of the split to arrive adds the partials in split order,
writes bf16, and sets the counter back to 0 (so a CUDA graph can replay it). A kernel-source variant, as
``diag_fp4_l2``'s are: ``kernels/_fp4_cuda.py`` is hashed into the cost model's fp4 tables, so a change there
lands only with a recalibration on the H100 and the H200.

Rows, each a CUDA-graph replay's median over copies of the weight that together take three times L2 (as
bench_fp4): bf16 cuBLAS; the default config; each split config with the sum after (``fp4_linear_cuda``); the
same with the sum in the kernel. Every fp4 row's output is checked against the default's (relative error).
"""

from __future__ import annotations


import torch

from kpt_compiler.kernels import _fp4_cuda

from ._fp4_diag import Rows, arguments, edited

AS_BUILT = _fp4_cuda.SOURCE
FIXUP = r"""
  if (counters != nullptr) {  // split K: the last of the split to arrive adds the partials (in split order)
    __threadfence();
    __syncwarp();
    const int id = blockIdx.x * RW + rw;
    unsigned old = 0;
    if (lane == 0) old = atomicAdd(counters + id, 1u);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old == gridDim.y - 1) {
      __threadfence();
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = nt * 8 + 2 * t + (e & 1), row = row0 + 16 * rt + (e < 2 ? 0 : 8);
            if (tok < M && row < N) {
              const long long at = (long long)tok * stride_ym + row;
              float sum = 0.f;
              for (int sp = 0; sp < (int)gridDim.y; ++sp) sum += __ldcg((const float *)y + sp * (long long)stride_ys + at);
              y_bf16[at] = to_bf16(sum);
            }
          }
      if (lane == 0) counters[id] = 0u;
    }
  }
}
"""
STORE_END = "            ((u16 *)y)[at] = to_bf16(acc[rt][nt][e] * f);\n        }\n      }\n}\n"


def _rep(s: str, a: str, b: str) -> str:
    return edited(s, [(a, b)], "diag_fp4_splitk")


def fixup_source() -> str:
    s = _rep(AS_BUILT, "int stride_ym, int out_f32) {",
             "int stride_ym, int out_f32, u16 *__restrict__ y_bf16, unsigned *__restrict__ counters) {")
    return _rep(s, STORE_END, STORE_END[:-2] + FIXUP)


_BUILT: dict = {}
_COUNTERS: dict = {}


def _fixup_kernel(cfg: dict):
    key = _fp4_cuda._key(cfg, 0)
    if key not in _BUILT:
        _fp4_cuda.SOURCE = fixup_source()
        try:
            _BUILT[key] = _fp4_cuda._build(*key)
        finally:
            _fp4_cuda.SOURCE = AS_BUILT
    return _BUILT[key]


def fp4_fixup(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """``fp4_linear_cuda``'s launch with the split's sums added in the kernel (split > 1)."""
    (m, k), n = x2.shape, q.packed.shape[0]
    w, s = q.packed.view(torch.int32), q.scales.view(torch.uint8)
    chunks = k // _fp4_cuda.CHUNK
    per = -(-chunks // min(cfg["split_k"], chunks))
    split = -(-chunks // per)
    rt, groups = cfg.get("rt", 1), -(-n // (16 * cfg.get("rt", 1) * cfg["rw"]))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    need = groups * cfg["rw"]
    if _COUNTERS.get("n", 0) < need:  # zeros once; each last arrival sets its counter back to 0
        _COUNTERS.update(n=need, t=torch.zeros(need, dtype=torch.int32, device=x2.device))
    _fixup_kernel(cfg)(grid=(groups, split, 1), block=(32 * cfg["rw"] * cfg["wk"], 1, 1),
                       shared_mem=_fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], int(cfg["async"]), rt,
                                                       cfg["nt"]),
                       args=[x2, w, s, q.global_scale.reshape(1).float(), part, m, n, k, per, x2.stride(0),
                             w.stride(0), s.stride(0), part.stride(0), part.stride(1), 1, y, _COUNTERS["t"]],
                       stream=torch.cuda.current_stream())
    return y


def split_configs(m: int) -> list[dict]:
    nt = 1 if m <= 8 else 2
    return [dict(cuda=True, nt=nt, rw=rw, wk=wk, depth=depth, split_k=sk, rt=2, **{"async": True})
            for rw in (2, 4, 8) for wk in (1, 2) for sk in (4, 8) for depth in (2,) if rw * wk <= 8]


def main() -> None:
    p = arguments(__doc__, "1,16", registers=False)
    args = p.parse_args()
    t = Rows(*(int(v) for v in args.shape.split("x")), args.rep_ms)
    for m, x, ref in t.each_m(args.ms):
        for cfg in split_configs(m):
            tag = f"rw={cfg['rw']} wk={cfg['wk']} split={cfg['split_k']} depth={cfg['depth']}"
            t.row(m, f"{tag}, sum after", lambda q, c=cfg: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales,
                                                                                  q.global_scale, c), ref)
            t.row(m, f"{tag}, sum in kernel", lambda q, c=cfg: fp4_fixup(x, q, c), ref)
    t.finish(12, args.out)


if __name__ == "__main__":
    main()
