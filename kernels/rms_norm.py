"""Residual add + RMSNorm, forward and backward, in one pass over memory each.

Math (per row of N elements; statistics in fp32; ``reference`` also takes float64, for exact gradients)::

    h    = x + residual                       rounded to x.dtype, as torch rounds `x + residual`
                                              (no residual: h is x itself)
    rstd = 1 / sqrt(mean(hf ** 2) + eps)      hf = h in fp32; rstd is saved for the backward
    n    = hf * rstd
    y    = weight * n.to(h.dtype)             cast_before_weight=True
    y    = (n * weight.float()).to(h.dtype)   cast_before_weight=False

The two variants differ in where the weight multiplies, and a fusion pass must reproduce each exactly:

- ``cast_before_weight=True`` reproduces Hugging Face's ``LlamaRMSNorm.forward`` (Llama, Mistral, Qwen2, ...)::

      input_dtype = hidden_states.dtype
      hidden_states = hidden_states.to(torch.float32)
      variance = hidden_states.pow(2).mean(-1, keepdim=True)
      hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
      return self.weight * hidden_states.to(input_dtype)

  y has the dtype torch gives ``weight * h`` (bf16 weight, bf16 h: bf16; fp32 weight, bf16 h: fp32); the
  product of the weight and the rounded normalized value is rounded once, as torch does.
- ``cast_before_weight=False`` reproduces ``F.rms_norm(h, (N,), weight, eps)`` and ``torch.nn.RMSNorm``
  (``aten._fused_rms_norm`` and its decomposition in ``torch/_decomp/decompositions.py``, which Inductor
  uses; on the CPU with torch 2.9 and 2.13 ``F.rms_norm`` equals the formula bit for bit, see
  tests/test_rms_norm.py): the weight multiplies in fp32 and y, in h's dtype, is rounded once.

Both are exact up to the order of the fp32 sum in the mean (and, on the GPU, the approximate ``rsqrt``):
h is bit-identical to torch's, and y differs from the torch code above by at most one rounding of y.
x and residual must have the same shape and dtype (fp16, bf16 or fp32); N is at most ``MAX_N`` (65536).

Backward (dy for y, dh for h, which is an output the model uses elsewhere, e.g. the next residual)::

    dn   = dy * w                              (dy where there is no weight)
    dh_total = dh + rstd * (dn - n * mean(dn * n))
    dx   = d residual = dh_total               rounded once to x.dtype
    dw   = sum over rows of dy * n             (dy * n.to(h.dtype) for cast_before_weight=True)

The gradient treats the rounding of n as the identity (as autograd does). dw is summed per program into
fp32 partials [programs, N] and reduced afterwards (the Triton tutorial / Liger-Kernel layer-norm scheme).

Ops (``torch.library.custom_op``; the public function ``add_rms_norm`` returns ``(y, h)``)::

    kpt::add_rms_norm(Tensor x, Tensor? residual, Tensor? weight, float eps, bool cast_before_weight)
        -> (Tensor y, Tensor h, Tensor rstd)
    kpt::add_rms_norm_backward(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd,
                               bool cast_before_weight, bool weight_grad) -> (Tensor dx, Tensor dweight)

``h`` is ``x + residual``; without a residual it is an empty tensor of shape [0] (a custom op may not return
an alias of its input, and a copy of x would cost a write): the caller uses x itself. ``rstd`` is fp32 of
shape ``x.shape[:-1]``. ``dweight`` is fp32 of shape [N] (empty when ``weight_grad`` is false); the autograd
formula casts it to the weight's dtype. Double backward is not supported.

custom_op, not ``torch.library.triton_op``: the op's body picks Triton or the eager reference by device at
run time (CPU tensors run the kernels only under the Triton interpreter; without triton, or on other
devices, the reference), which an opaque custom op allows on every torch we support (2.9, 2.11, 2.13).
Inductor calls it as an extern kernel; it is already one fused memory-bound kernel that Inductor could not
fuse further, so tracing into the kernel (what triton_op adds) would save only the launch overhead.

Dispatch (``_launch.kernel_runs``): CUDA tensors run the Triton kernels; CPU tensors run them when the
kernels were decorated under ``TRITON_INTERPRET=1`` (set before this module is imported, as tests/conftest.py
does), else the eager reference (forward and backward), so the ops work everywhere; without triton (a
CPU-only torch install) the ops run the reference. The kernels also run in Triton 3.5's interpreter (torch
2.9), which cannot loop to a run-time bound: the backward's trip count is a constexpr. ``launches`` counts
kernel launches (tests assert on it; one counter with layer_norm's). Checks, launch heuristic, backward grid
and the counter: ``_norm_common``.
Import this module as ``kpt_compiler.kernels.rms_norm`` only (the ops register once, when it is imported).
"""

from typing import Optional

import torch
from torch import Tensor

from ._launch import kernel_runs, tl, triton
from ._norm_common import MAX_N  # noqa: F401  (this module's documented limit; tests read it here)
from ._norm_common import backward_grid, check_inputs, launch_config, launches, rows_of

__all__ = ["add_rms_norm", "reference", "launches"]

# the kernel modules whose source decides this op's speed (the cost model keys its calibration on them)
SOURCE_MODULES = ("rms_norm", "_norm_common", "_launch")

# Launch configuration: ``_norm_common.launch_config`` (no autotuning: the whole row per program, several rows
# per program for narrow rows, and the warps, by a heuristic).


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _add_rms_norm_fwd_kernel(
    # pointers
    X, R, W, H, Y, RSTD,             # x, residual, weight [N], h (out), y (out), rstd (out, fp32 [M])
    # sizes
    M, N,
    # strides between rows, in elements (rows are contiguous)
    stride_x, stride_r, stride_h, stride_y,
    # scalars
    eps,
    # meta
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)  # rows * stride may pass 2**31
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # one rounding, as torch's add
        tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    n = hf * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        if CAST_BEFORE_WEIGHT:
            y = w[None, :] * n.to(x.dtype).to(tl.float32)  # weight * n.to(h.dtype)
        else:
            y = n * w[None, :]                               # (n * weight.float()).to(h.dtype)
    else:
        y = n
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_bwd_kernel(
    # pointers
    DY, DH, H, W, RSTD,              # dy, dh (gradient of the output h), h, weight [N], rstd (fp32 [M])
    DX, DW_PARTIAL,                  # dx (out, also the residual's gradient), dweight partials (out, fp32)
    # sizes
    M, N,
    # strides between rows, in elements (rows are contiguous)
    stride_dy, stride_dh, stride_h, stride_dx,
    # meta
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(TILES):
        rows = (pid * TILES + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows = rows.to(tl.int64)
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        n = h.to(tl.float32) * rstd[:, None]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dn = dy * w[None, :]
            if WEIGHT_GRAD:
                if CAST_BEFORE_WEIGHT:
                    dw += dy * n.to(h.dtype).to(tl.float32)
                else:
                    dw += dy * n
        else:
            dn = dy
        dx = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / N)[:, None])
        if HAS_DH:
            dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)


# ---------------------------------------------------------------------------------------------------------
# Launchers: check (``_norm_common.check_inputs``), flatten leading dims, allocate, launch
# ---------------------------------------------------------------------------------------------------------

def _y_dtype(h_dtype: torch.dtype, weight: Optional[Tensor], cast_before_weight: bool) -> torch.dtype:
    if weight is not None and cast_before_weight:
        return torch.promote_types(weight.dtype, h_dtype)  # weight * n.to(h.dtype) promotes
    return h_dtype


def _forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float,
             cast_before_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    N = x.shape[-1]
    x2 = rows_of(x, N)
    r2 = rows_of(residual, N) if residual is not None else x2
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=_y_dtype(x.dtype, weight, cast_before_weight), device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x.new_empty(0)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if M == 0:
        return y, h, rstd
    h2 = h.view(-1, N) if residual is not None else x2
    BLOCK_M, BLOCK_N, num_warps = launch_config(M, N, x.device)
    w = weight.contiguous() if weight is not None else x2
    _add_rms_norm_fwd_kernel[(triton.cdiv(M, BLOCK_M),)](
        x2, r2, w, h2, y.view(-1, N), rstd,
        M, N,
        x2.stride(0), r2.stride(0), h2.stride(0), N,
        eps,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, CAST_BEFORE_WEIGHT=cast_before_weight,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=num_warps,
    )
    launches["add_rms_norm_fwd"] += 1
    return y, h, rstd


def _backward(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], rstd: Tensor,
              cast_before_weight: bool, weight_grad: bool) -> tuple[Tensor, Tensor]:
    N = h.shape[-1]
    h2, dy2 = rows_of(h, N), rows_of(dy, N)
    dh2 = rows_of(dh, N) if dh is not None else h2
    M = h2.shape[0]
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    weight_grad = weight_grad and weight is not None
    if M == 0:
        return dx, h.new_zeros(N if weight_grad else 0, dtype=torch.float32)
    BLOCK_M, BLOCK_N, num_warps = launch_config(M, N, h.device)
    programs, tiles = backward_grid(M, BLOCK_M, num_warps, h.device)
    partial = torch.empty((programs, N) if weight_grad else (0,), dtype=torch.float32, device=h.device)
    _add_rms_norm_bwd_kernel[(programs,)](
        dy2, dh2, h2, weight.contiguous() if weight is not None else h2, rstd.reshape(-1),
        dx.view(-1, N), partial,
        M, N,
        dy2.stride(0), dh2.stride(0), h2.stride(0), N,
        HAS_DH=dh is not None, HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad,
        CAST_BEFORE_WEIGHT=cast_before_weight, TILES=tiles, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=num_warps,
    )
    launches["add_rms_norm_bwd"] += 1
    return dx, partial.sum(0) if weight_grad else partial


# ---------------------------------------------------------------------------------------------------------
# Eager reference (and the ops' fallback where Triton does not run)
# ---------------------------------------------------------------------------------------------------------

def reference(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float = 1e-6,
              cast_before_weight: bool = True) -> tuple[Tensor, Tensor]:
    """The unfused torch code: ``(y, h)`` as in the module docstring (differentiable, any float dtype)."""
    h = x if residual is None else x + residual
    y, _ = _reference_norm(h, weight, eps, cast_before_weight)
    return y, h


def _reference_norm(h, weight, eps, cast_before_weight):
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    n = hf * rstd
    if weight is None:
        y = n.to(h.dtype)
    elif cast_before_weight:
        y = weight * n.to(h.dtype)
    else:
        y = (n * weight.to(hf.dtype)).to(h.dtype)
    return y, rstd.squeeze(-1)


def _reference_backward(dy, dh, h, weight, rstd, cast_before_weight, weight_grad):
    """The backward formula of the module docstring in torch ops (the kernel's math)."""
    hf = h.float()
    n = hf * rstd.unsqueeze(-1)
    dy = dy.float()
    dn = dy if weight is None else dy * weight.float()
    dx = rstd.unsqueeze(-1) * (dn - n * (dn * n).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.float()
    dw = h.new_zeros(0, dtype=torch.float32)
    if weight_grad and weight is not None:
        nw = n.to(h.dtype).float() if cast_before_weight else n
        dw = (dy * nw).reshape(-1, h.shape[-1]).sum(0)
    return dx.to(h.dtype).contiguous(), dw


# ---------------------------------------------------------------------------------------------------------
# Custom ops, fakes, autograd
# ---------------------------------------------------------------------------------------------------------

@torch.library.custom_op("kpt::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float,
                     cast_before_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs("kpt::add_rms_norm", x, residual, {"weight": weight})
    if kernel_runs(x):
        return _forward(x, residual, weight, eps, cast_before_weight)
    h = (x + residual).contiguous() if residual is not None else x  # contiguous, as the fake says
    y, rstd = _reference_norm(h, weight, eps, cast_before_weight)
    return y.contiguous(), (h if residual is not None else x.new_empty(0)), rstd.contiguous()


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, cast_before_weight):
    check_inputs("kpt::add_rms_norm", x, residual, {"weight": weight})
    y = x.new_empty(x.shape, dtype=_y_dtype(x.dtype, weight, cast_before_weight))
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return y, h, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kpt::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward_op(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], rstd: Tensor,
                              cast_before_weight: bool, weight_grad: bool) -> tuple[Tensor, Tensor]:
    if kernel_runs(h):
        return _backward(dy, dh, h, weight, rstd, cast_before_weight, weight_grad)
    return _reference_backward(dy, dh, h, weight, rstd, cast_before_weight, weight_grad)


@_add_rms_norm_backward_op.register_fake
def _(dy, dh, h, weight, rstd, cast_before_weight, weight_grad):
    N = h.shape[-1]
    return h.new_empty(h.shape), h.new_empty(N if weight_grad and weight is not None else 0, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, cast_before_weight = inputs
    y, h, rstd = output
    # one call: each call replaces the last; without a residual h is an empty placeholder (the caller uses x)
    ctx.mark_non_differentiable(*((rstd,) if residual is not None else (rstd, h)))
    ctx.set_materialize_grads(False)  # an unused y or h gives None, not a tensor of zeros to read
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)
    ctx.has_residual = residual is not None
    ctx.cast_before_weight = cast_before_weight


def _backward_formula(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    dh = dh if ctx.has_residual else None
    if dy is None:  # only h is used downstream: h = x + residual passes its gradient through
        dw = torch.zeros_like(weight) if weight_grad else None
        return dh, (dh if ctx.has_residual else None), dw, None, None
    dx, dw = torch.ops.kpt.add_rms_norm_backward(dy, dh, h, weight, rstd, ctx.cast_before_weight, weight_grad)
    return dx, (dx if ctx.has_residual else None), (dw.to(weight.dtype) if weight_grad else None), None, None


_add_rms_norm_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------------------

def add_rms_norm(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float = 1e-6,
                 cast_before_weight: bool = True) -> tuple[Tensor, Tensor]:
    """``(y, h)``: h = x + residual (x itself when residual is None), y = RMSNorm(h) * weight.

    ``cast_before_weight=True`` is Hugging Face's LlamaRMSNorm, False is F.rms_norm / nn.RMSNorm; see the
    module docstring for the exact torch code each reproduces. Differentiable in x, residual and weight.
    """
    y, h, _ = torch.ops.kpt.add_rms_norm(x, residual, weight, eps, cast_before_weight)
    return y, (h if residual is not None else x)
