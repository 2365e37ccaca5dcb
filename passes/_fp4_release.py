"""Releasing the 16-bit weights the fp4 pass quantized (issue 18: "free the bf16 weights"):
``kpt_compiler.release_weights(model)``.

After an inference graph compiled with ``fp4``, the module still holds its bf16 (fp16) parameters beside their
fp4 copies: a recompile quantizes from them, the lossy guard measures against them, and the model still runs
outside the compiled graph. ``release_weights`` gives that up for the memory: each frozen parameter with an fp4
copy is replaced, in its module, by an ``Fp4WeightTensor`` parameter of the same shape and dtype that holds only
the packed codes, the block scales and the tensor scale (the very tensors the compiled graphs read); the 16-bit
storage goes with the last reference to the old parameter.

What still works, and how (passes/_released.py):
- The compiled graphs: Dynamo sees a new parameter and compiles again; the fp4 pass reads the released weight's
  codes directly for every layer that uses it, whatever its cost model or its ``format`` option says, since no
  16-bit weight is left to choose. The lossy guard then measures each layer against the dequantized weight,
  which shows the kernel's own error only, and the report says so.
- Anything else that reads the weight sees it dequantized (correct, slower); writing into it is an error.
"""

from __future__ import annotations

import torch

from ._released import Released, ReleasedWeight, fitting_copy, release


class Fp4WeightTensor(ReleasedWeight):
    """A weight released to fp4: shape, dtype and device of the parameter it replaced; holds ``packed`` ([N, K / 2]
    codes), ``scales`` ([N, K / block], E4M3 or E8M0 bytes) and ``global_scale`` (fp32 scalar) of the format
    named ``fmt``, ``transposed`` where the layer stores its weight [K, N] (GPT-2's Conv1D)."""

    FORMAT = "fp4"

    @staticmethod
    def __new__(cls, packed, scales, global_scale, fmt: str, dtype: torch.dtype, transposed: bool):
        shape = (packed.shape[0], packed.shape[1] * 2)
        return torch.Tensor._make_wrapper_subclass(cls, shape[::-1] if transposed else shape, dtype=dtype,
                                                   device=packed.device, requires_grad=False)

    def __init__(self, packed, scales, global_scale, fmt, dtype, transposed):
        self.packed, self.scales, self.global_scale = packed, scales, global_scale
        self.fmt, self.transposed = fmt, transposed

    def __repr__(self) -> str:
        return (f"Fp4WeightTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {self.fmt}, released by "
                "kpt_compiler.release_weights)")

    def __tensor_flatten__(self):
        return ["packed", "scales", "global_scale"], (self.fmt, self.dtype, self.transposed)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp4WeightTensor(inner["packed"], inner["scales"], inner["global_scale"], *ctx)

    def same(self) -> "Fp4WeightTensor":
        return Fp4WeightTensor(self.packed, self.scales, self.global_scale, self.fmt, self.dtype, self.transposed)

    @property
    def q(self):
        """The weight [N, K] as kernels/_fp4_format.py holds it."""
        from kpt_compiler.kernels import _fp4_format

        n, half = self.packed.shape
        return _fp4_format.Fp4Weight(_fp4_format.FORMATS[self.fmt], self.packed, self.scales, self.global_scale,
                                     (n, half * 2))

    def dequantize(self) -> torch.Tensor:
        """The weight as the layer had it (its dtype and layout), from the codes and their scales."""
        from kpt_compiler.kernels import _fp4_format

        w = _fp4_format.dequantize(self.q, self.dtype)
        return w.t() if self.transposed else w


def _copy_of(param: torch.Tensor):
    from . import fp4

    return fitting_copy(fp4._TABLE, param)


def _wrap(copy) -> Fp4WeightTensor:
    q = copy.q
    return Fp4WeightTensor(q.packed, q.scales, q.global_scale, q.format.name, copy.dtype, copy.transposed)


def release_weights(module: torch.nn.Module) -> Released:
    """Replace each parameter of ``module`` that the fp4 pass quantized (compile the model with ``fp4`` first,
    under ``torch.no_grad()``) by its fp4 copy, so that its 16-bit storage can be freed."""
    return release(module, _copy_of, _wrap, "fp4")
