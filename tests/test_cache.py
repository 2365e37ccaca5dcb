"""Inductor's caches key on our pipeline: a changed option never brings back an artifact compiled by
another pipeline, and the same options still hit the cache."""

import pytest
import torch
from torch._dynamo.utils import counters

import kpt_compiler


@pytest.mark.inductor
def test_changed_options_never_return_a_stale_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor import config

    with config.patch(fx_graph_cache=True, force_disable_caches=False):
        _check_cache_keys()


def _check_cache_keys():
    f = lambda x: torch.relu(x) * 2 + 1  # noqa: E731
    x = torch.randn(64)

    def run(options):
        torch._dynamo.reset()
        with torch.no_grad():
            return torch.compile(f, backend="kernelpytorch", options=options)(x)

    counters.clear()
    scaled = run({"test_scale_outputs": {"factor": 3.0}})
    torch.testing.assert_close(scaled, 3 * f(x))
    # Same graph, other options: Inductor must not hand back the tripled artifact.
    plain = run({})
    torch.testing.assert_close(plain, f(x))
    other_factor = run({"test_scale_outputs": {"factor": 5.0}})
    torch.testing.assert_close(other_factor, 5 * f(x))
    assert counters["inductor"]["fxgraph_cache_hit"] == 0
    # The first options again: now a cache hit, with the right result.
    again = run({"test_scale_outputs": {"factor": 3.0}})
    torch.testing.assert_close(again, 3 * f(x))
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    # the passes did not run this time, and the report says so instead of pretending
    report = kpt_compiler.last_report()
    assert "forward" not in report.stages
    assert any("came from Inductor's cache" in note for note in report.notes)
    assert "came from Inductor's cache" in report.table()


@pytest.mark.inductor
def test_a_graph_with_our_functions_is_taken_from_the_autograd_cache(tmp_path, monkeypatch):
    """merge-parallel-linears puts a plain function of ours (merged_linear_static) into the graph;
    AOTAutograd's cache passes over graphs calling functions it does not know unless they are marked cacheable.
    The second compile of the same model must come from it, not be traced again."""
    import torch.nn.functional as F

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor import config

    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))

        def forward(self, x):
            return F.relu(self.q(x)) + self.k(x) * self.v(x)

    model, x = QKV().eval(), torch.randn(8, 32)
    options = {"fusion": {"decide": "always"}, "attention": False}
    with config.patch(fx_graph_cache=True, force_disable_caches=False), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        results = []
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            with torch.no_grad():
                results.append(torch.compile(model, backend="kernelpytorch", options=options)(x))
            assert "merge-parallel-linears" in kpt_compiler.last_report().fired()
            assert counters["aot_autograd"]["autograd_cache_bypass"] == 0, dict(counters["aot_autograd"])
            assert not any("AOTAutograd's cache skipped" in n for n in kpt_compiler.last_report().notes)
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
        # unmarked, the cache skips the graph, and the report says so with AOTAutograd's reason
        from kpt_compiler import emitters

        monkeypatch.setattr(emitters, "_cacheable_functions", lambda gm, pm: {})
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend="kernelpytorch", options=options)(x)
        skipped = [n for n in kpt_compiler.last_report().notes if n.startswith("AOTAutograd's cache skipped")]
        assert skipped and "merged_linear_static" in skipped[0], kpt_compiler.last_report().notes
    with torch.no_grad():
        torch.testing.assert_close(results[1], model(x))


_WARM = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
import kpt_compiler
from kpt_compiler.models.gpt import GPT, GPTConfig

torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64)).eval()
start = time.perf_counter()
with torch.no_grad():
    torch.compile(model, backend="kernelpytorch", options=json.loads(sys.argv[1]))(torch.randint(0, 64, (1, 16)))
report = kpt_compiler.last_report()
print(json.dumps({"seconds": time.perf_counter() - start, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "fired": report.fired(), "notes": report.notes}))
"""


@pytest.mark.inductor
def test_a_new_process_takes_the_graph_from_the_cache_and_a_changed_option_misses(tmp_path):
    """Warm restarts (issue 20): the same model and options in a new process come from Inductor's cache, with
    our pre_aot passes still applied and the report saying where the code came from; other options miss."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "warm.py"
    script.write_text(_WARM)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}

    def run(options):
        out = subprocess.run([sys.executable, str(script), json.dumps(options)], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run({}), run({})
    assert cold["hit"] == 0 and warm["hit"] >= 1, (cold, warm)
    assert "attention" in cold["fired"] and warm["fired"] == cold["fired"], (cold, warm)
    assert any("came from Inductor's cache" in n for n in warm["notes"]), warm["notes"]
    other = run({"cudagraphs": False})  # another option, the same graph: must not get the first one's code
    assert other["hit"] == 0, other


def test_a_changed_pass_source_changes_the_fingerprint(tmp_path, monkeypatch):
    """Inductor keys its caches on PassManager.fingerprint (CustomGraphPass.uuid): an edited pass must miss."""
    import importlib.util

    from kpt_compiler import parse_options, unregister_pass
    from kpt_compiler.pass_manager import PassManager
    from kpt_compiler.report import GraphReport
    from kpt_compiler.target import Target

    source = tmp_path / "my_pass.py"
    body = ('from kpt_compiler import graph_pass\n\n@graph_pass("test-edited-pass", summary="nothing", stage="pre_aot")\n'
            'def edited(gm, ctx):\n    return False{}\n')
    source.write_text(body.format(""))
    spec = importlib.util.spec_from_file_location("my_pass", source)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    try:
        def fp():
            rep = GraphReport(index=0, compile_id="-", codegen="inductor", target={}, options={})
            return PassManager(parse_options(None, {}), Target("cpu", "cpu"), rep).fingerprint()

        before = fp()
        assert fp() == before
        source.write_text(body.format("  # edited"))
        assert fp() != before
    finally:
        unregister_pass("test-edited-pass")


def test_the_fingerprint_reads_the_passes_helpers_and_kernels_too_under_names_free_of_the_install_path():
    # an editable install keeps passes/ and kernels/ beside kpt_compiler/: walking kpt_compiler/ alone left every
    # helper module (passes/_attention_gqa.py, kernels/flex_attention.py, ...) out, so editing one could hit the
    # cache. Each file is hashed under its package's name and its path inside it, as a regular install would
    # name it too: two checkouts of one tree share Inductor's cache
    import os

    from kpt_compiler.kernels import flex_attention, fp4_linear
    from kpt_compiler.pass_manager import _package_sources
    from kpt_compiler.passes import _attention_gqa, _bucket_graphs

    read = _package_sources()
    for module, name in ((_attention_gqa, "kpt_compiler.passes/_attention_gqa.py"),
                         (_bucket_graphs, "kpt_compiler.passes/_bucket_graphs.py"),
                         (flex_attention, "kpt_compiler.kernels/flex_attention.py"),
                         (fp4_linear, "kpt_compiler.kernels/fp4_linear.py")):
        assert read.get(os.path.abspath(module.__file__)) == name, module.__name__
    names = list(read.values())
    assert len(set(names)) == len(names) and not any(os.path.isabs(n) or "__pycache__" in n for n in names)
    assert "kpt_compiler/pass_manager.py" in names


class _Kernel:
    """Stands for a @triton.jit function: the cache reads only its name and cache key."""

    def __init__(self, cache_key: str):
        self.cache_key, self.__name__ = cache_key, "fake_kernel"
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append(meta)


class _Autotuned:
    def __init__(self, choice: dict):
        self.tuned, self.choice = 0, choice

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.tuned += 1
            self.best_config = type("Config", (), {"all_kwargs": lambda _: dict(self.choice)})()
        return run


@pytest.fixture
def choices_on_disk(tmp_path, monkeypatch):
    """The autotune cache as on a GPU: enabled, a card's name, Inductor's cache folder in tmp_path."""
    from kpt_compiler.kernels import _launch, _tuned_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_tuned_cache, "_disabled", lambda: False)
    card = {"name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(_tuned_cache, "_card", lambda index: card["name"])
    monkeypatch.setattr(_tuned_cache.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_chosen", _tuned_cache.ChoicesOnDisk())

    def restart():  # a new process: nothing chosen in memory
        monkeypatch.setattr(_launch, "_chosen", _tuned_cache.ChoicesOnDisk())
    return _launch, restart, card


def test_a_restarted_process_launches_the_choice_its_predecessor_tuned(choices_on_disk):
    _launch, restart, _ = choices_on_disk
    kernel, key = _Kernel("source-1"), (4096, 1024, 1024, "torch.bfloat16")
    autotuned = _Autotuned({"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8})
    assert _launch.launch_tuned(autotuned, kernel, key, (1,), (), {"ACT": "silu"}) == autotuned.choice
    assert autotuned.tuned == 1 and kernel.launches == []
    restart()
    again = _Autotuned({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4})  # would choose otherwise: must not run
    assert _launch.launch_tuned(again, kernel, key, (1,), (), {"ACT": "silu"}) == autotuned.choice
    assert again.tuned == 0
    assert kernel.launches == [{"ACT": "silu", **autotuned.choice}]


def test_a_changed_kernel_key_or_card_tunes_again(choices_on_disk):
    _launch, restart, card = choices_on_disk
    key = (4096, 1024, 1024, "torch.bfloat16")
    _launch.launch_tuned(_Autotuned({"BLOCK_M": 128}), _Kernel("source-1"), key, (1,), (), {})
    for kernel, k in ((_Kernel("source-2"), key), (_Kernel("source-1"), (8192,) + key[1:]),
                      (_Kernel("source-1"), key[:3] + ("torch.float16",))):
        restart()
        tuner = _Autotuned({"BLOCK_M": 64})
        _launch.launch_tuned(tuner, kernel, k, (1,), (), {})
        assert tuner.tuned == 1, (kernel.cache_key, k)
    restart()
    card["name"] = "NVIDIA H200"
    tuner = _Autotuned({"BLOCK_M": 64})
    _launch.launch_tuned(tuner, _Kernel("source-1"), key, (1,), (), {})
    assert tuner.tuned == 1


def test_inductor_force_disable_caches_turns_the_autotune_files_off(choices_on_disk, monkeypatch):
    from torch._inductor import config

    from kpt_compiler.kernels import _tuned_cache

    _launch, restart, _ = choices_on_disk
    monkeypatch.setattr(_tuned_cache, "_disabled", lambda: bool(config.force_disable_caches))
    key = (64, 64, 64, "torch.bfloat16")
    _launch.launch_tuned(_Autotuned({"BLOCK_M": 16}), _Kernel("k"), key, (1,), (), {})
    restart()
    with config.patch(force_disable_caches=True):
        tuner = _Autotuned({"BLOCK_M": 16})
        _launch.launch_tuned(tuner, _Kernel("k"), key, (1,), (), {})
    assert tuner.tuned == 1


def test_the_kernels_package_installs_the_autotune_files():
    from kpt_compiler.kernels import _launch, _tuned_cache

    assert isinstance(_launch._chosen, _tuned_cache.ChoicesOnDisk)


def test_the_backend_gives_triton_inductors_ptxas_before_anything_compiles(monkeypatch):
    """Triton's cache key holds the ptxas version, and Inductor sets TRITON_PTXAS_PATH only on some of its paths:
    a warm restart that took Inductor's code from its cache built kernels with the other ptxas, under new keys
    (issue 20; backend._triton_toolchain_as_inductor). Every backend call sets it, before the passes run."""
    from torch._inductor.runtime import compile_tasks

    from kpt_compiler import pass_manager

    order = []
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: order.append("ptxas"))
    run = pass_manager.PassManager.run_stage

    def recording(self, *args, **kwargs):
        order.append("stage")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(pass_manager.PassManager, "run_stage", recording)
    torch._dynamo.reset()
    x = torch.randn(8)
    out = torch.compile(lambda t: t.sin() + 1, backend="kernelpytorch", options={"codegen": "eager"})(x)
    torch.testing.assert_close(out, x.sin() + 1)
    assert order[:1] == ["ptxas"] and "stage" in order


def test_a_failing_toolchain_setter_is_logged_once_and_the_compile_goes_on(monkeypatch):
    """The setters are Inductor's private functions: a change of theirs must not break every compile."""
    import logging

    from torch._inductor.runtime import compile_tasks

    from kpt_compiler import backend

    def broken():
        raise TypeError("a changed signature")

    class Recorder(logging.Handler):
        messages: list = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", broken)
    monkeypatch.setattr(backend, "_toolchain_warned", False)
    handler = Recorder(level=logging.WARNING)
    backend.log.addHandler(handler)
    try:
        x = torch.randn(8)
        for _ in range(2):
            torch._dynamo.reset()
            out = torch.compile(lambda t: t.cos() * 2, backend="kernelpytorch", options={"codegen": "eager"})(x)
            torch.testing.assert_close(out, x.cos() * 2)
    finally:
        backend.log.removeHandler(handler)
    assert Recorder.messages.count("could not give Triton Inductor's ptxas (TypeError: a changed signature); a warm "
                                   "restart may build kernels again") == 1, Recorder.messages


def test_the_skip_reason_is_checked_under_the_compiles_config_patches():
    # checked outside them, the reason named merged_linear_static, which the compile marks cacheable, for a graph
    # AOTAutograd skipped for another cause (torch.Tensor methods as call_function targets, on the H200, s23)
    import torch.fx as fx

    from kpt_compiler import emitters
    from kpt_compiler.passes.merge_parallel_linears import merged_linear_static

    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(merged_linear_static, (x, w, None, [2, 2])))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    name = "kpt_compiler.passes.merge_parallel_linears.merged_linear_static"
    with torch._inductor.config.patch(fx_graph_cache=True):
        assert "merged_linear_static" in emitters._aot_cache_reason(gm, {})
        marked = emitters._aot_cache_reason(gm, {"unsafe_marked_cacheable_functions": {name: "key"}})
    assert "merged_linear_static" not in marked and "TORCH_LOGS" in marked, marked
