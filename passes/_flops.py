"""Counting a graph's FLOPs (passes/cudagraphs.py's device-time estimate): torch's FLOP counter over a run on fake
tensors at given sizes, or once over Dynamo's symbolic fake values as a sympy expression of the graph's dynamic
sizes, which each bucket of a bucketed graph then evaluates (issue 17: a run per bucket took 8.8 s of the Llama
stream's pass 1 under cProfile on the H100, session 39)."""

from __future__ import annotations

import weakref
from typing import Any

import sympy
import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir

_FLOPS_EXPR: "weakref.WeakKeyDictionary[fx.GraphModule, Any]" = weakref.WeakKeyDictionary()


def _flops_expr(gm: fx.GraphModule) -> Any:
    """The graph's FLOPs as a sympy expression of its dynamic sizes, counted once (a bucket substitutes its sizes):
    the graph run under torch's FLOP counter on Dynamo's own symbolic fake values, in their fake mode, guards
    suppressed. None where that run fails or the graph has no dynamic size (then each bucket counts its own)."""
    if gm not in _FLOPS_EXPR:
        _FLOPS_EXPR[gm] = None
        try:
            _FLOPS_EXPR[gm] = _symbolic_count(gm)
        except Exception:  # noqa: BLE001 - an op the symbolic run does not take: per-bucket counts instead
            pass
    return _FLOPS_EXPR[gm]


def _symbolic_count(gm: fx.GraphModule) -> Any:
    from torch._dispatch.python import enable_python_dispatcher

    values = [ir.example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    mode = next((v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor)), None)
    env = getattr(mode, "shape_env", None)
    if env is None or not any(isinstance(s, torch.SymInt) for v in values if isinstance(v, torch.Tensor)
                              for s in v.shape):
        return None
    real_ok, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True  # constants our passes added
    try:
        with mode, enable_python_dispatcher(), env.suppress_guards():
            counter = _counted_run(gm, values)
    finally:
        mode.allow_non_fake_inputs = real_ok
    total = counter.get_total_flops()
    return total.node.expr if isinstance(total, torch.SymInt) else sympy.Integer(int(total))


def _int(size: Any, sizes: dict | None) -> int:
    """A size as an int: a dynamic one at ``sizes`` (symbol -> int) where they give it, else its example's."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    if sizes:
        expr = expr.xreplace({s: sympy.Integer(v) for s, v in sizes.items()})
    if expr.is_number:
        return int(expr)
    return int(size.node.hint)


def _count_flops(gm: fx.GraphModule, values: list[Any], sizes: dict | None = None) -> float:
    """The graph run once under torch's FLOP counter, on fresh fake tensors of the recorded shapes (the recorded
    values may come from several fake modes once passes have added nodes, which FakeTensorMode refuses to mix)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [torch.empty_strided([_int(s, sizes) for s in v.shape], [_int(s, sizes) for s in v.stride()],
                                     dtype=v.dtype, device=v.device)
                 if isinstance(v, torch.Tensor) else v for v in values]
        counter = _counted_run(gm, fakes)
    del mode
    return float(counter.get_total_flops())


def _counted_run(gm: fx.GraphModule, values: list[Any]):
    """``gm`` run on ``values`` under torch's FLOP counter (the interpreter only where a node names a stand-in)."""
    from torch.utils.flop_counter import FlopCounterMode

    stand_ins = any(hasattr(n.target, "flop_standin") for n in gm.graph.nodes if n.op == "call_function")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        _StandIns(gm).run(*values) if stand_ins else gm(*values)
    return counter


class _StandIns(fx.Interpreter):
    """The graph run with each function that names a ``flop_standin`` (one with the same FLOPs that torch's FLOP
    counter can run: kernels/flex_attention.py's) called in its place."""

    def call_function(self, target, args, kwargs):
        return getattr(target, "flop_standin", target)(*args, **kwargs)
