"""How the emitters are configured: Inductor modes, user Inductor options, hook chaining; device checks."""

import importlib.util

import pytest
import torch

from kpt_compiler import OptionError, parse_options
from kpt_compiler.emitters import inductor_config_patches
from kpt_compiler.pass_manager import PassManager
from kpt_compiler.report import GraphReport
from kpt_compiler.target import Target, detect_target


def _run(mode=None, options=None, target=Target("cpu", "cpu")):
    rep = GraphReport(index=0, compile_id="-", codegen="inductor", target={}, options={})
    return PassManager(parse_options(mode, options), target, rep)


@pytest.mark.parametrize("mode, expected", [
    ("reduce-overhead", {"triton.cudagraphs": True}),
    ("max-autotune", {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True}),
    ("max-autotune-no-cudagraphs", {"max_autotune": True, "coordinate_descent_tuning": True}),
])
def test_modes_mean_what_they_mean_for_inductor(mode, expected):
    from torch._inductor import list_mode_options

    patches = inductor_config_patches(_run(mode))
    assert list_mode_options(mode) == expected  # torch's own table, as torch.compile gives Inductor
    for key, value in expected.items():
        assert patches[key] == value


def test_default_mode_adds_only_our_hooks():
    patches = inductor_config_patches(_run())
    assert set(patches) == {"joint_custom_pre_pass", "post_grad_custom_pre_pass"}


def test_a_pass_asks_inductor_config_for_the_whole_compile_and_the_user_has_the_last_word():
    # the cudagraphs pass capturing a training graph: the setting must reach compile_fx's config_patches, which
    # Inductor also holds for the backward it compiles at the first backward call
    pm = _run()
    pm.inductor_patches.update({"triton.cudagraphs": True})
    assert inductor_config_patches(pm)["triton.cudagraphs"] is True
    pm = _run(options={"inductor": {"triton.cudagraphs": False}})
    pm.inductor_patches.update({"triton.cudagraphs": True})
    assert inductor_config_patches(pm)["triton.cudagraphs"] is False
    from kpt_compiler.emitters import user_overrides

    notes = user_overrides(pm)  # and the report says so, beside the pass's "captured"
    assert len(notes) == 1 and "triton.cudagraphs=False" in notes[0] and "no CUDA-graph capture" in notes[0], notes
    assert user_overrides(_run(options={"inductor": {"epilogue_fusion": False}})) == []


@pytest.mark.parametrize("applies", [True, False])
def test_the_pass_manager_takes_inductor_config_from_passes_that_applied(applies):
    import torch.fx as fx

    pm = _run(options={"test-inductor-config": {"applies": applies}})
    gm = fx.symbolic_trace(lambda x: x + 1)
    pm.run_stage(gm, "pre_aot", is_inference=True)
    assert pm.report.pass_record("test-inductor-config").status == ("applied" if applies else "unchanged")
    assert (inductor_config_patches(pm).get("max_autotune_gemm_backends") == "ATEN") is applies


def test_cudagraphs_pass_on_a_training_graph_asks_inductor_config_not_a_trace_context(monkeypatch):
    import torch.fx as fx

    from kpt_compiler.cost_model import CostModel
    from kpt_compiler.registry import PassContext
    from kpt_compiler.passes import cudagraphs as cg

    h100 = Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(4, 8, device="meta")
    graph.output(graph.call_function(torch.relu, (x,)))
    ctx = PassContext(options=cg.CudaGraphsOptions(decide="always"), target=h100, stage="pre_aot", is_inference=False,
                      mode="default", codegen="inductor", cost_model=CostModel(h100, "default"))
    # the meta input is no GPU tensor: the graph's own checks are not what is tested here
    monkeypatch.setattr(cg, "_refusal", lambda gm, ctx: None)
    assert cg.cudagraphs(fx.GraphModule({}, graph), ctx)
    assert ctx.inductor_patches == {"triton.cudagraphs": True}
    from torch._inductor import config

    with ctx.aot_contexts[0]():  # what is held during the trace only listens; the setting is not patched there
        assert not config.triton.cudagraphs

    def listening() -> bool:
        from kpt_compiler.passes import _cudagraph_log

        return any(isinstance(h, cg._SkipLog) for h in _cudagraph_log.logger().handlers)

    # a training graph's backward is recorded at the first backward, after the first call: Inductor's refusals
    # are heard until the second call ends
    after = ctx.return_hooks[0]
    after((torch.ones(2),))
    assert listening()
    after((torch.ones(2),))
    assert not listening()


def test_user_inductor_options_are_applied():
    patches = inductor_config_patches(_run(options={"inductor": {"epilogue_fusion": False}}))
    assert patches["epilogue_fusion"] is False


def test_hooks_chain_a_custom_pass_the_user_installed():
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    calls = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "user-pass-v1"

    with config.patch(post_grad_custom_pre_pass=UserPass()):
        hook = inductor_config_patches(_run())["post_grad_custom_pre_pass"]
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    hook(gm.graph)
    assert calls == [gm.graph]
    assert "user-pass-v1" in hook.uuid()


def test_target_from_inputs():
    assert detect_target([torch.randn(2), 3]).device == "cpu"
    assert detect_target([]).device == "cpu"
    has_xla = importlib.util.find_spec("torch_xla") is not None
    xla = "inputs are on 'cpu'" if has_xla else "needs torch_xla, which is not installed here"
    with pytest.raises(OptionError, match=f"options\\['device'\\]='xla'.*{xla}"):
        detect_target([torch.randn(2)], "xla")


def test_a_graph_without_tensor_inputs_runs_where_its_ops_put_their_tensors(monkeypatch):
    """A causal mask built from sizes alone (a graph of its own before the attention's) takes no tensor: its
    target is the device of the tensors it makes (found on a GPU: the cudagraphs pass refused it as a CPU graph).
    So too where its only tensors in are host scalars (a float Dynamo made dynamic); a device asked for still
    wins (a review: comparing it with the tensors made turned a graph that compiled into an error)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kpt_compiler import target as target_module

    gm = torch.fx.symbolic_trace(lambda: torch.ones(2))
    with FakeTensorMode():
        made = torch.empty(2, device="cuda")
    for node in gm.graph.nodes:
        node.meta["example_value"] = ((made,),)  # nested, as a node with several outputs holds them
    gpu = Target("cuda", "NVIDIA H100 80GB HBM3", capability=(9, 0))
    monkeypatch.setattr(target_module, "cuda_target", lambda index=None: gpu)
    assert detect_target([], gm=gm) is gpu
    assert detect_target([torch.tensor(0.5), 3], gm=gm) is gpu  # a host scalar: still where the tensors are made
    assert detect_target([torch.randn(2)], gm=gm).device == "cpu"  # inputs decide where there are some
    assert detect_target([], "cpu", gm=gm).device == "cpu"  # asked for: no error, as before
    for node in gm.graph.nodes:
        node.meta.clear()
    assert detect_target([], gm=gm).device == "cpu"


def test_the_backend_hands_its_graph_to_the_target_check(monkeypatch):
    from kpt_compiler import backend as backend_module

    seen = []
    real = backend_module.detect_target

    def recording(example_inputs, asked="auto", gm=None):
        seen.append(gm)
        return real(example_inputs, asked, gm)

    monkeypatch.setattr(backend_module, "detect_target", recording)
    torch._dynamo.reset()
    out = torch.compile(lambda n: torch.arange(n) * 2, backend="kernelpytorch", options={"codegen": "eager"})(5)
    torch._dynamo.reset()
    assert out.tolist() == [0, 2, 4, 6, 8]
    assert seen and all(g is not None and len(g.graph.nodes) > 0 for g in seen), seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_says_what_is_missing():
    with pytest.raises(OptionError, match=r"options\['device'\]='cuda', but torch sees no CUDA device here"):
        detect_target([torch.randn(2)], "cuda")


def test_target_capabilities():
    h100 = Target("cuda", "NVIDIA H100", capability=(9, 0))
    a100 = Target("cuda", "NVIDIA A100", capability=(8, 0))
    cpu = Target("cpu", "cpu")
    assert h100.has_fp8 and h100.has_sparse_2_4
    assert not a100.has_fp8 and a100.has_sparse_2_4
    assert not cpu.has_fp8 and not cpu.has_sparse_2_4 and not cpu.has_triton
    assert "sm_90" in h100.describe()


def test_the_first_calls_tensors_are_not_held_past_the_compile(monkeypatch):
    # the pass manager keeps Dynamo's example inputs for the passes while it compiles. It sits in reference cycles
    # (its stage hooks live in Inductor's config patches), so holding them afterwards kept the first call's tensors
    # until the collector ran: a static cache, whose successor could then not move into the captured storage
    # (seen on the H200, s23), and whatever memory they hold
    import weakref

    from kpt_compiler import backend

    managers, real = [], backend._run_pipeline_and_emit

    def run(gm, example_inputs, pm, *rest):
        managers.append(pm)
        return real(gm, example_inputs, pm, *rest)

    monkeypatch.setattr(backend, "_run_pipeline_and_emit", run)

    def step(x, cache, pos):
        cache.index_copy_(0, pos, x)
        return cache.sum(0) * 2

    cache = torch.zeros(8, 16)
    alive = weakref.ref(cache)
    compiled = torch.compile(step, backend="kernelpytorch")
    torch.testing.assert_close(compiled(torch.ones(1, 16), cache, torch.tensor([0])), torch.full((16,), 2.0))
    assert len(managers) == 1 and managers[0].example_inputs == []
    managers.clear()
    del cache
    assert alive() is None
