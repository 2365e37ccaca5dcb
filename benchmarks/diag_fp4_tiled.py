"""The fp4 CUDA form reading a tiled weight: each 16-row tile's 64 bytes a chunk (16 x 64 bytes) contiguous, so that
one load instruction of a warp reads 512 contiguous bytes where the row-major weight gives it 8 rows' 64 bytes, 7 KB
apart at 4096x14336 (issue 18: 3x bf16 at M=1 and M=16 on the H100).

    python -m benchmarks.diag_fp4_tiled [--shape 4096x14336] [--ms 1,16] [--rep-ms 30] [--out FILE]
    python -m benchmarks.diag_fp4_tiled --registers   (no GPU: nvcc's registers for sm_90 of each config)

Why (s48, written with no device time left, not yet run): s45's loads-only pattern on an H100
(``benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-07-s45-diag-fp4-pattern-call4-run1-99db000.txt``, docs/fp4-cuda-
kernel.md, "What the H100 can read") read the 33 MB of 4096x14336 in 11.80-12.27 us at 16 warps along K as the
kernel lays its loads out, and in 11.20-11.23 us with this tiling; the kernel at its best takes 14.7 us at M=1 and
17.7 at M=16 (s48), and 3x bf16 needs about 13.9 and 14.6. The scales stay row-major (2 bytes a lane a chunk).

The weight is repacked once, outside the timing: rows padded to a multiple of 16 (rows past N are never stored),
then [row tile][chunk][16 rows][16 words]. The variant changes the kernel's weight pointers only: row r's chunk c
lies at word ((r >> 4) * chunks + c) * 256 + (r & 15) * 16, and a chunk step is 256 words instead of 16. Rows: bf16
cuBLAS, the default, and at each config the kernel as built and the variant; every output checked against the
default's. A kernel-source variant, as the other diag_fp4_* are: landing it would mean the fp4 format's packing
(kpt_compiler/kernels/_fp4_format.py, the Triton forms read it too) and a recalibration on both cards.
"""

from __future__ import annotations

import types

import torch

from kpt_compiler.kernels import _fp4_cuda

from ._fp4_diag import Rows, arguments, build, edited, launch, sm90_registers, warps_an_sm

AS_BUILT = _fp4_cuda.SOURCE
TILE_ROWS, CHUNK_WORDS = 16, 16  # a tile: 16 rows x one chunk's 16 int32 words (128 fp4 codes) each

EDITS = [
    ("    w_lo[rt] = w + c_lo * stride_wn + 4 * t + 16 * first;\n"
     "    w_hi[rt] = w + c_hi * stride_wn + 4 * t + 16 * first;\n",
     "    w_lo[rt] = w + ((c_lo >> 4) * nchunks + first) * 256 + (c_lo & 15) * 16 + 4 * t;  // tiled\n"
     "    w_hi[rt] = w + ((c_hi >> 4) * nchunks + first) * 256 + (c_hi & 15) * 16 + 4 * t;\n"),
    ("        cp_async16(ring + ((slot) * RT + rt) * 1024, w_lo[rt] + 16 * WK * (P));                \\\n"
     "        cp_async16(ring + ((slot) * RT + rt) * 1024 + 512, w_hi[rt] + 16 * WK * (P));          \\\n",
     "        cp_async16(ring + ((slot) * RT + rt) * 1024, w_lo[rt] + 256 * WK * (P));               \\\n"
     "        cp_async16(ring + ((slot) * RT + rt) * 1024 + 512, w_hi[rt] + 256 * WK * (P));         \\\n"),
    ("        wb[slot][rt][0] = load_stream(w_lo[rt] + 16 * WK * (P));                               \\\n"
     "        wb[slot][rt][1] = load_stream(w_hi[rt] + 16 * WK * (P));                               \\\n",
     "        wb[slot][rt][0] = load_stream(w_lo[rt] + 256 * WK * (P));                              \\\n"
     "        wb[slot][rt][1] = load_stream(w_hi[rt] + 256 * WK * (P));                              \\\n"),
    ("      w_lo[rt] += 16 * WK * DEPTH;\n      w_hi[rt] += 16 * WK * DEPTH;\n",
     "      w_lo[rt] += 256 * WK * DEPTH;\n      w_hi[rt] += 256 * WK * DEPTH;\n"),
]


def source() -> str:
    return edited(AS_BUILT, EDITS, "diag_fp4_tiled")


def tiled(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` [N, K/2] uint8 (row-major NVFP4 codes) as the variant reads it: rows padded with zeros to a multiple
    of 16, then [row tile][chunk][16 rows][16 words], returned as an [N, K/2] uint8 view of that memory (its first
    dimension is what the launch counts as N; its strides mean nothing to the variant)."""
    n, half = packed.shape
    words = packed.contiguous().view(torch.int32)  # [N, K/8]
    pad = -n % TILE_ROWS
    if pad:
        words = torch.cat([words, words.new_zeros(pad, words.shape[1])])
    chunks = words.shape[1] // CHUNK_WORDS
    t = words.reshape(-1, TILE_ROWS, chunks, CHUNK_WORDS).permute(0, 2, 1, 3).contiguous()
    return t.view(torch.uint8).reshape(-1, half)[:n]


def word_at(r: int, c: int, t: int, chunks: int) -> int:
    """The int32 word the variant's lane t reads first for row r, chunk c (the C expression above, in Python)."""
    return ((r >> 4) * chunks + c) * 256 + (r & 15) * 16 + 4 * t


_BUILT: dict = {}
_TILED: dict = {}


def _dynamic(cfg: dict) -> int:
    return _fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], int(cfg["async"]), cfg["rt"], cfg["nt"])


def fp4_tiled(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """The variant at ``cfg`` on ``q``'s weight, repacked once (kept by ``q``'s identity)."""
    key = _fp4_cuda._key(cfg, 0)[:-1]
    if key not in _BUILT:
        _BUILT[key] = build(source(), f"fp4_mma_sync<{', '.join(str(v) for v in key)}>", cfg, _dynamic(cfg))
    if id(q) not in _TILED:
        _TILED[id(q)] = (q, types.SimpleNamespace(packed=tiled(q.packed), scales=q.scales, global_scale=q.global_scale))
    return launch(_BUILT[key], x2, _TILED[id(q)][1], cfg, _dynamic(cfg))


def configs(m: int) -> list[dict]:
    """M <= 8: the M=1 pick (the ring, 12 warps along K), the register pipeline at 8 and 16 warps; M = 9-16: the
    pick (x through the ring, 12 warps, 2 row tiles a warp) and the ring with x in registers at 8 and 12 warps."""
    if m <= 8:
        rows = [(12, 1, True), (8, 1, False), (16, 1, False), (16, 1, True)]
        return [dict(cuda=True, nt=1, rw=1, wk=wk, depth=2, split_k=1, rt=rt, **{"async": a}) for wk, rt, a in rows]
    rows = [(12, 2, 2), (12, 2, True), (8, 2, True)]
    return [dict(cuda=True, nt=2, rw=1, wk=wk, depth=2, split_k=1, rt=rt, **{"async": a}) for wk, rt, a in rows]


def _name(cfg: dict) -> str:
    form = {0: "register form", 1: "ring", 2: "ring, x through it"}[int(cfg["async"])]
    return f"rt={cfg['rt']} wk={cfg['wk']} depth={cfg['depth']} {form}"


def main() -> None:
    p = arguments(__doc__, "1,16")
    args = p.parse_args()
    if args.registers:
        print("| M | config (nt, rw, wk, depth, async, rt) | registers as built | tiled | warps an SM (tiled) |\n"
              "| --- | --- | --- | --- | --- |")
        for m in (int(v) for v in args.ms.split(",")):
            for c in configs(m):
                targs = ", ".join(str(v) for v in _fp4_cuda._key(c, 0)[:-1])
                r0, r = sm90_registers(AS_BUILT, targs), sm90_registers(source(), targs)
                shared = _dynamic(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"], c["rt"])
                print(f"| {m} | ({targs}) | {r0} | {r} | {warps_an_sm(r, c['rw'] * c['wk'], shared)} |")
        return
    t = Rows(*(int(v) for v in args.shape.split("x")), args.rep_ms)
    for m, x, ref in t.each_m(args.ms):
        for cfg in configs(m):
            t.row(m, f"{_name(cfg)}, as built",
                  lambda q, c=cfg: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales, q.global_scale, c), ref)
            t.row(m, f"{_name(cfg)}, tiled weight", lambda q, c=cfg: fp4_tiled(x, q, c), ref)
    t.finish(None, args.out)


if __name__ == "__main__":
    main()
