"""The main job: compile a real model with kernelpytorch and show what it did.

    python -m kpt_compiler.demo [--model gpt2|tiny-gpt] [--batch B --seq S] [--dtype bf16] [--options JSON]

Builds GPT-2 small from its configuration (Hugging Face transformers, eager attention; the project's own
small GPT when transformers is absent), checks kernelpytorch's output against eager, times eager, Inductor and
kernelpytorch side by side, prints which passes fired, and writes the report (``--out``/index.html).
On a GPU the defaults are the ANCHORS.md setting (8 x 1024, bf16); on the CPU a 2-layer model at 2 x 128.
Exits non-zero when kernelpytorch's output is further from eager float32 than Inductor's or eager's own is.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch

import kpt_compiler

from .bench import first_tensor, git_commit, median_ms, relative_error
from .models.zoo import MissingLibrary, build

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROUNDS = 3  # timing rounds, every mode in each, in turn


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kpt_compiler.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="auto", help="gpt2 (transformers), tiny-gpt (ours), or auto")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: 12 on cuda, 2 on cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--options", default="{}", help="kernelpytorch options as JSON, e.g. '{\"strict\": true}'")
    p.add_argument("--out", default="kpt_demo", help="where the report goes (dump_dir)")
    p.add_argument("--rep-ms", type=float, default=None, help="timing budget per mode")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    batch = args.batch or (8 if gpu else 2)
    seq = args.seq or (1024 if gpu else 128)
    layers = args.layers or (12 if gpu else 2)
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    rep_ms = args.rep_ms or (1000 if gpu else 1500)
    user_options = json.loads(args.options)
    try:  # fail before building anything when the options or the output folder are wrong
        kpt_compiler.parse_options(None, user_options)
        from .dump import DumpWriter

        DumpWriter.for_dir(args.out)  # the folder the report goes to (parse_options does not look at it)
    except kpt_compiler.OptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    name = args.model
    try:
        if name in ("auto", "gpt2"):
            model, make_inputs = build("gpt2", attn="eager", n_layer=layers)
            label = f"GPT-2 small ({layers} layers; transformers, eager attention)"
        else:
            raise MissingLibrary("asked for tiny-gpt")
    except MissingLibrary as why:
        if name == "gpt2":
            raise
        model, make_inputs = build("tiny-gpt", n_layer=layers)
        label = f"the project's GPT ({layers} layers, 256 wide; {why})"
    torch.manual_seed(0)
    model = model.eval().to(device)
    inputs = make_inputs(batch, seq, device)
    ref_model = copy.deepcopy(model).float()
    model = model.to(dtype)

    print(f"kernelpytorch main job | {label} | batch {batch} x seq {seq} | {str(dtype).replace('torch.', '')} | "
          f"{_device_name(device)} | torch {torch.__version__} | {datetime.date.today()}")
    with torch.no_grad():
        ref = first_tensor(ref_model(*inputs)).float()
    del ref_model

    kpt_options = {"dump_dir": args.out, **user_options}
    modes = {
        "eager": lambda: model,
        "inductor": lambda: torch.compile(model, backend="inductor"),
        "kernelpytorch": lambda: torch.compile(model, backend="kernelpytorch", options=kpt_options),
    }
    rows, fns = [], {}
    kpt_compiler.clear_reports()
    torch._dynamo.reset()  # once: each compiled mode keeps its graphs (Dynamo guards each on its backend)
    for mode, make in modes.items():
        fn = fns[mode] = make()
        with torch.no_grad():
            t0 = time.perf_counter()
            out = first_tensor(fn(*inputs))
            if gpu:
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
        rows.append({"mode": mode, "first_call_s": compile_s, "rel_err": relative_error(out, ref), "ms_rounds": []})
    # timed in turn, ROUNDS rounds: modes timed one after another drift apart on a busy machine (README, "The CPU")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for _ in range(ROUNDS):
            for r in rows:
                fn = fns[r["mode"]]
                r["ms_rounds"].append(median_ms(lambda: fn(*inputs), device, rep_ms=rep_ms / ROUNDS))
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    for r in rows:
        r["ms"] = statistics.median(r["ms_rounds"])
        print(f"  {r['mode']:14s} first call {r['first_call_s']:7.2f} s   median {r['ms']:9.3f} ms "
              f"[{min(r['ms_rounds']):.3f}, {max(r['ms_rounds']):.3f}] over {ROUNDS} rounds in turn   "
              f"rel. error vs fp32 eager {r['rel_err']:.2e}", flush=True)
    if recompiled:
        print(f"  note: {recompiled} graph(s) compiled during the timing (their time is in the rounds)")

    reports = kpt_compiler.reports()
    print()
    print("What kernelpytorch did:")
    for r in reports:
        print(r.table())
    fired = sorted({name for r in reports for name in r.fired()})
    print(f"passes that fired: {', '.join(fired) if fired else 'none'}")
    print("pipeline:\n  " + kpt_compiler.describe_pipeline(kpt_compiler.parse_options(None, user_options)).replace("\n", "\n  "))
    print(f"report: {os.path.join(args.out, 'index.html')}")

    by = {r["mode"]: r for r in rows}
    for r in rows:  # against Inductor: the median of the rounds' ratios (each round times every mode in turn)
        r["vs_inductor"] = statistics.median(i / m for i, m in zip(by["inductor"]["ms_rounds"], r["ms_rounds"]))
    print()
    print(f"| mode | first call (s) | median (ms), {ROUNDS} rounds in turn | vs Inductor | rel. error vs fp32 eager |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        cs = "-" if r["mode"] == "eager" else f"{r['first_call_s']:.1f}"  # eager's first call compiles nothing
        print(f"| {r['mode']} | {cs} | {r['ms']:.3f} [{min(r['ms_rounds']):.3f}, {max(r['ms_rounds']):.3f}] | "
              f"{r['vs_inductor']:.2f}x | {r['rel_err']:.1e} |")
    bound = 2 * max(by["eager"]["rel_err"], by["inductor"]["rel_err"]) + 1e-6
    ok = by["kernelpytorch"]["rel_err"] <= bound
    print(f"\noutput check: kernelpytorch rel. error {by['kernelpytorch']['rel_err']:.2e} "
          f"{'<=' if ok else '>'} bound {bound:.2e} (twice the worse of eager's and Inductor's): "
          f"{'OK' if ok else 'MISMATCH'}")
    with open(os.path.join(args.out, "main_job.json"), "w") as f:
        json.dump({"label": label, "batch": batch, "seq": seq, "dtype": str(dtype), "device": _device_name(device),
                   "torch": torch.__version__, "date": str(datetime.date.today()), "commit": git_commit(),
                   "rows": rows, "fired": fired, "ok": ok}, f, indent=1)
    return 0 if ok else 1


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
