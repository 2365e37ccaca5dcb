"""The fp4 weight GEMM (kernels/fp4_linear.py) on the GPU: bf16 activations at model sizes, both formats."""

import pytest
import torch

from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels.fp4_linear import fp4_linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (16, 14336, 4096), (16, 4096, 14336), (77, 1000, 512)])
def test_bf16_at_model_sizes_against_the_dequantized_matmul(f, M, N, K):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    q = fmt.quantize(w, f)
    y = fp4_linear(x, q)
    ref = x.float() @ fmt.dequantize(q).T
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
