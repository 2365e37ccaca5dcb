"""Host cost of one call of each fused op, against the ATen calls it replaces (CUDA only).

    python -m benchmarks.bench_dispatch [--out DIR]

Without CUDA graphs a small model is launch-bound: the step takes as long as the host needs to issue its
kernels, so a fused op that saves device time but costs more host time than the ATen calls it replaces makes
the model slower. This measures, per call, the host time to issue (N calls back to back without a sync, their
wall time divided by N; the device keeps up at these shapes) and the device time (CUDA-graph replay) of:
  - aten: the unfused ATen sequence the fusion pass replaces, as eager issues it;
  - op: the custom op (torch.ops.kpt.*), as Inductor's generated code calls it;
  - launch: our launcher without the custom-op dispatch (argument checks, autotuner, Triton launch);
  - kernel: the launcher with the autotuner's chosen config passed in (no autotuner on the way);
under torch.no_grad() (inference) at Llama-style decode and prefill shapes. The fusion cost model's
``HOST_US`` table (passes/fusion.py) comes from this.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_linear_epilogue import require_cuda, run_meta, write
from kpt_compiler.bench import median_ms
from kpt_compiler.kernels import gated_linear as gl
from kpt_compiler.kernels import linear_epilogue as le
from kpt_compiler.kernels import rms_norm as rn

CALLS = 400
VARIANTS = ("aten", "op", "launch", "kernel")


def host_us(fn, calls: int = CALLS) -> float:
    """Microseconds of host time per call: ``calls`` calls issued back to back, then one sync."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):  # the least disturbed of five rounds
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def _best(autotuned) -> dict:
    """The config the autotuner chose last (the "kernel" variant runs it directly, without the autotuner)."""
    return autotuned.best_config.all_kwargs()


def cases(M: int, K: int = 1024, N: int = 2816):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    wg, wu = (torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(2))
    wo = torch.randn(K, K, device=dev, dtype=dt) * K ** -0.5
    res = torch.randn(M, K, device=dev, dtype=dt)
    norm_w = torch.ones(K, device=dev, dtype=dt)
    yield "gated_linear", {
        "aten": lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu),
        "op": lambda: torch.ops.kpt.gated_linear(x, wg, wu, "silu"),
        "launch": lambda: gl._launch(x, wg, wu, "silu"),
        "kernel": lambda: gl._launch(x, wg, wu, "silu", config=_best(gl._gated_linear_autotuned)),
    }
    yield "linear_epilogue (residual)", {
        "aten": lambda: F.linear(x, wo) + res,
        "op": lambda: torch.ops.kpt.linear_epilogue(x, wo, None, res, "none"),
        "launch": lambda: le._launch(x, wo, None, res, "none"),
        "kernel": lambda: le._launch(x, wo, None, res, "none", config=_best(le._linear_epilogue_autotuned)),
    }
    yield "add_rms_norm", {
        "aten": lambda: F.rms_norm(x + res, (K,), norm_w, 1e-6),
        "op": lambda: torch.ops.kpt.add_rms_norm(x, res, norm_w, 1e-6, False),
        "launch": lambda: rn._forward(x, res, norm_w, 1e-6, False),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write bench_dispatch.json and .md here")
    args = p.parse_args(argv)
    if not require_cuda("bench_dispatch"):
        return 2
    meta = run_meta("python -m benchmarks.bench_dispatch")
    rows = []
    with torch.no_grad():
        for M in (1, 128):
            for name, fns in cases(M):
                row = {"op": name, "M": M, "host_us": {}, "device_us": {}}
                for variant, fn in fns.items():
                    row["host_us"][variant] = host_us(fn)
                    row["device_us"][variant] = median_ms(fn, "cuda", rep_ms=100, cuda_graph=True) * 1e3
                rows.append(row)
                print(f"{name} M={M}: " + "  ".join(f"{v} host {row['host_us'][v]:.1f}us device "
                                                    f"{row['device_us'][v]:.1f}us" for v in fns), flush=True)
    title = (f"host and device time per call, torch.no_grad, bf16, K=1024, N=2816, {meta['card']}, "
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: {meta['command']}")
    header = "| op | M | " + " | ".join(f"{v} host us | {v} device us" for v in VARIANTS)
    lines = [header, "|" + " --- |" * (2 + 2 * len(VARIANTS))]
    for r in rows:
        lines.append(f"| {r['op']} | {r['M']} | " + " | ".join(
            f"{r['host_us'].get(v, float('nan')):.1f} | {r['device_us'].get(v, float('nan')):.1f}" for v in VARIANTS) + " |")
    table = "\n".join([title, "", *lines])
    print(table)
    write(args.out, "bench_dispatch", meta, rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
