"""Residual add + RMSNorm / LayerNorm kernels on the GPU: bf16 at model sizes, forward and backward, against an
fp32 reference, and inside torch.compile(backend="inductor")."""

import pytest
import torch
import torch.nn.functional as F

from kpt_compiler.bench import relative_error

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")

from kpt_compiler.kernels import layer_norm as L  # noqa: E402
from kpt_compiler.kernels import rms_norm as K  # noqa: E402

KINDS = ["rms_hf", "rms_torch", "layer"]  # rms with cast_before_weight True / False, layer norm


def _run(kind, x, r, w, b, reference=False):
    if kind == "layer":
        return (L.reference if reference else L.add_layer_norm)(x, r, w, b, 1e-5)
    fn = K.reference if reference else K.add_rms_norm
    return fn(x, r, w, 1e-6, kind == "rms_hf")


def _leaves(kind, rows, N, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, N, device="cuda", generator=g).to(dtype)
    r = torch.randn(rows, N, device="cuda", generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(N, device="cuda", generator=g)).to(dtype)
    b = (0.5 * torch.randn(N, device="cuda", generator=g)).to(dtype) if kind == "layer" else None
    return [t.requires_grad_() if t is not None else None for t in (x, r, w, b)]


def _forward_backward(kind, leaves, gy, gh, reference=False):
    y, h = _run(kind, *leaves, reference=reference)
    inputs = [t for t in leaves if t is not None]
    grads = torch.autograd.grad([y, h], inputs, [gy.to(y.dtype), gh.to(h.dtype)])
    return [y, h, *grads]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [8192, 128, 1])
@pytest.mark.parametrize("N", [768, 1024, 4096, 8192])
def test_bf16_forward_backward_against_fp32(kind, rows, N):
    leaves = _leaves(kind, rows, N, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    gy = torch.randn(rows, N, device="cuda", generator=g).bfloat16()
    gh = torch.randn(rows, N, device="cuda", generator=g).bfloat16()
    launched = dict(K.launches)
    ours = _forward_backward(kind, leaves, gy, gh)
    name = "add_layer_norm" if kind == "layer" else "add_rms_norm"
    assert K.launches[name + "_fwd"] > launched.get(name + "_fwd", 0)
    assert K.launches[name + "_bwd"] > launched.get(name + "_bwd", 0)
    assert torch.equal(ours[1], leaves[0] + leaves[1])  # h: the bf16 add, rounded as torch rounds it

    fp32 = [t.detach().float().requires_grad_() if t is not None else None for t in leaves]
    ref = _forward_backward(kind, fp32, gy.float(), gh.float(), reference=True)
    eager = _forward_backward(kind, leaves, gy, gh, reference=True)  # unfused torch code in bf16
    names = ["y", "h", "dx", "dresidual", "dweight", "dbias"]
    for what, o, e, r in zip(names, ours, eager, ref):
        err, err_eager = relative_error(o, r), relative_error(e, r)
        # fp32 statistics and one rounding: at least about as accurate as the unfused bf16 code
        assert err <= 1.5 * err_eager + 2e-3 and err < 2e-2, f"{what}: {err:.2e} (eager bf16 {err_eager:.2e})"


@pytest.mark.parametrize("N", [1024, 4096])
def test_bf16_rms_variants_within_one_rounding_of_torch(N):
    x, r, w, _ = (t.detach() if t is not None else None for t in _leaves("rms_hf", 4096, N, torch.bfloat16))
    h = x + r
    hf = h.float()
    normalized = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    for cast_before_weight, ref in ((True, w * normalized.to(h.dtype)),  # transformers' LlamaRMSNorm
                                    (False, F.rms_norm(h, (N,), w, 1e-6))):
        y, _ = K.add_rms_norm(x, r, w, 1e-6, cast_before_weight)
        diff = (y.float() - ref.float()).abs()
        ulp = ref.float().abs() * 2 ** -7 + 1e-30  # one bf16 unit in the last place, or more
        assert (diff <= ulp).all() and (y == ref).float().mean() > 0.98, cast_before_weight


@pytest.mark.parametrize("kind", KINDS)
def test_inside_inductor_compile(kind):
    """The ops inside a compiled block (as the fusion pass inserts them): same values and gradients as eager."""
    proj = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) * 0.03

    def block(x, r, w, b):
        y, h = _run(kind, x, r, w, b)
        return (y @ proj).relu(), h * 2

    leaves = _leaves(kind, 2048, 1024, torch.bfloat16)
    inputs = [t for t in leaves if t is not None]
    eager = block(*leaves)
    eager_grads = torch.autograd.grad(eager, inputs, [torch.ones_like(t) for t in eager])
    torch._dynamo.reset()
    launched = dict(K.launches)
    compiled = torch.compile(block, backend="inductor", fullgraph=True)(*leaves)
    grads = torch.autograd.grad(compiled, inputs, [torch.ones_like(t) for t in compiled])
    name = "add_layer_norm" if kind == "layer" else "add_rms_norm"
    assert K.launches[name + "_fwd"] > launched.get(name + "_fwd", 0)
    assert K.launches[name + "_bwd"] > launched.get(name + "_bwd", 0)
    for a, c in zip(eager + eager_grads, compiled + grads):
        assert relative_error(c, a) < 1e-2
    assert torch.equal(compiled[1], eager[1])
