"""What the L2 cache does for fp4 decoding: the CUDA form's GEMVs in a captured chain shaped like the zoo's
8-layer Llama decoding one token at batch 1 (RMSNorm, q/k/v as one weight, SDPA over an 80-token cache, o,
gate and up as one weight, SiLU times up, down, 8 layers, the LM head), timed as a CUDA graph's replay.
Needs a GPU with the CUDA form (sm_90: the prefetch is sm_90's ``cp.async.bulk.prefetch``).

    python -m benchmarks.diag_fp4_l2 --exp evict-first
    python -m benchmarks.diag_fp4_l2 --exp prefetch

Variants of ``kernels/_fp4_cuda.SOURCE``, each built by NVRTC as the real one is and run at the default config:
- ``--exp evict-first``: ``as built`` (plain loads) against ``evict-first weights`` (the weights' loads with an
  L2 evict-first policy: 769bbcf's kernel, up to comments and spacing; measured in s36, then taken out of the
  kernel because a change of its source voids the H200's fp4 calibration, which no GPU was left to redo) and
  ``scales too`` (the block scales' loads evict-first as well). At 769bbcf, where the kernel had the hint, the
  script named these ``no hint``, ``as built`` and ``scales too``;
- ``--exp prefetch``: each GEMV's blocks prefetch into L2 the next GEMV's weights (a slice a block, its bytes
  capped), at the block's start or after its loads, with or without the hints; ``only small``: only where the
  next weight is q/k/v or o (12-14 MB, which fit in L2 beside the rest).
Every variant must give the same output as the first (the hints and the prefetch change no value); the table
says so. Rounds interleave the variants, so that drift of the machine hits each alike.

``gemv`` repeats ``_fp4_cuda.fp4_linear_cuda``'s launch (split, grid, shared memory) because the prefetch
variants take five more kernel arguments. Giving ``fp4_linear_cuda`` extra arguments instead would change
``_fp4_cuda.py``, whose whole code the cost model hashes into the H200's fp4 calibration: do it with the
recalibration that lands the hint, and call it from here then.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from kpt_compiler.kernels import _fp4_cuda
from kpt_compiler.kernels import _fp4_format as fmt

from ._fp4_diag import edited

AS_BUILT = _fp4_cuda.SOURCE
# The evict-first policy on the weights' loads (s36): (the source as built, the hinted form). Measured, then kept
# out of the kernel until the H200's fp4 tables can be calibrated again (the cost model keys them to the source).
POLICY = r"""__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

"""
HINTS = [
    ("__device__ __forceinline__ uint4 load_stream(const u32 *p) {",
     POLICY + "__device__ __forceinline__ uint4 load_stream(const u32 *p, unsigned long long pol) {"),
    ('asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"\n'
     '               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));',
     'asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"\n'
     '               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));'),
    # the weights' copies take the policy through an overload; x's copies (async 2) keep the plain one
    ("__device__ __forceinline__ void cp_async16(unsigned a, const void *gmem) {",
     "__device__ __forceinline__ void cp_async16(unsigned a, const void *gmem, unsigned long long pol) {\n"
     '  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" :: "r"(a), "l"(gmem), "l"(pol)\n'
     '               : "memory");\n}\n\n'
     "__device__ __forceinline__ void cp_async16(unsigned a, const void *gmem) {"),
    ("  const int g = lane >> 2, t = lane & 3;\n",
     "  const int g = lane >> 2, t = lane & 3;\n  const unsigned long long pol = evict_first_policy();\n"),
    ("cp_async16(ring + ((slot) * RT + rt) * 1024, w_lo[rt] + 16 * WK * (P));",
     "cp_async16(ring + ((slot) * RT + rt) * 1024, w_lo[rt] + 16 * WK * (P), pol);"),
    ("cp_async16(ring + ((slot) * RT + rt) * 1024 + 512, w_hi[rt] + 16 * WK * (P));",
     "cp_async16(ring + ((slot) * RT + rt) * 1024 + 512, w_hi[rt] + 16 * WK * (P), pol);"),
    ("wb[slot][rt][0] = load_stream(w_lo[rt] + 16 * WK * (P));",
     "wb[slot][rt][0] = load_stream(w_lo[rt] + 16 * WK * (P), pol);"),
    ("wb[slot][rt][1] = load_stream(w_hi[rt] + 16 * WK * (P));",
     "wb[slot][rt][1] = load_stream(w_hi[rt] + 16 * WK * (P), pol);"),
]
SCALE_LOADS = ["sb[slot][rt][0] = *(const u16 *)(s_lo[rt] + 8 * WK * (P));",
               "sb[slot][rt][1] = *(const u16 *)(s_hi[rt] + 8 * WK * (P));"]
LOAD_SCALE = r"""__device__ __forceinline__ u32 load_scale(const unsigned char *p, unsigned long long pol) {
  unsigned short v;
  asm volatile("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(pol));
  return v;
}
"""
PREFETCH = r"""
__device__ __forceinline__ void prefetch_slice(const unsigned char *p, long long bytes, int evict_last) {
  if (bytes <= 0) return;
  const long long ncta = (long long)gridDim.x * gridDim.y, cta = (long long)blockIdx.y * gridDim.x + blockIdx.x;
  const long long slice = ((bytes + ncta - 1) / ncta + 15) & ~15LL, begin = cta * slice;
  if (begin >= bytes) return;
  const long long n = (bytes - begin < slice ? bytes - begin : slice) & ~15LL;
  if (n <= 0) return;
  if (evict_last)
    asm volatile("{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
                 "cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, pol;\n}" :: "l"(p + begin), "r"((u32)n)
                 : "memory");
  else
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + begin), "r"((u32)n) : "memory");
}
"""
PF_ARGS = "const unsigned char *pf0, long long pb0, const unsigned char *pf1, long long pb1, int pf_mode"
PF_CALL = ("if (pf_mode %s && threadIdx.x == 0) { prefetch_slice(pf0, pb0, pf_mode & 4); "
           "prefetch_slice(pf1, pb1, pf_mode & 4); }")


def _rep(s: str, a: str, b: str) -> str:
    return edited(s, [(a, b)], "diag_fp4_l2")


def source(hints: bool = True, scales: bool = False, prefetch: bool = False) -> str:
    s = AS_BUILT
    if hints:
        for a, b in HINTS:
            s = _rep(s, a, b)
    if scales:  # with the hints only: the scales' loads take the same policy
        s = _rep(s, "// One chunk of 128 K", LOAD_SCALE + "// One chunk of 128 K")
        s = _rep(s, SCALE_LOADS[0], "sb[slot][rt][0] = load_scale(s_lo[rt] + 8 * WK * (P), pol);")
        s = _rep(s, SCALE_LOADS[1], "sb[slot][rt][1] = load_scale(s_hi[rt] + 8 * WK * (P), pol);")
    if prefetch:  # pf_mode: 1 at the block's start, 2 after its loads; + 4 with an evict-last policy
        s = _rep(s, "// Two E4M3 scale bytes", PREFETCH + "// Two E4M3 scale bytes")
        s = _rep(s, "int stride_ym, int out_f32) {", "int stride_ym, int out_f32, " + PF_ARGS + ") {")
        s = _rep(s, "  const int g = lane >> 2, t = lane & 3;\n",
                 "  const int g = lane >> 2, t = lane & 3;\n  " + PF_CALL % "& 1" + "\n")
        s = _rep(s, "#undef LOAD_W\n#undef LOAD_X\n", "#undef LOAD_W\n#undef LOAD_X\n  " + PF_CALL % "& 2" + "\n")
    return s


_BUILT: dict = {}


def kernel(cfg: dict, variant: tuple):
    key = (_fp4_cuda._key(cfg, 0), variant)
    if key not in _BUILT:
        _fp4_cuda.SOURCE = source(*variant)
        try:
            _BUILT[key] = _fp4_cuda._build(*_fp4_cuda._key(cfg, 0))
        finally:
            _fp4_cuda.SOURCE = AS_BUILT
    return _BUILT[key]


def gemv(x2, q, variant, sms, pf=None, pf_mode=0, cap=0):
    (m, k), n = x2.shape, q.packed.shape[0]
    cfg = _fp4_cuda.config(m, n, k, sms)
    w, s = q.packed.view(torch.int32), q.scales.view(torch.uint8)
    chunks = k // _fp4_cuda.CHUNK
    per = -(-chunks // min(cfg["split_k"], chunks))
    split = -(-chunks // per)
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else torch.bfloat16, device=x2.device)
    rt = cfg.get("rt", 1)
    args = [x2, w, s, q.global_scale.reshape(1).float(), out, m, n, k, per, x2.stride(0), w.stride(0), s.stride(0),
            out.stride(0), out.stride(1), int(split > 1)]
    if variant[2]:
        if pf is None or not pf_mode:
            args += [s, 0, s, 0, 0]
        else:
            p0, p1 = pf.packed.view(torch.uint8), pf.scales.view(torch.uint8)
            args += [p0, min(p0.numel(), cap), p1, min(p1.numel(), cap * p1.numel() // p0.numel()), pf_mode]
    kernel(cfg, variant)(grid=(-(-n // (16 * rt * cfg["rw"])), split, 1), block=(32 * cfg["rw"] * cfg["wk"], 1, 1),
                         shared_mem=_fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"],
                                                         int(cfg.get("async", False)), rt, cfg["nt"]),
                         args=args, stream=torch.cuda.current_stream())
    return out[0] if split == 1 else out.sum(0).to(torch.bfloat16)


def variants(exp: str) -> dict:
    """name -> ((hints, scales, prefetch), pf_mode, cap in MB, only small)."""
    if exp == "evict-first":
        return {"as built": ((False, False, False), 0, 0, False),
                "evict-first weights": ((True, False, False), 0, 0, False),
                "scales too": ((True, True, False), 0, 0, False),
                "as built again": ((False, False, False), 0, 0, False)}
    plain, hinted = (False, False, True), (True, False, True)
    return {"no hint, no prefetch": (plain, 0, 0, False), "after loads": (plain, 2, 24, False),
            "after loads, hints": (hinted, 2 | 4, 24, False), "at start, hints": (hinted, 1 | 4, 24, False),
            "after loads, only small": (plain, 2, 24, True),
            "after loads, only small, hints": (hinted, 2 | 4, 24, True),
            "at start, only small": (plain, 1, 24, True), "after loads, cap 12 MB": (plain, 2, 12, False),
            "after loads, cap 40 MB": (plain, 2, 40, False), "hints, no prefetch": (hinted, 0, 0, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--exp", choices=["evict-first", "prefetch"], default="evict-first")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None, help="write the times (ms a replay, per round) as JSON here")
    args = p.parse_args()
    dev, sms = "cuda", torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    L, H, I, V = 8, 4096, 14336, 32000

    def qw(n, k):
        return fmt.quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16), fmt.NVFP4)

    layers = [dict(qkv=qw(6144, H), o=qw(H, H), gu=qw(2 * I, H), d=qw(H, I)) for _ in range(L)]
    head = qw(V, H)
    seq = [q for lay in layers for q in (lay["qkv"], lay["o"], lay["gu"], lay["d"])] + [head]
    nxt = {id(a): b for a, b in zip(seq, seq[1:] + seq[:1])}
    small = {id(lay[k]) for lay in layers for k in ("qkv", "o")}
    kc = torch.randn(1, 32, 80, 128, device=dev, dtype=torch.bfloat16)
    vc, nw = torch.randn_like(kc), torch.ones(H, device=dev, dtype=torch.bfloat16)

    def step(x, variant, pf_mode, cap_mb, only_small):
        def G(a, q):
            pf = nxt[id(q)]
            return gemv(a, q, variant, sms, None if only_small and id(pf) not in small else pf, pf_mode, cap_mb << 20)
        h = x
        for lay in layers:
            qkv = G(F.rms_norm(h, (H,), nw), lay["qkv"])
            a = F.scaled_dot_product_attention(qkv[:, :H].view(1, 32, 1, 128), kc, vc).reshape(1, H)
            h = h + G(a, lay["o"])
            gu = G(F.rms_norm(h, (H,), nw), lay["gu"])
            h = h + G(F.silu(gu[:, :I]) * gu[:, I:], lay["d"])
        return G(F.rms_norm(h, (H,), nw), head)

    x0 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    graphs, ref = {}, None
    for name, v in variants(args.exp).items():
        static = x0.clone()
        for _ in range(2):
            step(static, *v)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step(static, *v)
        g.replay()
        torch.cuda.synchronize()
        ref = out.clone() if ref is None else ref
        graphs[name] = (g, torch.equal(out, ref))
    times = {n: [] for n in graphs}
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for name, (g, _) in graphs.items():
            for _ in range(10):
                g.replay()
            e0.record()
            for _ in range(100):
                g.replay()
            e1.record()
            e1.synchronize()
            times[name].append(e0.elapsed_time(e1) / 100)
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, torch {torch.__version__}; --exp {args.exp}, "
          f"{args.rounds} rounds of 100 replays")
    print("| variant | ms a replay, median | min | max | same output as the first |")
    print("| --- | --- | --- | --- | --- |")
    for name, (_, same) in graphs.items():
        r = times[name]
        print(f"| {name} | {statistics.median(r):.4f} | {min(r):.4f} | {max(r):.4f} | {same} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(times, f)


if __name__ == "__main__":
    main()
