"""The exceptions kernelpytorch raises on purpose. A leaf module: everything else may import it.

Dynamo wraps what a backend raises in ``BackendCompilerFailed`` ("backend='kernelpytorch' raised: ..."), except
its own ``ShortenTraceback`` errors, which it lets through as they are. ``OptionError`` and ``PassFailed`` are
such errors too (where this torch has the class), so a user's mistake in the options reaches them as itself:
the error's own type and message, which ``pytest.raises(OptionError)`` and ``except ValueError`` catch.
"""

from __future__ import annotations

try:
    from torch._dynamo.exc import ShortenTraceback as _PassesThroughDynamo
except ImportError:  # pragma: no cover - every torch we support has it (2.9, 2.11, 2.13)
    _PassesThroughDynamo = None

__all__ = ["OptionError", "PassSkipped", "PassFailed"]


def _through_dynamo(base: type) -> tuple[type, ...]:
    if _PassesThroughDynamo is None:
        return (base,)
    return (_PassesThroughDynamo,) if issubclass(_PassesThroughDynamo, base) else (base, _PassesThroughDynamo)


class _Surfaced:
    """Initialises the Dynamo side of an error that passes through it (no frames to cut from the traceback)."""

    def __init__(self, *args):
        if _PassesThroughDynamo is None:
            Exception.__init__(self, *args)
        else:
            _PassesThroughDynamo.__init__(self, *args, first_useful_frame=None)


class OptionError(_Surfaced, *_through_dynamo(ValueError)):
    """A compile option is unknown, of the wrong type, or cannot be honoured on this device."""


class PassSkipped(Exception):
    """Raised by a pass that finds, once running, that it cannot apply here; the message says why."""


class PassFailed(_Surfaced, *_through_dynamo(RuntimeError)):
    """A pass raised or broke an invariant while options['strict'] was on."""
