"""The exceptions kernelpytorch raises on purpose. A leaf module: everything else may import it."""

from __future__ import annotations

__all__ = ["OptionError", "PassSkipped", "PassFailed"]


class OptionError(ValueError):
    """A compile option is unknown, of the wrong type, or cannot be honoured on this device."""


class PassSkipped(Exception):
    """Raised by a pass that finds, once running, that it cannot apply here; the message says why."""


class PassFailed(RuntimeError):
    """A pass raised or broke an invariant while options['strict'] was on."""
