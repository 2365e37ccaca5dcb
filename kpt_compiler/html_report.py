"""index.html: the compile reports as one page, with a picture of each region a pass changed.

Pictures are inline SVG drawn here from ``PassRecord.regions`` (``changed_regions``, which the dump writer
calls for each pass that changed a graph: pictures cost nothing unless dumping): the nodes
of the region in layers by depth, the changed ones coloured (removed: red, before; added: green, after),
their direct neighbours grey. No Graphviz or plotting library is needed to read the report.
"""

from __future__ import annotations

import html
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from .graph_utils import target_name
from .report import GraphReport, PassRecord

__all__ = ["render_index", "region_svg", "changed_regions", "node_label"]

_STATUS_COLOUR = {
    "applied": "#1a7f37",
    "unchanged": "#57606a",
    "failed": "#cf222e",
    "skipped": "#9a6700",
    "disabled": "#8c959f",
    "backed_out": "#bc4c00",
}

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1f2328; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 32px; } h3 { font-size: 15px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
.status { font-weight: 600; }
.pics { display: flex; gap: 24px; flex-wrap: wrap; align-items: flex-start; }
.pic { border: 1px solid #d0d7de; padding: 6px; }
.pic h4 { margin: 0 0 4px; font-size: 13px; }
pre.diff { background: #f6f8fa; padding: 8px; overflow-x: auto; font-size: 12px; }
.add { color: #1a7f37; } .del { color: #cf222e; }
.muted { color: #57606a; }
"""


# ---------------------------------------------------------------------------------------------- regions


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


# ---------------------------------------------------------------------------------------------- drawing


def _status(status: str) -> str:
    return f'<span class="status" style="color:{_STATUS_COLOUR.get(status, "#000")}">{status}</span>'


def _ops_delta(p: PassRecord) -> str:
    keys = sorted(set(p.ops_before) | set(p.ops_after))
    parts = []
    for k in keys:
        d = p.ops_after.get(k, 0) - p.ops_before.get(k, 0)
        if d:
            parts.append(f"{k} {'+' if d > 0 else ''}{d}")
    return html.escape(", ".join(parts))


def _layers(nodes: list[dict[str, Any]], edges: list[list[str]]) -> dict[str, int]:
    """Depth of each node: one more than its deepest input (nodes come in topological order)."""
    preds: dict[str, list[str]] = {n["id"]: [] for n in nodes}
    for u, v in edges:
        preds[v].append(u)
    depth: dict[str, int] = {}
    for n in nodes:
        depth[n["id"]] = 1 + max((depth[p] for p in preds[n["id"]] if p in depth), default=-1)
    return depth


def region_svg(side: dict[str, Any], colour: str, title: str) -> str:
    """One side of a region as an SVG: boxes in layers top to bottom, arrows along data flow."""
    nodes, edges = side["nodes"], side["edges"]
    if not nodes:
        return f'<div class="pic"><h4>{html.escape(title)}</h4><span class="muted">(nothing)</span></div>'
    depth = _layers(nodes, edges)
    rows: dict[int, list[dict[str, Any]]] = {}
    for n in nodes:
        rows.setdefault(depth[n["id"]], []).append(n)
    char_w, box_h, gap_x, gap_y, pad = 6.6, 22, 14, 26, 8
    width = {n["id"]: max(40, len(n["label"]) * char_w + 12) for n in nodes}
    row_w = {d: sum(width[n["id"]] for n in ns) + gap_x * (len(ns) - 1) for d, ns in rows.items()}
    total_w = max(row_w.values()) + 2 * pad
    pos: dict[str, tuple[float, float]] = {}
    for d, ns in sorted(rows.items()):
        x = pad + (total_w - 2 * pad - row_w[d]) / 2
        for n in ns:
            pos[n["id"]] = (x, pad + d * (box_h + gap_y))
            x += width[n["id"]] + gap_x
    total_h = pad * 2 + (max(rows) + 1) * (box_h + gap_y) - gap_y
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0f}" height="{total_h:.0f}" '
        f'font-family="monospace" font-size="11">',
        '<defs><marker id="arr" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#57606a"/></marker></defs>',
    ]
    for u, v in edges:
        (x1, y1), (x2, y2) = pos[u], pos[v]
        out.append(
            f'<line x1="{x1 + width[u] / 2:.1f}" y1="{y1 + box_h:.1f}" x2="{x2 + width[v] / 2:.1f}" '
            f'y2="{y2:.1f}" stroke="#57606a" marker-end="url(#arr)"/>'
        )
    for n in nodes:
        x, y = pos[n["id"]]
        fill = colour if n["changed"] else "#f6f8fa"
        out.append(
            f'<g><title>{html.escape(n["id"])}</title><rect x="{x:.1f}" y="{y:.1f}" width="{width[n["id"]]:.1f}" '
            f'height="{box_h}" rx="4" fill="{fill}" stroke="#57606a"/>'
            f'<text x="{x + 6:.1f}" y="{y + 15:.1f}">{html.escape(n["label"])}</text></g>'
        )
    out.append("</svg>")
    more = f'<div class="muted">{side["truncated"]} more nodes not drawn</div>' if side.get("truncated") else ""
    return f'<div class="pic"><h4>{html.escape(title)}</h4>{"".join(out)}{more}</div>'


def _diff_html(diff: str) -> str:
    lines = []
    for line in diff.splitlines():
        esc = html.escape(line)
        if line.startswith("+") and not line.startswith("+++"):
            esc = f'<span class="add">{esc}</span>'
        elif line.startswith("-") and not line.startswith("---"):
            esc = f'<span class="del">{esc}</span>'
        lines.append(esc)
    return '<pre class="diff">' + "\n".join(lines) + "</pre>"


def _link(path: str | None, text: str) -> str:
    return f'<a href="{html.escape(path)}">{text}</a>' if path else ""


def _error_cell(p: PassRecord) -> str:
    """The lossy guard's figure: SQNR against the unmodified graph, its bound, and what was backed out."""
    if p.error_bound_db is None:
        return ""
    text = html.escape(p.error_text() or f"bound {p.error_bound_db:g} dB")
    if p.backed_out:
        text += "<br>backed out: " + html.escape(", ".join(f"{k} {v:.1f} dB" for k, v in p.backed_out.items()))
    return text


def _rewrite_errors(p: PassRecord) -> str:
    """A lossy pass's figure per rewrite (the layer's own SQNR), kept and backed out, worst first."""
    rows = [(v, k, "kept") for k, v in p.layer_db.items()] + [(v, k, "backed out") for k, v in p.backed_out.items()]
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.1f}</td><td>{status}</td></tr>" for v, k, status in sorted(rows))
    return (f"<details open><summary>{html.escape(p.name)}: SQNR per rewrite (bound {p.error_bound_db:g} dB)</summary>"
            f"<table><tr><th>rewrite</th><th>SQNR dB</th><th></th></tr>{body}</table></details>")


def _pass_row(p: PassRecord) -> str:
    detail = html.escape(p.reason or "")
    if p.notes:
        detail += "<br>" + "<br>".join(html.escape(n) for n in p.notes[:20])
        if len(p.notes) > 20:
            detail += f"<br>({len(p.notes) - 20} more)"
    files = " ".join(x for x in (_link(p.code_file, "code"), _link(p.diff_file, "diff")) if x)
    return (
        f"<tr><td>{html.escape(p.name)}</td><td>{_status(p.status)}</td><td>{p.matches}</td>"
        f"<td>{p.time_ms:.1f}</td><td>{_ops_delta(p)}</td><td>{_error_cell(p)}</td><td>{detail}</td><td>{files}</td></tr>"
    )


def _graph_section(r: GraphReport) -> str:
    out = [
        f'<h2 id="{html.escape(r.folder or str(r.index))}">{html.escape(r.folder or f"graph {r.index}")} '
        f'<span class="muted">compile id {html.escape(r.compile_id)}, {html.escape(r.codegen)} on '
        f'{html.escape(str(r.target.get("name")))}, {r.compile_ms:.0f} ms</span></h2>'
    ]
    for s in r.stages.values():
        kind = "inference" if s.is_inference else "training"
        link = _link(f"{s.folder}/00_input.py", "input graph") if s.folder else ""
        out.append(
            f"<h3>{html.escape(s.stage)} <span class='muted'>({kind}; {s.nodes_before} → {s.nodes_after} nodes, "
            f"{s.time_ms:.1f} ms) {link}</span></h3>"
        )
        if not s.passes:
            out.append('<p class="muted">no passes in this stage</p>')
            continue
        out.append(
            "<table><tr><th>pass</th><th>status</th><th>matches</th><th>ms</th><th>op counts</th>"
            "<th>error (SQNR)</th><th>reason / notes</th><th>files</th></tr>"
        )
        out += [_pass_row(p) for p in s.passes]
        out.append("</table>")
        for p in s.passes:
            if p.layer_db or p.backed_out:
                out.append(_rewrite_errors(p))
            if p.status != "applied":
                continue
            out.append(f"<h4>{html.escape(p.name)}: {len(p.regions)} changed region(s)</h4>")
            for i, region in enumerate(p.regions[:8]):
                out.append('<div class="pics">')
                out.append(region_svg(region["before"], "#ffd7d5", f"region {i + 1}: before"))
                out.append(region_svg(region["after"], "#d2f4d3", f"region {i + 1}: after"))
                out.append("</div>")
            if len(p.regions) > 8:
                out.append(f'<p class="muted">{len(p.regions) - 8} more regions (see the diff)</p>')
            if p.diff:
                out.append(f"<details><summary>diff</summary>{_diff_html(p.diff)}</details>")
    return "\n".join(out)


def render_index(graphs: list[GraphReport]) -> str:
    rows = []
    for r in graphs:
        fired = ", ".join(r.fired()) or "none"
        failed = [f"{p.name} ({p.stage})" for p in r.passes() if p.status == "failed"]
        stages = ", ".join(r.stages)
        rows.append(
            f'<tr><td><a href="#{html.escape(r.folder or str(r.index))}">{html.escape(r.folder or str(r.index))}</a></td>'
            f"<td>{html.escape(r.compile_id)}</td><td>{html.escape(r.codegen)}</td>"
            f"<td>{html.escape(str(r.target.get('name')))}</td><td>{html.escape(stages)}</td>"
            f"<td>{html.escape(fired)}</td><td>{html.escape(', '.join(failed)) or '-'}</td></tr>"
        )
    body = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kernelpytorch report</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>kernelpytorch: what the compiler did</h1><p class='muted'>torch {html.escape(torch.__version__)}, "
        f"{len(graphs)} compiled graph(s). Raw data: <a href='summary.json'>summary.json</a>.</p>",
        "<table><tr><th>graph</th><th>compile id</th><th>codegen</th><th>target</th><th>stages</th>"
        "<th>passes that fired</th><th>failed</th></tr>",
        *rows,
        "</table>",
        *(_graph_section(r) for r in graphs),
        "</body></html>",
    ]
    return "\n".join(body)
