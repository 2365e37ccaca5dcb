"""What happened in a compile, as data: one GraphReport per graph Dynamo hands the backend.

A GraphReport holds a StageRecord per stage the pipeline ran (pre_aot, joint, forward, backward, and wrap where
the pipeline has passes that wrap the compiled callable), each with
a PassRecord per pass in the pipeline for that stage. The backward stage is filled in when the backward is
compiled, which Inductor and AOTAutograd do lazily at the first ``.backward()``.

``kpt_compiler.last_report()`` returns the newest; ``reports()`` all since the last ``clear_reports()``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

__all__ = ["PassRecord", "StageRecord", "GraphReport", "last_report", "reports", "clear_reports", "STATUSES"]

# applied: the pass changed the graph; unchanged: it ran and found nothing to do; failed: it raised or broke
# an invariant, and the graph from before it was kept; skipped: it could not apply here (device, shapes...);
# disabled: the options switched it off; backed_out: a lossy pass whose every rewrite was over its error bound
# (kpt_compiler.lossy_guard), so the graph from before it was kept.
STATUSES = ("applied", "unchanged", "failed", "skipped", "disabled", "backed_out")


def _db(value: float | None) -> float | str | None:
    """A dB figure for JSON: rounded, or "inf" / "-inf" (JSON has no infinities)."""
    if value is None:
        return None
    return round(value, 2) if math.isfinite(value) else ("inf" if value > 0 else "-inf")


@dataclasses.dataclass
class PassRecord:
    name: str
    stage: str
    status: str
    matches: int = 0
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    time_ms: float = 0.0
    reason: str | None = None  # why skipped or disabled; the error when failed
    notes: list[str] = dataclasses.field(default_factory=list)  # decisions and near misses, one line each
    ops_before: dict[str, int] = dataclasses.field(default_factory=dict)
    ops_after: dict[str, int] = dataclasses.field(default_factory=dict)
    # unified diff of the readable code, when applied: made when first read (``diff``), from the graphs before
    # and after the pass, unless a dump made it at once; printing a large graph takes a compile 0.1-0.2 s a time
    _diff: str | None = dataclasses.field(default=None, repr=False)
    _diff_from: Any = dataclasses.field(default=None, repr=False, compare=False)
    regions: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # changed subgraphs, for pictures
    code_file: str | None = None  # relative to the dump folder, when dumped
    diff_file: str | None = None
    # lossy passes: the signal-to-noise ratio (dB) of the graph against the unmodified one, the bound, and the
    # rewrites backed out with their figure on their own (kpt_compiler.lossy_guard)
    error_db: float | None = None
    error_bound_db: float | None = None
    backed_out: dict[str, float] = dataclasses.field(default_factory=dict)
    # passes measured rewrite by rewrite (ctx.check_locally): each rewrite kept, with its own figure
    layer_db: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def diff(self) -> str | None:
        if self._diff is None and self._diff_from is not None:
            make, self._diff_from = self._diff_from, None
            self._diff = make()
        return self._diff

    @diff.setter
    def diff(self, text: str | None) -> None:
        self._diff, self._diff_from = text, None

    def summary(self) -> dict[str, Any]:
        """The fields summary.json carries (no code, no pictures)."""
        out = {
            "name": self.name,
            "stage": self.stage,
            "status": self.status,
            "matches": self.matches,
            "time_ms": round(self.time_ms, 3),
        }
        if self.stats:
            out["stats"] = dict(self.stats)
        if self.reason:
            out["reason"] = self.reason
        if self.notes:
            out["notes"] = list(self.notes)
        if self.error_bound_db is not None:
            out["error_db"] = _db(self.error_db)
            out["error_bound_db"] = self.error_bound_db
            out["backed_out"] = {k: _db(v) for k, v in self.backed_out.items()}
            if self.layer_db:
                out["layer_db"] = {k: _db(v) for k, v in self.layer_db.items()}
        return out

    def error_text(self) -> str:
        """The lossy guard's figure as one phrase ("SQNR 31.2 dB (bound 25 dB)"), or ""."""
        if self.error_bound_db is None or self.error_db is None:
            return ""
        text = f"SQNR {self.error_db:.1f} dB (bound {self.error_bound_db:g} dB)"
        if self.layer_db:  # the bound applies to each rewrite's own figure
            text = (f"SQNR {min(self.layer_db.values()):.1f}-{max(self.layer_db.values()):.1f} dB per rewrite "
                    f"(bound {self.error_bound_db:g} dB), output {self.error_db:.1f} dB")
        return text


@dataclasses.dataclass
class StageRecord:
    stage: str
    is_inference: bool
    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: dict[str, int] = dataclasses.field(default_factory=dict)
    ops_after: dict[str, int] = dataclasses.field(default_factory=dict)
    time_ms: float = 0.0
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    folder: str | None = None  # relative to dump_dir, when dumped

    def pass_record(self, name: str) -> PassRecord:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass {name!r} in stage {self.stage!r}; ran: {[p.name for p in self.passes]}")


@dataclasses.dataclass
class GraphReport:
    index: int
    compile_id: str
    codegen: str  # "inductor", "eager" or "xla": what generated code for the rewritten graph
    target: dict[str, Any]
    options: dict[str, Any]
    stages: dict[str, StageRecord] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    compile_ms: float = 0.0  # the backend call (forward); the backward adds its stage times later
    folder: str | None = None
    rank: int | None = None  # this process's rank where torch.distributed runs more than one (None: one process)

    # ------------------------------------------------------------------ queries
    def passes(self, stage: str | None = None) -> list[PassRecord]:
        return [p for s in self.stages.values() if stage in (None, s.stage) for p in s.passes]

    def fired(self) -> list[str]:
        """Names of the passes that changed a graph, in the order they ran."""
        out: list[str] = []
        for p in self.passes():
            if p.status == "applied" and p.name not in out:
                out.append(p.name)
        return out

    def pass_record(self, name: str, stage: str | None = None) -> PassRecord:
        found = [p for p in self.passes(stage) if p.name == name]
        if not found:
            raise KeyError(f"pass {name!r} did not run{' in ' + stage if stage else ''}")
        return found[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "compile_id": self.compile_id,
            "codegen": self.codegen,
            "target": self.target,
            "options": self.options,
            "compile_ms": round(self.compile_ms, 3),
            "folder": self.folder,
            "rank": self.rank,
            "notes": list(self.notes),
            "stages": {
                s.stage: {
                    "is_inference": s.is_inference,
                    "nodes_before": s.nodes_before,
                    "nodes_after": s.nodes_after,
                    "time_ms": round(s.time_ms, 3),
                    "folder": s.folder,
                    "passes": [p.summary() for p in s.passes],
                }
                for s in self.stages.values()
            },
        }

    def table(self) -> str:
        """A plain-text table: one row per pass that ran."""
        rows = [("stage", "pass", "status", "matches", "ms", "detail")]
        for p in self.passes():
            detail = "; ".join(x for x in (p.error_text(), p.reason or ("; ".join(p.notes[:2]) if p.notes else "")) if x)
            rows.append((p.stage, p.name, p.status, str(p.matches), f"{p.time_ms:.1f}", detail[:80]))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        rank = f", rank {self.rank}" if self.rank is not None else ""
        head = f"graph {self.index} (compile id {self.compile_id}, {self.codegen} on {self.target.get('name')}{rank})"
        lines = [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if len(rows) == 1:
            lines.append("  (no passes in the pipeline)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


_lock = threading.Lock()
_REPORTS: list[GraphReport] = []


def _new_report(**kwargs: Any) -> GraphReport:
    """A report for a compile that is about to start; ``_publish`` adds it to ``reports()`` once the compile's
    options and target have passed their checks (a refused compile leaves no empty report behind)."""
    return GraphReport(index=-1, **kwargs)


def _publish(report: GraphReport) -> GraphReport:
    with _lock:
        report.index = len(_REPORTS)
        _REPORTS.append(report)
        return report


def last_report() -> GraphReport:
    """The report of the graph compiled most recently in this process."""
    if not _REPORTS:
        raise LookupError("nothing has been compiled with backend='kernelpytorch' yet (or clear_reports() ran)")
    return _REPORTS[-1]


def reports() -> list[GraphReport]:
    """Every graph compiled since the process started or clear_reports() was last called, oldest first."""
    return list(_REPORTS)


def clear_reports() -> None:
    with _lock:
        _REPORTS.clear()
