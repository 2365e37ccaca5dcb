"""The cost model: is one of our rewrites faster than what Inductor runs instead, here, and by how much?

Passes ask ``ctx.cost_model.decide(how, candidate)`` before each rewrite whose speed is in question. One
``CostModel`` serves one compile: it is bound to the target (card name and compute capability) and to whether
the mode replays CUDA graphs. How it answers is the pass's ``decide`` option:

- ``"always"``: yes (tests, and users who have measured for themselves);
- ``"measure"`` (the default under ``mode="max-autotune"``): time both on the device now and keep the faster.
  Ours is timed as it is; Inductor's side as its best case (the pass supplies it: for a GEMM, the cuBLAS
  calls plus its epilogue moving its bytes at this card's copy bandwidth). Each decision is cached on disk
  (``$KPT_CACHE_DIR``, default ``~/.cache/kernelpytorch/decisions.json``) keyed by card, kind, shapes, dtype
  and the kernel's source hash, so a later compile reuses it;
- ``"auto"``: a decision cached for the same key if there is one, else the calibration of this card: a file
  ``calibration/<card>.sm<XY>.json`` beside this module (``python -m benchmarks.calibrate`` writes it on the
  card). A figure there speaks only for the card, dtype and kernel source it was measured on: with no file
  for this card, no table for the kind in this dtype, or a table measured with other kernel source (the
  hash of the kernel's files, comments and docstrings aside), the answer is no, and the reason says that
  ``decide="measure"`` would time it. Otherwise the speed-up over Inductor's device time measured at the
  nearest calibrated shape (in log space of M, K, N) decides, taken when it is at least ``MARGIN`` and only
  within ``NEAR`` times a calibrated shape in each of M, K and N (a speed-up measured at decode sizes, where
  launches dominate, says nothing of 16384 rows). On the CPU never: our kernels run their eager reference.
  Without CUDA graphs the host's cost of issuing each call counts too: each side costs the larger of its
  host time per call (the file's ``host_us``) and its device time (Inductor's estimated from the card's
  ceilings), and the ratio of those decides. At decode sizes that is host time, and a kernel faster on the
  device but slower to issue makes a model without CUDA graphs slower.

Every answer comes with the figures behind it, naming the card, date and commit they were measured on;
the pass writes it into the report.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import io
import json
import math
import os
import re
import threading
import tokenize
import types
from pathlib import Path
from typing import Any, Callable

import torch

from .target import Target

__all__ = ["Candidate", "Decision", "CostModel", "Calibration", "calibration_file", "load_calibration",
           "source_hash", "cache_path", "CALIBRATION_DIR", "CUDA_GRAPH_MODES", "MARGIN", "NEAR"]

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs
MARGIN = 1.03  # below this a measured win is within run-to-run noise
NEAR = 4.0  # a calibrated shape speaks for candidates within this factor of it in each of M, K and N

_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------- sources


def _code_text(text: str) -> str:
    """The code of a Python source without comments, docstrings and layout: what decides what it runs.

    Comments and docstrings are cut at the tokenizer's positions and whitespace is collapsed; the code is kept
    as written, so the text is the same whichever Python tokenized it (3.12 splits f-strings into tokens,
    3.11 does not; the GPU machine runs 3.12, CI 3.11)."""
    lines = io.StringIO(text).readlines()  # the tokenizer's lines (splitlines also splits at \x0c, \x85, ...)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    cut, prev = [], tokenize.NEWLINE
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            continue
        following = next((t.type for t in tokens[i + 1:] if t.type not in (tokenize.COMMENT, tokenize.NL)), None)
        docstring = (tok.type == tokenize.STRING and prev == tokenize.NEWLINE and following == tokenize.NEWLINE
                     and "f" not in tok.string.split(tok.string[-1])[0].lower())
        if tok.type == tokenize.COMMENT or docstring:
            cut.append((starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]))
        if tok.type != tokenize.COMMENT:
            prev = tok.type
    kept, at = [], 0
    for a, b in cut:
        kept.append(text[at:a])
        at = b
    kept.append(text[at:])
    return " ".join("".join(kept).split())


def _module_files(module: types.ModuleType) -> list[Path]:
    names = getattr(module, "SOURCE_MODULES", None)
    if names is None:
        return [Path(inspect.getsourcefile(module))]
    package = module.__name__.rsplit(".", 1)[0]
    return [Path(inspect.getsourcefile(__import__(f"{package}.{n}", fromlist=["_"]))) for n in names]


def source_hash(source: Any) -> str:
    """A short hash of what decides a rewrite's speed: a kernel module (the files its ``SOURCE_MODULES`` names,
    or its own) or a function (its source), comments and docstrings aside. Raises if the source cannot be
    read: a decision keyed without its source could outlive a change of the kernel. Cached per file state
    (a compile asks for every candidate; tokenizing a kernel's files takes tens of milliseconds)."""
    if isinstance(source, types.ModuleType):
        files = _module_files(source)
        return _hash_files(tuple((str(p), p.stat().st_mtime_ns) for p in files))
    if callable(source):
        path = Path(inspect.getsourcefile(source))
        return _hash_function(str(path), path.stat().st_mtime_ns, source.__qualname__, source)
    raise TypeError(f"source_hash: a kernel module or a function, not {type(source).__name__}")


def _hash_texts(texts: list[str]) -> str:
    """The hash of the texts' code (``_code_text``). Tokenizing a kernel's files takes tens of milliseconds, and a
    compile asks for each kernel's: 0.18 s of a warm llama compile on the H100 (cProfile,
    benchmarks/results/nvidia-h100-80gb-hbm3/2026-11-28-s20-warm-prof-llama-kpt-099b5f9.txt). So the answer is
    also kept on disk beside the decision cache, keyed by the texts themselves, byte for byte, and by the source
    of ``_code_text``."""
    raw = hashlib.sha256(b"\0".join([_code_text_source()] + [t.encode() for t in texts])).hexdigest()
    known = _source_hashes().get(raw)
    if known is not None:
        return known
    h = hashlib.sha256()
    for text in texts:
        h.update(_code_text(text).encode() + b"\0")
    result = h.hexdigest()[:16]
    _keep_source_hash(raw, result)
    return result


@functools.lru_cache(maxsize=1)
def _code_text_source() -> bytes:
    """What the kept hashes were computed by: an edit of ``_code_text`` must not read hashes it did not make."""
    return inspect.getsource(_code_text).encode()


def _source_hashes_path() -> Path:
    return cache_path().parent / "source_hashes.json"


def _source_hashes() -> dict:
    return _read_json(_source_hashes_path())


def _keep_source_hash(raw: str, result: str) -> None:
    try:
        _put_json(_source_hashes_path(), raw, result)
    except OSError:  # a read-only home: the hash is still right, only not kept
        pass


@functools.lru_cache(maxsize=64)
def _hash_files(files: tuple[tuple[str, int], ...]) -> str:
    return _hash_texts([Path(path).read_text() for path, _stamp in files])


@functools.lru_cache(maxsize=64)
def _hash_function(_path: str, _stamp: int, _qualname: str, fn: Callable) -> str:
    return _hash_texts([inspect.getsource(fn)])


# ---------------------------------------------------------------------------------------------- calibration


def calibration_file(name: str, capability: tuple[int, int]) -> str:
    """``NVIDIA H100 80GB HBM3``, (9, 0) -> ``nvidia-h100-80gb-hbm3.sm90.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}.sm{capability[0]}{capability[1]}.json"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One card's calibration file (the format: calibration/README.md)."""

    path: Path
    data: dict

    @property
    def card(self) -> str:
        d = self.data["device"]
        return f"{d['name']} (sm_{d['capability'][0]}{d['capability'][1]})"

    def table(self, kind: str, dtype: torch.dtype) -> dict | None:
        return self.data.get("device_time", {}).get(kind, {}).get(str(dtype).replace("torch.", ""))

    def host_us(self, kind: str) -> dict | None:
        return self.data.get("host_us", {}).get(kind)

    @property
    def ceilings(self) -> dict:
        """The card's rates the cost model estimates Inductor's device time from (tflops, copy_tbps,
        kernel_floor_us)."""
        return self.data["ceilings"]

    def provenance(self, entry: dict) -> str:
        run = self.data["runs"][entry["run"]]
        return f"{run['date']}, commit {run['commit']}"


def load_calibration(target: Target, directory: Path | str | None = None) -> Calibration | None:
    """This card's calibration, or None: files are matched by card name and compute capability exactly."""
    if not target.is_cuda or target.capability is None:
        return None
    path = Path(directory or os.environ.get("KPT_CALIBRATION_DIR") or CALIBRATION_DIR)
    path = path / calibration_file(target.name, target.capability)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    return _read(path, stamp)


@functools.lru_cache(maxsize=16)
def _read(path: Path, _stamp: int) -> Calibration:
    data = json.loads(path.read_text())
    return Calibration(path, data)


# ---------------------------------------------------------------------------------------------- decisions


@dataclasses.dataclass
class Candidate:
    kind: str  # what the rewrite is, for the report: "gated_linear", "linear_epilogue", "horizontal", ...
    rows: int  # the GEMM's M (tokens), or the norm's rows
    shapes: dict  # what the key needs besides rows: {"K": 1024, "N": [1024, 256, 256]}
    dtype: torch.dtype
    source: Any  # the kernel module (or function) whose code keys the calibration and the cache
    table: str | None = None  # the calibration entry, when it is not ``kind``
    mkn: tuple[int, int, int] | None = None  # the GEMM's M, K, N, for the calibrated cost model
    form: str = "inference"  # how ours is issued ("inference" op or "triton" op): its host cost per call
    gemm_ns: list[int] | None = None  # the N of each GEMM on Inductor's side, for its estimated device time
    unfused_kernels: int = 1  # the kernels Inductor runs instead
    ours: Callable[[], object] | None = None  # run our kernel once on inputs of the shape ("measure")
    baseline_ms: Callable[[], float] | None = None  # Inductor's best case in ms ("measure")
    timeable: bool = True  # whether the pass can time this kind at compile time (give ours and baseline_ms)

    @property
    def entry(self) -> str:
        return self.table or self.kind


@dataclasses.dataclass
class Decision:
    rewrite: bool
    why: str
    speedup: float | None = None  # ours over Inductor (device time, or the host-weighed ratio), where a figure says

    def __bool__(self) -> bool:
        return self.rewrite


def cache_path() -> Path:
    root = os.environ.get("KPT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kernelpytorch")
    return Path(root) / "decisions.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _put_json(path: Path, key: str, value: Any) -> None:
    """Set ``key`` in the JSON file at ``path``, written whole to a file of this process's and moved over it (a
    reader never sees half a file; another process's entry written meanwhile may be lost, and found again)."""
    with _lock:
        data = _read_json(path)
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


def _load_cache() -> dict:
    return _read_json(cache_path())


def _store(key: str, value: dict) -> None:
    _put_json(cache_path(), key, value)


class CostModel:
    """The decisions of one compile: bound to its target and to whether its mode replays CUDA graphs."""

    def __init__(self, target: Target, mode: str = "default", codegen: str = "inductor",
                 calibration: Calibration | None | bool = True):
        self.target = target
        self.cudagraphs = mode in CUDA_GRAPH_MODES
        self.codegen = codegen
        self._calibration = load_calibration(target) if calibration is True else (calibration or None)

    @property
    def calibration(self) -> Calibration | None:
        return self._calibration

    def _key(self, c: Candidate, source: str) -> str:
        card = [self.target.name, list(self.target.capability or ())]
        return json.dumps([card, c.kind, c.rows, c.shapes, str(c.dtype), source], sort_keys=True)

    def decide(self, how: str, c: Candidate) -> Decision:
        if how == "always":
            return Decision(True, "decide='always'")
        if not self.target.is_cuda:
            return Decision(False, f"on {self.target.device} our kernels run their eager reference; Inductor's code "
                                   "is faster")
        source = source_hash(c.source)
        if how == "measure" and c.ours is not None and c.baseline_ms is not None:
            return self._measure(c, source)
        cached = _load_cache().get(self._key(c, source))
        if cached is not None:
            return Decision(bool(cached["rewrite"]), f"measured earlier on {self.target.card}: ours "
                                                     f"{cached['ours_ms']:.4f} ms, Inductor at best "
                                                     f"{cached['inductor_ms']:.4f} ms (cache {cache_path()})",
                            cached["inductor_ms"] / max(cached["ours_ms"], 1e-9))
        return self._calibrated(c, source, timed=c.timeable)

    def _measure(self, c: Candidate, source: str) -> Decision:
        from .bench import median_ms

        ours = median_ms(c.ours, "cuda", warmup_ms=25, rep_ms=100)
        base = c.baseline_ms()
        won = ours < base
        _store(self._key(c, source), {"rewrite": won, "ours_ms": ours, "inductor_ms": base})
        return Decision(won, f"measured on {self.target.card}: ours {ours:.4f} ms, Inductor at best {base:.4f} ms",
                        base / max(ours, 1e-9))

    def _calibrated(self, c: Candidate, now: str, timed: bool = True) -> Decision:
        measure = "decide='measure' times it" if timed else f"{c.kind} has no compile-time timing either"
        cal = self.calibration
        if cal is None:
            return Decision(False, f"cost model: no calibration for {self.target.card} "
                                   f"(kpt_compiler/calibration/{calibration_file(self.target.name, self.target.capability)}"
                                   f"; python -m benchmarks.calibrate makes one on the card); {measure}")
        table = cal.table(c.entry, c.dtype)
        if table is None:
            return Decision(False, f"cost model: no calibrated win over Inductor for {c.kind} in "
                                   f"{str(c.dtype).replace('torch.', '')} on {cal.card}; {measure}")
        if table["source"] != now:
            return Decision(False, f"cost model: {c.kind} on {cal.card} was calibrated with kernel source "
                                   f"{table['source']}, which is now {now}; python -m benchmarks.calibrate measures "
                                   f"it again, {measure}")
        if c.mkn is None:
            return Decision(False, f"cost model: {c.kind} needs the GEMM's sizes; {measure}")
        point = min(table["points"], key=lambda p: _distance(p, c.mkn))
        M, K, N, speedup = point["M"], point["K"], point["N"], point["speedup"]
        mkn = ",".join(map(str, c.mkn))
        if any(max(a, 1) / max(b, 1) > NEAR or max(b, 1) / max(a, 1) > NEAR for a, b in zip((M, K, N), c.mkn)):
            return Decision(False, f"cost model: no shape calibrated on {cal.card} within {NEAR:g}x of M,K,N={mkn} "
                                   f"(the nearest, {M},{K},{N}, gave {speedup:.2f}x); {measure}")
        why = (f"cost model: {speedup:.2f}x over Inductor's device time measured on {cal.card} at M,K,N={M},{K},{N}, "
               f"the nearest calibrated shape ({cal.provenance(point)})")
        host = None if self.cudagraphs else cal.host_us(c.entry)
        if not self.cudagraphs and c.gemm_ns and (host is None or not cal.data.get("ceilings")):
            return Decision(False, f"{why}; but issued without CUDA graphs, and {cal.card}'s file has no host times "
                                   f"for {c.kind} (or no ceilings) to weigh them: python -m benchmarks.calibrate "
                                   f"--tables host,ceilings; {measure}")
        if host is not None and c.gemm_ns:
            theirs_device = self._inductor_device_us(cal, c)
            ours_host, their_host = host[c.form], host["inductor"]
            ours_device = theirs_device / speedup
            speedup = max(their_host, theirs_device) / max(ours_host, ours_device)
            why += (f"; issued without CUDA graphs, per call ours max(host {ours_host:.0f}, device {ours_device:.0f}) "
                    f"us, Inductor max(host {their_host:.0f}, device {theirs_device:.0f}) us: {speedup:.2f}x")
        return Decision(speedup >= MARGIN, f"{why} (needs {MARGIN}x)", speedup)

    @staticmethod
    def _inductor_device_us(cal: Calibration, c: Candidate) -> float:
        """Inductor's device time per call, estimated: its GEMMs at the card's peak rate or their bytes at its
        copy bandwidth, whichever is slower, plus a fixed cost per kernel (the card's ceilings)."""
        return gemm_device_us(cal, c.rows, c.shapes["K"], c.gemm_ns, c.dtype, c.unfused_kernels)


def gemm_device_us(cal: Calibration, rows: int, K: int, Ns: list[int], dtype: torch.dtype, kernels: int = 1) -> float:
    """A dense GEMM's device time estimated from the card's ceilings: its FLOPs at the peak rate or its bytes at
    the copy bandwidth, whichever is slower, plus the fixed cost of each of ``kernels`` kernels."""
    ceil = cal.ceilings
    size = torch.empty((), dtype=dtype).element_size()
    flops = 2 * rows * K * sum(Ns)
    nbytes = size * (rows * K + sum(Ns) * K + rows * sum(Ns))
    return max(flops / (ceil["tflops"] * 1e6), nbytes / (ceil["copy_tbps"] * 1e6)) + ceil["kernel_floor_us"] * kernels


def pass_device_us(cal: Calibration, nbytes: int) -> float:
    """One elementwise kernel's device time estimated from the card's ceilings: its bytes at the copy bandwidth
    plus a kernel's fixed cost."""
    ceil = cal.ceilings
    return nbytes / (ceil["copy_tbps"] * 1e6) + ceil["kernel_floor_us"]


def _distance(point: dict, mkn: tuple[int, int, int]) -> float:
    return sum((math.log2(max(point[d], 1)) - math.log2(max(v, 1))) ** 2 for d, v in zip("MKN", mkn))
