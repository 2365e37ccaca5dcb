"""kernels/rms_norm.py: residual add + RMSNorm against the exact torch code each variant claims to reproduce.

On a machine without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before they are imported), in fp32 and fp16; with a GPU they run on it. Every test that calls the op
asserts that the Triton kernels ran, so a dispatch that fell back to the eager reference would fail.
"""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kpt_compiler.kernels import rms_norm as K  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}  # dtype: (atol, rtol)
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 4e-3}  # dtype: largest |grad - fp64 grad| / max |fp64 grad|
SHAPES = [(1, 16), (9, 41), (7, 341), (3, 4231), (2, 5, 41), (67, 41)]  # (67, 41): several tiles per program


def _inputs(shape, dtype, residual=True, weight_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    r = torch.randn(shape, generator=g).to(DEVICE, dtype) if residual else None
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(DEVICE, weight_dtype or dtype)
    return x, r, w


class _Launched:
    """Asserts that the named Triton kernels launched inside the block."""

    def __init__(self, *kernels):
        self.kernels = kernels

    def __enter__(self):
        self.before = {k: K.launches[k] for k in self.kernels}

    def __exit__(self, *exc):
        if exc[0] is None:
            for k in self.kernels:
                assert K.launches[k] > self.before[k], f"{k} did not launch: the op fell back to the reference"


def _hf_llama_rms_norm(hidden_states, weight, eps):
    """transformers' LlamaRMSNorm.forward, written out (self.weight -> weight, self.variance_epsilon -> eps)."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def _torch_rms_norm(h, weight, eps):
    """F.rms_norm where torch has it, else the formula it computes (fp32 math, one rounding at the end)."""
    if hasattr(F, "rms_norm"):
        return F.rms_norm(h, (h.shape[-1],), weight, eps)
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (n if weight is None else n * weight.float()).to(h.dtype)


def _assert_within_one_rounding(out, ref):
    """|out - ref| <= one unit in the last place of ref (in ref's dtype), and most elements equal."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    r = ref.float()
    _, e = torch.frexp(r)
    ulp = torch.ldexp(torch.full_like(r, torch.finfo(ref.dtype).eps), e - 1).clamp_min(torch.finfo(ref.dtype).tiny)
    assert ((out.float() - r).abs() <= ulp).all(), (out.float() - r).abs().max()
    assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_forward_matches_reference(shape, dtype, residual, cast_before_weight):
    x, r, w = _inputs(shape, dtype, residual)
    with _Launched("add_rms_norm_fwd"):
        y, h = K.add_rms_norm(x, r, w, 1e-6, cast_before_weight)
    y_ref, h_ref = K.reference(x, r, w, 1e-6, cast_before_weight)
    assert torch.equal(h, h_ref)  # the add is rounded exactly as torch rounds it
    if r is None:
        assert h is x
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                                 (torch.float32, torch.float32)])
def test_cast_before_weight_is_hf_llama_rms_norm(dtype, weight_dtype):
    x, r, w = _inputs((7, 341), dtype, weight_dtype=weight_dtype)
    with _Launched("add_rms_norm_fwd"):
        y, h = K.add_rms_norm(x, r, w, 1e-6, cast_before_weight=True)
    ref = _hf_llama_rms_norm(x + r, w, 1e-6)
    assert y.dtype == ref.dtype == torch.promote_types(dtype, weight_dtype)
    if y.dtype == torch.float16:
        _assert_within_one_rounding(y, ref)
    else:  # fp32 output: only the order of the sum differs
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(9, 41), (3, 4231)])
def test_cast_after_weight_is_torch_rms_norm(shape):
    x, r, w = _inputs(shape, torch.float16)
    with _Launched("add_rms_norm_fwd"):
        y, h = K.add_rms_norm(x, r, w, 1e-6, cast_before_weight=False)
    ref = _torch_rms_norm(x + r, w, 1e-6)
    _assert_within_one_rounding(y, ref)
    # what F.rms_norm computes: the formula of the module docstring, bit for bit (fp32 weight product, one rounding)
    hf = (x + r).float()
    formula = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).half()
    assert torch.equal(ref, formula)
    # and torch's own RMSNorm module is the same function
    module = torch.nn.RMSNorm(shape[-1], eps=1e-6, device=DEVICE, dtype=torch.float16)
    with torch.no_grad():
        module.weight.copy_(w)
    assert torch.equal(module(x + r), ref)


def test_the_two_variants_differ():
    # the pass must pick the right one: in fp16 they round differently
    x, r, w = _inputs((9, 341), torch.float16)
    y_hf, _ = K.add_rms_norm(x, r, w, cast_before_weight=True)
    y_torch, _ = K.add_rms_norm(x, r, w, cast_before_weight=False)
    assert not torch.equal(y_hf, y_torch)


def _grads_fp64(x, r, w, gy, gh, cast_before_weight):
    leaves = [t.detach().double().requires_grad_() for t in (x, r, w) if t is not None]
    xd, wd = leaves[0], leaves[-1]
    rd = leaves[1] if r is not None else None
    y, h = K.reference(xd, rd, wd, 1e-6, cast_before_weight)
    torch.autograd.backward([y, h], [gy.double(), gh.double()])
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_gradients_against_fp64_autograd(shape, dtype, residual, cast_before_weight):
    x, r, w = _inputs(shape, dtype, residual)
    leaves = [t.requires_grad_() for t in (x, r, w) if t is not None]
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(shape, generator=g).to(DEVICE, dtype)
    gh = torch.randn(shape, generator=g).to(DEVICE, dtype)  # the model uses h too (the next residual)
    with _Launched("add_rms_norm_fwd", "add_rms_norm_bwd"):
        y, h = K.add_rms_norm(x, r, w, 1e-6, cast_before_weight)
        torch.autograd.backward([y, h], [gy, gh])
    for name, t, ref in zip(["x", "residual", "weight"] if residual else ["x", "weight"], leaves,
                            _grads_fp64(x, r, w, gy, gh, cast_before_weight)):
        assert t.grad.dtype == t.dtype, name
        err = (t.grad.double() - ref).abs().max() / ref.abs().max()
        assert err < GRAD_TOL[dtype], f"d{name}: {err:.2e}"


def test_gradient_without_upstream_gradient_on_h():
    x, r, w = _inputs((9, 41), torch.float32)
    for t in (x, r, w):
        t.requires_grad_()
    y, _ = K.add_rms_norm(x, r, w)
    y.sum().backward()  # h unused: its gradient is None, not zeros
    ref = _grads_fp64(x, r, w, torch.ones_like(y), torch.zeros_like(y), True)
    for t, g in zip((x, r, w), ref):
        torch.testing.assert_close(t.grad.double(), g, atol=1e-5, rtol=1e-5)
    # only h used: the norm contributes nothing, h = x + residual passes the gradient through
    x.grad = r.grad = w.grad = None
    _, h = K.add_rms_norm(x, r, w)
    h.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))


def test_reference_fallback_without_triton(monkeypatch):
    # CPU tensors without the interpreter run the eager reference, forward and backward
    x, r, w = (t.cpu() for t in _inputs((7, 341), torch.float32))
    monkeypatch.setattr(K, "kernel_runs", lambda t: False)
    for t in (x, r, w):
        t.requires_grad_()
    before = dict(K.launches)
    y, h = K.add_rms_norm(x, r, w)
    (y.sum() + h.square().sum()).backward()
    assert dict(K.launches) == before
    ref = _grads_fp64(x, r, w, torch.ones_like(y), 2 * h.detach(), True)
    torch.testing.assert_close(y, K.reference(x, r, w)[0])
    for t, g in zip((x, r, w), ref):
        torch.testing.assert_close(t.grad.double(), g, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("residual", [True, False])
def test_opcheck(residual):
    x, r, w = _inputs((5, 41), torch.float32, residual)
    for t in (x, r, w):
        if t is not None:
            t.requires_grad_()
    torch.library.opcheck(torch.ops.kpt.add_rms_norm.default, (x, r, w, 1e-6, True))
    y, h, rstd = torch.ops.kpt.add_rms_norm(x, r, w, 1e-6, False)
    h = h if residual else x
    args = (torch.randn_like(y), torch.randn_like(h) if residual else None, h.detach(), w.detach(), rstd, False, True)
    torch.library.opcheck(torch.ops.kpt.add_rms_norm_backward.default, args)


@pytest.mark.parametrize("residual", [True, False])
def test_aot_eager_compile_matches_eager(residual):
    def step(x, r, w):
        y, h = K.add_rms_norm(x, r, w, 1e-6, True)
        return y * 2, h + 1

    x, r, w = _inputs((2, 5, 41), torch.float32, residual)
    leaves = [t.requires_grad_() for t in (x, r, w) if t is not None]
    eager = step(x, r, w)
    grads = torch.autograd.grad(eager, leaves, [torch.ones_like(t) for t in eager])
    with _Launched("add_rms_norm_fwd", "add_rms_norm_bwd"):
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x, r, w)
        compiled_grads = torch.autograd.grad(compiled, leaves, [torch.ones_like(t) for t in compiled])
    for a, b in zip(eager + grads, compiled + compiled_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args, message", [
    (lambda x, r, w: (x, r, w[:-1]), r"weight has shape \(40,\); expected \(41,\)"),
    (lambda x, r, w: (x, r[:, :-1], w), r"residual has shape \(9, 40\) but x has \(9, 41\)"),
    (lambda x, r, w: (x, r.half(), w), "residual has dtype torch.float16 but x has torch.float32"),
    (lambda x, r, w: (x.long(), None, w), "x has dtype torch.int64"),
    (lambda x, r, w: (x, r, w.double()), "weight has dtype torch.float64"),
    (lambda x, r, w: (x[0, 0], None, None), "x is a scalar"),
    (lambda x, r, w: (x, r, w[None]), r"weight has shape \(1, 41\)"),
])
def test_bad_input_raises_value_error(args, message):
    x, r, w = _inputs((9, 41), torch.float32)
    with pytest.raises(ValueError, match=message):
        K.add_rms_norm(*args(x, r, w))


def test_too_wide_rows_raise_value_error():
    x = torch.zeros(1, K.MAX_N + 1, device=DEVICE)
    with pytest.raises(ValueError, match=f"last dimension is {K.MAX_N + 1}; supported: 1 to {K.MAX_N}"):
        K.add_rms_norm(x, None, None)


def test_strided_rows_and_no_weight():
    # rows that are not contiguous with each other (a slice of a wider tensor), and no weight at all
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(9, 64, generator=g).to(DEVICE)
    x, r = wide[:, :41], wide[:, 20:61]
    with _Launched("add_rms_norm_fwd"):
        y, h = K.add_rms_norm(x, r, None)
    torch.testing.assert_close(y, K.reference(x, r, None)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, _torch_rms_norm(x + r, None, 1e-6), atol=1e-5, rtol=1e-5)
