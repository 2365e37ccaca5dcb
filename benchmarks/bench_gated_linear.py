"""Gated linear (Llama's MLP gate/up) microbenchmark: the fused Triton kernel against cuBLAS, eager, Inductor.

    python -m benchmarks.bench_gated_linear [--out DIR] [--activation silu]    (CUDA only)

For each bf16 shape (M tokens, K in, N out per projection), in one run on one card, act(x @ Wg^T) * (x @ Wu^T)
timed as:
  - cuBLAS: F.linear(x, [Wg; Wu]) alone, one GEMM of the same FLOPs into [M, 2N] with no epilogue: the
    ceiling (what a checkpoint with a fused gate_up weight runs before its activation);
  - ours: torch.ops.kpt.gated_linear (both products and act(g) * u in one kernel, x read once): on Hopper
    from 1024 rows the persistent TMA kernel, else the tiled pointer kernel;
  - ours, pointer kernel only: the same with the TMA kernel left out (where the op takes it);
  - eager: two F.linear, the activation, the product (four kernels);
  - Inductor: torch.compile of the eager sequence (default mode: two cuBLAS GEMMs and one pointwise kernel).
TFLOP/s counts 2 * 2*M*N*K. "ours / cuBLAS" is ours as a fraction of the one-GEMM ceiling; the target on an
H100 is 85% or more at 4096 and up. rel. err is against the float32 computation.
"""

from __future__ import annotations

import argparse

import torch.nn.functional as F

from benchmarks.bench_linear_epilogue import (SHAPES, make_row, best_config, compiled, markdown, randn,
                                              require_cuda, run_meta, time_all, write)
from kpt_compiler.bench import relative_error
from kpt_compiler.kernels import _tma_gemm as tg
from kpt_compiler.kernels import gated_linear as gl


def measure(M: int, K: int, N: int, act: str, variants=None, launches: bool = True) -> dict:
    """One shape's row (see bench_linear_epilogue.measure); ``variants`` picks among cublas, pointer, eager and
    inductor (ours is always timed)."""
    def unfused(x, w_gate, w_up):
        return gl.ACTIVATIONS[act](F.linear(x, w_gate)) * F.linear(x, w_up)

    x = randn(M, K, seed=1)
    w_cat = randn(2 * N, K, scale=K ** -0.5, seed=2)
    w_gate, w_up = w_cat[:N], w_cat[N:]  # views: contiguous rows, as separate nn.Linear weights would be
    inductor = compiled(unfused) if variants is None or "inductor" in variants else None
    fns = {
        "cublas": lambda: F.linear(x, w_cat),
        "ours": lambda: gl.gated_linear(x, w_gate, w_up, act),
        "pointer": lambda: gl._launch(x, w_gate, w_up, act, tma=False),
        "eager": lambda: unfused(x, w_gate, w_up),
        "inductor": lambda: inductor(x, w_gate, w_up),
    }
    times, launched = time_all({k: f for k, f in fns.items() if variants is None or k in variants or k == "ours"},
                               launches)
    config = best_config(tg._gemm_tma_autotuned if tg.use_tma(M, 2 * N, K) else gl._gated_linear_autotuned)
    ref = unfused(x.float(), w_gate.float(), w_up.float())
    return make_row(M, K, N, times, launched, config, {"ours": relative_error(gl.gated_linear(x, w_gate, w_up, act), ref),
                                                   "eager": relative_error(unfused(x, w_gate, w_up), ref)},
                flop=2 * 2 * M * N * K)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write bench_gated_linear.json and .md here")
    p.add_argument("--activation", default="silu", choices=list(gl.ACTIVATIONS))
    args = p.parse_args(argv)
    if not require_cuda("bench_gated_linear"):
        return 2
    act = args.activation
    meta = {**run_meta(f"python -m benchmarks.bench_gated_linear --activation {act}"), "activation": act}
    rows = [measure(M, K, N, act) for M, K, N in SHAPES]
    columns = [("cublas", "cuBLAS one GEMM [M, 2N]"), ("ours", "ours (fused)"),
               ("pointer", "ours, pointer kernel only"), ("eager", "eager"),
               ("inductor", "Inductor")]
    table = markdown(meta, f"gated linear {act}(x Wg^T) * (x Wu^T)", rows, columns)
    print(table)
    write(args.out, "bench_gated_linear", meta, rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
