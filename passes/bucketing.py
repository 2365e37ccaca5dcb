"""Shape bucketing: inputs whose sizes vary are padded up to a few sizes (buckets), and the outputs sliced back.

Dynamo compiles a graph for the sizes it first sees; once a size changes it compiles one that is dynamic in that
dimension (or, with ``mark_dynamic``, from the start). A dynamic graph runs every size, but a CUDA graph holds
one size and Inductor's cudagraph trees record one per size: a stream of changing sequence lengths records
graphs without end (pytorch/pytorch#128424). This pass takes the dynamic graph and pads its varying dimensions
to a ladder of sizes (powers of two by default, or the user's ``buckets``), so the compiled code and its CUDA
graphs meet a few sizes only; the padding is zeros (False for bool inputs: an attention mask padded with zeros
hides the padding).

It pads only where it proves from the graph that padding cannot change the real part of the outputs
(passes/_padding_proof.py), and says why not where it cannot, per dimension. The proof runs on the graph as the
user wrote it (traced to ATen before the other passes rewrite it; their rewrites compute each row as before).
Inference only: in training the padded positions would enter the loss. Only calls a CUDA graph replays are
padded (``pad="captured"``): others run at their own sizes through the same dynamic code. At each call the
bucket is checked against the guards the compiled code was made under (one past a guard runs unpadded).

Asked for (``options={"bucketing": True}``), it pads from the dynamic graph's first call. Not asked for, it is on
for CUDA inference only and waits: the dynamic graph runs unpadded until it has met ``AUTO_AFTER_SHAPES``
distinct sizes (a stream of changing sizes, not a model called at two or three), and the report says when it
started. Its static graphs are then compiled at once, as without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Sequence

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import graph_utils
from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from . import _bucket_frames as frames
from . import _ladder as ladder
from ._bucket_frames import CannotServe
from ._bucket_inputs import (_guards_hold, _has, _input_facts, _mutated_placeholders, _output_dims,
                             _padded_placeholders, _shape_env, _trace, _value)
from ._padding_proof import Unprovable, prove

MAX_SYMBOL_RETRIES = 4
AUTO_AFTER_SHAPES = 4  # on by default: distinct sizes the dynamic graph meets before it pads
FIT_AFTER_SHAPES = 8  # buckets="fit": the fewest distinct sizes a ladder is fitted to


@dataclasses.dataclass(frozen=True)
class BucketingOptions:
    # which dimensions of the inputs may be padded (0: batch, 1: sequence, ...); None: every dynamic one
    dims: tuple[int, ...] | None = None
    # the sizes to pad to, ascending; None: powers of two; "fit": a ladder per padded dim fitted to the sizes met
    # (passes/_ladder.py) once the graph has met max(after_shapes, FIT_AFTER_SHAPES) distinct sizes. A size past
    # the user's last bucket runs unpadded; past a fitted ladder, it rounds up to a power of two
    buckets: tuple[int, ...] | Literal["fit"] | None = None
    # a graph Dynamo made for one set of sizes (before any changed) compiles at this call, running eagerly
    # before: in a stream of changing sizes it may never be called again (1: compile at once)
    compile_static_after: int = 2
    # "captured": pad only the calls a CUDA graph replays (the cudagraphs pass, per bucket); the others run at
    # their own sizes through the same dynamic code, which padding would only slow. "always": pad every call
    pad: Literal["captured", "always"] = "captured"
    # pad once the dynamic graph has met this many distinct sizes (1: from its first call). When the pass runs
    # by default, not asked for: AUTO_AFTER_SHAPES
    after_shapes: int = 1

    def __post_init__(self):
        if self.buckets is not None and self.buckets != "fit":
            if not self.buckets or any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
                raise ValueError(f"buckets must be positive sizes in ascending order, got {list(self.buckets)}")
        if self.after_shapes < 1:
            raise ValueError(f"after_shapes must be 1 or more, got {self.after_shapes}")
        if self.compile_static_after < 1:
            raise ValueError(f"compile_static_after must be 1 or more, got {self.compile_static_after}")
        if self.dims is not None and any(d < 0 for d in self.dims):
            raise ValueError(f"dims must be dimension indices >= 0, got {list(self.dims)}")


@dataclasses.dataclass
class Plan:
    """How one graph is padded: read by the wrapper at each call and by the cudagraphs pass."""

    symbols: tuple[sympy.Symbol, ...]  # padded
    sources: dict[sympy.Symbol, tuple[int, int]]  # every dynamic symbol -> (argument, dim) that gives its value
    tensors: list[tuple[int, list[tuple[int, Any]]]]  # (argument, [(dim, size expression)]) to pad
    sym_args: list[tuple[int, Any]]  # SymInt arguments: (argument, expression)
    outputs: list[tuple[int, list[tuple[int, Any]]]]  # (output, [(dim, size expression)]) to slice back
    buckets: tuple[int, ...] | str | None  # str: "fit", until fitted (then ``ladders``)
    shape_env: Any = None
    withdrawn: str | None = None  # a later pass made padding unsafe (the fp8 pass's tensorwise scales)
    seen: dict[tuple, bool] = dataclasses.field(default_factory=dict)  # bucket -> the guards hold there
    notes: list[str] | None = None
    calls: int = 0
    pad_always: bool = False  # the options' pad="always"; else only the calls a CUDA graph replays are padded
    mutated_inputs: bool = False  # the graph writes into one of its inputs
    graphs: Any = None  # a _bucket_graphs.BucketGraphs when the cudagraphs pass captures per bucket
    _memo: dict = dataclasses.field(default_factory=dict)  # real sizes -> what _sizes says
    watched: list = dataclasses.field(default_factory=list)  # buffers the proof read: (input, version, address)
    after_shapes: int = 1  # pads from the call at which the graph has met this many distinct sizes
    met: set = dataclasses.field(default_factory=set)  # the distinct sizes met while waiting
    ladders: dict | None = None  # buckets="fit": symbol -> its fitted ladder
    forced: bool = False  # this call's sizes break the code's guards (another graph served by this one): pad

    def __post_init__(self):
        where = list(self.sources)  # the padded symbols' places among the sizes ``call`` reads
        self._padded_at = [where.index(s) for s in self.symbols if s in self.sources]

    def bucket(self, n: int, symbol: Any = None) -> int:
        if self.ladders is not None:
            return ladder.round_up(n, self.ladders.get(symbol), past="power_of_two")
        return ladder.round_up(n, self.buckets if self.buckets != "fit" else None)

    def waits_for(self) -> int:
        return max(self.after_shapes, FIT_AFTER_SHAPES) if self.buckets == "fit" else self.after_shapes

    def _fit(self) -> None:
        self.ladders = {s: ladder.fit([m[i] for m in self.met]) for i, s in enumerate(self.symbols)}
        if self.notes is not None:
            fitted = "; ".join(f"{s}: {list(v)}" for s, v in self.ladders.items())
            self.notes.append(f"call {self.calls}: ladders fitted to the {len(self.met)} sizes met: {fitted}")

    def wrap(self, compiled: Callable) -> Callable:
        if self.withdrawn:
            return compiled

        def call(*args: Any) -> Any:
            return self.call(compiled, args)

        return call

    def call(self, compiled: Callable, args: Sequence[Any]) -> Any:
        self.calls += 1
        for i, version, ptr in self.watched:
            if args[i]._version != version or args[i].data_ptr() != ptr:  # a buffer the proof read has changed
                if self.notes is not None and self.watched:
                    self.notes.append(f"call {self.calls}: a buffer the proof read changed; calls run unpadded")
                self.watched, self.withdrawn = [], "a buffer the proof read changed"
        if self.forced:
            return self._forced(compiled, args)
        if self.withdrawn or self.graphs is None and not self.pad_always:
            return compiled(*args)
        real = tuple(_size(args, where) for where in self.sources.values())
        if self.met is not None:  # waiting for enough distinct sizes of the padded dims (others may vary too)
            self.met.add(tuple(real[i] for i in self._padded_at))
            if len(self.met) < self.waits_for():
                return compiled(*args)
            if self.buckets == "fit":
                self._fit()
            if self.notes is not None and self.waits_for() > 1:
                self.notes.append(f"call {self.calls}: {len(self.met)} distinct sizes met; padding to buckets from "
                                  "here on")
            self.met = None
        sizes = self._sizes_of(real, args)
        if sizes[0] is None:  # every size a bucket already (and no graphs to replay), or a guard broken there
            return compiled(*args)
        return self._padded(compiled, args, sizes)

    def _padded(self, compiled: Callable, args: Sequence[Any], sizes: tuple, forced: bool = False) -> Any:
        key, shapes, sym_values, out_sizes = sizes
        new = list(args)
        for (i, _), v in zip(self.sym_args, sym_values):
            new[i] = v
        if self.graphs is not None:
            outs = self.graphs.run(key, compiled, new, list(shapes), shapes, dict(zip(self.symbols, key)))
            if outs is not None:
                return self._slice(outs, out_sizes, copy=True) if self._fits(outs, out_sizes) else compiled(*args)
            if not forced and not self.pad_always and key in self.graphs.declined:
                return compiled(*args)  # no CUDA graph holds this bucket: its own sizes cost less than padded ones
        for i, shape in shapes.items():
            t = args[i]
            pad = [p for d in reversed(range(t.dim())) for p in (0, shape[d] - t.shape[d])]
            new[i] = F.pad(t, pad) if any(pad) else t
        outs = compiled(*new)
        return self._slice(outs, out_sizes, copy=False) if self._fits(outs, out_sizes) else compiled(*args)

    def _fits(self, outs: Any, out_sizes: list) -> bool:
        """Whether each output holds its real sizes (the proof makes every padded dim grow). If one does not, the
        proof was wrong: padding is withdrawn, said in the report, and the call runs at its own sizes."""
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if all(flat[i].size(d) >= n for (i, _), sizes in zip(self.outputs, out_sizes) for d, n in sizes):
            return True
        self.withdrawn = "an output came out smaller than its real size once padded (a gap in the proof)"
        if self.notes is not None:
            self.notes.append(f"call {self.calls}: {self.withdrawn}; padding withdrawn, calls run unpadded")
        return False

    def _forced(self, compiled: Callable, args: Sequence[Any]) -> Any:
        """A call whose sizes the code was not compiled for (a graph of the same frame that Dynamo specialized,
        batch 1 say, served by this one: passes/_bucket_frames.py): padded to a bucket where the code's guards
        hold, never run at its own sizes; CannotServe where no bucket does."""
        if self.withdrawn or set(self.sources) - set(self.symbols):
            raise CannotServe(self.withdrawn or "a dynamic size this graph does not pad")
        sizes = self._sizes_of(tuple(_size(args, where) for where in self.sources.values()), args)
        if sizes[0] is None:
            raise CannotServe("no bucket of these sizes keeps the guards the code was compiled under")
        return self._padded(compiled, args, sizes, forced=True)

    def _sizes_of(self, real: tuple, args: Sequence[Any]) -> tuple:
        sizes = self._memo.get(real)
        if sizes is None:  # sympy once per distinct set of sizes, not on every call
            if len(self._memo) > 4096:
                self._memo.clear()
            sizes = self._memo[real] = self._sizes(dict(zip(self.sources, real)), args)
        return sizes

    def _lowest(self, s: Any) -> int:
        """The least size the code was compiled for (Dynamo's dynamic sizes start at 2: 0 and 1 specialize)."""
        vr = self.shape_env.var_to_range.get(s) if self.shape_env is not None else None
        lower = getattr(vr, "lower", 0)
        return int(lower) if lower is not None and lower != -sympy.oo else 0

    def _sizes(self, real: dict, args: Sequence[Any]) -> tuple:
        """For one set of real sizes: (the bucket, or None to call unpadded; padded input shapes; SymInt
        arguments; the real sizes of the outputs' padded dims). A bucket is never under the least size the code
        was compiled for."""
        padded = dict(real)
        for s in self.symbols:
            padded[s] = self.bucket(max(real[s], self._lowest(s)), s)
        key = tuple(padded[s] for s in self.symbols)
        if self.graphs is None and all(padded[s] == real[s] for s in self.symbols):
            return None, {}, [], []
        ok = self.seen.get(key)
        if ok is None:
            ok = self.seen[key] = _guards_hold(self.shape_env, padded, self.symbols)
            if self.notes is not None:
                label = ", ".join(f"{s}={padded[s]}" for s in self.symbols)
                self.notes.append(f"call {self.calls}: first call in bucket {label}" if ok else
                                  f"call {self.calls}: bucket {label} breaks a guard the code was compiled under; "
                                  "calls there run unpadded")
        if not ok:
            return None, {}, [], []
        shapes = {i: tuple(_value(e, padded) if d in dict(dims) else args[i].shape[d]
                           for d, e in enumerate(_full_dims(args[i], dims)))
                  for i, dims in self.tensors}
        out_sizes = [[(d, _value(expr, real)) for d, expr in dims] for _, dims in self.outputs]
        return key, shapes, [_value(e, padded) for _, e in self.sym_args], out_sizes

    def _slice(self, outs: Any, out_sizes: list, copy: bool) -> Any:
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for (i, _), sizes in zip(self.outputs, out_sizes):
            o = flat[i]
            for d, n in sizes:
                o = o.narrow(d, 0, n)
            # contiguous as eager's would be (a narrowed inner dim leaves a view .view() cannot always take)
            flat[i] = o if copy or o.is_contiguous() else o.contiguous()
        if copy:  # out of the CUDA graphs' pool, which the next replay writes
            flat = [o.clone() if isinstance(o, torch.Tensor) else o for o in flat]
        return type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0]


def _full_dims(t: torch.Tensor, dims: list[tuple[int, Any]]) -> list[Any]:
    given = dict(dims)
    return [given.get(d) for d in range(t.dim())]


def _size(args: Sequence[Any], where: tuple[int, int]) -> int:
    i, d = where
    return int(args[i]) if d < 0 else int(args[i].shape[d])


@graph_pass("bucketing", summary="inputs whose sizes vary padded to a ladder of buckets (zeros), outputs sliced "
            "back, where the graph provably keeps the padding out of the real outputs", stage="pre_aot",
            options=BucketingOptions, default=True, statistics=("padded_dims",))
def bucketing(gm: fx.GraphModule, ctx: PassContext) -> bool:
    if not ctx.explicit:  # on by default: for CUDA graphs per bucket, on a stream of sizes
        off = (f"the graph runs on {ctx.target.device}" if not ctx.target.is_cuda else
               None if ctx.is_inference else "a training graph")
        if off is None and not graph_utils.has_dynamic_sizes(gm):
            ctx.note("not padded: no input size varies in this graph")
            key = frames.frame_key(ctx)
            if frames.known(key):  # batch 1 after the dynamic graph, say
                _serve(gm, ctx, key)
            return False
        if off is not None:
            ctx.note(f"not padded: on by default for CUDA inference only ({off}); options={{'bucketing': True}} asks "
                     "for it")
            return False
    key = frames.frame_key(ctx) if ctx.is_inference else None
    served = frames.prepared(gm, key, ctx.example_inputs) if frames.known(key) and graph_utils.has_dynamic_sizes(
        gm) else None
    if isinstance(served, frames.Served):  # batch 1, the sequence dynamic: no proof of its own (seconds of tracing)
        gm.meta["kpt_served"] = True
        _serve(gm, ctx, key, served)
        ctx.note("no padding proof of its own: its calls run the dynamic graph's code, padded as that graph's proof "
                 "allows")
        return True
    if served is not None:
        ctx.note(f"not served by the frame's bucketed dynamic graph: {served}; compiled")
    plan, why = make_plan(gm, ctx)
    if plan is None:
        ctx.note(f"not padded: {why}")
        if ctx.explicit and ctx.is_inference and not graph_utils.has_dynamic_sizes(gm):
            if ctx.options.compile_static_after > 1:
                ctx.defer_compile(ctx.options.compile_static_after)
                ctx.note(f"compile deferred to call {ctx.options.compile_static_after}: Dynamo makes this graph for "
                         "the sizes it saw first, and a stream of changing sizes may not call it again")
            if ctx.options.compile_static_after > 1 or frames.known(key):
                _serve(gm, ctx, key)
        return False
    gm.meta["kpt_bucketing"] = plan
    if served is None:
        frames.register(ctx, gm, plan)
    plan.after_shapes = ctx.options.after_shapes if ctx.explicit else AUTO_AFTER_SHAPES
    ctx.count("padded_dims", len(plan.symbols))
    rungs = "powers of two" if plan.buckets is None else "a ladder fitted to the sizes met" if plan.buckets == "fit" \
        else f"buckets {list(plan.buckets)}"
    ctx.note(f"padded to {rungs}{'' if plan.pad_always else ' where a CUDA graph replays the bucket'}: {why}")
    if plan.waits_for() > 1:
        ctx.note(f"padding starts once the graph has met {plan.waits_for()} distinct sizes" +
                 ("" if ctx.explicit else " (on by default; options={'bucketing': True} pads from the first call)"))
    ctx.wrap_each_call(plan.wrap)
    ctx.during_aot(_no_size_range_guards)
    guards_before = len(plan.shape_env.guards) if plan.shape_env is not None else 0

    def keep_notes(notes: list[str]) -> None:
        plan.notes = notes
        if plan.withdrawn:
            notes.append(f"withdrawn: {plan.withdrawn}")
        added = [str(g.expr) for g in (plan.shape_env.guards[guards_before:] if plan.shape_env is not None else [])
                 if g.expr.free_symbols & set(plan.symbols)]
        if added:  # Dynamo checks them on the real sizes: a call outside them compiles another graph
            notes.append(f"the compile guarded the padded sizes ({'; '.join(added[:4])}): calls outside these "
                         "recompile, and buckets outside them run unpadded")

    ctx.note_after_compile(keep_notes)
    return True  # applied: the graph is the same; the compiled callable gets the padding around it


def _serve(gm: fx.GraphModule, ctx: PassContext, key: tuple | None, served=None) -> None:
    ctx.defer_compile(max(2, ctx.options.compile_static_after))
    frames.serve(ctx, gm, key, served)
    ctx.note("served by the frame's bucketed dynamic graph where its calls map onto it (padded to a bucket); where "
             "they do not, a static graph compiles its own code, one with dynamic sizes runs as it is "
             "(passes/_bucket_frames.py)")


def _no_size_range_guards():
    """Inductor's mm padding without its compute-bound check for a bucketed compile: the check asks ``M * N >=
    768`` of the dynamic sizes (a recompile for the other side); the padding itself pads static dims only (GPT-2's
    50257-word head). On the H100 stream kpt with it ran the second pass in 0.42 s, bucketed graphs with it off in
    0.71 s (76ccf54; the cause not isolated). Where torch lacks the switch: off."""
    from torch._inductor import config

    return config.patch(force_shape_pad=True) if hasattr(config, "force_shape_pad") else \
        config.patch(shape_padding=False)


def make_plan(gm: fx.GraphModule, ctx: PassContext) -> tuple[Plan | None, str]:
    """The padding plan for ``gm``, with what was proven; or None and why not."""
    if not ctx.is_inference:
        return None, "a training graph (the padded positions would enter the loss and its gradients)"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [ir.example_value(n) for n in placeholders]
    sources: dict[sympy.Symbol, tuple[int, int]] = {}
    candidates: dict[sympy.Symbol, str] = {}
    dims = ctx.options.dims
    for i, (node, v) in enumerate(zip(placeholders, values)):
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            sources.setdefault(v.node.expr, (i, -1))
        elif isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    s = size.node.expr
                    sources.setdefault(s, (i, d))
                    if dims is None or d in dims:
                        candidates.setdefault(s, f"{node.name} dim {d}")
    if not candidates:
        return None, ("no input size varies in this graph (Dynamo compiles one for the sizes first seen; bucketing "
                      "pads the graph it makes dynamic once a size changes, or dims marked with "
                      "torch._dynamo.mark_dynamic)" if not sources else
                      f"none of the dynamic dims is in dims={list(dims)}")
    if any(s not in sources for v in values if isinstance(v, torch.Tensor)
           for size in v.shape if isinstance(size, torch.SymInt) for s in size.node.expr.free_symbols):
        return None, "an input size is an expression of sizes no input gives alone"
    try:
        aten_gm = _trace(gm, values)
    except Exception as e:  # noqa: BLE001 - no trace, no proof
        return None, f"the graph could not be traced to ATen for the proof ({type(e).__name__}: {str(e)[:200]})"
    refused: list[str] = []
    watched: list = []
    padded = frozenset(candidates)
    for _ in range(MAX_SYMBOL_RETRIES):
        try:
            watched.clear()
            outs = prove(aten_gm, padded, _input_facts(aten_gm, values, ctx.example_inputs, padded,
                                                       [n.name for n in placeholders], watched))
            break
        except Unprovable as e:
            drop = e.symbols & padded or padded
            refused += [f"{candidates[s]} ({s}): {e}" for s in sorted(drop, key=str)]
            padded = padded - drop
            if not padded:
                return None, "cannot prove that padding leaves the real outputs unchanged: " + "; ".join(refused)
    else:
        return None, "cannot prove it for any dim within the retries: " + "; ".join(refused)
    mutated = _mutated_placeholders(aten_gm)
    if mutated & set(_padded_placeholders(aten_gm, values, padded)):
        return None, f"the graph writes into a padded input ({', '.join(sorted(mutated))}); the caller would not see it"
    plan = Plan(
        symbols=tuple(sorted(padded, key=str)), sources=sources,
        tensors=[(i, [(d, size.node.expr) for d, size in enumerate(v.shape) if _has(size, padded)])
                 for i, v in enumerate(values) if isinstance(v, torch.Tensor) and any(_has(s, padded) for s in v.shape)],
        sym_args=[(i, v.node.expr) for i, v in enumerate(values) if isinstance(v, torch.SymInt) and _has(v, padded)],
        outputs=_output_dims(gm, padded), buckets=ctx.options.buckets,
        shape_env=_shape_env(values), mutated_inputs=bool(mutated), pad_always=ctx.options.pad == "always",
    )
    if plan.outputs is None:
        return None, "an output is not a tensor or size this pass can slice back"
    if graph_utils.outputs_aliasing_inputs(gm):
        return None, "an output is a view of an input (padded, it would be a view of the padded copy)"
    plan.watched = list(watched)
    proven = ", ".join(f"{candidates[s]} ({s})" for s in plan.symbols)
    why = f"proven for {proven} ({len([o for o in outs if o is not None])} outputs sliced back where padded)"
    if refused:
        why += "; not padded: " + "; ".join(refused)
    return plan, why
