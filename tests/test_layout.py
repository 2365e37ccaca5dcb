"""The shape of the code: every module imports alone, the core modules import each other without a circle
(not even through imports inside functions), and no pass or kernel file outgrows its budget."""

import ast
import concurrent.futures
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import networkx as nx

import kpt_compiler
import kpt_compiler.kernels
import kpt_compiler.passes

ROOT = Path(__file__).resolve().parent.parent
CORE = Path(kpt_compiler.__file__).parent
LINE_BUDGET = 420  # "a file that passes ~300 lines is asking to split"; none of these over ~400


def _modules() -> list[str]:
    out = []
    for package in (kpt_compiler, kpt_compiler.passes, kpt_compiler.kernels):
        folder = os.path.dirname(package.__file__)  # its own folder (not what __path__ may add)
        out += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules([folder])]
    out += [f"kpt_compiler.models.{m.name}" for m in pkgutil.iter_modules([str(CORE / "models")])]
    return sorted(out)


def _imports_of(path: Path, package: str) -> set[str]:
    """The kpt_compiler modules a file imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}")
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("kpt_compiler.")}


def test_no_import_circle_among_the_core_modules():
    graph = nx.DiGraph()
    core = sorted(p.stem for p in CORE.glob("*.py") if p.stem != "__init__")
    for stem in core:
        graph.add_node(stem)
        for name in _imports_of(CORE / f"{stem}.py", "kpt_compiler"):
            target = name.split(".")[1]
            if target in core and target != stem:
                graph.add_edge(stem, target)
    assert nx.is_directed_acyclic_graph(graph), list(nx.simple_cycles(graph))
    # the four the options flow through, in the order they build on each other
    for low, high in (("registry", "options"), ("options", "pipeline"), ("target", "registry")):
        assert not nx.has_path(graph, low, high), f"{low} reaches {high}"


def _import_alone(name: str) -> subprocess.CompletedProcess:
    code = f"import sys, {name}; print(' '.join(m for m in sys.modules if m.startswith('kpt_compiler')))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ""})


def test_every_module_imports_alone():
    """``python -c "import kpt_compiler.<m>"`` for every module. Importing a submodule runs the package's
    ``__init__`` first, so for the modules that ``__init__`` loads the result is that of ``import kpt_compiler``
    (checked once, with the list of what it loaded); every other module is imported in a process of its own."""
    first = _import_alone("kpt_compiler")
    assert first.returncode == 0, first.stderr[-2000:]
    loaded = set(first.stdout.split())
    rest = [m for m in _modules() if m not in loaded]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = dict(zip(rest, pool.map(_import_alone, rest)))
    failed = {name: r.stderr[-600:] for name, r in runs.items() if r.returncode != 0}
    assert not failed, failed
    assert set(_modules()) <= loaded | set(runs)


def test_pass_and_kernel_files_stay_within_the_line_budget():
    over = {}
    for folder in ("passes", "kernels"):
        for path in (ROOT / folder).glob("*.py"):
            lines = len(path.read_text().splitlines())
            if lines > LINE_BUDGET:
                over[f"{folder}/{path.name}"] = lines
    assert not over, over


def test_the_source_folder_works_from_the_repository_root_without_an_editable_install(tmp_path):
    """After `pip install .` (not -e), Python run from the repository root imports the source folder
    kpt_compiler/, which has no passes/ or kernels/ inside: the package must find them beside it. Simulated
    with a copy of the three folders and no editable-install finder."""
    import shutil

    for folder in ("kpt_compiler", "passes", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    drop_editable = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in " \
                    "getattr(f, '__name__', '')]; "
    load = "import kpt_compiler, kpt_compiler.passes, kpt_compiler.kernels.gated_linear; " \
           "print(kpt_compiler.passes.__file__, kpt_compiler.kernels.gated_linear.__file__)"
    # no install mapping at all (pip install .), and an editable install of another checkout (this one's, here)
    for code in (drop_editable + load, load):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": ""})
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split() == [str(tmp_path / "passes" / "__init__.py"),
                                    str(tmp_path / "kernels" / "gated_linear.py")], (code, r.stdout)


def test_run_from_the_repository_root_the_top_level_name_kernels_is_left_to_its_distribution(tmp_path):
    """kernels/ is kpt_compiler.kernels. Run from the repository root (first on sys.path), ``import kernels``
    found the folder itself, and transformers 5.25, which imports Hugging Face's ``kernels`` when it loads,
    failed there (``cannot import name 'CUDAProperties'``). The folder hands the name to the installed package
    (here a stand-in after the root on the path), or is an empty module where none is installed; kpt_compiler.kernels is unchanged."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = 'the installed kernels'\n")
    code = "import kernels; import kpt_compiler.kernels.gated_linear as g; print(kernels.CUDAProperties); " \
           "print(g.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["the installed kernels", "kpt_compiler.kernels.gated_linear"], r.stdout
    # with none installed (transformers 5.17 imports the name to ask its version): an empty module, no error
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' "
                        "not in p]; import kernels; print(getattr(kernels, '__version__', 'N/A'), "
                        "sorted(k for k in vars(kernels) if not k.startswith('_')))"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0 and r.stdout.split() == ["N/A", "[]"], (r.stdout, r.stderr[-2000:])
