"""fp8 linear layers against bf16, quantization included: what the fp8 pass buys per layer.

    python -m benchmarks.bench_fp8 [--out DIR]    (CUDA with fp8: compute capability 8.9 or newer)

For each shape (M tokens, K input features, N output features) it times, in one run on one card, with
``torch.compile`` (Inductor) around each so the scaling and casts fuse as they would in a model:
  - bf16 ``F.linear`` (cuBLAS);
  - ``fp8_linear`` (passes/_fp8_recipes.py) with each recipe: the amax, the casts and ``torch._scaled_mm``;
  - where torchao imports, torchao's float8 (benchmarks/torchao_fp8.py) on an ``nn.Linear`` with the same weight,
    tensorwise and rowwise: for forward + backward its training ``Float8Linear``
    (``Float8LinearConfig.from_recipe_name``); for forward its inference quantization (``quantize_`` with
    ``Float8DynamicActivationFloat8WeightConfig``, ``PerTensor()`` / ``PerRow()``), which quantizes the weight once
    where ``fp8_linear`` quantizes it on every call. Without torchao the run says why and leaves those columns out;
  - forward only: ``fp8_linear_static`` (passes/_fp8_static.py), the weight quantized beforehand, as the pass
    does for an inference graph's parameters ("<granularity> static");
forward alone (inference) and forward + backward.
TFLOP/s counts 2*M*K*N per GEMM (three GEMMs for forward + backward); the speed-up is over bf16.

torchao's columns are timed after all the others: its training conversion patches Inductor's Triton min/max code
for the rest of the process (benchmarks/torchao_fp8.py), so the other columns compile as they would without it.
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
STATIC_COLUMNS = ("tensorwise static", "rowwise static")  # forward, the weight quantized beforehand
TORCHAO_RECIPES = ("tensorwise", "rowwise")  # training recipes; for forward, the inference granularity of each
TORCHAO_COLUMNS = tuple(f"torchao {r}" for r in TORCHAO_RECIPES)


def _time(fn, x, w, backward: bool) -> float:
    if not backward:
        with torch.no_grad():
            return median_ms(lambda: fn(x, w), x.device.type)
    grad = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    return median_ms(lambda: torch.autograd.grad(fn(x, w), (x, w), grad), x.device.type)


def _operands(M: int, K: int, N: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g) * K ** -0.5).requires_grad_()
    return x, w


def _torchao_layer(recipe: str, w: torch.Tensor, backward: bool) -> torch.nn.Module:
    """An ``nn.Linear`` holding ``w`` (a copy), converted by torchao: training ``Float8Linear`` with ``recipe``
    for forward + backward, else the inference quantization at the recipe's granularity."""
    from benchmarks import torchao_fp8

    N, K = w.shape
    layer = torch.nn.Linear(K, N, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    if backward:
        return torchao_fp8.convert_training(layer, recipe, keep_output=False)
    layer.weight.requires_grad_(False)
    return torchao_fp8.convert_inference(layer, recipe.removesuffix("wise"), keep_output=False)


def _time_torchao(recipe: str, x: torch.Tensor, w: torch.Tensor, backward: bool) -> float:
    layer = _torchao_layer(recipe, w, backward)
    fn = torch.compile(layer)
    return _time(lambda x, w: fn(x), x, layer.weight, backward)


def _fill(row: dict) -> dict:
    M, K, N = row["shape"]
    flops = 2 * M * K * N * (3 if row["task"] == "forward+backward" else 1)
    times = row["ms"]
    row["tflops"] = {k: flops / (t * 1e9) for k, t in times.items()}
    row["speedup"] = {k: times["bf16"] / t for k, t in times.items() if k != "bf16"}
    return row


def rows(torchao: bool = False) -> list[dict]:
    """One row per shape and task; ``torchao``: add torchao's columns (``TORCHAO_COLUMNS``)."""
    from kpt_compiler.passes import _fp8_static
    from kpt_compiler.passes._fp8_recipes import fp8_linear

    out = []
    for M, K, N in SHAPES:
        x, w = _operands(M, K, N)
        for backward in (False, True):
            torch._dynamo.reset()
            times = {"bf16": _time(torch.compile(F.linear), x, w, backward)}
            for recipe in RECIPES:
                if recipe == "rowwise_with_gw_hp" and not backward:
                    continue  # the same forward as rowwise
                fn = torch.compile(lambda x, w, r=recipe: fp8_linear(x, w, recipe=r))
                times[recipe] = _time(fn, x, w, backward)
            if not backward:  # inference: the weight quantized once, as the pass does for a parameter
                for granularity in ("tensorwise", "rowwise"):
                    q = _fp8_static.Fp8Weight(w, granularity, transposed=False)
                    fn = torch.compile(lambda x, w, q=q, g=granularity:
                                       _fp8_static.fp8_linear_static(x, q.w8, q.scale, granularity=g))
                    times[f"{granularity} static"] = _time(fn, x, w, backward)
            out.append(_fill({"shape": [M, K, N], "task": "forward+backward" if backward else "forward",
                              "ms": times}))
            print(M, K, N, out[-1]["task"], {k: round(t, 3) for k, t in times.items()}, flush=True)
        del x, w
    if torchao:  # last: see the module's docstring
        for row in out:
            x, w = _operands(*row["shape"])
            backward = row["task"] == "forward+backward"
            torch._dynamo.reset()
            for recipe in TORCHAO_RECIPES:
                column = f"torchao {recipe}"
                try:
                    row["ms"][column] = _time_torchao(recipe, x, w, backward)
                except Exception as e:  # one failing column is recorded; the others go on
                    row.setdefault("errors", {})[column] = f"{type(e).__name__}: {e}"[:500]
                    print(*row["shape"], row["task"], column, "failed:", row["errors"][column], flush=True)
            _fill(row)
            print(*row["shape"], row["task"], {k: round(row["ms"][k], 3) for k in TORCHAO_COLUMNS if k in row["ms"]},
                  flush=True)
            del x, w
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for bench_fp8.json and bench_fp8.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("bench_fp8 needs a CUDA GPU with fp8 (compute capability 8.9 or newer)")
        return 1
    from benchmarks import torchao_fp8

    why = torchao_fp8.available()
    torchao = f"torchao {torchao_fp8.version()}" if why is None else f"torchao: {why}"
    print(torchao, flush=True)
    table = rows(torchao=why is None)
    columns = RECIPES + STATIC_COLUMNS + (TORCHAO_COLUMNS if why is None else ())
    card, commit = torch.cuda.get_device_name(), git_commit()
    lines = [f"fp8 linear layers against bf16, quantization included, torch.compile around each; {card}, torch "
             f"{torch.__version__}, {torchao}, {datetime.date.today()}, commit {commit}; command: python -m "
             f"benchmarks.bench_fp8" + ("; torchao's forward quantizes the weight once (inference quantize_), its "
                                        "forward+backward is Float8Linear" if why is None else ""),
             "", "| M, K, N | task | bf16 ms | " + " | ".join(f"{r} ms (x bf16)" for r in columns) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in columns) + " |"]
    for r in table:
        cells = [f"{r['ms'][k]:.3f} ({r['speedup'][k]:.2f}x)" if k in r["ms"] else "-" for k in columns]
        lines.append(f"| {','.join(map(str, r['shape']))} | {r['task']} | {r['ms']['bf16']:.3f} | "
                     + " | ".join(cells) + " |")
    errors = [f"{','.join(map(str, r['shape']))} {r['task']} {k}: {e}"
              for r in table for k, e in r.get("errors", {}).items()]
    if errors:
        lines += ["", "Failed:", *(f"- {e}" for e in errors)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_bench(args.out, "bench_fp8", {"card": card, "torchao": torchao_fp8.version() if why is None else None,
                                            "torchao_missing": why, "rows": table}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
