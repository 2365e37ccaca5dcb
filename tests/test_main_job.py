"""The main job's command runs end to end (small sizes) and writes what it promises."""

import json
import subprocess
import sys

import pytest


@pytest.mark.inductor
def test_main_job_small(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "kpt_compiler.demo", "--model", "tiny-gpt", "--layers", "1", "--batch", "1",
         "--seq", "32", "--rep-ms", "20", "--out", str(out), "--options", '{"test_relu_to_clamp": true}'],
        capture_output=True, text=True, timeout=600,
    )
    # The options name a test-only pass that this subprocess never registered: a clear error, not a crash.
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown option 'test_relu_to_clamp' in options")
    proc = subprocess.run(
        [sys.executable, "-m", "kpt_compiler.demo", "--model", "tiny-gpt", "--layers", "1", "--batch", "1",
         "--seq", "32", "--rep-ms", "20", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode in ("eager", "inductor", "kernelpytorch"):
        assert f"| {mode} |" in proc.stdout
    assert "output check: kernelpytorch" in proc.stdout and ": OK" in proc.stdout
    result = json.loads((out / "main_job.json").read_text())
    assert result["ok"] and [r["mode"] for r in result["rows"]] == ["eager", "inductor", "kernelpytorch"]
    # timed in turn: every mode in each of the rounds, its median over them, against Inductor round by round
    for r in result["rows"]:
        assert len(r["ms_rounds"]) == 3 and min(r["ms_rounds"]) <= r["ms"] <= max(r["ms_rounds"]), r
    kpt, ind = result["rows"][2], result["rows"][1]
    ratios = sorted(i / k for i, k in zip(ind["ms_rounds"], kpt["ms_rounds"]))
    assert kpt["vs_inductor"] == ratios[1] and kpt["first_call_s"] > 0  # the middle round's ratio, not medians
    assert "graph(s) compiled during the timing" not in proc.stdout  # each mode kept its graphs between rounds
    assert (out / "index.html").is_file() and (out / "summary.json").is_file()
