"""One stream table from several bench_shapes runs (the same stream and card, other commits or calls): each row
keeps the commit and date of the run that made it, and the kpt rows are compared with the fastest Inductor
mode over all of them.

    python -m benchmarks.merge_shapes A/bench_shapes.json B/bench_shapes.json ... --out DIR

A row of a later file replaces the same (model, mode) of an earlier one.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from benchmarks import outputs
from benchmarks.bench_shapes import add_ratios, table


def merge(records: list[dict]) -> dict:
    first = records[0]
    same = lambda r: {k: v for k, v in r.get("stream", {}).items() if k != "pass2_repeats"}  # noqa: E731
    for r in records[1:]:
        if same(r) != same(first) or r.get("card") != first.get("card"):
            raise ValueError("the runs differ in their stream or card; only runs of one stream merge")
    rows: dict[tuple, dict] = {}
    for r in records:
        for row in r["rows"]:
            # every run's row, the same mode at several commits included: runs that disagree are all shown
            rows[(row["model"], row["mode"], r.get("commit"), r.get("date"))] = {**row, "commit": r.get("commit"),
                                                                               "date": r.get("date")}
    merged = {k: v for k, v in first.items() if k not in ("rows", "commit", "date", "command")}
    merged["torch"] = ", ".join(dict.fromkeys(str(r.get("torch")) for r in records))
    merged.update(models={k: v for r in records for k, v in r.get("models", {}).items()},
                  modes={k: v for r in records for k, v in r.get("modes", {}).items()},
                  runs=[{"commit": r.get("commit"), "date": r.get("date"), "command": r.get("command")}
                        for r in records], rows=list(rows.values()))
    add_ratios(merged["rows"])
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.merge_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    records = []
    for path in args.files:
        with open(path) as f:
            records.append(json.load(f))
    try:
        merged = merge(records)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    merged["command"] = "python -m benchmarks.merge_shapes " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    merged.update(date="per row", commit="per row (the runs below)")
    text = table(merged)
    text += "\n\nRuns merged:\n" + "\n".join(f"- {r['date']} at {r['commit']}: `{r['command']}`" for r in merged["runs"])
    outputs.write_bench(args.out, "bench_shapes", merged, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
