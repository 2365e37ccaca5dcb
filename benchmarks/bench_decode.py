"""Compiled decoding as transformers documents it: greedy ``generate`` with a static cache and a compiled forward.

    python -m benchmarks.bench_decode [--modes eager,inductor,inductor-ro,kpt,kpt[no-cudagraphs],kpt[ro],
        kpt[cudagraphs-always]] [--new-tokens 64] [--repeats 5] [--profile kpt,eager] [--out benchmarks/out/decode]
    python -m benchmarks.bench_decode --device cpu --tiny            (CPU check: eager and kpt modes only)

A Llama-style model (LlamaConfig, random weights, bf16 on cuda; 8 layers, hidden 4096 by default) runs
``model.generate(ids, max_new_tokens=N, do_sample=False, cache_implementation="static")`` with
``model.forward = torch.compile(model.forward, ...)``, a fresh compile per mode. Per mode: two warm-up calls
(the compiles, from a fresh Inductor cache folder; "compile+warmup s"), then ``generate`` timed with 1 and N
new tokens, --repeats times each; ms/token = (T(N) - T(1)) / (N - 1): the decode steps without the prefill,
median and [min, max] over repeats. Every call makes exactly N tokens: the end-of-sequence id is unset. The
tokens of each mode are compared with the --reference mode's and eager's ("identical", or the first index that
differs). kpt modes list, per graph, the passes that fired and what the cudagraphs pass decided.
``--step`` also times the compiled forward alone on one decode step (the keyword arguments generate() passes
at its second token, the same cache slot written again): "step ms" back to back (calls queued without a wait:
the device's time where the host keeps ahead) and synchronized after each call (host and device in series).
``--separate`` runs each mode in a process of its own (one mode's compiled graphs, Dynamo caches and allocator
state cannot slow the next; the record says so). ``--profile MODES`` profiles 3 decode steps of those modes
(generate with 4 new tokens minus generate with 1) and prints the kernels that take the most device time per
token.
transformers' own auto-compile of static-cache decoding is switched off (``disable_compile``): otherwise it
wraps every mode's forward, eager included, in its own torch.compile on cuda.
A mode name ending in ``+deferred-stop`` (``kpt+deferred-stop``: CUDA, transformers 5.24 or later) is that mode with
every generate() call inside ``kpt_compiler.generation.deferred_stop_check()``: the stop flag read one step late, so
the host queues the next step while the device runs this one (its tokens compared as any mode's).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kpt_compiler
from kpt_compiler.generation import deferred_stop_check, deferred_stop_supported

from . import measure, outputs
from .run import all_modes

LOCAL_SETS = {"cudagraphs-always": {"cudagraphs": {"decide": "always"}},  # not in option_sets.OPTION_SETS
              "fp4": {"fp4": {"decide": "always"}},  # lossy, opt-in: the fp4 pass on every eligible linear
              # the same with each layer its own kernel (q, k, v and gate, up not quantized as one weight)
              "fp4-no-merge": {"fp4": {"decide": "always", "merge_parallel_linears": False}},
              "fp4-no-pack-gqa": {"fp4": {"decide": "always"}, "attention": {"pack_gqa": False}},
              "no-pack-gqa": {"attention": {"pack_gqa": False}},  # grouped-query SDPA over repeat_kv's copies
              # packed SDPA below the SMs' pair threshold too
              "attention-always": {"attention": {"decide": "always", "gqa_kernel": "sdpa"}},
              # grouped-query attention at small query lengths as FlexAttention over k and v as they are (the
              # default on sm_9x since s35), or as packed SDPA under the pair rule (the default before)
              "gqa-flex": {"attention": {"gqa_kernel": "flex"}},
              "gqa-sdpa": {"attention": {"gqa_kernel": "sdpa"}},
              "fp4-gqa-sdpa": {"fp4": {"decide": "always"}, "attention": {"gqa_kernel": "sdpa"}},
              "fp4-gqa-flex": {"fp4": {"decide": "always"}, "attention": {"gqa_kernel": "flex"}},
              # Inductor's horizontal fusion (an Inductor option, passed through): independent small kernels of
              # the step (the per-layer cache updates, norms) as one launch; not yet GPU-run (s36)
              "combo": {"inductor": {"combo_kernels": True}},
              "fp4-combo": {"fp4": {"decide": "always"}, "inductor": {"combo_kernels": True}}}
DEFERRED = "+deferred-stop"  # a mode's suffix: its generate() calls inside deferred_stop_check()
DEFAULT_MODES = "eager,inductor,inductor-ro,kpt,kpt[no-cudagraphs],kpt[ro],kpt[cudagraphs-always]"
NEEDS_CUDA = ("inductor-ro", "kpt[ro]", "kpt[cudagraphs-always]")
FULL = dict(num_hidden_layers=8, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=32000)
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
PROFILED_STEPS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_kwargs(mode: str, device: str) -> dict | None:
    mode = mode.removesuffix(DEFERRED)
    modes = all_modes()
    for name, options in LOCAL_SETS.items():  # option_sets.py's own set wins if it gets one of these names
        modes.setdefault(f"kpt[{name}]", {"backend": "kernelpytorch", "options": options})
    if mode not in modes:
        raise SystemExit(f"error: unknown mode {mode!r}; known: {', '.join(modes)}")
    kwargs = modes[mode]
    if kwargs and kwargs["backend"] == "kernelpytorch":
        kwargs = {**kwargs, "options": {**kwargs["options"], **({"codegen": "eager"} if device == "cpu" else {})}}
    return kwargs


def build_model(config: dict, device: str, dtype: torch.dtype):
    """Random weights made on ``device`` in ``dtype`` directly (no float32 copy on the host)."""
    import transformers

    cfg = transformers.LlamaConfig(max_position_embeddings=4096, **config)
    saved = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(saved)
    # no end-of-sequence: every call makes exactly max_new_tokens (random weights may pick the eos id); pad 0
    # keeps generate from warning; disable_compile: the forward is compiled by us, not by generate
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.disable_compile = None, 0, True
    return model


def skip_reason(mode: str, device: str) -> str | None:
    if mode.endswith(DEFERRED) and device == "cpu":
        return "skipped: the deferred stop check waits on a torch.Event, which the CPU has not"
    if mode.endswith(DEFERRED) and not deferred_stop_supported():
        import transformers

        return f"skipped: transformers {transformers.__version__} cannot defer its stop check (5.24 or later can)"
    mode = mode.removesuffix(DEFERRED)
    if device == "cpu" and mode in NEEDS_CUDA:
        return "skipped: needs CUDA"
    if device == "cpu" and mode.startswith("inductor"):
        return "skipped: cpu test keeps Inductor's C++ build out"
    return None


def first_difference(a: list[int] | None, b: list[int] | None, steps: list[dict] | None = None) -> str:
    """Where tokens ``a`` first differ from ``b``. ``steps``: ``b``'s greedy margins per step (``margins``); where
    the step that differs had its two best logits within one rounding step of the model's dtype, the text says
    so: one rounding of any kernel decides such a token (random weights make exact ties)."""
    if a is None or b is None:
        return "-"
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None and len(a) == len(b):
        return "identical"
    at = i if i is not None else min(len(a), len(b))
    step = steps[at] if steps and at < len(steps) else None
    if step is None:
        return f"differs at {at}"
    tie = ": a tie" if step["gap"] <= step["ulp"] else ""
    return f"differs at {at} (the other's two best logits there {step['gap']:.3g} apart, one rounding step " \
           f"{step['ulp']:.3g}{tie})"


def margins(model, ids, new_tokens: int) -> tuple[list[int], list[dict]]:
    """One more greedy generate() with its scores: the tokens and, per step, the gap between the two best logits
    and one rounding step of the model's dtype at the best logit's magnitude."""
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                         output_scores=True, return_dict_in_generate=True)
    eps = torch.finfo(model.dtype).eps
    steps = []
    for s in out.scores:
        top = s[0].float().topk(2).values.tolist()
        steps.append({"gap": top[0] - top[1], "ulp": eps * 2.0 ** math.floor(math.log2(max(abs(top[0]), 1e-30)))})
    return out.sequences[0, ids.shape[1]:].tolist(), steps


def kpt_graphs() -> list[dict]:
    """Per graph compiled by kernelpytorch: the passes that fired, and the cudagraphs pass's status and notes."""
    graphs = []
    for r in kpt_compiler.reports():
        g = {"graph": r.index, "compile_id": r.compile_id, "fired": r.fired()}  # "frame/recompile" (Dynamo's)
        try:
            cg = r.pass_record("cudagraphs")
        except KeyError:
            cg = None
        if cg is not None:
            declined = any(n.startswith("Inductor declined") for n in cg.notes)
            g.update(cudagraphs=cg.status, captured=cg.status == "applied" and not declined,
                     cudagraphs_notes=([cg.reason] if cg.reason else []) + cg.notes)
        graphs.append(g)
    return graphs


def captured_cell(mode: str, kwargs: dict | None, graphs: list[dict], skips: int) -> str:
    if measure.uses_cudagraphs(kwargs):
        return "by mode" + (f", {skips} skipped" if skips else "")
    if kwargs and kwargs["backend"] == "kernelpytorch":
        captured = sum(bool(g.get("captured")) for g in graphs)
        return f"{captured}/{len(graphs)} graphs" + (f", {skips} skipped" if skips else "")
    return "-"


def run_mode(model, forward, ids, mode: str, kwargs: dict | None, args, device: str) -> dict:
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    torch._dynamo.utils.counters.clear()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.forward = torch.compile(forward, **kwargs) if kwargs else forward

    def generate(n: int) -> tuple[float, torch.Tensor]:
        measure.sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static")
        measure.sync(device)
        return time.perf_counter() - t0, out

    t0 = time.perf_counter()
    for _ in range(2):  # the largest call first: the static cache is sized for it, and later calls reuse the size
        generate(args.new_tokens)
    row = {"compile_warmup_s": round(time.perf_counter() - t0, 3)}
    per_token = []
    for _ in range(args.repeats):
        t1, _ = generate(1)
        tn, out = generate(args.new_tokens)
        per_token.append((tn - t1) / (args.new_tokens - 1) * 1e3)
    tokens = out[0, ids.shape[1]:].tolist()
    if len(tokens) != args.new_tokens:
        raise RuntimeError(f"generate made {len(tokens)} tokens, not {args.new_tokens}")
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None  # before the scored run
    scored, steps = margins(model, ids, args.new_tokens)  # after the timing: not timed
    row.update(ms_per_token=statistics.median(per_token), min_ms=min(per_token), max_ms=max(per_token),
               per_token_ms=per_token, tokens=tokens, margins=steps,
               scored_vs_timed=first_difference(scored, tokens), peak_gib=peak_gib)
    graphs = kpt_graphs() if kwargs and kwargs["backend"] == "kernelpytorch" else None
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    row.update(graphs=graphs, cudagraph_skips=skips, captured=captured_cell(mode, kwargs, graphs or [], skips))
    if args.step and args.new_tokens > 3:  # a cache that counts its own slots holds new_tokens - 3 more calls
        row.update(step_timing(model, ids, device, calls=min(20, args.new_tokens - 3)))
    if mode in args.profile:
        row["profile"] = profile_decode(model, ids, args.top, row["ms_per_token"])
    return row


def step_timing(model, ids, device: str, calls: int) -> dict:
    """The compiled forward alone on the arguments generate() gives its second decode step, ``calls`` times back
    to back (one wait at the end) and ``calls`` times with a wait after each: ms per call, median of 3 rounds.
    Each set of calls starts from a fresh generate() of 3 tokens (a cache that counts its own position, as
    transformers 5.24's does, moves one slot per call: ``calls`` stays under the cache's free slots)."""
    compiled = model.forward

    def record():
        seen = []

        @functools.wraps(compiled)  # generate() reads the forward's signature to choose what it passes
        def recorder(*a, **k):
            ids_now = k.get("input_ids")
            if not seen and ids_now is not None and ids_now.shape[1] == 1:
                seen.append((a, k))
            return compiled(*a, **k)

        model.forward = recorder
        try:
            model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
        finally:
            model.forward = compiled
        if not seen:
            raise RuntimeError("generate() made no one-token forward call")
        return seen[0]

    def timed(wait_each: bool) -> float:
        a, k = record()
        measure.sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            compiled(*a, **k)
            if wait_each:
                measure.sync(device)
        measure.sync(device)
        return (time.perf_counter() - t0) / calls * 1e3

    back = [timed(False) for _ in range(3)]
    synced = [timed(True) for _ in range(3)]
    return {"step_ms": statistics.median(back), "step_synced_ms": statistics.median(synced), "step_calls": calls}


def profile_decode(model, ids, top: int, wall_ms: float) -> dict:
    """Device time per decode token, kernel by kernel: generate with 1 + PROFILED_STEPS tokens minus with 1."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    per_kernel = []
    for n in (1, 1 + PROFILED_STEPS):
        with torch.profiler.profile(activities=acts) as prof:
            model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static")
            torch.cuda.synchronize()
        per_kernel.append({e.key: (e.count, e.device_time_total) for e in prof.key_averages()
                           if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0})
    one, more = per_kernel
    diff = {k: ((c - one.get(k, (0, 0))[0]) / PROFILED_STEPS, (us - one.get(k, (0, 0.0))[1]) / PROFILED_STEPS)
            for k, (c, us) in more.items()}
    ranked = sorted(diff.items(), key=lambda kv: -kv[1][1])
    return {"wall_ms_per_token": wall_ms, "device_ms_per_token": sum(us for _, us in diff.values()) / 1e3,
            "kernels_per_token": sum(c for c, _ in diff.values()),
            "top": [{"kernel": k[:90], "calls": c, "us": us} for k, (c, us) in ranked[:top]]}


def table(record: dict) -> str:
    ref = record["reference"]
    lines = [f"# Decoding, {record['config_name']} Llama, batch {record['batch']}, prompt {record['prompt']}, "
             f"{record['new_tokens']} new tokens, on {record['card']}", "",
             f"- date: {record.get('date')}; commit: {record.get('commit')}; torch {record.get('torch')}; "
             f"transformers {record.get('transformers')}",
             f"- command: `{record['command']}`",
             "- ms/token: (T(new) - T(1)) / (new - 1), median over repeats [min, max]",
             "- step ms (with --step): the compiled forward alone on one decode step, back to back / waiting for "
             "each call", "",
             f"| mode | compile+warmup s | ms/token | spread | tokens vs {ref} | tokens vs eager | peak GiB "
             "| captured? | step ms | status |", "|" + " --- |" * 10]
    for r in record["rows"]:
        if "ms_per_token" not in r:
            lines.append(f"| {r['mode']} | - | - | - | - | - | - | - | - | {r['status'].replace('|', '/')} |")
            continue
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        step = f"{r['step_ms']:.3f} / {r['step_synced_ms']:.3f}" if "step_ms" in r else "-"
        lines.append(f"| {r['mode']} | {r['compile_warmup_s']:.1f} | {r['ms_per_token']:.3f} | "
                     f"[{r['min_ms']:.3f}, {r['max_ms']:.3f}] | {r['vs_reference']} | {r['vs_eager']} | {peak} | "
                     f"{r['captured']} | {step} | {r['status']} |")
    for r in record["rows"]:
        if r.get("scored_vs_timed", "identical") != "identical":
            lines.append(f"\n- {r['mode']}: the generate() run after the timing for the logits' margins "
                         f"{r['scored_vs_timed']} from the timed run's tokens")
    for r in record["rows"]:
        for g in r.get("graphs") or []:
            lines.append(f"\n- {r['mode']} graph {g['graph']} (Dynamo's compile {g.get('compile_id', '?')}): fired "
                         f"{', '.join(g['fired']) or 'none'}; cudagraphs "
                         f"{g.get('cudagraphs')}: {' / '.join(g.get('cudagraphs_notes') or [])}")
    for r in record["rows"]:
        if "profile" in r:
            p = r["profile"]
            lines += ["", f"## {r['mode']}: wall {p['wall_ms_per_token']:.3f} ms/token, device "
                          f"{p['device_ms_per_token']:.3f} ms/token, {p['kernels_per_token']:.0f} kernels/token", "",
                      "| kernel | calls/token | us/token |", "| --- | --- | --- |"]
            lines += [f"| {k['kernel']} | {k['calls']:g} | {k['us']:.1f} |" for k in p["top"]]
    return "\n".join(lines)


def _in_own_process(args, mode: str, kwargs: dict | None) -> dict:
    """``mode``'s row from a process of its own (bench_decode --row-file), or an error row if it died."""
    with tempfile.TemporaryDirectory(prefix="kpt_decode_") as folder:
        path = os.path.join(folder, "row.json")
        cmd = [sys.executable, "-m", "benchmarks.bench_decode", "--device", args.device, "--modes", mode,
               "--reference", args.reference, "--batch", str(args.batch), "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--top", str(args.top),
               "--profile", mode if mode in args.profile else "", "--row-file", path]
        cmd += ["--step"] if args.step else []
        cmd += ["--tiny"] if args.tiny else []
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    tail = " ".join((done.stdout + done.stderr).split())[-250:]
    return {"mode": mode, "compile_kwargs": kwargs, "status": f"error: its process exited with {done.returncode}: "
            f"{tail}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, vocab 256, float32, 8 new tokens")
    p.add_argument("--modes", default=DEFAULT_MODES)
    p.add_argument("--reference", default="kpt[no-cudagraphs]")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (8 with --tiny)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", default="", help="modes (comma-separated) to profile after timing (CUDA only)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--step", action="store_true", help="also time the compiled forward alone on one decode step")
    p.add_argument("--out", default="benchmarks/out/decode")
    p.add_argument("--separate", action="store_true", help="each mode in a process of its own (nothing left by "
                   "the modes before it: Dynamo's caches, the allocator's blocks, compiled graphs)")
    p.add_argument("--row-file", default=None, help=argparse.SUPPRESS)  # --separate's child: its one row here
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 64)
    args.profile = [m for m in args.profile.split(",") if m] if args.device == "cuda" else []
    device, names = args.device, args.modes.split(",")
    kwargs = {m: compile_kwargs(m, device) for m in names}
    dtype = torch.float32 if args.tiny or device == "cpu" else torch.bfloat16
    config = TINY if args.tiny else FULL
    model = None if args.separate else build_model(config, device, dtype)  # --separate: each process builds its own
    forward = model.forward if model is not None else None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (args.batch, args.prompt), generator=g).to(device)
    if device == "cuda" and model is not None:
        measure.warm_up(device)  # process-wide one-time costs out of the first mode's compile time
    rows = []
    for mode in names:
        if args.separate:
            rows.append(_in_own_process(args, mode, kwargs[mode]))
            print(f"{mode}: {rows[-1]['status']}", flush=True)
            continue
        row = {"mode": mode, "compile_kwargs": kwargs[mode], "status": skip_reason(mode, device) or "ok"}
        if row["status"] == "ok":
            try:
                with torch.no_grad(), measure.fresh_caches() if kwargs[mode] else contextlib.nullcontext(), (
                        deferred_stop_check() if mode.endswith(DEFERRED) else contextlib.nullcontext()):
                    row.update(run_mode(model, forward, ids, mode, kwargs[mode], args, device))
            except Exception as e:  # one mode's failure is a row; the others still run
                row["status"] = measure.error_status(e)
            finally:
                model.forward = forward
                measure.cleanup(device)
        print(f"{mode}: {row['status']}" + (f", {row['ms_per_token']:.3f} ms/token" if "ms_per_token" in row else ""),
              flush=True)
        rows.append(row)
    if args.row_file:
        with open(args.row_file, "w") as f:
            json.dump({**rows[0], "attn_implementation": model.config._attn_implementation}, f)
        return 0
    tokens = {r["mode"]: r.get("tokens") for r in rows}
    steps = {r["mode"]: r.get("margins") for r in rows}
    for r in rows:
        r["vs_reference"] = first_difference(r.get("tokens"), tokens.get(args.reference), steps.get(args.reference))
        r["vs_eager"] = first_difference(r.get("tokens"), tokens.get("eager"), steps.get("eager"))
    command = "python -m benchmarks.bench_decode " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    record = {"card": torch.cuda.get_device_name() if device == "cuda" else "cpu", "device": device,
              "config_name": "tiny" if args.tiny else "8-layer", "config": config, "dtype": str(dtype),
              "attn_implementation": model.config._attn_implementation if model is not None else
              next((r["attn_implementation"] for r in rows if "attn_implementation" in r), None), "batch": args.batch,
              "separate_processes": args.separate,
              "prompt": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "reference": args.reference, "command": command, "rows": rows}
    from kpt_compiler.bench import git_commit

    import transformers

    record.update(date=str(__import__("datetime").date.today()), commit=git_commit(), torch=torch.__version__,
                  transformers=transformers.__version__)
    text = table(record)
    print(text)
    outputs.write_bench(args.out, "bench_decode", record, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
