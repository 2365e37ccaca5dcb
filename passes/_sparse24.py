"""2:4 structured sparsity, the part that needs no GPU (issue 19): the pattern, magnitude pruning to it, and
pruning a model so that it can be fine-tuned with the pattern kept.

The pattern: along K (the input features, the reduction dimension of ``x @ w.T``), in every group of four
consecutive weights at most two are non-zero; NVIDIA's sparse tensor cores skip the zeros
(``torch.sparse.to_sparse_semi_structured``, CUDA only). Magnitude pruning keeps the two largest |w| of each
group (on ties the earlier position). Pruning a trained model loses accuracy; fine-tuning with the mask kept
(the pruned weights' gradients zeroed, so SGD, Adam and AdamW leave them at zero) recovers most of it:
``kpt_compiler.prune_2_4(model)`` prunes every eligible ``nn.Linear`` and installs those gradient hooks.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import Tensor

GROUP = 4  # weights per group along K
KEEP = 2  # non-zero at most per group


def _groups(w: Tensor) -> Tensor:
    if w.dim() != 2:
        raise ValueError(f"2:4 sparsity applies to 2-D weights [N, K], got shape {tuple(w.shape)}")
    if w.shape[1] % GROUP:
        raise ValueError(f"2:4 sparsity groups K in fours: K={w.shape[1]} is not a multiple of {GROUP}")
    return w.reshape(w.shape[0], w.shape[1] // GROUP, GROUP)


def mask_2_4(w: Tensor) -> Tensor:
    """Bool mask [N, K]: True at the two largest |w| of each group of four along K (on ties, the earlier)."""
    groups = _groups(w).abs()
    order = torch.sort(groups, dim=-1, descending=True, stable=True).indices[..., :KEEP]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, order, True)
    return mask.reshape(w.shape)


def is_2_4(w: Tensor) -> bool:
    """Whether every group of four along K has at most two non-zeros."""
    return bool(((_groups(w) != 0).sum(-1) <= KEEP).all())


def prune_2_4(w: Tensor) -> Tensor:
    """``w`` with the two smallest |w| of each group of four along K set to zero."""
    return w * mask_2_4(w)


@dataclasses.dataclass
class Pruned:
    """What ``prune`` did, per layer: the share of zeros after, the weight's SQNR against before (dB; inf where
    it already had the pattern), and the layers left with why."""

    layers: dict[str, dict] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        text = f"pruned {len(self.layers)} layers to 2:4: " + ", ".join(
            f"{name} ({v['sqnr_db']:.1f} dB)" for name, v in self.layers.items())
        return text + "".join(f"; {name}: {why}" for name, why in self.skipped.items())


def prune(module: torch.nn.Module, *, skip=(), min_features: int = 64, keep_mask: bool = True) -> Pruned:
    """Prune the weight of every ``nn.Linear`` in ``module`` to 2:4 along its input features, in place. Left
    alone: module paths matching a ``skip`` pattern (fnmatch), layers with fewer than ``min_features`` input or
    output features, input features not a multiple of four. ``keep_mask``: a gradient hook on each pruned weight
    zeroes the gradients of its pruned positions, so fine-tuning keeps the pattern (``Pruned`` reports per layer;
    ``is_2_4`` checks a weight)."""
    from kpt_compiler.lossy_guard import sqnr_db

    if isinstance(skip, str):
        raise ValueError(f"skip must be a list of module-path patterns (strings), got {skip!r}")
    done = Pruned()
    for path, mod in module.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight
        n, k = w.shape
        if any(fnmatch.fnmatchcase(path, p) for p in skip):
            done.skipped[path] = "matches a skip pattern"
        elif min(n, k) < min_features:
            done.skipped[path] = f"{k}x{n} is under min_features={min_features}"
        elif k % GROUP:
            done.skipped[path] = f"K={k} input features are not a multiple of {GROUP}"
        else:
            with torch.no_grad():
                before = w.detach().float().clone()
                mask = mask_2_4(w)
                w.mul_(mask)
            if keep_mask and w.requires_grad:
                w.register_hook(lambda grad, mask=mask: grad * mask)
            done.layers[path] = {"shape": (n, k), "zeros": 1 - mask.float().mean().item(),
                                 "sqnr_db": sqnr_db(w.detach().float(), before)}
    return done
