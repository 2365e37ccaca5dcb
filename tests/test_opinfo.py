"""PyTorch's own OpInfo samples through the backend: 100 ops spread over the op database, one sample each, in
float32 on the CPU (codegen="eager": the rewritten ATen graph as it is), with the default options and with
every pass forced on; each result against eager. An op no pass touches must come out as eager computes it,
and one a pass rewrites must keep its value."""

import pytest
import torch

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
    try:
        return pytest.importorskip("torch.testing._internal.common_methods_invocations",
                                   reason="PyTorch's OpInfo database (needs expecttest)").op_db
    finally:
        flags["__allow_nonbracketed_mutation_flag"] = allowed


def _ops():
    ops = sorted((o for o in _op_db() if not any(r in o.name for r in RANDOM)
                  and torch.float32 in o.supported_dtypes("cpu")), key=lambda o: (o.name, o.variant_test_name))
    return ops[::max(1, len(ops) // COUNT)][:COUNT]


def _every_pass_on() -> dict:
    options = {spec.key: True for name, spec in kpt_compiler.registered_passes().items()
               if not name.startswith("test-") and spec.stage != "wrap"}
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
