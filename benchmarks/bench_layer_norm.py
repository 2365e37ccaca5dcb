"""Residual add + LayerNorm microbenchmark: the fused kernels (kernels/layer_norm.py) against the unfused torch code.

    python -m benchmarks.bench_layer_norm [--out DIR] [--rep-ms MS]    (CUDA only)

For each bf16 shape (rows x N), forward and forward+backward (gradients of x, residual, weight and bias, with
upstream gradients on both y and h), it times in one run on one card:
  - ours: ``add_layer_norm`` (one Triton kernel forward, one backward plus a small reduction);
  - eager: the unfused torch code (``h = x + residual``, ``F.layer_norm(h, (N,), weight, bias, eps)``);
  - inductor: ``torch.compile`` (Inductor, default mode) of the unfused code.
GB/s counts the bytes the work needs, the same for all three: forward reads x, residual, weight, bias and
writes h, y; backward reads dy, dh, h, weight, bias, mean, rstd and writes dx and the fp32 weight- and
bias-gradient partials of our grid. "% copy" is ours against the device-to-device copy bandwidth measured in
the same run (benchmarks.ceilings.copy_bandwidth); the target is >= 80% at the large shapes. ``--out DIR``
writes bench_layer_norm.json and bench_layer_norm.md; the markdown table is printed last. Timing, table and
output helpers come from bench_rms_norm.py.
"""

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_rms_norm import SHAPES, _bytes, markdown, require_cuda, time_case, write_out

EPS = 1e-5


def unfused(x, residual, weight, bias):
    h = x + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias, EPS), h


def _ours(x, residual, weight, bias):
    from kpt_compiler.kernels.layer_norm import add_layer_norm

    return add_layer_norm(x, residual, weight, bias, EPS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fused residual add + LayerNorm against the unfused torch code (CUDA)")
    p.add_argument("--out", default=None, help="write bench_layer_norm.json and bench_layer_norm.md here")
    p.add_argument("--rep-ms", type=float, default=500, help="timed milliseconds per measurement")
    args = p.parse_args(argv)
    error = require_cuda("bench_layer_norm")
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
            w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).bfloat16()
            return [x, r, w, (0.1 * torch.randn(N, device="cuda", generator=g)).bfloat16()]

        fwd_bytes, bwd_bytes = _bytes(rows_, N, 2, n_params=2, n_stats=2, per_sm=2)
        impls = {"ours": _ours, "eager": unfused, "inductor": unfused}
        for row in time_case(impls, make_inputs, fwd_bytes, bwd_bytes, args.rep_ms):
            rows.append({"shape": [rows_, N], "variant": "F.layer_norm", **row})
            print(f"{rows_}x{N} {row['mode']}: " + "  ".join(
                f"{n} {t:.4f}ms ({row['gbps'][n]:.0f} GB/s)" for n, t in row["ms"].items()), flush=True)
    table = markdown("Residual add + LayerNorm", "python -m benchmarks.bench_layer_norm", rows, copy_tbps, "norm")
    write_out(args.out, "bench_layer_norm", {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                                             "date": str(datetime.date.today()), "copy_tbps": copy_tbps}, rows, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
