"""Where one zoo case spends its time under each compile mode: the kernels of a step, from torch.profiler.

    python -m benchmarks.profile_case --model llama-eager --case inference:1x128 \\
        --modes "inductor-ro,kpt[ro],kpt[ro-no-fusion]" [--top 15] [--out DIR]     (CUDA only)

For each mode the case is compiled, warmed up, and a few steps are profiled (CPU and CUDA activities; kernels
replayed from CUDA graphs are included). Printed per mode: host wall time per step (synchronized), device time
per step (the kernels' summed durations), kernels per step, and the kernels that take the most device time,
with calls and microseconds per step. This is the profile the fusion pass's kernels are chosen from: it shows
what a mode launches that another does not. Timing figures for the README come from ``benchmarks.run``; this
is for finding where the time goes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.bench import first_tensor

from . import measure
from .run import DTYPES, all_modes
from .zoo import CUDA_ZOO

STEPS = 5


def _case(model: str, case: str):
    task, shape = case.split(":")
    batch, seq = (int(v) for v in shape.split("x"))
    for entry in CUDA_ZOO:
        for c in entry.cases:
            if entry.name == model and (c.task, c.batch, c.seq) == (task, batch, seq):
                return entry, c
    known = [f"{e.name} {c.task}:{c.batch}x{c.seq}" for e in CUDA_ZOO for c in e.cases]
    raise SystemExit(f"error: no zoo case {model} {case}; known: {', '.join(known)}")


def profile_mode(model, inputs, training: bool, compile_kwargs, top: int) -> dict:
    kpt_compiler.clear_reports()
    torch._dynamo.reset()
    fn = torch.compile(model, **compile_kwargs) if compile_kwargs else model
    cudagraphs = measure.uses_cudagraphs(compile_kwargs)
    target = None

    def step():
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if training:
            model.zero_grad(set_to_none=True)
        out = first_tensor(fn(*inputs))
        if training:
            nonlocal target
            if target is None:
                target = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device).flatten()
            F.cross_entropy(out.flatten(0, -2).float(), target).backward()
        return out

    with torch.set_grad_enabled(training):
        for _ in range(5):  # compile, record the CUDA graphs, warm up
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) / 20 * 1e3
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
    kernels: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])  # name -> [calls, us]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.device_time
    total_us = sum(us for _, us in kernels.values()) / STEPS
    calls = sum(n for n, _ in kernels.values()) / STEPS
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    fired = sorted({p for r in kpt_compiler.reports() for p in r.fired()})
    return {"wall_ms": host_ms, "device_us": total_us, "kernels_per_step": calls, "passes": fired,
            "top": [{"kernel": name[:90], "calls": n / STEPS, "us": us / STEPS} for name, (n, us) in ranked]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-eager")
    p.add_argument("--case", default="inference:1x128", help="task:batchxseq, e.g. inference:1x128")
    p.add_argument("--modes", default="inductor-ro,kpt[ro]")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None, help="write profile_case.json here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_case: needs CUDA")
        return 2
    entry, case = _case(args.model, args.case)
    modes = all_modes()
    unknown = [m for m in args.modes.split(",") if m not in modes]
    if unknown:
        raise SystemExit(f"error: unknown mode(s) {unknown}; known: {', '.join(modes)}")
    dtype, _ = DTYPES["cuda"]
    model, make_inputs = measure.prepare(entry, "cuda", dtype)
    model.train(case.task == "training")
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in make_inputs(case.batch, case.seq, "cuda"))
    measure.warm_up("cuda")
    results = {}
    for mode in args.modes.split(","):
        r = results[mode] = profile_mode(model, inputs, case.task == "training", modes[mode], args.top)
        print(f"\n## {entry.name} {args.case} {mode}: wall {r['wall_ms']:.3f} ms/step, device "
              f"{r['device_us']:.0f} us/step, {r['kernels_per_step']:.0f} kernels/step, passes {r['passes']}")
        print("| kernel | calls/step | us/step |\n| --- | --- | --- |")
        for k in r["top"]:
            print(f"| {k['kernel']} | {k['calls']:g} | {k['us']:.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_case.json"), "w") as f:
            json.dump({"model": entry.name, "case": args.case, "card": torch.cuda.get_device_name(),
                       "modes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
