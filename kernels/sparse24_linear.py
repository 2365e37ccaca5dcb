"""``y = x @ w.T`` with ``w`` 2:4 semi-structured sparse (issue 19; the sparsity-2-4 pass emits it as
``kpt::sparse24_linear``).

No kernel of ours: torch's, the ones ``torch.sparse.to_sparse_semi_structured`` dispatches to, called directly
so that the weight's parts can be graph constants and the call one opaque op (Inductor launches it as an extern
kernel; a tensor subclass as a graph constant is not something it takes):
- ``cusparselt``: the weight compressed by ``torch._cslt_compress`` (kept values and metadata in one tensor),
  ``torch._cslt_sparse_mm(packed, x.T, transpose_result=True)``;
- ``cutlass``: kept values and metadata from ``sparse_semi_structured_from_dense_cutlass``,
  ``torch._sparse_semi_structured_mm(packed, meta, x.T).T``;
- ``dense``: the pruned weight as a dense matrix and ``F.linear``: a reference that runs anywhere (the CPU
  tests' and a user's way to see a pruned model's accuracy where the sparse kernels do not run), no faster.
Both sparse kernels are CUDA only (sm_80 and later) and take the activation with its rows padded to a multiple
of 8 (``DENSE_ROWS``); the weight's rows and columns must be multiples of ``WEIGHT_MULTIPLES`` (torch's
constraints for 16-bit types).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.utils.flop_counter
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("cusparselt", "cutlass", "dense")
# (N, K) multiples the weight needs per backend, 16-bit dtypes (torch/sparse/semi_structured.py's constraints)
WEIGHT_MULTIPLES = {"cusparselt": (16, 16), "cutlass": (32, 64), "dense": (1, 4)}
DENSE_ROWS = 8  # the activation's rows are padded to a multiple of this for the sparse kernels


def default_backend() -> str:
    """cuSPARSELt where torch was built with it (torch's own default), else CUTLASS."""
    cslt = getattr(torch.backends, "cusparselt", None)
    return "cusparselt" if cslt is not None and cslt.is_available() else "cutlass"


@dataclasses.dataclass
class Sparse24Weight:
    """A 2:4 weight [N, K] compressed for ``backend``: ``packed`` (and ``meta`` for CUTLASS)."""

    backend: str
    shape: tuple[int, int]
    packed: Tensor
    meta: Tensor | None = None
    alg_id: int = 0  # cuSPARSELt's algorithm (search_alg picks one for an M)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.meta) if t is not None)


def compress(w24: Tensor, backend: str) -> Sparse24Weight:
    """``w24`` (already 2:4 along K: passes/_sparse24.py) in ``backend``'s form."""
    if backend not in BACKENDS:
        raise ValueError(f"sparse24_linear: backend {backend!r}; one of {', '.join(BACKENDS)}")
    n, k = w24.shape
    rows, cols = WEIGHT_MULTIPLES[backend]
    if n % rows or k % cols:
        raise ValueError(f"sparse24_linear: a {n}x{k} weight; {backend} needs N a multiple of {rows} and K of {cols}")
    w24 = w24.detach().contiguous()
    if backend == "dense":
        return Sparse24Weight(backend, (n, k), w24.clone())
    if w24.device.type != "cuda":
        raise ValueError(f"sparse24_linear: the {backend} kernels run on CUDA only, the weight is on {w24.device}")
    if backend == "cusparselt":
        return Sparse24Weight(backend, (n, k), torch._cslt_compress(w24))
    from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

    packed, meta = sparse_semi_structured_from_dense_cutlass(w24)
    return Sparse24Weight(backend, (n, k), packed, meta)


def search_alg(w: Sparse24Weight, m: int, dtype: torch.dtype) -> int:
    """cuSPARSELt's fastest algorithm for ``m`` rows (``torch._cslt_sparse_mm_search`` times them on the device;
    0, its default, for the other backends)."""
    if w.backend != "cusparselt":
        return 0
    x = torch.zeros(m + (-m) % DENSE_ROWS, w.shape[1], device=w.packed.device, dtype=dtype)
    return int(torch._cslt_sparse_mm_search(w.packed, x.t(), transpose_result=True))


@functools.cache
def unavailable(backend: str) -> str | None:
    """Why ``backend`` does not run on this CUDA device (a tiny product tried once; torch's CUTLASS 2:4 kernels
    are built for some architectures only), or None."""
    try:
        w = torch.zeros(32, 64, device="cuda", dtype=torch.bfloat16)
        w[:, ::2] = 1
        y = sparse24_linear(torch.ones(8, 64, device="cuda", dtype=torch.bfloat16), compress(w, backend))
        if not bool((y == 32).all()):
            return f"{backend} gave a wrong product on a test matrix"
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return f"{backend} does not run here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


def sparse24_linear(x: Tensor, w: Sparse24Weight) -> Tensor:
    """``x @ w.T`` for x [..., K]."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"sparse24_linear: x has K={x.shape[-1]}, the weight {k}")
    x2 = x.reshape(-1, k)
    if w.backend == "dense":
        return F.linear(x2, w.packed).reshape(*x.shape[:-1], n)
    m = x2.shape[0]
    pad = (-m) % DENSE_ROWS
    xp = F.pad(x2, (0, 0, 0, pad)) if pad else x2
    if w.backend == "cusparselt":
        out = torch._cslt_sparse_mm(w.packed, xp.t(), transpose_result=True, alg_id=w.alg_id)  # [M, N]
    else:
        out = torch._sparse_semi_structured_mm(w.packed, w.meta, xp.t()).t()  # [N, M] -> [M, N]
    return out[:m].reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------------------------------------------
# The op a pass emits: inference only; the weight's parts are its arguments (constants of the graph).
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("kpt::sparse24_linear", mutates_args=())
def sparse24_linear_op(x: Tensor, packed: Tensor, meta: Tensor | None, out_features: int,
                       in_features: int, backend: str, alg_id: int = 0) -> Tensor:
    return sparse24_linear(x, Sparse24Weight(backend, (out_features, in_features), packed, meta, alg_id))


@sparse24_linear_op.register_fake
def _(x, packed, meta, out_features, in_features, backend, alg_id=0):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.utils.flop_counter.register_flop_formula(torch.ops.kpt.sparse24_linear)
def _flops(x_shape, packed_shape, meta_shape, out_features: int, *args, **kwargs) -> int:
    """A dense GEMM's FLOPs (2 M N K: what the layer computes; the sparse cores skip half), so cost estimates
    over a rewritten graph (passes/cudagraphs.py's) count its work."""
    return 2 * math.prod(x_shape) * out_features


def op_args(w: Sparse24Weight) -> tuple:
    """The weight's parts as the op takes them (after x)."""
    return (w.packed, w.meta, w.shape[0], w.shape[1], w.backend, w.alg_id)
