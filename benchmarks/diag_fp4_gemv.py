"""Usage: PYTHONPATH=. python3 benchmarks/diag_fp4_gemv.py (GPU; run from .gpu/diag_gemv.py in s15).

s15: why every fp4 form takes ~34 us at 4096x14336 M=1 (H200: bf16 31 us): load-only ceiling of the tile
pattern vs the decode, with and without register prefetch, per-step reductions removed."""
import itertools
import torch, triton, triton.language as tl
from triton.testing import do_bench_cudagraph
from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels.fp4_linear import _decode_word

@triton.jit
def gemv2(x_ptr, w_ptr, s_ptr, y_ptr, N, K, KW_PER_SPLIT, stride_wn, stride_sn,
          BN: tl.constexpr, BW: tl.constexpr, LOAD_ONLY: tl.constexpr, PREFETCH: tl.constexpr,
          BLOCK: tl.constexpr, ATOMIC: tl.constexpr, ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    WPB: tl.constexpr = BLOCK // 8
    rn = pid_n * BN + tl.arange(0, BN)
    rw = tl.arange(0, BW)
    rs = tl.arange(0, BW // WPB)
    kw_start = pid_k * KW_PER_SPLIT
    kw_end = tl.minimum(kw_start + KW_PER_SPLIT, K // 8)
    acc = tl.zeros((BN, BW // WPB), dtype=tl.float32)
    ptrs = w_ptr + rn[:, None] * stride_wn + (kw_start + rw)[None, :]
    words = tl.load(ptrs, mask=(kw_start + rw < kw_end)[None, :], other=0)
    for kw0 in range(kw_start, kw_end, BW):
        kw = kw0 + rw
        if PREFETCH:
            nxt = tl.load(ptrs + (kw0 - kw_start + BW), mask=(kw + BW < kw_end)[None, :], other=0)
        else:
            words = tl.load(ptrs + (kw0 - kw_start), mask=(kw < kw_end)[None, :], other=0)
        if LOAD_ONLY:
            p = words.to(tl.float32, bitcast=True)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word(words, ASM)
            xb = x_ptr + 8 * kw
            p = v0 * tl.load(xb + 0).to(tl.float32)[None, :]
            p += v1 * tl.load(xb + 1).to(tl.float32)[None, :]
            p += v2 * tl.load(xb + 2).to(tl.float32)[None, :]
            p += v3 * tl.load(xb + 3).to(tl.float32)[None, :]
            p += v4 * tl.load(xb + 4).to(tl.float32)[None, :]
            p += v5 * tl.load(xb + 5).to(tl.float32)[None, :]
            p += v6 * tl.load(xb + 6).to(tl.float32)[None, :]
            p += v7 * tl.load(xb + 7).to(tl.float32)[None, :]
        pb = tl.sum(tl.reshape(p, (BN, BW // WPB, WPB)), axis=2)
        sk = kw0 // WPB + rs
        raw = tl.load(s_ptr + rn[:, None] * stride_sn + sk[None, :])
        acc += pb * raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if PREFETCH:
            words = nxt
    y = tl.sum(acc, axis=1) * 16384.0
    if ATOMIC:
        tl.atomic_add(y_ptr + rn, y)
    else:
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))


CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def run(n, k, cfg, q, x, out, outb):
    bn, bw, warps, split, load_only, prefetch, stages = cfg
    words = q.packed.view(torch.int32)
    kw = k // 8
    per = -(-kw // (split * bw)) * bw
    grid = (n // bn, -(-kw // per))
    def f():
        if split > 1:
            out.zero_()
        gemv2[grid](x, words, q.scales.view(torch.uint8), out if split > 1 else outb, n, k, per,
                    words.stride(0), q.scales.stride(0), BN=bn, BW=bw, LOAD_ONLY=load_only, PREFETCH=prefetch,
                    BLOCK=16, ATOMIC=split > 1, ASM=CUDA, num_warps=warps, num_stages=stages)
    return f

rows = []
for n, k in ([(4096, 14336), (14336, 4096)] if CUDA else [(16, 2048)]):
    w = torch.randn(n, k, device=DEV) * 0.02
    q = fmt.quantize(w, fmt.NVFP4)
    x = torch.randn(k, device=DEV).bfloat16()
    out = torch.zeros(n, device=DEV)
    wb = w.bfloat16()
    xb = x[None]
    bf16 = do_bench_cudagraph(lambda: torch.nn.functional.linear(xb, wb), rep=30) if CUDA else 0
    # correctness of the full form once
    ref = (x.float() @ fmt.dequantize(q).T)
    outb = torch.zeros(n, device=DEV, dtype=torch.bfloat16)
    outb0 = outb
    gemv2[(n // 8, 1)](x, q.packed.view(torch.int32), q.scales.view(torch.uint8), outb, n, k, k // 8,
                       q.packed.stride(0) // 4, q.scales.stride(0), BN=8, BW=128, LOAD_ONLY=False, PREFETCH=True,
                       BLOCK=16, ATOMIC=False, ASM=CUDA, num_warps=4)
    if not CUDA:
        gs = q.global_scale.item()
        for cfg in [(8, 64, 2, 2, 0, 1, 1), (4, 128, 2, 1, 0, 0, 1)]:
            out.zero_(); outb.zero_()
            run(n, k, cfg, q, x, out, outb)()
            got = (out if cfg[3] > 1 else outb).float() * gs
            print(cfg, ((got - ref).norm() / ref.norm()).item())
        outb = outb.float() * gs
        print(((outb - ref).norm() / ref.norm()).item())
        continue
    print(f"{n}x{k} check rel err {((outb.float() * q.global_scale - ref).norm() / ref.norm()).item():.2e}", flush=True)
    res = {}
    for bn, bw, warps, split, load_only, prefetch, stages in itertools.product((4, 8, 16), (64, 128, 256), (2, 4),
                                                                                (1, 2, 4), (1, 0), (1, 0), (1, 3)):
        if prefetch and stages != 1:
            continue
        cfg = (bn, bw, warps, split, load_only, prefetch, stages)
        try:
            res[cfg] = do_bench_cudagraph(run(n, k, cfg, q, x, out, outb0), rep=15)
        except Exception:  # noqa: BLE001 - a config that does not fit
            res[cfg] = float("inf")
    nbytes = q.packed.numel() + q.scales.numel()
    print(f"{n}x{k}: bf16 {bf16*1e3:.1f} us")
    for lo in (1, 0):
        for pf in (1, 0):
            for st in ((1,) if pf else (1, 3)):
                sub = {c: t for c, t in res.items() if c[4] == lo and c[5] == pf and c[6] == st}
                best = sorted(sub, key=sub.get)[:3]
                print(f"  load_only={lo} prefetch={pf} stages={st}: " + "; ".join(
                    f"bn={c[0]} bw={c[1]} w={c[2]} split={c[3]}: {sub[c]*1e3:.1f} us ({nbytes/sub[c]/1e9:.2f} TB/s)"
                    for c in best), flush=True)
