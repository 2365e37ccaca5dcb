"""Cold and warm compiles (issue 20's warm restarts): each zoo case compiled in a new process twice over one fresh
Inductor cache folder, the second time as a restarted job would.

    python -m benchmarks.bench_warm [--models a,b] [--modes kpt,inductor] [--out DIR] [--device cuda|cpu]

For each quick inference case of the zoo (benchmarks/zoo.py; --models picks entries, and for an entry with no
quick inference case, such as the CPU zoo's whole models, takes its first inference case) and each mode, a
child process (``--child``) builds the model (bf16 on CUDA, fp32 on the CPU), runs it once eagerly, imports
Inductor (and for kpt our passes and kernels) under a timer of their own, compiles it under ``torch.no_grad`` and times
``torch.compile`` and the first call, which includes the compile. Of that time it also gives Dynamo's
share (Dynamo, our backend and Inductor; the rest is the first run, with the kernels' loading) and the time the
autotuners spent on their configs (Triton's, which our kernels use outside Inductor, and Inductor's; Triton's
count includes building each config's kernel). It runs twice with ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` in one new folder per case and mode: "cold" fills the caches, "warm" reads them, as a
restart on the same machine would. Columns: the two times, their ratio, the FX-graph cache hits of the warm run,
and for kpt the passes that fired in each run (our pre_aot passes run again on the warm compile, and the report
says where the code came from). Inductor's FX-graph and AOTAutograd caches key on our pipeline
(kpt_compiler/pass_manager.py's fingerprint). The issue asks for warm at least 3x faster than cold. ``--out DIR``
writes bench_warm.json and bench_warm.md (card, date, commit, command). ``--warm-runs N`` starts N warm children
(the table shows the first; the JSON has the others, to see whether the first warm run paid for something it
wrote). ``--profile DIR`` runs one more warm child with its compile under cProfile (its times are not in the table:
the profiler slows it) and writes DIR/<model>-<mode>-warm.txt: the functions by cumulative and by own time, to say
where a warm compile's seconds go.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


from .bench_rms_norm import write_out
from .outputs import run_meta
from .zoo import cases

MODES = ("kpt", "inductor")


def inference_case(model_name: str, device: str):
    """The zoo entry and the case a model's cold and warm compiles run: its first quick inference case, else (a
    model named with --models that has none, such as the CPU zoo's whole models) its first inference case."""
    for suite in ("quick", "full"):
        found = [(e, c) for e, c in cases(suite, device, [model_name]) if c.task == "inference"]
        if found:
            return found[0]
    raise ValueError(f"{model_name} has no inference case in the {device} zoo (benchmarks/zoo.py)")


def child(model_name: str, mode: str, device: str, profile: str | None = None) -> dict:
    """One compile of one case in this process: the first call's seconds and what the caches and passes did.

    Before any timer, the model runs once eagerly (CUDA, cuBLAS and cuDNN start there, which no compiler cache
    can spare a restart), then Inductor and our passes and kernels are imported under their own timer
    (``imports_s``: a restart pays them, cache or not). The compile timer runs from ``torch.compile`` to the end
    of the first compiled call. ``profile``: that part under cProfile, the statistics written there."""
    from torch._dynamo.utils import compile_times, counters

    import kpt_compiler

    from .measure import prepare, sync

    entry, case = inference_case(model_name, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, make_inputs = prepare(entry, device, dtype)
    model.eval()
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in make_inputs(case.batch, case.seq, device))
    with torch.no_grad():
        model(*inputs)
    sync(device)
    start = time.perf_counter()
    for module in ("torch._inductor.compile_fx",) + (("kpt_compiler.kernels", "kpt_compiler.passes") if mode == "kpt"
                                                     else ()):
        importlib.import_module(module)
    imports = time.perf_counter() - start
    backend = "kernelpytorch" if mode == "kpt" else "inductor"
    autotune = _time_autotuning()
    profiler = _Profile(profile)
    start = time.perf_counter()
    with profiler:
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            compiled(*inputs)
        sync(device)
    seconds = time.perf_counter() - start
    names, values = compile_times(repr="csv", aggregate=True)
    dynamo = float(dict(zip(names, values)).get("_compile.compile_inner", 0.0))
    row = {"model": entry.name, "shape": entry.shape(case), "mode": mode, "seconds": seconds, "imports_s": imports,
           "compile_s": dynamo, "autotune_s": autotune["seconds"], "autotunes": autotune["calls"],
           "fx_hits": counters["inductor"]["fxgraph_cache_hit"], "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
           "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
           "aot_misses": counters["aot_autograd"]["autograd_cache_miss"],
           "aot_bypasses": counters["aot_autograd"]["autograd_cache_bypass"]}
    if mode == "kpt":
        from kpt_compiler.kernels import _tuned_cache

        reports = kpt_compiler.reports()
        row["fired"] = sorted({p for r in reports for p in r.fired()})
        row["from_cache"] = any("came from Inductor's cache" in n for r in reports for n in r.notes)
        row["aot_cache_skipped"] = [n for r in reports for n in r.notes if n.startswith("AOTAutograd's cache skipped")]
        row["tuned_choices_read"] = _tuned_cache.stats()["read"]
        # our share: the backend calls (Inductor's compile inside them) and, of those, our passes by name
        row["backend_s"] = sum(r.compile_ms for r in reports) / 1e3
        passes: dict = {}
        for r in reports:
            for p in r.passes():
                passes[p.name] = passes.get(p.name, 0.0) + p.time_ms / 1e3
        row["passes_s"] = dict(sorted(passes.items(), key=lambda kv: -kv[1]))
    return row


class _Profile:
    """cProfile over a ``with`` block when given a path: the functions by cumulative and by own time go there."""

    def __init__(self, path: str | None):
        self.path = path

    def __enter__(self):
        if self.path:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def __exit__(self, *exc):
        if not self.path:
            return
        import io
        import pstats

        self.profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(self.profiler, stream=text).strip_dirs()
        stats.sort_stats("cumulative").print_stats(120)
        stats.sort_stats("tottime").print_stats(40)
        with open(self.path, "w") as f:
            f.write(text.getvalue())


def _time_autotuning() -> dict:
    """Count and time, in this process, the autotuners' work on their configs: Triton's ``Autotuner._bench`` (our
    kernels' ``triton.autotune`` outside Inductor; it builds each config's kernel, then times it) and Inductor's
    ``CachingAutotuner.benchmark_all_configs`` (its own kernels, and user kernels it launches). Neither exists
    without triton: then nothing is counted."""
    import functools

    totals = {"seconds": 0.0, "calls": 0}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals["seconds"] += time.perf_counter() - t0
                totals["calls"] += 1
        return wrapper

    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return totals
    Autotuner._bench = timed(Autotuner._bench)
    CachingAutotuner.benchmark_all_configs = timed(CachingAutotuner.benchmark_all_configs)
    return totals


def run_case(model_name: str, mode: str, device: str, profile: str | None = None, warm_runs: int = 1) -> dict:
    """Cold then warm (``warm_runs`` times), each a new process, over one new cache folder."""
    with tempfile.TemporaryDirectory() as cache:
        # Triton's cache too (the kernels it built, our own included): a cold run builds every kernel, as on a new
        # machine, and the warm one finds them, as a restart on the same machine would
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
               "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        runs = []
        for run in ("cold",) + ("warm",) * warm_runs + (("profiled",) if profile else ()):
            command = [sys.executable, "-m", "benchmarks.bench_warm", "--child", model_name, "--modes", mode,
                       "--device", device]
            if run == "profiled":
                os.makedirs(profile, exist_ok=True)
                command += ["--profile", os.path.join(profile, f"{model_name}-{mode}-warm.txt")]
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
            if out.returncode:
                return {"model": model_name, "mode": mode, "error": out.stderr.strip().splitlines()[-1][:300]}
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs[:2]
    again = runs[2:1 + warm_runs]
    row = {**{k: cold[k] for k in ("model", "shape", "mode")}, "cold_s": cold["seconds"], "warm_s": warm["seconds"],
           "cold_compile_s": cold["compile_s"], "warm_compile_s": warm["compile_s"],
           "cold_autotune_s": cold["autotune_s"], "warm_autotune_s": warm["autotune_s"],
           "cold_autotunes": cold["autotunes"], "warm_autotunes": warm["autotunes"],
           "cold_imports_s": cold["imports_s"], "warm_imports_s": warm["imports_s"],
           "speedup": cold["seconds"] / warm["seconds"],
           "speedup_with_imports": (cold["seconds"] + cold["imports_s"]) / (warm["seconds"] + warm["imports_s"]),
           "cold_first_call_s": cold["seconds"] - cold["compile_s"],
           "warm_first_call_s": warm["seconds"] - warm["compile_s"],
           # later restarts over the same caches: whether the first warm run still paid for something it wrote
           "warm_again_s": [r["seconds"] for r in again], "warm_again_compile_s": [r["compile_s"] for r in again],
           "profiled_s": runs[-1]["seconds"] if profile else None,
           "warm_fx_hits": warm["fx_hits"],
           "warm_fx_misses": warm["fx_misses"], "warm_aot_hits": warm["aot_hits"],
           "warm_aot_misses": warm.get("aot_misses"), "warm_aot_bypasses": warm.get("aot_bypasses")}
    if mode == "kpt":
        row.update(cold_fired=cold["fired"], warm_fired=warm["fired"], warm_says_cache=warm["from_cache"],
                   warm_tuned_choices_read=warm["tuned_choices_read"], warm_backend_s=warm["backend_s"],
                   warm_passes_s=warm["passes_s"], warm_aot_cache_skipped=warm.get("aot_cache_skipped", []))
    print(f"{row['model']} {mode}: cold {row['cold_s']:.1f} s, warm {row['warm_s']:.1f} s "
          f"({row['speedup']:.1f}x), warm FX-graph hits {row['warm_fx_hits']}; first call cold "
          f"{row['cold_first_call_s']:.2f} s, warm {row['warm_first_call_s']:.2f} s; later warm runs "
          f"{[round(x, 1) for x in row['warm_again_s']]} s; profiled run {row['profiled_s']}", flush=True)
    return row


def markdown(rows: list[dict], command: str, card: str, commit: str | None) -> str:
    lines = [f"# Cold and warm compiles on {card}", "",
             f"- date: {datetime.date.today()}; commit: {commit}; torch {torch.__version__}",
             f"- command: `{command}`",
             "- seconds: in a new process, after one eager call of the model (CUDA's libraries start there): "
             "torch.compile and the first compiled call; warm: the same again over the cold run's Inductor and "
             "Triton caches. (Dynamo, autotuning): the time inside Dynamo's compile, our backend and Inductor "
             "included, and the autotuners' time on their configs (Triton's, building included, and Inductor's; "
             "inside Dynamo's share where Inductor tunes while compiling). Imports: Inductor's, and for kpt our "
             "passes' and kernels', timed before the compile; the last ratio counts them in", "",
             "| model | shape | mode | cold s (Dynamo, autotuning) | warm s (Dynamo, autotuning) | cold / warm | "
             "imports s cold, warm | cold / warm with imports | warm FX-graph hits, misses | passes fired cold / "
             "warm | warm report says cache | autotune choices read warm |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | - | {r['mode']} | error: {r['error']} | | | | | | | | |")
            continue
        fired = f"{', '.join(r['cold_fired'])} / {', '.join(r['warm_fired'])}" if "cold_fired" in r else "-"
        says = ("yes" if r["warm_says_cache"] else "no") if "warm_says_cache" in r else "-"
        lines.append(f"| {r['model']} | {r['shape']} | {r['mode']} | {r['cold_s']:.1f} ({r['cold_compile_s']:.1f}, "
                     f"{r['cold_autotune_s']:.1f}) | {r['warm_s']:.1f} ({r['warm_compile_s']:.1f}, "
                     f"{r['warm_autotune_s']:.1f}) | "
                     f"{r['speedup']:.1f}x | {r['cold_imports_s']:.1f}, {r['warm_imports_s']:.1f} | "
                     f"{r['speedup_with_imports']:.1f}x | {r['warm_fx_hits']}, {r['warm_fx_misses']} | {fired} | "
                     f"{says} | {r.get('warm_tuned_choices_read', '-')} |")
    lines += ["", "Warm AOTAutograd cache (hits, misses, bypasses): " + "; ".join(
        f"{r['model']} {r['mode']} {r['warm_aot_hits']}, {r.get('warm_aot_misses')}, {r.get('warm_aot_bypasses')}"
        for r in rows if "error" not in r)]
    skipped = [f"- {r['model']} {r['mode']}: {n}" for r in rows for n in r.get("warm_aot_cache_skipped", [])]
    if skipped:
        lines += ["", "Warm graphs AOTAutograd's cache skipped (kpt's report):", *skipped]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated zoo entries (default: every quick inference one)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write bench_warm.json and bench_warm.md here")
    p.add_argument("--profile", default=None, help="profile each warm child (cProfile) into this folder")
    p.add_argument("--warm-runs", type=int, default=1,
                   help="warm children per case (the table's warm column is the first; the rest in the JSON)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_runs < 1:
        p.error(f"--warm-runs must be at least 1 (the restart the table compares with the cold run), "
                f"got {args.warm_runs}")
    modes = [m for m in args.modes.split(",") if m]
    if args.child:
        print(json.dumps(child(args.child, modes[0], args.device, args.profile)))
        return 0
    if args.models:
        models = list(dict.fromkeys(m for m in args.models.split(",") if m))
        for name in models:
            inference_case(name, args.device)  # an unknown name, or one with no inference case, fails here
    else:
        models = list(dict.fromkeys(e.name for e, c in cases("quick", args.device) if c.task == "inference"))
    meta = run_meta("bench_warm", argv, args.device)
    rows: list[dict] = []
    for name in models:
        for mode in modes:
            rows.append(run_case(name, mode, args.device, args.profile, args.warm_runs))
            table = markdown(rows, meta["command"], meta["card"], meta["commit"])
            write_out(args.out, "bench_warm", meta, rows, table)  # after each row: a killed run keeps them
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
