"""Timing helpers shared by the main job and the benchmarks (never used for pass/fail in tests).

On CUDA, ``triton.testing.do_bench`` (CUDA events, warm-up, L2 flushed between runs, median). On the CPU a
median of wall-clock runs after warm-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["median_ms", "relative_error", "peak_memory", "first_tensor"]


def median_ms(fn: Callable[[], Any], device: str, *, warmup_ms: float = 100, rep_ms: float = 500,
              min_reps: int = 5) -> float:
    """Median time of one call of ``fn`` in milliseconds."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    start = time.perf_counter()
    fn()
    while (time.perf_counter() - start) * 1e3 < warmup_ms:
        fn()
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - begin) * 1e3 < rep_ms:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 1000:
            break
    return statistics.median(times)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def peak_memory(fn: Callable[[], Any], device: str) -> int | None:
    """Peak bytes the device allocator held during one call of ``fn`` (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def first_tensor(out: Any) -> torch.Tensor:
    """The main output of a model: logits, last hidden state, or the first tensor it returns."""
    for name in ("logits", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name)
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return first_tensor(out[0])
    if isinstance(out, dict):
        return first_tensor(next(iter(out.values())))
    raise TypeError(f"no tensor in the model's output of type {type(out).__name__}")
