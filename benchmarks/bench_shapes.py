"""A stream of inference calls whose input sizes change, as users with variable batch and sequence lengths make them.

    python -m benchmarks.bench_shapes --models gpt2 --calls 200 --device cuda --out benchmarks/out

The stream: --calls sizes drawn with ``random.Random(--seed)``, batch uniform in [1, --max-batch] and sequence
uniform in [1, --max-seq]; the inputs are the zoo's token ids (kpt_compiler.models.zoo), bf16 on cuda and float32
on cpu, under torch.no_grad(). Models: ``gpt2`` (--attn, default "eager"), ``llama`` (the zoo builder's small
default), ``llama-4096x8`` (Llama-3-8B's layer, SDPA, 8 layers), ``tiny-gpt``; --tiny gives each one layer.

Modes: ``eager``; ``inductor``; ``inductor-dynamic`` (dynamic=True); ``inductor-ro`` (mode="reduce-overhead");
``kpt`` (backend="kernelpytorch"); ``kpt[<set>]`` for a set of benchmarks/option_sets.py (``kpt[bucketing]``,
``kpt[bucketing+cudagraphs]``). --kpt-codegen merges {"codegen": ...} into every kpt mode's options (CI on the
CPU passes "eager": no Inductor C++ build).

Each (model, mode) runs in a fresh process (``--one-mode``) with its own empty TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR, so no mode reuses another's kernels and its compiles are cold (on cuda after a warm-up compile
of something small that takes the process's one-time costs, as benchmarks/run.py does). There: the model is
built (seeded), the eager outputs of every --check-every-th call computed and kept on the host, then pass 1 runs
the stream (wall seconds, compiles included) and pass 2 runs it again (steady state). Per row: graphs Dynamo
compiled, recompiles, whether Dynamo hit its recompile limit and ran the rest eagerly, peak allocated memory
(cuda), the largest relative error ||out - ref|| / ||ref|| of the checked calls against eager in the same dtype
(checks happen outside the timed spans), for kpt modes the bucketing and cudagraphs passes' records, and the
pass times over the fastest Inductor mode's. A mode that raises gives an error row, a hung one (past
--timeout-per-mode) a timeout row, and the run goes on. Writes OUT/bench_shapes.{json,md} (outputs.write_bench);
--append keeps the rows already there (same stream and card), for one table built over several shorter runs.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from . import outputs
from .option_sets import OPTION_SETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"cuda": (torch.bfloat16, "bf16"), "cpu": (torch.float32, "fp32")}
# name -> (zoo builder, its kwargs, the longest sequence its positions take)
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt2": ("gpt2", {"attn": "eager"}, 2048),
    "llama": ("llama", {"attn": "eager"}, 4096),
    "llama-4096x8": ("llama", {"attn": "sdpa", "n_layer": 8, "hidden": 4096, "heads": 32, "kv_heads": 8,
                               "intermediate": 14336}, 4096),
    "tiny-gpt": ("tiny-gpt", {}, 1024),
}
DEFAULT_MODES = "eager,inductor,inductor-dynamic,inductor-ro,kpt,kpt[bucketing],kpt[bucketing+cudagraphs]"
WATCHED_PASSES = ("bucketing", "cudagraphs")  # the kpt passes whose records each kpt row summarizes


def stream(calls: int, seed: int, max_batch: int, max_seq: int) -> list[tuple[int, int]]:
    """The (batch, seq) of each call: batch uniform in [1, max_batch], seq uniform in [1, max_seq]."""
    rng = random.Random(seed)
    return [(rng.randint(1, max_batch), rng.randint(1, max_seq)) for _ in range(calls)]


def compile_kwargs(mode: str, kpt_codegen: str | None = None) -> dict[str, Any] | None:
    """torch.compile keyword arguments of a mode (None: eager); ValueError for an unknown mode."""
    fixed: dict[str, dict[str, Any] | None] = {
        "eager": None,
        "inductor": {"backend": "inductor"},
        "inductor-dynamic": {"backend": "inductor", "dynamic": True},
        "inductor-ro": {"backend": "inductor", "mode": "reduce-overhead"},
        "kpt": {"backend": "kernelpytorch", "options": {}},
    }
    if mode in fixed:
        kwargs = fixed[mode]
    elif mode.startswith("kpt[") and mode.endswith("]") and mode[4:-1] in OPTION_SETS:
        kwargs = {"backend": "kernelpytorch", "options": dict(OPTION_SETS[mode[4:-1]])}
    else:
        known = list(fixed) + [f"kpt[{s}]" for s in OPTION_SETS]
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(known)}")
    if kwargs and kwargs["backend"] == "kernelpytorch" and kpt_codegen:
        kwargs = {**kwargs, "options": {**kwargs["options"], "codegen": kpt_codegen}}
    return kwargs


def model_kwargs(name: str, attn: str | None, tiny: bool) -> tuple[str, dict[str, Any]]:
    builder, kwargs, _ = MODELS[name]
    kwargs = dict(kwargs)
    if attn and "attn" in kwargs:
        kwargs["attn"] = attn
    if tiny:
        kwargs["n_layer"] = 1
    return builder, kwargs


def _spawn(args: argparse.Namespace, mode: str, model_name: str) -> dict[str, Any]:
    """Run one (model, mode) in a fresh process with empty Inductor/Triton caches; its row, or an error or timeout
    row when it raised outside the row, died or hung."""
    folder = tempfile.mkdtemp(prefix="kpt_shapes_")
    result = os.path.join(folder, "row.json")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"),
               TRITON_CACHE_DIR=os.path.join(folder, "triton"))
    cmd = [sys.executable, "-m", "benchmarks.bench_shapes", "--one-mode", mode, "--models", model_name,
           "--device", args.device, "--calls", str(args.calls), "--seed", str(args.seed),
           "--max-batch", str(args.max_batch), "--max-seq", str(args.max_seq),
           "--check-every", str(args.check_every), "--pass2-repeats", str(args.pass2_repeats), "--result-file", result]
    cmd += (["--attn", args.attn] if args.attn else []) + (["--tiny"] if args.tiny else [])
    cmd += ["--kpt-codegen", args.kpt_codegen] if args.kpt_codegen else []
    tail: collections.deque[str] = collections.deque(maxlen=20)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: a timeout kills its compile workers too

    def echo() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if args.verbose:
                print(f"  | {line.rstrip()}", flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    row: dict[str, Any] = {"model": model_name, "mode": mode, "dtype": DTYPES[args.device][1]}
    try:
        proc.wait(timeout=args.timeout_per_mode)
        reader.join(timeout=10)
        if os.path.exists(result):
            with open(result) as f:
                row = json.load(f)
        else:
            last = " ".join(line for line in tail if line.strip())[-250:]
            row["status"] = f"error: the process exited with code {proc.returncode}: {last}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        row["status"] = f"timeout: killed after {args.timeout_per_mode:g} s"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    row["process_s"] = round(time.monotonic() - t0, 1)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """For each kpt row of a model: its pass-1 and pass-2 seconds over the fastest Inductor mode's (per pass)."""
    for model in dict.fromkeys(r["model"] for r in rows):
        ours = [r for r in rows if r["model"] == model]
        inductor = [r for r in ours if r["mode"].startswith("inductor") and r["status"] == "ok"]
        for n in (1, 2):
            key = f"pass{n}_s"
            best = min(inductor, key=lambda r: r[key]) if inductor else None
            for r in ours:
                if r["mode"].startswith("kpt"):
                    ok = best is not None and r["status"] == "ok" and best[key] > 0
                    r[f"pass{n}_vs_inductor"] = round(r[key] / best[key], 3) if ok else None
                    r[f"pass{n}_best_inductor"] = best["mode"] if best else None


def _kpt_line(passes: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name, entry in passes.items():
        statuses = ", ".join(f"{s} x{n}" for s, n in entry["statuses"].items())
        note = f" ({entry['notes'][0][:140]}{'; ...' if len(entry['notes']) > 1 else ''})" if entry["notes"] else ""
        parts.append(f"{name}: {statuses}{note}")
    return "; ".join(parts) or "no bucketing or cudagraphs record"


def table(record: dict[str, Any]) -> str:
    s = record["stream"]
    lines = [
        f"# Changing input sizes: a stream of {s['calls']} inference calls on {record['card']}",
        "",
        f"- date: {record.get('date', '?')}; commit: {record.get('commit') or 'unknown'}; torch {record.get('torch') or torch.__version__}",
        f"- command: `{record['command']}`",
        f"- stream: seed {s['seed']}, batch uniform in [1, {s['max_batch']}], sequence uniform in "
        f"[1, {s['max_seq']}] ({s['distinct_sizes']} distinct sizes); token ids, no_grad, {record['dtype']}",
        "- each mode in a fresh process with empty Inductor/Triton cache folders; pass 1: the stream, compiles "
        "included; pass 2: the same stream again, repeated (median [min, max] where repeated); Dynamo's defaults (recompile_limit "
        f"{record['recompile_limit']}); fell back: Dynamo hit that limit and runs the frame eagerly",
        f"- max rel err: ||out - eager|| / ||eager|| over every {s['check_every']}th call of both passes (eager in "
        f"{record['dtype']}, computed before compiling); checks are outside the timed spans",
        "- vs Inductor: the kpt mode's pass seconds / the fastest Inductor mode's (below 1: faster)",
    ]
    for model in dict.fromkeys(r["model"] for r in record["rows"]):
        rows = [r for r in record["rows"] if r["model"] == model]
        lines += ["", f"## {model}", "",
                  "| mode | pass-1 s | pass-2 s | graphs | recompiles | fell back to eager | peak GiB | graphs' pool MiB "
                  "| max rel err | pass-1 vs Inductor | pass-2 vs Inductor | status |",
                  "|" + " --- |" * 12]
        for r in rows:
            def f(key: str, spec: str, suffix: str = "") -> str:
                v = r.get(key)
                return format(v, spec) + suffix if v is not None else "-"

            fell = r.get("fell_back")
            at = f" (at {r['commit']})" if r.get("commit") and r["commit"] != record.get("commit") else ""
            lines.append("| " + " | ".join([
                r["mode"] + at, f("pass1_s", ".2f"), _pass2(r), f("graphs", "d"), f("recompiles", "d"),
                ("yes: " + ", ".join(dict.fromkeys(fell)) if fell else "no") if fell is not None else "-",
                f("peak_gib", ".2f"), f("pool_mib", ".0f"), f("max_rel_err", ".1e"),
                f("pass1_vs_inductor", ".2f", "x"), f("pass2_vs_inductor", ".2f", "x"),
                r["status"].replace("|", "/")[:200]]) + " |")
        kpt = [r for r in rows if "kpt_passes" in r]
        if kpt:
            lines += ["", "kpt passes (graphs per status; first reason or note):"]
            lines += [f"- {r['mode']}: {_kpt_line(r['kpt_passes'])}" for r in kpt]
        timed = [r for r in rows if r.get("compile_s")]
        if timed:
            lines += ["", "compile seconds per frame compile (Dynamo's count), then kpt's deferred compiles:"]
            lines += [f"- {r['mode']}: {', '.join(format(t, 'g') for t in r['compile_s'])}"
                      + (f"; buckets used {r['buckets_used']}, captured {r['buckets_captured']}"
                         if r.get("buckets_used") is not None else "")
                      + (f"; deferred: {', '.join(format(t, 'g') for t in r['deferred_compile_s'])}"
                         if r.get("deferred_compile_s") else "") for r in timed]
        calls = [r for r in rows if r.get("pass1_call_s")]
        if calls:
            lines += ["", "pass 1 call by call (host seconds from the call to its return, no sync): the slowest, "
                      "as call (batch x sequence) seconds; then the calls under 0.1 s, summed:"]
            lines += [f"- {r['mode']}: {_slowest(r['pass1_call_s'], s.get('sizes') or [])}" for r in calls]
    return "\n".join(lines)


def _slowest(call_s: list[float], sizes: list[tuple[int, int]], top: int = 8) -> str:
    slow = sorted(range(len(call_s)), key=call_s.__getitem__, reverse=True)[:top]
    fast = [t for t in call_s if t < 0.1]
    return (", ".join(f"{i}" + (f" ({sizes[i][0]}x{sizes[i][1]})" if i < len(sizes) else "") + f" {call_s[i]:.2f}"
                      for i in slow)
            + f"; {len(fast)} calls under 0.1 s: {sum(fast):.2f} s; all {len(call_s)}: {sum(call_s):.2f} s")


def _pass2(row: dict) -> str:
    runs = row.get("pass2_runs_s") or []
    if row.get("pass2_s") is None:
        return "-"
    return f"{row['pass2_s']:.2f}" + (f" [{min(runs):.2f}, {max(runs):.2f}]" if len(runs) > 1 else "")


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2", help=f"comma-separated subset of: {', '.join(MODELS)}")
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated: eager, inductor, inductor-dynamic, "
                   "inductor-ro, kpt, kpt[<option set of benchmarks/option_sets.py>]")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--check-every", type=int, default=10, metavar="K", help="check every K-th call (0: none)")
    p.add_argument("--pass2-repeats", type=int, default=3, metavar="R",
                   help="run the second pass R times; the table shows the median and the range")
    p.add_argument("--attn", default=None, help="attention implementation for gpt2/llama (default: the model's)")
    p.add_argument("--tiny", action="store_true", help="one layer per model (tests)")
    p.add_argument("--kpt-codegen", choices=["auto", "inductor", "eager"], default=None,
                   help="merged into every kpt mode's options (CPU CI: eager)")
    p.add_argument("--timeout-per-mode", type=float, default=1500.0, metavar="S")
    p.add_argument("--out", default="benchmarks/out", help="folder for bench_shapes.json and .md")
    p.add_argument("--append", action="store_true",
                   help="keep the rows of OUT/bench_shapes.json (same stream) and replace those run again: one "
                        "table built over several shorter runs")
    p.add_argument("--verbose", action="store_true", help="echo each mode's process output")
    p.add_argument("--one-mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from_cli = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch.cuda.is_available() is False")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"error: unknown model {m!r}; known: {', '.join(MODELS)}")
        if args.max_seq > MODELS[m][2]:
            raise SystemExit(f"error: --max-seq {args.max_seq} is past {m}'s {MODELS[m][2]} positions")
    try:
        for m in modes:
            compile_kwargs(m)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if args.calls < 1 or args.max_batch < 1 or args.max_seq < 1:
        raise SystemExit("error: --calls, --max-batch and --max-seq must be at least 1")

    if args.one_mode:  # the child: one (model, mode), its row into --result-file
        from ._shapes_mode import run_one

        row = run_one(args, args.one_mode, models[0])
        with open(args.result_file, "w") as f:
            json.dump(row, f)
        return 0

    command = shlex.join(sys.orig_argv if from_cli else ["python", "-m", "benchmarks.bench_shapes", *argv])
    sizes = stream(args.calls, args.seed, args.max_batch, args.max_seq)
    from kpt_compiler.bench import git_commit

    record: dict[str, Any] = {
        "date": str(datetime.date.today()), "commit": git_commit(),
        "card": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "device": args.device, "dtype": DTYPES[args.device][1], "command": command,
        "stream": {"calls": args.calls, "seed": args.seed, "max_batch": args.max_batch, "max_seq": args.max_seq,
                   "check_every": args.check_every, "pass2_repeats": args.pass2_repeats, "distinct_sizes": len(set(sizes)),
                   "sizes": [list(s) for s in sizes]},
        "models": {m: dict(zip(("builder", "kwargs"), model_kwargs(m, args.attn, args.tiny))) for m in models},
        "modes": {m: compile_kwargs(m, args.kpt_codegen) for m in modes},
        "recompile_limit": torch._dynamo.config.recompile_limit,
        "timeout_per_mode_s": args.timeout_per_mode,
        "rows": [],
    }
    previous = os.path.join(args.out, "bench_shapes.json")
    if args.append and os.path.exists(previous):
        with open(previous) as f:
            old = json.load(f)
        if old.get("stream") != record["stream"] or old.get("card") != record["card"]:
            raise SystemExit(f"error: --append: {previous} has another stream or card")
        record["models"] = {**old.get("models", {}), **record["models"]}
        record["modes"] = {**old.get("modes", {}), **record["modes"]}
        record["command"] = old["command"] + " ; " + command
        record["rows"] = [r for r in old["rows"] if (r["model"], r["mode"]) not in
                          {(m, mode) for m in models for mode in modes}]
    start = time.monotonic()
    print(f"bench_shapes: {len(models)} models x {len(modes)} modes on {record['card']}, {args.calls} calls "
          f"({record['stream']['distinct_sizes']} distinct sizes), a fresh process each", flush=True)
    for model in models:
        for mode in modes:
            row = _spawn(args, mode, model)
            record["rows"].append(row)
            order = list(record["models"]), list(record["modes"])
            record["rows"].sort(key=lambda r: (order[0].index(r["model"]), order[1].index(r["mode"])))
            add_ratios(record["rows"])
            elapsed = time.monotonic() - start
            print(f"[{len(record['rows']):2d}/{len(models) * len(modes)} {int(elapsed) // 60:2d}:"
                  f"{int(elapsed) % 60:02d}] {_progress(row)}", flush=True)
            outputs.write_bench(args.out, "bench_shapes", record, table(record))  # a killed run keeps its rows
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    text = table(record)
    outputs.write_bench(args.out, "bench_shapes", record, text)
    print(f"\nwrote {os.path.join(args.out, 'bench_shapes.json')} and .md in {record['elapsed_s']:.0f} s\n", flush=True)
    print(text, flush=True)
    return 0


def _progress(row: dict[str, Any]) -> str:
    head = f"{row['model']} {row['mode']}"
    if row["status"] != "ok":
        return f"{head}: {row['status']}"
    parts = [f"pass 1 {row['pass1_s']:.2f} s", f"pass 2 {row['pass2_s']:.2f} s"]
    if row.get("graphs") is not None:
        parts.append(f"{row['graphs']} graphs, {row['recompiles']} recompiles"
                     + (f", fell back ({', '.join(row['fell_back'])})" if row["fell_back"] else ""))
    if row.get("peak_gib") is not None:
        parts.append(f"peak {row['peak_gib']:.2f} GiB")
    if row.get("max_rel_err") is not None:
        parts.append(f"max rel err {row['max_rel_err']:.1e}")
    return f"{head}: {', '.join(parts)} (process {row['process_s']:.0f} s)"


if __name__ == "__main__":
    sys.exit(main())
