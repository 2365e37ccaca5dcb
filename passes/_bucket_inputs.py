"""What the bucketing pass reads off a dynamic graph to plan its padding: the graph traced to ATen for the proof,
the facts the proof starts from, the inputs it writes into, the outputs to slice back (passes/bucketing.py)."""

from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir

from ._padding_proof import AV


def _mutated_placeholders(aten_gm: fx.GraphModule) -> set[str]:
    out = set()
    for node in aten_gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            for arg, a in zip(node.target._schema.arguments, node.args):
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, fx.Node) \
                        and a.op == "placeholder":
                    out.add(a.name)
    return out


def _padded_placeholders(aten_gm: fx.GraphModule, values: list[Any], padded: frozenset) -> list[str]:
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    return [n.name for n, v in zip(placeholders, values) if isinstance(v, torch.Tensor)
            and any(_has(s, padded) for s in v.shape)]


def _has(size: Any, padded: frozenset) -> bool:
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols & padded)


def _shape_env(values: list[Any]) -> Any:
    for v in values:
        if isinstance(v, torch.SymInt):
            return v.node.shape_env
        if isinstance(v, torch.Tensor):
            for s in v.shape:
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None


def _trace(gm: fx.GraphModule, values: list[Any]) -> fx.GraphModule:
    """``gm`` in ATen, traced under Dynamo's fake mode so its sizes are sympy expressions over Dynamo's symbols."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # the values' own mode: the tracing context may hold another one by now
    from torch._dispatch.python import enable_python_dispatcher

    fake_mode = next(v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor))
    env = _shape_env(values)
    # the Python dispatcher, as Dynamo and AOTAutograd trace with (without it torch 2.9 reads sizes as ints and
    # specializes the graph to them), and no guards: the proof reads the graph, the compile guards it
    # a tracing context of that mode too: a tensor constant (torch.tensor(0.0)) is lifted into the context's mode
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), fake_mode, torch.no_grad(), \
            enable_python_dispatcher(), env.suppress_guards():
        return make_fx(gm, tracing_mode="real")(*values)


def _input_facts(aten_gm: fx.GraphModule, values: list[Any], real: Sequence[Any], padded: frozenset,
                 names: list[str] | None = None, watched: list | None = None) -> dict[str, AV]:
    """What the proof starts from: padded inputs hold zeros (False) where padded; a module's small integer or
    bool buffer (a causal mask kept as a buffer) is known by its values, which each call checks did not change
    (``watched``: (input, version, address) appended for those)."""
    facts = {}
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    for i, (node, v, r) in enumerate(zip(placeholders, values, real)):
        if not isinstance(v, torch.Tensor):
            continue
        shape = tuple(s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s) for s in v.shape)
        av = AV(shape)
        zero = False if v.dtype == torch.bool else 0
        for d, e in enumerate(shape):
            if getattr(e, "free_symbols", set()) & padded:
                av.fill[d] = zero  # the padding: zeros
        if (not av.fill and isinstance(r, torch.Tensor) and r.dtype in (torch.bool, torch.uint8, torch.int8)
                and not isinstance(r, torch._subclasses.FakeTensor) and r.dim() >= 2
                and names is not None and "_buffers_" in names[i]):  # Dynamo's name for a module's buffer
            av.concrete = r.detach().cpu()
            if watched is not None:
                watched.append((i, r._version, r.data_ptr()))
        facts[node.name] = av
    return facts


def _output_dims(gm: fx.GraphModule, padded: frozenset) -> list[tuple[int, list[tuple[int, Any]]]] | None:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    result = []
    for i, o in enumerate(flat):
        v = ir.example_value(o) if isinstance(o, fx.Node) else o
        if isinstance(v, torch.Tensor):
            dims = [(d, s.node.expr) for d, s in enumerate(v.shape) if _has(s, padded)]
            if dims:
                result.append((i, dims))
        elif isinstance(v, torch.SymInt) and _has(v, padded):
            return None
    return result


def _value(expr: Any, values: dict) -> int:
    return int(expr.xreplace({s: sympy.Integer(v) for s, v in values.items()}))


def _guards_hold(shape_env: Any, values: dict, padded: tuple = ()) -> bool:
    """Whether the compiled code's guards and value ranges hold at these sizes. Guards on no padded symbol
    held for the real call (Dynamo checked them); the others must hold here, Dynamo's replacements applied (a
    symbol these sizes do not give: no)."""
    if shape_env is None:
        return True
    subs = {s: sympy.Integer(v) for s, v in values.items()}
    for s in padded or values:
        vr = shape_env.var_to_range.get(s)
        if vr is not None and not (vr.lower <= values[s] <= vr.upper):
            return False
    for guard in shape_env.guards:
        expr = shape_env.replace(guard.expr)
        if padded and not expr.free_symbols & set(padded):
            continue
        r = expr.xreplace(subs)
        if r is not sympy.true and r != True:  # noqa: E712 - sympy booleans
            return False
    return True
