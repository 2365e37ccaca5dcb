"""The pass manager: runs one stage of the pipeline on one graph, and owns everything around a pass.

Passes stay small because this module does the rest: switching a pass off by name, device checks, timing, a
snapshot to fall back to when a pass raises or breaks an invariant, diffs and op counts for the report, the
dumps, and, for lossy passes, the guard that measures their error and backs out a rewrite over its bound
(``lossy_guard``). One ``PassManager`` serves one call of the backend (one Dynamo graph): the emitters call
``run_stage`` at each stage of the compile, and the backend calls ``run_wrap_stage`` on the compiled callable.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from . import distributed, graph_utils
from .cost_model import CostModel
from .errors import OptionError, PassFailed, PassSkipped
from .lossy_guard import LossyGuard
from .options import CompileOptions
from .pipeline import resolve_pipeline
from .registry import GraphPass, PassContext
from .report import GraphReport, PassRecord, StageRecord
from .target import Target

__all__ = ["PassManager"]

log = logging.getLogger("kpt_compiler")


def _source_hash(files: dict[str, str]) -> str:
    """The hash of the files ``{path: name}``, each under its name: a package file's name does not say where the
    package is installed, so two checkouts or an editable and a regular install of one tree hash alike."""
    h = hashlib.sha256()
    for path, name in sorted(files.items(), key=lambda item: item[1]):
        with open(path, "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


_PACKAGES = ("kpt_compiler", "kpt_compiler.passes", "kpt_compiler.kernels")


def _package_sources() -> dict[str, str]:
    """Every .py and .json file of the package, its passes and kernels included, as {path: "package/relative
    path"}: in an editable install passes/ and kernels/ live beside kpt_compiler/ (pyproject's package-dir), not
    under it, and a pass's helper modules and kernels change what it compiles as much as its own file does.
    Found without importing the subpackages (kernels/ would import triton); dotted names (editors' lock files)
    and caches are left out."""
    import importlib.util

    roots = {os.path.abspath(r): pkg for pkg in _PACKAGES
             for r in importlib.util.find_spec(pkg).submodule_search_locations}
    out = {}
    for root, pkg in roots.items():
        for base, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))
                       and os.path.join(base, d) not in roots]  # a subpackage's files under its own name
            for f in files:
                path = os.path.join(base, f)
                if f.endswith((".py", ".json")) and not f.startswith(".") and os.path.isfile(path):
                    out[path] = f"{pkg}/{os.path.relpath(path, root)}"
    return out


class PassManager:
    """One call of the backend: its options, target and report, and the passes of each stage."""

    def __init__(self, options: CompileOptions, target: Target, report: GraphReport, dump=None,
                 codegen: str = "inductor", example_inputs: Sequence[Any] = ()):
        self.options = options
        self.codegen = codegen
        self.target = target
        self.report = report
        self.dump = dump  # a dump.DumpWriter or None
        self.example_inputs = list(example_inputs)  # Dynamo's, for the pre_aot graph
        self.pipeline = resolve_pipeline(options)
        self.cost_model = CostModel(target, options.mode, codegen)
        self.aot_contexts: list[Callable[[], Any]] = []  # from pre_aot passes that applied
        self.inductor_patches: dict[str, Any] = {}  # Inductor config from pre_aot passes that applied
        self.call_hooks: list[Callable[[Sequence[Any]], None]] = []  # run before each call (ctx.before_each_call)
        self.return_hooks: list[Callable[[Any], Any]] = []  # run on the outputs of each call (ctx.after_each_call)
        self.call_wrappers: list[Callable[[Callable], Callable]] = []  # wrap the compiled graph (ctx.wrap_each_call)
        self.defer_calls = 0  # compile at this call, eager before (ctx.defer_compile)
        self.built_wrappers: list[Callable] = []  # around the built callable (ctx.wrap_built)
        self.compile_key = repr(sorted(options.to_dict().items(), key=str))  # ctx.compile_key
        self.late_notes: list[tuple[PassRecord, Callable[[list[str]], None]]] = []  # ctx.note_after_compile
        # (stage, is_inference) of the graph an emitter is compiling now, for hooks that are not told (Inductor's)
        self.emitter_stage: list[tuple[str, bool]] = []
        self._fingerprint: str | None = None

    # -------------------------------------------------------------- identity, for Inductor's caches
    def fingerprint(self) -> str:
        """Identity of what the pipeline does: the source of our package (calibration files included) and of
        each pass, the options, the target and the rank (under torch.distributed, a rank's graph may differ:
        its shard, its split).

        Inductor puts it in its FX-graph and AOTAutograd cache keys (CustomGraphPass.uuid), so a changed
        option, pass or calibration never returns an artifact compiled by another pipeline.
        """
        if self._fingerprint is None:
            files = _package_sources()
            for spec in self.pipeline:  # a pass registered from outside the package: under its path
                src = inspect.getsourcefile(spec.run)
                if src:
                    files.setdefault(os.path.abspath(src), os.path.abspath(src))
            opts = {k: v for k, v in self.options.to_dict().items() if k != "dump_dir"}
            opts["KPT_DISABLE"] = list(self.options.env_disable)  # not an option, but it changes what runs
            self._fingerprint = hashlib.sha256(
                (_source_hash(files) + repr(sorted(opts.items(), key=str)) + repr(self.target.to_dict())
                 + f"rank={distributed.rank()}").encode()
            ).hexdigest()
        return self._fingerprint

    # -------------------------------------------------------------- checks made once, before compiling
    def check_requested_passes(self) -> None:
        """A pass the user asked for that this device cannot run is an error, not a silent skip."""
        for spec in self.pipeline:
            setting = self.options.passes[spec.name]
            if setting.explicit and self.options.pass_enabled(spec.name):
                reason = spec.unsupported_reason(self.target, setting.options)
                if reason:
                    key = setting.key or spec.key
                    what = f"pass {spec.name!r} (through options[{key!r}])" if key != spec.key else f"options[{key!r}]"
                    fix = ("remove it from options['pipeline']" if key == "pipeline" else
                           f"remove it or set options[{key!r}]=False")
                    raise OptionError(f"{what} was asked for, but {reason}. For this device, {fix}.")

    # -------------------------------------------------------------- graph stages
    def stage_done(self, gm: fx.GraphModule, stage: str) -> bool:
        """Inductor 2.9 calls the joint custom pass twice on one graph; run each stage once per graph."""
        done = gm.meta.setdefault("kpt_stages_done", set())
        if stage in done:
            return True
        done.add(stage)
        return False

    def run_stage(self, gm: fx.GraphModule, stage: str, is_inference: bool | None = None,
                  snapshot: graph_utils.GraphSnapshot | None = None) -> StageRecord:
        """Run the passes of ``stage`` on ``gm``. ``snapshot``: one already taken of ``gm`` as it is (the
        backend's, of Dynamo's graph), the first pass's rollback point."""
        if is_inference is None:
            is_inference = not any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
        start = time.perf_counter()
        record = StageRecord(stage=stage, is_inference=is_inference)
        record.ops_before = graph_utils.op_counts(gm.graph)
        record.nodes_before = len(gm.graph.nodes)
        self.report.stages[stage] = record
        code = graph_utils.readable_code(gm) if self.dump is not None else None
        if self.dump is not None:
            self.dump.begin_stage(self.report, record, gm, code)
        passes = [spec for spec in self.pipeline if spec.stage == stage]
        inputs = _Once(lambda: self.example_inputs if stage == "pre_aot" else graph_utils.random_inputs(gm))
        guard = None
        if any(s.lossy and self._enabled(s) for s in passes):  # the unmodified graph's outputs, before any pass
            try:
                guard = LossyGuard(gm, inputs())
            except Exception as e:  # noqa: BLE001 - each lossy pass steps aside with it (see _guarded)
                guard = e
        snap = snapshot  # the graph as the last pass left it, for a rollback: copied again only after a change
        for spec in passes:
            rec, code, before, snap = self._run_pass(spec, gm, stage, is_inference, code, inputs, guard, snap)
            record.passes.append(rec)
            if self.dump is not None:
                self.dump.write_pass(self.report, record, rec, gm, code, before)
        record.ops_after = graph_utils.op_counts(gm.graph)
        record.nodes_after = len(gm.graph.nodes)
        record.time_ms = (time.perf_counter() - start) * 1e3
        if self.dump is not None:
            self.dump.end_stage(self.report, record)
        return record

    def _enabled(self, spec: GraphPass) -> bool:
        return self._why_not(spec) is None

    def _context(self, spec: GraphPass, stage: str, is_inference: bool, inputs: Callable[[], list],
                 allowed: frozenset[str] | None = None, graph_module: fx.GraphModule | None = None) -> PassContext:
        return PassContext(options=self.options.pass_options(spec.name), target=self.target, stage=stage,
                           is_inference=is_inference, mode=self.options.mode, codegen=self.codegen,
                           cost_model=self.cost_model, allowed=allowed, inputs_fn=inputs, graph_module=graph_module,
                           explicit=self.options.passes[spec.name].explicit, cuda_graphs=self._cuda_graphs(),
                           other_pass=self.options_if_runs, compile_key=self.compile_key)

    def options_if_runs(self, name: str) -> Any:
        """The options of pass ``name`` where it runs in this compile (in the pipeline, switched on, for this
        target), else None."""
        spec = next((s for s in self.pipeline if s.name == name), None)
        return None if spec is None or not self._enabled(spec) else self.options.pass_options(name)

    def _cuda_graphs(self) -> bool:
        from kpt_compiler.cost_model import CUDA_GRAPH_MODES

        if not self.target.is_cuda or self.codegen != "inductor" or self.options.mode == "max-autotune-no-cudagraphs":
            return False
        if self.options.mode in CUDA_GRAPH_MODES:
            return True
        cg = self.options.passes.get("cudagraphs")
        return bool(cg and self.options.pass_enabled("cudagraphs") and getattr(cg.options, "decide", None) == "always")

    def _why_not(self, spec: GraphPass) -> tuple[str, str] | None:
        """(status, reason) when the pass does not run at all (switched off, or not for this target), else None."""
        if not self.options.pass_enabled(spec.name):
            by_env = self.options.disabled_by_env(spec.name)
            return "disabled", "switched off by KPT_DISABLE" if by_env else "switched off by the options"
        reason = spec.unsupported_reason(self.target, self.options.pass_options(spec.name))
        return ("skipped", reason) if reason else None

    def _skip_reason(self, spec: GraphPass, rec: PassRecord) -> bool:
        """Fill ``rec`` and say so when the pass does not run at all."""
        why = self._why_not(spec)
        if why is not None:
            rec.status, rec.reason = why
        return why is not None

    def _run_pass(self, spec: GraphPass, gm, stage, is_inference, code_before, inputs, guard, snap=None):
        """Run one pass with its rollback; returns (its record, the code after it where a dump wants it, the graph
        before it where it applied, the snapshot of the graph as it now is). ``snap``: one already taken of the
        graph as it is (copying the graph for each pass took 0.2 s of a warm llama compile on the H100, cProfile
        2026-11-28-s20-warm-prof-llama-kpt-099b5f9.txt; most passes change nothing)."""
        rec = PassRecord(name=spec.name, stage=stage, status="unchanged")
        if self._skip_reason(spec, rec):
            return rec, code_before, None, snap
        snap = snap or graph_utils.snapshot(gm)
        rec.ops_before = graph_utils.op_counts(gm.graph)

        def attempt(allowed: frozenset[str] | None) -> tuple[bool, PassContext]:
            ctx = self._context(spec, stage, is_inference, inputs, allowed)
            attempt.ctx = ctx  # what the pass counted, also when it raises
            changed = bool(spec.run(gm, ctx))
            if changed:
                gm.recompile()
                self._check_invariants(spec, gm, snap, stage)
            return changed, ctx

        start = time.perf_counter()
        try:
            changed, ctx = attempt(None)
            if spec.lossy and guard is not None and changed:
                changed, ctx = _guarded(guard, spec, gm, snap, ctx, attempt, rec)
        except PassSkipped as e:
            rec.time_ms = (time.perf_counter() - start) * 1e3
            graph_utils.restore(gm, snap)
            rec.status, rec.reason = "skipped", str(e)
            return rec, code_before, None, snap
        except Exception as e:  # noqa: BLE001 - isolation is the point: the user's compile goes on
            rec.time_ms = (time.perf_counter() - start) * 1e3
            graph_utils.restore(gm, snap)
            ctx = getattr(attempt, "ctx", None)
            rec.status, rec.reason = "failed", f"{type(e).__name__}: {e}"
            rec.stats, rec.notes = (dict(ctx.stats), list(ctx.notes)) if ctx else ({}, [])
            log.warning("kernelpytorch: pass %r failed in stage %s and was rolled back: %s", spec.name, stage,
                        rec.reason)
            if self.options.strict:
                raise PassFailed(f"pass {spec.name!r} failed in stage {stage!r} (strict=True): {rec.reason}") from e
            return rec, code_before, None, snap
        rec.time_ms = (time.perf_counter() - start) * 1e3
        rec.stats, rec.notes = dict(ctx.stats), rec.notes + list(ctx.notes)
        rec.matches = ctx.stats.get("matches", 0)
        rec.ops_after = graph_utils.op_counts(gm.graph)
        # a dispatcher choice holds even where the graph is unchanged (the SDPA priority for calls already there)
        self.aot_contexts += ctx.aot_contexts
        self.late_notes += [(rec, take_notes) for take_notes in ctx.late_notes]
        self.defer_calls = max(self.defer_calls, ctx.defer_calls)  # a pass may defer a graph it leaves as it is
        self.built_wrappers += ctx.built_wrappers  # or serve it by another graph
        if not changed:
            return rec, code_before, None, snap
        self.inductor_patches.update(ctx.inductor_patches)
        self.call_hooks += ctx.call_hooks
        self.return_hooks += ctx.return_hooks
        self.call_wrappers += ctx.call_wrappers
        rec.status = "applied"
        names = f"before {spec.name}", f"after {spec.name}"
        if self.dump is None:  # nobody reads the code now: the diff is made if the report's reader asks
            after_graph = graph_utils.copy_graph(gm.graph)
            attrs = graph_utils.meta_attrs(gm, snap.graph, after_graph)
            rec._diff_from = functools.partial(graph_utils.diff_of_graphs, type(gm).__name__, attrs, snap.graph,
                                               after_graph, names)
            # the copy for the diff is also the next pass's rollback point (neither changes a graph it holds)
            return rec, None, snap.graph, graph_utils.snapshot(gm, after_graph)
        before = code_before if code_before is not None else graph_utils.readable_code(gm, snap.graph)
        after = graph_utils.readable_code(gm)
        rec.diff = graph_utils.unified_diff(before, after, *names)
        return rec, after, snap.graph, None

    def _check_invariants(self, spec: GraphPass, gm: fx.GraphModule, snap, stage: str) -> None:
        """What every pass must leave true (passes/README.md); a pass that breaks it is rolled back."""
        gm.graph.lint()
        if _signature(gm.graph) != _signature(snap.graph):
            raise RuntimeError(
                f"pass {spec.name!r} changed the graph's inputs or outputs (their number, shapes or dtypes): "
                f"{_signature(snap.graph)} -> {_signature(gm.graph)}"
            )
        if stage == "pre_aot":
            return
        old = {n.name for n in snap.graph.nodes}
        for node in gm.graph.nodes:
            if node.name in old or node.op in ("output", "get_attr"):
                continue
            if "val" not in node.meta:
                raise RuntimeError(f"pass {spec.name!r} added node {node.name!r} ({node.target}) without meta['val']")
            target = node.target
            if not spec.mutates and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
                raise RuntimeError(
                    f"pass {spec.name!r} added the mutating op {target} in stage {stage!r}; the graph must stay "
                    "functional (declare mutates=True and run last if that is intended)"
                )

    def add_late_notes(self) -> None:
        """After the code generator ran: the notes passes asked to make then (ctx.note_after_compile)."""
        for rec, take_notes in self.late_notes:
            take_notes(rec.notes)
        self.late_notes.clear()

    # -------------------------------------------------------------- the wrap stage
    def run_wrap_stage(self, compiled: Callable, gm: fx.GraphModule, is_inference: bool) -> Callable:
        """Give the compiled callable to each ``wrap`` pass in turn; each may return a wrapper (applied) or None.

        The emitters' callables take the graph's inputs as positional arguments (Dynamo calls them so), and so
        must a wrapper. A wrap pass that raises is reported as failed and the callable it got goes on unwrapped
        (``strict=True`` raises instead).
        """
        passes = [spec for spec in self.pipeline if spec.stage == "wrap"]
        if not any(self._enabled(spec) for spec in passes):
            return compiled  # no wrap stage in the report unless one of its passes runs
        start = time.perf_counter()
        record = self.report.stages["wrap"] = StageRecord(stage="wrap", is_inference=is_inference)
        for spec in passes:
            rec = PassRecord(name=spec.name, stage="wrap", status="unchanged")
            record.passes.append(rec)
            if self._skip_reason(spec, rec):
                continue
            ctx = self._context(spec, "wrap", is_inference, lambda: self.example_inputs, graph_module=gm)
            t0 = time.perf_counter()
            try:
                wrapped = spec.run(compiled, ctx)
            except PassSkipped as e:
                rec.status, rec.reason = "skipped", str(e)
                wrapped = None
            except Exception as e:  # noqa: BLE001 - as for graph passes: the compile goes on
                rec.status, rec.reason = "failed", f"{type(e).__name__}: {e}"
                log.warning("kernelpytorch: wrap pass %r failed and was left out: %s", spec.name, rec.reason)
                if self.options.strict:
                    raise PassFailed(f"pass {spec.name!r} failed in stage 'wrap' (strict=True): {rec.reason}") from e
                wrapped = None
            rec.time_ms = (time.perf_counter() - t0) * 1e3
            rec.stats, rec.notes = dict(ctx.stats), list(ctx.notes)
            rec.matches = ctx.stats.get("matches", 0)
            if wrapped is not None and wrapped is not compiled:
                compiled, rec.status = wrapped, "applied"
        record.time_ms = (time.perf_counter() - start) * 1e3
        if self.dump is not None:
            self.dump.wrap_stage(self.report, record)
        return compiled


def _guarded(guard: LossyGuard | Exception, spec: GraphPass, gm, snap, ctx, attempt, rec):
    """The lossy guard's check. Where the guard could not measure (the reference run failed: out of memory, an
    op that fails on random inputs, a size known only at run time), the pass steps aside: unmeasured, its
    rewrite would change results silently."""
    if isinstance(guard, Exception):
        raise PassSkipped(f"the lossy guard could not run the unmodified graph to measure this pass's error "
                          f"({type(guard).__name__}: {str(guard)[:200]})")
    return guard.check(spec, spec.bound_db(ctx.options), gm, snap, ctx, attempt, rec)


class _Once:
    """A value computed on first use (example inputs: random ones are made only if a pass reads them)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.done, self.value = fn, False, None

    def __call__(self) -> Any:
        if not self.done:
            self.value, self.done = self.fn(), True
        return self.value


def _signature(graph: fx.Graph) -> tuple:
    """How the graph is called: its inputs and outputs as (shape, dtype), where meta records them."""

    def describe(node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return repr(node)
        val = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(val, torch.Tensor):
            return (tuple(val.shape), val.dtype)
        return type(val).__name__

    inputs = tuple(describe(n) for n in graph.nodes if n.op == "placeholder")
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outputs = tuple(describe(a) for a in torch.utils._pytree.tree_leaves(output.args[0]))
    return inputs, outputs
