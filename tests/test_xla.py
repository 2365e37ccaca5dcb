"""The XLA route: inputs on an XLA device go through our stages, then torch_xla's dynamo bridge.

Runs in the torch 2.9 + torch_xla 2.9 environment with PJRT_DEVICE=CPU (scripts/test.sh sets it up).
"""

import copy
import os

import pytest
import torch

import kpt_compiler

from models import make

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def xla_device():
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    return torch_xla.device()


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_inference_through_openxla(xla_device):
    model, x = make("mlp")
    ref = model(x)
    xmodel = copy.deepcopy(model).to(xla_device)
    compiled = torch.compile(xmodel, backend="kernelpytorch", options={"test_relu_to_clamp": True})
    with torch.no_grad():
        out = compiled(x.to(xla_device))
    assert _rel_err(out.cpu(), ref) < 1e-5
    report = kpt_compiler.last_report()
    assert report.codegen == "xla" and report.target["device"] == "xla"
    assert report.pass_record("test-relu-to-clamp").status == "applied"
    # the rewritten graph is what XLA ran: scaling outputs shows up in the result
    torch._dynamo.reset()
    scaled = torch.compile(xmodel, backend="kernelpytorch", options={"test_scale_outputs": {"factor": 2.0}})
    with torch.no_grad():
        out2 = scaled(x.to(xla_device))
    assert _rel_err(out2.cpu(), 2 * ref) < 1e-5


def test_training_step_through_openxla(xla_device):
    model, x = make("block")
    ref_model = copy.deepcopy(model)
    ref_model(x).square().mean().backward()
    xmodel = copy.deepcopy(model).to(xla_device)
    compiled = torch.compile(xmodel, backend="kernelpytorch", options={"test_relu_to_clamp": True})
    compiled(x.to(xla_device)).square().mean().backward()
    for (name, p), (_, pr) in zip(xmodel.named_parameters(), ref_model.named_parameters()):
        assert _rel_err(p.grad.cpu(), pr.grad) < 1e-4, name
    assert list(kpt_compiler.last_report().stages) == ["pre_aot", "joint", "forward", "backward"]


def test_inductor_only_settings_are_refused_on_xla(xla_device):
    model, x = make("mlp")
    xmodel = copy.deepcopy(model).to(xla_device)
    with pytest.raises(Exception, match=r"mode='reduce-overhead' is an Inductor mode.*XLA cannot honour it"):
        torch.compile(xmodel, backend="kernelpytorch", mode="reduce-overhead")(x.to(xla_device))
