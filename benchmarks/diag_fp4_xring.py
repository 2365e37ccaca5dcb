"""Where x lies for the fp4 CUDA form's ring (issue 18: M=16 and M=1 at 4096x14336): in registers, loaded a chunk
ahead (``async=True``), or copied whole through the cp.async ring beside the weights (``async=2``, the kernel's
own since s48); and a bound on what x's L2 traffic costs.

    python -m benchmarks.diag_fp4_xring [--shape 4096x14336] [--ms 1,16] [--rep-ms 30] [--out FILE]
    python -m benchmarks.diag_fp4_xring --registers      (no GPU: nvcc's registers for sm_90 of each config)
    python -m benchmarks.diag_fp4_xring --as-built       (x in registers only, beside the default)
    python -m benchmarks.diag_fp4_xring --x-pinned       (a bound, not a kernel: x's reads kept in L1)

The reading behind it (s45, from s32's ncu profile of the M=16 default on an H200,
``benchmarks/results/nvidia-h200/2026-11-29-s32-fp4-ncu-cuda-b4ce997.txt``): 2 warps a scheduler (167 registers:
one block of 8 warps an SM), 0.48 of them eligible, 41% of the cycles between two instructions stalled on a global
load, x's (one chunk ahead into two register buffers: 64 registers at two token tiles) or the scales'. With x in
the ring the kernel takes 128 registers at M=16 (12 warps along K) and x's loads are as far ahead as the weights'.

History of the variants (their code is at commit 67c81e7, ``git show 67c81e7:benchmarks/diag_fp4_xring.py`` and
``diag_fp4_xcopy.py``): s45's first x ring, each lane copying its own 64 bytes, was right and 2.5-8x slower
(``benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-07-s45-diag-fp4-xring-call1-288ccd0.txt``); s47's copies of
x whole and coalesced, read back from a swizzled layout, were 2.41x bf16 at M=16 against 2.18x for the ring of x
in registers (s48, one H100), and became ``async=2``; s46's x whole in shared memory at M=1 (the fp4-xw branch)
was not faster than the as-built ring at 12 warps along K (s48, one H100) and was dropped. docs/fp4-cuda-kernel.md
has the tables.

Rows, each a CUDA-graph replay's median over copies of the weight that together take three times L2 (as
bench_fp4): bf16 cuBLAS; the default config; the ring at each tried config with x in registers and through the
ring. Every fp4 row's output is checked against the default's (relative error).
"""

from __future__ import annotations

import torch

from kpt_compiler.kernels import _fp4_cuda

from ._fp4_diag import Rows, arguments, build, edited, launch, sm90_registers, warps_an_sm

AS_BUILT = _fp4_cuda.SOURCE


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


def pinned_source() -> str:
    return edited(AS_BUILT, EDITS_X_PINNED, "diag_fp4_xring")


def shared_bytes(cfg: dict) -> int:
    """Dynamic shared memory: the weights' ring, and at async=2 x's (DEPTH chunks of NT token tiles a warp)."""
    return _fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], int(cfg.get("async", False)), cfg.get("rt", 1),
                                cfg["nt"])


_BUILT: dict = {}


def x_pinned(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """The as-built kernel at ``cfg`` with x's reads pinned to each warp's first chunk (EDITS_X_PINNED)."""
    key = _fp4_cuda._key(cfg, 0)
    if key not in _BUILT:
        _BUILT[key] = build(pinned_source(), f"fp4_mma_sync<{', '.join(str(v) for v in key[:-1])}>", cfg,
                            shared_bytes(cfg))
    return launch(_BUILT[key], x2, q, cfg, shared_bytes(cfg))


def configs(m: int, variants: tuple = (1, 2)) -> list[dict]:
    """The ring at 1 or 2 row tiles a warp (1 at M <= 8), 8/12/16 warps along K, 2 or 4 chunks in flight, x in
    registers (async 1) or through the ring (async 2), where the block's shared memory fits (227 KB)."""
    nt = 1 if m <= 8 else 2
    rts = (1,) if m <= 8 else (1, 2)
    every = [dict(cuda=True, nt=nt, rw=1, wk=wk, depth=depth, split_k=1, rt=rt, **{"async": a})
             for rt in rts for wk in (8, 12, 16) for depth in (2, 4) for a in variants]
    return [c for c in every if shared_bytes(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"], c["rt"])
            <= 227 * 1024]


def _run(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    return _fp4_cuda.fp4_linear_cuda(x2, q.packed, q.scales, q.global_scale, cfg)


def main() -> None:
    p = arguments(__doc__, "1,16")
    p.add_argument("--as-built", action="store_true", help="x in registers only (async=1), not through the ring")
    p.add_argument("--x-pinned", action="store_true", help="each M's default and the ring at 8, 12 and 16 warps "
                   "along K, beside the same with x's reads kept in L1 (a bound: wrong outputs)")
    args = p.parse_args()
    variants = (1,) if args.as_built else (1, 2)
    if args.registers:
        print("| M | config (nt, rw, wk, depth, async, rt) | registers | warps an SM (registers, shared memory) | "
              "shared KB |\n| --- | --- | --- | --- | --- |")
        for m in (int(v) for v in args.ms.split(",")):
            for c in configs(m, variants):
                key = _fp4_cuda._key(c, 0)[:-1]
                r = sm90_registers(AS_BUILT, ", ".join(str(v) for v in key))
                shared = shared_bytes(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"], c["rt"])
                print(f"| {m} | {key} | {r} | {warps_an_sm(r, c['rw'] * c['wk'], shared)} | {shared / 1024:.0f} |")
        return
    t = Rows(*(int(v) for v in args.shape.split("x")), args.rep_ms)
    for m, x, ref in t.each_m(args.ms):
        if args.x_pinned:
            pick = {k: v for k, v in _fp4_cuda.config(m, t.n, t.k, t.sms).items() if k != "split_k"}
            for cfg in [dict(pick, split_k=1)] + [c for c in configs(m, (1,)) if c["depth"] == 2]:
                tag = "default" if cfg == dict(pick, split_k=1) else (
                    f"rt={cfg['rt']} wk={cfg['wk']} depth={cfg['depth']} ring")
                t.row(m, f"{tag}, as built", lambda q, c=cfg: _run(x, q, c), ref)
                if cfg["async"] != 2:  # x through the ring has no register loads for the edit to pin
                    t.row(m, f"{tag}, x pinned (a bound)", lambda q, c=cfg: x_pinned(x, q, c), None)
            continue
        for cfg in configs(m, variants):
            where = "x through the ring" if cfg["async"] == 2 else "x in registers"
            t.row(m, f"rt={cfg['rt']} wk={cfg['wk']} depth={cfg['depth']}, {where}", lambda q, c=cfg: _run(x, q, c),
                  ref)
    t.finish(None if args.x_pinned else 14, args.out)


if __name__ == "__main__":
    main()
