"""Training steps timed in turn: one module shared by the modes against a copy per mode.

``benchmarks.run --interleave`` first timed training modes in turn over one shared module; on the CPU
(2026-11-29) that ranked kpt against Inductor otherwise than copies did, and on the H100 (session 9) every mode
came out alike. This times both forms in one process, so the comparison itself can be rerun on any device:

    python -m benchmarks.diag_train_inturn --model llama-eager --batch 1 --seq 128 --rounds 8 --device cpu

Per form: each mode compiled (``torch.compile``, the given backends), then ``rounds`` rounds, each timing every
mode's step (median of ``--steps`` steps), the order rotated each round. Prints, per form and mode, the median ms
over rounds and the median of the per-round ratios Inductor / mode.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from benchmarks.measure import make_step, prepare, reference, sync
from benchmarks.zoo import CPU_ZOO, CUDA_ZOO
from kpt_compiler.bench import git_commit

MODES = {"inductor": {"backend": "inductor"}, "kpt": {"backend": "kernelpytorch"}}


def time_form(model, inputs, ref, device: str, shared: bool, rounds: int, steps_per: int) -> dict[str, list[float]]:
    import time

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=16, accumulated_recompile_limit=256), torch.enable_grad():
        steps = {m: make_step(model if shared else copy.deepcopy(model), inputs, ref, True, kw, device)
                 for m, kw in MODES.items()}
        for s in steps.values():
            s(), s()  # compiles forward and backward, then one warm step
        names, times = list(steps), {m: [] for m in steps}
        for r in range(rounds):
            for m in names[r % len(names):] + names[:r % len(names)]:
                ts = []
                for _ in range(steps_per):
                    sync(device)
                    t0 = time.perf_counter()
                    steps[m]()
                    sync(device)
                    ts.append((time.perf_counter() - t0) * 1e3)
                times[m].append(statistics.median(ts))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diag_train_inturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-eager")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="steps per mode per round (their median is the round's)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--forms", default="shared,copies", help="the forms to time, in this order")
    args = p.parse_args(argv)
    zoo = CUDA_ZOO if args.device == "cuda" else CPU_ZOO
    entry = next(e for e in zoo if e.name == args.model)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, make_inputs = prepare(entry, args.device, dtype)
    model.train(True)
    inputs = make_inputs(args.batch, args.seq, args.device)
    ref = reference(model, inputs, True)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {args.model} training {args.batch}x{args.seq}, {card}, torch {torch.__version__}, commit {git_commit()}")
    print(f"# forms {args.forms}; {args.rounds} rounds x {args.steps} steps per mode; median ms over rounds; "
          "Inductor / mode per round")
    for form in args.forms.split(","):
        times = time_form(model, inputs, ref, args.device, form == "shared", args.rounds, args.steps)
        for m, ms in times.items():
            ratios = [a / b for a, b in zip(times["inductor"], ms)]
            print(f"{form:7s} {m:9s} {statistics.median(ms):9.1f} ms  vs Inductor {statistics.median(ratios):.3f}x "
                  f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
