"""Dumps: files per graph and stage, diffs that match what a pass did, runnable code, summary and report."""

import json
import subprocess
import sys

import pytest
import torch

import kpt_compiler
from kpt_compiler import dump as dump_mod

from models import make


@pytest.fixture(autouse=True)
def _new_process_view_of_dump_dirs():
    dump_mod._WRITERS.clear()


def _compile_with_dump(tmp_path, options, train=False):
    model, x = make("mlp")
    compiled = torch.compile(model, backend="kernelpytorch",
                             options={"codegen": "eager", "dump_dir": str(tmp_path), **options})
    out = compiled(x)
    if train:
        out.sum().backward()
    return kpt_compiler.last_report()


def test_layout_and_summary(tmp_path):
    report = _compile_with_dump(tmp_path, {"test_relu_to_clamp": True, "test_raise": True}, train=True)
    g = tmp_path / "graph_000"
    for stage in ("pre_aot", "joint", "forward", "backward"):
        assert (g / stage / "00_input.py").is_file(), stage
        assert (g / stage / "passes.json").is_file(), stage
    assert (g / "joint" / "01_test-relu-to-clamp.py").is_file()
    assert (g / "joint" / "01_test-relu-to-clamp.diff").is_file()
    assert not list((g / "forward").glob("01_*")), "a failed pass leaves no 'after' file"
    options = json.loads((g / "options.json").read_text())
    assert options["options"]["test_relu_to_clamp"] is True

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["torch"] == torch.__version__
    [graph] = summary["graphs"]
    passes = {(p["stage"], p["name"]): p for s in graph["stages"].values() for p in s["passes"]}
    clamp = passes[("joint", "test-relu-to-clamp")]
    assert clamp["status"] == "applied" and clamp["matches"] == 2 and clamp["time_ms"] >= 0
    failed = passes[("forward", "test-raise")]
    assert failed["status"] == "failed" and "failing on purpose" in failed["reason"]
    assert passes[("joint", "test-skip")]["status"] == "disabled"
    assert graph == report.to_dict()


def test_diff_is_exactly_the_change_the_pass_made(tmp_path):
    _compile_with_dump(tmp_path, {"test_relu_to_clamp": True})
    diff = (tmp_path / "graph_000" / "joint" / "01_test-relu-to-clamp.diff").read_text()
    removed = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    # two relus became two clamp_mins; the only other changed lines are their users' arguments
    assert sum("aten.relu.default" in line for line in removed) == 2
    assert sum("aten.clamp_min.default" in line for line in added) == 2
    assert not any("aten.relu" in line for line in added)
    assert len(removed) == len(added)
    for line in removed:
        assert "relu" in line, line
    stage = json.loads((tmp_path / "graph_000" / "joint" / "passes.json").read_text())
    rec = next(p for p in stage["passes"] if p["name"] == "test-relu-to-clamp")
    assert rec["ops_before"]["relu"] == 2 and rec["ops_after"]["clamp_min"] == 2
    assert "relu" not in rec["ops_after"]


def test_dumped_code_runs(tmp_path):
    _compile_with_dump(tmp_path, {"test_relu_to_clamp": True}, train=True)
    for path in ("joint/01_test-relu-to-clamp.py", "pre_aot/00_input.py", "backward/00_input.py"):
        proc = subprocess.run([sys.executable, path], cwd=tmp_path / "graph_000", capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "output 0:" in proc.stdout
    text = (tmp_path / "graph_000" / "joint" / "01_test-relu-to-clamp.py").read_text()
    assert text.startswith("# kernelpytorch dump | graph_000")
    assert "stage joint | after pass 'test-relu-to-clamp'" in text


def test_dumped_code_runs_after_passes_that_call_our_functions(tmp_path):
    """merge-parallel-linears emits its own merged_linear and fuse-add-norm a kernel's Python function: the
    dumped graph imports them (it failed with a NameError where it named them as the graph's globals)."""
    def block(x, wq, wk, r, w, b):
        q, k = torch.nn.functional.linear(x, wq), torch.nn.functional.linear(x, wk)
        return torch.nn.functional.layer_norm(q + r, (8,), w, b) + k

    args = [torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)]
    options = {"codegen": "eager", "dump_dir": str(tmp_path), "fusion": {"decide": "always", "epilogue": False}}
    torch.compile(block, backend="kernelpytorch", options=options)(*args)
    fired = kpt_compiler.last_report().fired()
    assert "merge-parallel-linears" in fired and "fuse-add-norm" in fired, fired
    for path in sorted((tmp_path / "graph_000" / "pre_aot").glob("0[1-9]_*.py")):
        proc = subprocess.run([sys.executable, path.name], cwd=path.parent, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and "output 0:" in proc.stdout, (path.name, proc.stderr[-2000:])


def test_index_html_shows_passes_and_pictures(tmp_path):
    _compile_with_dump(tmp_path, {"test_relu_to_clamp": True, "test_raise": True})
    page = (tmp_path / "index.html").read_text()
    assert "test-relu-to-clamp" in page and "test-raise" in page
    assert "failing on purpose" in page
    # one picture before and one after for each changed region
    assert page.count("<svg") >= 2 and "region 1: before" in page and "region 1: after" in page
    assert "clamp_min" in page and 'href="graph_000/joint/01_test-relu-to-clamp.diff"' in page


def test_environment_variable_sets_the_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KPT_DUMP_DIR", str(tmp_path / "from_env"))
    model, x = make("mlp")
    torch.compile(model, backend="kernelpytorch", options={"codegen": "eager"})(x)
    assert (tmp_path / "from_env" / "summary.json").is_file()


def test_a_new_process_replaces_an_old_dump_but_nothing_else(tmp_path):
    _compile_with_dump(tmp_path, {})
    torch._dynamo.reset()
    _compile_with_dump(tmp_path, {})  # same process: numbering goes on
    assert (tmp_path / "graph_001").is_dir()
    (tmp_path / "notes.txt").write_text("mine")
    dump_mod._WRITERS.clear()  # as a new process would start
    torch._dynamo.reset()
    _compile_with_dump(tmp_path, {})
    assert (tmp_path / "graph_000").is_dir() and not (tmp_path / "graph_001").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert len(json.loads((tmp_path / "summary.json").read_text())["graphs"]) == 1


def _compile_into(path):
    return torch.compile(lambda x: x + 1, backend="kernelpytorch",
                         options={"codegen": "eager", "dump_dir": str(path)})(torch.ones(2))


def test_a_dump_dir_that_is_a_file_or_cannot_be_made_is_named(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with pytest.raises(kpt_compiler.OptionError, match=rf"dump_dir '{afile}' \(options\['dump_dir'\], or the "
                                                       r"KPT_DUMP_DIR .*\) is a file, not a folder"):
        _compile_into(afile)
    with pytest.raises(kpt_compiler.OptionError, match=rf"dump_dir '{afile}/sub' .* cannot be written"):
        _compile_into(afile / "sub")
    assert kpt_compiler.reports() == []  # a refused compile leaves no empty report behind


def test_a_folder_with_files_that_are_not_ours_is_refused_and_left_alone(tmp_path):
    (tmp_path / "summary.json").write_text('{"mine": true}')
    with pytest.raises(kpt_compiler.OptionError, match=r"already holds files kernelpytorch did not write "
                                                       r"\(summary.json\)"):
        _compile_into(tmp_path)
    assert (tmp_path / "summary.json").read_text() == '{"mine": true}'
    assert kpt_compiler.reports() == []


def test_the_after_file_and_the_after_picture_show_the_graph_after_the_pass(tmp_path):
    """01_<pass>.py is the graph after the pass, 00_input.py the one before; in index.html the region's "after"
    picture draws the new op (changed) and the "before" picture the old one."""
    import re

    _compile_with_dump(tmp_path, {"test_relu_to_clamp": True})
    stage = tmp_path / "graph_000" / "joint"
    before, after = (stage / "00_input.py").read_text(), (stage / "01_test-relu-to-clamp.py").read_text()
    assert "aten.relu.default" in before and "aten.clamp_min.default" not in before
    assert "aten.clamp_min.default" in after and "aten.relu.default" not in after
    page = (tmp_path / "index.html").read_text()
    pictures = re.findall(r'<div class="pic"><h4>region 1: (before|after)</h4>(.*?)</div>', page, re.S)
    drawn = {side: re.findall(r'fill="([^"]+)" stroke="#57606a"/><text[^>]*>([^<]+)</text>', svg)
             for side, svg in pictures}
    changed = {side: {label.split()[0] for fill, label in boxes if fill != "#f6f8fa"} for side, boxes in drawn.items()}
    assert "relu" in changed["before"] and "clamp_min" not in changed["before"], changed
    assert "clamp_min" in changed["after"] and "relu" not in changed["after"], changed


def test_a_size_known_only_at_run_time_is_said_where_the_dump_guesses_it():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    u = shape_env.create_unbacked_symint()
    with torch._subclasses.FakeTensorMode(shape_env=shape_env):
        fake = torch.empty(u, 3)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"] = fake
    unbacked: list[str] = []
    text = dump_mod.runnable_source(gm, "# header\n", unbacked=unbacked)
    assert unbacked == ["x"] and "# sizes known only at run time (x) are given 2 in the random inputs" in text
