"""Small real models through the whole backend: numerics against eager in float64, inference and training."""

import copy

import pytest
import torch

import kpt_compiler

from models import make

# fp32 compiled vs a float64 reference: relative error of the whole output (norm), far under 1e-4
RTOL = 1e-4


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _setup(name, train):
    """(model, input, float64 reference model and input, the model compiled with eager codegen)."""
    model, x = make(name)
    model.train(train)
    compiled = torch.compile(model, backend="kernelpytorch", options={"codegen": "eager", "test_relu_to_clamp": True})
    return model, x, copy.deepcopy(model).double(), x.double(), compiled


def _assert_grads_match(model, ref_model):
    for (pname, p), (_, pr) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert p.grad is not None, pname
        assert _rel_err(p.grad, pr.grad) < RTOL, pname


@pytest.mark.parametrize("name", ["mlp", "cnn", "block"])
def test_inference_matches_eager(name):
    model, x, ref_model, xr, compiled = _setup(name, train=False)
    with torch.no_grad():
        out = compiled(x)
        ref = ref_model(xr)
    assert _rel_err(out, ref) < RTOL
    report = kpt_compiler.last_report()
    assert report.stages["joint"].is_inference
    expected = "applied" if name in ("mlp", "cnn") else "unchanged"  # the block uses gelu, not relu
    assert report.pass_record("test-relu-to-clamp").status == expected


@pytest.mark.parametrize("name", ["mlp", "cnn", "block"])
def test_training_step_matches_eager(name):
    model, x, ref_model, xr, compiled = _setup(name, train=True)
    out = compiled(x)
    out.square().mean().backward()
    ref = ref_model(xr)
    ref.square().mean().backward()
    assert _rel_err(out, ref) < RTOL
    _assert_grads_match(model, ref_model)
    # batch norm's running statistics are a mutation the compiled step must keep
    for (bname, b), (_, br) in zip(model.named_buffers(), ref_model.named_buffers()):
        if b.is_floating_point():
            assert _rel_err(b, br) < RTOL, bname
    assert "backward" in kpt_compiler.last_report().stages


@pytest.mark.inductor
def test_inductor_inference_with_a_failing_post_grad_pass():
    """Inductor hosts the pipeline: a joint rewrite applies, a forward pass that raises inside Inductor's
    post-grad hook is rolled back in place, and the generated code still matches eager."""
    model, x = make("mlp")
    ref_model, xr = copy.deepcopy(model).double(), x.double()
    compiled = torch.compile(model, backend="kernelpytorch", options={"test_relu_to_clamp": True, "test_raise": True})
    with torch.no_grad():
        out = compiled(x)
    assert _rel_err(out, ref_model(xr)) < RTOL
    report = kpt_compiler.last_report()
    assert report.codegen == "inductor"
    assert report.pass_record("test-relu-to-clamp").status == "applied"
    assert report.pass_record("test-raise", "forward").status == "failed"


@pytest.mark.inductor
def test_inductor_training_step_of_a_transformer_block():
    model, x = make("block")
    ref_model, xr = copy.deepcopy(model).double(), x.double()
    compiled = torch.compile(model, backend="kernelpytorch", options={"test_scale_outputs": {"factor": 1.0}})
    out = compiled(x)
    out.square().mean().backward()
    ref = ref_model(xr)
    ref.square().mean().backward()
    assert _rel_err(out, ref) < RTOL
    _assert_grads_match(model, ref_model)
    report = kpt_compiler.last_report()
    assert list(report.stages) == ["pre_aot", "joint", "forward", "backward"]
    assert report.pass_record("test-scale-outputs", "forward").status == "applied"
