"""Timing helpers shared by the main job and the benchmarks (never used for pass/fail in tests).

On CUDA, ``triton.testing.do_bench`` (CUDA events, warm-up, L2 flushed between runs, median). On the CPU a
median of wall-clock runs after warm-up.
``timing_ms`` also gives the 20th and 80th percentiles, from which benchmarks report run-to-run noise.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, NamedTuple

import torch

__all__ = ["Timing", "timing_ms", "median_ms", "copy_bandwidth", "relative_error", "peak_memory", "first_tensor"]


class Timing(NamedTuple):
    """Milliseconds per call: the median and the 20th and 80th percentiles over the timed calls."""

    median: float
    p20: float
    p80: float

    @property
    def noise(self) -> float:
        """The spread relative to the median, (p80 - p20) / median: how far two runs may differ by chance."""
        return (self.p80 - self.p20) / self.median if self.median > 0 else 0.0


def timing_ms(fn: Callable[[], Any], device: str, *, warmup_ms: float = 100, rep_ms: float = 500,
              min_reps: int = 5, cuda_graph: bool = False) -> Timing:
    """Time one call of ``fn``: median, 20th and 80th percentile in milliseconds.

    ``cuda_graph`` (CUDA only): capture ``fn`` in a CUDA graph and time its replays
    (``triton.testing.do_bench_cudagraph``), which leaves out the host's launch costs: the device time of
    the kernels, for kernel benchmarks whose small shapes would otherwise time Python."""
    if device == "cuda":
        import triton.testing

        if cuda_graph:
            median, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
            return Timing(float(median), float(p20), float(p80))
        median, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return Timing(float(median), float(p20), float(p80))
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
    # "inclusive" interpolates between the timed calls as torch.quantile (do_bench) does
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return Timing(statistics.median(times), deciles[1], deciles[7])


@functools.lru_cache(maxsize=None)
def copy_bandwidth(nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """Device-to-device copy in TB/s, counting the bytes read and the bytes written (measured once a process)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timing_ms(lambda: dst.copy_(src), device).median
    return 2 * nbytes / (ms * 1e-3) / 1e12


def median_ms(fn: Callable[[], Any], device: str, *, warmup_ms: float = 100, rep_ms: float = 500,
              min_reps: int = 5, cuda_graph: bool = False) -> float:
    """Median time of one call of ``fn`` in milliseconds."""
    return timing_ms(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps, cuda_graph=cuda_graph).median


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


def git_commit() -> str | None:
    """The commit results are stamped with: ``KPT_COMMIT`` if set (the lent GPU machine's copy of the tree keeps
    the git HEAD of its first copy, so there the command names the commit), else git's short HEAD with
    "+dirty" when tracked files have changes; None outside a git checkout."""
    import os
    import subprocess

    if os.environ.get("KPT_COMMIT"):
        return os.environ["KPT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None
