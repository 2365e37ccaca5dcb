"""Snapshot and restore, op counts, and the changed regions drawn in the report."""

import torch
import torch.fx as fx

from kpt_compiler import graph_utils
from kpt_compiler.html_report import changed_regions, region_svg


def _gm():
    class M(torch.nn.Module):
        def forward(self, x, y):
            a = torch.relu(x) + y
            return torch.sigmoid(a) * 2

    return fx.symbolic_trace(M())


def test_restore_undoes_everything_and_keeps_names_and_graph_object():
    gm = _gm()
    graph_obj = gm.graph
    code_before = gm.code
    snap = graph_utils.snapshot(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.relu:
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(torch.tanh, (node.args[0],))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.register_buffer("extra", torch.ones(1))
    gm.recompile()
    assert gm.code != code_before
    graph_utils.restore(gm, snap)
    assert gm.graph is graph_obj
    assert gm.code == code_before
    assert not hasattr(gm, "extra")
    x, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(gm(x, y), torch.sigmoid(torch.relu(x) + y) * 2)


def test_op_counts():
    counts = graph_utils.op_counts(_gm().graph)
    assert counts == {"add": 1, "mul": 1, "relu": 1, "sigmoid": 1}


def test_changed_regions_find_the_rewrite_and_its_neighbours():
    gm = _gm()
    snap = graph_utils.snapshot(gm)
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    with gm.graph.inserting_after(relu):
        new = gm.graph.call_function(torch.tanh, (relu.args[0],))
    relu.replace_all_uses_with(new)
    gm.graph.erase_node(relu)
    [region] = changed_regions(snap.graph, gm.graph)
    before = {n["label"]: n["changed"] for n in region["before"]["nodes"]}
    after = {n["label"]: n["changed"] for n in region["after"]["nodes"]}
    assert before["relu"] is True and after["tanh"] is True
    # the add that consumed relu now consumes tanh: it changed too; x is unchanged context
    assert before["add"] is True and after["add"] is True
    assert before["x"] is False and before["sigmoid"] is False
    assert "mul" not in before  # two hops from any change: not drawn
    svg = region_svg(region["after"], "#d2f4d3", "after")
    assert svg.count("<rect") == len(region["after"]["nodes"]) and "tanh" in svg


def test_no_change_no_region():
    gm = _gm()
    snap = graph_utils.snapshot(gm)
    assert changed_regions(snap.graph, gm.graph) == []
