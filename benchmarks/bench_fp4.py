"""fp4 weight GEMM microbenchmark (issue 18): kernels/fp4_linear.py against bf16 cuBLAS and fp8 ``_scaled_mm``.

    python -m benchmarks.bench_fp4 [--out DIR] [--formats nvfp4,mxfp4] [--ms 1,4,16,64,256,2048] [--rep-ms MS]
    (CUDA; --device cpu runs a smoke test of the table on tiny shapes through the eager reference)

For each weight shape N x K (4096x4096, 14336x4096 and 4096x14336: Llama's attention, MLP up and down) and each
M it times ``y = x @ w.T`` in bf16:
  - bf16: ``F.linear`` (cuBLAS);
  - fp8: ``torch._scaled_mm`` with rowwise scales (x quantized per call, the weight once), the fp8 pass's form;
  - fp4 <format>: our kernel with its default config, the weight quantized once (kernels/_fp4_format.py): the
    GEMV form up to GEMV_MAX_M, the dot form past it (kernels/fp4_linear.py); past GEMV_MAX_M "fp4 mxfp4
    scaled dot" is the MXFP4 weight through triton's tl.dot_scaled (``config={"scaled_dot": True}``).
Times are CUDA-graph replays (``timing_ms(..., cuda_graph=True)``: device time, no launch costs), each call on
the next of several copies of the weight, together three times the L2 cache (``copies_for``), so that every
call reads its weight from memory as a decoding model's layers do (timed alone, a 29 MB fp4 weight stays in
L2 and looks twice as fast; the copies per row are in the JSON). "weight TB/s"
is the weight's stored bytes over the time (bf16: 2 bytes per weight; fp8: 1; fp4: 0.5 plus the scales), the
figure a memory-bound GEMV is judged by; TFLOP/s counts 2 M N K. "vs bf16" is bf16's time over the row's.
The relative error is against the dequantized weight's matmul in fp32 (the kernel's own error, not the
format's); the format's SQNR against the bf16 weight is in its own column. ``--out DIR`` writes
bench_fp4.json and bench_fp4.md (card, date, commit); the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys

import torch
import torch.nn.functional as F

from kpt_compiler.bench import git_commit, relative_error, timing_ms
from kpt_compiler.kernels import _fp4_cuda
from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels.fp4_linear import GEMV_MAX_M, cuda_form_fits, fp4_linear
from kpt_compiler.lossy_guard import sqnr_db

from .bench_rms_norm import require_cuda, write_out

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # N x K
TINY = [(32, 64), (48, 128)]


def copies_for(nbytes: int, device: str, cap: int = 32) -> int:
    """How many copies of a weight of ``nbytes`` to cycle through so that together they take three times the
    card's L2 cache: each call then reads its weight from memory, as a model's layers do in decoding (a 29 MB
    fp4 weight timed alone stays in an H100's 50 MB L2; s15 measured a load-only kernel at 6 TB/s that way)."""
    if device != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(cap, -(-3 * l2 // nbytes)))


def rotating(fn, weights: list):
    """``fn(weight)`` on the next of ``weights`` each call (captured in a CUDA graph, the sequence is fixed)."""
    state = {"i": 0}

    def call():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return fn(w)
    return call


def _fp8_rowwise(x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    sx = amax / torch.finfo(torch.float8_e4m3fn).max
    x8 = (x.float() / sx).to(torch.float8_e4m3fn)
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)


def run(shapes, ms, formats, device: str, rep_ms: float) -> list[dict]:
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for n, k in shapes:
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
        quantized = {f: fmt.quantize(w, fmt.FORMATS[f]) for f in formats}
        snr = {f: sqnr_db(fmt.dequantize(q), w.float()) for f, q in quantized.items()}
        # copies to cycle through, each call reading its weight from memory (copies_for)
        ws = [w] + [w.clone() for _ in range(copies_for(2 * n * k, device) - 1)]
        qcopies = {f: [q] + [fmt.quantize(w, fmt.FORMATS[f]) for _ in range(copies_for(q.nbytes(), device) - 1)]
                   for f, q in quantized.items()}
        fp8 = None
        if device == "cuda":
            sw = (w.float().abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
            w8 = (w.float() / sw).to(torch.float8_e4m3fn)
            fp8 = [(w8, sw)] + [(w8.clone(), sw) for _ in range(copies_for(n * k, device) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16 if device == "cuda" else torch.float32)
            impls = {"bf16": (rotating(lambda w, x=x: F.linear(x, w.to(x.dtype)), ws), 2 * n * k)}
            if fp8 is not None:
                impls["fp8"] = (rotating(lambda w8s, x=x: _fp8_rowwise(x, *w8s), fp8), n * k + 4 * n)
            for f, q in quantized.items():
                impls[f"fp4 {f}"] = (rotating(lambda q, x=x: fp4_linear(x, q), qcopies[f]), q.nbytes())
                if f == "mxfp4" and x.dtype == torch.bfloat16 and m > GEMV_MAX_M:  # triton's scaled dot beside ours
                    impls["fp4 mxfp4 scaled dot"] = (rotating(lambda q, x=x: fp4_linear(
                        x, q, config=SCALED), qcopies[f]), q.nbytes())
            row = {"N": n, "K": k, "M": m, "ms": {}, "weight_tbps": {}, "tflops": {}, "rel_err": {},
                   "sqnr_db": {f"fp4 {f}": round(s, 2) for f, s in snr.items()},
                   "copies": {"bf16": len(ws), "fp8": len(fp8 or []),
                              **{f"fp4 {f}": len(c) for f, c in qcopies.items()}}}
            for name, (fn, nbytes) in impls.items():
                t = timing_ms(fn, device, warmup_ms=rep_ms / 5, rep_ms=rep_ms, cuda_graph=device == "cuda").median
                row["ms"][name] = t
                row["weight_tbps"][name] = nbytes / (t * 1e-3) / 1e12
                row["tflops"][name] = 2 * m * n * k / (t * 1e-3) / 1e12
                if name.startswith("fp4"):
                    q = quantized[name.split()[1]]
                    row["sqnr_db"].setdefault(name, row["sqnr_db"][f"fp4 {name.split()[1]}"])
                    ref = x.float() @ fmt.dequantize(q).T
                    out = fp4_linear(x, q, config=SCALED if name.endswith("scaled dot") else None)
                    row["rel_err"][name] = relative_error(out.float(), ref)
            rows.append(row)
            print(f"{n}x{k} M={m}: " + "  ".join(f"{k_} {v:.4f} ms" for k_, v in row["ms"].items()), flush=True)
    return rows


SCALED = {"scaled_dot": True}
GEMV_SWEEP = [dict(gemv=True, block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=1, gemv_math="f32")
              for bn in (8, 16, 32, 64) for bk in (512, 1024, 2048) for sk in (1, 2, 4) for nw in (2, 4)]
GEMV_SWEEP += [dict(gemv=True, block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=1, gemv_math="f16x2")
               for bn in (4, 8, 16, 32) for bk in (1024, 2048, 4096) for sk in (1, 2) for nw in (4, 8, 16)
               if bk // 8 >= 32 * nw // bn]  # at least one word a thread (s28: one wave of 3.6 warps a scheduler)
DOT_SWEEP = [dict(block_m=16, block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=3, scaled_dot=sd,
                  decode=decode, gemv=False)
             for sd, decode in ((False, 1), (False, 2), (True, 0))
             for bn in (32, 64, 128) for bk in (128, 256) for sk in (1, 4, 8)]
DOT_SWEEP += [dict(block_m=16, block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=st, scaled_dot=False,
                   decode=3, gemv=False)  # bf16 pairs, the weight as the MMA's first operand (kernels/_fp4_mma.py)
              for bn, bk, st, nw in ((64, 64, 3, 4), (64, 64, 4, 4), (64, 128, 2, 4), (64, 128, 3, 4), (64, 128, 4, 4),
                                     (64, 256, 3, 4), (128, 128, 3, 8), (128, 256, 3, 8)) for sk in (2, 4, 8, 16, 32)]

# The CUDA C++ form (kernels/_fp4_cuda.py). Every config names async and rt: fp4_linear fills a key left out from
# the default's pick, which at some shapes is the ring with rt=4 (s32's M=16 sweep ran so, mislabelled).
CUDA_SWEEP = [dict(cuda=True, rw=rw, wk=wk, depth=2, split_k=sk, rt=1, **{"async": False})
              for rw in (1, 2, 4) for wk in (1, 2, 4, 8) for sk in (1, 2, 4)]
CUDA_SWEEP += [dict(cuda=True, rw=1, wk=wk, depth=4, split_k=1, rt=1, **{"async": False}) for wk in (2, 4, 8)]
CUDA_SWEEP += [dict(cuda=True, rw=1, wk=wk, depth=depth, split_k=1, rt=1, **{"async": True})  # weights via cp.async
               for wk in (1, 2, 4, 8) for depth in (2, 4, 6, 8)]
CUDA_SWEEP += [dict(cuda=True, rw=rw, wk=wk, depth=depth, split_k=1, rt=rt, **{"async": True})  # rows a warp
               for rt in (2, 4) for rw in (1, 2) for wk in (1, 2, 4, 8) for depth in (2, 4) if rw * wk <= 8]
# (row groups sharing x over a split of K across blocks: benchmarks/diag_fp4_splitk.py; none beat the default, s43)
# More warps along K than 8 (s44, not yet timed; registers from `diag_fp4_sass --cuda`): the ring at wk=12 takes 76-80
# registers, so two blocks of 12 warps fit an SM at M=1 (24 warps against the default's 16); with 2 row tiles a warp
# at M=16, 168 registers, one block of 12 against 8. The register form at wk=12 (86) fits one block only.
CUDA_SWEEP += [dict(cuda=True, rw=1, wk=wk, depth=depth, split_k=1, rt=rt, **{"async": True})
               for wk in (12, 16) for rt in (1, 2) for depth in (2, 4)]


def family(cfg: dict) -> str:
    """The form a config runs: gemv (CUDA cores; fp16 pairs or fp32 arithmetic), dot with the integer or the bit
    decode, or the scaled dot."""
    if cfg.get("cuda"):
        return "cuda"
    if cfg.get("gemv"):
        return f"gemv {cfg.get('gemv_math', 'f16x2')}"
    return "scaled dot" if cfg.get("scaled_dot") else f"dot decode={cfg.get('decode', 2)}"


def sweep(shapes, ms, device: str, rep_ms: float, top: int = 4, forms: str = "") -> list[dict]:
    """Every config of GEMV_SWEEP, DOT_SWEEP and CUDA_SWEEP (small-M forms; NVFP4, or MXFP4 for the scaled dot)
    at each shape and M: the fastest ``top`` of each form, with the Triton forms' heuristic (``config_for``), the
    CUDA form's own pick (``_fp4_cuda.config``, the default where it runs) and bf16 beside them. ``forms``: only
    the forms whose names start so (comma-separated; "" all)."""
    from kpt_compiler.kernels.fp4_linear import config_for

    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for n, k in shapes:
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
        qs = {sd: [fmt.quantize(w, f) for _ in range(copies_for(fmt.quantize(w, f).nbytes(), device))]
              for sd, f in ((False, fmt.NVFP4), (True, fmt.MXFP4))}
        ws = [w] + [w.clone() for _ in range(copies_for(2 * n * k, device) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            t = {}
            mine = config_for(m, n, k, 16, dtype=torch.bfloat16)  # the Triton forms' heuristic
            # the CUDA form's own pick (the default where it runs), timed beside it
            pick = _fp4_cuda.pick(m, n, k, x.device) if cuda_form_fits(x, qs[False][0]) else None
            configs = [c for c in GEMV_SWEEP + DOT_SWEEP + CUDA_SWEEP
                       if family(c).startswith(tuple(forms.split(",")))]
            for cfg in configs + [mine] + ([pick] if pick else []):
                key = ",".join(f"{a}={b}" for a, b in sorted(cfg.items()))
                q = qs[bool(cfg.get("scaled_dot"))]
                try:
                    t[key] = timing_ms(rotating(lambda q, cfg=cfg: fp4_linear(x, q, config=cfg), q), device,
                                       warmup_ms=rep_ms / 5, rep_ms=rep_ms, cuda_graph=device == "cuda").median
                except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory): skipped
                    t[key] = float("inf")
                    print(f"  {key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            bf16 = timing_ms(rotating(lambda w: F.linear(x, w), ws), device, warmup_ms=rep_ms / 5, rep_ms=rep_ms,
                             cuda_graph=device == "cuda").median
            mine_key = ",".join(f"{a}={b}" for a, b in sorted(mine.items()))
            by_form = {}
            for cfg in configs:
                key = ",".join(f"{a}={b}" for a, b in sorted(cfg.items()))
                by_form.setdefault(family(cfg), []).append(key)
            best = {f: [(c, t[c]) for c in sorted(keys, key=t.get)[:top]] for f, keys in by_form.items()}
            pick_key = pick and ",".join(f"{a}={b}" for a, b in sorted(pick.items()))
            out.append({"N": n, "K": k, "M": m, "bf16_ms": bf16, "heuristic": mine_key,
                        "heuristic_ms": t[mine_key], "cuda_default": pick_key,
                        "cuda_default_ms": t.get(pick_key), "best": best, "all_ms": dict(t)})
            print(f"{n}x{k} M={m}: bf16 {bf16:.4f} ms, heuristic {t[mine_key]:.4f} ms, CUDA default "
                  f"{t.get(pick_key, float('nan')):.4f} ms; best: " +
                  "; ".join(f"[{f}] {c} {v:.4f}" for f, b in best.items() for c, v in b), flush=True)
    return out


def markdown(rows: list[dict], command: str, card: str, commit: str | None) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["ms"]))  # a column only some rows have: "-" elsewhere
    lines = [f"# fp4 weight GEMM on {card}", "",
             f"- date: {datetime.date.today()}; commit: {commit}; torch {torch.__version__}",
             f"- command: `{command}`",
             "- times: " + ("CUDA-graph replays, median (device time)" if card != "cpu" else
                            "wall clock on the CPU through the eager reference: a smoke test, not a figure"), "",
             "| N x K | M | " + " | ".join(f"{n} ms" for n in names) + " | "
             + " | ".join(f"{n} weight TB/s" for n in names) + " | "
             + " | ".join(f"{n} vs bf16" for n in names if n != "bf16") + " | fp4 rel. err | fp4 SQNR dB |",
             "|" + " --- |" * (2 + 2 * len(names) + len(names) - 1 + 2)]
    for r in rows:
        def cell(n, text):
            return text(n) if n in r["ms"] else "-"
        lines.append(f"| {r['N']}x{r['K']} | {r['M']} | "
                     + " | ".join(cell(n, lambda n: f"{r['ms'][n]:.4f}") for n in names) + " | "
                     + " | ".join(cell(n, lambda n: f"{r['weight_tbps'][n]:.2f}") for n in names) + " | "
                     + " | ".join(cell(n, lambda n: f"{r['ms']['bf16'] / r['ms'][n]:.2f}x") for n in names
                                  if n != "bf16") + " | "
                     + ", ".join(f"{v:.1e}" for v in r["rel_err"].values()) + " | "
                     + ", ".join(f"{v:.1f}" for v in r["sqnr_db"].values()) + " |")
    return "\n".join(lines)


def sweep_markdown(rows: list[dict], command: str, card: str, commit: str | None) -> str:
    """The sweep's table: per shape and M, bf16, the Triton heuristic, the CUDA form's default and each form's
    fastest configs (ms), every config written out whole (sweep configs name every key a default could fill)."""
    lines = [f"# fp4 small-M config sweep on {card}", "",
             f"- date: {datetime.date.today()}; commit: {commit}; torch {torch.__version__}",
             f"- command: `{command}`", "- times: ms, " + ("CUDA-graph replays, median; one run" if card != "cpu" else
                                                          "wall clock through the eager reference: a smoke test"), "",
             "| N x K | M | bf16 | Triton heuristic | CUDA default | fastest configs (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        best = "; ".join(f"[{f}] {c} {v:.4f}" for f, b in r["best"].items() for c, v in b)
        default = f"{r['cuda_default_ms']:.4f}" if r["cuda_default_ms"] is not None else "-"
        lines.append(f"| {r['N']}x{r['K']} | {r['M']} | {r['bf16_ms']:.4f} | {r['heuristic_ms']:.4f} | {default} "
                     f"| {best} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write bench_fp4.json and bench_fp4.md here")
    p.add_argument("--formats", default="nvfp4,mxfp4")
    p.add_argument("--ms", default="1,4,16,64,256,2048", help="comma-separated M values")
    p.add_argument("--rep-ms", type=float, default=200)
    p.add_argument("--shapes", default=None, help="N x K shapes, comma-separated (default: 4096x4096,14336x4096,"
                   "4096x14336)")
    p.add_argument("--sweep", action="store_true",
                   help="time every small-M config of the GEMV, DOT and CUDA sweeps instead")
    p.add_argument("--forms", default="", help="with --sweep: only these forms (prefixes, e.g. 'gemv')")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke test of the table on tiny shapes (the eager reference, wall-clock times)")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if any(f not in fmt.FORMATS for f in formats):
        p.error(f"--formats: {args.formats!r}; allowed: {', '.join(fmt.FORMATS)}")
    ms = [int(m) for m in args.ms.split(",") if m]
    if args.device == "cuda":
        error = require_cuda("bench_fp4")
        if error:
            print(error, file=sys.stderr)
            return 2
    shapes = SHAPES if args.device == "cuda" else TINY
    if args.shapes:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    command = ("python -m benchmarks.bench_fp4 " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    if args.sweep:
        rows = sweep(shapes, ms, args.device, args.rep_ms, forms=args.forms)
        write_out(args.out, "bench_fp4_sweep", {"card": card, "date": str(datetime.date.today()),
                                                "commit": git_commit(), "command": command},
                  rows, sweep_markdown(rows, command, card, git_commit()))
        return 0
    rows = run(shapes, ms, formats, args.device, args.rep_ms)
    table = markdown(rows, command, card, git_commit())
    write_out(args.out, "bench_fp4", {"card": card, "torch": torch.__version__, "date": str(datetime.date.today()),
                                      "commit": git_commit(), "command": command}, rows, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
