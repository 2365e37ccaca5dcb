"""Passes that exist only for tests: each does one simple, checkable thing (or fails on purpose).

All are off by default; a test turns one on with options={"test_...": True}.
"""

from __future__ import annotations

import dataclasses

import torch

from kpt_compiler import PassSkipped, graph_pass

aten = torch.ops.aten


@graph_pass("test-relu-to-clamp", summary="relu(x) -> clamp_min(x, 0): exact, changes the graph", stage="joint",
            default=False)
def relu_to_clamp(gm, ctx):
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten.relu.default:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(aten.clamp_min.default, (node.args[0], 0.0))
            new.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            ctx.count()
            changed = True
    return changed


@dataclasses.dataclass(frozen=True)
class ScaleOptions:
    factor: float = 2.0

    def __post_init__(self):
        if self.factor == 0:
            raise ValueError("factor must not be 0")


@graph_pass("test-scale-outputs", summary="multiplies every tensor output by a factor: a visible change",
            stage="forward", default=False, options=ScaleOptions)
def scale_outputs(gm, ctx):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    new_outs = []
    for value in out.args[0]:
        if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), torch.Tensor) \
                and value.meta["val"].dtype.is_floating_point:
            with gm.graph.inserting_before(out):
                scaled = gm.graph.call_function(aten.mul.Tensor, (value, ctx.options.factor))
            scaled.meta["val"] = value.meta["val"]
            new_outs.append(scaled)
            ctx.count()
        else:
            new_outs.append(value)
    out.args = (type(out.args[0])(new_outs),)
    return ctx.stats["matches"] > 0


@graph_pass("test-raise", summary="vandalises the graph, then raises", stage="forward", default=False)
def raise_midway(gm, ctx):
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and not node.users:
            gm.graph.erase_node(node)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (tuple(None for _ in out.args[0]),)
    ctx.count()
    raise RuntimeError("test-raise: failing on purpose")


@graph_pass("test-no-meta", summary="adds a node without meta['val'] (breaks an invariant)", stage="joint",
            default=False)
def add_node_without_meta(gm, ctx):
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(first):
        gm.graph.call_function(aten.neg.default, (first,))
    return True


@graph_pass("test-skip", summary="always steps aside, saying why", stage="joint", default=False)
def always_skip(gm, ctx):
    raise PassSkipped("nothing for this pass on such graphs")


@graph_pass("test-cuda-only", summary="claims to need CUDA", stage="joint", default=False,
            supports=lambda target, opts: None if target.is_cuda else f"it needs a CUDA GPU and the target is {target.device}")
def cuda_only(gm, ctx):
    return False


@graph_pass("test-pre-aot-sin", summary="sin -> cos at the torch level (pre-AOT; changes numerics)",
            stage="pre_aot", default=False)
def sin_to_cos(gm, ctx):
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.sin:
            node.target = torch.cos
            ctx.count()
            changed = True
    return changed


@graph_pass("test-drop-output", summary="changes what the graph returns (breaks an invariant)", stage="forward",
            default=False)
def drop_output(gm, ctx):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    first = next(v for v in out.args[0] if isinstance(v, torch.fx.Node))
    with gm.graph.inserting_before(out):
        summed = gm.graph.call_function(aten.sum.default, (first,))
    summed.meta["val"] = first.meta["val"].sum()
    out.args = ((summed, *out.args[0][1:]),)
    return True


def _untraceable(x):
    raise RuntimeError("this op cannot be traced")


@graph_pass("test-untraceable", summary="swaps torch.sin for a function AOTAutograd cannot trace", stage="pre_aot",
            default=False)
def untraceable(gm, ctx):
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.sin:
            node.target = _untraceable
            ctx.count()
            changed = True
    return changed


# ---------------------------------------------------------------------------------------------- lossy


@dataclasses.dataclass(frozen=True)
class RoundOptions:
    step: float = 0.02  # tanh's input is rounded to a multiple of this: the error this pass makes
    name_rewrites: bool = True  # ctx.propose(node name) before each rewrite, so the guard can back out one
    error_bound_db: float = 30.0


def rounded_tanh(x, step):
    return torch.tanh(torch.round(x / step) * step)


@graph_pass("test-lossy-round", summary="tanh(x) -> tanh(round(x / step) * step): lossy, with a bound in dB",
            stage="pre_aot", default=False, options=RoundOptions, lossy=True, error_bound_db=30.0)
def round_tanh_inputs(gm, ctx):
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.tanh:
            if ctx.options.name_rewrites and not ctx.propose(node.name):
                continue
            node.target, node.args = rounded_tanh, (node.args[0], ctx.options.step)
            ctx.count()
            changed = True
    return changed


# ---------------------------------------------------------------------------------------------- wrap

CALLS = {"test-wrap-count": 0}


@graph_pass("test-wrap-count", summary="wraps the compiled callable to count its calls", stage="wrap",
            default=False)
def count_calls(compiled, ctx):
    assert isinstance(ctx.graph_module, torch.fx.GraphModule)
    ctx.count()

    def counted(*args):
        CALLS["test-wrap-count"] += 1
        return compiled(*args)
    return counted


@graph_pass("test-wrap-raise", summary="a wrap pass that fails", stage="wrap", default=False)
def wrap_and_raise(compiled, ctx):
    raise RuntimeError("test-wrap-raise: failing on purpose")


BOUND_CALLS: list[int] = []


class _Runner:
    def __init__(self, compiled):
        self.compiled, self.calls = compiled, 0

    def run(self, *args):
        self.calls += 1
        BOUND_CALLS.append(self.calls)
        return self.compiled(*args)


@graph_pass("test-wrap-bound-method", summary="wraps the compiled callable in a bound method", stage="wrap",
            default=False)
def wrap_in_bound_method(compiled, ctx):
    return _Runner(compiled).run


SDP_PRIORITY: list[list[int]] = []


@graph_pass("test-record-sdp-priority", summary="records the SDPA backend priority in effect while AOT traces",
            stage="joint", default=False)
def record_sdp_priority(gm, ctx):
    SDP_PRIORITY.append([int(b) for b in torch._C._get_sdp_priority_order()])
    return False


@dataclasses.dataclass(frozen=True)
class InductorConfigOptions:
    applies: bool = True  # False: asks, then reports the graph unchanged


@graph_pass("test-inductor-config", summary="asks an Inductor setting for the compile (ctx.inductor_config)",
            stage="pre_aot", default=False, options=InductorConfigOptions)
def inductor_config(gm, ctx):
    ctx.inductor_config({"max_autotune_gemm_backends": "ATEN"})
    return ctx.options.applies
