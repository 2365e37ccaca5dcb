"""The fp4 CUDA form's ring copying runs of RUN chunks of a row (RUN x 64 contiguous bytes) instead of one chunk's
64 bytes of each of 8 rows, the weight's format unchanged (issue 18: 3x bf16 at M=1 and M=16 on the H100).

    python -m benchmarks.diag_fp4_runs [--shape 4096x14336] [--ms 1,16] [--rep-ms 30] [--out FILE]
    python -m benchmarks.diag_fp4_runs --registers   (no GPU: nvcc's registers for sm_90 of each config)

Why (s49, written with no device lent, not yet run): s45's loads-only pattern on an H100 read 4096x14336 NVFP4 faster
with the weight tiled (one load instruction: 512 contiguous bytes, 11.20-11.83 us at 8-16 warps along K) than laid
out as the kernel reads it (8 rows' 64 bytes, a row 7 KB apart: 11.87-14.08 us); ``diag_fp4_tiled`` times the kernel
on a repacked weight, which would change the fp4 format that the Triton forms read too. With the cp.async ring
(async 1), where a lane copies from and where the copy lands are free of each other: the lane that reads row g's
16 bytes of a chunk from shared memory need not be the lane that copied them. Here a warp takes its chunks in runs of
RUN (chunks RUN (warp + WK j) + h, h < RUN), and one copy instruction moves 8 / RUN rows' RUN x 64 contiguous bytes
(RUN=2: 4 rows x 128 bytes, whole 128-byte lines), landing each 16 bytes where the as-built layout has them, so the
decode, the scales and x are as built (at the chunk's new place along K). The ring holds two runs (DEPTH = 2 RUN):
run r + 1 is copied at the turn of run r's first chunk, into run r - 1's slots, and a chunk waits for its run's group
(``cp.async.wait_group`` RUN); since lanes read what other lanes copied, the warp meets (``__syncwarp``) after the wait
and before each copy, as the x ring (async 2) does.

A kernel-source variant, as the other diag_fp4_* (the cost model hashes the kernel's source): ``RUN`` a template
argument after the others, async 1 only. Rows: bf16 cuBLAS, the default, and at each config the kernel as built at
depth 2 and at the variant's depth (2 RUN: the same chunks in flight, so that a gain is the runs', not the depth's),
and the variant at RUN 2 and 4; every output checked against the default's.
"""

from __future__ import annotations

import torch

from kpt_compiler.kernels import _fp4_cuda

from ._fp4_diag import Rows, arguments, build, edited, launch, sm90_registers, warps_an_sm

AS_BUILT = _fp4_cuda.SOURCE

SETUP = r"""
  // the runs (RUN chunks of a row, contiguous): the lane's part of each copy. Copy k of a run moves rows
  // k (8 / RUN) + lane / (4 RUN) of the row tile, chunk h = lane % (4 RUN) / 4 of the run, 16 bytes t = lane % 4, to
  // where the as-built ring keeps them (row r's 16 bytes t at lane (r & 7, t), + 512 from row 8)
  const int cp_h = (lane % (4 * RUN)) / 4;
  const u32 *w_run = w + 4 * t + 16 * (first + cp_h);  // + the row, + 16 OFF(P) words
  unsigned cp_dst[2 * RUN];
#pragma unroll
  for (int k = 0; k < 2 * RUN; ++k) {
    const int r = k * (8 / RUN) + lane / (4 * RUN);
    cp_dst[k] = (r >= 8 ? 512 : 0) + ((r & 7) * 4 + t) * 16;
  }
  const unsigned ringw = shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64);
#define CP_ROW(rt, k) ((long long)min(row0 - g + 16 * (rt) + (k) * (8 / RUN) + lane / (4 * RUN), N - 1))
"""

GROUP = (
    "  if ((P) % RUN == RUN - 1) {  /* the run of chunks P - RUN + 1 .. P, for its slots */                \\\n"
    "    _Pragma(\"unroll\") for (int rt = 0; rt < RT; ++rt)                                          \\\n"
    "      _Pragma(\"unroll\") for (int k = 0; k < 2 * RUN; ++k)                                      \\\n"
    "        if (i0 + (P) - (RUN - 1) + cp_h < count)                                               \\\n"
    "          cp_async16(ringw + (((slot) - (RUN - 1) + cp_h) * RT + rt) * 1024 + cp_dst[k],       \\\n"
    "                     w_run + CP_ROW(rt, k) * stride_wn + 16 * OFF((P) - (RUN - 1)));           \\\n"
    "  }                                                                                            \\\n")

EDITS = [
    ("int RT>\n__global__", "int RT, int RUN>\n__global__"),
    ('  static_assert(DEPTH % 2 == 0, "x\'s two buffers alternate with the chunk\'s parity: DEPTH must be even");\n',
     '  static_assert(DEPTH % 2 == 0, "x\'s two buffers alternate with the chunk\'s parity: DEPTH must be even");\n'
     '  static_assert(ASYNC == 1 && DEPTH == 2 * RUN && 8 % RUN == 0, "runs: the ring (async 1), two runs in it");\n'),
    ("  const int first = blockIdx.y * chunks_per_split + warp;\n",
     "  const int first = blockIdx.y * chunks_per_split + RUN * warp;  // chunks first + RUN WK j + h, h < RUN\n"),
    ("  const int count = first < end ? (end - first + WK - 1) / WK : 0;  // this warp's chunks: first + WK i\n",
     "  const int left = end - first, runs = left >= RUN ? (left - RUN) / (RUN * WK) + 1 : 0;  // whole runs\n"
     "  const int tail = left - RUN * WK * runs, count = RUN * runs + (tail <= 0 ? 0 : tail < RUN ? tail : RUN);\n"),
    ("  // The loads of a warp's chunk i0 + P", SETUP
     + "#define OFF(P) (RUN * WK * ((P) / RUN) + (P) % RUN)  // chunk i0 + P's place after chunk i0's\n"
     + "  // The loads of a warp's chunk i0 + P"),
    ("        cp_async16(ring + ((slot) * RT + rt) * 1024, w_lo[rt] + 16 * WK * (P));                \\\n"
     "        cp_async16(ring + ((slot) * RT + rt) * 1024 + 512, w_hi[rt] + 16 * WK * (P));          \\\n", ""),
    ("      sb[slot][rt][0] = *(const u16 *)(s_lo[rt] + 8 * WK * (P));                               \\\n"
     "      sb[slot][rt][1] = *(const u16 *)(s_hi[rt] + 8 * WK * (P));                               \\\n",
     "      sb[slot][rt][0] = *(const u16 *)(s_lo[rt] + 8 * OFF(P));                                 \\\n"
     "      sb[slot][rt][1] = *(const u16 *)(s_hi[rt] + 8 * OFF(P));                                 \\\n"),
    ("  if (ASYNC) cp_async_commit();  /* a group every turn",
     GROUP + "  if (ASYNC) cp_async_commit();  /* a group every turn"),
    ("        xb[slot][nt][q] = load_cached(x_row[nt] + 16 * WK * (P) + q);                          \\\n",
     "        xb[slot][nt][q] = load_cached(x_row[nt] + 16 * OFF(P) + q);                            \\\n"),
    ("        if (ASYNC) cp_async_wait<DEPTH - 1>();  // this chunk's group has landed: at most DEPTH - 1 pending",
     "        if (ASYNC) cp_async_wait<RUN>();  // this chunk's run has landed: at most RUN groups pending"),
    # a lane reads what other lanes copied, and copies over what other lanes read: the warp meets before each
    # (as async 2 does for x)
    ("        if (ASYNC == 2) __syncwarp();  // every lane has read the slot",
     "        __syncwarp();  // every lane has read the slot"),
    ("        if (ASYNC == 2) __syncwarp();  // and every lane's copies",
     "        __syncwarp();  // and every lane's copies"),
    ("    for (int nt = 0; nt < NT; ++nt) x_row[nt] += 16 * WK * DEPTH;\n",
     "    for (int nt = 0; nt < NT; ++nt) x_row[nt] += 16 * WK * DEPTH;\n    w_run += 16 * WK * DEPTH;\n"),
    ("#undef LOAD_W\n", "#undef LOAD_W\n#undef OFF\n#undef CP_ROW\n"),
]


def source() -> str:
    return edited(AS_BUILT, EDITS, "diag_fp4_runs")


def _targs(cfg: dict) -> str:
    return ", ".join(str(v) for v in _fp4_cuda._key(cfg, 0)[:-1]) + f", {cfg['run']}"


def _dynamic(cfg: dict) -> int:
    return _fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], 1, cfg["rt"], cfg["nt"])


_BUILT: dict = {}


def fp4_runs(x2: torch.Tensor, q, cfg: dict) -> torch.Tensor:
    """The variant at ``cfg`` (``run`` chunks a run, depth 2 run), into a new bf16 output."""
    key = tuple(sorted(cfg.items()))
    if key not in _BUILT:
        _BUILT[key] = build(source(), f"fp4_mma_sync<{_targs(cfg)}>", cfg, _dynamic(cfg))
    return launch(_BUILT[key], x2, q, cfg, _dynamic(cfg))


def configs(m: int) -> list[dict]:
    """M <= 8: the M=1 pick's layout (1 row tile a warp, 12 warps along K) and 8 and 16 warps; M = 9-16: 2 row tiles a
    warp at 8 and 12 warps (x in registers, async 1: the x ring's copies are the variant's to come). RUN 2 and 4."""
    nt, rt, wks = (1, 1, (12, 8, 16)) if m <= 8 else (2, 2, (12, 8))
    return [dict(cuda=True, nt=nt, rw=1, wk=wk, depth=2 * run, split_k=1, rt=rt, run=run, **{"async": True})
            for wk in wks for run in (2, 4)]


def main() -> None:
    p = arguments(__doc__, "1,16")
    args = p.parse_args()
    if args.registers:
        print("| M | config (nt, rw, wk, depth, async, rt, run) | registers as built, depth 2 | as built, the same "
              "depth | runs | warps an SM (runs) |\n| --- | --- | --- | --- | --- | --- |")
        for m in (int(v) for v in args.ms.split(",")):
            for c in configs(m):
                r0, rd = (sm90_registers(AS_BUILT, ", ".join(str(v) for v in _fp4_cuda._key(
                    {**c, "depth": depth}, 0)[:-1])) for depth in (2, c["depth"]))
                r = sm90_registers(source(), _targs(c))
                shared = _dynamic(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"], c["rt"])
                print(f"| {m} | ({_targs(c)}) | {r0} | {rd} | {r} | {warps_an_sm(r, c['rw'] * c['wk'], shared)} |")
        return
    t = Rows(*(int(v) for v in args.shape.split("x")), args.rep_ms)
    for m, x, ref in t.each_m(args.ms):
        for cfg in configs(m):
            tag = f"rt={cfg['rt']} wk={cfg['wk']} ring"
            for depth in ((2, cfg["depth"]) if cfg["run"] == 2 else (cfg["depth"],)):
                built = {k: v for k, v in cfg.items() if k != "run"} | {"depth": depth}
                t.row(m, f"{tag} depth {depth}, as built", lambda q, c=built: _fp4_cuda.fp4_linear_cuda(
                    x, q.packed, q.scales, q.global_scale, c), ref)
            t.row(m, f"{tag} runs of {cfg['run']} (depth {cfg['depth']})", lambda q, c=cfg: fp4_runs(x, q, c), ref)
    t.finish(None, args.out)


if __name__ == "__main__":
    main()
