"""The loss-curve benchmark's outputs (benchmarks/fp8_loss_curve.py): the summary of its runs against the bf16
run-to-run noise, the markdown table, and the PNG drawn from the JSON."""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any

NAME = "fp8_loss_curve"
FINAL_STEPS = 10  # the final training loss is the mean over this many last steps


def _spread(values: list[float]) -> float | None:
    """The largest difference between two of ``values`` (None for fewer than two)."""
    return max(values) - min(values) if len(values) >= 2 else None


def summarize(runs: dict[str, dict]) -> dict[str, Any]:
    """The bf16 seeds' spread of each final loss and each fp8 run's difference from bf16 against it."""
    out: dict[str, Any] = {}
    bf16 = [r for n, r in runs.items() if n.startswith("bf16") and "error" not in r]
    for key in ("final_train_loss", "final_eval_loss"):
        vals = [r[key] for r in bf16 if r[key] is not None]
        spread = _spread(vals)
        entry: dict[str, Any] = {"bf16_spread": spread, "bf16_values": vals}
        base = runs.get("bf16", {}).get(key)
        for name, r in runs.items():
            if name.startswith("bf16") or "error" in r:
                continue
            diff = r[key] - base if r[key] is not None and base is not None else None
            entry[name] = {"value": r[key], "diff_vs_bf16": diff,
                           "within_bf16_noise": (abs(diff) <= spread) if diff is not None and spread is not None
                           else None}
        out[key] = entry
    return out


def markdown(record: dict) -> str:
    runs, summ = record["runs"], record["summary"]
    m = record["config"]["model"]
    lines = [
        f"# fp8 loss curve: GPT {m['n_layer']}x{m['n_embd']} on a synthetic order-2 Markov chain, "
        f"{record['config']['steps']} steps",
        "",
        f"- card: {record['card']}; torch {record['torch']}, triton {record['triton']}; date {record['date']}; "
        f"commit {record['commit'] or 'unknown'}",
        f"- command: `{record['command']}`",
        f"- model {record['config']['dtype']}, batch {record['config']['batch']} x {m['block_size']} tokens, "
        f"AdamW lr {record['config']['lr']:g}; loss floor (the chain's conditional entropy on the evaluation "
        f"batches) {record['task']['floor']:.4f}, order-1 plateau {record['task']['order1_entropy']:.4f}, "
        f"uniform {math.log(m['vocab_size']):.4f} nats",
        "",
        "| run | seed | options | final train loss (last 10) | final eval loss | vs bf16 (train / eval) "
        "| fp8 layers | fp8 SQNR dB | wall s | compile s | step ms | passes fired |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f4(x):
        return "-" if x is None else f"{x:.4f}"

    def signed(x):
        return "-" if x is None else f"{x:+.4f}"

    base = runs.get("bf16", {})
    for name, r in runs.items():
        if "error" in r:
            lines.append(f"| {name} | {r.get('seed')} | `{json.dumps(r.get('options'))}` | "
                         + " | ".join(["-"] * 8) + f" | {r['error'][:120].replace('|', '/')} |")
            continue
        c = r["compiler"]
        dt = dv = None
        if name != "bf16" and "error" not in base and base:
            if r["final_train_loss"] is not None and base.get("final_train_loss") is not None:
                dt = r["final_train_loss"] - base["final_train_loss"]
            if r["final_eval_loss"] is not None and base.get("final_eval_loss") is not None:
                dv = r["final_eval_loss"] - base["final_eval_loss"]
        sq = [g["fp8"].get("error_db") for g in c["per_graph"] if g.get("fp8", {}).get("status") == "applied"]
        lines.append(
            f"| {name} | {r['seed']} | `{json.dumps(r['options'])}` | {f4(r['final_train_loss'])} | "
            f"{f4(r['final_eval_loss'])} | {signed(dt)} / {signed(dv)} | {c['fp8_matches'] or '-'}"
            f"{' (backed out: ' + ', '.join(c['fp8_backed_out']) + ')' if c['fp8_backed_out'] else ''} | "
            f"{', '.join(map(str, sq)) or '-'} | {r['wall_s']:.1f} | {r['compile_s']:.1f} | "
            f"{r['step_ms'] if r['step_ms'] is not None else '-'} | {', '.join(c['fired']) or 'none'} |")
    lines.append("")
    for key, label in (("final_train_loss", "final training loss"), ("final_eval_loss", "final eval loss")):
        s = summ[key]
        if s["bf16_spread"] is None:
            lines.append(f"- {label}: fewer than two bf16 runs, no run-to-run spread")
            continue
        lines.append(f"- {label}: bf16 run-to-run spread (largest difference between {len(s['bf16_values'])} "
                     f"seeds) {s['bf16_spread']:.4f}")
        for name, e in s.items():
            if isinstance(e, dict) and e.get("diff_vs_bf16") is not None:
                verdict = "within" if e["within_bf16_noise"] else "OUTSIDE"
                lines.append(f"  - {name}: {e['diff_vs_bf16']:+.4f} vs bf16 (same seed): {verdict} the bf16 spread")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- plot
_COLORS = {"bf16": "tab:blue", "fp8": "tab:red", "fp8-rowwise": "tab:orange"}


def _smooth(ys: list, window: int) -> list:
    """A centred moving average over ``window`` points (fewer at the ends), skipping missing values."""
    half = window // 2
    out = []
    for i in range(len(ys)):
        near = [y for y in ys[max(0, i - half):i + half + 1] if y is not None]
        out.append(statistics.fmean(near) if near else None)
    return out


def plot(json_path: str) -> str | None:
    """fp8_loss_curve.png beside ``json_path``: the training loss (smoothed; raw, light) and the evaluation loss
    per run with the loss floor and the order-1 plateau, and each run's evaluation loss minus bf16's (the bf16 seeds give the noise)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no PNG (make it elsewhere with --plot FILE.json)", flush=True)
        return None
    with open(json_path) as f:
        record = json.load(f)
    runs = {n: r for n, r in record["runs"].items() if "error" not in r}
    steps = record["config"]["steps"]
    window = max(1, steps // 20)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    grey = iter(["tab:gray", "tab:green", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"])
    colors = {n: _COLORS.get(n) or next(grey, "black") for n in runs}
    for name, r in runs.items():
        xs = list(range(1, len(r["train_loss"]) + 1))
        ax.plot(xs, [y if y is not None else float("nan") for y in r["train_loss"]], color=colors[name],
                alpha=0.15, linewidth=0.8)
        sm = _smooth(r["train_loss"], window)
        ax.plot(xs, [y if y is not None else float("nan") for y in sm], color=colors[name], linewidth=1.6,
                label=f"{name} train (final {r['final_train_loss']:.3f})" if r["final_train_loss"] is not None
                else f"{name} train")
        ev = [(s, y) for s, y in r["eval"] if y is not None]
        ax.plot([s for s, _ in ev], [y for _, y in ev], color=colors[name], linestyle=":", marker="o",
                markersize=3, linewidth=1.0, label=f"{name} eval")
    floor = record["task"]["floor"]
    ax.axhline(floor, color="black", linestyle="--", linewidth=1.0, label=f"loss floor {floor:.3f}")
    plateau = record["task"]["order1_entropy"]
    ax.axhline(plateau, color="gray", linestyle=":", linewidth=0.8,
               label=f"order-1 entropy {plateau:.3f} (no use of the token two back)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("training loss (smoothed; raw light) and eval loss", fontsize=9)

    base = {s: y for s, y in runs.get("bf16", {}).get("eval", []) if y is not None}
    for name, r in runs.items():
        if name == "bf16" or not base:
            continue
        pts = [(s, y - base[s]) for s, y in r["eval"] if y is not None and s in base and s > 0]
        ax2.plot([s for s, _ in pts], [d for _, d in pts], color=colors[name], marker="o", markersize=3,
                 linewidth=1.2 if not name.startswith("bf16") else 0.9,
                 linestyle="-" if not name.startswith("bf16") else "--", label=name)
    ax2.axhline(0.0, color="tab:blue", linewidth=1.0)
    ax2.set_xlabel("step")
    ax2.set_ylabel("eval loss minus bf16's (nats)")
    ax2.set_title("difference from bf16 (seed 1); bf16 seeds dashed: run-to-run noise", fontsize=9)
    ax2.grid(True, alpha=0.3)
    if len(runs) > 1 and base:
        ax2.legend(fontsize=7)
    m = record["config"]["model"]
    fig.suptitle(f"GPT {m['n_layer']}x{m['n_embd']} ({record['config']['dtype']}), {steps} steps, bf16 vs fp8 "
                 f"(kernelpytorch) on {record['card']}; torch {record['torch']}; commit {record['commit']}; "
                 f"{record['date']}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(os.path.dirname(os.path.abspath(json_path)), f"{NAME}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
