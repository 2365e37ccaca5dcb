"""The backend: ``torch.compile(model, backend="kernelpytorch", mode=..., options={...})`` lands here.

One call per graph Dynamo captures:
  options  -> parse and validate (OptionError names the key and the valid choices)
  target   -> the device of the example inputs, checked against options["device"]
  pre_aot  -> our pre-AOT passes on the Dynamo graph
  emitter  -> Inductor (cuda, cpu), eager (codegen="eager") or torch_xla (xla), each running AOTAutograd
              and calling back into the joint / forward / backward stages
  wrap     -> passes that wrap the compiled callable (bucketing, CUDA-graph capture)
  report   -> a GraphReport (kpt_compiler.last_report()) and, with dump_dir, files and index.html
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from . import distributed, graph_utils
from . import report as report_mod
from .emitters import EMITTERS
from .errors import OptionError, PassFailed
from .options import CompileOptions, parse_options
from .pass_manager import PassManager
from .pipeline import describe_pipeline
from .target import Target, detect_target

__all__ = ["kernelpytorch", "BACKEND_NAME"]

BACKEND_NAME = "kernelpytorch"
log = logging.getLogger("kpt_compiler")


def _choose_codegen(options: CompileOptions, target: Target) -> str:
    if target.device == "xla":
        if options.codegen != "auto":
            raise OptionError(
                f"options['codegen']={options.codegen!r} applies to cuda and cpu; XLA graphs are lowered by "
                "torch_xla's dynamo bridge. Leave codegen='auto' on XLA."
            )
        if options.mode != "default":
            raise OptionError(
                f"mode={options.mode!r} is an Inductor mode (CUDA graphs, autotuning) and XLA cannot honour it; "
                "leave mode='default' on XLA"
            )
        return "xla"
    if options.codegen == "eager":
        if options.mode != "default":
            raise OptionError(
                f"mode={options.mode!r} needs Inductor to generate code; it cannot be honoured with "
                "codegen='eager'. Use codegen='inductor' (the default) or mode='default'."
            )
        if options.inductor:
            raise OptionError("options['inductor'] configures Inductor, which codegen='eager' does not use")
        return "eager"
    return "inductor"


def _compile_id() -> str:
    try:
        cid = torch._guards.CompileContext.current_compile_id()
        return str(cid) if cid is not None else "-"
    except Exception:  # noqa: BLE001 - only a label
        return "-"


def _run_pipeline_and_emit(gm: fx.GraphModule, example_inputs: Sequence[Any], pm: PassManager,
                           original: graph_utils.GraphSnapshot | None = None) -> Callable:
    """``original``: a snapshot of ``gm`` as it is (the pre_aot stage's first rollback point, not copied again)."""
    try:
        is_inference = _is_inference(gm, example_inputs)
        pm.run_stage(gm, "pre_aot", is_inference=is_inference, snapshot=original)
        if pm.defer_calls > 1 and graph_utils.has_dynamic_sizes(gm):
            compiled = _AsIs(gm, pm)
        elif pm.defer_calls > 1:
            compiled = _Deferred(gm, pm, is_inference)
        else:
            compiled = _emit(gm, example_inputs, pm, is_inference)
        for wrapper in pm.call_wrappers:  # e.g. bucketing: pad the arguments, slice the outputs
            compiled = wrapper(compiled)
        if pm.call_hooks or pm.return_hooks:
            compiled = _with_call_hooks(compiled, pm.call_hooks, pm.return_hooks)
        for wrapper in pm.built_wrappers:  # e.g. bucketing: a specialized graph served by its frame's dynamic one
            compiled = wrapper(compiled, pm.report.notes)
        return compiled
    finally:
        # Dynamo's real inputs are not held past the compile, failed or not: pm sits in reference cycles, which
        # kept the first call's tensors (a static cache: the next one could not move into the captured storage)
        # until the collector ran
        pm.example_inputs = []


def _is_inference(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """No backward can follow this graph: grad mode is off, or no input or parameter requires grad (AOTAutograd
    then compiles it for inference as well; a static cache's update under grad mode is one)."""
    if not torch.is_grad_enabled():
        return True
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)] + list(gm.parameters())
    return not any(t.requires_grad for t in tensors)


def _emit(gm: fx.GraphModule, example_inputs: Sequence[Any], pm: PassManager, is_inference: bool) -> Callable:
    with contextlib.ExitStack() as stack:
        for factory in pm.aot_contexts:  # e.g. the SDPA backend priority the attention pass chose
            stack.enter_context(factory())
        compiled = EMITTERS[pm.codegen](gm, example_inputs, pm)
    pm.add_late_notes()
    return pm.run_wrap_stage(compiled, gm, is_inference)


class _Deferred:
    """A graph run as it is (eagerly: the Dynamo graph after the pre_aot passes) until its ``pm.defer_calls``-th
    call, then compiled with that call's arguments (ctx.defer_compile); the report says when."""

    def __init__(self, gm: fx.GraphModule, pm: PassManager, is_inference: bool):
        self.gm, self.pm, self.is_inference = gm, pm, is_inference
        self.calls, self.compiled = 0, None
        self.tracing = torch._guards.TracingContext.try_get()  # Dynamo's, for Inductor to find static inputs
        pm.report.notes.append(f"compile deferred to call {pm.defer_calls}: the graph runs eagerly until then")

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.calls += 1
            if self.calls < self.pm.defer_calls:
                return self.gm(*args)
            start = time.perf_counter()
            self.pm.example_inputs = list(args)  # for the wrap stage's passes, as Dynamo's would be
            try:
                with torch._guards.tracing(self.tracing) if self.tracing is not None else contextlib.nullcontext():
                    self.compiled = _emit(self.gm, args, self.pm, self.is_inference)
            except Exception as e:  # noqa: BLE001 - the graph runs as it is, as it did until now
                if self.pm.options.strict:
                    raise
                self.compiled = self.gm
                self.pm.report.notes.append(f"the deferred compile failed ({type(e).__name__}: {str(e)[:200]}); "
                                            "the graph keeps running as it is")
                return self.gm(*args)
            finally:
                self.pm.example_inputs = []  # this call's tensors, not held past it
            self.pm.report.notes.append(f"compiled at call {self.calls} "
                                        f"({(time.perf_counter() - start) * 1e3:.0f} ms)")
        return self.compiled(*args)


class _AsIs:
    """A dynamic graph whose compile a pass deferred: never compiled (a dynamic graph compiled outside Dynamo
    would lose its symbols, and the guards its compile adds would not be Dynamo's), run as it is (eagerly) at
    any call that reaches it. Bucketing defers only graphs another graph serves (batch 1 served by the frame's
    dynamic graph); this runs where serving stops. Holds the graph only, not the pass manager and its
    example inputs."""

    def __init__(self, gm: fx.GraphModule, pm: PassManager):
        self.gm = gm
        pm.report.notes.append("not compiled: its calls go to another graph, and any that do not run it as it is "
                               "(eagerly)")

    def __call__(self, *args: Any) -> Any:
        return self.gm(*args)


def _with_call_hooks(compiled: Callable, before: list[Callable], after: list[Callable]) -> Callable:
    """The compiled callable with the passes' hooks around each call (outermost: outside any CUDA graph):
    ``before`` see the arguments, ``after`` get the outputs and return what the caller receives."""

    def call(*args: Any) -> Any:
        for hook in before:
            hook(args)
        outputs = compiled(*args)
        for hook in after:
            outputs = hook(outputs)
        return outputs

    return call


def _compile_without(fired: list[str], error: Exception, gm: fx.GraphModule, example_inputs: Sequence[Any],
                     pm: PassManager, original) -> Callable:
    """The emitter failed on the rewritten graph: compile the original again with the passes that fired off,
    and say so in the report (each of them becomes "failed", with the emitter's error)."""
    reason = f"{pm.codegen} could not compile the rewritten graph: {type(error).__name__}: {str(error)[:300]}"
    log.warning("kernelpytorch: %s; compiling again without %s", reason, ", ".join(fired))
    graph_utils.restore(gm, original)
    report = pm.report
    report.notes.append(f"compiled again without {', '.join(fired)}: {reason}")
    report.stages.clear()
    options = dataclasses.replace(pm.options, disable=tuple(pm.options.disable) + tuple(fired))
    retry = PassManager(options, pm.target, report, dump=pm.dump, codegen=pm.codegen, example_inputs=example_inputs)
    compiled = _run_pipeline_and_emit(gm, example_inputs, retry, original)
    for rec in report.passes():
        if rec.name in fired:
            rec.status, rec.reason = "failed", reason
    return compiled


def _triton_toolchain_as_inductor() -> None:
    """Give this process's Triton the ptxas (and libdevice) that Inductor gives its compile workers, before
    anything here compiles a kernel.

    Triton's cache key holds the ptxas version. Inductor points ``TRITON_PTXAS_PATH`` at torch's own ptxas in its
    compile workers, and in this process only on some of its paths. When a cold run compiled through Inductor,
    the variable was set by the time our kernels were built. A warm run takes Inductor's code from its cache, so
    it was not, and the kernels it built in this process (ours, and Inductor's chosen configs) got other keys and
    were built again. Both setters are Inductor's own (no-ops where torch ships no ptxas, and where the user set
    ``TRITON_PTXAS_PATH``); being private, any failure of theirs is logged once and the compile goes on."""
    global _toolchain_warned
    try:
        from torch._inductor.runtime import compile_tasks

        for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
            setter = getattr(compile_tasks, name, None)
            if setter is not None:
                setter()
    except Exception as e:  # noqa: BLE001 - a restart may rebuild kernels; nothing else depends on this
        if not _toolchain_warned:
            _toolchain_warned = True
            log.warning("could not give Triton Inductor's ptxas (%s: %s); a warm restart may build kernels again",
                        type(e).__name__, e)


_toolchain_warned = False


def kernelpytorch(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    **unexpected: Any,
) -> Callable:
    """Compile one Dynamo graph. Registered as ``torch.compile(backend="kernelpytorch")``."""
    if unexpected:
        raise OptionError(
            f"backend 'kernelpytorch' takes mode= and options=; got {sorted(unexpected)}. "
            "Put kernelpytorch settings in options={...}."
        )
    start = time.perf_counter()
    _triton_toolchain_as_inductor()
    opts = parse_options(mode, options)
    target = detect_target(example_inputs, opts.device, gm)
    codegen = _choose_codegen(opts, target)
    rank = distributed.rank()
    dump = None
    if opts.dump_dir:
        from .dump import DumpWriter

        # one folder per rank: the ranks of one job write their reports side by side, none over another's
        dump = DumpWriter.for_dir(opts.dump_dir if rank is None else os.path.join(opts.dump_dir, f"rank{rank}"))
    shown = {**opts.to_dict(), **({"KPT_DISABLE": list(opts.env_disable)} if opts.env_disable else {})}
    graph_report = report_mod._new_report(compile_id=_compile_id(), codegen=codegen, target=target.to_dict(),
                                          options=shown, rank=rank)
    graph_report.notes += distributed.ddp_split()
    pm = PassManager(opts, target, graph_report, dump=dump, codegen=codegen, example_inputs=example_inputs)
    pm.check_requested_passes()
    report_mod._publish(graph_report)
    if dump is not None:
        dump.begin_graph(graph_report, describe_pipeline(opts, target))
    original = graph_utils.snapshot(gm)
    try:
        compiled = _run_pipeline_and_emit(gm, example_inputs, pm, original)
    except PassFailed:
        raise
    except Exception as e:  # noqa: BLE001 - the code generator rejected what our passes produced
        fired = graph_report.fired()
        if not fired or opts.strict:
            raise
        compiled = _compile_without(fired, e, gm, example_inputs, pm, original)
    graph_report.compile_ms = (time.perf_counter() - start) * 1e3
    if dump is not None:
        dump.end_graph(graph_report)
    return compiled
