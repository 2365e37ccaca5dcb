"""The backend on an NVIDIA GPU: target detection, Inductor/Triton with our stages, CUDA graphs, training.

Run on the H100 machine: pytest -m gpu
"""

import copy

import pytest
import torch

import kpt_compiler
from kpt_compiler.bench import relative_error

from models import make

pytestmark = pytest.mark.gpu


def test_target_is_detected_from_cuda_inputs():
    model, x = make("mlp")
    compiled = torch.compile(model.cuda(), backend="kernelpytorch", options={"codegen": "eager"})
    compiled(x.cuda())
    target = kpt_compiler.last_report().target
    major, minor = torch.cuda.get_device_capability()
    assert target["device"] == "cuda" and target["capability"] == [major, minor]
    assert target["name"] == torch.cuda.get_device_name()


@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_inductor_on_cuda_with_a_joint_rewrite(mode):
    model, x = make("cnn")
    model = model.cuda().eval()
    ref = copy.deepcopy(model).double()(x.double().cuda())
    # torch.compile takes mode= or options=, not both: the mode goes in the options
    options = {"test_relu_to_clamp": True, **({"mode": mode} if mode else {})}
    compiled = torch.compile(model, backend="kernelpytorch", options=options)
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    counters["inductor"].clear()
    with torch.no_grad():
        for _ in range(3):  # CUDA graphs record on a later call
            out = compiled(x.cuda())
    assert relative_error(out, ref) < 1e-2  # TF32 convolutions allowed
    report = kpt_compiler.last_report()
    assert report.codegen == "inductor" and report.pass_record("test-relu-to-clamp").status == "applied"
    if mode == "reduce-overhead":  # the mode's point: the calls were captured as a CUDA graph and replayed
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        assert manager is not None and any(manager.roots.values()), "no CUDA graph was recorded"


def test_training_step_on_cuda_bf16():
    model, x = make("block")
    model = model.cuda()
    ref_model = copy.deepcopy(model).double()
    compiled = torch.compile(model.to(torch.bfloat16), backend="kernelpytorch",
                             options={"test_scale_outputs": {"factor": 1.0}})
    out = compiled(x.cuda().bfloat16())
    out.float().square().mean().backward()
    ref = ref_model(x.cuda().double())
    ref.square().mean().backward()
    assert relative_error(out, ref) < 2e-2
    for (name, p), (_, pr) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert relative_error(p.grad, pr.grad) < 5e-2, name
    assert list(kpt_compiler.last_report().stages) == ["pre_aot", "joint", "forward", "backward"]


def test_a_failing_pass_steps_aside_on_cuda():
    model, x = make("mlp")
    model = model.cuda()
    compiled = torch.compile(model, backend="kernelpytorch", options={"test_raise": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x.cuda()), model(x.cuda()), rtol=1e-3, atol=1e-3)
    assert kpt_compiler.last_report().pass_record("test-raise").status == "failed"
