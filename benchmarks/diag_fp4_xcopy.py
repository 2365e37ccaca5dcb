"""x through the cp.async ring as whole chunks, copied coalesced and read back from a swizzled layout, for the fp4
CUDA form (issue 18: M=16 at 4096x14336, where the as-built kernel's 167 registers leave 8 warps an SM).

    python -m benchmarks.diag_fp4_xcopy [--shape 4096x14336] [--ms 16,1] [--rep-ms 30] [--out FILE]
    python -m benchmarks.diag_fp4_xcopy --registers   (no GPU: nvcc's registers for sm_90 of each config)

Why another x ring (s47, written with no GPU, not yet run): ``diag_fp4_xring``'s variant put x in the ring with
fewer registers (102-106 at M=16, 16 warps along K) and was 2.5-8x slower, unexplained. In it each lane copied
the 64 bytes it reads itself, 16 at a time (``cp.async.cg``: L2 only). Our reading of that, not measured: one
copy instruction of a warp touches 32 sectors half each, and with L1 bypassed the other half is fetched again by
the next instruction, so x's L2 traffic doubles where it is already 1.8 times the weights' at M=16; at M=1 eight
lanes copy the same 16 bytes, each its own copy. Here a warp copies its chunk of x as the bytes lie in memory:
copy i of lane l moves 16-byte unit l % 16 of token 2 i + l / 16, so one instruction reads two tokens' 256
contiguous bytes, and tokens past M are not copied (at M=1 half a warp copies 256 bytes). Since a lane now reads
bytes that other lanes copied, the warp synchronizes (``__syncwarp``) after the chunk's copies land and before a
slot is copied over. Each token's 16 units are stored swizzled, unit u at u ^ 2 (u >> 3) ^ (token & 1), so that
the 8 lanes of a phase reading one step of two tokens hit 8 different groups of banks (a lane's 64 bytes stay
together; it reads its step j at j ^ c, c from its lane and token).

Rows: bf16 cuBLAS, the default, the as-built ring and this variant at the same configs (1 or 2 row tiles a warp,
8/12/16 warps along K, 2 or 4 chunks in flight); every row's output checked against the default's.
"""

from __future__ import annotations


import torch

from kpt_compiler.kernels import _fp4_cuda

from . import diag_fp4_xring as xring
from ._fp4_diag import (NT_COMMENT, SM_SHARED, Rows, arguments, build, edited, has_xw, launch, sm90_registers,
                         warps_an_sm)


CP_ASYNC_CA = r"""
__device__ __forceinline__ void cp_async16_ca(unsigned a, const void *gmem) {  // x through L1 too (diag_fp4_xcopy)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(a), "l"(gmem) : "memory");
}
"""


def chunk_fn() -> str:
    return xring.chunk_from_shared("chunk_mma_shx", "int NT", "const unsigned (&xa)[NT], const unsigned (&xc)[NT], "
                                   "unsigned off", "xa[nt] + off + 16 * xc[nt]",
                                   "xa[nt] + off + 16 * ((j + 1) ^ xc[nt])")


RING_LINE = "  const unsigned ring = shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64 + lane);\n"
X_RING = r"""  // ASYNC 2: x's chunk whole (8 NT tokens x 256 bytes) in DEPTH slots a warp after every warp's weights;
  // copy i of lane l is unit u = l % 16 of token 2 i + l / 16, stored at unit u ^ 2 (u >> 3) ^ (token & 1) of the
  // token's 256 bytes (8 lanes reading one step of two tokens then hit 8 groups of banks)
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
"""
COPY = (
    "    if (ASYNC == 2) {                                                                          \\\n"
    "      _Pragma(\"unroll\") for (int i = 0; i < NT * 4; ++i)                                       \\\n"
    "        if (2 * i + (lane >> 4) < M)                                                           \\\n"
    "          cp_async16(xdst + (slot) * NT * 2048 + i * 512,                                      \\\n"
    "                     xsrc + 2 * i * stride_xm + 128 * WK * (i0 + (P)));                        \\\n"
    "    }                                                                                          \\\n")
COMMIT = ("  }                                                                                            \\\n"
          "  if (ASYNC) cp_async_commit();")
LOAD_X = ("#define LOAD_X(slot, P)                                                                        \\\n"
          "  if (")
CALL = "          if (ASYNC)\n            chunk_mma<NT>("

EDITS = [
    (NT_COMMENT, "\n" + chunk_fn() + NT_COMMENT),
    (RING_LINE, RING_LINE + X_RING),
    (COMMIT, COPY + COMMIT),
    (LOAD_X, LOAD_X + "ASYNC != 2 && "),
    # a lane reads other lanes' copies: the warp meets after the copies land and before a slot is copied over
    ("        if (ASYNC) cp_async_wait<DEPTH - 1>();  // this chunk's group has landed: at most DEPTH - 1 pending\n",
     "        if (ASYNC) cp_async_wait<DEPTH - 1>();  // this chunk's group has landed: at most DEPTH - 1 pending\n"
     "        if (ASYNC == 2) __syncwarp();  // and every lane's copies with it\n"),
    ("        LOAD_W((p + DEPTH - 1) % DEPTH, p + DEPTH - 1)\n",
     "        if (ASYNC == 2) __syncwarp();  // every lane has read the slot that these copies overwrite\n"
     "        LOAD_W((p + DEPTH - 1) % DEPTH, p + DEPTH - 1)\n"),
    (CALL,
     "          if (ASYNC == 2)\n"
     "            chunk_mma_shx<NT>(acc[rt], load_shared(ring + (p * RT + rt) * 1024),\n"
     "                              load_shared(ring + (p * RT + rt) * 1024 + 512), sb[p][rt][0], sb[p][rt][1],\n"
     "                              xa, xc, p * NT * 2048);\n"
     "          else if (ASYNC)\n            chunk_mma<NT>("),
]


def source(ca: bool = False) -> str:
    """The variant; with ``ca`` x's copies go through L1 (``cp.async.ca``: blocks on one SM share x there, as the
    as-built loads do), else L2 only (``.cg``, as the weights')."""
    edits = [(a, b.replace("cp_async16(", "cp_async16_ca(")) if a == COMMIT and ca else (a, b) for a, b in EDITS]
    if ca:
        edits[0] = (NT_COMMENT, "\n" + CP_ASYNC_CA + chunk_fn() + NT_COMMENT)
    return edited(xring.AS_BUILT, edits, "diag_fp4_xcopy")


def _targs(cfg: dict) -> str:  # ASYNC 2 is the variant; XW 0 where the kernel has it (the fp4-xw branch)
    return (f"{cfg['nt']}, {cfg['rw']}, {cfg['wk']}, {cfg['depth']}, 2, {cfg['rt']}"
            + (", 0" if has_xw(xring.AS_BUILT) else ""))


_BUILT: dict = {}


def _dynamic(cfg: dict) -> int:
    return xring.shared_bytes(dict(cfg, **{"async": 2}))


def configs(m: int) -> list[dict]:
    """diag_fp4_xring's configs (1 or 2 row tiles a warp, 8/12/16 warps along K, 2 or 4 chunks in flight) whose
    shared memory fits a block (227 KB)."""
    return [c for c in xring.configs(m, (1,)) if _dynamic(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"],
                                                                                      c["rt"]) <= SM_SHARED - 1024]


def fp4_xcopy(x2: torch.Tensor, q, cfg: dict, ca: bool = False) -> torch.Tensor:
    key = (_targs(cfg), ca)
    if key not in _BUILT:
        _BUILT[key] = build(source(ca), f"fp4_mma_sync<{key[0]}>", cfg, _dynamic(cfg))
    return launch(_BUILT[key], x2, q, cfg, _dynamic(cfg))


def main() -> None:
    p = arguments(__doc__, "16,1")
    args = p.parse_args()
    if args.registers:
        print("| M | config (nt, rw, wk, depth, rt) | registers | warps an SM (registers, shared memory) | shared KB |"
              "\n| --- | --- | --- | --- | --- |")
        for m in (int(v) for v in args.ms.split(",")):
            for c in configs(m):
                r = sm90_registers(source(), _targs(c))
                shared = _dynamic(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"], c["rt"])
                print(f"| {m} | {(c['nt'], c['rw'], c['wk'], c['depth'], c['rt'])} | {r} | "
                      f"{warps_an_sm(r, c['rw'] * c['wk'], shared)} | {shared / 1024:.0f} |")
        return
    t = Rows(*(int(v) for v in args.shape.split("x")), args.rep_ms)
    for m, x, ref in t.each_m(args.ms):
        for cfg in configs(m):
            tag = f"rt={cfg['rt']} wk={cfg['wk']} depth={cfg['depth']}"
            t.row(m, f"{tag} ring, as built", lambda q, c=cfg: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales,
                                                                                      q.global_scale, c), ref)
            t.row(m, f"{tag} ring, x copied whole (L2)", lambda q, c=cfg: fp4_xcopy(x, q, c), ref)
            if cfg["depth"] == 2:
                t.row(m, f"{tag} ring, x copied whole (L1)", lambda q, c=cfg: fp4_xcopy(x, q, c, ca=True), ref)
    t.finish(None, args.out)


if __name__ == "__main__":
    main()
