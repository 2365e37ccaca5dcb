"""Host cost of one call of each fused op, against what Inductor issues instead (CUDA only).

    python -m benchmarks.bench_dispatch [--out DIR]

Without CUDA graphs a small model is launch-bound: a step takes as long as the host needs to issue its
kernels, so a fused op that saves device time but costs more host time than the calls it replaces makes the
model slower. This measures, per call, the host time to issue (calls back to back without a sync, wall time
divided by their number; the device keeps up at these shapes) and the device time (CUDA-graph replay) of:
  - aten: the unfused sequence the fusion pass replaces, as eager issues it;
  - inductor: the same sequence inside an Inductor-compiled graph, marginal cost: a graph of five copies
    (distinct weights) against a graph of one, divided by four, so Dynamo's per-call guard and wrapper costs,
    which a model pays once per step, cancel;
  - op: the custom op with autograd (torch.ops.kpt.<name>), as a training graph calls it;
  - inference: torch.ops.kpt.<name>_inference, which the fusion pass emits where no gradient flows;
  - launch: our launcher alone (argument checks, the chosen config, the Triton launch);
  - inductor+inference, inductor+triton: the inference op and the triton_op form (torch.ops.kpt.<name>_triton,
    which Inductor traces and launches as its own kernel) inside an Inductor graph, marginal cost as above;
under torch.no_grad() at the zoo Llama's decode and prefill sizes (K=1024, N=2816 and 1024; ``--k`` sets K, e.g.
768 for BERT). The cost model's host times per call and its ``horizontal`` table (the q/k/v rows, grouped-query
and multi-head; the merged form is merge-parallel-linears' own ``merged_linear``) come from these measurements
(``python -m benchmarks.calibrate --tables host,horizontal`` runs them and writes the card's calibration file).
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
from kpt_compiler.passes.merge_parallel_linears import merged_linear

CALLS = 400
COPIES = 5
VARIANTS = ("aten", "inductor", "op", "inference", "launch", "inductor+inference", "inductor+triton")


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


def inductor_us(seq, copies: list[tuple]) -> tuple[float, float]:
    """(host, device) microseconds of one more copy of ``seq`` inside an Inductor graph (see the docstring)."""
    torch._dynamo.reset()
    one = torch.compile(lambda args: [seq(*a) for a in args], dynamic=False)
    many = torch.compile(lambda args: [seq(*a) for a in args], dynamic=False)
    first, rest = copies[:1], copies
    host = (host_us(lambda: many(rest)) - host_us(lambda: one(first))) / (len(rest) - 1)
    dev = (median_ms(lambda: many(rest), "cuda", rep_ms=100, cuda_graph=True)
           - median_ms(lambda: one(first), "cuda", rep_ms=100, cuda_graph=True)) * 1e3 / (len(rest) - 1)
    return host, dev


def measure(name: str, M: int, seq, copies, fns: dict, variants=None) -> dict:
    """One op's row: host and device microseconds per call of each variant (``variants``: which, default all)."""
    row = {"op": name, "M": M, "host_us": {}, "device_us": {}}

    def wanted(v):
        return variants is None or v in variants

    if wanted("aten"):
        row["host_us"]["aten"] = host_us(lambda: seq(*copies[0]))
        row["device_us"]["aten"] = median_ms(lambda: seq(*copies[0]), "cuda", rep_ms=100, cuda_graph=True) * 1e3
    if wanted("inductor"):
        row["host_us"]["inductor"], row["device_us"]["inductor"] = inductor_us(seq, copies)
    for variant, fn in fns.items():
        if not wanted(variant):
            continue
        if variant.startswith("inductor+"):  # fn is a sequence to compile, over the copies
            row["host_us"][variant], row["device_us"][variant] = inductor_us(fn, copies)
            continue
        row["host_us"][variant] = host_us(fn)
        row["device_us"][variant] = median_ms(fn, "cuda", rep_ms=100, cuda_graph=True) * 1e3
    print(f"{name} M={M}: " + "  ".join(f"{v} host {row['host_us'][v]:.1f}us device {row['device_us'][v]:.1f}us"
                                        for v in row["host_us"]), flush=True)
    return row


def cases(M: int, K: int = 1024, N: int = 2816):
    dev, dt = "cuda", torch.bfloat16

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=dev, dtype=dt) * scale

    x, res, norm_w = randn(M, K), randn(M, K), torch.ones(K, device=dev, dtype=dt)
    gates = [(x, randn(N, K, scale=K ** -0.5), randn(N, K, scale=K ** -0.5)) for _ in range(COPIES)]
    outs = [(x, randn(K, K, scale=K ** -0.5), res) for _ in range(COPIES)]
    _, wg, wu = gates[0]
    _, wo, _ = outs[0]
    yield "gated_linear", lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu), gates, {
        "op": lambda: torch.ops.kpt.gated_linear(x, wg, wu, "silu"),
        "inference": lambda: torch.ops.kpt.gated_linear_inference(x, wg, wu, "silu"),
        "launch": lambda: gl._launch(x, wg, wu, "silu"),
        "inductor+inference": lambda x, wg, wu: torch.ops.kpt.gated_linear_inference(x, wg, wu, "silu"),
        "inductor+triton": lambda x, wg, wu: torch.ops.kpt.gated_linear_triton(x, wg, wu, "silu"),
    }
    yield "linear_epilogue (residual)", lambda x, w, r: F.linear(x, w) + r, outs, {
        "op": lambda: torch.ops.kpt.linear_epilogue(x, wo, None, res, "none"),
        "inference": lambda: torch.ops.kpt.linear_epilogue_inference(x, wo, None, res, "none"),
        "launch": lambda: le._launch(x, wo, None, res, "none"),
        "inductor+inference": lambda x, w, r: torch.ops.kpt.linear_epilogue_inference(x, w, None, r, "none"),
        "inductor+triton": lambda x, w, r: torch.ops.kpt.linear_epilogue_triton(x, w, None, r, "none"),
    }
    # what Inductor pays for the GEMM alone, when the residual add folds into the next kernel (a norm)
    yield "linear alone", lambda x, w, r: F.linear(x, w), outs, {}
    # the horizontal rule: q, k and v projections (grouped-query: k and v narrower) as three GEMMs, or as one
    # over the weights concatenated on every call
    qkv = [(x, randn(K, K, scale=K ** -0.5), randn(K // 4, K, scale=K ** -0.5), randn(K // 4, K, scale=K ** -0.5))
           for _ in range(COPIES)]
    yield "qkv: three linears", lambda x, wq, wk, wv: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)), qkv, {}
    yield "qkv: one linear over cat(Wq Wk Wv)", \
        lambda x, wq, wk, wv: merged_linear(x, [wq, wk, wv], None, [K, K // 4, K // 4]), qkv, {}
    # the same with full-width k and v (multi-head attention: BERT, GPT-2)
    mha = [(x, *(randn(K, K, scale=K ** -0.5) for _ in range(3))) for _ in range(COPIES)]
    yield "qkv-mha: three linears", lambda x, wq, wk, wv: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)), mha, {}
    yield "qkv-mha: one linear over cat(Wq Wk Wv)", \
        lambda x, wq, wk, wv: merged_linear(x, [wq, wk, wv], None, [K, K, K]), mha, {}
    yield "add_rms_norm", lambda x, r: F.rms_norm(x + r, (K,), norm_w, 1e-6), [(x, randn(M, K)) for _ in range(COPIES)], {
        "op": lambda: torch.ops.kpt.add_rms_norm(x, res, norm_w, 1e-6, False),
        "launch": lambda: rn._forward(x, res, norm_w, 1e-6, False),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write bench_dispatch.json and .md here")
    p.add_argument("--rows", default="1,128", help="comma-separated M (default: 1,128)")
    p.add_argument("--k", type=int, default=1024, help="the input width K (default 1024, the zoo Llama's)")
    p.add_argument("--ops", default=None, help="comma-separated prefixes of the op names to keep, e.g. "
                   "gated_linear,qkv (default: all)")
    args = p.parse_args(argv)
    if not require_cuda("bench_dispatch"):
        return 2
    meta = run_meta("python -m benchmarks.bench_dispatch")
    rows = []
    with torch.no_grad():
        for M in (int(m) for m in args.rows.split(",")):
            for name, seq, copies, fns in cases(M, args.k):
                if args.ops and not name.startswith(tuple(args.ops.split(","))):
                    continue
                rows.append(measure(name, M, seq, copies, fns))
    title = (f"host and device time per call, torch.no_grad, bf16, K={args.k}, N=2816, {meta['card']}, "
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; command: {meta['command']}")
    header = "| op | M | " + " | ".join(f"{v} host us | {v} device us" for v in VARIANTS) + " |"
    lines = [header, "|" + " --- |" * (2 + 2 * len(VARIANTS))]
    for r in rows:
        lines.append(f"| {r['op']} | {r['M']} | " + " | ".join(
            f"{r['host_us'].get(v, float('nan')):.1f} | {r['device_us'].get(v, float('nan')):.1f}" for v in VARIANTS)
            + " |")
    table = "\n".join([title, "", *lines, "", "inductor: marginal cost of one more copy inside a compiled graph. "
                       "nan: not applicable."])
    print(table)
    write(args.out, "bench_dispatch", meta, rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
