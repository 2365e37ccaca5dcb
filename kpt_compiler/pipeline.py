"""The pass registry, the default pipeline and the pass manager.

A pass is data (``GraphPass``): a kebab-case name, a one-line summary, the stage it runs in, a frozen options
dataclass, the statistics it counts, and one entry function ``run(gm, ctx) -> bool`` that rewrites an FX
GraphModule in place and says whether it changed it. ``@graph_pass(...)`` declares one. The pass manager
(``run_stage``) owns everything around a pass: switching it off by name, device checks, timing, a snapshot to
fall back to when it raises or breaks an invariant, diffs and op counts for the report. Passes stay small.

Stages, in the order a compile meets them:
  pre_aot   the graph Dynamo captured (torch IR, may mutate); runs in the backend before AOTAutograd
  joint     the functional ATen graph before the forward/backward split (the joint graph when training,
            the inference graph otherwise), so a fused op brings its own backward
  forward   the forward graph after the split (after Inductor's decompositions)
  backward  the backward graph after the split; compiled lazily at the first .backward()
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from . import graph_utils
from .options import CompileOptions, OptionError
from .report import GraphReport, PassRecord, StageRecord
from .target import Target

__all__ = [
    "STAGES",
    "GraphPass",
    "PassContext",
    "PassSkipped",
    "PassFailed",
    "graph_pass",
    "register_pass",
    "unregister_pass",
    "registered_passes",
    "DEFAULT_PIPELINE",
    "resolve_pipeline",
    "describe_pipeline",
    "CompileRun",
]

log = logging.getLogger("kpt_compiler")

STAGES = ("pre_aot", "joint", "forward", "backward")


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """For passes that take no options."""


class PassSkipped(Exception):
    """Raised by a pass that finds, once running, that it cannot apply here; the message says why."""


class PassFailed(RuntimeError):
    """A pass raised or broke an invariant while options['strict'] was on."""


@dataclasses.dataclass
class PassContext:
    """What a pass gets besides the graph: its options, the target, and where to count and explain."""

    options: Any
    target: Target
    stage: str
    is_inference: bool
    mode: str
    host: str = "inductor"  # what generates code for the rewritten graph: "inductor", "eager" or "xla"
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    notes: list[str] = dataclasses.field(default_factory=list)
    # context managers (as factories) to hold while AOTAutograd traces; see during_aot
    aot_contexts: list[Callable[[], Any]] = dataclasses.field(default_factory=list)

    def count(self, stat: str = "matches", n: int = 1) -> None:
        self.stats[stat] += n

    def near_miss(self, reason: str) -> None:
        """Record a candidate the pass looked at and left alone, with why (shown in the report)."""
        self.stats["near_misses"] += 1
        self.notes.append(f"near miss: {reason}")

    def note(self, message: str) -> None:
        self.notes.append(message)

    def during_aot(self, context_factory: Callable[[], Any]) -> None:
        """Hold ``context_factory()`` while AOTAutograd traces this graph (pre_aot passes only): for choices the
        dispatcher makes at trace time, such as which SDPA kernel a scaled_dot_product_attention call becomes."""
        if self.stage != "pre_aot":
            raise RuntimeError("during_aot is for pre_aot passes: later stages run after the trace")
        self.aot_contexts.append(context_factory)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    name: str
    summary: str
    stage: str
    run: Callable[[fx.GraphModule, PassContext], bool]
    options: type = NoOptions
    statistics: tuple[str, ...] = ("matches",)
    default: bool = True  # on unless the options switch it off; lossy passes are off by default
    lossy: bool = False
    # Returns why the pass cannot run on this target with these options, or None when it can.
    supports: Callable[[Target, Any], str | None] | None = None
    # A pass that introduces mutation (in-place ops) must say so; it then belongs at the end of its stage.
    mutates: bool = False

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"pass {self.name!r}: stage must be one of {STAGES}, got {self.stage!r}")
        if not self.name or self.name != self.name.lower() or "_" in self.name or " " in self.name:
            raise ValueError(f"pass names are kebab-case (like 'fuse-attention'); got {self.name!r}")
        if not dataclasses.is_dataclass(self.options) or not self.options.__dataclass_params__.frozen:
            raise ValueError(f"pass {self.name!r}: options must be a frozen dataclass")
        if self.lossy and self.default:
            raise ValueError(f"pass {self.name!r} is lossy, so it must be off by default")

    @property
    def key(self) -> str:
        """The key in torch.compile's options dict: the name with '_' for '-'."""
        return self.name.replace("-", "_")

    def unsupported_reason(self, target: Target, options: Any) -> str | None:
        return self.supports(target, options) if self.supports else None


_REGISTRY: dict[str, GraphPass] = {}


def register_pass(spec: GraphPass) -> GraphPass:
    if spec.name in _REGISTRY and _REGISTRY[spec.name].run is not spec.run:
        raise ValueError(f"a pass named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_pass(name: str) -> None:
    _REGISTRY.pop(name, None)


def graph_pass(name: str, *, summary: str, stage: str, **fields: Any) -> Callable:
    """Declare the decorated function a pass: ``@graph_pass("fuse-attention", summary=..., stage="joint")``."""

    def wrap(fn: Callable[[fx.GraphModule, PassContext], bool]) -> Callable:
        fn.graph_pass = register_pass(GraphPass(name=name, summary=summary, stage=stage, run=fn, **fields))
        return fn

    return wrap


def registered_passes() -> dict[str, GraphPass]:
    _load_builtin_passes()
    return dict(_REGISTRY)


def _load_builtin_passes() -> None:
    from . import passes  # noqa: F401  (importing registers them)


# The default pipeline: a flat list, in the order passes run within each stage. One line each says why it
# sits where it does. Passes registered elsewhere (a user's, a test's) run after these, in registration order.
DEFAULT_PIPELINE: tuple[str, ...] = (
    # pre_aot: before AOTAutograd, so a rewrite's backward comes from its replacement's autograd formula
    "attention",  # first: it needs the softmax chain intact, before anything fuses parts of it
    "fusion",  # after attention, which needs the q/k/v projections' outputs as they were (off by default)
)


def resolve_pipeline(options: CompileOptions) -> list[GraphPass]:
    registry = registered_passes()
    if options.pipeline is not None:
        names = [n.replace("_", "-") for n in options.pipeline]
    else:
        names = list(DEFAULT_PIPELINE) + [n for n in registry if n not in DEFAULT_PIPELINE]
    return [registry[n] for n in names if n in registry]


def describe_pipeline(options: CompileOptions, target: Target | None = None) -> str:
    """The pipeline as one line per stage, e.g. ``joint: attention, -fusion(off)``."""
    lines = []
    for stage in STAGES:
        items = []
        for spec in resolve_pipeline(options):
            if spec.stage != stage:
                continue
            if not options.pass_enabled(spec.name):
                items.append(f"-{spec.name}(off)")
            elif target is not None and spec.unsupported_reason(target, options.pass_options(spec.name)):
                items.append(f"-{spec.name}(n/a)")
            else:
                items.append(spec.name)
        lines.append(f"{stage}: {', '.join(items) if items else '-'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the run


def _source_hash(paths: list[str]) -> str:
    h = hashlib.sha256()
    for path in sorted(set(paths)):
        with open(path, "rb") as f:
            h.update(path.encode() + b"\0" + f.read())
    return h.hexdigest()


_PACKAGE_ROOT = os.path.dirname(os.path.abspath(__file__))


def _package_sources() -> list[str]:
    out = []
    for base, _dirs, files in os.walk(_PACKAGE_ROOT):
        out += [os.path.join(base, f) for f in files if f.endswith(".py")]
    return out


class CompileRun:
    """One call of the backend: its options, target and report, and the pass manager for its stages."""

    def __init__(self, gm: fx.GraphModule, options: CompileOptions, target: Target, report: GraphReport, dump=None,
                 host: str = "inductor"):
        self.options = options
        self.host = host
        self.target = target
        self.report = report
        self.dump = dump  # a dump.DumpWriter or None
        self.pipeline = resolve_pipeline(options)
        self.aot_contexts: list[Callable[[], Any]] = []  # from pre_aot passes that applied
        # (stage, is_inference) of the graph a host is compiling now, for hooks that are not told (Inductor's)
        self.host_stage: list[tuple[str, bool]] = []
        self._fingerprint: str | None = None

    # -------------------------------------------------------------- identity, for Inductor's caches
    def fingerprint(self) -> str:
        """Identity of what the pipeline does: the source of our package and of each pass, and the options.

        Inductor puts it in its FX-graph and AOTAutograd cache keys (CustomGraphPass.uuid), so a changed
        option or pass never returns an artifact compiled by another pipeline.
        """
        if self._fingerprint is None:
            files = _package_sources()
            for spec in self.pipeline:
                src = inspect.getsourcefile(spec.run)
                if src:
                    files.append(os.path.abspath(src))
            opts = {k: v for k, v in self.options.to_dict().items() if k != "dump_dir"}
            self._fingerprint = hashlib.sha256(
                (_source_hash(files) + repr(sorted(opts.items(), key=str)) + repr(self.target.to_dict())).encode()
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
                    raise OptionError(
                        f"options[{spec.key!r}] was asked for, but {reason}. "
                        f"Remove it or set options[{spec.key!r}]=False for this device."
                    )

    # -------------------------------------------------------------- the pass manager
    def stage_done(self, gm: fx.GraphModule, stage: str) -> bool:
        """Inductor 2.9 calls the joint custom pass twice on one graph; run each stage once per graph."""
        done = gm.meta.setdefault("kpt_stages_done", set())
        if stage in done:
            return True
        done.add(stage)
        return False

    def run_stage(self, gm: fx.GraphModule, stage: str, is_inference: bool | None = None) -> StageRecord:
        if is_inference is None:
            is_inference = not any(
                n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes
            )
        start = time.perf_counter()
        record = StageRecord(stage=stage, is_inference=is_inference)
        record.ops_before = graph_utils.op_counts(gm.graph)
        record.nodes_before = len(gm.graph.nodes)
        self.report.stages[stage] = record
        code = graph_utils.readable_code(gm) if self.dump is not None else None
        if self.dump is not None:
            self.dump.begin_stage(self.report, record, gm, code)
        for spec in self.pipeline:
            if spec.stage != stage:
                continue
            rec, code = self._run_pass(spec, gm, stage, is_inference, code)
            record.passes.append(rec)
            if self.dump is not None:
                self.dump.write_pass(self.report, record, rec, gm, code)
        record.ops_after = graph_utils.op_counts(gm.graph)
        record.nodes_after = len(gm.graph.nodes)
        record.time_ms = (time.perf_counter() - start) * 1e3
        if self.dump is not None:
            self.dump.end_stage(self.report, record)
        return record

    def _run_pass(self, spec: GraphPass, gm, stage, is_inference, code_before):
        rec = PassRecord(name=spec.name, stage=stage, status="unchanged")
        if not self.options.pass_enabled(spec.name):
            rec.status, rec.reason = "disabled", "switched off by the options"
            return rec, code_before
        popts = self.options.pass_options(spec.name)
        reason = spec.unsupported_reason(self.target, popts)
        if reason:
            rec.status, rec.reason = "skipped", reason
            return rec, code_before
        ctx = PassContext(options=popts, target=self.target, stage=stage, is_inference=is_inference,
                          mode=self.options.mode, host=self.host)
        snap = graph_utils.snapshot(gm)
        rec.ops_before = graph_utils.op_counts(gm.graph)
        start = time.perf_counter()
        try:
            changed = spec.run(gm, ctx)
            if changed:
                gm.recompile()
                self._check_invariants(spec, gm, snap, stage)
        except PassSkipped as e:
            rec.time_ms = (time.perf_counter() - start) * 1e3
            graph_utils.restore(gm, snap)
            rec.status, rec.reason = "skipped", str(e)
            return rec, code_before
        except Exception as e:  # noqa: BLE001 - isolation is the point: the user's compile goes on
            rec.time_ms = (time.perf_counter() - start) * 1e3
            graph_utils.restore(gm, snap)
            rec.status, rec.reason = "failed", f"{type(e).__name__}: {e}"
            rec.stats, rec.notes = dict(ctx.stats), list(ctx.notes)
            log.warning("kernelpytorch: pass %r failed in stage %s and was rolled back: %s", spec.name, stage, rec.reason)
            if self.options.strict:
                raise PassFailed(f"pass {spec.name!r} failed in stage {stage!r} (strict=True): {rec.reason}") from e
            return rec, code_before
        rec.time_ms = (time.perf_counter() - start) * 1e3
        rec.stats, rec.notes = dict(ctx.stats), list(ctx.notes)
        rec.matches = ctx.stats.get("matches", 0)
        rec.ops_after = graph_utils.op_counts(gm.graph)
        if not changed:
            return rec, code_before
        rec.status = "applied"
        self.aot_contexts += ctx.aot_contexts
        rec.regions = graph_utils.changed_regions(snap.graph, gm.graph)
        before = code_before if code_before is not None else graph_utils.readable_code(gm, snap.graph)
        after = graph_utils.readable_code(gm)
        rec.diff = graph_utils.unified_diff(before, after, f"before {spec.name}", f"after {spec.name}")
        return rec, after

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
            if (
                not spec.mutates
                and isinstance(target, torch._ops.OpOverload)
                and target._schema.is_mutable
            ):
                raise RuntimeError(
                    f"pass {spec.name!r} added the mutating op {target} in stage {stage!r}; the graph must stay "
                    "functional (declare mutates=True and run last if that is intended)"
                )


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
