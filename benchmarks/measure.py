"""One row: compile, first call, error against eager float32, timing, peak memory and the passes that fired."""

from __future__ import annotations

import contextlib
import copy
import gc
import tempfile
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.bench import Timing, first_tensor, peak_memory, relative_error, timing_ms
from kpt_compiler.models.zoo import build

from .zoo import Case, Entry


# A row whose spread, (p80 - p20) / median, is above NOISY is timed again, at most RETRIES more times, and the
# steadiest run is kept. Launch-bound rows (small models without CUDA graphs) moved by 20-48% between runs
# on the H100 machine's host (2026-11-26 suites), too much to rank kernelpytorch against Inductor.
NOISY = 0.10
RETRIES = 2


def steady_timing(step: Callable[[], Any], device: str, rep_ms: float, noisy: float = NOISY,
                  retries: int = RETRIES) -> tuple[Timing, int]:
    """(the steadiest of up to 1 + ``retries`` timings of ``step``, how many extra timings it took)."""
    best = timing_ms(step, device, warmup_ms=rep_ms / 5, rep_ms=rep_ms)
    extra = 0
    while best.noise > noisy and extra < retries:
        extra += 1
        again = timing_ms(step, device, warmup_ms=rep_ms / 5, rep_ms=rep_ms)
        if again.noise < best.noise:
            best = again
    return best, extra


def uses_cudagraphs(kwargs: dict[str, Any] | None) -> bool:
    """Whether torch.compile keyword arguments ask for CUDA graphs (mode reduce-overhead or max-autotune)."""
    kwargs = kwargs or {}
    mode = kwargs.get("mode") or kwargs.get("options", {}).get("mode")
    return mode in ("reduce-overhead", "max-autotune")


def prepare(entry: Entry, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Callable[..., tuple]]:
    """The entry's model on ``device`` in ``dtype``, and its ``make_inputs(batch, seq, device)``."""
    torch.manual_seed(0)
    model, make_inputs = build(entry.builder, **entry.kwargs)
    # Dropout off: compiled and eager code draw different random numbers, and the output is checked.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.to(device=device, dtype=dtype), make_inputs


def reference(model: torch.nn.Module, inputs: tuple, training: bool) -> torch.Tensor:
    """The float32 eager output on the same (possibly bf16-rounded) weights and inputs, kept on the host."""
    ref_model = copy.deepcopy(model).float().train(training)
    with torch.no_grad(), _no_tf32():
        ref = first_tensor(ref_model(*(x.float() if x.is_floating_point() else x for x in inputs))).float().cpu()
    del ref_model
    return ref


def run_row(model: torch.nn.Module, inputs: tuple, ref: torch.Tensor, case: Case, compile_kwargs: dict | None,
            device: str, rep_ms: float) -> dict[str, Any]:
    """One mode (torch.compile keyword arguments, None for eager) on one case; raises what the mode raised."""
    kpt_compiler.clear_reports()
    torch._dynamo.reset()
    with fresh_caches() if compile_kwargs else contextlib.nullcontext():
        row = _measure(model, inputs, ref, case, compile_kwargs, device, rep_ms)
    if compile_kwargs and compile_kwargs["backend"] == "kernelpytorch":
        fired: list[str] = []
        for report in kpt_compiler.reports():
            fired += [p for p in report.fired() if p not in fired]
        row["passes"] = fired
    return row


def _measure(model: torch.nn.Module, inputs: tuple, ref: torch.Tensor, case: Case, compile_kwargs: dict | None,
             device: str, rep_ms: float) -> dict[str, Any]:
    training = case.task == "training"
    step = make_step(model, inputs, ref, training, compile_kwargs, device)
    torch._dynamo.utils.counters.clear()
    with torch.set_grad_enabled(training):
        sync(device)
        t0 = time.perf_counter()
        out = step()
        sync(device)
        first_s = time.perf_counter() - t0
        rel_err = relative_error(out, ref.to(device))
        del out
        timing, retimed = steady_timing(step, device, rep_ms)
        peak = peak_memory(step, device)
    return {
        "compile_s": round(first_s, 3) if compile_kwargs else None,
        "ms": timing.median,
        "p20_ms": timing.p20,
        "p80_ms": timing.p80,
        "noise": timing.noise,
        "retimed": retimed,
        "peak_mib": round(peak / 2**20, 1) if peak is not None else None,
        "rel_err": rel_err,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] if compile_kwargs else None,
    }


def make_step(model: torch.nn.Module, inputs: tuple, ref: torch.Tensor, training: bool,
              compile_kwargs: dict | None, device: str) -> Callable[[], torch.Tensor]:
    """One timed step of a mode: the compiled (or eager) forward, and for training the loss and backward."""
    if compile_kwargs and "torchao" in compile_kwargs:  # torchao's float8 on a copy: the others keep the model
        from . import torchao_fp8

        recipe, compile_kwargs = compile_kwargs["torchao"], {k: v for k, v in compile_kwargs.items() if k != "torchao"}
        model = copy.deepcopy(model)
        if training:
            model = torchao_fp8.convert_training(model, recipe)
        else:
            model = torchao_fp8.convert_inference(model.requires_grad_(False), recipe)
    fn = torch.compile(model, **compile_kwargs) if compile_kwargs else model
    cudagraphs = uses_cudagraphs(compile_kwargs)
    target = None
    if training:  # fixed random classes for the output's last dimension (next tokens, image classes)
        g = torch.Generator().manual_seed(0)
        target = torch.randint(0, ref.shape[-1], ref.shape[:-1], generator=g).flatten().to(device)

    def step() -> torch.Tensor:
        if cudagraphs:  # a new iteration for CUDA graph trees: the previous step's outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        if training:
            model.zero_grad(set_to_none=True)
        out = first_tensor(fn(*inputs))
        if training:
            F.cross_entropy(out.flatten(0, -2).float(), target).backward()
        return out

    return step


def interleaved(model: torch.nn.Module, inputs: tuple, ref: torch.Tensor, case: Case,
                modes: dict[str, dict | None], device: str, rounds: int, rep_ms: float,
                share_model: bool = False) -> dict[str, dict]:
    """Each mode compiled once and kept, then timed in turn, ``rounds`` times, the order rotated each round.

    For rows the host bounds (a small model's training step without CUDA graphs: the GPU waits for Python),
    the machine's drift from one minute to the next is larger than the difference between modes, and timing
    the modes one after another ranks them by when they ran. Timed in turn, each round compares the modes
    under the same conditions: per mode, the median over rounds of its median ms, and its speed-up over
    Inductor as the median of the per-round ratios, with their 20th and 80th percentiles."""
    training = case.task == "training"
    steps = {}
    torch._dynamo.reset()
    # each mode's compile is a recompile of the model's forward (another backend): past Dynamo's limit the rest
    # would run eager, timed as if compiled
    limits = torch._dynamo.config.patch(recompile_limit=len(modes) + 8,
                                        accumulated_recompile_limit=max(256, 4 * len(modes)))
    with torch.set_grad_enabled(training), limits:
        for mode, kwargs in modes.items():
            # training: each mode its own copy of the model (the same weights), so no mode's state (gradients,
            # Dynamo's cache entries on the module) is another's. Whether sharing skewed the rounds is not settled:
            # on the CPU it seemed to, then not when the forms swapped order (benchmarks/diag_train_inturn.py and
            # results/cpu/2026-11-29-s30-diag-train-inturn-*.txt); the H100's alike rounds are not checked.
            # share_model=True: the old form, for that diagnostic
            own = copy.deepcopy(model) if training and not share_model else model
            with fresh_caches() if kwargs else contextlib.nullcontext():
                steps[mode] = make_step(own, inputs, ref, training, kwargs, device)
                steps[mode]()  # compiles forward and backward
                sync(device)
        names = list(steps)
        times: dict[str, list[float]] = {m: [] for m in names}
        for r in range(rounds):
            for mode in names[r % len(names):] + names[:r % len(names)]:
                times[mode].append(timing_ms(steps[mode], device, warmup_ms=rep_ms / 5, rep_ms=rep_ms).median)
    del steps
    cleanup(device)
    out = {}
    for mode, ms in times.items():
        entry = {"rounds": rounds, "ms": _quantiles(ms)}
        if "inductor" in times:
            entry["vs_inductor"] = _quantiles([a / b for a, b in zip(times["inductor"], ms)])
        out[mode] = entry
    return out


def _quantiles(values: list[float]) -> dict[str, float]:
    """Median, 20th and 80th percentiles (interpolated as torch.quantile does)."""
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    return {"median": q[0], "p20": q[1], "p80": q[2]}


@contextlib.contextmanager
def fresh_caches():
    # Inductor keeps generated code and Triton binaries on disk across modes and runs; a fresh folder per
    # compiled mode keeps one mode's compile from reusing another's kernels. The outer folder goes even when
    # the compile fails (fresh_inductor_cache keeps its own then, for debugging).
    from torch._inductor.utils import fresh_inductor_cache

    with tempfile.TemporaryDirectory(prefix="kpt_bench_") as folder, fresh_inductor_cache(dir=folder):
        yield


@contextlib.contextmanager
def _no_tf32():
    # The reference is float32 arithmetic; cuDNN convolutions would otherwise use TF32 by default.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def warm_up(device: str) -> None:
    """Compile something small once, so that process-wide one-time costs (imports, compile workers, CUDA and
    Triton start-up) do not land in the first row's compile time and make the modes' times incomparable."""
    fn = torch.compile(lambda x: torch.sin(x) + 1)
    with fresh_caches():
        fn(torch.ones(64, device=device))
    sync(device)
    torch._dynamo.reset()


def cleanup(device: str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def error_status(e: BaseException) -> str:
    # Dynamo's wrappers put the cause on the lines after the first and end with advice on logging
    lines = [line.strip() for line in str(e).splitlines()
             if line.strip() and not line.startswith(("Set TORCHDYNAMO_VERBOSE", "For even more developer"))]
    return f"error: {type(e).__name__}: {' '.join(lines)}"[:300]
