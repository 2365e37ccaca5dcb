"""The benchmark harness on the CPU: the quick suite end to end, regression grading, skipped and failed rows.

No timing is asserted: only that the harness measures, records and grades what it should.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmarks/ is a package at the repository root, run as python -m benchmarks.run

from benchmarks import compare, run  # noqa: E402
from benchmarks.option_sets import OPTION_SETS  # noqa: E402
from kpt_compiler.models import zoo  # noqa: E402

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.inductor
def test_quick_suite_on_cpu_end_to_end(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "benchmarks.run", "--suite", "quick", "--device", "cpu", "--modes", "eager,kpt",
           "--rep-ms", "50", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    result = json.loads((out / "results.json").read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["suite"] == "quick" and meta["device"] == "cpu" and meta["card"] == "cpu"
    assert "--suite quick --device cpu" in meta["command"] and meta["date"]
    assert meta["torch"] and "transformers" in meta and "triton" in meta
    assert "FX-graph cache and AOTAutograd cache off" in meta["caches"]

    cases = [("tiny-gpt", "inference", "1x32"), ("tiny-gpt", "training", "1x32"), ("gpt2-eager", "inference", "1x32")]
    expected = [(m, t, s, "fp32", mode) for m, t, s in cases for mode in ("eager", "kpt")]
    assert [(r["model"], r["task"], r["shape"], r["dtype"], r["mode"]) for r in rows] == expected
    for r in rows:
        if r["model"] == "gpt2-eager" and not HAVE_TRANSFORMERS:
            assert r["status"] == "skipped: transformers is not installed"
            continue
        assert r["status"] == "ok", r
        assert r["ms"] > 0 and r["p20_ms"] <= r["ms"] <= r["p80_ms"] and r["noise"] >= 0
        # float32 against the float32 eager copy. Not bit-exact even for eager: the training row runs with autograd
        # on and the reference under no_grad, and a CPU may take another kernel then (CI saw 1.2e-5 on its CPU).
        assert r["rel_err"] < 1e-4
        assert r["vs_eager"] > 0 and r["vs_inductor"] is None  # no inductor row asked for
        if r["mode"] == "eager":
            assert r["compile_s"] is None and "passes" not in r
        else:
            assert r["compile_s"] > 0 and isinstance(r["passes"], list) and r["graphs"] >= 1

    table = (out / "results.md").read_text()
    assert "| model | task | shape | dtype | mode | compile s | median ms | noise % | vs Inductor |" in table
    assert table.count("| tiny-gpt | training | 1x32 | fp32 |") == 2 and meta["command"] in table
    if HAVE_MATPLOTLIB:
        assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the torch 2.9 + torch_xla environment of scripts/test.sh has no matplotlib
        assert not (out / "results.png").exists() and "matplotlib is not installed: no results.png" in proc.stdout
    # one progress line per row as it goes, the table last
    assert proc.stdout.count("] tiny-gpt ") == 4
    assert proc.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])


def test_missing_library_gives_skipped_rows(tmp_path, monkeypatch):
    reason = "transformers is not installed (planted by the test)"

    def no_transformers(**_):
        raise zoo.MissingLibrary(reason)

    monkeypatch.setitem(zoo.BUILDERS, "gpt2", no_transformers)
    out = tmp_path / "bench"
    assert run.main(["--device", "cpu", "--models", "gpt2-eager", "--modes", "eager,kpt", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["model"], r["mode"], r["status"]) for r in rows] == [
        ("gpt2-eager", "eager", f"skipped: {reason}"), ("gpt2-eager", "kpt", f"skipped: {reason}")]
    assert f"skipped: {reason}" in (out / "results.md").read_text()


def test_a_failing_mode_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(OPTION_SETS, "broken", {"no_such_option": True})
    out = tmp_path / "bench"
    assert run.main(["--device", "cpu", "--models", "tiny-gpt", "--modes", "kpt[broken],eager", "--rep-ms", "20",
                     "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["task"], r["mode"]) for r in rows] == [("inference", "eager"), ("inference", "kpt[broken]"),
                                                      ("training", "eager"), ("training", "kpt[broken]")]
    for r in rows:
        if r["mode"] == "eager":
            assert r["status"] == "ok"
        else:
            assert r["status"].startswith("error: ") and "no_such_option" in r["status"], r["status"]
            assert r["options"] == {"no_such_option": True}


# ---------------------------------------------------------------------------- compare


def _row(mode="kpt", ms=10.0, noise=0.02, rel_err=1e-3, status="ok", model="gpt2-eager"):
    return {"model": model, "task": "inference", "shape": "8x1024", "dtype": "bf16", "mode": mode,
            "status": status, "ms": ms, "noise": noise, "rel_err": rel_err}


def _compare(tmp_path, capsys, old_rows, new_rows):
    paths = []
    for name, rows in (("old", old_rows), ("new", new_rows)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"meta": {"card": "test card"}, "rows": rows}))
        paths.append(str(path))
    code = compare.main(paths)
    return code, capsys.readouterr().out


def test_compare_grades_a_large_slowdown_severe(tmp_path, capsys):
    old = [_row("inductor"), _row("kpt")]
    new = [_row("inductor"), _row("kpt", ms=15.0)]  # 50% slower, 2% noise: 25x the noise
    code, out = _compare(tmp_path, capsys, old, new)
    assert code == 1
    assert "severe   gpt2-eager inference 8x1024 bf16 kpt: 10.000 -> 15.000 ms" in out
    assert "inductor" not in out


def test_compare_grades_a_small_slowdown_minor(tmp_path, capsys):
    code, out = _compare(tmp_path, capsys, [_row()], [_row(ms=10.3)])  # 3% slower, 2% noise: 1.5x the noise
    assert code == 0
    assert "minor    gpt2-eager inference 8x1024 bf16 kpt" in out and "severe" not in out
    # within the noise: nothing flagged; the noise has a 2% floor even when a row reports less
    code, out = _compare(tmp_path, capsys, [_row(noise=0.001)], [_row(ms=10.15, noise=0.001)])
    assert code == 0 and "no regressions" in out


def test_compare_flags_accuracy_regressions_and_new_errors(tmp_path, capsys):
    old = [_row("kpt"), _row("kpt[ro]"), _row("inductor", rel_err=1e-6)]
    new = [_row("kpt", rel_err=5e-3), _row("kpt[ro]", status="error: RuntimeError: boom"),
           _row("inductor", rel_err=5e-5)]  # 50x worse, but under 1e-4: rounding, not a regression
    code, out = _compare(tmp_path, capsys, old, new)
    assert code == 1
    assert "moderate gpt2-eager inference 8x1024 bf16 kpt: rel err 1.0e-03 -> 5.0e-03" in out
    assert "severe   gpt2-eager inference 8x1024 bf16 kpt[ro]: was ok, now error: RuntimeError: boom" in out
    assert "inductor" not in out


def test_compare_of_an_unchanged_run_flags_nothing(tmp_path, capsys):
    rows = [_row("eager", ms=25.0), _row("inductor", ms=9.0), _row("kpt", ms=8.5),
            _row("kpt[ro]", status="skipped: time budget")]
    code, out = _compare(tmp_path, capsys, rows, rows)
    assert code == 0
    assert out.strip() == "no regressions"


def test_a_noisy_row_is_timed_again_and_the_steadiest_timing_kept(monkeypatch):
    from benchmarks import measure
    from kpt_compiler.bench import Timing

    def runs(*timings):
        it = iter(timings)
        calls = []

        def fake(step, device, warmup_ms, rep_ms):
            calls.append(rep_ms)
            return next(it)
        monkeypatch.setattr(measure, "timing_ms", fake)
        return calls

    steady, noisy, noisier = Timing(1.0, 0.99, 1.01), Timing(1.2, 0.9, 1.5), Timing(1.0, 0.6, 1.6)
    calls = runs(steady)
    assert measure.steady_timing(None, "cpu", 50) == (steady, 0) and len(calls) == 1
    calls = runs(noisy, noisier, steady, steady)
    assert measure.steady_timing(None, "cpu", 50) == (steady, 2) and len(calls) == 3
    calls = runs(noisier, noisy, noisier, steady)  # retries spent: the steadiest of the three, though noisy
    assert measure.steady_timing(None, "cpu", 50, retries=2) == (noisy, 2) and len(calls) == 3


def test_the_commit_can_be_named_where_git_is_stale(monkeypatch):
    """On the lent GPU machine the tree's git HEAD is the session's first; KPT_COMMIT names the real one."""
    monkeypatch.delenv("KPT_COMMIT", raising=False)
    from_git = run._git_commit()
    assert from_git is None or len(from_git.split("+")[0]) >= 7
    monkeypatch.setenv("KPT_COMMIT", "abc1234")
    assert run._git_commit() == "abc1234"


def test_a_results_commit_says_dirty_when_the_tree_has_changes(tmp_path, monkeypatch):
    """The stamp on results is the real commit, and "+dirty" where tracked files differ from it."""
    import shutil

    from kpt_compiler import bench

    if shutil.which("git") is None:
        pytest.skip("no git")
    monkeypatch.delenv("KPT_COMMIT", raising=False)
    repo = tmp_path / "repo"
    (repo / "kpt_compiler").mkdir(parents=True)
    shutil.copy(bench.__file__, repo / "kpt_compiler" / "bench.py")
    (repo / "notes.txt").write_text("tracked\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(git + cmd, cwd=repo, check=True, capture_output=True)
    stamp = [sys.executable, "-c", "import importlib.util as u; s = u.spec_from_file_location('b', 'kpt_compiler/bench.py');"
             " m = u.module_from_spec(s); s.loader.exec_module(m); print(m.git_commit())"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert subprocess.run(stamp, cwd=repo, capture_output=True, text=True).stdout.strip() == head
    (repo / "notes.txt").write_text("changed\n")
    assert subprocess.run(stamp, cwd=repo, capture_output=True, text=True).stdout.strip() == head + "+dirty"


def test_calibrate_refuses_without_a_gpu(capsys):
    from benchmarks import calibrate

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert calibrate.main(["--tables", "ceilings"]) == 2
    assert "run it on the GPU machine" in capsys.readouterr().err


def test_calibration_files_merge_tables_and_keep_each_entrys_run():
    from benchmarks.calibrate import merge

    device = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
    first = {"command": "python -m benchmarks.calibrate", "date": "2026-11-26", "commit": "aaa"}
    gemm = {"source": "s1", "points": [{"M": 1, "K": 2, "N": 3, "speedup": 1.5}]}
    data = merge(None, device, first, {"gated_linear": gemm, "ceilings": {"tflops": 700.0},
                                       "host": {"gated_linear": {"inference": 50.0, "triton": 12.0, "inductor": 37.0}}})
    assert data["runs"] == [first] and data["device_time"]["gated_linear"]["bfloat16"]["points"][0]["run"] == 0
    second = {**first, "commit": "bbb", "command": "python -m benchmarks.calibrate --tables gated_linear"}
    again = merge(json.loads(json.dumps(data)), device, second, {"gated_linear": {**gemm, "source": "s2"}})
    assert again["runs"] == [first, second]  # the first still measured the ceilings and the host table
    assert again["device_time"]["gated_linear"]["bfloat16"]["source"] == "s2"
    assert again["device_time"]["gated_linear"]["bfloat16"]["points"][0]["run"] == 1 and again["ceilings"]["run"] == 0
    third = merge(json.loads(json.dumps(again)), device, {**second, "commit": "ccc"},
                  {"ceilings": {"tflops": 710.0}, "host": {"gated_linear": {"inference": 1.0, "triton": 1.0,
                                                                              "inductor": 1.0}}})
    assert [r["commit"] for r in third["runs"]] == ["bbb", "ccc"]  # nothing names the first run any more
    assert third["ceilings"]["run"] == 1 and third["device_time"]["gated_linear"]["bfloat16"]["points"][0]["run"] == 0
    with pytest.raises(ValueError, match="this card is"):
        merge(third, {"name": "NVIDIA H200", "capability": [9, 0]}, first, {})


def test_a_gemm_table_takes_the_bench_ratio_against_what_it_names(monkeypatch):
    """calibrate's GEMM tables from the benches' rows (their measuring needs a GPU; the plumbing does not)."""
    from benchmarks import bench_linear_epilogue, calibrate
    from kpt_compiler import cost_model as cm
    from kpt_compiler.kernels import linear_epilogue

    def measure(M, K, N, act, variants, launches):
        assert variants == ("cublas",) and act == "none" and launches is False
        return {"shape": [M, K, N], "ms": {"ours": 0.002, "cublas": 0.001}, "ours_vs_cublas": 0.5}

    monkeypatch.setattr(bench_linear_epilogue, "measure", measure)
    table = calibrate.measure_gemm_table("linear_epilogue_vs_gemm")
    assert table["source"] == cm.source_hash(linear_epilogue)
    assert [(p["M"], p["K"], p["N"]) for p in table["points"]] == [tuple(s) for s in bench_linear_epilogue.SHAPES]
    first = table["points"][0]
    assert (first["speedup"], first["ours_us"], first["theirs_us"]) == (0.5, 2.0, 1.0)


def test_a_microbenchmark_writes_its_record_stamped_with_the_commit_and_its_table(tmp_path, monkeypatch):
    from benchmarks.outputs import write_bench

    monkeypatch.setenv("KPT_COMMIT", "abc1234+dirty")
    write_bench(str(tmp_path / "out"), "bench_x", {"card": "some card", "rows": [{"a": 1}]}, "| a |\n| 1 |")
    record = json.loads((tmp_path / "out" / "bench_x.json").read_text())
    assert record["commit"] == "abc1234+dirty" and record["card"] == "some card" and record["rows"] == [{"a": 1}]
    assert record["date"] and record["torch"] == torch.__version__
    assert (tmp_path / "out" / "bench_x.md").read_text() == "| a |\n| 1 |\n"


def test_the_torchao_baseline_keeps_the_output_layer_and_layers_fp8_cannot_take():
    from benchmarks import torchao_fp8

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 40), torch.nn.Linear(40, 64),
                                torch.nn.Linear(64, 64))
    convert, kept = torchao_fp8.plan(model)
    assert convert == ["0"] and set(kept) == {"1", "2", "3"}
    assert "multiples of 16" in kept["1"] and "last nn.Linear" in kept["3"]
    model.add_module("lm_head", torch.nn.Linear(64, 96))  # named: the output layer, whatever comes after it
    model.add_module("tail", torch.nn.Linear(64, 64))
    convert, kept = torchao_fp8.plan(model, skip=["0"])
    assert convert == ["3", "tail"] and "lm_head" in kept["lm_head"] and "skip" in kept["0"]
    assert torchao_fp8.plan(torch.nn.Linear(32, 32), keep_output=False) == ([""], {})


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao is installed here")
def test_the_torchao_baseline_says_why_without_torchao():
    from benchmarks import torchao_fp8

    assert torchao_fp8.available().startswith("not installed") and torchao_fp8.version() is None
    for convert in (torchao_fp8.convert_training, torchao_fp8.convert_inference):
        with pytest.raises(zoo.MissingLibrary, match="torchao not installed") as e:
            convert(torch.nn.Linear(32, 32))
        assert isinstance(e.value, ImportError)


def test_modes_timed_in_turn_give_paired_ratios_and_a_table(monkeypatch):
    """--interleave: each mode compiled once, then timed round by round (the order rotated); the ratio to
    Inductor is the median of the rounds' ratios. Here "inductor" is Dynamo's eager backend (cheap) and a
    copy of the step reports twice its time in every round (the times are given, not measured: a clock on a
    loaded 2-core CI machine once put the ratio at 2.6)."""
    from benchmarks import measure, outputs
    from benchmarks.zoo import CPU_ZOO

    entry = next(e for e in CPU_ZOO if e.name == "tiny-gpt")
    case = next(c for c in entry.cases if c.task == "training")
    model, make_inputs = measure.prepare(entry, "cpu", torch.float32)
    inputs = make_inputs(case.batch, case.seq, "cpu")
    ref = measure.reference(model, inputs, True)
    real = measure.make_step
    order = []

    def make_step(model, inputs, ref, training, kwargs, device):
        step = real(model, inputs, ref, training, kwargs, device)
        name = "slow" if kwargs and kwargs.get("slow") else "inductor"

        def timed():
            order.append(name)
            for _ in range(2 if name == "slow" else 1):
                out = step()
            return out
        return timed

    monkeypatch.setattr(measure, "make_step", make_step)

    def timing_ms(step, device, **_):  # the time each round's step reports: the pairing is tested, not a clock
        from kpt_compiler.bench import Timing

        step()
        t = (2.0 if order[-1] == "slow" else 1.0) * (1 + 0.1 * len(order))  # rounds differ; within one, 2x
        return Timing(t, t, t)

    monkeypatch.setattr(measure, "timing_ms", timing_ms)
    modes = {"inductor": {"backend": "eager"}, "slow": {"backend": "eager", "slow": True}}
    monkeypatch.setattr(torch, "compile", lambda model, backend, slow=False: torch._dynamo.optimize(backend)(model))
    figures = measure.interleaved(model, inputs, ref, case, modes, "cpu", rounds=4, rep_ms=20)
    assert figures["inductor"]["vs_inductor"]["median"] == 1.0 and figures["slow"]["rounds"] == 4
    assert 1.7 < 1 / figures["slow"]["vs_inductor"]["median"] < 2.3, figures  # 2x, within a round's drift
    firsts = [order[i] for i in range(len(order)) if i == 0 or order[i] != order[i - 1]]
    assert firsts[:3] == ["inductor", "slow", "inductor"]  # the rounds alternate which mode goes first
    row = {"model": "tiny-gpt", "task": "training", "shape": "1x32", "dtype": "fp32", "mode": "slow",
           "status": "ok", "ms": 1.0, "interleaved": figures["slow"]}
    table = outputs.markdown({"suite": "quick", "card_detail": "cpu", "date": "d", "torch": "t", "command": "c",
                              "timing": "t", "caches": "c", "reference": "r"}, [row])
    assert "Timed in turn (--interleave 4" in table and "| tiny-gpt | training | 1x32 | slow |" in table


def test_profile_rounds_table_pairs_each_round_with_inductor(monkeypatch):
    from benchmarks import profile_case

    monkeypatch.setenv("KPT_COMMIT", "abc1234")
    # host-bound rounds: kpt's wall is 0.8x Inductor's in one round and 1.25x faster in the next two
    walls = [(10.0, 12.5), (10.0, 8.0), (12.0, 9.6)]
    record = {"model": "tiny-gpt", "case": "training:8x1024", "card": "H100", "command": "python -m x",
              "rounds": [{"inductor": {"wall_ms": i, "device_us": 2300.0}, "kpt": {"wall_ms": k, "device_us": 1650.0}}
                         for i, k in walls]}
    table = profile_case.rounds_table(record, ["inductor", "kpt"])
    assert "commit: abc1234" in table and "3 rounds in turn" in table
    assert "| 2 | 10.00 | 2.30 | 8.00 | 1.65 |" in table
    kpt = next(line for line in table.splitlines() if line.startswith("| kpt |"))
    assert "1.25x [0.98, 1.25]" in kpt  # median of 0.8, 1.25, 1.25; 20th percentile 0.8 + 0.4 * 0.45
    assert kpt.split("|")[3].strip() == "1.65"


@pytest.mark.inductor
def test_bench_warm_compiles_cold_then_warm_from_one_cache(tmp_path):
    """The warm-restart benchmark on the CPU's tiny GPT: the second process reads the first one's Inductor cache
    (an FX-graph hit), our attention pass fires in both, and the warm report says where the code came from."""
    from benchmarks import bench_warm

    assert bench_warm.main(["--device", "cpu", "--models", "tiny-gpt", "--modes", "kpt", "--out", str(tmp_path),
                            "--profile", str(tmp_path / "prof"), "--warm-runs", "2"]) == 0
    row, = json.loads((tmp_path / "bench_warm.json").read_text())["rows"]
    assert len(row["warm_again_s"]) == 1 and row["warm_again_s"][0] > 0 and row["profiled_s"] > 0
    # the profile covers the compile (Dynamo's entry is in it), not the model's building
    profile = (tmp_path / "prof" / "tiny-gpt-kpt-warm.txt").read_text()
    assert "convert_frame" in profile and "zoo.py" not in profile
    assert row["cold_imports_s"] > 0 and row["warm_imports_s"] > 0
    assert row["speedup_with_imports"] < row["speedup"]
    assert row["warm_fx_hits"] >= 1 and row["cold_fired"] == row["warm_fired"] and "attention" in row["warm_fired"]
    assert row["warm_says_cache"] and row["cold_s"] > 0 and row["warm_s"] > 0
    # Dynamo's share: most of a cold compile (Inductor's C++ build), less than the whole of either
    assert 0 < row["warm_compile_s"] < row["warm_s"] and 0.5 * row["cold_s"] < row["cold_compile_s"] < row["cold_s"]
    assert (tmp_path / "bench_warm.md").read_text().count("| tiny-gpt |") == 1


def test_bench_warm_takes_a_named_entrys_first_inference_case():
    """A model named with --models that has no quick inference case (the CPU zoo's whole models) runs its first
    inference case; a quick one is preferred where there is one; a name the zoo lacks is an error naming it."""
    from benchmarks import bench_warm

    entry, case = bench_warm.inference_case("t5-encoder-eager", "cpu")
    assert entry.name == "t5-encoder-eager" and case.task == "inference" and not case.quick
    entry, case = bench_warm.inference_case("tiny-gpt", "cpu")
    assert case.quick and case.task == "inference"
    with pytest.raises(ValueError, match="t5-decoder"):
        bench_warm.main(["--device", "cpu", "--models", "t5-decoder", "--modes", "kpt"])


def test_bench_warm_times_both_autotuners(monkeypatch):
    """What the autotuning column adds up: each config benchmark of Triton's autotuner and each of Inductor's."""
    import time

    pytest.importorskip("triton")
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.runtime.autotuner import Autotuner

    from benchmarks import bench_warm

    monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, **k: time.sleep(0.02) or [1.0])
    monkeypatch.setattr(CachingAutotuner, "benchmark_all_configs", lambda self, *a, **k: time.sleep(0.03) or {})
    totals = bench_warm._time_autotuning()
    assert Autotuner._bench(None, config=None) == [1.0] and CachingAutotuner.benchmark_all_configs(None) == {}
    Autotuner._bench(None, config=None)
    assert totals["calls"] == 3 and 0.07 <= totals["seconds"] < 1.0, totals


def test_the_l2_diagnosis_variants_still_apply_to_the_kernel_source():
    """``benchmarks/diag_fp4_l2.py`` carries the evict-first hint that a GPU session is to land with a new H200
    calibration (docs/fp4-cuda-kernel.md): each variant's edits must still find their places in the CUDA form's
    source, and the hint must touch the weights' loads and nothing else."""
    from benchmarks import diag_fp4_l2 as d

    assert d.source(False) == d.AS_BUILT
    hinted = d.source(True)
    assert hinted.count("L2::cache_hint") == 2 and hinted.count(", pol)") == 4
    undone = hinted
    for plain, hint in reversed(d.HINTS):
        assert undone.count(hint) == 1, hint[:60]
        undone = undone.replace(hint, plain)
    assert undone == d.AS_BUILT
    for exp in ("evict-first", "prefetch"):
        for name, (variant, *_) in d.variants(exp).items():
            assert "fp4_mma_sync" in d.source(*variant), (exp, name)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) on PATH")
def test_the_evict_first_variants_compile_for_sm_90():
    """The hinted variants build (nvcc, sm_90): s48's x ring (async 2) copies x with the plain two-argument
    cp_async16, which the hint had replaced with a three-argument one, so until s49 the variants did not compile at
    all (they would have failed on the next GPU). Every config compiles the x ring's code; one config suffices."""
    from benchmarks import diag_fp4_l2 as d
    from benchmarks._fp4_diag import sm90_registers

    for name in ("evict-first weights", "scales too"):
        variant = d.variants("evict-first")[name][0]
        assert sm90_registers(d.source(*variant), "2, 1, 12, 2, 2, 2") > 0, name


def test_the_x_pinned_bound_still_applies_to_the_kernel_source(monkeypatch):
    """``benchmarks/diag_fp4_xring.py --x-pinned`` edits the CUDA form's source into a bound (x's reads pinned to a
    warp's first chunk): each edit must still find its one place, and a kernel that lost it must say so."""
    from benchmarks import diag_fp4_xring as d

    pinned = d.pinned_source()
    assert "x_row[nt] + q);  /* pinned */" in pinned and "x_row[nt] += " not in pinned
    assert pinned.count("chunk_mma<NT>(") == d.AS_BUILT.count("chunk_mma<NT>(")
    # the configs it times: x in registers and through the ring, each within a block's shared memory
    assert {c["async"] for c in d.configs(16)} == {1, 2} and all(c["nt"] == 2 for c in d.configs(16))
    assert all(d.shared_bytes(c) <= 227 * 1024 for c in d.configs(16))
    broken = d.AS_BUILT.replace("x_row[nt] += 16 * WK * DEPTH;", "x_row[nt] += 16 * WK * DEPTH; ")
    monkeypatch.setattr(d, "AS_BUILT", broken)
    with pytest.raises(RuntimeError, match="no longer has"):
        d.pinned_source()


def test_the_cluster_split_variant_still_applies_to_the_kernel_source(monkeypatch):
    """``benchmarks/diag_fp4_cluster.py`` edits the CUDA form's source into a split of K across a thread-block
    cluster: each edit must find its one place, every thread must reach the cluster's barriers (no early return
    before them), and the first block's sum must index the fp32 sums as the warps' own reduction does."""
    from benchmarks import diag_fp4_cluster as d
    from kpt_compiler.kernels import _fp4_cuda

    s = d.source()
    assert "__cluster_dims__(1, CL, 1)" in s and re.search(r"int RT(, int XW)?, int CL>\n__global__", s)
    assert s.count("cluster_sync();") == 2 and "if (warp != 0) return;" not in s
    # the launch's shared memory counts the variant's own array (its opt-in past 48 KB depends on it)
    assert "__shared__ float part[RW][RT * NT * 4][32];" in s and d._part(dict(rw=2, rt=2, nt=2)) == 2 * 16 * 32 * 4
    assert s.index("cluster_sync();") < s.index("if (rank != 0 || warp != 0) return;") < s.index("256.f * gs[0]")
    # the sums' flat index i, as the variant unpacks it, against the kernel's (rt * NT + nt) * 4 + e
    unpack = re.search(r"acc\[(i / \(NT \* 4\))\]\[(\(i / 4\) % NT)\]\[(i % 4)\]", s).groups()
    assert "red[warp][rw][(rt * NT + nt) * 4 + e][lane]" in s
    for rt_n, nt_n in ((1, 1), (2, 2), (4, 2), (1, 2)):
        for rt in range(rt_n):
            for nt in range(nt_n):
                for e in range(4):
                    env = {"i": (rt * nt_n + nt) * 4 + e, "NT": nt_n}
                    assert [eval(x.replace("/", "//"), env) for x in unpack] == [rt, nt, e]
    # every config launches: its dynamic and static shared memory (the variant's part included) within sm_90's 227 KB
    for m in (1, 16):
        for c in d.configs(m):
            assert d._dynamic(c) + _fp4_cuda.static_bytes(c["nt"], c["rw"], c["wk"], c["rt"]) + d._part(c) <= (
                227 * 1024), c
    assert any(c["async"] == 2 and c["cl"] == 2 for c in d.configs(16))
    broken = d.AS_BUILT.replace("  const float f = 256.f * gs[0];", "  const float f = gs[0];")
    monkeypatch.setattr(d, "AS_BUILT", broken)
    with pytest.raises(RuntimeError, match="no longer has"):
        d.source()




def test_the_tiled_weight_variant_reads_each_rows_words_where_the_repack_put_them():
    """``benchmarks/diag_fp4_tiled.py``: its edits find their places and change every weight pointer and step (none
    left at the row-major 16 words a chunk), and the word its lanes read for row r, chunk c (the C expression,
    mirrored in ``word_at``) holds row r's words of chunk c after ``tiled``'s repack, ragged rows included."""
    from benchmarks import diag_fp4_tiled as d

    s = d.source()
    assert s.count("256 * WK * (P)") == 4 and s.count("256 * WK * DEPTH") == 2
    assert not any(f"{p}[rt] + 16 * WK" in s or f"{p}[rt] += 16 * WK" in s for p in ("w_lo", "w_hi"))
    assert s.count("* 256 + (c_lo & 15) * 16 + 4 * t;") == 1 and s.count("* 256 + (c_hi & 15) * 16 + 4 * t;") == 1
    n, k = 37, 384  # three chunks; rows past 32 fill a third tile of 16 with 11 padding rows
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    words = packed.view(torch.int32)
    t = d.tiled(packed)
    assert t.shape == packed.shape
    flat = torch.frombuffer(bytearray(t.untyped_storage()), dtype=torch.int32)
    assert flat.numel() == 48 * k // 8
    chunks = k // 128
    for r in range(n):
        for c in range(chunks):
            for lane_t in range(4):
                at = d.word_at(r, c, lane_t, chunks)
                assert flat[at:at + 4].tolist() == words[r, 16 * c + 4 * lane_t:16 * c + 4 * lane_t + 4].tolist()
    # one chunk step of a warp (WK chunks further) is 256 WK words, the edited pointer step
    assert d.word_at(5, 2, 1, chunks) - d.word_at(5, 0, 1, chunks) == 256 * 2
    # the 8 lanes g of one load (rows 8j..8j+7, t = 0..3) read 512 contiguous bytes
    assert sorted(d.word_at(g, 1, lt, chunks) for g in range(8) for lt in range(4)) == list(
        range(d.word_at(0, 1, 0, chunks), d.word_at(0, 1, 0, chunks) + 128, 4))


@pytest.mark.parametrize("run, wk, nchunks, split, rt, n", [(2, 12, 112, 1, 1, 32), (4, 12, 112, 1, 2, 64),
                                                            (2, 8, 37, 2, 2, 27), (4, 3, 50, 3, 1, 9),
                                                            (2, 5, 9, 1, 1, 16), (2, 4, 23, 2, 1, 5)])
def test_the_runs_variant_lands_each_chunk_where_the_decode_reads_it_before_it_reads_it(run, wk, nchunks, split, rt, n):
    """``benchmarks/diag_fp4_runs.py``: the warps' chunks (runs of RUN) cover each split of K once; each copy (8 / RUN
    rows' RUN x 64 contiguous bytes an instruction, rows past N clamped) lands the 16 bytes a decoding lane reads from
    its slot (row g, or g + 8, of each row tile, clamped as the kernel clamps them; the chunk; bytes 16 t), in a slot
    whose chunk has been read, and the chunk's group is done at the wait (``cp.async.wait_group RUN``), ragged tails
    included. The C expressions are checked in the source, then run here in Python over every lane."""
    from benchmarks import diag_fp4_runs as d

    s = d.source()
    for expr in ("const int first = blockIdx.y * chunks_per_split + RUN * warp;",
                 "runs = left >= RUN ? (left - RUN) / (RUN * WK) + 1 : 0;",
                 "count = RUN * runs + (tail <= 0 ? 0 : tail < RUN ? tail : RUN);",
                 "const int cp_h = (lane % (4 * RUN)) / 4;", "w + 4 * t + 16 * (first + cp_h);",
                 "const int r = k * (8 / RUN) + lane / (4 * RUN);", "(r >= 8 ? 512 : 0) + ((r & 7) * 4 + t) * 16;",
                 "#define CP_ROW(rt, k) ((long long)min(row0 - g + 16 * (rt) + (k) * (8 / RUN) + lane / (4 * RUN), "
                 "N - 1))", "const int row0 = (blockIdx.x * RW + rw) * 16 * RT + g;",
                 "c_lo = r < N ? r : N - 1, c_hi = r + 8 < N ? r + 8 : N - 1;",
                 "#define OFF(P) (RUN * WK * ((P) / RUN) + (P) % RUN)",
                 "\\\n  if ((P) % RUN == RUN - 1) {",  # the run's copies: outside the chunk's count guard (tails)
                 "if (i0 + (P) - (RUN - 1) + cp_h < count)",
                 "(((slot) - (RUN - 1) + cp_h) * RT + rt) * 1024 + cp_dst[k]",
                 "w_run + CP_ROW(rt, k) * stride_wn + 16 * OFF((P) - (RUN - 1))", "cp_async_wait<RUN>();",
                 "w_run += 16 * WK * DEPTH;", "for (int p = 0; p < DEPTH - 1; ++p) { LOAD_W(p, p) }",
                 "LOAD_W((p + DEPTH - 1) % DEPTH, p + DEPTH - 1)", "s_lo[rt] + 8 * OFF(P)",
                 "x_row[nt] + 16 * OFF(P) + q",
                 "chunk_mma<NT>(acc[rt], load_shared(ring + (p * RT + rt) * 1024),"):
        assert expr in s, expr
    assert s.count("        __syncwarp();  //") == 2 and "if (ASYNC == 2) __syncwarp();" not in s  # the warp meets
    assert "16 * WK * (P)" not in s.replace("w_lo[rt] + 16 * WK * (P)", "").replace("w_hi[rt] + 16 * WK * (P)", "")
    depth, per_split = 2 * run, -(-nchunks // split)

    def off(p):
        return run * wk * (p // run) + p % run

    seen = []
    for y in range(split):
        end = min((y + 1) * per_split, nchunks)
        for tile0 in range(0, n, 16 * rt):  # a block's rows (RW 1)
            for warp in range(wk):
                first = y * per_split + run * warp
                left = end - first
                runs = (left - run) // (run * wk) + 1 if left >= run else 0
                tail = left - run * wk * runs
                count = run * runs + (0 if tail <= 0 else min(tail, run))
                chunk = [first + off(i) for i in range(count)]
                if tile0 == 0:
                    seen += chunk
                slots, commits = {}, []  # (slot, row tile) -> {byte: [row, chunk, t, commit, read]}

                def invoke(slot, p, i0, turn):
                    if p % run == run - 1:
                        for lane in range(32):
                            h, t = lane % (4 * run) // 4, lane % 4
                            for r_t in range(rt):
                                for k in range(2 * run):
                                    if i0 + p - (run - 1) + h < count:
                                        r = k * (8 // run) + lane // (4 * run)
                                        row = min(tile0 + 16 * r_t + r, n - 1)
                                        dst = (r >= 8) * 512 + ((r & 7) * 4 + t) * 16
                                        at = (slot - (run - 1) + h, r_t)
                                        old = slots.get(at, {}).get(dst)
                                        assert old is None or old[4], (warp, at, dst)  # its chunk read first
                                        c = first + h + wk * depth * turn + off(p - (run - 1))
                                        slots.setdefault(at, {})[dst] = [row, c, t, len(commits), False]
                    commits.append(p)

                for p in range(depth - 1):
                    invoke(p, p, 0, 0)
                i0 = turn = 0
                while i0 < count:
                    for p in range(depth):
                        if i0 + p < count:
                            invoke((p + depth - 1) % depth, p + depth - 1, i0, turn)
                            for r_t in range(rt):
                                for g in range(8):
                                    for t in range(4):
                                        r = tile0 + g + 16 * r_t
                                        for half, row in ((0, min(r, n - 1)), (512, min(r + 8, n - 1))):
                                            got = slots[(p, r_t)][half + (4 * g + t) * 16]
                                            assert got[:3] == [row, chunk[i0 + p], t], (warp, i0 + p, g, t, got)
                                            # wait_group RUN: all but the newest RUN commits are done, its own too
                                            assert got[3] <= len(commits) - 1 - run, (warp, i0 + p, got[3])
                                            got[4] = True
                    i0 += depth
                    turn += 1
    assert sorted(seen) == list(range(nchunks))  # every chunk once, over the splits and warps
