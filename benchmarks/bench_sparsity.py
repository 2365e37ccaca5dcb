"""2:4 semi-structured sparsity microbenchmark (issue 19): cuSPARSELt and CUTLASS 2:4 GEMMs against bf16 cuBLAS and fp8.

    python -m benchmarks.bench_sparsity [--out DIR] [--ms 1,16,128,2048,8192] [--shapes NxK,...] [--[no-]mlps]
                                        [--rep-ms MS] [--taken MODEL,...]
    (CUDA; --device cpu runs a smoke test of the table on tiny shapes, the sparse columns through dense references)

``y = x @ w.T`` with x [M, K] and w [N, K] in bf16, for Llama-3-8B's attention, MLP up and MLP down weights
(4096x4096, 14336x4096, 4096x14336) at each M of ``--ms``, and (``--mlps``, on by default without ``--shapes``) the
MLP layers of BERT-base (M = 32 x 128), ViT-base (M = 32 x 197) and the zoo's Llama (benchmarks/zoo.py's
llama-eager: hidden 1024, intermediate 1024 * 11 // 4, its 8 x 1024 inference case). Columns:
  - dense bf16: ``F.linear(x, w)`` (cuBLAS), w unpruned;
  - 2:4 cuSPARSELt: w pruned to 2:4 along K by magnitude (passes/_sparse24.prune_2_4), then
    ``torch.sparse.to_sparse_semi_structured`` and ``F.linear(x, ws)``;
  - 2:4 CUTLASS: the same with ``SparseSemiStructuredTensor._FORCE_CUTLASS`` set (torch's CUTLASS kernels are
    built for SM 8.x: on an H100 they are expected to say unsupported);
  - 2:4 kpt: the sparsity-2-4 pass's op (kernels/sparse24_linear.py: cuSPARSELt where torch has it) with
    cuSPARSELt's algorithm searched for the row's M, as the pass does at compile time ("kpt_alg" in the JSON);
  - fp8 dense: ``fp8_linear_static`` (passes/_fp8_static.py), tensorwise scales, the weight quantized once and x
    on every call, ``torch._scaled_mm``;
  - fp8 + 2:4: the pruned weight's e4m3 copy compressed by ``torch._cslt_compress`` and ``torch._cslt_sparse_mm``
    with x quantized per tensor on every call (rows padded to 16), the result scaled by alpha = sx * sw, as
    torch's ``semi_sparse_scaled_mm`` does. A one-element alpha is read with ``.item()`` (a host sync, which no
    CUDA graph can capture), so alpha goes as a vector of that one value, read on the device; where cuSPARSELt
    refuses that or gets it wrong, the scalar form runs, timed without a graph ("fp8_alpha" in the JSON);
  - fp8 + 2:4 scaled after: the same product without alpha and the two scales applied to its bf16 result (no
    host sync, so it is timed as a graph replay).
Times are CUDA-graph replays (``timing_ms(..., cuda_graph=True)``: device time); a call whose capture fails is
timed without a graph (launch costs included), marked * in the table and "graph" in the JSON. A column whose
kernel raises (card, torch build, shape constraints) says unsupported, the JSON keeping the error's first 200
characters. TFLOP/s counts 2 M N K for every column (sparse ones do half the multiplications: this is the
dense-equivalent rate); "vs bf16" is dense bf16's time over the column's. "rel. err" is each sparse column
against the fp32 matmul of the same pruned weight (fp8 + 2:4: of its dequantized operands; the JSON also has it
against fp8 dense of the pruned weight); "pruning SQNR" is the pruned layer's fp32 output against the unpruned
one's, the accuracy pruning random weights costs.

``--taken bert-sdpa,vit-sdpa`` asks the pass itself instead of a shape list: each zoo model (benchmarks/zoo.py, its
first inference case, bf16) is compiled with the zoo's ``kpt[2:4+cudagraphs]`` options (the gate under "auto",
graphs captured) and run once; every layer its report says the pass took becomes a row at the M the pass saw
(one row per distinct shape; "xN" counts the layers), so "2:4 kpt vs bf16" shows whether a layer the gate took
is slower than dense. The pass's near misses for those models are printed. ``--out DIR`` writes bench_sparsity.json and bench_sparsity.md
(card, date, commit, torch, command); the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import re
import sys

import torch
import torch.nn.functional as F

from kpt_compiler.bench import relative_error, timing_ms
from kpt_compiler.kernels import sparse24_linear as kernel
from kpt_compiler.lossy_guard import sqnr_db
from kpt_compiler.passes._fp8_recipes import E4M3, quantize
from kpt_compiler.passes._fp8_static import fp8_linear_static
from kpt_compiler.passes._sparse24 import prune_2_4

from .bench_rms_norm import require_cuda, write_out
from .option_sets import OPTION_SETS
from .outputs import run_meta

LLAMA = {(4096, 4096): "Llama-3-8B attn", (14336, 4096): "Llama-3-8B MLP up", (4096, 14336): "Llama-3-8B MLP down"}
ZOO_LLAMA = 1024, 1024 * 11 // 4, 8 * 1024  # hidden, intermediate, batch x seq of benchmarks/zoo.py's llama-eager
MLPS = [("BERT-base MLP up", 3072, 768, 32 * 128), ("BERT-base MLP down", 768, 3072, 32 * 128),
        ("ViT-base MLP up", 3072, 768, 32 * 197), ("ViT-base MLP down", 768, 3072, 32 * 197),
        ("zoo llama MLP up", ZOO_LLAMA[1], ZOO_LLAMA[0], ZOO_LLAMA[2]),
        ("zoo llama MLP down", ZOO_LLAMA[0], ZOO_LLAMA[1], ZOO_LLAMA[2])]  # (layer, N, K, M)
TINY = [(64, 128), (128, 256)]
COLUMNS = ("dense bf16", "2:4 cuSPARSELt", "2:4 CUTLASS", "2:4 kpt", "fp8 dense", "fp8 + 2:4",
           "fp8 + 2:4 scaled after")
SPARSE = ("2:4 cuSPARSELt", "2:4 CUTLASS", "2:4 kpt", "fp8 + 2:4", "fp8 + 2:4 scaled after")
FP8_ROWS = 16  # cuSPARSELt's fp8 dense operand: a multiple of 16 along each dimension


@contextlib.contextmanager
def force_cutlass(on: bool):
    """``SparseSemiStructuredTensor._FORCE_CUTLASS`` set to ``on`` inside, restored after."""
    cls = torch.sparse.SparseSemiStructuredTensor
    before, cls._FORCE_CUTLASS = cls._FORCE_CUTLASS, on
    try:
        yield
    finally:
        cls._FORCE_CUTLASS = before


def why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:200]


def fp8_sparse_scaled_after(x, packed, w_scale):
    """The same product with no alpha (cuSPARSELt's one-element alpha is read with a host sync, and a per-row
    alpha is refused for fp8 on the H100: 2026-11-27-s16-sparsity-d8e0d67-dirty.json), the scales applied to
    the bf16 result by one elementwise kernel: no sync, so it can be captured."""
    m = x.shape[0]
    if m % FP8_ROWS:
        x = F.pad(x, (0, 0, 0, -m % FP8_ROWS))
    x8, sx = quantize(x, E4M3)
    out = torch._cslt_sparse_mm(packed, x8.t(), out_dtype=torch.bfloat16, transpose_result=True)[:m]
    return out * (sx * w_scale).to(out.dtype)


def fp8_sparse(x, packed, w_scale, n: int, vector: bool = True):
    """``x @ w.T`` through cuSPARSELt's fp8 2:4 GEMM, ``packed`` = ``torch._cslt_compress(w8)`` [N, K] (e4m3,
    2:4) and ``w ~= w8 * w_scale``: x quantized per tensor here, alpha = sx * w_scale scales the result.
    ``vector``: alpha as a vector, read on the device (a one-element alpha costs a host sync)."""
    m = x.shape[0]
    if m % FP8_ROWS:  # zero rows: amax and the scale unchanged
        x = F.pad(x, (0, 0, 0, -m % FP8_ROWS))
    x8, sx = quantize(x, E4M3)
    alpha = sx * w_scale
    if vector:  # one value per output row of the sparse operand (N); as long as the padded M as well
        alpha = alpha.reshape(1).expand(max(n, x.shape[0])).contiguous()
    return torch._cslt_sparse_mm(packed, x8.t(), alpha=alpha, out_dtype=torch.bfloat16, transpose_result=True)[:m]


def convert(w24: torch.Tensor, w8_24: torch.Tensor) -> dict:
    """The sparse columns' weights: name -> converted weight, or the error converting it raised (a string)."""
    out = {}
    for name, cutlass in (("2:4 cuSPARSELt", False), ("2:4 CUTLASS", True)):
        try:
            with force_cutlass(cutlass):
                out[name] = torch.sparse.to_sparse_semi_structured(w24)
        except Exception as e:  # noqa: BLE001 - not on this card or torch build: the cell says so
            out[name] = why(e)
    try:  # the pass's op, its kernel (cuSPARSELt where torch has it) with the algorithm searched per M
        out["2:4 kpt"] = kernel.compress(w24, kernel.default_backend())
    except Exception as e:  # noqa: BLE001
        out["2:4 kpt"] = why(e)
    try:
        out["fp8 + 2:4"] = torch._cslt_compress(w8_24)
    except Exception as e:  # noqa: BLE001
        out["fp8 + 2:4"] = why(e)
    return out


def time_cell(fn, device: str, rep_ms: float, graph: bool = True) -> tuple[float, bool | str | None]:
    """(median ms, how it was timed): True for CUDA-graph replays, else why not (None on the CPU)."""
    if device != "cuda":
        return timing_ms(fn, device, warmup_ms=rep_ms / 5, rep_ms=rep_ms).median, None
    how = "no graph: host sync (one-element alpha)"
    if graph:
        try:
            return timing_ms(fn, device, rep_ms=rep_ms, cuda_graph=True).median, True
        except Exception as e:  # noqa: BLE001 - the capture failed: time the launches instead
            torch.cuda.synchronize()
            how = "no graph: " + why(e)
    return timing_ms(fn, device, warmup_ms=rep_ms / 5, rep_ms=rep_ms).median, how


def run_row(layer, n, k, m, weights, device, rep_ms, g) -> dict:
    w, w24, (w8, sw), (w8_24, sw24), conv = weights
    x = torch.randn(m, k, device=device, generator=g).to(w.dtype)
    full, ref24 = x.float() @ w.float().T, x.float() @ w24.float().T
    x8, sx = quantize(x, E4M3)
    ref8 = (x8.float() * sx) @ (w8_24.float() * sw24).T
    row = {"layer": layer, "N": n, "K": k, "M": m, "ms": {}, "tflops": {}, "vs_bf16": {}, "rel_err": {},
           "graph": {}, "unsupported": {}, "sqnr_db": sqnr_db(ref24, full), "reference": device != "cuda"}
    calls = {"dense bf16": lambda: F.linear(x, w), "fp8 dense": lambda: fp8_linear_static(x, w8, sw)}
    if device != "cuda":  # to_sparse_semi_structured is CUDA only: the dense masked references
        calls.update({"2:4 cuSPARSELt": lambda: F.linear(x, w24), "2:4 CUTLASS": lambda: F.linear(x, w24),
                      "2:4 kpt": lambda d=kernel.compress(w24, "dense"): kernel.sparse24_linear(x, d), "fp8 + 2:4": lambda: fp8_linear_static(x, w8_24, sw24),
                      "fp8 + 2:4 scaled after": lambda: fp8_linear_static(x, w8_24, sw24)})
    else:
        for name in ("2:4 cuSPARSELt", "2:4 CUTLASS"):
            calls[name] = conv[name] if isinstance(conv[name], str) else (lambda ws=conv[name]: F.linear(x, ws))
        calls["fp8 + 2:4"] = conv["fp8 + 2:4"]
        calls["fp8 + 2:4 scaled after"] = conv["fp8 + 2:4"] if isinstance(conv["fp8 + 2:4"], str) else (
            lambda p=conv["fp8 + 2:4"]: fp8_sparse_scaled_after(x, p, sw24))
        calls["2:4 kpt"] = conv["2:4 kpt"]
        if not isinstance(conv["2:4 kpt"], str):
            try:
                ours = dataclasses.replace(conv["2:4 kpt"], alg_id=kernel.search_alg(conv["2:4 kpt"], m, x.dtype))
                row["kpt_alg"] = f"{ours.backend} alg {ours.alg_id}"
                calls["2:4 kpt"] = lambda: kernel.sparse24_linear(x, ours)
            except Exception as e:  # noqa: BLE001
                calls["2:4 kpt"] = why(e)
    graph = {}
    if not isinstance(calls["fp8 + 2:4"], str) and device == "cuda":  # the vector alpha, checked; else the scalar
        dense8 = None
        try:  # checked against fp8 dense of the same pruned weight
            dense8 = fp8_linear_static(x, w8_24, sw24).float()
            row["fp8_alpha"] = "vector" if relative_error(fp8_sparse(x, conv["fp8 + 2:4"], sw24, n).float(),
                                                          dense8) < 0.05 else "scalar (the vector's result was wrong)"
        except Exception as e:  # noqa: BLE001
            row["fp8_alpha"] = "scalar (raised " + why(e) + ")"
        vector = row["fp8_alpha"] == "vector"
        calls["fp8 + 2:4"] = lambda p=conv["fp8 + 2:4"]: fp8_sparse(x, p, sw24, n, vector)
        graph["fp8 + 2:4"] = vector
        with contextlib.suppress(Exception):
            row["fp8_sparse_vs_fp8_dense"] = relative_error(calls["fp8 + 2:4"]().float(), dense8)
    refs = {"2:4 cuSPARSELt": ref24, "2:4 CUTLASS": ref24, "2:4 kpt": ref24, "fp8 + 2:4": ref8,
            "fp8 + 2:4 scaled after": ref8}
    for name in COLUMNS:
        if isinstance(calls[name], str):
            row["unsupported"][name] = calls[name]
            continue
        try:
            with force_cutlass(name == "2:4 CUTLASS"):
                if name in refs:
                    row["rel_err"][name] = relative_error(calls[name]().float(), refs[name])
                t, how = time_cell(calls[name], device, rep_ms, graph.get(name, True))
        except Exception as e:  # noqa: BLE001 - the kernel raised: unsupported, not a crash
            row["rel_err"].pop(name, None)
            row["unsupported"][name] = why(e)
            continue
        row["ms"][name], row["tflops"][name] = t, 2 * m * n * k / (t * 1e-3) / 1e12
        if how is not None:
            row["graph"][name] = how
    for name, t in row["ms"].items():
        if "dense bf16" in row["ms"] and name != "dense bf16":
            row["vs_bf16"][name] = row["ms"]["dense bf16"] / t
    print(f"{layer} {n}x{k} M={m}: " + "  ".join(f"{c} {row['ms'][c]:.4f} ms" if c in row["ms"] else f"{c} "
                                                 "unsupported" for c in COLUMNS), flush=True)
    return row


def run(layers, device: str, rep_ms: float) -> list[dict]:
    """``layers``: (layer, N, K, [M, ...]); one row per M."""
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the CPU's references compared in fp32
    for layer, n, k, ms in layers:
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
        w24 = prune_2_4(w)
        q, q24 = quantize(w, E4M3), quantize(w24, E4M3)
        conv = convert(w24, q24[0]) if device == "cuda" else {}
        rows += [run_row(layer, n, k, m, (w, w24, q, q24, conv), device, rep_ms, g) for m in ms]
    return rows


TAKEN_NOTE = re.compile(r"^(?P<label>.+?): (?P<M>\d+)x(?P<K>\d+) @ \d+x(?P<N>\d+), (already 2:4|pruned to 2:4)")


def taken_layers(model, inputs, options) -> tuple[list[tuple[str, int, int, int]], list[str]]:
    """Compile ``model`` with the backend and ``options``, run it once on ``inputs`` without gradients; the layers
    the sparsity-2-4 pass took, as (label, N, K, M) in graph order, and its near misses, from the reports."""
    import kpt_compiler

    kpt_compiler.clear_reports()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="kernelpytorch", options=options)(*inputs)
    taken, misses = [], []
    for report in kpt_compiler.reports():
        for record in report.passes():
            if record.name != "sparsity-2-4":
                continue
            for note in record.notes:
                m = TAKEN_NOTE.match(note)
                if m:
                    taken.append((m["label"], int(m["N"]), int(m["K"]), int(m["M"])))
                elif note.startswith("near miss"):
                    misses.append(note)
    return taken, misses


def zoo_layers(models: list[str], device: str) -> list[tuple[str, int, int, list[int]]]:
    """``--taken``: the layers the pass takes in each zoo model, one per distinct (N, K, M), in bench rows."""
    from . import measure, zoo

    layers, done = [], set()
    for entry, case in zoo.cases("full", device, models):
        if case.task != "inference" or entry.name in done:
            continue
        done.add(entry.name)
        model, make_inputs = measure.prepare(entry, device, torch.bfloat16)
        inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x
                       for x in make_inputs(case.batch, case.seq, device))
        taken, misses = taken_layers(model.eval(), inputs, OPTION_SETS["2:4+cudagraphs"])
        print(f"{entry.name} {entry.shape(case)}: the pass took {len(taken)} layers; near misses:", *misses,
              sep="\n  ", flush=True)
        shapes: dict[tuple[int, int, int], list[str]] = {}
        for label, n, k, m in taken:
            shapes.setdefault((n, k, m), []).append(label)
        layers += [(f"{entry.name}: {labels[0]} x{len(labels)}", n, k, [m]) for (n, k, m), labels in shapes.items()]
        del model, inputs
        measure.cleanup(device)
    return layers


def markdown(rows: list[dict], command: str, card: str, commit: str | None) -> str:
    ref = card == "cpu"
    timed = ("wall clock on the CPU: a smoke test, not a figure. The 2:4 columns are the dense masked REFERENCE "
             "(F.linear with the pruned weight) and fp8 + 2:4 is fp8_linear_static of the pruned weight: no sparse "
             "kernel ran, their times mean nothing (and dense bf16 runs in fp32 here)") if ref else \
        "CUDA-graph replays, median (device time); * timed without a graph (its capture failed: see the JSON)"
    fast = [c for c in COLUMNS if c != "dense bf16"]
    head = ([f"{c} ms" for c in COLUMNS] + [f"{c} TFLOP/s" for c in COLUMNS] + [f"{c} vs bf16" for c in fast]
            + [f"{c} rel. err" for c in SPARSE] + ["pruning SQNR dB"])
    lines = [f"# 2:4 semi-structured sparsity GEMM on {card}", "",
             f"- date: {datetime.date.today()}; commit: {commit}; torch {torch.__version__}",
             f"- command: `{command}`", f"- times: {timed}", "",
             "| layer | N x K | M | " + " | ".join(head) + " |", "|" + " --- |" * (3 + len(head))]
    for r in rows:
        def cell(c, fmt, table):
            if c not in table:
                return "unsupported" if table is r["ms"] and c in r["unsupported"] else "-"
            untimed_graph = table is r["ms"] and r["graph"].get(c, True) is not True
            return fmt(table[c]) + ("*" if untimed_graph else "")
        cells = ([cell(c, "{:.4f}".format, r["ms"]) for c in COLUMNS]
                 + [cell(c, "{:.1f}".format, r["tflops"]) for c in COLUMNS]
                 + [cell(c, "{:.2f}x".format, r["vs_bf16"]) for c in fast]
                 + [cell(c, "{:.1e}".format, r["rel_err"]) for c in SPARSE] + [f"{r['sqnr_db']:.2f}"])
        lines.append(f"| {r['layer']} | {r['N']}x{r['K']} | {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write bench_sparsity.json and bench_sparsity.md here")
    p.add_argument("--ms", default="1,16,128,2048,8192", help="comma-separated M values of the --shapes rows")
    p.add_argument("--shapes", default=None, help="N x K shapes, comma-separated, instead of Llama-3-8B's "
                   "4096x4096,14336x4096,4096x14336 (cpu: 64x128,128x256)")
    p.add_argument("--mlps", action=argparse.BooleanOptionalAction, default=None,
                   help="add the MLP layers of BERT-base, ViT-base and the zoo's Llama at their own M (default: "
                   "on for CUDA without --shapes)")
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--taken", default=None, help="zoo models (comma-separated): time the layers the pass takes "
                   "in each, at their own M, instead of --shapes and --mlps")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke test of the table on tiny shapes (dense references, wall-clock times)")
    args = p.parse_args(argv)
    if args.taken and args.device != "cuda":
        p.error("--taken compiles zoo models with the 2:4 pass's sparse kernels: CUDA only (--device cuda)")
    if args.device == "cuda":
        error = require_cuda("bench_sparsity")
        if error:
            print(error, file=sys.stderr)
            return 2
    ms = [int(m) for m in args.ms.split(",") if m]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else \
        list(LLAMA) if args.device == "cuda" else TINY
    layers = [(LLAMA.get(s, "tiny" if args.device == "cpu" else "-"), *s, ms) for s in shapes]
    if args.taken:
        layers = zoo_layers(args.taken.split(","), args.device)
    elif args.mlps or (args.mlps is None and args.device == "cuda" and not args.shapes):
        layers += [(layer, n, k, [m]) for layer, n, k, m in MLPS]
    rows = run(layers, args.device, args.rep_ms)
    meta = {**run_meta("bench_sparsity", argv, args.device), "columns": list(COLUMNS),
            "cusparselt": torch.backends.cusparselt.version()}
    table = markdown(rows, meta["command"], meta["card"], meta["commit"])
    write_out(args.out, "bench_sparsity", meta, rows, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
