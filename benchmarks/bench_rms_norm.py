"""Residual add + RMSNorm microbenchmark: the fused kernels (kernels/rms_norm.py) against the unfused torch code.

    python -m benchmarks.bench_rms_norm [--out DIR] [--variants hf,torch] [--rep-ms MS]    (CUDA only)

For each bf16 shape (rows x N) and each variant (``hf``: transformers' LlamaRMSNorm, cast before the weight;
``torch``: F.rms_norm, weight in fp32), forward and forward+backward (gradients of x, residual and weight,
with upstream gradients on both y and h), it times in one run on one card:
  - ours: ``add_rms_norm`` (one Triton kernel forward, one backward plus a small reduction);
  - eager: the unfused torch code (``h = x + residual`` then the variant's torch code);
  - inductor: ``torch.compile`` (Inductor, default mode) of the unfused code.
GB/s counts the bytes the work needs, the same for all three: forward reads x, residual, weight and writes h,
y; backward reads dy, dh, h, weight, rstd and writes dx and the fp32 weight-gradient partials of our grid.
Times are CUDA-graph replays (``timing_ms(..., cuda_graph=True)``): the kernels' device time without the
host's launch costs, which at small shapes (and for autograd's backward at every shape) would time Python.
"% copy" is ours against the device-to-device copy bandwidth measured in the same run
(benchmarks.ceilings.copy_bandwidth); the target is >= 80% at the large shapes. ``--out DIR`` writes
bench_rms_norm.json and bench_rms_norm.md; the markdown table is printed last.

The helpers below (timing a case, the table, the output files) are shared with bench_layer_norm.py.
"""

import argparse
import datetime
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

from kpt_compiler.bench import median_ms, relative_error

SHAPES = [(8192, 1024), (8192, 4096), (16384, 8192), (128, 4096), (1, 4096)]
EPS = 1e-6


def unfused_hf(x, residual, weight):
    """transformers' residual add and LlamaRMSNorm, as a Llama decoder layer runs them."""
    h = x + residual
    hf = h.to(torch.float32)
    variance = hf.pow(2).mean(-1, keepdim=True)
    hf = hf * torch.rsqrt(variance + EPS)
    return weight * hf.to(h.dtype), h


def unfused_torch(x, residual, weight):
    h = x + residual
    return F.rms_norm(h, (h.shape[-1],), weight, EPS), h


def _ours(variant):
    from kpt_compiler.kernels.rms_norm import add_rms_norm

    return lambda x, r, w: add_rms_norm(x, r, w, EPS, variant == "hf")


def _bytes(rows: int, N: int, elem: int, n_params: int, n_stats: int, per_sm=None) -> tuple[int, int]:
    """(forward, backward) bytes needed for rows x N with ``n_params`` [N] parameters and fp32 row statistics
    (``per_sm``: the backward's programs per SM, as the kernel's launcher passes it to backward_grid)."""
    from kpt_compiler.kernels._norm_common import backward_grid, launch_config

    act = rows * N * elem
    forward = 2 * act + n_params * N * elem + 2 * act  # read x, residual, parameters; write h, y
    BLOCK_M, _, num_warps = launch_config(rows, N, torch.device("cuda"))
    programs, _ = backward_grid(rows, BLOCK_M, num_warps, torch.device("cuda"), per_sm=per_sm)
    backward = (3 * act + n_params * N * elem + n_stats * rows * 4  # read dy, dh, h, parameters, statistics
                + act + n_params * programs * N * 4)  # write dx and the fp32 partials of each parameter gradient
    return forward, backward


def time_case(impls: dict, make_inputs, fwd_bytes: int, bwd_bytes: int, rep_ms: float) -> list[dict]:
    """Time each implementation forward and forward+backward; rows with ms, GB/s and the error of y."""
    leaves = make_inputs()
    with torch.no_grad():
        ref_y = impls["eager"](*[t.float() if t is not None else None for t in leaves])[0]
    rows, launch_timed = [], []
    for mode in ("forward", "forward+backward"):
        times, errors = {}, {}
        for name, fn in impls.items():
            if name == "inductor":
                torch._dynamo.reset()
                fn = torch.compile(fn, dynamic=False)
            inputs = [t.detach().requires_grad_(mode != "forward") if t is not None else None for t in leaves]
            if mode == "forward":
                def step(fn=fn, inputs=inputs):
                    with torch.no_grad():
                        return fn(*inputs)
            else:
                wrt = [t for t in inputs if t is not None]
                y, h = fn(*inputs)
                dy, dh = torch.randn_like(y), torch.randn_like(h)
                del y, h  # no autograd graph may outlive this call: CUDA-graph capture runs on its own stream

                def step(fn=fn, inputs=inputs, wrt=wrt, dy=dy, dh=dh):
                    y, h = fn(*inputs)
                    return torch.autograd.grad([y, h], wrt, [dy, dh])
            out = step()
            if mode == "forward":
                errors[name] = relative_error(out[0], ref_y)
            try:
                times[name] = median_ms(step, "cuda", rep_ms=rep_ms, cuda_graph=True)
            except RuntimeError as e:  # capture refused: time with the launches (the row says so)
                print(f"warning: {name} {mode}: CUDA-graph timing failed ({str(e).splitlines()[0]}); "
                      "timing with launch costs", file=sys.stderr)
                torch.cuda.synchronize()
                times[name] = median_ms(step, "cuda", rep_ms=rep_ms)
                launch_timed.append(f"{name} {mode}")
        nbytes = fwd_bytes + (bwd_bytes if mode != "forward" else 0)
        rows.append({"mode": mode, "ms": times, "gbps": {n: nbytes / t / 1e6 for n, t in times.items()},
                     "bytes": nbytes, "rel_err_y": errors or None,
                     "ours_vs_inductor": times["inductor"] / times["ours"],
                     "ours_vs_eager": times["eager"] / times["ours"],
                     "timed_with_launches": [t for t in launch_timed if t.endswith(mode)]})
    return rows


def markdown(title: str, command: str, rows: list[dict], copy_tbps: float, label: str) -> str:
    card = torch.cuda.get_device_name()
    lines = [f"{title}, bf16, {card}, torch {torch.__version__}, {datetime.date.today()}; command: {command}", "",
             f"Copy bandwidth (read + write, same run): {copy_tbps * 1000:.0f} GB/s.", "",
             f"| rows x N | {label} | pass | ours ms | ours GB/s | % copy | eager GB/s | Inductor GB/s "
             "| ours vs Inductor | ours vs eager | rel. err y |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        g = r["gbps"]
        err = f"{r['rel_err_y']['ours']:.1e}" if r["rel_err_y"] else ""
        lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['variant']} | {r['mode']} | {r['ms']['ours']:.4f} | "
                     f"{g['ours']:.0f} | {g['ours'] / (copy_tbps * 1000):.0%} | {g['eager']:.0f} | "
                     f"{g['inductor']:.0f} | {r['ours_vs_inductor']:.2f}x | {r['ours_vs_eager']:.2f}x | {err} |")
    lines += ["", "GB/s counts the bytes the work needs (the same for all three; see the script's docstring); "
              "forward+backward times both passes and counts both passes' bytes. Times are CUDA-graph replays "
              "(device time, no launch costs)."]
    fallback = [f"{r['shape'][0]}x{r['shape'][1]} {r['variant']} {t}" for r in rows for t in r.get("timed_with_launches", ())]
    if fallback:
        lines.append("Timed with launch costs (capture failed): " + "; ".join(fallback) + ".")
    return "\n".join(lines)


def write_out(out: str | None, stem: str, meta: dict, rows: list[dict], table: str) -> None:
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(table + "\n")


def require_cuda(name: str) -> str | None:
    """An error line when this machine cannot run a GPU kernel benchmark, else None."""
    if not torch.cuda.is_available():
        return f"error: {name} times CUDA kernels and torch.cuda.is_available() is False (run it on the GPU machine)"
    if importlib.util.find_spec("triton") is None:
        return f"error: {name} needs triton, which is not installed"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fused residual add + RMSNorm against the unfused torch code (CUDA)")
    p.add_argument("--out", default=None, help="write bench_rms_norm.json and bench_rms_norm.md here")
    p.add_argument("--variants", default="hf,torch", help="comma-separated: hf (LlamaRMSNorm), torch (F.rms_norm)")
    p.add_argument("--rep-ms", type=float, default=500, help="timed milliseconds per measurement")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in ("hf", "torch") for v in variants):
        p.error(f"--variants: {args.variants!r}; allowed: hf, torch")
    error = require_cuda("bench_rms_norm")
    if error:
        print(error, file=sys.stderr)
        return 2
    from benchmarks.ceilings import copy_bandwidth

    copy_tbps = copy_bandwidth()
    rows = []
    for rows_, N in SHAPES:
        def make_inputs(rows_=rows_, N=N):
            g = torch.Generator(device="cuda").manual_seed(0)
            x, r = (torch.randn(rows_, N, device="cuda", generator=g).bfloat16() for _ in range(2))
            return [x, r, (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).bfloat16()]

        fwd_bytes, bwd_bytes = _bytes(rows_, N, 2, n_params=1, n_stats=1)
        for variant in variants:
            unfused = unfused_hf if variant == "hf" else unfused_torch
            impls = {"ours": _ours(variant), "eager": unfused, "inductor": unfused}
            for row in time_case(impls, make_inputs, fwd_bytes, bwd_bytes, args.rep_ms):
                rows.append({"shape": [rows_, N], "variant": variant, **row})
                print(f"{rows_}x{N} {variant} {row['mode']}: " + "  ".join(
                    f"{n} {t:.4f}ms ({row['gbps'][n]:.0f} GB/s)" for n, t in row["ms"].items()), flush=True)
    command = "python -m benchmarks.bench_rms_norm" + ("" if args.variants == "hf,torch" else
                                                       f" --variants {args.variants}")
    table = markdown("Residual add + RMSNorm", command, rows, copy_tbps, "variant")
    write_out(args.out, "bench_rms_norm", {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "date": str(datetime.date.today()), "copy_tbps": copy_tbps}, rows, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
