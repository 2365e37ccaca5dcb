"""What a run writes: results.json (meta and one record per row), results.md (the table) and results.png."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["write_json", "markdown", "write_markdown", "write_plot", "progress_line", "write_bench", "run_meta"]

COLUMNS = ("model", "task", "shape", "dtype", "mode", "compile s", "median ms", "noise %", "vs Inductor",
           "peak MiB", "rel err", "passes fired", "status")


def write_json(out: str, meta: dict, rows: list[dict]) -> str:
    path = os.path.join(out, "results.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return path


def write_bench(out: str, name: str, record: dict, table: str) -> None:
    """A microbenchmark's files: ``<name>.json`` (``record``: card, torch, date, commit and its rows, stamped
    here with the date and the commit) and ``<name>.md`` (the table)."""
    import datetime

    import torch

    from kpt_compiler.bench import git_commit

    os.makedirs(out, exist_ok=True)
    stamp = {"torch": torch.__version__, "date": str(datetime.date.today()), "commit": git_commit()}
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({**stamp, **record}, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table + "\n")


def run_meta(module: str, argv: list[str] | None, device: str) -> dict:
    """What a benchmark's files are stamped with: card, torch, date, commit and the command that ran
    (``python -m benchmarks.<module>`` and its arguments: ``argv``, else the process's)."""
    import datetime
    import sys

    import torch

    from kpt_compiler.bench import git_commit

    args = sys.argv[1:] if argv is None else argv
    return {"card": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "date": str(datetime.date.today()), "commit": git_commit(),
            "command": f"python -m benchmarks.{module} {' '.join(args)}".strip()}


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _cells(row: dict[str, Any]) -> list[str]:
    ok = row["status"] == "ok"

    def fmt(key: str, spec: str, scale: float = 1.0) -> str:
        value = row.get(key)
        return format(value * scale, spec) if ok and value is not None else "-"

    passes = row.get("passes")
    return [
        row["model"], row["task"], row["shape"], row["dtype"], row["mode"],
        fmt("compile_s", ".1f"),
        _ms(row["ms"]) if ok else "-",
        fmt("noise", ".1f", 100),
        fmt("vs_inductor", ".2f") + ("x" if ok and row.get("vs_inductor") else ""),
        fmt("peak_mib", ".0f"),
        fmt("rel_err", ".1e"),
        (", ".join(passes) or "none") if passes is not None else "",
        row["status"].replace("|", "/"),
    ]


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# kernelpytorch benchmarks: {meta['suite']} suite on {meta['card_detail']}",
        "",
        f"- date: {meta['date']}; commit: {meta.get('git') or 'unknown'}",
        f"- torch {meta['torch']} (CUDA {meta.get('cuda')}), triton {meta.get('triton')}, "
        f"transformers {meta.get('transformers')}, torchvision {meta.get('torchvision')}",
        f"- command: `{meta['command']}`",
        f"- timing: {meta['timing']}; {meta['caches']}",
        f"- compile s: first call; noise: (p80 - p20) / median; vs Inductor: inductor ms / ms; "
        f"rel err: against the {meta['reference']}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    timed_in_turn = [r for r in rows if r.get("interleaved")]
    if timed_in_turn:
        rounds = next((r["interleaved"].get("rounds") for r in timed_in_turn if "rounds" in r["interleaved"]), "?")
        lines += ["", f"Timed in turn (--interleave {rounds}: the case's modes compiled once each, then timed one "
                      "after another, the order rotated each round; median over rounds [p20, p80]; vs Inductor: "
                      "the median of the per-round ratios [p20, p80]):", "",
                  "| model | task | shape | mode | median ms | vs Inductor |", "| --- | --- | --- | --- | --- | --- |"]
        for r in timed_in_turn:
            fig = r["interleaved"]
            if "error" in fig:
                lines.append(f"| {r['model']} | {r['task']} | {r['shape']} | {r['mode']} | {fig['error']} | |")
                continue
            ms, vs = fig["ms"], fig.get("vs_inductor")
            ratio = f"{vs['median']:.2f}x [{vs['p20']:.2f}, {vs['p80']:.2f}]" if vs else ""
            lines.append(f"| {r['model']} | {r['task']} | {r['shape']} | {r['mode']} | {_ms(ms['median'])} "
                         f"[{_ms(ms['p20'])}, {_ms(ms['p80'])}] | {ratio} |")
    if "elapsed_s" in meta:
        lines += ["", f"Run time {meta['elapsed_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def write_markdown(out: str, meta: dict, rows: list[dict]) -> str:
    text = markdown(meta, rows)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    return text


def write_plot(out: str, meta: dict, rows: list[dict]) -> str | None:
    """Grouped bars: speed-up over eager per (model, task, shape), one bar per compiled mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no results.png", flush=True)
        return None
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["status"] == "ok" and r["mode"] != "eager" and r.get("vs_eager"):
            groups.setdefault((r["model"], r["task"], r["shape"]), {})[r["mode"]] = r["vs_eager"]
    modes = list(dict.fromkeys(m for bars in groups.values() for m in bars))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) * max(1, len(modes)) / 2 + 2), 4.5))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [g + (i - (len(modes) - 1) / 2) * width for g, bars in enumerate(groups.values()) if mode in bars]
        ys = [bars[mode] for bars in groups.values() if mode in bars]
        ax.bar(xs, ys, width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{t} {s}" for m, t, s in groups], fontsize=8)
    ax.set_ylabel("speed-up over eager (x)")
    ax.set_title(f"{meta['suite']} suite, {meta['card_detail']}, {meta['date'][:10]}, torch {meta['torch']}",
                 fontsize=9)
    if modes:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no row with an eager baseline", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    path = os.path.join(out, "results.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def interleaved_line(model: str, task: str, row: dict, fig: dict) -> str:
    vs = fig.get("vs_inductor")
    return (f"  in turn, {fig['rounds']} rounds: {model} {task} {row['mode']}: median {_ms(fig['ms']['median'])} ms"
            + (f", {vs['median']:.2f}x Inductor [{vs['p20']:.2f}, {vs['p80']:.2f}]" if vs else ""))


def progress_line(row: dict, index: int, total: int, elapsed_s: float) -> str:
    head = (f"[{index:3d}/{total} {int(elapsed_s) // 60:2d}:{int(elapsed_s) % 60:02d}] "
            f"{row['model']} {row['task']} {row['shape']} {row['dtype']} {row['mode']}")
    if row["status"] != "ok":
        return f"{head}: {row['status']}"
    parts = [f"median {_ms(row['ms'])} ms", f"noise {100 * row['noise']:.1f}%"]
    if row.get("compile_s") is not None:
        parts.insert(0, f"compile {row['compile_s']:.1f} s")
    if row.get("vs_inductor"):
        parts.append(f"{row['vs_inductor']:.2f}x Inductor")
    if row.get("peak_mib") is not None:
        parts.append(f"peak {row['peak_mib']:.0f} MiB")
    parts.append(f"rel err {row['rel_err']:.1e}")
    if row.get("passes") is not None:
        parts.append(f"fired: {', '.join(row['passes']) or 'none'}")
    return f"{head}: {', '.join(parts)} (row {row['row_s']:.1f} s)"
