"""Linear + epilogue microbenchmark: the fused Triton kernel against cuBLAS, eager and Inductor.

    python -m benchmarks.bench_linear_epilogue [--out DIR] [--activation gelu_tanh]    (CUDA only)

For each bf16 shape (M tokens, K in, N out), in one run on one card, act(x @ W^T + b) + r timed as:
  - cuBLAS: F.linear(x, W) alone, the GEMM without epilogue: the ceiling;
  - ours: torch.ops.kpt.linear_epilogue (bias, activation and residual fused into the GEMM's store), and the
    same kernel with no epilogue (GEMM only), which tells the GEMM's speed from the epilogue's cost;
  - eager: F.linear(x, W, b), the activation, + r (three kernels);
  - Inductor: torch.compile of the eager sequence (default mode: cuBLAS plus one fused pointwise kernel).
TFLOP/s counts 2*M*N*K over the kernels' device time (CUDA-graph replays, ``timing_ms(cuda_graph=True)``);
"launches included" repeats ours vs Inductor timed as plain calls (host costs in). "ours / cuBLAS" is ours (with the epilogue) as a fraction of the GEMM alone; the
target on an H100 is 85% or more at 4096 and up. The autotuner runs on the first call of each shape, before
timing; the config it chose is in the table. rel. err is against the float32 computation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

from kpt_compiler.bench import median_ms, relative_error
from kpt_compiler.kernels import _tma_gemm as tg
from kpt_compiler.kernels import linear_epilogue as le

SHAPES = [  # (M, K, N)
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (8192, 4096, 14336),  # Llama-3 8B MLP up projection at 8192 tokens
    (8192, 1024, 2816),
    (128, 4096, 4096),  # short prefill
    (1, 4096, 4096),  # one decode token: memory-bound on W
    # the Llama of the zoo at 1 x 128 tokens: q and o projections, gate and up, down (the cost model's
    # small-shape points: there the GEMMs take a few microseconds and tile choice decides)
    (128, 1024, 1024),
    (128, 1024, 2816),
    (128, 2816, 1024),
]


def require_cuda(name: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"error: {name} times CUDA kernels and torch.cuda.is_available() is False; run it on the GPU machine",
          file=sys.stderr)
    return False


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


def time_all(fns: dict, launches: bool = True) -> tuple[dict, dict]:
    """Median ms of each callable, as CUDA-graph replays (the kernels' device time) and, with ``launches``, as
    plain calls (with the host's launch costs, which a model compiled without CUDA graphs pays when the GPU
    waits on the host); each is called once first (autotuning, compilation) outside the timing."""
    device, launched = {}, {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        device[name] = median_ms(fn, "cuda", cuda_graph=True)
        if launches:
            launched[name] = median_ms(fn, "cuda")
    return device, launched


def compiled(fn):
    torch._dynamo.reset()  # each shape compiles afresh, static: no dynamic-shape recompilation
    return torch.compile(fn, dynamic=False)


def best_config(autotuned) -> str:
    config = getattr(autotuned, "best_config", None)
    if config is None:
        return "?"
    k = config.kwargs
    tma = (" tma" + (" subtile" if k["EPILOGUE_SUBTILE"] else "")) if "EPILOGUE_SUBTILE" in k else ""
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} g{k['GROUP_M']} w{config.num_warps} s{config.num_stages}{tma}"


def write(out_dir: str | None, stem: str, meta: dict, rows: list[dict], table: str) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(table + "\n")


def run_meta(command: str) -> dict:
    import triton

    return {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": str(datetime.date.today()), "command": command}


def _tflops(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2f}"


def markdown(meta: dict, title: str, rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """The table: shape, TFLOP/s of each timed column, ours / cuBLAS, ours vs Inductor, config, errors."""
    lines = [f"{title}, bf16, {meta['card']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
             f"command: {meta['command']}", "",
             "| M, K, N | " + " | ".join(label for _, label in columns)
             + " | ours / cuBLAS | ours vs Inductor | same, launches included | config | rel. err ours / eager |",
             "| --- |" + " --- |" * (len(columns) + 5)]
    for r in rows:
        tf = r["tflops"]
        lines.append(f"| {','.join(map(str, r['shape']))} | " + " | ".join(_tflops(tf[n]) for n, _ in columns)
                     + f" | {r['ours_vs_cublas']:.0%} | {r['ours_vs_inductor']:.2f}x | {r['ours_vs_inductor_launched']:.2f}x"
                     f" | {r['config']} | "
                     f"{r['rel_err']['ours']:.1e} / {r['rel_err']['eager']:.1e} |")
    lines.append("\nTFLOP/s (2*M*N*K per GEMM) of the kernels' device time (CUDA-graph replays). ours / cuBLAS: ours "
                 "with its epilogue against the GEMM alone. Launches included: plain calls, host costs in. The cost "
                 "model's calibration (benchmarks.calibrate) takes the device-time ratios.")
    return "\n".join(lines)


def measure(M: int, K: int, N: int, act: str, variants=None, launches: bool = True) -> dict:
    """One shape's row: each variant's device time (and with launches), TFLOP/s, the ratios that apply, the
    config the autotuner chose and the errors. ``variants`` (default all) picks among cublas, ours_gemm, eager,
    inductor and ours (always timed): ``benchmarks.calibrate`` times only what a calibration table needs, and
    device time only (``launches=False``)."""
    def unfused(x, w, b, r):
        return le.ACTIVATIONS[act](F.linear(x, w, b)) + r

    x, w = randn(M, K, seed=1), randn(N, K, scale=K ** -0.5, seed=2)
    b, r = randn(N, seed=3), randn(M, N, seed=4)
    inductor = compiled(unfused) if variants is None or "inductor" in variants else None
    fns = {
        "cublas": lambda: F.linear(x, w),
        "ours_gemm": lambda: le.linear_epilogue(x, w),
        "eager": lambda: unfused(x, w, b, r),
        "inductor": lambda: inductor(x, w, b, r),
        "ours": lambda: le.linear_epilogue(x, w, b, r, act),  # last: its config is the autotuner's last choice
    }
    times, launched = time_all({k: f for k, f in fns.items() if variants is None or k in variants or k == "ours"},
                               launches)
    config = best_config(tg._gemm_tma_autotuned if tg.use_tma(M, N, K) else le._linear_epilogue_autotuned)
    ref = unfused(x.float(), w.float(), b.float(), r.float())
    return make_row(M, K, N, times, launched, config, {"ours": relative_error(le.linear_epilogue(x, w, b, r, act), ref),
                                                   "eager": relative_error(unfused(x, w, b, r), ref)})


def make_row(M, K, N, times, launched, config, rel_err, flop=None) -> dict:
    flop = flop or 2 * M * N * K
    row = {"shape": [M, K, N], "ms": times, "tflops": {n: flop / t / 1e9 for n, t in times.items()},
           "ms_launched": launched, "config": config, "rel_err": rel_err}
    if "cublas" in times:
        row["ours_vs_cublas"] = times["cublas"] / times["ours"]
    if "inductor" in times:
        row["ours_vs_inductor"] = times["inductor"] / times["ours"]
    if "inductor" in launched:
        row["ours_vs_inductor_launched"] = launched["inductor"] / launched["ours"]
    print(f"{M}x{K}x{N}: " + "  ".join(f"{n} {t:.3f}ms" for n, t in times.items())
          + (f"  ours/cuBLAS {row['ours_vs_cublas']:.0%}" if "cublas" in times else "") + f"  [{config}]", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write bench_linear_epilogue.json and .md here")
    p.add_argument("--activation", default="gelu_tanh", choices=list(le.ACTIVATIONS))
    args = p.parse_args(argv)
    if not require_cuda("bench_linear_epilogue"):
        return 2
    act = args.activation
    meta = {**run_meta(f"python -m benchmarks.bench_linear_epilogue --activation {act}"), "activation": act}
    rows = [measure(M, K, N, act) for M, K, N in SHAPES]
    columns = [("cublas", "cuBLAS GEMM alone"), ("ours", "ours (fused)"), ("ours_gemm", "ours, GEMM only"),
               ("eager", "eager"), ("inductor", "Inductor")]
    table = markdown(meta, f"linear + bias + {act} + residual", rows, columns)
    print(table)
    write(args.out, "bench_linear_epilogue", meta, rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
