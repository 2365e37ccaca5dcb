"""The pass registry: what a pass is (``GraphPass``), what it gets (``PassContext``), and groups of passes.

A pass is data: a kebab-case name, a one-line summary, the stage it runs in, a frozen options dataclass, the
statistics it counts, and one entry function. ``@graph_pass(...)`` declares one and registers it. For the graph
stages the entry function is ``run(gm, ctx) -> bool``: it rewrites an FX GraphModule in place and says whether
it changed it. For the ``wrap`` stage it is ``run(compiled, ctx) -> callable | None``: it wraps the callable
code generation produced (bucketing pads inputs and slices outputs; CUDA-graph capture records and replays)
and returns the wrapper, or None to leave it as it is.

A group (``PassGroup``) names several passes that users switch and configure together: ``options={"fusion":
False}`` turns off every pass in the fusion group, ``{"fusion": {"decide": "measure"}}`` gives each of them
that option. Each member stays a pass of its own (its own name, statistics, place in the pipeline, record in
the report), so it can be disabled, timed, dumped and bisected alone.

This module imports no other kernelpytorch module but ``errors`` and ``target``: the options, the pipeline and
the pass manager build on it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from .target import Target

__all__ = [
    "STAGES",
    "GRAPH_STAGES",
    "NoOptions",
    "PassContext",
    "GraphPass",
    "PassGroup",
    "graph_pass",
    "register_pass",
    "unregister_pass",
    "registered_passes",
    "register_group",
    "registered_groups",
    "expand_groups",
]

# Stages, in the order a compile meets them:
#   pre_aot   the graph Dynamo captured (torch IR, may mutate); runs in the backend before AOTAutograd
#   joint     the functional ATen graph before the forward/backward split (the joint graph when training,
#             the inference graph otherwise), so a fused op brings its own backward
#   forward   the forward graph after the split (after Inductor's decompositions)
#   backward  the backward graph after the split; compiled lazily at the first .backward()
#   wrap      the compiled callable, after code generation: passes that wrap it instead of rewriting a graph
GRAPH_STAGES = ("pre_aot", "joint", "forward", "backward")
STAGES = GRAPH_STAGES + ("wrap",)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """For passes that take no options."""


@dataclasses.dataclass
class PassContext:
    """What a pass gets besides the graph: its options, the target, and where to count and explain.

    ``codegen`` is what generates code for the rewritten graph ("inductor", "eager" or "xla");
    ``cost_model`` answers "is our rewrite faster here?" for this target and mode (kpt_compiler.cost_model);
    ``example_inputs`` are inputs to run the graph on: the real ones Dynamo gave for pre_aot, random ones of
    the recorded shapes and dtypes for later stages (computed when first read).
    """

    options: Any
    target: Target
    stage: str
    is_inference: bool
    mode: str
    codegen: str = "inductor"
    cost_model: Any = None
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    notes: list[str] = dataclasses.field(default_factory=list)
    # context managers (as factories) to hold while AOTAutograd traces; see during_aot
    aot_contexts: list[Callable[[], Any]] = dataclasses.field(default_factory=list)
    # Inductor config settings for this graph's compile, its backward's included; see inductor_config
    inductor_patches: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the wrap stage: the Dynamo graph the compiled callable runs (after the pre_aot passes)
    graph_module: fx.GraphModule | None = None
    # lossy passes: the labels of the rewrites proposed, and which may be made (None: all)
    proposed: list[str] = dataclasses.field(default_factory=list)
    allowed: frozenset[str] | None = None
    # run before each call of the compiled graph, with its arguments (see before_each_call)
    call_hooks: list[Callable[[Sequence[Any]], None]] = dataclasses.field(default_factory=list)
    # run after each call of the compiled graph, on its outputs (see after_each_call)
    return_hooks: list[Callable[[Any], Any]] = dataclasses.field(default_factory=list)
    # wrappers of the compiled callable, innermost first (see wrap_each_call)
    call_wrappers: list[Callable[[Callable], Callable]] = dataclasses.field(default_factory=list)
    # compile at the n-th call, running the graph as it is before (see defer_compile); 0: now
    defer_calls: int = 0
    # wrappers of the whole compiled callable, hooks included, kept where the graph is unchanged (see wrap_built)
    built_wrappers: list[Callable[[Callable, list[str]], Callable]] = dataclasses.field(default_factory=list)
    # notes made once the graph is compiled (see note_after_compile)
    late_notes: list[Callable[[list[str]], None]] = dataclasses.field(default_factory=list)
    # lossy passes that say what each rewrite replaced: label -> (the new node's name, the exact function)
    local_checks: dict[str, tuple[str, Callable[..., Any], Any]] = dataclasses.field(default_factory=dict)
    inputs_fn: Callable[[], list[Any]] | None = dataclasses.field(default=None, repr=False)
    _inputs: list[Any] | None = dataclasses.field(default=None, repr=False)
    # the user asked for this pass (its key, its group's, or ``pipeline``); False: it runs by its default
    explicit: bool = False
    # CUDA graphs are asked for: a mode that captures, or the cudagraphs pass with decide="always", under Inductor
    # (under "auto" it decides later, on the rewritten graph); whether this graph can be captured (its inputs'
    # devices, dynamic sizes, host syncs) is passes/cudagraphs.py's graph_refusal
    cuda_graphs: bool = False
    # another pass's options where it runs in this compile (in the pipeline, switched on, for this target), else
    # None: a pass that takes nodes a later one would also take weighs the later one's rewrite (sparsity-2-4)
    other_pass: Callable[[str], Any] = lambda name: None
    # the compile's options (all passes'), as a key: graphs of one frame compiled alike share it (bucketing)
    compile_key: str = ""

    def count(self, stat: str = "matches", n: int = 1) -> None:
        self.stats[stat] += n

    def near_miss(self, reason: str) -> None:
        """Record a candidate the pass looked at and left alone, with why (shown in the report)."""
        self.stats["near_misses"] += 1
        self.notes.append(f"near miss: {reason}")

    def note(self, message: str) -> None:
        self.notes.append(message)

    @property
    def decide(self) -> str | None:
        """The options' ``decide`` in effect: "auto" means "measure" under mode="max-autotune" (None where the
        pass has no such option)."""
        decide = getattr(self.options, "decide", None)
        return "measure" if decide == "auto" and self.mode == "max-autotune" else decide

    def propose(self, label: str) -> bool:
        """A lossy pass asks before each rewrite, naming it (e.g. the node it replaces); False means the pass
        manager backed this rewrite out (its error was over the pass's bound) and the pass must leave it."""
        self.proposed.append(label)
        return self.allowed is None or label in self.allowed

    def check_locally(self, label: str, node: fx.Node, exact: Callable[..., Any], split=None) -> None:
        """After the rewrite ``label`` made ``node``: ``exact`` takes the node's arguments and computes what it
        replaced. The guard then measures each rewrite's own error where it happens (the node's output against
        ``exact`` on the same inputs, in one run of the rewritten graph) instead of searching rewrite by
        rewrite with the whole graph's output (kpt_compiler.lossy_guard). ``split`` (widths along the last
        dim): the output is several layers' side by side (the fp4 pass's groups), and the figure is the lowest
        of its parts', so that a narrow part's error does not hide in the others' signal."""
        self.local_checks[label] = (node.name, exact, split)

    def before_each_call(self, hook: Callable[[Sequence[Any]], None]) -> None:
        """Call ``hook(args)`` before each call of the compiled graph (its flat arguments, in placeholder
        order): for a pass that computed something from an input at compile time and must see it change
        (the fp8 pass's weights quantized once). Keep it cheap: it runs on every call. pre_aot passes only:
        later stages' graphs take other arguments."""
        if self.stage != "pre_aot":
            raise RuntimeError("before_each_call is for pre_aot passes: later graphs are called with other arguments")
        self.call_hooks.append(hook)

    def after_each_call(self, hook: Callable[[Any], Any]) -> None:
        """Pass the compiled graph's outputs through ``hook(outputs) -> outputs`` after each call (pre_aot passes
        that applied only): for a pass that changes how the graph runs, e.g. the cudagraphs pass copying outputs
        out of the CUDA graphs' pool. Keep it cheap: it runs on every call."""
        if self.stage != "pre_aot":
            raise RuntimeError("after_each_call is for pre_aot passes: later graphs return other outputs")
        self.return_hooks.append(hook)

    def wrap_each_call(self, wrapper: Callable[[Callable], Callable]) -> None:
        """Have ``wrapper(compiled) -> callable`` wrap the compiled graph (pre_aot passes that applied only): for
        a pass that changes the arguments, such as bucketing padding them to a bucket's sizes. Wrappers sit inside
        the before/after hooks, so those see the caller's arguments and the outputs the wrapper returns."""
        if self.stage != "pre_aot":
            raise RuntimeError("wrap_each_call is for pre_aot passes: later graphs are called with other arguments")
        self.call_wrappers.append(wrapper)

    def defer_compile(self, calls: int) -> None:
        """Run the graph as it is (eagerly) until its ``calls``-th call, and compile it then, with that call's
        arguments as the example (pre_aot passes). For graphs that may never be called again: bucketing's static
        first graph, whose compile would cost seconds for one call. A graph with dynamic sizes is never compiled
        then (compiled outside Dynamo it would lose its symbols): it runs as it is at every call that reaches it
        (bucketing: batch 1 with the sequence dynamic, served by the frame's dynamic graph)."""
        if self.stage != "pre_aot":
            raise RuntimeError("defer_compile is for pre_aot passes")
        self.defer_calls = max(self.defer_calls, calls)

    def wrap_built(self, wrapper: Callable[[Callable, list[str]], Callable]) -> None:
        """Have ``wrapper(built, notes) -> callable`` take the compiled graph as the caller gets it (outside every
        hook; pre_aot passes, kept even where the pass left the graph as it is; ``notes``: the graph report's, for
        what happens at its calls): to serve this graph by another (bucketing: a graph Dynamo specialized, served
        by its frame's dynamic graph) or to keep a reference."""
        if self.stage != "pre_aot":
            raise RuntimeError("wrap_built is for pre_aot passes")
        self.built_wrappers.append(wrapper)

    def note_after_compile(self, take_notes: Callable[[list[str]], None]) -> None:
        """Once the code generator has compiled the graph, hand ``take_notes`` this pass's notes in the report
        (a list it may append to, then or at a later call): for what only the compile or the first call tells,
        such as a capture Inductor declined."""
        self.late_notes.append(take_notes)

    def during_aot(self, context_factory: Callable[[], Any]) -> None:
        """Hold ``context_factory()`` while AOTAutograd traces this graph (pre_aot passes only): for choices the
        dispatcher makes at trace time, such as which SDPA kernel a scaled_dot_product_attention call becomes."""
        if self.stage != "pre_aot":
            raise RuntimeError("during_aot is for pre_aot passes: later stages run after the trace")
        self.aot_contexts.append(context_factory)

    def inductor_config(self, patches: dict[str, Any]) -> None:
        """Compile this graph under these Inductor config settings (pre_aot passes that apply only): they go to
        ``compile_fx`` as its ``config_patches`` (the user's ``options["inductor"]`` over them), which also hold
        for the backward, compiled at the first backward call, after any context held during the trace is gone."""
        if self.stage != "pre_aot":
            raise RuntimeError("inductor_config is for pre_aot passes: later stages run inside Inductor's compile")
        self.inductor_patches.update(patches)

    @property
    def example_inputs(self) -> list[Any]:
        if self._inputs is None:
            if self.inputs_fn is None:
                raise RuntimeError("this context has no example inputs")
            self._inputs = list(self.inputs_fn())
        return self._inputs


@dataclasses.dataclass(frozen=True)
class GraphPass:
    name: str
    summary: str
    stage: str
    run: Callable[..., Any]
    options: type = NoOptions
    statistics: tuple[str, ...] = ("matches",)
    default: bool = True  # on unless the options switch it off; lossy passes are off by default
    # A lossy pass changes results within a stated error: the pass manager runs the graph before and after it
    # on the example inputs and backs out a rewrite whose signal-to-noise ratio (dB) is under the bound (the
    # options' ``error_bound_db`` field where they have one, else this).
    lossy: bool = False
    error_bound_db: float | None = None
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
        if self.lossy and self.error_bound_db is None:
            raise ValueError(f"pass {self.name!r} is lossy, so it must state its error bound (error_bound_db, in dB)")
        if self.lossy and self.stage == "wrap":
            raise ValueError(f"pass {self.name!r}: the lossy guard measures graphs; a wrap pass cannot be lossy")

    @property
    def key(self) -> str:
        """The key in torch.compile's options dict: the name with '_' for '-'."""
        return self.name.replace("-", "_")

    def unsupported_reason(self, target: Target, options: Any) -> str | None:
        return self.supports(target, options) if self.supports else None

    def bound_db(self, options: Any) -> float | None:
        """The error bound this pass holds to with these options (lossy passes only)."""
        if not self.lossy:
            return None
        given = getattr(options, "error_bound_db", None)
        return float(self.error_bound_db if given is None else given)


@dataclasses.dataclass(frozen=True)
class PassGroup:
    """Passes that users switch and configure together under one options key (see the module docstring).

    ``options`` is the group's frozen options dataclass. Its fields named in ``toggles`` switch one member
    each (``{"fusion": {"gated": False}}`` turns off ``fuse-gated-linear``); the others are passed on to every
    member whose options have a field of that name (``{"fusion": {"decide": "measure"}}``).
    """

    name: str
    summary: str
    members: tuple[str, ...]
    options: type = NoOptions
    toggles: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not dataclasses.is_dataclass(self.options) or not self.options.__dataclass_params__.frozen:
            raise ValueError(f"group {self.name!r}: options must be a frozen dataclass")
        fields = {f.name for f in dataclasses.fields(self.options)}
        for field, member in self.toggles.items():
            if field not in fields or member not in self.members:
                raise ValueError(f"group {self.name!r}: toggle {field!r} -> {member!r} names no field or member")

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    def shared(self, options: Any) -> dict[str, Any]:
        """The group options passed on to its members: every field that is not a member's toggle."""
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in self.toggles}

    def member_enabled(self, options: Any, member: str) -> bool:
        return all(getattr(options, field) for field, m in self.toggles.items() if m == member)


_REGISTRY: dict[str, GraphPass] = {}
_GROUPS: dict[str, PassGroup] = {}


def register_pass(spec: GraphPass) -> GraphPass:
    if spec.name in _REGISTRY and _REGISTRY[spec.name].run is not spec.run:
        raise ValueError(f"a pass named {spec.name!r} is already registered")
    if spec.name in _GROUPS:
        raise ValueError(f"{spec.name!r} is the name of a pass group")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_pass(name: str) -> None:
    _REGISTRY.pop(name, None)


def graph_pass(name: str, *, summary: str, stage: str, **fields: Any) -> Callable:
    """Declare the decorated function a pass: ``@graph_pass("fuse-attention", summary=..., stage="joint")``."""

    def wrap(fn: Callable[..., Any]) -> Callable:
        fn.graph_pass = register_pass(GraphPass(name=name, summary=summary, stage=stage, run=fn, **fields))
        return fn

    return wrap


def registered_passes() -> dict[str, GraphPass]:
    """Every registered pass by name (the built-in ones register when ``kpt_compiler`` is imported)."""
    return dict(_REGISTRY)


def register_group(group: PassGroup) -> PassGroup:
    if group.name in _REGISTRY:
        raise ValueError(f"{group.name!r} is the name of a pass")
    if group.name in _GROUPS and _GROUPS[group.name] != group:
        raise ValueError(f"a pass group named {group.name!r} is already registered")
    _GROUPS[group.name] = group
    return group


def registered_groups() -> dict[str, PassGroup]:
    """Every registered group by name; a group's members need not all be registered (a test may drop one)."""
    return dict(_GROUPS)


def expand_groups(names) -> list[str]:
    """Pass names, each group's name replaced by its members in the order the group declares them (repeats
    dropped, the first kept)."""
    out: list[str] = []
    for n in names:
        for m in _GROUPS[n].members if n in _GROUPS else (n,):
            if m not in out:
                out.append(m)
    return out
