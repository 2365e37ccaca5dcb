"""Releasing the bf16 weights the fp8 pass quantized once: ``kpt_compiler.release_weights(model)``.

After an inference graph compiled with static fp8 weights (passes/_fp8_static.py), the module still holds its
bf16 (or fp16, fp32) parameters: a recompile (another input shape) quantizes from them, the lossy guard measures
against them, and the model still runs outside the compiled graph. ``release_weights`` gives that up for the
memory: each frozen parameter with a static fp8 copy is replaced, in its module, by an ``Fp8WeightTensor``
parameter of the same shape and dtype that holds only the e4m3 values and their scale (the very tensors the
compiled graphs read), and the bf16 storage goes with the last reference to the old parameter.

What still works, and how:
- The compiled graphs: Dynamo sees a new parameter and compiles again; the fp8 pass reads the released weight
  directly (``fp8_linear_released``) for every layer that uses it, whatever its cost model says, since no bf16
  weight is left to choose. The lossy guard then measures each layer against the dequantized weight: it sees the
  activation's quantization error only, and the report says so.
- Anything else that reads the weight (the model run eagerly, a graph compiled without fp8, the embedding of a
  tied weight): ``__torch_dispatch__`` dequantizes it (``w8 * scale`` in the original dtype) for that op. Correct,
  and slower than bf16.
- Writing into it (``copy_``, ``load_state_dict``, an optimizer step) is an error that says what to do: the
  bf16 values it would change no longer exist.

Parameters that require grad are not released (a released weight cannot train); nor is one that several modules
share (a tied embedding and output layer: the embedding would dequantize the whole table on every call). The
wrapper's behaviour and the release loop are passes/_released.py's, shared with the fp4 pass.
"""

from __future__ import annotations

import torch

from . import _fp8_static
from ._released import Released, ReleasedWeight, fitting_copy, release


class Fp8WeightTensor(ReleasedWeight):
    """A weight released to fp8: shape, dtype and device of the parameter it replaced; holds ``w8`` ([N, K] e4m3,
    as ``Fp8Weight`` stores it) and ``scale`` (scalar or [1, N]), ``transposed`` where the layer stores its weight
    [K, N] (GPT-2's Conv1D). Any op but ``detach`` sees the dequantized weight (passes/_released.py)."""

    FORMAT = "fp8"

    @staticmethod
    def __new__(cls, w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, granularity: str, transposed: bool):
        shape = w8.shape[::-1] if transposed else w8.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=w8.device, requires_grad=False)

    def __init__(self, w8, scale, dtype, granularity, transposed):
        self.w8, self.scale, self.granularity, self.transposed = w8, scale, granularity, transposed

    def __repr__(self) -> str:
        return (f"Fp8WeightTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {self.granularity}, "
                "released by kpt_compiler.release_weights)")

    def __tensor_flatten__(self):
        return ["w8", "scale"], (self.dtype, self.granularity, self.transposed)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8WeightTensor(inner["w8"], inner["scale"], *ctx)

    def same(self) -> "Fp8WeightTensor":
        return Fp8WeightTensor(self.w8, self.scale, self.dtype, self.granularity, self.transposed)

    def dequantize(self) -> torch.Tensor:
        """The weight as the layer had it (its dtype and layout), from the e4m3 values and their scale."""
        scale = self.scale.t() if self.granularity == "rowwise" else self.scale  # [1, N] -> [N, 1]
        w = (self.w8.to(torch.float32) * scale).to(self.dtype)
        return w.t() if self.transposed else w


def bias_after(bias, x) -> bool:
    """Whether an fp8 layer adds its bias after the GEMM: cuBLAS's fp8 GEMM takes a bias only with a 16-bit
    output, and for a float32 layer torch._scaled_mm raises "Bias is not supported when out_dtype is set to
    Float32" on CUDA (torch 2.11, H200; the CPU's takes it)."""
    return bias is not None and x.dtype == torch.float32 and x.device.type == "cuda"


def fp8_linear_released(x: torch.Tensor, w: Fp8WeightTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (``x @ w + bias`` where the weight is stored [K, N]) on a released weight's e4m3
    values: the same GEMM as ``fp8_linear_static`` (the bias added after it where ``bias_after``)."""
    if bias_after(bias, x):
        return _fp8_static.fp8_linear_static(x, w.w8, w.scale, granularity=w.granularity) + bias
    return _fp8_static.fp8_linear_static(x, w.w8, w.scale, bias, granularity=w.granularity)


def release_weights(module: torch.nn.Module) -> Released:
    """Replace each parameter of ``module`` that the fp8 pass quantized once (compile the model with
    ``fp8`` first, under ``torch.no_grad()``, with frozen parameters or ``static_weights=True``) by its fp8 copy,
    so that its bf16 storage can be freed. See the module's docstring for what still works."""
    def wrap(w):
        return Fp8WeightTensor(w.w8, w.scale, w.dtype, w.granularity, w.transposed)
    return release(module, lambda p: fitting_copy(_fp8_static._TABLE, p), wrap, "fp8")
