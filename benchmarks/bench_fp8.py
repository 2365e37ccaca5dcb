"""fp8 linear layers against bf16, quantization included: what the fp8 pass buys per layer.

    python -m benchmarks.bench_fp8 [--out DIR]    (CUDA with fp8: compute capability 8.9 or newer)

For each shape (M tokens, K input features, N output features) it times, in one run on one card, with
``torch.compile`` (Inductor) around each so the scaling and casts fuse as they would in a model:
  - bf16 ``F.linear`` (cuBLAS);
  - ``fp8_linear`` (passes/_fp8_recipes.py) with each recipe: the amax, the casts and ``torch._scaled_mm``;
forward alone (inference, weights quantized on every call as the pass does today) and forward + backward.
TFLOP/s counts 2*M*K*N per GEMM (three GEMMs for forward + backward); the speed-up is over bf16.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F

from benchmarks.outputs import write_bench
from kpt_compiler.bench import git_commit, median_ms

SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 8192, 8192), (2048, 4096, 4096), (1024, 2048, 1024),
          (16, 4096, 14336)]
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _time(fn, x, w, backward: bool) -> float:
    if not backward:
        with torch.no_grad():
            return median_ms(lambda: fn(x, w), "cuda")
    grad = torch.randn(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype)
    return median_ms(lambda: torch.autograd.grad(fn(x, w), (x, w), grad), "cuda")


def rows() -> list[dict]:
    from kpt_compiler.passes._fp8_recipes import fp8_linear

    out = []
    for M, K, N in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5).requires_grad_()
        for backward in (False, True):
            torch._dynamo.reset()
            times = {"bf16": _time(torch.compile(F.linear), x, w, backward)}
            for recipe in RECIPES:
                if recipe == "rowwise_with_gw_hp" and not backward:
                    continue  # the same forward as rowwise
                fn = torch.compile(lambda x, w, r=recipe: fp8_linear(x, w, recipe=r))
                times[recipe] = _time(fn, x, w, backward)
            flops = 2 * M * K * N * (3 if backward else 1)
            out.append({"shape": [M, K, N], "task": "forward+backward" if backward else "forward", "ms": times,
                        "tflops": {k: flops / (t * 1e9) for k, t in times.items()},
                        "speedup": {k: times["bf16"] / t for k, t in times.items() if k != "bf16"}})
            print(M, K, N, out[-1]["task"], {k: round(t, 3) for k, t in times.items()}, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for bench_fp8.json and bench_fp8.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("bench_fp8 needs a CUDA GPU with fp8 (compute capability 8.9 or newer)")
        return 1
    table = rows()
    card, commit = torch.cuda.get_device_name(), git_commit()
    lines = [f"fp8 linear layers against bf16, quantization included, torch.compile around each; {card}, torch "
             f"{torch.__version__}, {datetime.date.today()}, commit {commit}; command: python -m benchmarks.bench_fp8",
             "", "| M, K, N | task | bf16 ms | " + " | ".join(f"{r} ms (x bf16)" for r in RECIPES) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in RECIPES) + " |"]
    for r in table:
        cells = [f"{r['ms'][k]:.3f} ({r['speedup'][k]:.2f}x)" if k in r["ms"] else "-" for k in RECIPES]
        lines.append(f"| {','.join(map(str, r['shape']))} | {r['task']} | {r['ms']['bf16']:.3f} | "
                     + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_bench(args.out, "bench_fp8", {"card": card, "rows": table}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
