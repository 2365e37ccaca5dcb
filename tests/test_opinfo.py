"""PyTorch's own OpInfo samples through the backend: 100 ops spread over the op database, one sample each, in
float32 on the CPU (codegen="eager": the rewritten ATen graph as it is), with the default options and with
every pass forced on; each result against eager. An op no pass touches must come out as eager computes it,
and one a pass rewrites must keep its value."""

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kpt_compiler

RANDOM = ("rand", "dropout", "normal", "bernoulli", "multinomial", "empty", "uniform", "poisson", "new_",
          "exponential", "geometric", "cauchy", "log_normal")
COUNT = 100


def _op_db():
    """PyTorch's OpInfo database. Its import (torch.testing._internal.common_utils) forbids setting
    torch.backends flags for the rest of the process (disable_global_flags): allowed again at once, since other
    tests (the benchmark harness turns TF32 off) set them."""
    flags = torch.backends.flags_frozen.__globals__  # torch.backends' own globals, which flags_frozen() reads
    allowed = flags["__allow_nonbracketed_mutation_flag"]
    try:  # no skip: the test extra installs expecttest, which the database needs
        return importlib.import_module("torch.testing._internal.common_methods_invocations").op_db
    finally:
        flags["__allow_nonbracketed_mutation_flag"] = allowed


def _ops():
    ops = sorted((o for o in _op_db() if not any(r in o.name for r in RANDOM)
                  and torch.float32 in o.supported_dtypes("cpu")), key=lambda o: (o.name, o.variant_test_name))
    return ops[::max(1, len(ops) // COUNT)][:COUNT]


def _every_pass_on() -> dict:
    cpu = kpt_compiler.Target("cpu", "cpu")  # and not the passes that cannot run here (cudagraphs)
    options = {spec.key: True for name, spec in kpt_compiler.registered_passes().items()
               if not name.startswith("test-") and spec.stage != "wrap"
               and spec.unsupported_reason(cpu, spec.options()) is None}
    return {**options, "fusion": {"decide": "always"}}


OPTIONS = {"default": {}, "every pass": _every_pass_on()}


def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("setting", list(OPTIONS))
def test_opinfo_samples_match_eager(setting):
    compared, failed = 0, []
    for op in _ops():
        sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=False)), None)
        if sample is None:
            continue
        args, kwargs = (sample.input, *sample.args), sample.kwargs

        def fn(*a):
            return op.op(*a, **kwargs)

        try:
            expected = fn(*args)
        except Exception:  # noqa: BLE001 - a sample eager rejects says nothing of the backend
            continue
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="kernelpytorch", dynamic=False,
                                 options={"codegen": "eager", **OPTIONS[setting]})
        try:
            got = compiled(*args)
            torch.testing.assert_close(_leaves(got), _leaves(expected), rtol=1e-4, atol=1e-5, equal_nan=True)
        except Exception as e:  # noqa: BLE001 - gather them all, then fail with the list
            failed.append(f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        compared += 1
    assert compared >= 80, compared
    assert not failed, "\n".join(failed)


def _gated(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def _epilogue(x, w, b, r):
    return F.gelu(F.linear(x, w, b)) + r


def _qkv(x, wq, wk, wv):
    return F.linear(x, wq) * F.linear(x, wk) - F.linear(x, wv)


def _attention(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v


def _add_layer_norm(a, r, w, b):
    return F.layer_norm(a + r, (16,), w, b)


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


COMPOSITES = [  # (function, inputs, the pass that must fire with every pass forced on)
    (_gated, (_randn(5, 16), _randn(12, 16), _randn(12, 16)), "fuse-gated-linear"),
    (_epilogue, (_randn(5, 16), _randn(12, 16), _randn(12), _randn(5, 12)), "fuse-linear-epilogue"),
    (_qkv, (_randn(5, 16), _randn(12, 16), _randn(12, 16), _randn(12, 16)), "merge-parallel-linears"),
    (_attention, (_randn(2, 3, 7, 8), _randn(2, 3, 7, 8), _randn(2, 3, 7, 8)), "attention"),
    (_add_layer_norm, (_randn(5, 16), _randn(5, 16), _randn(16), _randn(16)), "fuse-add-norm"),
]


@pytest.mark.parametrize("fn, inputs, rule", COMPOSITES, ids=[c[2] for c in COMPOSITES])
def test_every_pass_forced_on_rewrites_what_it_matches_and_keeps_its_value(fn, inputs, rule):
    """The single ops above give the passes nothing to match; these small compositions do."""
    compiled = torch.compile(fn, backend="kernelpytorch", options={"codegen": "eager", **_every_pass_on()})
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), rtol=1e-4, atol=1e-5)
    assert rule in kpt_compiler.last_report().fired(), kpt_compiler.last_report().fired()


def test_conv_bn_folds_with_every_pass_forced_on():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2)
    x = _randn(2, 3, 9, 9)
    compiled = torch.compile(model, backend="kernelpytorch", options={"codegen": "eager", **_every_pass_on()})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert "fold-conv-bn" in kpt_compiler.last_report().fired()
