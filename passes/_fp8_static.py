"""fp8 linear layers at inference with the weights quantized once, at compile time, instead of on every call.

In an inference graph (no gradient flows) a weight that is a module's parameter does not change between calls
unless the user changes it. The fp8 pass then quantizes it when it compiles (``Fp8Weight``: the e4m3 weight
[N, K] and its scale, one per tensor or one per output channel) and the graph reads these constants; each call
quantizes only the activation::

    y = fp8_linear_static(x, w8, w_scale, b, granularity=...)      # x -> (x8, sx); torch._scaled_mm

A parameter can still change: ``load_state_dict`` and in-place ops write into it (its ``_version`` goes up),
and a compiled graph can be called with another module's parameters (Dynamo does not guard on their
identity). So before each call ``refresh`` compares what each weight was quantized from (the tensor object,
its version, its storage) with the argument the graph gets, and quantizes again, in place, where they differ.
The check costs well under a microsecond per layer. It cannot see writes that bump no version: through
``param.data`` (``p.data.copy_(...)``) and a fused optimizer's step (``AdamW(fused=True)``). That is why the
pass quantizes once, by default, only parameters with ``requires_grad=False`` (frozen: no optimizer steps
them); with ``static_weights=True`` it takes every parameter, and after such a write the user calls
``refresh_weights(module)``.

One ``Fp8Weight`` per parameter (and scaling) is shared by every graph compiled from it (a recompile for
another input shape adds no copy): ``weight_for`` keeps them in a table that keeps neither the parameters nor
the fp8 copies alive (a copy goes with the last compiled graph that reads it).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._fp8_recipes import E4M3, _mm, quantize

# what keys the cost model's static-weight tables: this file and the quantization and GEMM it calls
SOURCE_MODULES = ("_fp8_static", "_fp8_recipes")


class Fp8Weight:
    """A parameter's weight [N, K] in e4m3 (row-major, so ``w8.t()`` is the column-major operand
    ``_scaled_mm`` wants) and its float32 scale: a scalar (tensorwise) or [1, N] (rowwise), made from
    ``param`` (or ``param.t()`` where the layer stores the weight [K, N], as GPT-2's Conv1D)."""

    def __init__(self, param: torch.Tensor, granularity: str, transposed: bool):
        self.granularity, self.transposed, self.dtype = granularity, transposed, param.dtype
        self.w8, self.scale = self._quantize(param)
        self._seen(param)

    def _quantize(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            w = param.detach().t() if self.transposed else param.detach()
            if self.granularity == "tensorwise":
                w8, scale = quantize(w, E4M3)
            else:
                w8, scale = quantize(w, E4M3, dim=-1)  # [N, 1]: one scale per output channel
                scale = scale.t().contiguous()  # [1, N], as _scaled_mm takes the second operand's scales
            return w8.contiguous(), scale

    def _seen(self, param: torch.Tensor) -> None:
        self.source = weakref.ref(param)
        self.version, self.ptr = param._version, param.data_ptr()

    def fits(self, param: torch.Tensor) -> bool:
        """Whether ``param`` can be quantized into this copy's tensors (same shape, dtype and device)."""
        shape = tuple(param.shape[::-1] if self.transposed else param.shape)
        return shape == tuple(self.w8.shape) and param.device == self.w8.device and param.dtype == self.dtype

    def stale(self, param: torch.Tensor) -> bool:
        return self.source() is not param or param._version != self.version or param.data_ptr() != self.ptr

    def refresh(self, param: torch.Tensor) -> None:
        """Quantize ``param`` again into the same tensors (graphs and CUDA graphs read them where they are)."""
        w8, scale = self._quantize(param)
        self.w8.copy_(w8)
        self.scale.copy_(scale)
        self._seen(param)

    @property
    def nbytes(self) -> int:
        return self.w8.nbytes + self.scale.nbytes


# by the parameter's identity (a WeakKeyDictionary would compare tensors with ==), not keeping it alive
_TABLE = WeakIdKeyDictionary()


def weight_for(param: torch.Tensor, granularity: str, transposed: bool) -> Fp8Weight:
    """The shared ``Fp8Weight`` of ``param`` (quantized now if none is, or if it changed since)."""
    per_param = _TABLE.get(param)
    if per_param is None:  # held weakly: an Fp8Weight lives as long as a compiled graph uses it
        per_param = _TABLE[param] = weakref.WeakValueDictionary()
    key = (granularity, transposed)
    weight = per_param.get(key)
    if weight is None or not weight.fits(param):  # new, or the parameter changed shape, dtype or device (Dynamo
        # recompiled for it): a new copy, the graphs compiled before keep theirs
        weight = per_param[key] = Fp8Weight(param, granularity, transposed)
    elif weight.stale(param):
        weight.refresh(param)
    return weight


def refresh_weights(module: torch.nn.Module) -> int:
    """Quantize again every static fp8 copy of ``module``'s parameters (after a write the check before each call
    cannot see: ``param.data.copy_(...)``, a fused optimizer's step). Returns how many it refreshed."""
    done = 0
    for param in module.parameters():
        for weight in list((_TABLE.get(param) or {}).values()):
            if weight.fits(param):
                weight.refresh(param)
                done += 1
    return done


def refresh(weights: Sequence[tuple[int, Fp8Weight]], args: Sequence[torch.Tensor]) -> None:
    """Before a call: quantize again each weight whose argument (by position) is not what it was made from."""
    for index, weight in weights:
        param = args[index]
        if weight.stale(param):
            weight.refresh(param)


def fp8_linear_static(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      *, granularity: str = "tensorwise") -> torch.Tensor:
    """``F.linear(x, w, bias)`` with ``w ~= w8 * w_scale`` quantized beforehand and ``x`` quantized here."""
    x2 = x.reshape(-1, x.shape[-1])
    if granularity == "tensorwise":
        x8, sx = quantize(x2, E4M3)
        out = _mm(x8, sx, w8.t(), w_scale, x.dtype, bias, fast_accum=True)
    else:
        x8, sx = quantize(x2, E4M3, dim=-1)  # [M, 1]
        out = _mm(x8, sx, w8.t(), w_scale, x.dtype, fast_accum=True)
        if bias is not None:
            out = out + bias
    return out.reshape(*x.shape[:-1], w8.shape[0])
