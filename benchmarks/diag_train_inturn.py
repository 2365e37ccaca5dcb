"""Training steps timed in turn: one module shared by the modes against a copy per mode.

``benchmarks.run --interleave`` first timed training modes in turn over one shared module; on the CPU
(2026-11-29) that ranked kpt against Inductor otherwise than copies did, until the forms swapped order, and on
the H100 (session 9) every mode came out alike. This times both forms in one process through
``measure.interleaved`` (``share_model``), so the comparison can be rerun on any device:

    python -m benchmarks.diag_train_inturn --model llama-eager --batch 1 --seq 128 --rounds 8 --device cpu

Prints, per form and mode, the median ms over rounds and the median of the per-round ratios Inductor / mode,
with their 20th and 80th percentiles.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.measure import interleaved, prepare, reference
from benchmarks.zoo import CPU_ZOO, CUDA_ZOO, Case
from kpt_compiler.bench import git_commit

MODES = {"inductor": {"backend": "inductor"}, "kpt": {"backend": "kernelpytorch"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diag_train_inturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-eager")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--rep-ms", type=float, default=2000, help="timing budget per mode per round")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--forms", default="shared,copies", help="the forms to time, in this order")
    args = p.parse_args(argv)
    entry = next(e for e in (CUDA_ZOO if args.device == "cuda" else CPU_ZOO) if e.name == args.model)
    model, make_inputs = prepare(entry, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    model.train(True)
    inputs = make_inputs(args.batch, args.seq, args.device)
    ref = reference(model, inputs, True)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {args.model} training {args.batch}x{args.seq}, {card}, torch {torch.__version__}, commit {git_commit()}")
    print(f"# forms {args.forms}; {args.rounds} rounds, {args.rep_ms:g} ms a mode a round; median [p20, p80]")
    for form in args.forms.split(","):
        figures = interleaved(model, inputs, ref, Case("training", args.batch, args.seq), MODES, args.device,
                              args.rounds, args.rep_ms, share_model=form == "shared")
        for m, f in figures.items():
            ms, r = f["ms"], f["vs_inductor"]
            print(f"{form:7s} {m:9s} {ms['median']:9.1f} ms [{ms['p20']:.1f}, {ms['p80']:.1f}]  vs Inductor "
                  f"{r['median']:.3f}x [{r['p20']:.3f}, {r['p80']:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
