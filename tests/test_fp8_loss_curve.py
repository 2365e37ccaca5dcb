"""benchmarks/fp8_loss_curve.py on the CPU, small: the bf16 and fp8 runs train (finite, falling losses), the fp8
run's report shows the pass rewrote the GPT's linears, and the JSON, the summary and the PNG are written.

No accuracy figure is asserted: a few steps of a tiny model say nothing about fp8's noise against bf16's."""

import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmarks/ is a package at the repository root

from benchmarks import fp8_loss_curve  # noqa: E402


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def _scaled_mm_works():
    try:
        from kpt_compiler.passes._fp8_recipes import fp8_linear

        fp8_linear(torch.randn(16, 32), torch.randn(16, 32), recipe="tensorwise")
        return True
    except (RuntimeError, NotImplementedError):
        return False


pytestmark = pytest.mark.skipif(not _torch_at_least(2, 10) or not _scaled_mm_works(),
                                reason="this torch's CPU torch._scaled_mm cannot run the fp8 recipes")


def test_markov_task_floor_is_its_conditional_entropy():
    task = fp8_loss_curve.MarkovTask(64, seed=0)
    x = task.sample(256, 33, seed=5)
    assert x.shape == (256, 33) and int(x.min()) >= 0 and int(x.max()) < 64
    assert torch.equal(x, task.sample(256, 33, seed=5))  # deterministic from the seed
    # every token after the first two is one of its predecessor's successors
    assert all(int(x[0, t]) in task.succ[int(x[0, t - 1])].tolist() for t in range(2, 33))
    floor = task.floor(x)
    assert 0 < floor < task.order1_entropy() < math.log(64)
    # the floor is the Bayes predictor's cross-entropy: close to the empirical loss of the chain's own rows
    rows = task.group[x[:, :-2]] * 64 + x[:, 1:-1]
    j = (task.succ[x[:, 1:-1]] == x[:, 2:, None]).float().argmax(-1)
    nll = -task.probs[rows, j].log()
    empirical = (math.log(64) * x.shape[0] + nll.sum().item()) / (x.shape[0] * 32)
    assert abs(empirical - floor) < 0.05


def test_summary_compares_fp8_with_the_bf16_spread():
    def run(train, ev):
        return {"final_train_loss": train, "final_eval_loss": ev}

    runs = {"bf16": run(2.00, 2.10), "bf16-seed2": run(2.03, 2.08), "bf16-seed3": run(1.99, 2.11),
            "fp8": run(2.01, 2.16), "fp8-rowwise": {"seed": 1, "error": "RuntimeError: boom"}}
    s = fp8_loss_curve.summarize(runs)
    assert s["final_train_loss"]["bf16_spread"] == pytest.approx(0.04)
    assert s["final_train_loss"]["fp8"]["diff_vs_bf16"] == pytest.approx(0.01)
    assert s["final_train_loss"]["fp8"]["within_bf16_noise"] is True
    assert s["final_eval_loss"]["bf16_spread"] == pytest.approx(0.03)
    assert s["final_eval_loss"]["fp8"]["within_bf16_noise"] is False  # +0.06 against a spread of 0.03
    assert "fp8-rowwise" not in s["final_eval_loss"]  # a failed run is left out


def test_tiny_run_bf16_and_fp8(tmp_path):
    out = tmp_path / "lc"
    rc = fp8_loss_curve.main(["--device", "cpu", "--tiny", "--steps", "12", "--eval-every", "6",
                              "--runs", "fp8,bf16", "--out", str(out)])
    assert rc == 0
    record = json.loads((out / "fp8_loss_curve.json").read_text())
    assert record["torch"] == torch.__version__ and record["date"] and "commit" in record
    assert record["card"].startswith("cpu") and "--tiny" in record["command"]
    assert 0 < record["task"]["floor"] < record["task"]["uniform"]
    runs = record["runs"]
    assert list(runs) == ["bf16", "fp8"]  # bf16 first, whatever the order asked for
    for name, r in runs.items():
        assert "error" not in r, (name, r.get("error"))
        losses = r["train_loss"]
        assert len(losses) == 12 and all(x is not None and math.isfinite(x) for x in losses), name
        assert sum(losses[-3:]) / 3 < losses[0] - 0.1, (name, losses)  # it learns
        assert [s for s, _ in r["eval"]] == [0, 6, 12]
        assert r["eval"][-1][1] < r["eval"][0][1]
        assert r["final_train_loss"] == pytest.approx(sum(losses[-10:]) / 10)
        assert r["compiler"]["graphs"] == 1  # the evaluation reuses the training graph: no recompile
    # fp8 ran: the pass rewrote the GPT's linears (2 layers x 4, and the tied lm_head), none backed out
    fp8 = runs["fp8"]["compiler"]
    assert fp8["fp8_fired"] and fp8["fp8_matches"] == 9 and not fp8["fp8_backed_out"], fp8
    assert runs["fp8"]["options"]["fp8"] == {"decide": "always"}
    assert not runs["bf16"]["compiler"]["fp8_fired"] and runs["bf16"]["compiler"]["fp8_matches"] == 0
    # the same seed gives the same start: bf16 and fp8 begin from the same weights and data
    assert runs["fp8"]["eval"][0][1] == pytest.approx(runs["bf16"]["eval"][0][1], abs=0.05)
    assert runs["fp8"]["train_loss"] != runs["bf16"]["train_loss"]  # but fp8 did change the numbers
    summary = record["summary"]["final_eval_loss"]
    assert summary["bf16_spread"] is None and summary["fp8"]["within_bf16_noise"] is None  # one bf16 run
    assert summary["fp8"]["diff_vs_bf16"] == pytest.approx(runs["fp8"]["final_eval_loss"]
                                                            - runs["bf16"]["final_eval_loss"])
    md = (out / "fp8_loss_curve.md").read_text()
    assert "fewer than two bf16 runs" in md and "| fp8 | 1 |" in md

    pytest.importorskip("matplotlib")
    png = out / "fp8_loss_curve.png"
    png.unlink()
    assert fp8_loss_curve.main(["--plot", str(out / "fp8_loss_curve.json")]) == 0
    assert png.stat().st_size > 10_000


def test_fp4_quality_trains_then_compares_perplexity_and_top1(tmp_path):
    # benchmarks/fp4_quality.py: the tiny GPT trained a few steps on the CPU, then evaluated with fp4 weights
    import json

    from kpt_compiler.kernels import _launch

    if not _launch.kernel_runs(torch.empty(0), needs_3_6_interpreter=True):
        pytest.skip("the fp4 kernel runs on the CPU only in Triton's interpreter")
    from benchmarks import fp4_quality

    assert fp4_quality.main(["--device", "cpu", "--tiny", "--steps", "4", "--formats", "nvfp4",
                             "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fp4_quality.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["16-bit", "fp4 nvfp4"]
    fp4 = rows[1]
    assert fp4["layers"] == 9 and not fp4["backed_out"] and 0.5 < fp4["top1_agreement"] <= 1.0
    assert abs(fp4["loss"] - rows[0]["loss"]) < 0.5 and all(v > 15 for v in fp4["layer_db"].values())
