"""A layer's weight kept in another form (fp4 codes, a 2:4 compressed matrix), made from its parameter when the
graph compiles and made again, in place, when the parameter changes: what the fp4 and 2:4 passes share (the
fp8 pass's static weights, passes/_fp8_static.py, keep their own: its source is what their calibration was
measured with).

A copy is made in place again, so graphs and CUDA graphs keep reading the same tensors. Each pass keeps a table
parameter -> {key: copy}, weak both ways (a copy lives as long as a graph reads it); the check before each call
is ``refresh`` below, which asks ``stale`` and ``refresh`` of each copy.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary


class WeightCopy:
    """``param`` (``param.t()`` where the layer stores the weight [K, N]) in another form: ``parts``, made by the
    subclass's ``make`` from the weight [N, K]. ``key``: its key in its pass's table (``copy_in`` sets it)."""

    key = None

    def __init__(self, param: torch.Tensor, transposed: bool):
        self.transposed, self.dtype, self.device = transposed, param.dtype, param.device
        self.shape = tuple(param.shape[::-1] if transposed else param.shape)
        with torch.no_grad():
            self.parts = self.make(self._weight(param))
        self._mark(param)

    def make(self, w: torch.Tensor) -> tuple:
        raise NotImplementedError

    def _weight(self, param: torch.Tensor) -> torch.Tensor:
        w = param.detach()
        return w.t() if self.transposed else w

    def _mark(self, param: torch.Tensor) -> None:
        self.made_from = (weakref.ref(param), param._version, param.data_ptr())

    def stale(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is not the one this was made from as it was (identity, version, storage)."""
        ref, version, ptr = self.made_from
        return ref() is not param or (param._version, param.data_ptr()) != (version, ptr)

    def fits(self, param: torch.Tensor) -> bool:
        shape = tuple(param.shape[::-1] if self.transposed else param.shape)
        return shape == self.shape and param.device == self.device and param.dtype == self.dtype

    def refresh(self, param: torch.Tensor) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.parts, self.make(self._weight(param))):
                if mine is not None:
                    mine.copy_(theirs)
        self._mark(param)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts if isinstance(t, torch.Tensor))


def new_table() -> WeakIdKeyDictionary:
    return WeakIdKeyDictionary()


def copy_in(table: WeakIdKeyDictionary, param: torch.Tensor, key, make) -> WeightCopy:
    """The shared copy of ``param`` under ``key`` (``make()`` builds one): made now if there is none or the
    parameter no longer fits it (a recompile for another shape, dtype or device gets a new one), made again if
    it changed since."""
    mine = table.get(param)
    if mine is None:
        mine = table[param] = weakref.WeakValueDictionary()
    copy = mine.get(key)
    if copy is None or not copy.fits(param):
        copy = mine[key] = make()
        copy.key = key
    elif copy.stale(param):
        copy.refresh(param)
    return copy


def refresh(table: WeakIdKeyDictionary, copies, args) -> None:
    """Before a call: make again each copy whose argument (by position) is not what it was made from. A
    parameter replaced by another object (``layer.weight = nn.Parameter(...)``) takes the copy over in the table,
    so that ``refresh_all`` finds it under the parameter the module now holds."""
    for index, copy in copies:
        param = args[index]
        if copy.stale(param):
            if copy.made_from[0]() is not param and copy.key is not None:
                mine = table.get(param)
                if mine is None:
                    mine = table[param] = weakref.WeakValueDictionary()
                mine[copy.key] = copy
            copy.refresh(param)


def refresh_all(table: WeakIdKeyDictionary, module: torch.nn.Module) -> int:
    """Make again every copy in ``table`` of ``module``'s parameters (kpt_compiler.refresh_weights)."""
    done = 0
    for param in module.parameters():
        for copy in list((table.get(param) or {}).values()):
            if copy.fits(param):
                copy.refresh(param)
                done += 1
    return done
