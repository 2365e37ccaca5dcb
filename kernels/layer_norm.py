"""Residual add + LayerNorm, forward and backward, in one pass over memory each.

Math (per row of N elements; statistics in fp32)::

    h    = x + residual                       rounded to x.dtype, as torch rounds `x + residual`
                                              (no residual: h is x itself)
    mean = mean(hf)                           hf = h in fp32
    rstd = 1 / sqrt(mean((hf - mean) ** 2) + eps)       mean and rstd are saved for the backward
    xhat = (hf - mean) * rstd
    y    = (xhat * weight + bias).to(h.dtype)             weight and bias in fp32; either may be None

y is ``F.layer_norm(h, (N,), weight, bias, eps)`` up to the order of the fp32 sums and one rounding of y
(torch's kernels may fold the row statistics into a per-row scale and shift first; in the fp16 tests over 98%
of y is bit-identical). h is bit-identical to torch's ``x + residual``. x and residual must have the same
shape and dtype (fp16, bf16 or fp32); N is at most ``_norm_common.MAX_N`` (65536).

Backward (dy for y, dh for h, which is an output the model uses elsewhere, e.g. the next residual)::

    g    = dy * weight                        (dy where there is no weight)
    dh_total = dh + rstd * (g - mean(g) - xhat * mean(g * xhat))
    dx   = d residual = dh_total              rounded once to x.dtype
    dw   = sum over rows of dy * xhat,   db = sum over rows of dy

dw and db are summed per program into fp32 partials [programs, N] and reduced afterwards (the Triton
tutorial / Liger-Kernel layer-norm scheme).

Ops (``torch.library.custom_op``; the public function ``add_layer_norm`` returns ``(y, h)``)::

    kpt::add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps)
        -> (Tensor y, Tensor h, Tensor mean, Tensor rstd)
    kpt::add_layer_norm_backward(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd,
                                 bool weight_grad, bool bias_grad) -> (Tensor dx, Tensor dweight, Tensor dbias)

``h`` is ``x + residual``; without a residual it is an empty tensor of shape [0] (a custom op may not return
an alias of its input, and a copy of x would cost a write): the caller uses x itself. ``mean`` and ``rstd``
are fp32 of shape ``x.shape[:-1]``. ``dweight`` and ``dbias`` are fp32 of shape [N] (empty when not asked
for); the autograd formula casts them to the parameters' dtypes. Double backward is not supported.

custom_op rather than triton_op, and dispatch (CUDA: Triton; CPU: Triton under the interpreter, else the
eager reference; no triton: the reference; ``_launch.kernel_runs``), as in rms_norm.py, whose docstring says
why; checks, launch heuristic and ``launches`` are shared with it (``_norm_common``). Import as
``kpt_compiler.kernels.layer_norm`` only.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._launch import kernel_runs, tl, triton
from ._norm_common import backward_grid, check_inputs, launch_config, launches, rows_of

__all__ = ["add_layer_norm", "reference", "launches"]

# the kernel modules whose source decides this op's speed (the cost model keys its calibration on them)
SOURCE_MODULES = ("layer_norm", "_norm_common", "_launch")

# Launch configuration: ``_norm_common.launch_config`` (whole row per program, rows per program for narrow rows).


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _add_layer_norm_fwd_kernel(
    # pointers
    X, R, W, B, H, Y, MEAN, RSTD,    # x, residual, weight [N], bias [N], h (out), y (out), mean, rstd (out, fp32)
    # sizes
    M, N,
    # strides between rows, in elements (rows are contiguous)
    stride_x, stride_r, stride_h, stride_y,
    # scalars
    eps,
    # meta
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
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
    mean = tl.sum(hf, axis=1) / N
    centered = tl.where(mask, hf - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(centered * centered, axis=1) / N + eps)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_layer_norm_bwd_kernel(
    # pointers
    DY, DH, H, W, MEAN, RSTD,        # dy, dh (gradient of the output h), h, weight [N], mean, rstd (fp32 [M])
    DX, DW_PARTIAL, DB_PARTIAL,      # dx (out, also the residual's gradient), weight / bias partials (out, fp32)
    # sizes
    M, N,
    # strides between rows, in elements (rows are contiguous)
    stride_dy, stride_dh, stride_h, stride_dx,
    # meta
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(TILES):
        rows = (pid * TILES + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows = rows.to(tl.int64)
        hf = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (hf - mean[:, None]) * rstd[:, None], 0.0)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        if WEIGHT_GRAD:
            dw += dy * xhat
        if BIAS_GRAD:
            db += dy
        mean_g = tl.sum(g, axis=1) / N
        mean_gx = tl.sum(g * xhat, axis=1) / N
        dx = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
        if HAS_DH:
            dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)
    if BIAS_GRAD:
        tl.store(DB_PARTIAL + pid * N + cols, tl.sum(db, axis=0), mask=col_ok)


# ---------------------------------------------------------------------------------------------------------
# Launchers: check (``_norm_common.check_inputs``), flatten leading dims, allocate, launch
# ---------------------------------------------------------------------------------------------------------

def _forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
             eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    N = x.shape[-1]
    x2 = rows_of(x, N)
    r2 = rows_of(residual, N) if residual is not None else x2
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x.new_empty(0)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if M == 0:
        return y, h, mean, rstd
    h2 = h.view(-1, N) if residual is not None else x2
    BLOCK_M, BLOCK_N, num_warps = launch_config(M, N, x.device)
    _add_layer_norm_fwd_kernel[(triton.cdiv(M, BLOCK_M),)](
        x2, r2, weight.contiguous() if weight is not None else x2, bias.contiguous() if bias is not None else x2,
        h2, y.view(-1, N), mean, rstd,
        M, N,
        x2.stride(0), r2.stride(0), h2.stride(0), N,
        eps,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=num_warps,
    )
    launches["add_layer_norm_fwd"] += 1
    return y, h, mean, rstd


def _backward(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
              weight_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    N = h.shape[-1]
    h2, dy2 = rows_of(h, N), rows_of(dy, N)
    dh2 = rows_of(dh, N) if dh is not None else h2
    M = h2.shape[0]
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    weight_grad = weight_grad and weight is not None
    if M == 0:
        return (dx, h.new_zeros(N if weight_grad else 0, dtype=torch.float32),
                h.new_zeros(N if bias_grad else 0, dtype=torch.float32))
    BLOCK_M, BLOCK_N, num_warps = launch_config(M, N, h.device)
    # two programs per SM, twice the warps from 8192 columns: a sweep on the H100 (2026-11-26, over 1-8
    # programs per SM and 1-2x the warps; an uncommitted script) took the backward from 36/60/66% of copy
    # bandwidth to 50/69/76% at 8192x1024, 8192x4096 and 16384x8192 (benchmarks/bench_layer_norm.py)
    num_warps = min(32, num_warps * 2) if BLOCK_N >= 8192 else num_warps
    programs, tiles = backward_grid(M, BLOCK_M, num_warps, h.device, per_sm=2)
    dw = torch.empty((programs, N) if weight_grad else (0,), dtype=torch.float32, device=h.device)
    db = torch.empty((programs, N) if bias_grad else (0,), dtype=torch.float32, device=h.device)
    _add_layer_norm_bwd_kernel[(programs,)](
        dy2, dh2, h2, weight.contiguous() if weight is not None else h2, mean.reshape(-1), rstd.reshape(-1),
        dx.view(-1, N), dw, db,
        M, N,
        dy2.stride(0), dh2.stride(0), h2.stride(0), N,
        HAS_DH=dh is not None, HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad,
        TILES=tiles, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=num_warps,
    )
    launches["add_layer_norm_bwd"] += 1
    return dx, (dw.sum(0) if weight_grad else dw), (db.sum(0) if bias_grad else db)


# ---------------------------------------------------------------------------------------------------------
# Eager reference (and the ops' fallback where Triton does not run)
# ---------------------------------------------------------------------------------------------------------

def reference(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
              eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """The unfused torch code: ``(y, h)`` with ``y = F.layer_norm(h, (N,), weight, bias, eps)``."""
    h = x if residual is None else x + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def _reference_forward(h, weight, bias, eps):
    hf = h.float()
    mean = hf.mean(-1)
    centered = hf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centered.square().mean(-1) + eps)
    y = centered * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype), mean, rstd


def _reference_backward(dy, dh, h, weight, mean, rstd, weight_grad, bias_grad):
    """The backward formula of the module docstring in torch ops (the kernel's math)."""
    xhat = (h.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dy = dy.float()
    g = dy if weight is None else dy * weight.float()
    dx = rstd.unsqueeze(-1) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.float()
    N = h.shape[-1]
    empty = h.new_zeros(0, dtype=torch.float32)
    dw = (dy * xhat).reshape(-1, N).sum(0) if weight_grad and weight is not None else empty
    db = dy.reshape(-1, N).sum(0) if bias_grad else empty
    return dx.to(h.dtype).contiguous(), dw, db


# ---------------------------------------------------------------------------------------------------------
# Custom ops, fakes, autograd
# ---------------------------------------------------------------------------------------------------------

@torch.library.custom_op("kpt::add_layer_norm", mutates_args=())
def _add_layer_norm_op(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
                       eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_inputs("kpt::add_layer_norm", x, residual, {"weight": weight, "bias": bias})
    if kernel_runs(x):
        return _forward(x, residual, weight, bias, eps)
    h = (x + residual).contiguous() if residual is not None else x  # contiguous, as the fake says
    y, mean, rstd = _reference_forward(h, weight, bias, eps)
    return y.contiguous(), (h if residual is not None else x.new_empty(0)), mean, rstd


@_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps):
    check_inputs("kpt::add_layer_norm", x, residual, {"weight": weight, "bias": bias})
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    stats = x.shape[:-1]
    return x.new_empty(x.shape), h, x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32)


@torch.library.custom_op("kpt::add_layer_norm_backward", mutates_args=())
def _add_layer_norm_backward_op(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], mean: Tensor,
                                rstd: Tensor, weight_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    if kernel_runs(h):
        return _backward(dy, dh, h, weight, mean, rstd, weight_grad, bias_grad)
    return _reference_backward(dy, dh, h, weight, mean, rstd, weight_grad, bias_grad)


@_add_layer_norm_backward_op.register_fake
def _(dy, dh, h, weight, mean, rstd, weight_grad, bias_grad):
    N = h.shape[-1]
    return (h.new_empty(h.shape), h.new_empty(N if weight_grad and weight is not None else 0, dtype=torch.float32),
            h.new_empty(N if bias_grad else 0, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps = inputs
    y, h, mean, rstd = output
    # one call: each call replaces the last; without a residual h is an empty placeholder (the caller uses x)
    ctx.mark_non_differentiable(*((mean, rstd) if residual is not None else (mean, rstd, h)))
    ctx.set_materialize_grads(False)  # an unused y or h gives None, not a tensor of zeros to read
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.has_residual = residual is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward_formula(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    bias_grad = ctx.bias_dtype is not None and ctx.needs_input_grad[3]
    dh = dh if ctx.has_residual else None
    if dy is None:  # only h is used downstream: h = x + residual passes its gradient through
        dw = torch.zeros_like(weight) if weight_grad else None
        db = h.new_zeros(h.shape[-1], dtype=ctx.bias_dtype) if bias_grad else None
        return dh, (dh if ctx.has_residual else None), dw, db, None
    dx, dw, db = torch.ops.kpt.add_layer_norm_backward(dy, dh, h, weight, mean, rstd, weight_grad, bias_grad)
    return (dx, (dx if ctx.has_residual else None), (dw.to(weight.dtype) if weight_grad else None),
            (db.to(ctx.bias_dtype) if bias_grad else None), None)


_add_layer_norm_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------------------

def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """``(y, h)``: h = x + residual (x itself when residual is None), y = F.layer_norm(h, (N,), weight, bias, eps).

    Differentiable in x, residual, weight and bias; see the module docstring for the math.
    """
    y, h, _, _ = torch.ops.kpt.add_layer_norm(x, residual, weight, bias, eps)
    return y, (h if residual is not None else x)
