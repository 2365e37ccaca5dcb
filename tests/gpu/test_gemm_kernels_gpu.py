"""The fused GEMM kernels on the GPU: bf16 at model sizes against float32, the backward, inside Inductor.

Run on the H100 machine: pytest -m gpu tests/gpu/test_gemm_kernels_gpu.py
Single rounding of a float32 result: bf16 is within half an ulp (2^-9 relative) of the float32 reference and
at least as accurate as the unfused bf16 sequence.
"""

import pytest
import torch
import torch.nn.functional as F

from kpt_compiler.bench import relative_error

pytest.importorskip("triton")

from kpt_compiler.kernels import _launch, _tma_gemm  # noqa: E402
from kpt_compiler.kernels import gated_linear as gl  # noqa: E402
from kpt_compiler.kernels import linear_epilogue as le  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [  # (M, K, N): Llama-ish projections at 8192 tokens, a short prefill, one decode token
    (8192, 1024, 1024), (8192, 1024, 2816), (8192, 1024, 4096), (128, 1024, 2816), (1, 1024, 4096),
]
BF16 = dict(atol=1e-4, rtol=4e-3)  # twice bf16's half ulp, relative


def _randn(*shape, scale=1.0, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def _linear_inputs(M, K, N, dtype=torch.bfloat16, bias=True, residual=True):
    return (_randn(M, K, dtype=dtype, seed=1), _randn(N, K, scale=K ** -0.5, dtype=dtype, seed=2),
            _randn(N, dtype=dtype, seed=3) if bias else None, _randn(M, N, dtype=dtype, seed=4) if residual else None)


def _gated_inputs(M, K, N, dtype=torch.bfloat16):
    return (_randn(M, K, dtype=dtype, seed=1), _randn(N, K, scale=K ** -0.5, dtype=dtype, seed=2),
            _randn(N, K, scale=K ** -0.5, dtype=dtype, seed=3))


def _float(*ts):
    return [t if t is None else t.float() for t in ts]


@pytest.mark.parametrize("activation, bias, residual", [("gelu_tanh", True, True), ("none", False, False),
                                                        ("silu", False, True)])
@pytest.mark.parametrize("M, K, N", SHAPES)
def test_linear_epilogue_bf16_at_model_sizes(M, K, N, activation, bias, residual):
    args = _linear_inputs(M, K, N, bias=bias, residual=residual)
    before = le.launches["linear_epilogue"]
    out = le.linear_epilogue(*args, activation=activation)
    assert le.launches["linear_epilogue"] == before + 1
    ref = le.reference(*_float(*args), activation=activation)
    torch.testing.assert_close(out.float(), ref, **BF16)
    eager = le.reference(*args, activation=activation)  # the unfused bf16 sequence
    assert relative_error(out, ref) <= 1.1 * relative_error(eager, ref) + 1e-6


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("M, K, N", SHAPES)
def test_gated_linear_bf16_at_model_sizes(M, K, N, activation):
    args = _gated_inputs(M, K, N)
    before = gl.launches["gated_linear"]
    out = gl.gated_linear(*args, activation=activation)
    assert gl.launches["gated_linear"] == before + 1
    ref = gl.reference(*_float(*args), activation=activation)
    torch.testing.assert_close(out.float(), ref, **BF16)
    eager = gl.reference(*args, activation=activation)
    assert relative_error(out, ref) <= 1.1 * relative_error(eager, ref) + 1e-6


@pytest.mark.parametrize("activation", list(le.ACTIVATIONS))
def test_every_activation_bf16(activation):
    args = _linear_inputs(1000, 1024, 1000)
    torch.testing.assert_close(le.linear_epilogue(*args, activation=activation).float(),
                               le.reference(*_float(*args), activation=activation), **BF16)
    args = _gated_inputs(1000, 1024, 1000)
    torch.testing.assert_close(gl.gated_linear(*args, activation=activation).float(),
                               gl.reference(*_float(*args), activation=activation), **BF16)


@pytest.mark.parametrize("precision, tol", [("highest", 1e-5), ("high", 2e-3)])
def test_float32_follows_torchs_matmul_precision(precision, tol):
    # float32 configs have half the K step (shared memory); "highest": IEEE float32 dot products, "high": TF32
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        args = _linear_inputs(520, 1000, 1030, dtype=torch.float32)
        ref = le.reference(*[t.double() for t in args], activation="gelu")
        assert relative_error(le.linear_epilogue(*args, activation="gelu"), ref) < tol
        args = _gated_inputs(520, 1000, 1030, dtype=torch.float32)
        ref = gl.reference(*[t.double() for t in args])
        assert relative_error(gl.gated_linear(*args), ref) < tol
    finally:
        torch.set_float32_matmul_precision(previous)


def _grads_vs_float32(fn, args, reference):
    args = [t if t is None else t.requires_grad_() for t in args]
    fn(*args).float().square().mean().backward()
    ref_args = [t if t is None else t.detach().float().requires_grad_() for t in args]
    reference(*ref_args).square().mean().backward()
    for t, r in zip(args, ref_args):
        if t is not None:
            assert relative_error(t.grad, r.grad) < 1e-2


def test_linear_epilogue_backward_bf16():
    _grads_vs_float32(lambda *a: le.linear_epilogue(*a, activation="gelu"), _linear_inputs(2048, 1024, 2816),
                      lambda *a: le.reference(*a, activation="gelu"))


def test_gated_linear_backward_bf16():
    _grads_vs_float32(gl.gated_linear, _gated_inputs(2048, 1024, 2816), gl.reference)


def _mlp_block(x, w_gate, w_up, w_down, b_down, fused=True):
    """A Llama MLP block with a residual: x + W_down (silu(W_gate h) * W_up h) + b_down, h = rms_norm(x)."""
    h = F.rms_norm(x, (x.shape[-1],))
    if fused:
        return le.linear_epilogue(gl.gated_linear(h, w_gate, w_up), w_down, b_down, x)
    return F.linear(gl.reference(h, w_gate, w_up), w_down, b_down) + x


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inside_inductor_on_cuda(mode):
    x = _randn(4, 256, 1024, seed=1)
    params = [_randn(2816, 1024, scale=1024 ** -0.5, seed=2), _randn(2816, 1024, scale=1024 ** -0.5, seed=3),
              _randn(1024, 2816, scale=2816 ** -0.5, seed=4), _randn(1024, seed=5)]
    ref = _mlp_block(x.float(), *_float(*params), fused=False)
    compiled = torch.compile(_mlp_block, backend="inductor", mode=mode)
    if mode is None:  # training: the ops' backward inside the compiled graph
        args = [t.requires_grad_() for t in (x, *params)]
        before = le.launches["linear_epilogue"], gl.launches["gated_linear"]
        out = compiled(*args)
        assert (le.launches["linear_epilogue"], gl.launches["gated_linear"]) == (before[0] + 1, before[1] + 1)
        out.float().square().mean().backward()
        ref_args = [t.detach().float().requires_grad_() for t in args]
        _mlp_block(*ref_args, fused=False).square().mean().backward()
        for t, r in zip(args, ref_args):
            assert relative_error(t.grad, r.grad) < 1e-2
    else:  # CUDA graphs: autotuning happens in the warm-up calls, replays run the recorded kernels
        with torch.no_grad():
            for _ in range(3):
                out = compiled(x, *params)
    assert relative_error(out, ref) < 1e-2


def test_hopper_takes_the_tma_kernel_for_large_gemms():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    K = N = 8192
    for M, expect in ((_tma_gemm.TMA_MIN_M, 1), (_tma_gemm.TMA_MIN_M - 1, 0), (8192, 1)):
        assert _tma_gemm.use_tma(M, N, K) == bool(expect)
        before = _tma_gemm.launches["tma"]
        le.linear_epilogue(*_linear_inputs(M, K, N))
        gl.gated_linear(*_gated_inputs(M, K, N))  # the gated form: one descriptor over both weights
        assert _tma_gemm.launches["tma"] == before + 2 * expect


@pytest.mark.parametrize("residual", [False, True])
def test_the_tma_path_keeps_the_bias(residual):
    """At a size the op sends to the TMA kernel, a bias alone (and with a residual) reaches the result: the op
    against the reference, and against the same GEMM without the bias (which a dropped bias would equal)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    M, K, N = 8192, 1024, 4096
    assert _tma_gemm.use_tma(M, N, K)
    x, w, b, r = _linear_inputs(M, K, N, residual=residual)
    before = _tma_gemm.launches["tma"]
    out = le.linear_epilogue(x, w, b, r)
    assert _tma_gemm.launches["tma"] == before + 1
    ref = le.reference(*_float(x, w, b, r))
    assert relative_error(out, ref) < 1e-2
    assert relative_error(le.reference(*_float(x, w, None, r)), ref) > 0.1  # the bias matters at this scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_tma_config(dtype):
    """Each config the autotuner may pick (after pruning), at an odd size (edge tiles, K tail)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    from triton.runtime.errors import OutOfResources
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K, N = 1000, 1000, 1032
    x, w, b, r = _linear_inputs(M, K, N, dtype=dtype)
    ref = le.reference(*_float(x, w, b, r), activation="gelu_tanh")
    desc = TensorDescriptor.from_tensor(x, [1, 1])
    ran = 0
    for c in _tma_gemm.prune_tma_configs(_tma_gemm.TMA_CONFIGS, {"x_desc": desc}):
        config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        try:
            out = _tma_gemm.launch_tma(x, w, b, r, "gelu_tanh", config=config)
        except OutOfResources:  # the autotuner skips such a config too
            continue
        ran += 1
        assert relative_error(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3), config
    assert ran >= 2


@pytest.mark.parametrize("M, K, N", [(128, 1024, 2816), (8192, 1024, 4096)])  # pointer kernel; TMA kernel
def test_later_calls_skip_the_autotuner_and_match(M, K, N):
    """After the first call with a shape, the launchers run the chosen config directly (launch_tuned): the
    result must be bit-identical to the first call's, for the autograd ops and the *_inference ones."""
    args = _linear_inputs(M, K, N)
    _launch._chosen.clear()
    first = le.linear_epilogue(*args, activation="gelu_tanh")
    assert _launch._chosen, "the first call did not record its config"
    again = torch.ops.kpt.linear_epilogue_inference(*args, "gelu_tanh")
    assert torch.equal(first, again)
    gargs = _gated_inputs(M, K, N)
    first = gl.gated_linear(*gargs, activation="silu")
    assert torch.equal(first, torch.ops.kpt.gated_linear_inference(*gargs, "silu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_tma_config_gated(dtype):
    """The gated form with each config, at an odd size, with the weights apart and as halves of one tensor."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    from triton.runtime.errors import OutOfResources
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K, N = 1000, 1000, 1032
    x, w_gate, w_up = _gated_inputs(M, K, N, dtype=dtype)
    both = torch.cat([w_up, w_gate])  # up first: the descriptor starts at w_up
    desc = TensorDescriptor.from_tensor(x, [1, 1])
    ran = 0
    for weights in ((w_gate, w_up), (both[N:], both[:N])):
        ref = gl.reference(*_float(x, *weights), activation="silu")
        for c in _tma_gemm.prune_tma_configs(_tma_gemm.TMA_CONFIGS, {"x_desc": desc}):
            config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
            try:
                out = _tma_gemm.launch_tma_gated(x, *weights, "silu", config=config)
            except OutOfResources:
                continue
            ran += 1
            assert relative_error(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3), config
    assert ran >= 4


@pytest.mark.parametrize("M", [1, 128, 8192])  # pointer kernel (decode, prefill); gated at 8192: the TMA kernel
def test_triton_op_form_is_launched_by_inductor(M):
    """torch.ops.kpt.*_triton inside an Inductor graph: Inductor compiles our kernel and launches it itself
    (the generated code calls no kpt op) below the TMA kernel's sizes, and calls the inference op above."""
    from torch._inductor.utils import run_and_get_code

    K, N = 1024, 2816
    x, wg, wu = _gated_inputs(M, K, N)
    wd, res = _randn(K, N, scale=N ** -0.5, seed=5), _randn(M, K, seed=7)

    def mlp(x, wg, wu, wd, r):
        h = torch.ops.kpt.gated_linear_triton(x, wg, wu, "silu")
        return torch.ops.kpt.linear_epilogue_triton(h, wd, None, r, "none")
    ref = F.linear(gl.reference(*_float(x, wg, wu)), wd.float()) + res.float()
    torch._dynamo.reset()
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(torch.compile(mlp, backend="inductor"), x, wg, wu, wd, res)
    assert relative_error(out, ref) < 1e-2, M
    traced = not _tma_gemm.use_tma(M, 2 * N, K)
    assert ("_gated_linear_kernel" in code) == traced, code[-3000:]
    assert ("kpt.gated_linear_inference" in code) != traced, code[-3000:]
    if not _tma_gemm.use_tma(M, K, N):
        assert "_linear_epilogue_kernel" in code and "kpt.linear_epilogue_inference" not in code, code[-3000:]


def test_fusion_emits_the_triton_op_form_under_inductor_on_cuda():
    """The fusion pass, inference on CUDA with Inductor: the *_triton ops, and the result of the unfused model."""
    import kpt_compiler

    K, N, M = 1024, 2816, 128
    x, wg, wu = _gated_inputs(M, K, N)
    wd, res = _randn(K, N, scale=N ** -0.5, seed=5), _randn(M, K, seed=6)

    def mlp(x, wg, wu, wd, r):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd) + r
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(mlp, backend="kernelpytorch", options={"fusion": {"decide": "always"}})(x, wg, wu, wd, res)
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert ops.get("gated_linear_triton") == 1 and ops.get("linear_epilogue_triton") == 1, ops
    assert relative_error(out, mlp(*_float(x, wg, wu, wd, res))) < 1e-2
