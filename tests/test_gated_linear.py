"""kernels/gated_linear.py: act(x @ Wg^T) * (x @ Wu^T) in one Triton kernel (Triton's interpreter on the CPU).

Numerics against the float64 reference at odd and round shapes and every activation; the kernel (not the
eager fallback) must have run. Autograd, opcheck, torch.compile, bad input.
"""

import pytest
import torch

pytest.importorskip("triton")
if not __import__("kpt_compiler.kernels._launch", fromlist=["x"]).INTERPRETER_OK \
        and not __import__("torch").cuda.is_available():
    pytest.skip("triton 3.5's interpreter cannot run the GEMM kernels (3.6+ can)", allow_module_level=True)

from triton.runtime.errors import OutOfResources  # noqa: E402

from kpt_compiler.kernels import _gemm_common, _launch, _tma_gemm  # noqa: E402
from kpt_compiler.kernels import gated_linear as gl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not _launch.kernel_runs(torch.empty(0), _gemm_common.GEMM_DTYPES, needs_3_6_interpreter=True):
    pytest.skip("the kernel runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1 before import)",
                allow_module_level=True)

SHAPES = [(1, 16, 16), (9, 41, 33), (64, 48, 80), (130, 72, 40)]  # (M, N, K)
# One rounding of a float32 result: fp16 is within half an ulp (2^-11 relative) of the float64 reference.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-4, 1e-3)}  # dtype: (atol, rtol)
ACTIVATIONS = list(gl.ACTIVATIONS)


def _inputs(M, N, K, dtype, batch=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, M, K, generator=g)
    w_gate = torch.randn(N, K, generator=g) / K ** 0.5
    w_up = torch.randn(N, K, generator=g) / K ** 0.5
    return [t.to(DEVICE, dtype) for t in (x, w_gate, w_up)]


def _check_kernel_result(args, activation):
    before = gl.launches["gated_linear"]
    out = gl.gated_linear(*args, activation=activation)
    assert gl.launches["gated_linear"] == before + 1, "the op did not run the Triton kernel"
    ref = gl.reference(*[t.double() for t in args], activation=activation)
    atol, rtol = TOLERANCES[args[0].dtype]
    assert out.dtype == args[0].dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape, dtype, activation):
    _check_kernel_result(_inputs(*shape, dtype), activation)


def test_leading_batch_dims():
    args = _inputs(5, 24, 40, torch.float32, batch=(2,))
    assert args[0].shape == (2, 5, 40)
    _check_kernel_result(args, "silu")


def test_strided_inputs():
    x, w_gate, w_up = _inputs(33, 24, 40, torch.float32)
    both = torch.cat([w_gate, w_up])  # one [2N, K] weight, as a fused checkpoint stores it
    x_s = torch.cat([x, x], dim=1)[:, ::2]  # stride 2 along K
    _check_kernel_result([x_s, both[:24], both[24:].t().contiguous().t()], "gelu_tanh")


def test_float64_and_no_interpreter_use_the_reference(monkeypatch):
    x, w_gate, w_up = _inputs(9, 41, 33, torch.float64)
    before = dict(gl.launches)
    torch.testing.assert_close(gl.gated_linear(x, w_gate, w_up), gl.reference(x, w_gate, w_up))
    if DEVICE == "cpu":
        monkeypatch.setattr("kpt_compiler.kernels._launch.INTERPRETED", False)
        x, w_gate, w_up = _inputs(9, 41, 33, torch.float32)
        torch.testing.assert_close(gl.gated_linear(x, w_gate, w_up), gl.reference(x, w_gate, w_up))
    assert dict(gl.launches) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [3, 70])
def test_every_autotune_config_left_after_pruning(M, dtype):
    x, w_gate, w_up = _inputs(M, 300, 96, dtype)
    configs = _gemm_common.prune_configs(gl.CONFIGS, {"M": M, "x_ptr": x})
    assert configs and all(c.kwargs["BLOCK_M"] <= 64 if M <= 64 else c.kwargs["BLOCK_M"] >= 64 for c in configs)
    ref = gl.reference(x.double(), w_gate.double(), w_up.double(), activation="silu")
    atol, rtol = TOLERANCES[dtype]
    for c in configs:
        config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        try:
            out = gl._launch(x, w_gate, w_up, "silu", config=config)
        except OutOfResources:  # on a GPU: the autotuner skips such a config too
            continue
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{config}: {m}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_match_autograd_on_the_reference(activation):
    args = [t.requires_grad_() for t in _inputs(9, 41, 33, torch.float32, batch=(2,))]
    gl.gated_linear(*args, activation=activation).square().sum().backward()
    ref_args = [t.detach().double().requires_grad_() for t in args]
    gl.reference(*ref_args, activation=activation).square().sum().backward()
    for name, t, ref in zip(("x", "w_gate", "w_up"), args, ref_args):
        torch.testing.assert_close(t.grad.double(), ref.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation):
    args = [t.requires_grad_() for t in _inputs(3, 5, 4, torch.float64, batch=(2,))]
    assert torch.autograd.gradcheck(lambda *a: gl.gated_linear(*a, activation=activation), args)


def test_opcheck():
    args = [t.requires_grad_() for t in _inputs(9, 41, 33, torch.float32)]
    torch.library.opcheck(torch.ops.kpt.gated_linear.default, (*args, "silu"))


def test_torch_compile_aot_eager():
    def fn(x, w_gate, w_up):
        return gl.gated_linear(x, w_gate, w_up) + 1

    args = _inputs(9, 41, 33, torch.float32, batch=(2,))
    before = gl.launches["gated_linear"]
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    assert gl.launches["gated_linear"] > before
    torch.testing.assert_close(out, fn(*args))


@pytest.mark.parametrize("change, message", [
    (dict(w_gate=torch.randn(41, 32)), "w_gate: K mismatch"),
    (dict(w_up=torch.randn(41, 34)), "w_up: K mismatch"),
    (dict(w_up=torch.randn(40, 33)), "w_up: N mismatch"),
    (dict(w_gate=torch.randn(33)), "w_gate: expected 2 dimensions"),
    (dict(w_up=torch.randn(41, 33, dtype=torch.float64)), "w_up: dtype"),
    (dict(activation="swiglu"), "activation: unknown 'swiglu'"),
])
def test_bad_input_names_what_is_wrong(change, message):
    x, w_gate, w_up = _inputs(9, 41, 33, torch.float32)
    kw = dict(x=x, w_gate=change.get("w_gate", w_gate), w_up=change.get("w_up", w_up),
              activation=change.get("activation", "silu"))
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=message):
        gl.gated_linear(**kw)



# ---------------------------------------------------------------------------------------------------------
# The persistent TMA kernel's gated form (Hopper, M >= TMA_MIN_M), run here directly in the interpreter: one
# 3-D descriptor spans both weights wherever they are (separate tensors, or halves of one in either order).
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["separate", "gate_then_up", "up_then_gate"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M, N, K", [(70, 40, 48), (33, 72, 80)])  # N not a multiple of the tile; a K tail
def test_tma_gated_kernel_matches_float64_reference(M, N, K, dtype, activation, layout):
    x, w_gate, w_up = _inputs(M, N, K, dtype)
    if layout != "separate":  # both weights in one buffer, as a fused gate_up projection stores them
        both = torch.cat([w_gate, w_up] if layout == "gate_then_up" else [w_up, w_gate])
        w_gate, w_up = (both[:N], both[N:]) if layout == "gate_then_up" else (both[N:], both[:N])
    assert _tma_gemm.gated_tma_ok(w_gate, w_up)
    config = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, EPILOGUE_SUBTILE=False)
    before = _tma_gemm.launches["tma"]
    out = _tma_gemm.launch_tma_gated(x, w_gate, w_up, activation, config=config, num_sms=3)
    assert _tma_gemm.launches["tma"] == before + 1
    atol, rtol = TOLERANCES[dtype]
    ref = gl.reference(x.double(), w_gate.double(), w_up.double(), activation)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_tma_gated_needs_distinct_weights_with_one_row_stride():
    w = torch.randn(32, 16)
    assert not _tma_gemm.gated_tma_ok(w, w)  # the same tensor twice: no distance to stride over
    assert not _tma_gemm.gated_tma_ok(w, torch.randn(32, 24)[:, :16])  # another row stride
    assert _tma_gemm.gated_tma_ok(w, torch.randn(32, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_op_form_matches_float64_reference(monkeypatch, dtype):
    """torch.ops.kpt.gated_linear_triton (what Inductor traces on CUDA), called directly: it launches the
    pointer kernel itself; float64 goes to the inference op (the reference)."""
    calls = []
    real = _launch.wrapped_launch
    monkeypatch.setattr(gl, "wrapped_launch", lambda kernel, *a, **k: (calls.append(kernel), real(kernel, *a, **k)))
    args = _inputs(9, 41, 33, dtype, batch=(2,))
    before = dict(gl.launches)
    out = torch.ops.kpt.gated_linear_triton(*args, "silu")
    assert calls == [gl._gated_linear_kernel] and dict(gl.launches) == before
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), gl.reference(*[t.double() for t in args], "silu"), atol=atol, rtol=rtol)
    args = [t.double() for t in args]
    torch.testing.assert_close(torch.ops.kpt.gated_linear_triton(*args, "gelu"), gl.reference(*args, "gelu"))
    assert len(calls) == 1
