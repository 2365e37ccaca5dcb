"""Is one of our fused kernels faster than what Inductor runs instead, for this shape, dtype and device?

A pass asks ``decide(ctx, candidate)`` before each rewrite. How it answers is the pass's ``decide`` option:

- ``"always"``: yes (tests, and users who have measured for themselves);
- ``"measure"`` (the default under ``mode="max-autotune"``): time both on the device now and keep the faster.
  Ours is timed as it is; Inductor's side is timed as its best case: the cuBLAS GEMMs it calls, plus the
  epilogue it would generate moving its bytes at this card's copy bandwidth (a lower bound, so a rewrite
  must win against Inductor at its best). Each decision is cached on disk (``$KPT_CACHE_DIR``, default
  ``~/.cache/kernelpytorch/decisions.json``) keyed by device, kind, shapes, dtypes and our kernel's source, so
  a later compile reuses it;
- ``"auto"``: a decision cached for the same key if there is one, else the cost model: on CUDA, the
  device-time speed-up over Inductor measured at the nearest calibrated shape (in log space of M, K, N),
  taken when it is at least ``MARGIN``; for a kind with no calibration yet, from ``min_rows`` rows up (None:
  never). A calibration answers only near what it measured: with no calibrated shape within ``NEAR`` times the
  candidate's M, K and N, the answer is no (a speed-up measured at decode sizes, where launches dominate,
  says nothing of 16384 rows), and the reason names ``decide="measure"``. On the CPU never, since our kernels
  run their eager reference there.
  Without CUDA graphs the host's cost of issuing each call counts too: where the candidate carries
  ``host_us`` (ours, Inductor's, per call) and ``device_us`` (Inductor's device time per call, estimated),
  each side costs the larger of its host and device time (a call is as slow as the slower of issuing it and
  running it) and the ratio of those decides. At decode sizes that is host time, and a kernel that is faster
  on the device but slower to issue makes a model without CUDA graphs slower.

Every answer comes with the figures or the rule behind it, which the pass writes into the report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import threading
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Candidate", "Decision", "decide", "cache_path"]

_lock = threading.Lock()


@dataclasses.dataclass
class Candidate:
    kind: str  # "gated_linear", "linear_epilogue", "horizontal", "add_rms_norm", ...
    rows: int  # the GEMM's M (tokens), or the norm's rows
    shapes: dict  # what the key needs besides rows: {"K": 1024, "N": [1024, 256, 256]}
    dtype: torch.dtype
    device: torch.device
    min_rows: int | None  # the cost model's threshold on CUDA without a calibration (None: never)
    ours: Callable[[], object] | None = None  # run our kernel once on inputs of the shape ("measure")
    baseline_ms: Callable[[], float] | None = None  # Inductor's best case in ms ("measure")
    source: object = None  # the module or function whose source keys the cache
    mkn: tuple[int, int, int] | None = None  # the GEMM's M, K, N, for the calibrated cost model
    calibration: tuple = ()  # ((M, K, N, ours_vs_inductor), ...) device time, measured on the model's card
    host_us: tuple[float, float] | None = None  # (ours, Inductor's) host time per call; None under CUDA graphs
    device_us: float | None = None  # Inductor's device time per call (an estimate), for weighing host_us


MARGIN = 1.03  # below this a measured win is within run-to-run noise
NEAR = 4.0  # a calibrated shape speaks for candidates within this factor of it in each of M, K and N


@dataclasses.dataclass
class Decision:
    rewrite: bool
    why: str


def cache_path() -> Path:
    root = os.environ.get("KPT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kernelpytorch")
    return Path(root) / "decisions.json"


def _key(c: Candidate) -> str:
    on_cuda = c.device.type == "cuda" and torch.cuda.is_available()
    device = torch.cuda.get_device_name(c.device) if on_cuda else c.device.type
    try:
        source = hashlib.sha1(inspect.getsource(c.source).encode()).hexdigest()[:12] if c.source else ""
    except (OSError, TypeError):
        source = ""
    return json.dumps([device, c.kind, c.rows, c.shapes, str(c.dtype), source], sort_keys=True)


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(key: str, value: dict) -> None:
    with _lock:
        data = _load()
        data[key] = value
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


def _measure(c: Candidate) -> Decision:
    from .bench import median_ms

    ours = median_ms(c.ours, c.device.type, warmup_ms=25, rep_ms=100)
    base = c.baseline_ms()
    won = ours < base
    _store(_key(c), {"rewrite": won, "ours_ms": ours, "inductor_ms": base})
    return Decision(won, f"measured: ours {ours:.4f} ms, Inductor at best {base:.4f} ms")


def decide(how: str, c: Candidate) -> Decision:
    if how == "always":
        return Decision(True, "decide='always'")
    on_gpu = c.device.type == "cuda"
    if how == "measure" and on_gpu and c.ours is not None and c.baseline_ms is not None:
        return _measure(c)
    cached = _load().get(_key(c)) if on_gpu else None
    if cached is not None:
        return Decision(bool(cached["rewrite"]), f"measured earlier: ours {cached['ours_ms']:.4f} ms, Inductor at "
                                                 f"best {cached['inductor_ms']:.4f} ms (cache {cache_path()})")
    if not on_gpu:
        return Decision(False, "on the CPU our kernels run their eager reference; Inductor's code is faster")
    if c.calibration and c.mkn is not None:
        import math

        def distance(point):
            return sum((math.log2(max(a, 1)) - math.log2(max(b, 1))) ** 2 for a, b in zip(point[:3], c.mkn))

        M, K, N, speedup = min(c.calibration, key=distance)
        if any(max(a, 1) / max(b, 1) > NEAR or max(b, 1) / max(a, 1) > NEAR for a, b in zip((M, K, N), c.mkn)):
            mkn = ",".join(map(str, c.mkn))
            return Decision(False, f"cost model: no calibrated shape within {NEAR:g}x of M,K,N={mkn} (the nearest, "
                                   f"{M},{K},{N}, gave {speedup:.2f}x); decide='measure' times it")
        why = f"cost model: {speedup:.2f}x over Inductor's device time measured at M,K,N={M},{K},{N}, the nearest " \
              f"calibrated shape"
        if c.host_us is not None and c.device_us is not None:
            ours_host, their_host = c.host_us
            ours_device = c.device_us / speedup
            ours, theirs = max(ours_host, ours_device), max(their_host, c.device_us)
            speedup = theirs / ours
            why += (f"; issued without CUDA graphs, per call ours max(host {ours_host:.0f}, device {ours_device:.0f}) "
                    f"us, Inductor max(host {their_host:.0f}, device {c.device_us:.0f}) us: {speedup:.2f}x")
        return Decision(speedup >= MARGIN, f"{why} (needs {MARGIN}x)")
    if c.min_rows is None:
        return Decision(False, f"cost model: no calibrated win over Inductor for {c.kind} in {c.dtype}; "
                               "decide='measure' times it")
    if c.rows >= c.min_rows:
        return Decision(True, f"cost model: {c.rows} rows >= {c.min_rows}")
    return Decision(False, f"cost model: {c.rows} rows < {c.min_rows} (launch-bound; Inductor's own is as fast)")
