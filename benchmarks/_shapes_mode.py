"""What one mode's process of benchmarks/bench_shapes.py does (``--one-mode``): build the model, compute the eager
references, run the stream twice under the mode, and say what Dynamo and kernelpytorch did."""

from __future__ import annotations

import argparse
import logging
import re
import time
from typing import Any

import torch

from .bench_shapes import DTYPES, WATCHED_PASSES, compile_kwargs, model_kwargs, stream


class _LimitHits(logging.Handler):
    """Dynamo's "hit config.recompile_limit" warnings: past it, the frame runs eagerly for good."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message:
            self.hits.append(message.splitlines()[0].replace("torch._dynamo hit config.", "").strip())


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, one batch row at a time on the output's device (ref lives on the host)."""
    num = torch.zeros((), dtype=torch.float64, device=out.device)
    den = torch.zeros((), dtype=torch.float64, device=out.device)
    for j in range(out.shape[0]):
        r = ref[j].to(out.device).float()
        num += (out[j].float() - r).pow(2).sum(dtype=torch.float64)
        den += r.pow(2).sum(dtype=torch.float64)
    return (num.sqrt() / den.sqrt().clamp_min(1e-30)).item()


def _run_pass(fn, inputs: list[tuple], refs: dict[int, torch.Tensor], device: str,
              mark_step: bool, call_s: list[float] | None = None) -> tuple[float, list[float], int | None]:
    """(seconds of the stream, the checked calls' errors, peak bytes): the checks are outside the timed spans
    and the peak (reset after each check). ``call_s`` gets each call's host seconds, from the call to its return
    (no sync: the device's queued work is not in it; compiles, traces and captures are)."""
    from kpt_compiler.bench import first_tensor

    from .measure import sync

    cuda = device == "cuda"
    seconds, errors, peak = 0.0, [], 0
    sync(device)
    t0 = time.perf_counter()
    for i, x in enumerate(inputs):
        if mark_step:  # a new iteration for CUDA graph trees: the previous call's outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        start = time.perf_counter()
        out = first_tensor(fn(*x))
        if call_s is not None:
            call_s.append(time.perf_counter() - start)
        if i in refs:
            sync(device)
            seconds += time.perf_counter() - t0
            peak = max(peak, torch.cuda.max_memory_allocated()) if cuda else 0
            errors.append(_rel_err(out, refs[i]))
            del out
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        else:
            del out
    sync(device)
    seconds += time.perf_counter() - t0
    return seconds, errors, (max(peak, torch.cuda.max_memory_allocated()) if cuda else None)


def _kpt_passes() -> dict[str, dict[str, Any]]:
    """Per watched pass: how many graphs gave each status, and its distinct reasons and notes (a few)."""
    import kpt_compiler

    found: dict[str, dict[str, Any]] = {}
    for report in kpt_compiler.reports():
        for p in report.passes():
            if p.name not in WATCHED_PASSES:
                continue
            entry = found.setdefault(p.name, {"statuses": {}, "notes": []})
            entry["statuses"][p.status] = entry["statuses"].get(p.status, 0) + 1
            for line in ([p.reason] if p.reason else []) + list(p.notes):
                if line not in entry["notes"] and len(entry["notes"]) < 8:
                    entry["notes"].append(line[:300])
    return found


_NEW_BUCKET = re.compile(r"call \d+: (first call in bucket|bucket .* breaks a guard)")
_CAPTURED = re.compile(r"bucket .*: captured \(")
_COMPILED_AT = re.compile(r"compiled at call \d+ \((\d+) ms\)")


def pool_mib(notes_per_graph: list[list[str]]) -> float | None:
    """The CUDA graphs' pool our captures hold at the end, from the cudagraphs pass's notes (each capture notes
    "X MiB in all" for its graph's pool); summed over graphs, None where nothing was captured."""
    sizes = [max(float(m) for n in notes for m in re.findall(r"([\d.]+) MiB in all", n))
             for notes in notes_per_graph if any("MiB in all" in n for n in notes)]
    return round(sum(sizes), 1) if sizes else None


def run_one(args: argparse.Namespace, mode: str, model_name: str) -> dict[str, Any]:
    """One (model, mode) in this process: what the parent gets back as the row."""
    from torch._dynamo import utils as dynamo_utils

    import kpt_compiler

    from . import measure
    from .zoo import Entry

    device = args.device
    dtype, dtype_name = DTYPES[device]
    kwargs = compile_kwargs(mode, args.kpt_codegen)
    builder, bkwargs = model_kwargs(model_name, args.attn, args.tiny)
    row: dict[str, Any] = {"model": model_name, "mode": mode, "dtype": dtype_name, "status": "ok",
                           "card": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "builder": builder, "builder_kwargs": bkwargs}
    if kwargs and "options" in kwargs:
        row["options"] = kwargs["options"]
    sizes = stream(args.calls, args.seed, args.max_batch, args.max_seq)
    hits = _LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    phase = "setup"
    try:
        with torch.no_grad():
            model, make_inputs = measure.prepare(Entry(model_name, builder, bkwargs, ()), device, dtype)
            model.eval()
            inputs = [make_inputs(b, s, device) for b, s in sizes]
            phase = "eager reference"
            checked = range(0, len(sizes), args.check_every) if args.check_every > 0 else ()
            from kpt_compiler.bench import first_tensor

            refs = {i: first_tensor(model(*inputs[i])).cpu() for i in checked}
            measure.cleanup(device)
            if kwargs and device == "cuda":
                measure.warm_up(device)
            fn = torch.compile(model, **kwargs) if kwargs else model
            dynamo_utils.counters.clear()
            dynamo_utils.clear_compilation_metrics()
            if hasattr(dynamo_utils, "set_compilation_metrics_limit"):
                dynamo_utils.set_compilation_metrics_limit(100_000)
            kpt_compiler.clear_reports()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            errors: list[float] = []
            peak = None
            later = []  # pass 2, repeated: the steady state, with its noise
            for n in range(1, 2 + max(1, getattr(args, "pass2_repeats", 1))):
                phase = f"pass {n}"
                call_s: list[float] = []
                seconds, errs, p = _run_pass(fn, inputs, refs, device, mark_step=bool(kwargs) and device == "cuda",
                                             call_s=call_s)
                if n == 1:
                    row["pass1_s"] = round(seconds, 4)
                    row["pass1_call_s"] = [round(t, 4) for t in call_s]
                else:
                    later.append(round(seconds, 4))
                errors += errs
                peak = p if peak is None else max(peak, p or 0)
            row["pass2_s"] = sorted(later)[len(later) // 2]  # the median
            row["pass2_runs_s"] = later
        row["max_rel_err"] = max(errors) if errors else None
        row["checked_calls"] = len(errors)
        row["peak_gib"] = round(peak / 2**30, 3) if peak is not None else None
    except Exception as e:  # noqa: BLE001 - the row says what the mode raised
        import traceback

        traceback.print_exc()
        row["status"] = measure.error_status(e)
        row["phase"] = phase
    finally:
        logging.getLogger("torch._dynamo").removeHandler(hits)
    if kwargs:
        # frame compiles (cudagraph trees add runtime records: a recording per size, not a compile)
        metrics = [m for m in dynamo_utils.get_compilation_metrics() if not getattr(m, "is_runtime", False)]
        reasons = [m.recompile_reason for m in metrics if m.recompile_reason]
        row["graphs"] = dynamo_utils.counters["stats"]["unique_graphs"]
        row["compiles"] = len(metrics)
        row["recompiles"] = len(reasons)
        row["recompile_reasons"] = list(dict.fromkeys(r[:200] for r in reasons))[:5]
        row["fell_back"] = hits.hits
        # where pass 1's time went: each frame compile's seconds (Dynamo's metrics), and for kpt the compiles
        # it deferred to a later call (they run inside a call, outside Dynamo's count)
        row["compile_s"] = [round(getattr(m, "entire_frame_compile_time_s", None) or 0.0, 1) for m in metrics]
        if kwargs["backend"] == "kernelpytorch":
            row["kpt_graphs"] = len(kpt_compiler.reports())
            row["kpt_passes"] = _kpt_passes()
            notes = [n for r in kpt_compiler.reports() for p in r.passes() for n in p.notes]
            row["buckets_used"] = sum(bool(_NEW_BUCKET.match(n)) for n in notes)
            row["buckets_captured"] = sum(bool(_CAPTURED.match(n)) for n in notes)
            row["deferred_compile_s"] = [round(float(m.group(1)) / 1e3, 1) for r in kpt_compiler.reports()
                                         for note in r.notes if (m := _COMPILED_AT.match(note))]
            row["pool_mib"] = pool_mib([p.notes for r in kpt_compiler.reports() for p in r.passes()
                                        if p.name == "cudagraphs"])
    return row


# ---------------------------------------------------------------------------------------------- the run (parent)
