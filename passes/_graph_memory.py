"""The memory of our captured graphs and the ownership of the storages they keep (passes/_bucket_graphs.py).

- ``pool_bytes``: what a graph pool holds, read from the allocator's segments. The reserved memory's growth
  across a capture is no measure of it: ``torch.cuda.graph`` empties the cache as it starts (torch's source; our
  reading of why s39-s44's streams showed 0 MiB).
- ``same_layout``, ``movable``, ``sole_owner``: whether a new static cache may be moved into the storage a capture
  kept (``BucketGraphs._adopt``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["pool_bytes", "same_layout", "movable", "sole_owner"]


def pool_bytes(pool) -> int | None:
    """What the allocator's segments of graph pool ``pool`` hold on the current device: our graphs' memory, which
    grows only by a capture's own allocations. None where its snapshot names no pools."""
    device = torch.cuda.current_device()
    segments = torch.cuda.memory_snapshot()
    if segments and "segment_pool_id" not in segments[0]:
        return None
    return sum(seg["total_size"] for seg in segments
               if seg.get("device", device) == device and tuple(seg["segment_pool_id"]) == tuple(pool))


def same_layout(new: torch.Tensor, old: torch.Tensor) -> bool:
    return (type(new) is type(old) and new.dtype == old.dtype and new.device == old.device
            and new.size() == old.size() and new.stride() == old.stride()
            and new.storage_offset() == old.storage_offset()
            and new.untyped_storage().nbytes() == old.untyped_storage().nbytes())


def movable(t: Any) -> bool:
    """A tensor whose storage ``set_`` may replace: not an inference tensor outside inference mode (``set_`` would
    raise after moving it), no gradient."""
    return isinstance(t, torch.Tensor) and not t.requires_grad and \
        (not t.is_inference() or torch.is_inference_mode_enabled())


_ALONE: tuple[int, int] | None = None


def _counts(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()  # held: torch 2.9 frees a temporary before its count is read, 2.13 keeps it
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def sole_owner(t: torch.Tensor) -> bool:
    """Nothing else holds ``t``'s storage: no other tensor (a view, an alias) and no Python storage object of the
    caller's (``t.untyped_storage()`` kept). The counts are compared with a fresh tensor's, read the same way, as
    torch versions count a storage's Python object differently. Aliases outside torch are not seen (see
    passes/_bucket_graphs.py's docstring)."""
    global _ALONE
    if _ALONE is None:
        _ALONE = _counts(torch.empty(1))
    return _counts(t) == _ALONE
