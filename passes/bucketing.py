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
from typing import Literal

import sympy
import torch
import torch.fx as fx

from kpt_compiler import graph_utils
from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from . import _bucket_frames as frames
from ._bucket_inputs import _has, _input_facts, _mutated_placeholders, _output_dims, _padded_placeholders, _shape_env, \
    _trace
from ._bucket_plan import Plan
from ._padding_proof import Unprovable, prove

MAX_SYMBOL_RETRIES = 4
AUTO_AFTER_SHAPES = 4  # on by default: distinct sizes the dynamic graph meets before it pads


@dataclasses.dataclass(frozen=True)
class BucketingOptions:
    # which dimensions of the inputs may be padded (0: batch, 1: sequence, ...); None: every dynamic one
    dims: tuple[int, ...] | None = None
    # the sizes to pad to, ascending; None: powers of two; "fit": a ladder per padded dim fitted to the sizes met
    # (passes/_ladder.py) once the graph has met max(after_shapes, _bucket_plan.FIT_AFTER_SHAPES) distinct sizes. A size past
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
