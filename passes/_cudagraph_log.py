"""Inductor's refusals to capture a CUDA graph, heard from its log into the cudagraphs pass's notes.

Inductor decides at compile time and when its cudagraph trees record (the first call; for a training graph's
backward, the first backward) whether it captures, and says "skipping cudagraphs due to ..." in its log when it
does not. The pass listens from its compile until the calls that record are over.
"""

from __future__ import annotations

import contextlib
import logging


class SkipLog(logging.Handler):
    """Collects Inductor's "skipping cudagraphs due to ..." messages into the pass's notes."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.notes: list[str] | None = None
        self.listening = False
        self.calls = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.notes is not None:
            self.notes.append(f"Inductor declined the capture: {record.getMessage().splitlines()[0]}")

    def report_to(self, notes: list[str]) -> None:
        self.notes = notes

    def start(self) -> None:
        if not self.listening:
            logger().addHandler(self)
            self.listening = True

    def stop(self) -> None:
        logger().removeHandler(self)
        self.listening = False


def logger() -> logging.Logger:
    """The logger Inductor's "skipping cudagraphs" messages go to: ``cudagraphs_log`` (torch 2.10 and later),
    ``perf_hint_log`` before."""
    from torch._inductor import cudagraph_utils

    return getattr(cudagraph_utils, "cudagraphs_log", None) or cudagraph_utils.perf_hint_log


@contextlib.contextmanager
def listening(listener: SkipLog):
    """Inductor's refusals heard from this compile on (the pass stops listening once the recording calls are over)."""
    listener.start()
    try:
        yield
    except BaseException:  # no compiled graph, no first call to stop listening at
        listener.stop()
        raise
