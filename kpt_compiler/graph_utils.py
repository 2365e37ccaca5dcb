"""Small FX helpers the pass manager needs: snapshot and in-place restore, op counts, readable code and
diffs, and inputs of a graph's recorded shapes (to run it: the lossy guard, dumped graphs). The pictures of
what a pass changed are drawn by html_report, and only when dumping."""

from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = [
    "GraphSnapshot",
    "snapshot",
    "restore",
    "drop_unused",
    "op_counts",
    "readable_code",
    "unified_diff",
    "target_name",
    "input_spec",
    "make_input",
    "random_inputs",
]


@dataclasses.dataclass
class GraphSnapshot:
    graph: fx.Graph
    attrs: dict[str, Any]
    node_extras: dict[str, dict[str, Any]]  # attributes others set on nodes (Dynamo's _dynamo_source), by name


def _standard_node_fields() -> frozenset[str]:
    g = fx.Graph()
    return frozenset(g.placeholder("x").__dict__)


_NODE_FIELDS = _standard_node_fields()


def _extras(graph: fx.Graph) -> dict[str, dict[str, Any]]:
    out = {}
    for n in graph.nodes:
        extra = {k: v for k, v in n.__dict__.items() if k not in _NODE_FIELDS}
        if extra:
            out[n.name] = extra
    return out


_MODULE_DICTS = ("_modules", "_parameters", "_buffers")


def snapshot(gm: fx.GraphModule, graph: fx.Graph | None = None) -> GraphSnapshot:
    """A copy of the graph (nodes and their meta, shallowly) and of the module's attribute tables. ``graph``: a
    ``copy_graph`` of ``gm.graph`` as it is now, already made (kept, not copied again)."""
    attrs = {k: dict(getattr(gm, k)) for k in _MODULE_DICTS}
    attrs["__dict__"] = {k: v for k, v in gm.__dict__.items() if k not in _MODULE_DICTS}
    return GraphSnapshot(graph if graph is not None else copy_graph(gm.graph), attrs, _extras(gm.graph))


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (nodes and their meta, shallowly), as ``snapshot`` makes."""
    copy_ = fx.Graph(tracer_cls=graph._tracer_cls)
    _copy_nodes(graph, copy_)
    return copy_


def _copy_nodes(src: fx.Graph, dst: fx.Graph) -> None:
    """Copy every node of ``src`` (meta shallowly, output included) to the end of the empty ``dst``."""
    old_output = next(n for n in reversed(src.nodes) if n.op == "output")
    out = dst.graph_copy(src, {})
    new_output = dst.output(out, type_expr=old_output.type)
    new_output.meta = copy.copy(old_output.meta)
    dst._codegen = src._codegen  # passes never change how a graph is called


def restore(gm: fx.GraphModule, snap: GraphSnapshot) -> None:
    """Put ``gm`` back as it was at ``snap``, keeping the same Graph object.

    The Graph object is kept because Inductor's post-grad code holds on to it across our hook
    (its FakeTensorUpdater is built before the custom pass and updated after it).
    """
    graph = gm.graph
    for node in graph.nodes:  # a failed pass may have left a use before its definition: unlink first
        node.args, node.kwargs = (), {}
    for node in reversed(list(graph.nodes)):
        graph.erase_node(node)
    # A fresh namespace, so the restored nodes get their names back (dumps and diffs read better).
    graph._graph_namespace = type(graph._graph_namespace)()
    _copy_nodes(snap.graph, graph)
    for n in graph.nodes:
        for k, v in snap.node_extras.get(n.name, {}).items():
            setattr(n, k, v)
    for k in _MODULE_DICTS:
        table = getattr(gm, k)
        table.clear()
        table.update(snap.attrs[k])
    for k in list(gm.__dict__):
        if k not in _MODULE_DICTS and k not in snap.attrs["__dict__"]:
            del gm.__dict__[k]
    gm.__dict__.update(snap.attrs["__dict__"])
    gm.recompile()


def attr_of(gm: fx.GraphModule, target: str) -> Any:
    """What a get_attr node with this dotted ``target`` reads from ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def drop_unused(graph: fx.Graph, only: Callable[[fx.Node], bool] = lambda n: True) -> None:
    """Erase computations nothing uses (and ``only`` accepts), repeatedly; never anything impure or in-place,
    never placeholders, get_attr or output nodes."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.users or node.op not in ("call_function", "call_method") or node.is_impure():
                continue
            if written(node) or not only(node):  # fx does not see torch._foreach_add_ and the like as impure
                continue
            graph.erase_node(node)
            changed = True


def target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_function":
        if isinstance(t, torch._ops.OpOverload):
            return f"{t._schema.name.split('::')[-1]}.{t._overloadname}" if t._overloadname != "default" else t._schema.name.split("::")[-1]
        if isinstance(t, torch._ops.OpOverloadPacket):
            return t._qualified_op_name.split("::")[-1]
        if isinstance(t, torch._ops.HigherOrderOperator):
            return t.name()
        return getattr(t, "__name__", str(t))
    if node.op == "call_method":
        return f".{t}"
    if node.op == "call_module":
        return f"module:{t}"
    return str(t)


def op_counts(graph: fx.Graph) -> dict[str, int]:
    """How many times each operator is called (placeholders, get_attr and output left out)."""
    counts = collections.Counter(
        target_name(n) for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")
    )
    return dict(sorted(counts.items()))


def readable_code(gm: fx.GraphModule, graph: fx.Graph | None = None) -> str:
    """The graph as Python code with shapes and dtypes (``print_readable``), taking its inputs flat.

    Joint graphs take ``(primals, tangents)`` lists through a pytree code generator; printing them with the
    plain one makes every input a named argument, which reads better and runs with flat inputs.
    """
    graph = gm.graph if graph is None else graph
    if type(graph._codegen) is not fx.graph.CodeGen:
        flat = fx.Graph(tracer_cls=graph._tracer_cls)
        _copy_nodes(graph, flat)
        flat._codegen = fx.graph.CodeGen()
        graph = flat
    if graph is not gm.graph:
        gm = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    return gm.print_readable(print_output=False, include_stride=False, include_device=True, colored=False)


def _code_lines(code: str) -> list[str]:
    """Code lines without comment-only and blank lines: source locations ("# File: ...") sit above groups
    of nodes, and a new node without one would otherwise show up as a change to its neighbours."""
    return [line + "\n" for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def unified_diff(before: str, after: str, name_before: str, name_after: str) -> str:
    """What changed in the graph's code, comments aside."""
    return "".join(difflib.unified_diff(_code_lines(before), _code_lines(after), name_before, name_after, n=2))


# ---------------------------------------------------------------------------------------------- inputs


def _hint(s: Any, unbacked: int | None) -> int:
    if isinstance(s, int):
        return s
    try:
        return int(s.node.hint)
    except Exception:  # noqa: BLE001 - an unbacked size has no hint
        if unbacked is not None:
            return unbacked
        raise ValueError(f"the size {s} is unbacked (data-dependent): no input of its shape can be made") from None


def input_spec(value: Any, unbacked: int | None = None) -> tuple:
    """What ``make_input`` needs to make a value like ``value`` (a tensor's shape, dtype and device; a number
    as it is; sizes at their hints, an unbacked size as ``unbacked``, or ValueError). Plain data, so a dumped
    graph can carry it."""
    if isinstance(value, torch.Tensor):
        shape = [_hint(s, unbacked) for s in value.shape]
        return ("tensor", shape, str(value.dtype).replace("torch.", ""), str(value.device))
    if isinstance(value, torch.SymInt):
        return ("value", _hint(value, unbacked))
    if isinstance(value, (int, float, bool)) or value is None:
        return ("value", value)
    return ("value", None)


def make_input(spec: tuple, generator: torch.Generator | None = None) -> Any:
    """A random input for ``spec`` (``input_spec``): floats from a normal distribution, booleans True,
    integers zero (indices and lengths stay in range); CUDA tensors on the CPU where there is no GPU."""
    if spec[0] != "tensor":
        return spec[1]
    _, shape, dtype, dev = spec
    dev = dev if (not dev.startswith("cuda") or torch.cuda.is_available()) else "cpu"
    dtype = getattr(torch, dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator).to(device=dev, dtype=dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=dev)
    return torch.zeros(shape, dtype=dtype, device=dev)


def random_inputs(gm: fx.GraphModule, seed: int = 0) -> list[Any]:
    """Inputs for every placeholder of ``gm``, made from the values its meta records (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    specs = [input_spec(n.meta.get("val", n.meta.get("example_value"))) for n in gm.graph.nodes if n.op == "placeholder"]
    return [make_input(s, generator) for s in specs]


def has_dynamic_sizes(gm: fx.GraphModule) -> bool:
    """Whether any input of a Dynamo graph has a symbolic size (or is a symbolic int)."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if symbolic_sizes(node.meta.get("example_value", node.meta.get("val"))):
            return True
    return False


def symbolic_sizes(value: Any) -> bool:
    """Whether a fake value is a symbolic int or a tensor with a symbolic size."""
    return isinstance(value, torch.SymInt) or isinstance(value, torch.Tensor) and any(
        isinstance(s, torch.SymInt) for s in value.shape)


def outputs_aliasing_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of a Dynamo graph's outputs that are its inputs or views of them (by their fake values'
    storages)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(v):
        try:
            return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None
        except Exception:  # noqa: BLE001 - no storage (a symbolic size): no alias
            return None

    def value(n):
        return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else n

    inputs = {storage(value(n)) for n in gm.graph.nodes if n.op == "placeholder"} - {None}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    return frozenset(i for i, o in enumerate(flat) if storage(value(o)) in inputs)


def meta_attrs(gm: fx.GraphModule, *graphs: fx.Graph) -> dict[str, Any]:
    """What the graphs' ``get_attr`` and ``call_module`` nodes read from ``gm``, tensors as meta stand-ins: a diff
    printed later needs their names and shapes only, and the report must not keep weights (or ``gm``) alive."""
    out: dict[str, Any] = {}
    for graph in graphs:
        for node in graph.nodes:
            if node.op not in ("get_attr", "call_module") or node.target in out:
                continue
            try:
                value = attr_of(gm, node.target)
            except AttributeError:
                continue  # gone by now: that graph's diff says it cannot be made
            if isinstance(value, torch.Tensor):
                try:
                    value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
                except Exception:  # noqa: BLE001 - a tensor subclass without strides: its name is what prints
                    value = torch.empty(0, device="meta")
            out[node.target] = value
    return out


def diff_of_graphs(class_name: str, attrs: dict[str, Any], before: fx.Graph, after: fx.Graph,
                    names: tuple[str, str]) -> str:
    """A pass's diff, from copies of the graph before and after it and what their attributes were then."""
    try:
        codes = [readable_code(fx.GraphModule(attrs, g, class_name=class_name)) for g in (before, after)]
        return unified_diff(*codes, *names)
    except Exception as e:  # noqa: BLE001 - the report still prints
        return f"(the diff could not be made after the compile: {type(e).__name__}: {e}; set dump_dir to keep it)"


_INPLACE = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.iand, operator.ior,
            operator.ixor, operator.ilshift, operator.irshift, operator.itruediv, operator.ifloordiv, operator.imod}


def _nodes(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)  # every node inside lists, tuples and dicts too
    return found


def written(n: fx.Node) -> list[fx.Node]:
    """The nodes ``n`` writes into: in-place methods and functions, ``setitem``, ``out=``, ATen overloads whose
    schema writes an argument, foreach lists (conservatively: an op that may write writes its first argument and
    ``out=``)."""
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        out = []
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                out += _nodes(n.args[i] if i < len(n.args) else n.kwargs.get(arg.name))
        return out
    if isinstance(target, torch._ops.OpOverloadPacket):
        writes = any(getattr(target, o)._schema.is_mutable for o in target.overloads())
    else:
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        # a trailing underscore means in place, except in operator's names (and_, or_: not in place)
        trailing = name.endswith("_") and not name.endswith("__") and \
            getattr(target, "__module__", None) not in ("_operator", "operator")
        first = target in _INPLACE or trailing and name != "requires_grad_"  # that one sets a flag
        return (_nodes(n.args[:1]) if first else []) + _nodes(n.kwargs.get("out"))
    return _nodes(n.args[:1]) + _nodes(n.kwargs.get("out")) if writes else []
