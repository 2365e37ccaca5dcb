"""x through the cp.async ring as well as the weights, for the fp4 CUDA form (issue 18: M=16 and M=1 at 4096x14336).

    python -m benchmarks.diag_fp4_xring [--shape 4096x14336] [--ms 1,16] [--rep-ms 30] [--out FILE]
    python -m benchmarks.diag_fp4_xring --registers      (no GPU: nvcc's registers for sm_90 of each variant config)
    python -m benchmarks.diag_fp4_xring --registers --xw (no GPU: the same for the XW variant at M=1)
    python -m benchmarks.diag_fp4_xring --as-built       (the as-built ring's configs only, beside the default)
    python -m benchmarks.diag_fp4_xring --xw --ms 1      (M=1: x whole in shared memory, staged once a block)
    python -m benchmarks.diag_fp4_xring --x-pinned       (a bound, not a kernel: x's reads kept in L1)

The reading it tests (s45, from s32's ncu profile of the M=16 default on an H200,
``benchmarks/results/nvidia-h200/2026-11-29-s32-fp4-ncu-cuda-b4ce997.txt``): 2 warps a scheduler (167 registers:
one block of 8 warps an SM), 0.48 of them eligible, issue slots 32% busy, and 41% of the cycles between two
instructions stalled on an L1TEX scoreboard, i.e. on a global load. The weights come through the ring
(``cp.async``), so those are x's loads (one chunk ahead, into two register buffers: 64 registers at two token
tiles) and the scales'. Here x's chunk goes into the ring beside the weights' (``ASYNC=2``), DEPTH - 1 chunks
ahead in the same commit group, and each lane reads its own bytes back one 16-byte step ahead of its MMAs: x
then holds 2 x NT registers instead of 8 x NT x 4, so the kernel takes fewer registers, more warps fit an SM,
and x's loads are as far ahead as the weights'.

Result (s45, one H100, ``benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-07-s45-diag-fp4-xring-call1-288ccd0.txt``):
the variant is right (the same outputs as the as-built ring at each config) and 2.5-8x slower: 0.093-0.122 ms at
M=1 and 0.050-0.089 at M=16, against 0.0148-0.0193 and 0.0198-0.0309 for the as-built ring. Not followed up; our
guess is that x loses L1 (the as-built loads keep x there; ``cp.async.cg`` reads L2 every time), which does not
explain a factor of 8 at M=1, where x is 28 KB. The as-built ring at 12 warps along K was the fastest config at
both M (``--as-built``, three runs over two calls).

A kernel-source variant, as ``diag_fp4_l2``'s and ``diag_fp4_splitk``'s are: ``kernels/_fp4_cuda.py`` is hashed
into the cost model's fp4 tables, so a change there lands only with a recalibration on the H100 and the H200.
Rows, each a CUDA-graph replay's median over copies of the weight that together take three times L2 (as
bench_fp4): bf16 cuBLAS; the default config; the as-built ring at each tried config; the variant at the same.
Every fp4 row's output is checked against the default's (relative error).
"""

from __future__ import annotations

import torch

from kpt_compiler.kernels import _fp4_cuda

from ._fp4_diag import NT_COMMENT, Rows, arguments, build, edited, has_xw, launch, sm90_registers, warps_an_sm

AS_BUILT = _fp4_cuda.SOURCE

def _apply(s: str, edits: list) -> str:
    return edited(s, edits, "diag_fp4_xring")


def chunk_from_shared(name: str = "chunk_mma_sh", targs: str = "int NT, int TILE, int STEP",
                      params: str = "unsigned xs", first: str = "xs + nt * TILE",
                      after: str = "xs + nt * TILE + (j + 1) * STEP") -> str:
    """The as-built ``chunk_mma``, with x read from shared memory one 16-byte step ahead of its MMAs instead of from
    registers: by default ``chunk_mma_sh<NT, TILE, STEP>(..., xs)`` reads token tile nt's step j at xs + nt TILE +
    j STEP (the ring's x: 2048 and 512; x whole at M=1: 0 and 16); ``first`` and ``after`` are the addresses of
    step 0 and of step j + 1 for another layout. Derived from the kernel's own text, so the decode is its."""
    start = AS_BUILT.index("template <int NT>\n__device__ __forceinline__ void chunk_mma(")
    fn = AS_BUILT[start:AS_BUILT.index("\n}\n", start) + 3]
    return _apply(fn, [
        ("template <int NT>\n",
         f"// chunk_mma with x from shared memory (benchmarks/diag_fp4_x*)\ntemplate <{targs}>\n"),
        ("void chunk_mma(", f"void {name}("),
        ("const uint4 (&xv)[NT][4]) {\n",
         f"{params}) {{\n  uint4 xv[2][NT];\n#pragma unroll\n"
         f"  for (int nt = 0; nt < NT; ++nt) xv[0][nt] = load_shared({first});\n"),
        ("  for (int j = 0; j < 4; ++j) {\n",
         "  for (int j = 0; j < 4; ++j) {\n    if (j < 3) {\n#pragma unroll\n"
         f"      for (int nt = 0; nt < NT; ++nt) xv[(j + 1) & 1][nt] = load_shared({after});\n"
         "    }\n"),
        ("const uint4 v = xv[nt][j];", "const uint4 v = xv[j & 1][nt];"),
    ])


# (old, new) pairs applied once each to the kernel as built
EDITS = [
    (NT_COMMENT, "\n" + chunk_from_shared() + NT_COMMENT),
    ("  const unsigned ring = shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64 + lane);\n",
     "  const unsigned ring = shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64 + lane);\n"
     "  // ASYNC 2: x's ring after every warp's weights: DEPTH chunks a warp, [slot][token tile][step][lane]\n"
     "  const unsigned xring = shared_address(ring_all + RW * WK * DEPTH * RT * 64 + (threadIdx.x >> 5) * DEPTH * NT"
     " * 128 + lane);\n"),
    ("  }                                                                                            \\\n"
     "  if (ASYNC) cp_async_commit();",
     "    if (ASYNC == 2) {                                                                          \\\n"
     "      _Pragma(\"unroll\") for (int nt = 0; nt < NT; ++nt)                                        \\\n"
     "        _Pragma(\"unroll\") for (int q = 0; q < 4; ++q)                                          \\\n"
     "          cp_async16(xring + (((slot) * NT + nt) * 4 + q) * 512, x_row[nt] + 16 * WK * (P) + q); \\\n"
     "    }                                                                                          \\\n"
     "  }                                                                                            \\\n"
     "  if (ASYNC) cp_async_commit();"),
    ("#define LOAD_X(slot, P)                                                                        \\\n"
     "  if (",
     "#define LOAD_X(slot, P)                                                                        \\\n"
     "  if (ASYNC != 2 && "),
    ("          if (ASYNC)\n            chunk_mma<NT>(",
     "          if (ASYNC == 2)\n"
     "            chunk_mma_sh<NT, 2048, 512>(acc[rt], load_shared(ring + (p * RT + rt) * 1024),\n"
     "                             load_shared(ring + (p * RT + rt) * 1024 + 512), sb[p][rt][0], sb[p][rt][1],\n"
     "                             xring + p * NT * 2048);\n"
     "          else if (ASYNC)\n            chunk_mma<NT>("),
]


CALL_AS_BUILT = ("          if (ASYNC)\n            chunk_mma<NT>(acc[rt], load_shared(ring + (p * RT + rt) * 1024),\n"
                 "                          load_shared(ring + (p * RT + rt) * 1024 + 512), sb[p][rt][0], sb[p][rt][1],"
                 " xb[p % 2]);\n")
# x whole in shared memory (M=1), staged once a block by plain loads: XW=1, a seventh template argument
EDITS_XW = [
    (NT_COMMENT, "\n" + chunk_from_shared() + NT_COMMENT),
    ("template <int NT, int RW, int WK, int DEPTH, int ASYNC, int RT>\n__global__",
     "template <int NT, int RW, int WK, int DEPTH, int ASYNC, int RT, int XW = 0>\n__global__"),
    ("  const unsigned ring = shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64 + lane);\n",
     "  const unsigned ring = shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64 + lane);\n"
     "  uint4 *const x_all = ring_all + (ASYNC ? RW * WK * DEPTH * RT * 64 : 0);  // XW: x after the ring\n"
     "  const unsigned xw = shared_address(x_all) + 64 * t;\n"),
    ("#define LOAD_X(slot, P)                                                                        \\\n"
     "  if (i0 + (P) < count) {",
     "#define LOAD_X(slot, P)                                                                        \\\n"
     "  if (!XW && i0 + (P) < count) {"),
    ("  LOAD_X(0, 0)\n",
     "  if (XW) {  // x's one row into shared memory, once a block, the first weights' loads in flight\n"
     "    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) x_all[i] = load_cached((const uint4 *)x + i);\n"
     "    __syncthreads();\n"
     "  }\n"
     "  LOAD_X(0, 0)\n"),
    (CALL_AS_BUILT,
     "          if constexpr (XW) {  // not instantiated without XW: x whole is one token's\n"
     "            const unsigned xa = xw + (first + WK * (i0 + p)) * 256;\n"
     "            if (ASYNC)\n"
     "              chunk_mma_sh<NT, 0, 16>(acc[rt], load_shared(ring + (p * RT + rt) * 1024),\n"
     "                               load_shared(ring + (p * RT + rt) * 1024 + 512), sb[p][rt][0], sb[p][rt][1], xa);\n"
     "            else\n"
     "              chunk_mma_sh<NT, 0, 16>(acc[rt], wb[p][rt][0], wb[p][rt][1], sb[p][rt][0], sb[p][rt][1], xa);\n"
     "          } else\n" + CALL_AS_BUILT),
]


# A bound, not a kernel (its outputs are wrong): every chunk a warp decodes reads x's bytes of the warp's first chunk,
# so x comes from L1 after the first chunk where the as-built kernel reads a new 4 KB of it (M=16) from L2 each chunk.
# At M=16 and 4096x14336 the 128 blocks of the default read x from L2 once each, 59 MB against 33 MB of weights
# (s42's reading; s43's row groups over a split of K, which cut it, were not faster on an H200): the time this saves
# is what x's L2 traffic costs, with every other instruction as built.
EDITS_X_PINNED = [
    ("xb[slot][nt][q] = load_cached(x_row[nt] + 16 * WK * (P) + q);",
     "xb[slot][nt][q] = load_cached(x_row[nt] + q);  /* pinned */"),
    ("    for (int nt = 0; nt < NT; ++nt) x_row[nt] += 16 * WK * DEPTH;\n", "\n"),
]


def _edited(edits: list) -> str:
    return _apply(AS_BUILT, edits)


def xw_source() -> str:
    """The kernel with XW, as built where it has it already, else with EDITS_XW applied."""
    return AS_BUILT if has_xw(AS_BUILT) else _edited(EDITS_XW)


def variant_source() -> str:
    return _edited(EDITS)


def shared_bytes(cfg: dict) -> int:
    """Dynamic shared memory: the weights' ring, and at async=2 x's (DEPTH chunks of NT token tiles a warp)."""
    warps = cfg["rw"] * cfg["wk"]
    ring = _fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], 1, cfg.get("rt", 1))
    return ring + (warps * cfg["depth"] * cfg["nt"] * 2048 if cfg["async"] == 2 else 0)


_BUILT: dict = {}


def _run(name: str, source, x2: torch.Tensor, q, cfg: dict, asynchronous: int, shared: int, xw: int = 0):
    """``fp4_linear_cuda``'s launch (split 1) of a variant of the kernel at ``cfg``: ``source()`` built once per
    config and variant ``name``, with ``shared`` bytes of dynamic shared memory."""
    key = (_fp4_cuda._key(cfg, 0), name)
    if key not in _BUILT:
        _BUILT[key] = build(source(), f"fp4_mma_sync<{cfg['nt']}, {cfg['rw']}, {cfg['wk']}, {cfg['depth']}, "
                            f"{asynchronous}, {cfg.get('rt', 1)}" + (", 1>" if xw else ">"), cfg, shared)
    return launch(_BUILT[key], x2, q, cfg, shared)


def _ring(cfg: dict) -> int:
    return _fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], int(cfg.get("async", False)), cfg.get("rt", 1))


def fp4_xring(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """The x-through-the-ring variant (ASYNC=2)."""
    return _run("x ring", variant_source, x2, q, cfg, 2, shared_bytes(cfg))


def fp4_xw(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """The x-whole-in-shared-memory variant (M=1): ``cfg``'s ring or register form, XW=1."""
    assert x2.shape[0] == 1, "x whole in shared memory: M=1 only"
    return _run("xw", xw_source, x2, q, cfg, int(cfg["async"]), _ring(cfg) + 2 * x2.shape[1], xw=1)


def x_pinned(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """The as-built kernel at ``cfg`` with x's reads pinned to each warp's first chunk (EDITS_X_PINNED)."""
    return _run("x pinned", lambda: _edited(EDITS_X_PINNED), x2, q, cfg, int(cfg.get("async", False)), _ring(cfg))


def configs(m: int, variants: tuple = (1, 2)) -> list[dict]:
    nt = 1 if m <= 8 else 2
    rts = (1,) if m <= 8 else (1, 2)
    return [dict(cuda=True, nt=nt, rw=1, wk=wk, depth=depth, split_k=1, rt=rt, **{"async": a})
            for rt in rts for wk in (8, 12, 16) for depth in (2, 4) for a in variants]


def xw_configs() -> list[dict]:
    """The --xw configs at M=1: register form and ring, 8/12/16 warps along K, 2 and 4 chunks in flight."""
    return [dict(cuda=True, nt=1, rw=1, wk=wk, depth=depth, split_k=1, rt=1, **{"async": a})
            for wk in (8, 12, 16) for depth in (2, 4) for a in (0, 1)]


def registers(cfg: dict, xw: bool = False) -> int:
    """ptxas's registers for sm_90 (nvcc on PATH) of a variant's build of ``cfg`` (the XW one with ``xw``)."""
    targs = f"{cfg['nt']}, {cfg['rw']}, {cfg['wk']}, {cfg['depth']}, {int(cfg['async'])}, {cfg['rt']}" + (
        ", 1" if xw else "")
    return sm90_registers(xw_source() if xw else variant_source(), targs)


def main() -> None:
    p = arguments(__doc__, "1,16")
    p.add_argument("--as-built", action="store_true", help="the as-built ring only (async=1), not the variant")
    p.add_argument("--xw", action="store_true", help="M=1: x whole in shared memory (register form and ring), "
                   "beside the as-built ring")
    p.add_argument("--x-pinned", action="store_true", help="each M's default and the as-built ring at 8, 12 and 16 "
                   "warps along K, beside the same with x's reads kept in L1 (a bound: wrong outputs)")
    args = p.parse_args()
    variants = (1,) if args.as_built else (1, 2)
    if args.registers:  # shared KB: dynamic and static, at --shape's K for XW
        k = int(args.shape.split("x")[1])
        print("| M | config (nt, rw, wk, depth, async, rt) | registers | warps an SM (registers, shared memory) | "
              "shared KB |\n| --- | --- | --- | --- | --- |")
        rows = [(1, c, True) for c in xw_configs()] if args.xw else [
            (m, c, False) for m in (int(v) for v in args.ms.split(",")) for c in configs(m, variants)]
        for m, c, xw in rows:
            r = registers(c, xw)
            shared = (_ring(c) + 2 * k if xw else shared_bytes(c)) + _fp4_cuda.static_bytes(c["nt"], c["rw"],
                                                                                           c["wk"], c["rt"])
            print(f"| {m} | {(c['nt'], c['rw'], c['wk'], c['depth'], c['async'], c['rt'])}{' XW' if xw else ''} | "
                  f"{r} | {warps_an_sm(r, c['rw'] * c['wk'], shared)} | {shared / 1024:.0f} |")
        return
    t = Rows(*(int(v) for v in args.shape.split("x")), args.rep_ms)
    for m, x, ref in t.each_m(args.ms):
        if args.x_pinned:
            pick = {k: v for k, v in _fp4_cuda.config(m, t.n, t.k, t.sms).items() if k != "split_k"}
            for cfg in [dict(pick, split_k=1)] + [c for c in configs(m, (1,)) if c["depth"] == 2]:
                tag = "default" if cfg == dict(pick, split_k=1) else (
                    f"rt={cfg['rt']} wk={cfg['wk']} depth={cfg['depth']} ring")
                t.row(m, f"{tag}, as built", lambda q, c=cfg: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales,
                                                                                     q.global_scale, c), ref)
                t.row(m, f"{tag}, x pinned (a bound)", lambda q, c=cfg: x_pinned(x, q, c), None)
            continue
        if args.xw:
            for cfg in xw_configs():
                tag = f"wk={cfg['wk']} depth={cfg['depth']} {'ring' if cfg['async'] else 'register form'}"
                t.row(m, f"{tag}, as built", lambda q, c=cfg: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales,
                                                                                     q.global_scale, c), ref)
                t.row(m, f"{tag}, x whole in shared memory", lambda q, c=cfg: fp4_xw(x, q, c), ref)
            continue
        for cfg in configs(m, variants):
            tag = f"rt={cfg['rt']} wk={cfg['wk']} depth={cfg['depth']} async={cfg['async']}"
            if cfg["async"] == 2:
                t.row(m, f"{tag} (x in the ring)", lambda q, c=cfg: fp4_xring(x, q, c), ref)
            else:
                t.row(m, tag, lambda q, c=cfg: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales, q.global_scale, c),
                      ref)
    t.finish(None if args.xw or args.x_pinned else 14, args.out)


if __name__ == "__main__":
    main()
