"""2:4 sparsity on the GPU: kernels/sparse24_linear.py's calls into torch's cuSPARSELt and CUTLASS kernels
against the dense masked matmul, a capture in a CUDA graph, and the sparsity-2-4 pass under Inductor."""

import pytest
import torch
import torch.nn as nn

import kpt_compiler
from kpt_compiler.kernels import sparse24_linear as kernel
from kpt_compiler.lossy_guard import sqnr_db
from kpt_compiler.passes._sparse24 import prune_2_4

pytestmark = pytest.mark.gpu

BACKENDS = ["cusparselt", "cutlass"]


def _sparse_cores() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


@pytest.fixture(autouse=True)
def _needs_sparse_cores(request):
    if not _sparse_cores():
        pytest.skip("2:4 needs sm_80 or later")
    backend = request.node.callspec.params.get("backend") if hasattr(request.node, "callspec") else None
    why = backend and kernel.unavailable(backend)
    if why:
        pytest.skip(why)  # said in the run's -rs summary: which of torch's kernels this card has


def test_the_default_kernel_runs_here_and_the_alg_search_keeps_the_product():
    assert kernel.unavailable(kernel.default_backend()) is None
    w = kernel.compress(prune_2_4(torch.randn(4096, 4096, device="cuda").bfloat16()), kernel.default_backend())
    x = torch.randn(512, 4096, device="cuda").bfloat16()
    y0 = kernel.sparse24_linear(x, w)
    w.alg_id = kernel.search_alg(w, 512, x.dtype)
    torch.testing.assert_close(kernel.sparse24_linear(x, w), y0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (7, 1024, 512), (128, 14336, 4096), (1000, 768, 3072)])
def test_the_sparse_product_is_the_dense_masked_one(backend, M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M)
    w = prune_2_4(torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    y = kernel.sparse24_linear(x, kernel.compress(w, backend))
    ref = x.float() @ w.float().T
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    y3 = kernel.sparse24_linear(x.view(1, M, K), kernel.compress(w, backend))  # [..., K] activations
    assert y3.shape == (1, M, N) and torch.equal(y3[0], y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_call_can_be_captured_in_a_cuda_graph(backend):
    w = kernel.compress(prune_2_4(torch.randn(512, 1024, device="cuda").bfloat16()), backend)
    x = torch.randn(12, 1024, device="cuda").bfloat16()
    kernel.sparse24_linear(x, w)  # any one-time set-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernel.sparse24_linear(x, w)
    x.normal_()
    graph.replay()
    torch.testing.assert_close(y, kernel.sparse24_linear(x, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pass_under_inductor_and_a_cuda_graph_gives_the_masked_models_output(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.SiLU(), nn.Linear(4096, 1024)).cuda().bfloat16().eval()
    masked = nn.Sequential(nn.Linear(1024, 4096), nn.SiLU(), nn.Linear(4096, 1024)).cuda().bfloat16().eval()
    masked.load_state_dict(model.state_dict())
    with torch.no_grad():
        for lin in (masked[0], masked[2]):
            lin.weight.copy_(prune_2_4(lin.weight))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kernelpytorch", options={
        "sparsity_2_4": {"decide": "always", "kernel": backend}, "cudagraphs": {"decide": "always"}})
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        outs = [compiled(x).clone() for _ in range(3)]  # the third call replays the CUDA graph
        ref = masked.float()(x.float())
    rec = kpt_compiler.last_report().pass_record("sparsity-2-4")
    assert rec.status == "applied" and rec.matches == 2, rec.notes
    assert all(6 < v < 12 for v in rec.layer_db.values()), rec.layer_db  # pruning Gaussian weights: ~8.8 dB
    for out in outs:
        assert sqnr_db(out.float(), ref) > 35  # the masked model's output, up to bf16
    cg = kpt_compiler.last_report().pass_record("cudagraphs")
    assert cg.status == "applied", cg.notes
