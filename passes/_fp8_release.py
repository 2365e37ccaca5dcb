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
share (a tied embedding and output layer: the embedding would dequantize the whole table on every call).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.utils._pytree import tree_map

from . import _fp8_static

log = logging.getLogger("kpt_compiler")


class Fp8WeightTensor(torch.Tensor):
    """A weight released to fp8: shape, dtype and device of the parameter it replaced; holds ``w8`` ([N, K] e4m3,
    as ``Fp8Weight`` stores it) and ``scale`` (scalar or [1, N]), ``transposed`` where the layer stores its weight
    [K, N] (GPT-2's Conv1D). Any op but ``detach`` sees the dequantized weight."""

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

    def dequantize(self) -> torch.Tensor:
        """The weight as the layer had it (its dtype and layout), from the e4m3 values and their scale."""
        scale = self.scale.t() if self.granularity == "rowwise" else self.scale  # [1, N] -> [N, 1]
        w = (self.w8.to(torch.float32) * scale).to(self.dtype)
        return w.t() if self.transposed else w

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:  # nn.Parameter(t) and .detach() keep the released weight
            t = args[0]
            return Fp8WeightTensor(t.w8, t.scale, t.dtype, t.granularity, t.transposed)
        if func._schema.is_mutable and any(isinstance(a, Fp8WeightTensor) for a in args):
            raise RuntimeError(
                f"{func}: cannot write into a weight released to fp8 by kpt_compiler.release_weights: its bf16 "
                "values are gone. Load new weights into a model that was not released, then compile it again.")
        return func(*tree_map(lambda t: t.dequantize() if isinstance(t, Fp8WeightTensor) else t, args),
                    **tree_map(lambda t: t.dequantize() if isinstance(t, Fp8WeightTensor) else t, kwargs))


def fp8_linear_released(x: torch.Tensor, w: Fp8WeightTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (``x @ w + bias`` where the weight is stored [K, N]) on a released weight's e4m3
    values: the same GEMM as ``fp8_linear_static``."""
    return _fp8_static.fp8_linear_static(x, w.w8, w.scale, bias, granularity=w.granularity)


@dataclasses.dataclass
class Released:
    """What ``release_weights`` did: how many parameters it replaced, the bytes of their old storage (freed once
    nothing else holds the old parameters) and of the fp8 copies they now are, and why it left others."""

    count: int = 0
    freed_bytes: int = 0
    fp8_bytes: int = 0
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        text = (f"released {self.count} weights to fp8: {self.freed_bytes / 2**20:.1f} MiB of their own copies freed, "
                f"{self.fp8_bytes / 2**20:.1f} MiB of fp8 kept")
        return text + "".join(f"; {name}: {why}" for name, why in self.skipped.items())


def release_weights(module: torch.nn.Module) -> Released:
    """Replace each parameter of ``module`` that the fp8 pass quantized once (compile the model with
    ``fp8`` first, under ``torch.no_grad()``, with frozen parameters or ``static_weights=True``) by its fp8 copy,
    so that its bf16 storage can be freed. See the module's docstring for what still works."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for mod in module.modules():
        for name, param in mod._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((mod, name))
    done = Released()
    for path, param in module.named_parameters():
        weights = [w for w in (_fp8_static._TABLE.get(param) or {}).values() if w.fits(param)]
        if isinstance(param, Fp8WeightTensor) or not weights:
            continue
        if param.requires_grad:
            done.skipped[path] = "requires grad (a released weight cannot train; freeze it to release it)"
            continue
        if len(owners[id(param)]) > 1:
            done.skipped[path] = (f"shared by {len(owners[id(param)])} modules (tied weights): the others would "
                                  "dequantize it on every call")
            continue
        weight = weights[0]
        if weight.stale(param):
            weight.refresh(param)
        released = torch.nn.Parameter(
            Fp8WeightTensor(weight.w8, weight.scale, weight.dtype, weight.granularity, weight.transposed),
            requires_grad=False)
        for mod, name in owners[id(param)]:
            mod._parameters[name] = released
        done.count += 1
        done.freed_bytes += param.untyped_storage().nbytes()
        done.fp8_bytes += weight.nbytes
    log.info("kernelpytorch: %s", done)
    return done
