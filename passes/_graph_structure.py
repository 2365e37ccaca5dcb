"""Two Dynamo graphs of one frame compared as programs (passes/_bucket_frames.py): each graph node for node, its
sizes as values (ints, or sympy expressions of its own symbols), so that one graph's sizes can be substituted
by the other's and the two compared (issue 17: batch 1 served by the frame's dynamic graph)."""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols


def _source(node: fx.Node) -> str | None:
    src = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(src, "name", None)
    return name() if callable(name) else name


_SYM = (torch.SymInt, torch.SymBool, torch.SymFloat)


@dataclasses.dataclass(frozen=True)
class _Size:  # a dynamic size in a structure (tags of their own: no keyword or constant can look like one)
    expr: Any


@dataclasses.dataclass(frozen=True)
class _Input:
    source: str | None


@dataclasses.dataclass(frozen=True)
class _Node:
    index: int


@dataclasses.dataclass(frozen=True)
class _View:  # a view op with its input's and its output's sizes: the identity, left out, where they are equal
    entry: tuple
    sizes: tuple


# ops whose output is their first argument's values under another shape: equal shapes, the same tensor's values
# (transformers' Llama expands its positions to the batch except at batch 1, where Dynamo's graph has no expand)
_VIEWS = {("call_method", "expand"), ("call_method", "view"), ("call_method", "reshape"),
          ("call_function", torch.reshape)}


def _structure(gm: fx.GraphModule) -> list | None:
    """The graph node for node, sizes as values: ``_Size(expr)`` for a dynamic size (a SymInt node or argument),
    the int itself in a static graph; inputs by their source, other nodes by their place. Two graphs of one frame
    are the same program at some sizes when their structures are equal with the dynamic one's sizes evaluated
    there. None: a node this comparison does not cover (a SymBool or SymFloat, a submodule, an attribute)."""
    where: dict[fx.Node, Any] = {}
    out: list = []

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return where[a]
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        if isinstance(a, torch.Tensor):
            return ("tensor", id(a))  # the same object or not the same program
        return a

    for node in gm.graph.nodes:
        v = node.meta.get("example_value")
        if isinstance(v, _SYM):
            if not isinstance(v, torch.SymInt) or free_unbacked_symbols(v):  # .item(), nonzero: no size gives it
                return None
            where[node] = _Size(v.node.expr)
            continue
        if node.op == "placeholder":
            where[node] = _Input(_source(node))
        elif node.op in ("call_module", "get_attr"):
            return None
        else:
            where[node] = _Node(len(out))
        if node.op != "placeholder" and type(v) is int and node.op != "output":
            where[node] = v  # a size a static graph computed
            continue
        if node.op == "call_function" and node.target is torch.Size and len(node.args) == 1 and not node.kwargs:
            where[node] = arg(tuple(node.args[0]))  # sizes made a torch.Size (GPT-2's Conv1D): a static graph
            continue  # passes the tuple itself
        if node.op != "placeholder":
            entry = (node.op, node.target, arg(node.args), arg(node.kwargs))
            first = node.args[0] if node.args else None
            if (node.op, node.target) in _VIEWS and isinstance(first, fx.Node) and isinstance(v, torch.Tensor) \
                    and isinstance(first.meta.get("example_value"), torch.Tensor):
                entry = _View(entry, (_sizes(first.meta["example_value"]), _sizes(v)))
            out.append(entry)
    return out


def _sizes(t: torch.Tensor) -> tuple:
    return tuple(_Size(s.node.expr) if isinstance(s, torch.SymInt) else int(s) for s in t.shape)


def _program(structure: list) -> list:
    """``structure`` (evaluated at the sizes compared) without the views that are identities there: a reference
    to one becomes a reference to its input, and the nodes after it are renumbered."""
    out: list = []
    at: dict[int, Any] = {}  # old index -> what refers to it now

    def ref(a: Any) -> Any:
        if isinstance(a, _Node):
            return at[a.index]
        return tuple(ref(x) for x in a) if isinstance(a, tuple) else a

    for i, entry in enumerate(structure):
        if isinstance(entry, _View):
            if entry.sizes[0] == entry.sizes[1]:
                at[i] = ref(entry.entry[2][1][0])  # args: ("tuple", (first, ...))
                continue
            entry = entry.entry
        at[i] = _Node(len(out))
        out.append(ref(entry))
    return out


def _evaluated(a: Any, values: dict) -> Any:
    """``a`` with the dynamic graph's sizes replaced: by ints (a static graph's), or by the other graph's own
    expressions (a graph dynamic in fewer dims: batch 1 with the sequence dynamic), compared as sympy keeps them."""
    if isinstance(a, _Size):
        r = a.expr.xreplace(values)
        return int(r) if r.is_number else _Size(r)
    if isinstance(a, _View):
        return _View(_evaluated(a.entry, values), _evaluated(a.sizes, values))
    if isinstance(a, tuple):
        return tuple(_evaluated(x, values) for x in a)
    if isinstance(a, list):
        return [_evaluated(x, values) for x in a]
    return a


def _fake(node: fx.Node) -> Any:
    """A placeholder as the comparison needs it: a size's expression, a tensor's (sizes, dtype, device), else
    None (sizes: ints, or sympy expressions where dynamic)."""
    v = node.meta.get("example_value")
    if isinstance(v, torch.SymInt):
        return v.node.expr
    if isinstance(v, torch.Tensor):
        return (tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in v.shape), v.dtype, v.device)
    return None


def _sympified(values: dict) -> dict:
    return {s: sympy.Integer(v) if isinstance(v, int) else v for s, v in values.items()}
