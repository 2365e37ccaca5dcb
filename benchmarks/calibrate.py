"""Calibrate the cost model on this card: measure each table and write the card's calibration file.

    KPT_COMMIT=$(git rev-parse --short HEAD) python -m benchmarks.calibrate [--tables a,b] [--out DIR]   (CUDA)

Writes ``<out>/<card>.sm<XY>.json`` (default out: kpt_compiler/calibration, where the cost model reads it;
the format is calibration/README.md), merging into the card's file if there is one: the tables measured
now replace theirs, the others stay with the runs that measured them. Every entry names its run (command,
date, commit, torch and triton versions), and every device-time table the hash of the kernel source it was
measured with (``kpt_compiler.cost_model.source_hash``). bf16 throughout. Tables:

  gated_linear             ours vs Inductor, device time, silu, at bench_linear_epilogue.SHAPES
                           (bench_gated_linear.measure: two cuBLAS GEMMs and Inductor's pointwise kernel)
  linear_epilogue          ours vs Inductor, device time, bias + gelu_tanh + residual, same shapes
  linear_epilogue_vs_gemm  ours with bias + residual and no activation vs the cuBLAS GEMM alone (Inductor
                           folds those into cuBLAS and the next kernel), same shapes
  horizontal               merged_linear against three linears, both compiled by Inductor, marginal device
                           time (bench_dispatch.measure): grouped-query q/k/v at K=1024, multi-head at 1024
                           and at BERT's 768 x 16384 rows
  host                     host microseconds per call at 128 rows (bench_dispatch.measure): ours as the
                           inference op and as the triton_op inside an Inductor graph, Inductor's calls
  ceilings                 the bf16 GEMM rate at 8192^3, the copy bandwidth, and a small GEMM's fixed cost
                           (what the cost model estimates Inductor's device time from)
  fp8_linear_<recipe>      the fp8 pass's layer (passes/_fp8_recipes.py, quantization included) against the bf16
  fp8_linear_<recipe>_train  linear, both under torch.compile, forward / forward + backward (bench_fp8), at
                           FP8_SHAPES; recipes tensorwise, rowwise (not in the default --tables: ask for them)
  fp8_linear_<g>_static    inference with the weight quantized beforehand (passes/_fp8_static.py), forward
  fp4_linear_<format>      the fp4 kernel (kernels/fp4_linear.py, default config) against the bf16 linear
                           (cuBLAS), CUDA-graph replays over weight copies that together take 3x the L2
                           (bench_fp4.copies_for), at FP4_SHAPES; formats nvfp4, mxfp4 (not in the default
                           --tables: ask for them)
  sparse24_linear          the 2:4 sparse linear (kernels/sparse24_linear.py: torch's cuSPARSELt, else CUTLASS)
                           against the dense bf16 linear, CUDA-graph replays, at SPARSE_SHAPES (not in the
                           default --tables)

``--tables`` runs some of them (each call adds its run to the file).
"""

from __future__ import annotations

import argparse
import importlib
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kpt_compiler import cost_model as cm
from kpt_compiler.bench import git_commit

TABLES = ("gated_linear", "linear_epilogue", "linear_epilogue_vs_gemm", "horizontal", "host", "ceilings")
FP8_TABLES = tuple(f"fp8_linear_{r}{t}" for r in ("tensorwise", "rowwise") for t in ("", "_train", "_static"))
FP8_SHAPES = [(M, K, N) for M in (128, 2048, 8192) for K, N in ((4096, 4096), (4096, 14336), (14336, 4096))]
FP4_TABLES = ("fp4_linear_nvfp4", "fp4_linear_mxfp4")
FP4_SHAPES = [(M, K, N) for M in (1, 2, 4, 16, 64, 256) for K, N in ((4096, 4096), (4096, 14336), (14336, 4096))]
SPARSE_TABLES = ("sparse24_linear",)
# the Llama layers, BERT-base's and ViT-base's MLP, the zoo Llama's MLP; decode to prefill sizes
SPARSE_SHAPES = [(M, K, N) for M in (16, 128, 1024, 8192) for K, N in (
    (4096, 4096), (4096, 14336), (14336, 4096), (768, 3072), (3072, 768), (1024, 2816), (2816, 1024),
    # the attention projections of BERT and ViT (768) and the zoo Llama (q and o 1024, k and v 256): without them
    # the nearest point of a 768x768 layer was the 1024x2816 MLP's, 3.7x off in N
    (768, 768), (1024, 1024), (1024, 256))]
# (M, K, widths) of the q/k/v cases: grouped-query as the zoo Llama (K=1024, k and v a quarter), multi-head
HORIZONTAL = [(1, 1024, "gqa"), (128, 1024, "gqa"), (1024, 1024, "gqa"), (8192, 1024, "gqa"), (1024, 1024, "mha"),
              (8192, 1024, "mha"), (16384, 768, "mha")]
HOST_ROWS = 128  # host time hardly depends on M


def _commit() -> str:
    """KPT_COMMIT where given (the GPU machine's copy of the repository has a stale git HEAD), else git's,
    marked "+dirty" when the tree has changes."""
    return git_commit() or "unknown"


def new_run(argv: list[str]) -> dict:
    import triton

    return {"command": "python -m benchmarks.calibrate " + shlex.join(argv), "date": str(datetime.date.today()),
            "commit": _commit(), "torch": torch.__version__, "triton": triton.__version__}


def merge(old: dict | None, device: dict, run: dict, measured: dict) -> dict:
    """The card's file after this run: ``measured`` maps table names to what they measured (device-time tables:
    ``{"source": hash, "points": [...]}``; "host": ``{kind: {...}}``; "ceilings": ``{...}``), each entry
    without its run, which this adds. Runs no entry names any more are dropped and the rest renumbered."""
    data = old or {"device": device, "runs": [], "ceilings": None, "device_time": {}, "host_us": {}}
    if data["device"] != device:
        raise ValueError(f"the file is {data['device']}'s, this card is {device}")
    runs = data["runs"] + ([] if run in data["runs"] else [run])
    index = runs.index(run)
    for table, value in measured.items():
        if table == "ceilings":
            data["ceilings"] = {**value, "run": index}
        elif table == "host":
            data["host_us"].update({kind: {**v, "run": index} for kind, v in value.items()})
        else:
            points = [{**p, "run": index} for p in value["points"]]
            data["device_time"].setdefault(table, {})["bfloat16"] = {"source": value["source"], "points": points}
    entries = [data["ceilings"]] if data["ceilings"] else []
    entries += list(data["host_us"].values())
    entries += [p for by_dtype in data["device_time"].values() for t in by_dtype.values() for p in t["points"]]
    used = sorted({e["run"] for e in entries})
    renumber = {old_index: new for new, old_index in enumerate(used)}
    for e in entries:
        e["run"] = renumber[e["run"]]
    data["runs"] = [runs[i] for i in used]
    return data


# ---------------------------------------------------------------------------------------------- measuring


# device-time tables of our GEMM kernels: (the bench module, the activation, what ours is timed against, the
# kernel module whose source keys the table)
GEMM_TABLES = {
    "gated_linear": ("bench_gated_linear", "silu", "inductor", "gated_linear"),
    "linear_epilogue": ("bench_linear_epilogue", "gelu_tanh", "inductor", "linear_epilogue"),
    "linear_epilogue_vs_gemm": ("bench_linear_epilogue", "none", "cublas", "linear_epilogue"),
}


def measure_gemm_table(table: str) -> dict:
    """One GEMM table: the bench's ``measure`` at every shape of bench_linear_epilogue.SHAPES, device time only,
    ours against Inductor (or against cuBLAS alone)."""
    from benchmarks.bench_linear_epilogue import SHAPES

    bench_name, activation, theirs, kernel = GEMM_TABLES[table]
    bench = importlib.import_module(f"benchmarks.{bench_name}")
    rows = [bench.measure(M, K, N, activation, variants=(theirs,), launches=False) for M, K, N in SHAPES]
    points = [{"M": r["shape"][0], "K": r["shape"][1], "N": r["shape"][2],
               "speedup": round(r[f"ours_vs_{theirs}"], 4), "ours_us": round(r["ms"]["ours"] * 1e3, 2),
               "theirs_us": round(r["ms"][theirs] * 1e3, 2)} for r in rows]
    return {"source": cm.source_hash(importlib.import_module(f"kpt_compiler.kernels.{kernel}")), "points": points}


def _dispatch_case(M: int, K: int, prefix: str) -> dict:
    """bench_dispatch's cases at M rows and input width K whose names start with ``prefix``, by name."""
    from benchmarks.bench_dispatch import cases

    return {name: (seq, copies, fns) for name, seq, copies, fns in cases(M, K) if name.startswith(prefix)}


def measure_horizontal() -> dict:
    from benchmarks.bench_dispatch import measure
    from kpt_compiler.passes.merge_parallel_linears import merged_linear

    points = []
    with torch.no_grad():
        for M, K, form in HORIZONTAL:
            prefix = "qkv: " if form == "gqa" else "qkv-mha: "
            found = _dispatch_case(M, K, prefix)
            (three,) = [v for n, v in found.items() if "three" in n]
            (one,) = [v for n, v in found.items() if "one linear" in n]
            theirs = measure(prefix + "three", M, three[0], three[1], {}, variants=("inductor",))
            ours = measure(prefix + "merged", M, one[0], one[1], {}, variants=("inductor",))
            N = K + K // 2 if form == "gqa" else 3 * K
            t, o = theirs["device_us"]["inductor"], ours["device_us"]["inductor"]
            points.append({"M": M, "K": K, "N": N, "speedup": round(t / o, 4), "ours_us": round(o, 2),
                           "theirs_us": round(t, 2)})
    return {"source": cm.source_hash(merged_linear), "points": points}


def measure_host() -> dict:
    from benchmarks.bench_dispatch import measure

    def host(name, prefix, variants):
        (case,) = [v for n, v in _dispatch_case(HOST_ROWS, 1024, prefix).items() if n == name]
        return measure(name, HOST_ROWS, *case, variants=variants)["host_us"]

    out = {}
    with torch.no_grad():
        both = ("inductor", "inductor+inference", "inductor+triton")
        gated = host("gated_linear", "gated_linear", both)
        out["gated_linear"] = {"inference": gated["inductor+inference"], "triton": gated["inductor+triton"],
                               "inductor": gated["inductor"]}
        epi = host("linear_epilogue (residual)", "linear_epilogue", both)
        ours = {"inference": epi["inductor+inference"], "triton": epi["inductor+triton"]}
        out["linear_epilogue"] = {**ours, "inductor": epi["inductor"]}
        alone = host("linear alone", "linear alone", ("inductor",))
        out["linear_epilogue_vs_gemm"] = {**ours, "inductor": alone["inductor"]}
        three = host("qkv: three linears", "qkv: ", ("inductor",))
        merged = host("qkv: one linear over cat(Wq Wk Wv)", "qkv: ", ("inductor",))
        # the merged form is Inductor's own code either way: one figure for both of our forms
        out["horizontal"] = {"inference": merged["inductor"], "triton": merged["inductor"],
                             "inductor": three["inductor"]}
    return {kind: {k: round(v, 2) for k, v in value.items()} | {"M": HOST_ROWS} for kind, value in out.items()}


def measure_fp8(table: str) -> dict:
    """The fp8 pass's layer against the bf16 linear at FP8_SHAPES, both compiled by Inductor, device time."""
    import benchmarks.bench_fp8 as bench
    from kpt_compiler.passes import _fp8_recipes

    from kpt_compiler.passes import _fp8_static

    recipe = table.removeprefix("fp8_linear_").removesuffix("_train").removesuffix("_static")
    backward, static = table.endswith("_train"), table.endswith("_static")
    points = []
    for M, K, N in FP8_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16).requires_grad_(not static)
        w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5).requires_grad_(not static)
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no dynamic shapes
        theirs = bench._time(torch.compile(F.linear), x, w, backward)
        if static:  # the weight quantized once, outside the timed call, as an inference graph's parameter
            q = _fp8_static.Fp8Weight(w, recipe, transposed=False)
            fn = torch.compile(lambda x, w: _fp8_static.fp8_linear_static(x, q.w8, q.scale, granularity=recipe))
        else:
            fn = torch.compile(lambda x, w: _fp8_recipes.fp8_linear(x, w, recipe=recipe))
        ours = bench._time(fn, x, w, backward)
        points.append({"M": M, "K": K, "N": N, "speedup": round(theirs / ours, 4), "ours_us": round(ours * 1e3, 2),
                       "theirs_us": round(theirs * 1e3, 2)})
    return {"source": cm.source_hash(_fp8_static if static else _fp8_recipes), "points": points}


def measure_fp4(table: str) -> dict:
    """The fp4 kernel against the bf16 linear at FP4_SHAPES, device time, each call on the next of several
    weight copies (a layer's weight is read from memory in decoding, not from L2)."""
    from benchmarks.bench_fp4 import copies_for, rotating
    from kpt_compiler.bench import median_ms
    from kpt_compiler.kernels import _fp4_format as fmt
    from kpt_compiler.kernels import fp4_linear as kernel

    f = fmt.FORMATS[table.removeprefix("fp4_linear_")]
    points = []
    for M, K, N in FP4_SHAPES:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ws = [w] + [w.clone() for _ in range(copies_for(2 * N * K, "cuda") - 1)]
        qs = [fmt.quantize(w, f)]
        qs += [fmt.quantize(w, f) for _ in range(copies_for(qs[0].nbytes(), "cuda") - 1)]
        theirs = median_ms(rotating(lambda w: F.linear(x, w), ws), "cuda", cuda_graph=True)
        ours = median_ms(rotating(lambda q: kernel.fp4_linear(x, q), qs), "cuda", cuda_graph=True)
        points.append({"M": M, "K": K, "N": N, "speedup": round(theirs / ours, 4), "ours_us": round(ours * 1e3, 2),
                       "theirs_us": round(theirs * 1e3, 2)})
    return {"source": cm.source_hash(kernel), "points": points}


def measure_sparse24(table: str) -> dict:
    """The 2:4 sparse linear (kernels/sparse24_linear.py, torch's default sparse kernel) against the dense bf16
    linear at SPARSE_SHAPES, device time; Gaussian weights pruned by magnitude."""
    from kpt_compiler.bench import median_ms
    from kpt_compiler.kernels import sparse24_linear as kernel
    from kpt_compiler.passes._sparse24 import prune_2_4

    points = []
    for M, K, N in SPARSE_SHAPES:
        w = prune_2_4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        s = kernel.compress(w, kernel.default_backend())
        s.alg_id = kernel.search_alg(s, M, x.dtype)  # as the pass does at compile time
        theirs = median_ms(lambda: F.linear(x, w), "cuda", cuda_graph=True)
        ours = median_ms(lambda: kernel.sparse24_linear(x, s), "cuda", cuda_graph=True)
        points.append({"M": M, "K": K, "N": N, "speedup": round(theirs / ours, 4), "ours_us": round(ours * 1e3, 2),
                       "theirs_us": round(theirs * 1e3, 2), "kernel": s.backend})
    return {"source": cm.source_hash(kernel), "points": points}


def measure_ceilings() -> dict:
    from kpt_compiler.bench import copy_bandwidth, median_ms

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192 ** 3 / (median_ms(lambda: a @ b, "cuda", cuda_graph=True) * 1e-3) / 1e12
    tbps = copy_bandwidth()
    x = torch.randn(128, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    small_us = median_ms(lambda: F.linear(x, w), "cuda", cuda_graph=True) * 1e3
    ideal_us = max(2 * 128 * 1024 * 1024 / (tflops * 1e6), 2 * (2 * 128 * 1024 + 1024 * 1024) / (tbps * 1e6))
    return {"tflops": round(tflops, 1), "copy_tbps": round(tbps, 3), "kernel_floor_us": round(small_us - ideal_us, 2),
            "note": "tflops: bf16 8192^3 GEMM; kernel_floor_us: a 128x1024x1024 GEMM's device time over its ideal"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, from: {', '.join(TABLES)}")
    p.add_argument("--out", default=str(cm.CALIBRATION_DIR), help="the folder of calibration files")
    args = p.parse_args(argv)
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    known = TABLES + FP8_TABLES + FP4_TABLES + SPARSE_TABLES
    unknown = sorted(set(tables) - set(known))
    if unknown:
        p.error(f"unknown table(s) {unknown}; known: {', '.join(known)}")
    if not torch.cuda.is_available():
        print("error: benchmarks.calibrate measures this card's CUDA kernels and torch.cuda.is_available() is "
              "False; run it on the GPU machine", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    device = {"name": props.name, "capability": [props.major, props.minor]}
    run = new_run(argv)
    path = Path(args.out) / cm.calibration_file(props.name, (props.major, props.minor))
    measures = {"horizontal": measure_horizontal, "host": measure_host, "ceilings": measure_ceilings}
    for table in tables:  # written after each table, so a run cut short keeps what it measured
        measured = measures[table]() if table in measures else measure_fp8(table) if table in FP8_TABLES \
            else measure_fp4(table) if table in FP4_TABLES else measure_sparse24(table) if table in SPARSE_TABLES \
            else measure_gemm_table(table)
        old = json.loads(path.read_text()) if path.exists() else None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merge(old, device, run, {table: measured}), indent=1) + "\n")
        print(f"wrote {path}: {table}: " + json.dumps(measured)[:600], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
