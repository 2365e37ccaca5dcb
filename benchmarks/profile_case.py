"""Where one zoo case spends its time under each compile mode: the kernels of a step, from torch.profiler.

    python -m benchmarks.profile_case --model llama-eager --case inference:1x128 \\
        --modes "inductor-ro,kpt[ro],kpt[ro-no-fusion]" [--top 15] [--rounds N] [--out DIR]     (CUDA only)

For each mode the case is compiled, warmed up, and a few steps are profiled (CPU and CUDA activities; kernels
replayed from CUDA graphs are included). Printed per mode: host wall time per step (synchronized), device time
per step (the kernels' summed durations), kernels per step, and the kernels that take the most device time,
with calls and microseconds per step. This is the profile the fusion pass's kernels are chosen from: it shows
what a mode launches that another does not. Timing figures for the README come from ``benchmarks.run``; this
is for finding where the time goes.

``--rounds N`` profiles the modes N times in turn (the order rotated each round, each a fresh compile) and
writes ``profile_case.md``/``.json`` with every round's host and device time per step and, per mode, the median
over rounds of the host-time ratio to Inductor with its 20th and 80th percentiles. On steps the host bounds (a
small model's training step: the GPU waits for Python) one mode's wall time moves by a quarter from one minute
to the next, more than modes differ: rounds in turn show that drift instead of ranking modes by when they ran.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import shlex
import sys
import time

import torch
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.bench import first_tensor, git_commit

from . import measure, outputs
from .run import DTYPES, all_modes
from .zoo import CUDA_ZOO

STEPS = 5  # profiled
TIMED = 50  # timed for the host wall time


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
        for _ in range(TIMED):
            step()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) / TIMED * 1e3
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
    p.add_argument("--rounds", type=int, default=1, help="profile the modes this many times in turn")
    p.add_argument("--out", default=None, help="write profile_case.json and .md here")
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
    names = args.modes.split(",")
    rounds: list[dict] = []
    for r in range(args.rounds):
        results = {}
        for mode in names[r % len(names):] + names[:r % len(names)]:
            res = results[mode] = profile_mode(model, inputs, case.task == "training", modes[mode], args.top)
            print(f"\n## {entry.name} {args.case} {mode} (round {r + 1}): wall {res['wall_ms']:.3f} ms/step, device "
                  f"{res['device_us']:.0f} us/step, {res['kernels_per_step']:.0f} kernels/step, passes {res['passes']}")
            if r == 0:
                print("| kernel | calls/step | us/step |\n| --- | --- | --- |")
                for k in res["top"]:
                    print(f"| {k['kernel']} | {k['calls']:g} | {k['us']:.1f} |")
        rounds.append(results)
    if args.out:
        command = "python -m benchmarks.profile_case " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        record = {"model": entry.name, "case": args.case, "card": torch.cuda.get_device_name(), "command": command,
                  "rounds": rounds}
        outputs.write_bench(args.out, "profile_case", record, rounds_table(record, names))
    return 0


def rounds_table(record: dict, names: list[str]) -> str:
    """The rounds in markdown: host and device time per step per round, then per mode the medians over rounds
    and the host-time ratio to Inductor (median of the per-round ratios, 20th and 80th percentiles)."""
    from .measure import _quantiles

    rounds = record["rounds"]
    lines = [f"# {record['model']} {record['case']}: host and device time per step, {len(rounds)} rounds in turn",
             "", f"- card: {record['card']}; date: {datetime.date.today()}; commit: {git_commit()}",
             f"- command: `{record['command']}`",
             "- wall: host wall time per step over 50 steps, synchronized at the end (on a host-bound step, the host's time); "
             "device: the kernels' summed time per step (torch.profiler); each round compiles each mode afresh",
             "", "| round | " + " | ".join(f"{m} wall ms | {m} device ms" for m in names) + " |",
             "| --- |" + " --- | --- |" * len(names)]
    for i, res in enumerate(rounds):
        lines.append(f"| {i + 1} | " + " | ".join(f"{res[m]['wall_ms']:.2f} | {res[m]['device_us'] / 1e3:.2f}"
                                                  for m in names) + " |")
    lines += ["", "| mode | wall ms, median [p20, p80] | device ms, median | Inductor wall / wall, median [p20, p80] |",
              "| --- | --- | --- | --- |"]
    for m in names:
        wall = _quantiles([res[m]["wall_ms"] for res in rounds])
        dev = _quantiles([res[m]["device_us"] / 1e3 for res in rounds])
        ratio = (_quantiles([res["inductor"]["wall_ms"] / res[m]["wall_ms"] for res in rounds])
                 if "inductor" in names else None)
        cell = f"{ratio['median']:.2f}x [{ratio['p20']:.2f}, {ratio['p80']:.2f}]" if ratio else "-"
        lines.append(f"| {m} | {wall['median']:.2f} [{wall['p20']:.2f}, {wall['p80']:.2f}] | {dev['median']:.2f} | {cell} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
