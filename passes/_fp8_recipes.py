"""fp8 linear layers: dynamic scaling, the cast, ``torch._scaled_mm``, and the backward each recipe prescribes.

A tensor is quantized to an fp8 format by a scale per tensor or per row, computed from the tensor itself on
every call (dynamic scaling)::

    s = max(amax(|t|), AMAX_FLOOR) / finfo(fp8).max     # over the whole tensor, or along the reduction dim
    t8 = clamp(t / s, -max, max).to(fp8)                # t ~= t8 * s

and ``torch._scaled_mm(a8, b8, scale_a=s_a, scale_b=s_b)`` computes ``(a8 * s_a) @ (b8 * s_b)`` with fp32
accumulation, the output in the layer's dtype. The floor on amax keeps an all-zero row from dividing by 0
(a NaN users of rowwise scaling report).

The recipes are torchao's float8 training recipes:

- ``tensorwise``: one scale per tensor; e4m3 forward, the output gradient in e5m2 (its wider range);
- ``rowwise``: one scale per row of each operand along its reduction dimension, e4m3 throughout;
- ``rowwise_with_gw_hp``: rowwise, but the weight gradient computed in the layer's precision.

As torchao's recipes do, the forward GEMM accumulates in Hopper's fast fp8 mode (``use_fast_accum``) and the
gradient GEMMs with full promotion to fp32.

``fp8_linear`` is what the fp8 pass puts into Dynamo's graph in place of ``F.linear``: plain torch ops inside a
``torch.autograd.Function``, so AOTAutograd traces the forward and this backward, and Inductor fuses each
amax and cast into the kernels around them.
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def quantize(t: torch.Tensor, fp8: torch.dtype, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t8, scale) with t ~= t8 * scale: one scale for the tensor (``dim=None``) or one per slice along ``dim``
    (kept as a size-1 dimension), in float32."""
    top = torch.finfo(fp8).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = amax.float().clamp_min(AMAX_FLOOR) / top
    return (t.float() / scale).clamp(-top, top).to(fp8), scale


def _mm(a8, sa, b8, sb, out_dtype, bias=None, fast_accum=False):
    """(a8 * sa) @ (b8 * sb); ``a8`` row-major, ``b8`` column-major, as ``_scaled_mm`` wants them.
    ``fast_accum``: Hopper's faster fp8 accumulation (fewer promotions to fp32), for the forward GEMM only."""
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, bias, recipe):
        dtype = x2.dtype
        if recipe == "tensorwise":
            x8, sx = quantize(x2, E4M3)
            w8, sw = quantize(w, E4M3)
            out = _mm(x8, sx, w8.t(), sw, dtype, bias, fast_accum=True)
        else:
            x8, sx = quantize(x2, E4M3, dim=-1)  # [M, 1]: per row of x along K
            w8, sw = quantize(w, E4M3, dim=-1)  # [N, 1]: per output channel along K
            out = _mm(x8, sx, w8.t(), sw.t(), dtype, fast_accum=True)
            if bias is not None:
                out = out + bias
        ctx.save_for_backward(x2, w)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x2, w = ctx.saved_tensors
        dtype, recipe = grad.dtype, ctx.recipe
        grad = grad.contiguous()
        if recipe == "tensorwise":
            g8, sg = quantize(grad, E5M2)
            w8, sw = quantize(w, E4M3)
            grad_x = _mm(g8, sg, _col_major(w8), sw, dtype)  # [M, N] @ [N, K]
            x8, sx = quantize(x2, E4M3)
            grad_w = _mm(g8.t().contiguous(), sg, _col_major(x8), sx, dtype)  # [N, M] @ [M, K]
        else:
            g8, sg = quantize(grad, E4M3, dim=-1)  # per row of grad along N
            w8, sw = quantize(w, E4M3, dim=0)  # [1, K]: per column of w along N
            grad_x = _mm(g8, sg, _col_major(w8), sw, dtype)
            if recipe == "rowwise_with_gw_hp":
                grad_w = grad.t() @ x2
            else:
                gt8, sgt = quantize(grad.t().contiguous(), E4M3, dim=-1)  # [N, 1] along M
                x8, sx = quantize(x2, E4M3, dim=0)  # [1, K] along M
                grad_w = _mm(gt8, sgt, _col_major(x8), sx, dtype)
        grad_b = grad.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               recipe: str = "tensorwise") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its matrix products in fp8 by ``recipe`` (see the module docstring)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    x2 = x.reshape(-1, x.shape[-1])
    out = _Fp8Linear.apply(x2, weight, bias, recipe)
    return out.reshape(*x.shape[:-1], weight.shape[0])
