"""Compare two benchmark runs and flag the rows that got slower or less accurate.

    python -m benchmarks.compare OLD.json NEW.json

Rows are matched by (model, task, shape, dtype, mode). Grades:

- slower: the median grew by more than the run-to-run noise, where noise is the larger of the two rows'
  (p80 - p20) / median, at least 2%. Beyond 1x noise: minor; beyond 3x: moderate; beyond 6x: severe.
- less accurate: the relative error against eager float32 grew by more than 1.5x (minor), 3x (moderate) or
  10x (severe), and is above 1e-4 (below that every change is rounding).
- broken: a row that was ok and now errors is severe.

Exit status 1 when any row is severe, 0 otherwise. A row measured before and skipped now is listed, not graded.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["compare", "main", "NOISE_FLOOR", "SLOWDOWN_GRADES", "ERROR_GRADES", "ERROR_FLOOR"]

NOISE_FLOOR = 0.02
SLOWDOWN_GRADES = ((6.0, "severe"), (3.0, "moderate"), (1.0, "minor"))  # slowdown, in multiples of the noise
ERROR_GRADES = ((10.0, "severe"), (3.0, "moderate"), (1.5, "minor"))  # new rel err / old rel err
ERROR_FLOOR = 1e-4
KEY = ("model", "task", "shape", "dtype", "mode")


def _grade(value: float, grades: tuple[tuple[float, str], ...]) -> str | None:
    for threshold, grade in grades:
        if value > threshold:
            return grade
    return None


def _label(row: dict) -> str:
    return " ".join(str(row[k]) for k in KEY)


def compare(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """(grade, message) for every regression, and notes on rows that could not be compared."""
    before = {tuple(r[k] for k in KEY): r for r in old["rows"]}
    flagged: list[tuple[str, str]] = []
    notes: list[str] = []
    for row in new["rows"]:
        key = tuple(row[k] for k in KEY)
        prev = before.pop(key, None)
        if prev is None or prev["status"] != "ok":
            continue
        if row["status"].startswith("error"):
            flagged.append(("severe", f"{_label(row)}: was ok, now {row['status']}"))
            continue
        if row["status"] != "ok":
            notes.append(f"{_label(row)}: not measured now ({row['status']})")
            continue
        noise = max(prev.get("noise") or 0.0, row.get("noise") or 0.0, NOISE_FLOOR)
        slowdown = row["ms"] / prev["ms"] - 1
        grade = _grade(slowdown / noise, SLOWDOWN_GRADES)
        if grade:
            flagged.append((grade, f"{_label(row)}: {prev['ms']:.3f} -> {row['ms']:.3f} ms "
                                   f"(+{100 * slowdown:.1f}%, {slowdown / noise:.1f}x the noise {100 * noise:.1f}%)"))
        old_err, new_err = prev.get("rel_err"), row.get("rel_err")
        if old_err is not None and new_err is not None and new_err > ERROR_FLOOR:
            grade = _grade(new_err / old_err if old_err > 0 else float("inf"), ERROR_GRADES)
            if grade:
                flagged.append((grade, f"{_label(row)}: rel err {old_err:.1e} -> {new_err:.1e}"))
    notes += [f"{_label(r)}: in the old run only" for r in before.values() if r["status"] == "ok"]
    return flagged, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="results.json of the earlier run")
    p.add_argument("new", help="results.json of the later run")
    args = p.parse_args(argv)
    with open(args.old) as f:
        old = json.load(f)
    with open(args.new) as f:
        new = json.load(f)
    cards = old["meta"].get("card"), new["meta"].get("card")
    if cards[0] != cards[1]:
        print(f"warning: different cards ({cards[0]} vs {cards[1]}): timings are not comparable")
    flagged, notes = compare(old, new)
    order = {"severe": 0, "moderate": 1, "minor": 2}
    for grade, message in sorted(flagged, key=lambda f: order[f[0]]):
        print(f"{grade:8s} {message}")
    for note in notes:
        print(f"note     {note}")
    counts = {g: sum(1 for f in flagged if f[0] == g) for g in order}
    print(f"{len(flagged)} regression(s): " + ", ".join(f"{n} {g}" for g, n in counts.items() if n)
          if flagged else "no regressions")
    return 1 if counts["severe"] else 0


if __name__ == "__main__":
    sys.exit(main())
