"""``torch.ops.kpt.pad_rows``: a tensor copied with its last dimension padded (zeros) to a multiple of 8.

Not a Triton kernel: ``F.pad`` does the work. It is an opaque op because what matters is the layout Inductor
sees. An SDPA mask whose last dimension is dynamic makes Inductor's SDPA lowering guard that its rows are
aligned to 8 elements (the fused kernels' requirement), so a graph compiled at an aligned length recompiles
for every other length, and the other way round. The attention pass reads such a mask as
``pad_rows(mask).narrow(-1, 0, n)``: an extern op's output is a buffer with the layout its fake says, so the
narrowed view's strides are multiples of 8 at every length, which Inductor proves without a guard. (A view of
Inductor's own padded buffer would not do: ``as_strided`` over it reads whatever layout Inductor chose for it.)
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ._op_forms import register_op_forms

ALIGNMENT = 8  # elements; Inductor's SDPA lowering and aten's preprocess_mask ask this of a mask's rows


def _padded(n):
    """The padded row length: the next multiple of 8 above ``n`` (n + 1 to n + 8). Always more than ``n``, so
    the narrowed view is never contiguous: with a dynamic ``n``, a length that could equal it would make every
    contiguity check on the view (tracing records one per tensor) guard on ``n % 8``, the split this op is
    here to avoid."""
    return (n // ALIGNMENT + 1) * ALIGNMENT


def _forward(x: Tensor) -> Tensor:
    n = x.shape[-1]
    return F.pad(x, (0, _padded(n) - n)).contiguous()


def _fake(x):
    n = x.shape[-1]
    # a fact the shape environment cannot derive from the floor division; as a guard it holds for every n
    torch._check(_padded(n) > n)
    return x.new_empty((*x.shape[:-1], _padded(n)))


def _setup_context(ctx, inputs, output):
    ctx.n = inputs[0].shape[-1]


def _backward(ctx, grad):
    return grad.narrow(-1, 0, ctx.n)


pad_rows = register_op_forms("pad_rows", _forward, _fake, _setup_context, _backward)


def op(requires_grad: bool):
    """The op form a graph emits: with autograd where a gradient may flow to the mask."""
    return torch.ops.kpt.pad_rows.default if requires_grad else torch.ops.kpt.pad_rows_inference.default


def aligned_rows(x: Tensor) -> Tensor:
    """``x`` read through a copy whose rows are padded to a multiple of 8 elements (the values are ``x``'s)."""
    return op(x.requires_grad)(x).narrow(-1, 0, x.shape[-1])
