"""kernels/layer_norm.py: residual add + LayerNorm against F.layer_norm, forward and backward.

On a machine without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before they are imported), in fp32 and fp16; with a GPU they run on it. Every test that calls the op
asserts that the Triton kernels ran, so a dispatch that fell back to the eager reference would fail.
"""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kpt_compiler.kernels import layer_norm as L  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}  # dtype: (atol, rtol)
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 4e-3}  # dtype: largest |grad - fp64 grad| / max |fp64 grad|
SHAPES = [(1, 16), (9, 41), (7, 341), (3, 4231), (2, 5, 41), (67, 41)]  # (67, 41): several tiles per program
PARAMS = ["weight+bias", "weight", "bias", "none"]


def _inputs(shape, dtype, residual=True, params="weight+bias", param_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    r = torch.randn(shape, generator=g).to(DEVICE, dtype) if residual else None
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(DEVICE, param_dtype or dtype)
    b = (0.5 * torch.randn(shape[-1], generator=g)).to(DEVICE, param_dtype or dtype)
    return x, r, (w if "weight" in params else None), (b if params in ("weight+bias", "bias") else None)


class _Launched:
    """Asserts that the named Triton kernels launched inside the block."""

    def __init__(self, *kernels):
        self.kernels = kernels

    def __enter__(self):
        self.before = {k: L.launches[k] for k in self.kernels}

    def __exit__(self, *exc):
        if exc[0] is None:
            for k in self.kernels:
                assert L.launches[k] > self.before[k], f"{k} did not launch: the op fell back to the reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("params", PARAMS)
def test_forward_matches_f_layer_norm(shape, dtype, residual, params):
    x, r, w, b = _inputs(shape, dtype, residual, params)
    with _Launched("add_layer_norm_fwd"):
        y, h = L.add_layer_norm(x, r, w, b, 1e-5)
    h_ref = x + r if r is not None else x
    assert torch.equal(h, h_ref)  # the add is rounded exactly as torch rounds it
    if r is None:
        assert h is x
    y_ref = F.layer_norm(h_ref, (shape[-1],), w, b, 1e-5)
    assert y.dtype == y_ref.dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    if dtype == torch.float16:  # within one rounding of torch's result, nearly always equal
        assert ((y.float() - y_ref.float()).abs() <= y_ref.float().abs() * 2 ** -10 + 2 ** -24).all()
        assert (y == y_ref).float().mean() > 0.98


def test_fp32_parameters_with_fp16_activations():
    x, r, w, b = _inputs((7, 341), torch.float16, param_dtype=torch.float32)
    with _Launched("add_layer_norm_fwd"):
        y, h = L.add_layer_norm(x, r, w, b)
    assert y.dtype == torch.float16
    ref = F.layer_norm((x + r).float(), (341,), w, b, 1e-5).half()
    torch.testing.assert_close(y, ref, atol=2e-3, rtol=2e-3)


def _grads_fp64(x, r, w, b, gy, gh):
    given = [t for t in (x, r, w, b) if t is not None]
    leaves = [t.detach().double().requires_grad_() for t in given]
    it = iter(leaves)
    xd, rd, wd, bd = (next(it) if t is not None else None for t in (x, r, w, b))
    y, h = L.reference(xd, rd, wd, bd, 1e-5)
    torch.autograd.backward([y, h], [gy.double(), gh.double()])
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("params", ["weight+bias", "none"])
def test_gradients_against_fp64_autograd(shape, dtype, residual, params):
    x, r, w, b = _inputs(shape, dtype, residual, params)
    names = [n for n, t in zip(["x", "residual", "weight", "bias"], (x, r, w, b)) if t is not None]
    leaves = [t.requires_grad_() for t in (x, r, w, b) if t is not None]
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(shape, generator=g).to(DEVICE, dtype)
    gh = torch.randn(shape, generator=g).to(DEVICE, dtype)  # the model uses h too (the next residual)
    with _Launched("add_layer_norm_fwd", "add_layer_norm_bwd"):
        y, h = L.add_layer_norm(x, r, w, b, 1e-5)
        torch.autograd.backward([y, h], [gy, gh])
    for name, t, ref in zip(names, leaves, _grads_fp64(x, r, w, b, gy, gh)):
        assert t.grad.dtype == t.dtype, name
        err = (t.grad.double() - ref).abs().max() / ref.abs().max()
        assert err < GRAD_TOL[dtype], f"d{name}: {err:.2e}"


def test_gradient_without_upstream_gradient_on_h():
    x, r, w, b = _inputs((9, 41), torch.float32)
    for t in (x, r, w, b):
        t.requires_grad_()
    y, _ = L.add_layer_norm(x, r, w, b)
    (y * torch.arange(41.0, device=DEVICE)).sum().backward()  # h unused: its gradient is None, not zeros
    gy = torch.arange(41.0, device=DEVICE).expand(9, 41)
    ref = _grads_fp64(x, r, w, b, gy, torch.zeros_like(gy))
    for t, g in zip((x, r, w, b), ref):
        torch.testing.assert_close(t.grad.double(), g, atol=1e-4, rtol=1e-5)
    # only h used: h = x + residual passes the gradient through; the parameters get zeros
    x.grad = r.grad = w.grad = b.grad = None
    _, h = L.add_layer_norm(x, r, w, b)
    h.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))


def test_reference_fallback_without_triton(monkeypatch):
    # CPU tensors without the interpreter run the eager reference, forward and backward
    x, r, w, b = (t.cpu() for t in _inputs((7, 341), torch.float32))
    monkeypatch.setattr(L, "kernel_runs", lambda t: False)
    for t in (x, r, w, b):
        t.requires_grad_()
    before = dict(L.launches)
    y, h = L.add_layer_norm(x, r, w, b)
    (y.sum() + h.square().sum()).backward()
    assert dict(L.launches) == before
    torch.testing.assert_close(y, L.reference(x, r, w, b)[0])
    ref = _grads_fp64(x, r, w, b, torch.ones_like(y), 2 * h.detach())
    for t, g in zip((x, r, w, b), ref):
        torch.testing.assert_close(t.grad.double(), g, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("residual", [True, False])
def test_opcheck(residual):
    x, r, w, b = _inputs((5, 41), torch.float32, residual)
    for t in (x, r, w, b):
        if t is not None:
            t.requires_grad_()
    torch.library.opcheck(torch.ops.kpt.add_layer_norm.default, (x, r, w, b, 1e-5))
    y, h, mean, rstd = torch.ops.kpt.add_layer_norm(x, r, w, b, 1e-5)
    h = h if residual else x
    args = (torch.randn_like(y), torch.randn_like(h) if residual else None, h.detach(), w.detach(), mean, rstd,
            True, True)
    torch.library.opcheck(torch.ops.kpt.add_layer_norm_backward.default, args)


@pytest.mark.parametrize("residual", [True, False])
def test_aot_eager_compile_matches_eager(residual):
    def step(x, r, w, b):
        y, h = L.add_layer_norm(x, r, w, b, 1e-5)
        return y * 2, h + 1

    x, r, w, b = _inputs((2, 5, 41), torch.float32, residual)
    leaves = [t.requires_grad_() for t in (x, r, w, b) if t is not None]
    eager = step(x, r, w, b)
    grads = torch.autograd.grad(eager, leaves, [torch.ones_like(t) for t in eager])
    with _Launched("add_layer_norm_fwd", "add_layer_norm_bwd"):
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x, r, w, b)
        compiled_grads = torch.autograd.grad(compiled, leaves, [torch.ones_like(t) for t in compiled])
    for a, c in zip(eager + grads, compiled + compiled_grads):
        assert torch.equal(a, c)


def test_strided_rows():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(9, 64, generator=g).to(DEVICE)
    x, r = wide[:, :41], wide[:, 20:61]
    with _Launched("add_layer_norm_fwd"):
        y, h = L.add_layer_norm(x, r, None, None)
    torch.testing.assert_close(y, F.layer_norm(x + r, (41,), eps=1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args, message", [
    (lambda x, r, w, b: (x, r, w, b[:-1]), r"bias has shape \(40,\); expected \(41,\)"),
    (lambda x, r, w, b: (x, r, w[:-1], b), r"weight has shape \(40,\); expected \(41,\)"),
    (lambda x, r, w, b: (x, r[:, :-1], w, b), r"residual has shape \(9, 40\) but x has \(9, 41\)"),
    (lambda x, r, w, b: (x, r.half(), w, b), "residual has dtype torch.float16 but x has torch.float32"),
    (lambda x, r, w, b: (x.int(), None, w, b), "x has dtype torch.int32"),
    (lambda x, r, w, b: (x, r, w, b.double()), "bias has dtype torch.float64"),
    (lambda x, r, w, b: (x, r, w, torch.zeros(41, device="meta")), "bias is on meta"),
])
def test_bad_input_raises_value_error(args, message):
    x, r, w, b = _inputs((9, 41), torch.float32)
    with pytest.raises(ValueError, match=message):
        L.add_layer_norm(*args(x, r, w, b))
