"""transformers' ``generate()`` with its stop check read one step late on CUDA (issue 17: decoding).

    from kpt_compiler.generation import deferred_stop_check

    model.forward = torch.compile(model.forward, backend="kernelpytorch")
    with deferred_stop_check():
        out = model.generate(ids, max_new_tokens=64, cache_implementation="static")

Greedy and sampled decoding in ``generate()`` read ``unfinished_sequences.max() == 0`` on the host after every
token. That read waits for the device, so the host's work before the next step (generate's own bookkeeping, the
mask, Dynamo's guards, the CUDA-graph replay's call) runs while the device is idle, and a token costs the device's
step plus that host work. With a compiled forward whose step is short (a CUDA graph) the host work is a large part
of each token (docs/cudagraphs-and-bucketing.md, "Decoding").

transformers (5.24 and later) has the remedy, ``generation.utils.DeferredStopCheck``: the flag is copied to pinned
memory without waiting and read one step later, so the host queues step i + 1 while the device runs step i, and
when the flag says stop, the one step too many is undone (its tokens dropped, and the cache cropped where the cache
outlives the call). transformers turns it on for ``mps`` only. ``deferred_stop_check()`` turns it on for the
devices named (CUDA by default) inside the ``with`` block, keeping transformers' own conditions (no assistant
model; a cache that can be cropped, or one that is not returned) and restoring them on exit. Greedy decoding makes
the same tokens as without it: only when the host learns of the stop changes. Sampling makes the same tokens too,
but where it stops at an end-of-sequence token the undone step has drawn from the random generator, so the
generator's state after the call differs (a later sampled call then draws differently). This is transformers'
decision to make, and it is opt-in here: the context patches one static method of transformers for its duration
(not thread-safe: other threads' ``generate()`` calls see it too).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_WHERE = "transformers.generation.utils.DeferredStopCheck"
_NO_EVENTS = ("cpu",)  # device types without torch.Event, which the deferred check waits on


def _stop_check_class():
    try:
        import transformers
        from transformers.generation import utils
    except ImportError as e:
        raise RuntimeError(f"deferred_stop_check needs transformers ({_WHERE}, 5.24 or later): {e}") from e
    cls = getattr(utils, "DeferredStopCheck", None)
    if cls is None or not callable(getattr(cls, "is_supported", None)):
        raise RuntimeError(f"deferred_stop_check needs transformers 5.24 or later (its generate() defers the stop "
                           f"check through {_WHERE}.is_supported); this is transformers {transformers.__version__}")
    return cls


def deferred_stop_supported() -> bool:
    """Whether the installed transformers can defer its stop check (``deferred_stop_check`` would not raise)."""
    try:
        _stop_check_class()
    except RuntimeError:
        return False
    return True


@contextlib.contextmanager
def deferred_stop_check(devices: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """Inside the block, ``generate()`` on a device whose type is in ``devices`` reads its stop flag one step late
    (transformers' ``DeferredStopCheck``) where transformers' own conditions for it hold. Raises ``RuntimeError``
    where the installed transformers has no such check, ``ValueError`` for a device type without events (``cpu``:
    the check waits on a ``torch.Event`` of the device)."""
    devices = tuple(devices)
    if not devices or not all(isinstance(d, str) and d and ":" not in d for d in devices):
        raise ValueError(f"deferred_stop_check(devices={devices!r}): name device types, such as ('cuda',) (the "
                         "default), without an index: the check applies to every device of a type")
    if set(devices) & set(_NO_EVENTS):
        raise ValueError(f"deferred_stop_check(devices={devices!r}): the check waits on a torch.Event, which the CPU "
                         "does not have; name device types with events, such as ('cuda',)")
    cls = _stop_check_class()
    original = cls.__dict__["is_supported"]  # the staticmethod object itself, put back as it was
    check = original.__func__ if isinstance(original, staticmethod) else original

    def is_supported(device, cache, cache_is_returned, is_assistant):
        if torch.device(device).type in devices:
            # transformers' own conditions (assistant, cache) as they stand for the device it defers on
            return check(torch.device("mps"), cache, cache_is_returned, is_assistant)
        return check(device, cache, cache_is_returned, is_assistant)

    cls.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        cls.is_supported = original
