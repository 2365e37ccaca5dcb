"""What the weight passes share to release a module's 16-bit weights to their low-precision copies
(``kpt_compiler.release_weights``; the fp8 pass's in passes/_fp8_release.py, the fp4 pass's in
passes/_fp4_release.py).

A released parameter is a ``ReleasedWeight``: a wrapper tensor with the parameter's shape, dtype and device that
holds only the low-precision values the compiled graphs read. Any op but ``detach`` sees it dequantized (the
model run eagerly, a graph compiled without the pass, a tied embedding): correct, slower. Writing into it is an
error that says what to do: the 16-bit values it would change no longer exist. Parameters that require grad
are not released (a released weight cannot train); nor is one several modules share (tied weights: the others
would dequantize it on every call).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

log = logging.getLogger("kpt_compiler")


class ReleasedWeight(torch.Tensor):
    """Base of a released weight. Subclasses set ``FORMAT`` and define ``dequantize()`` (the weight in its
    dtype and the layer's layout) and ``same()`` (a new wrapper of the same inner tensors)."""

    FORMAT = "a lower precision"

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def same(self) -> "ReleasedWeight":
        raise NotImplementedError

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:  # nn.Parameter(t) and .detach() keep the released weight
            return args[0].same()
        if func._schema.is_mutable and any(isinstance(a, ReleasedWeight) for a in args):
            raise RuntimeError(
                f"{func}: cannot write into a weight released to {cls.FORMAT} by kpt_compiler.release_weights: its "
                "16-bit values are gone. Load new weights into a model that was not released, then compile it again.")

        def plain(t):
            return t.dequantize() if isinstance(t, ReleasedWeight) else t
        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


@dataclasses.dataclass
class Released:
    """What ``release_weights`` did: how many parameters it replaced, the bytes of their old storage (freed once
    nothing else holds the old parameters) and of the copies they now are, and why it left others."""

    count: int = 0
    freed_bytes: int = 0
    kept_bytes: int = 0
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    to: str = "fp8"

    @property
    def fp8_bytes(self) -> int:  # the name the fp8 release had first
        return self.kept_bytes

    def __add__(self, other: "Released") -> "Released":
        to = self.to if not other.count else other.to if not self.count else f"{self.to} and {other.to}"
        return Released(self.count + other.count, self.freed_bytes + other.freed_bytes,
                        self.kept_bytes + other.kept_bytes, {**self.skipped, **other.skipped}, to)

    def __str__(self) -> str:
        text = (f"released {self.count} weights to {self.to}: {self.freed_bytes / 2**20:.1f} MiB of their own "
                f"copies freed, {self.kept_bytes / 2**20:.1f} MiB of {self.to} kept")
        return text + "".join(f"; {name}: {why}" for name, why in self.skipped.items())


def fitting_copy(table, param: torch.Tensor):
    """The first copy of ``param`` in a pass's copy table (parameter -> {key: copy}) that fits it, made again if
    the parameter changed since; None if there is none."""
    copies = [c for c in (table.get(param) or {}).values() if c.fits(param)]
    if not copies:
        return None
    if copies[0].stale(param):
        copies[0].refresh(param)
    return copies[0]


def release(module: torch.nn.Module, copy_of: Callable[[torch.Tensor], Any],
            wrap: Callable[[Any], ReleasedWeight], to: str) -> Released:
    """Replace each parameter of ``module`` that ``copy_of`` has a low-precision copy of (fitting and up to date;
    None: not released) by ``wrap(copy)``, in every module that holds it."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for mod in module.modules():
        for name, param in mod._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((mod, name))
    done = Released(to=to)
    for path, param in module.named_parameters():
        if isinstance(param, ReleasedWeight):
            continue
        copy = copy_of(param)
        if copy is None:
            continue
        if param.requires_grad:
            done.skipped[path] = "requires grad (a released weight cannot train; freeze it to release it)"
            continue
        if len(owners[id(param)]) > 1:
            done.skipped[path] = (f"shared by {len(owners[id(param)])} modules (tied weights): the others would "
                                  "dequantize it on every call")
            continue
        released = torch.nn.Parameter(wrap(copy), requires_grad=False)
        for mod, name in owners[id(param)]:
            mod._parameters[name] = released
        done.count += 1
        done.freed_bytes += param.untyped_storage().nbytes()
        done.kept_bytes += copy.nbytes
    log.info("kernelpytorch: %s", done)
    return done
