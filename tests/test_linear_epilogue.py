"""kernels/linear_epilogue.py: act(x @ W^T + b) + r in one Triton kernel (Triton's interpreter on the CPU).

Numerics against the float64 reference at odd and round shapes, every activation, with and without bias and
residual; the kernel (not the eager fallback) must have run. Autograd, opcheck, torch.compile, bad input.
"""

import pytest
import torch

pytest.importorskip("triton")
if not __import__("kpt_compiler.kernels._launch", fromlist=["x"]).INTERPRETER_OK \
        and not __import__("torch").cuda.is_available():
    pytest.skip("triton 3.5's interpreter cannot run the GEMM kernels (3.6+ can)", allow_module_level=True)

from triton.runtime.errors import OutOfResources  # noqa: E402

from kpt_compiler.kernels import _gemm_common, _launch, _tma_gemm  # noqa: E402
from kpt_compiler.kernels import linear_epilogue as le  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not _launch.kernel_runs(torch.empty(0), _gemm_common.GEMM_DTYPES, needs_3_6_interpreter=True):
    pytest.skip("the kernel runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1 before import)",
                allow_module_level=True)

SHAPES = [(1, 16, 16), (9, 41, 33), (64, 48, 80), (130, 72, 40)]  # (M, N, K)
# One rounding of a float32 result: fp16 is within half an ulp (2^-11 relative) of the float64 reference.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-4, 1e-3)}  # dtype: (atol, rtol)
ACTIVATIONS = list(le.ACTIVATIONS)


def _inputs(M, N, K, dtype, batch=(), bias=True, residual=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    r = torch.randn(*batch, M, N, generator=g) if residual else None
    return [t if t is None else t.to(DEVICE, dtype) for t in (x, w, b, r)]


def _double(*ts):
    return [t if t is None else t.double() for t in ts]


def _check_kernel_result(args, activation):
    before = le.launches["linear_epilogue"]
    out = le.linear_epilogue(*args, activation=activation)
    assert le.launches["linear_epilogue"] == before + 1, "the op did not run the Triton kernel"
    ref = le.reference(*_double(*args), activation=activation)
    atol, rtol = TOLERANCES[args[0].dtype]
    assert out.dtype == args[0].dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape, dtype, activation):
    _check_kernel_result(_inputs(*shape, dtype), activation)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_bias_and_residual_are_optional(bias, residual, dtype):
    _check_kernel_result(_inputs(9, 41, 33, dtype, bias=bias, residual=residual), "gelu")


def test_leading_batch_dims():
    args = _inputs(5, 24, 40, torch.float32, batch=(2,))
    assert args[0].shape == (2, 5, 40)
    _check_kernel_result(args, "silu")


def test_strided_inputs():
    x, w, b, r = _inputs(33, 24, 40, torch.float32)
    w_t = w.t().contiguous().t()  # [N, K] with column-major strides
    x_s = torch.cat([x, x], dim=1)[:, ::2]  # stride 2 along K
    r_t = r.t().contiguous().t()
    _check_kernel_result([x_s, w_t, b, r_t], "relu")


def test_float64_and_no_interpreter_use_the_reference(monkeypatch):
    x, w, b, r = _inputs(9, 41, 33, torch.float64)
    before = dict(le.launches)
    torch.testing.assert_close(le.linear_epilogue(x, w, b, r, "gelu"), le.reference(x, w, b, r, "gelu"))
    if DEVICE == "cpu":
        monkeypatch.setattr(_launch, "INTERPRETED", False)
        x, w, b, r = _inputs(9, 41, 33, torch.float32)
        torch.testing.assert_close(le.linear_epilogue(x, w, b, r, "gelu"), le.reference(x, w, b, r, "gelu"))
    assert dict(le.launches) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [3, 70])
def test_every_autotune_config_left_after_pruning(M, dtype):
    x, w, b, r = _inputs(M, 300, 96, dtype)
    configs = _gemm_common.prune_configs(le.CONFIGS, {"M": M, "x_ptr": x})
    assert configs and all(c.kwargs["BLOCK_M"] <= 64 if M <= 64 else c.kwargs["BLOCK_M"] >= 64 for c in configs)
    if dtype == torch.float32:  # float32 tiles take twice the shared memory: half the K step
        assert max(c.kwargs["BLOCK_K"] for c in configs) < max(c.kwargs["BLOCK_K"] for c in le.CONFIGS)
    ref = le.reference(*_double(x, w, b, r), activation="gelu_tanh")
    atol, rtol = TOLERANCES[dtype]
    for c in configs:
        config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        try:
            out = le._launch(x, w, b, r, "gelu_tanh", config=config)
        except OutOfResources:  # on a GPU: the autotuner skips such a config too
            continue
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{config}: {m}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_match_autograd_on_the_reference(activation):
    args = [t.requires_grad_() for t in _inputs(9, 41, 33, torch.float32, batch=(2,))]
    le.linear_epilogue(*args, activation=activation).square().sum().backward()
    ref_args = [t.detach().double().requires_grad_() for t in args]
    le.reference(*ref_args, activation=activation).square().sum().backward()
    for name, t, ref in zip(("x", "weight", "bias", "residual"), args, ref_args):
        torch.testing.assert_close(t.grad.double(), ref.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation):
    args = [t.requires_grad_() for t in _inputs(3, 5, 4, torch.float64, batch=(2,))]
    assert torch.autograd.gradcheck(lambda *a: le.linear_epilogue(*a, activation=activation), args)


def test_only_the_needed_gradients():
    x, w, b, r = _inputs(9, 41, 33, torch.float32)
    w.requires_grad_()
    le.linear_epilogue(x, w, b, r, "silu").sum().backward()
    assert w.grad is not None and x.grad is None and b.grad is None


@pytest.mark.parametrize("bias, residual", [(True, True), (False, False)], ids=["bias-res", "plain"])
def test_opcheck(bias, residual):
    args = _inputs(9, 41, 33, torch.float32, bias=bias, residual=residual)
    args = [t if t is None else t.requires_grad_() for t in args]
    torch.library.opcheck(torch.ops.kpt.linear_epilogue.default, (*args, "gelu_tanh"))


def test_torch_compile_aot_eager():
    def fn(x, w, b, r):
        return le.linear_epilogue(x, w, b, r, activation="gelu") * 2

    args = _inputs(9, 41, 33, torch.float32, batch=(2,))
    before = le.launches["linear_epilogue"]
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    assert le.launches["linear_epilogue"] > before
    torch.testing.assert_close(out, fn(*args))


@pytest.mark.parametrize("change, message", [
    (dict(w=torch.randn(41, 32)), "weight: K mismatch"),
    (dict(w=torch.randn(41, 33, 1)), "weight: expected 2 dimensions"),
    (dict(b=torch.randn(40)), r"bias: expected shape \(41,\)"),
    (dict(r=torch.randn(9, 40)), r"residual: expected shape \(9, 41\)"),
    (dict(b=torch.randn(41, dtype=torch.float64)), "bias: dtype"),
    (dict(activation="swish"), "activation: unknown 'swish'"),
])
def test_bad_input_names_what_is_wrong(change, message):
    x, w, b, r = _inputs(9, 41, 33, torch.float32)
    kw = dict(x=x, weight=change.get("w", w), bias=change.get("b", b), residual=change.get("r", r),
              activation=change.get("activation", "none"))
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=message):
        le.linear_epilogue(**kw)


# ---------------------------------------------------------------------------------------------------------
# The persistent TMA kernel (Hopper's path for M >= TMA_MIN_M), run here directly in the interpreter with a
# small persistent grid, so each program walks several tiles; on a GPU, tests/gpu covers the op's dispatch.
# ---------------------------------------------------------------------------------------------------------
TMA_SHAPES = [(70, 48, 40), (33, 80, 72), (128, 64, 16)]  # (M, N, K); rows 16-byte aligned for TMA


@pytest.mark.parametrize("subtile", [False, True], ids=["whole", "subtile"])
@pytest.mark.parametrize("activation, bias, residual", [("gelu_tanh", True, True), ("none", False, False),
                                                        ("relu", False, True), ("silu", True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tma_kernel_matches_float64_reference(shape, dtype, activation, bias, residual, subtile):
    x, w, b, r = _inputs(*shape, dtype, bias=bias, residual=residual)
    config = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, EPILOGUE_SUBTILE=subtile)
    before = _tma_gemm.launches["tma"]
    out = _tma_gemm.launch_tma(x, w, b, r, activation, config=config, num_sms=3)
    assert _tma_gemm.launches["tma"] == before + 1
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), le.reference(*_double(x, w, b, r), activation=activation),
                               atol=atol, rtol=rtol)


def test_tma_configs_halve_the_k_step_for_float32():
    from triton.tools.tensor_descriptor import TensorDescriptor

    full = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps): c.kwargs["BLOCK_K"]
            for c in _tma_gemm.TMA_CONFIGS}
    for dtype, divisor in ((torch.float16, 1), (torch.float32, 2)):  # float32 tiles take twice the shared memory
        desc = TensorDescriptor.from_tensor(torch.empty(64, 64, dtype=dtype), [1, 1])
        kept = _tma_gemm.prune_tma_configs(_tma_gemm.TMA_CONFIGS, {"x_desc": desc, "M": 4096})
        assert len(kept) == len(_tma_gemm.TMA_CONFIGS)
        for c in kept:
            assert c.kwargs["BLOCK_K"] == full[c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps] // divisor


def test_tma_not_used_off_hopper_or_unaligned():
    x = torch.empty(128, 64)
    assert not _tma_gemm.tma_ok(x)  # CPU tensors: the op runs the pointer kernel (or the reference)
    if torch.cuda.is_available():
        xc = torch.empty(128, 63, device="cuda", dtype=torch.float16)  # 126-byte rows: not 16-byte aligned
        assert not _tma_gemm.tma_ok(xc)


def _count_wrapped_launches(monkeypatch):
    calls = []
    real = _launch.wrapped_launch

    def counted(kernel, *args, **kwargs):
        calls.append(kernel)
        return real(kernel, *args, **kwargs)
    monkeypatch.setattr(le, "wrapped_launch", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias, residual", [(True, True), (False, False)], ids=["bias-res", "plain"])
def test_triton_op_form_matches_float64_reference(monkeypatch, dtype, bias, residual):
    """torch.ops.kpt.linear_epilogue_triton (what Inductor traces on CUDA), called directly: it launches the
    pointer kernel itself, with strided inputs and leading batch dimensions."""
    calls = _count_wrapped_launches(monkeypatch)
    x, w, b, r = _inputs(9, 41, 33, dtype, batch=(2,), bias=bias, residual=residual)
    x = torch.cat([x, x], dim=-1)[..., ::2]  # stride 2 along K
    before = dict(le.launches)
    out = torch.ops.kpt.linear_epilogue_triton(x, w, b, r, "gelu_tanh")
    assert calls == [le._linear_epilogue_kernel] and dict(le.launches) == before  # not the inference op
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), le.reference(*_double(x, w, b, r), activation="gelu_tanh"),
                               atol=atol, rtol=rtol)


def test_triton_op_form_hands_the_rest_to_the_inference_op(monkeypatch):
    """float64 (the reference) and GEMMs large enough for the TMA kernel go to the inference op inside it."""
    calls = _count_wrapped_launches(monkeypatch)
    x, w, b, r = _inputs(9, 41, 33, torch.float64)
    torch.testing.assert_close(torch.ops.kpt.linear_epilogue_triton(x, w, b, r, "relu"),
                               le.reference(x, w, b, r, "relu"))
    monkeypatch.setattr(le, "use_tma", lambda M, N, K: True)
    x, w, b, r = _inputs(9, 41, 33, torch.float32)
    before = le.launches["linear_epilogue"]
    out = torch.ops.kpt.linear_epilogue_triton(x, w, b, r, "relu")
    assert le.launches["linear_epilogue"] == before + 1 and calls == []
    torch.testing.assert_close(out.double(), le.reference(*_double(x, w, b, r), activation="relu"),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("M", [3, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inductor_autotuner_holds_the_pruned_configs(M, dtype):
    """Inductor autotunes a traced kernel over its ``configs`` without our pruning: the autotuner it is given
    must hold exactly what prune_configs keeps for the shape and dtype."""
    tuner = _launch.inductor_autotuner(le._linear_epilogue_kernel, le.CONFIGS, M, dtype)
    kept = _gemm_common.prune_configs(le.CONFIGS, {"M": M, "x_ptr": torch.empty(0, dtype=dtype)})
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in tuner.configs] == \
        [(c.kwargs, c.num_warps, c.num_stages) for c in kept]
    assert tuner is _launch.inductor_autotuner(le._linear_epilogue_kernel, le.CONFIGS, M, dtype)
