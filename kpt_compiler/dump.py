"""Dumps: every compiled graph as readable, runnable code before the pipeline and after each pass that
changed it, with diffs, op counts, timings and statuses; ``summary.json`` and ``index.html`` over them all.

Layout under ``dump_dir`` (set by options["dump_dir"] or the KPT_DUMP_DIR environment variable)::

    summary.json                  per compiled graph: each pass that ran (name, stage, status, matches, time)
    index.html                    the same in a browser, with pictures of the regions each pass changed
    graph_000/                    one folder per graph Dynamo handed the backend, numbered in compile order
        options.json              the validated options and the pipeline
        pre_aot/ joint/ forward/ backward/ (wrap/, where the pipeline has passes that wrap the compiled callable)
            00_input.py           the graph as this stage received it (python 00_input.py runs it)
            01_<pass>.py          the graph after each pass that changed it
            01_<pass>.diff        what that pass changed (unified diff of the two files above)
            passes.json           every pass of the stage: status, matches, time, op counts before/after

A dump folder holds one process's compiles: the first compile that writes to it removes what an earlier
process left there (only the files and folders named above). A folder that holds files kernelpytorch did not
write (no ``.kernelpytorch-dump`` marker) is refused rather than written into: a ``summary.json`` there is not
ours to replace. A ``dump_dir`` that is a file, or cannot be created or written, is an ``OptionError`` that
names it, before anything is compiled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from typing import Any

import torch
import torch.fx as fx

from . import graph_utils
from .errors import OptionError
from .report import GraphReport, PassRecord, StageRecord

__all__ = ["DumpWriter", "runnable_source"]

_MARKER = ".kernelpytorch-dump"
_lock = threading.Lock()
_WRITERS: dict[str, "DumpWriter"] = {}


class DumpWriter:
    @classmethod
    def for_dir(cls, path: str) -> "DumpWriter":
        root = os.path.abspath(path)
        with _lock:
            if root not in _WRITERS:
                _WRITERS[root] = cls(root)
            return _WRITERS[root]

    def __init__(self, root: str):
        self.root = root
        self.graphs: list[GraphReport] = []
        where = (f"dump_dir {root!r} (options['dump_dir'], or the KPT_DUMP_DIR environment variable where the "
                 "options do not set it)")
        if os.path.exists(root) and not os.path.isdir(root):
            raise OptionError(f"{where} is a file, not a folder: give a folder to write the dump into")
        try:
            os.makedirs(root, exist_ok=True)
            if not os.access(root, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise OptionError(f"{where} cannot be written: {e.strerror or e}; give a folder this process can "
                              "create and write") from e
        foreign = [n for n in os.listdir(root) if not n.startswith(".")]  # .gitkeep and the like are no data
        if foreign and not os.path.exists(os.path.join(root, _MARKER)):
            raise OptionError(f"{where} already holds files kernelpytorch did not write ({', '.join(sorted(foreign)[:5])}"
                              f"{', ...' if len(foreign) > 5 else ''}); give an empty or new folder, or one an "
                              "earlier dump made")
        if os.path.exists(os.path.join(root, _MARKER)):
            for name in os.listdir(root):
                if re.fullmatch(r"graph_\d{3,}", name):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            for name in ("summary.json", "index.html"):
                if os.path.exists(os.path.join(root, name)):
                    os.remove(os.path.join(root, name))
        with open(os.path.join(root, _MARKER), "w") as f:
            f.write("written by kernelpytorch; the graph_* folders, summary.json and index.html are replaced by the next run\n")

    # ------------------------------------------------------------------ graph
    def begin_graph(self, report: GraphReport, pipeline_text: str) -> None:
        report.folder = f"graph_{len(self.graphs):03d}"
        self.graphs.append(report)
        os.makedirs(self._path(report.folder), exist_ok=True)
        _write_json(self._path(report.folder, "options.json"), {
            "compile_id": report.compile_id,
            "codegen": report.codegen,
            "target": report.target,
            "options": report.options,
            "pipeline": pipeline_text.splitlines(),
        })

    def end_graph(self, report: GraphReport) -> None:
        self.refresh()

    # ------------------------------------------------------------------ stage
    def begin_stage(self, report: GraphReport, stage: StageRecord, gm: fx.GraphModule, code: str) -> None:
        stage.folder = f"{report.folder}/{stage.stage}"
        os.makedirs(self._path(stage.folder), exist_ok=True)
        self._write_code(report, stage, gm, "00_input.py", "the graph as this stage received it", code)

    def write_pass(self, report: GraphReport, stage: StageRecord, rec: PassRecord, gm: fx.GraphModule,
                   code: str, before: fx.Graph | None) -> None:
        """After a pass: its code and diff where it changed the graph, and the pictures of what it changed
        (``before``: the graph before it)."""
        if rec.status != "applied":
            return
        from .html_report import changed_regions

        rec.regions = changed_regions(before, gm.graph) if before is not None else []
        n = sum(1 for p in stage.passes if p.status == "applied")
        base = f"{n:02d}_{rec.name}"
        what = f"after pass {rec.name!r} ({rec.matches} matches, {rec.time_ms:.1f} ms)"
        rec.code_file = f"{stage.folder}/{base}.py"
        self._write_code(report, stage, gm, f"{base}.py", what, code)
        rec.diff_file = f"{stage.folder}/{base}.diff"
        with open(self._path(rec.diff_file), "w") as f:
            f.write(rec.diff or "")

    def end_stage(self, report: GraphReport, stage: StageRecord) -> None:
        _write_json(self._path(stage.folder, "passes.json"), {
            "stage": stage.stage,
            "is_inference": stage.is_inference,
            "nodes_before": stage.nodes_before,
            "nodes_after": stage.nodes_after,
            "ops_before": stage.ops_before,
            "ops_after": stage.ops_after,
            "time_ms": round(stage.time_ms, 3),
            "passes": [
                {**p.summary(), "ops_before": p.ops_before, "ops_after": p.ops_after,
                 "code_file": p.code_file, "diff_file": p.diff_file}
                for p in stage.passes
            ],
        })
        self.refresh()

    def wrap_stage(self, report: GraphReport, stage: StageRecord) -> None:
        """The wrap stage has no graph to write: its passes.json, and the summary."""
        stage.folder = f"{report.folder}/{stage.stage}"
        os.makedirs(self._path(stage.folder), exist_ok=True)
        self.end_stage(report, stage)

    # ------------------------------------------------------------------ helpers
    def refresh(self) -> None:
        """Rewrite summary.json and index.html from the reports (the backward stage arrives late)."""
        from .html_report import render_index

        _write_json(self._path("summary.json"), {
            "torch": torch.__version__,
            "graphs": [r.to_dict() for r in self.graphs],
        })
        with open(self._path("index.html"), "w") as f:
            f.write(render_index(self.graphs))

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _write_code(self, report, stage, gm, filename, what, code):
        header = (
            f"# kernelpytorch dump | {report.folder} (compile id {report.compile_id}) | stage {stage.stage} | {what}\n"
            f"# torch {torch.__version__} | target {report.target.get('name')} | run: python {filename}\n"
        )
        unbacked: list[str] = []
        text = runnable_source(gm, header, code, unbacked)
        if unbacked:
            report.notes.append(f"{stage.folder}/{filename}: sizes known only at run time ({', '.join(unbacked)}) "
                                f"are given {_UNBACKED} in its random inputs")
        with open(self._path(stage.folder, filename), "w") as f:
            f.write(text)


_PREAMBLE = """\
import math

import torch
from torch import device  # noqa: F401  (printed graphs name devices as device(...))

import kpt_compiler  # noqa: F401  (registers the custom ops kernelpytorch's passes insert)

inf, nan = math.inf, math.nan

"""

_MAIN = """

# ---- run it on random inputs with the shapes and dtypes recorded at compile time ----------------------
_INPUTS = {inputs!r}
_ATTRS = {attrs!r}


if __name__ == "__main__":
    from kpt_compiler.graph_utils import make_input

    module = {cls}()
    for name, spec in _ATTRS.items():
        value = getattr({cls}, spec[1])() if spec[0] == "module" else make_input(spec)
        owner = module
        *path, leaf = name.split(".")
        for p in path:
            owner = getattr(owner, p)
        setattr(owner, leaf, value)
    out = module(*[make_input(s) for s in _INPUTS])
    outs = out if isinstance(out, (tuple, list)) else [out]
    for i, o in enumerate(outs):
        desc = f"{{tuple(o.shape)}} {{o.dtype}}" if isinstance(o, torch.Tensor) else repr(o)
        print(f"output {{i}}: {{desc}}")
"""

# a size known only at run time (unbacked) is given this value in a dumped graph's inputs
_UNBACKED = 2


def _imports(gm: fx.GraphModule) -> str:
    """Import lines for the functions the graph calls by a global name that is not torch's (a pass's
    replacement such as merged_linear, a kernel's Python entry such as add_layer_norm)."""
    lines = []
    for name, obj in gm.graph.python_code(root_module="self").globals.items():
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
        if not module or module.split(".")[0] in ("torch", "builtins") or "." in qualname or "<" in qualname:
            continue
        if not isinstance(obj, type) and not callable(obj):
            continue
        lines.append(f"from {module} import {qualname} as {name}  # noqa: F401")
    return "\n".join(lines) + "\n\n" if lines else ""


def _spec(value: Any, name: str, unbacked: list[str]) -> tuple:
    """``graph_utils.input_spec``, with a size known only at run time given ``_UNBACKED`` (and its input named)."""
    try:
        return graph_utils.input_spec(value)
    except ValueError:
        unbacked.append(name)
        return graph_utils.input_spec(value, _UNBACKED)


def runnable_source(gm: fx.GraphModule, header: str, code: str | None = None,
                    unbacked: list[str] | None = None) -> str:
    """The graph as a Python file that defines its module and, run as a script, runs it on random inputs.
    Inputs with sizes known only at run time get ``_UNBACKED`` there: their names are appended to ``unbacked``
    and said in the file's header."""
    unbacked = [] if unbacked is None else unbacked
    code = code if code is not None else graph_utils.readable_code(gm)
    match = re.match(r"class (\w+)\(", code)
    cls = match.group(1) if match else "GraphModule"
    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(_spec(node.meta.get("val", node.meta.get("example_value")), node.name, unbacked))
    attrs: dict[str, tuple] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            obj = graph_utils.attr_of(gm, node.target)
        except AttributeError:
            continue
        if isinstance(obj, fx.GraphModule):
            attrs[node.target] = ("module", node.target)
        elif isinstance(obj, torch.Tensor):
            attrs[node.target] = _spec(obj, node.target, unbacked)
    if unbacked:
        header += f"# sizes known only at run time ({', '.join(unbacked)}) are given {_UNBACKED} in the random inputs\n"
    return header + _PREAMBLE + _imports(gm) + code + _MAIN.format(inputs=inputs, attrs=attrs, cls=cls)


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
