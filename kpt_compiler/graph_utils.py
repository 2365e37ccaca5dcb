"""Small FX helpers the pass manager needs: snapshot and in-place restore, op counts, readable code,
and the region of a graph that a pass changed (for the report's pictures)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
from typing import Any, Callable

import networkx as nx
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
    "changed_regions",
    "node_label",
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


def snapshot(gm: fx.GraphModule) -> GraphSnapshot:
    """A copy of the graph (nodes and their meta, shallowly) and of the module's attribute tables."""
    attrs = {k: dict(getattr(gm, k)) for k in _MODULE_DICTS}
    attrs["__dict__"] = {k: v for k, v in gm.__dict__.items() if k not in _MODULE_DICTS}
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    _copy_nodes(gm.graph, graph)
    return GraphSnapshot(graph, attrs, _extras(gm.graph))


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
            if node.op == "call_method" and str(node.target).endswith("_") or not only(node):
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


def node_label(node: fx.Node) -> str:
    val = node.meta.get("val", node.meta.get("example_value"))
    shape = ""
    if isinstance(val, torch.Tensor):
        dims = ",".join(str(s) for s in val.shape)
        shape = f" {str(val.dtype).replace('torch.', '')}[{dims}]"
    if node.op == "placeholder":
        return f"{node.name}{shape}"
    if node.op == "output":
        return "output"
    return f"{target_name(node)}{shape}"


def _signature(node: fx.Node) -> tuple:
    """What makes a node the same node across two versions of a graph: its name, op, target and inputs."""
    args = tuple(a.name if isinstance(a, fx.Node) else repr(a) for a in node.all_input_nodes)
    return (node.name, node.op, target_name(node), args)


def _as_digraph(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n.name, label=node_label(n), sig=_signature(n))
        for a in n.all_input_nodes:
            g.add_edge(a.name, n.name)
    return g


def changed_regions(before: fx.Graph, after: fx.Graph, max_nodes: int = 40) -> list[dict[str, Any]]:
    """The parts of the graph a pass changed, each as a before/after pair of small subgraphs.

    A node is changed when no node of the other graph has its name, op, target and inputs. A region is
    a connected group of changed nodes with their direct neighbours; each side is a dict
    ``{"nodes": [{"id", "label", "changed"}], "edges": [[src, dst]]}`` ready to draw.
    """
    gb, ga = _as_digraph(before), _as_digraph(after)
    sig_b = {d["sig"] for _, d in gb.nodes(data=True)}
    sig_a = {d["sig"] for _, d in ga.nodes(data=True)}
    removed = {n for n, d in gb.nodes(data=True) if d["sig"] not in sig_a}
    added = {n for n, d in ga.nodes(data=True) if d["sig"] not in sig_b}
    if not removed and not added:
        return []
    # Group changes: nodes linked in either graph, or sharing a name across the two, belong together.
    link = nx.Graph()
    link.add_nodes_from(("b", n) for n in removed)
    link.add_nodes_from(("a", n) for n in added)
    for side, g, changed in (("b", gb, removed), ("a", ga, added)):
        for u, v in g.edges():
            if u in changed and v in changed:
                link.add_edge((side, u), (side, v))
        # two changed nodes with a common unchanged neighbour are one rewrite
        for n in g.nodes:
            near = [m for m in list(g.predecessors(n)) + list(g.successors(n)) if m in changed]
            for x, y in zip(near, near[1:]):
                link.add_edge((side, x), (side, y))
    for n in removed & added:
        link.add_edge(("b", n), ("a", n))
    regions = []
    for comp in nx.connected_components(link):
        rb = {n for s, n in comp if s == "b"}
        ra = {n for s, n in comp if s == "a"}
        regions.append({"before": _side(gb, rb, max_nodes), "after": _side(ga, ra, max_nodes)})
    regions.sort(key=lambda r: -(len(r["before"]["nodes"]) + len(r["after"]["nodes"])))
    return regions


def _side(g: nx.DiGraph, changed: set[str], max_nodes: int) -> dict[str, Any]:
    keep = set(changed)
    for n in changed:
        keep.update(g.predecessors(n))
        keep.update(g.successors(n))
    order = [n for n in nx.topological_sort(g) if n in keep]
    if len(order) > max_nodes:  # keep every changed node, drop context first
        context = [n for n in order if n not in changed]
        drop = set(context[: len(order) - max_nodes])
        order = [n for n in order if n not in drop]
    kept = set(order)
    return {
        "nodes": [{"id": n, "label": g.nodes[n]["label"], "changed": n in changed} for n in order],
        "edges": [[u, v] for u, v in g.edges() if u in kept and v in kept],
        "truncated": len(keep) - len(kept),
    }
