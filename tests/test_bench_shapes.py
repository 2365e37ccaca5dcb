"""benchmarks/bench_shapes.py: the stream of sizes, and one short run on the CPU (eager and kpt[bucketing], each in
its own process)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_shapes  # noqa: E402


def test_the_stream_is_seeded_and_keeps_to_its_ranges():
    a = bench_shapes.stream(100, 0, 16, 2048)
    assert a == bench_shapes.stream(100, 0, 16, 2048)
    assert a[:50] == bench_shapes.stream(50, 0, 16, 2048)  # a shorter stream is the longer one's start
    assert a != bench_shapes.stream(100, 1, 16, 2048)
    assert len(a) == 100 and len(bench_shapes.stream(7, 3, 2, 2)) == 7
    assert all(1 <= b <= 16 and 1 <= s <= 2048 for b, s in a)
    small = bench_shapes.stream(300, 5, 3, 4)
    assert {b for b, _ in small} == {1, 2, 3} and {s for _, s in small} == {1, 2, 3, 4}


def test_modes_take_kpt_options_from_the_option_sets():
    assert bench_shapes.compile_kwargs("eager") is None
    assert bench_shapes.compile_kwargs("inductor-dynamic") == {"backend": "inductor", "dynamic": True}
    assert bench_shapes.compile_kwargs("kpt[bucketing+cudagraphs]", "eager") == {
        "backend": "kernelpytorch", "options": {"bucketing": True, "cudagraphs": True, "codegen": "eager"}}
    with pytest.raises(ValueError, match="unknown mode"):
        bench_shapes.compile_kwargs("kpt[no-such-set]")


def test_kpt_rows_are_compared_with_the_fastest_inductor_mode_per_pass():
    rows = [{"model": "m", "mode": "inductor", "status": "ok", "pass1_s": 10.0, "pass2_s": 2.0},
            {"model": "m", "mode": "inductor-dynamic", "status": "ok", "pass1_s": 5.0, "pass2_s": 4.0},
            {"model": "m", "mode": "inductor-ro", "status": "error: x", "pass1_s": 1.0, "pass2_s": 1.0},
            {"model": "m", "mode": "kpt[bucketing]", "status": "ok", "pass1_s": 10.0, "pass2_s": 1.0},
            {"model": "m", "mode": "kpt", "status": "error: OptionError"}]
    bench_shapes.add_ratios(rows)
    assert rows[3]["pass1_vs_inductor"] == 2.0 and rows[3]["pass1_best_inductor"] == "inductor-dynamic"
    assert rows[3]["pass2_vs_inductor"] == 0.5 and rows[3]["pass2_best_inductor"] == "inductor"
    assert rows[4]["pass1_vs_inductor"] is None and "pass1_vs_inductor" not in rows[0]


def test_a_short_stream_on_the_cpu_gives_a_row_per_mode(tmp_path):
    # our GPT: no transformers needed (the XLA environment has none)
    cmd = [sys.executable, "-m", "benchmarks.bench_shapes", "--models", "tiny-gpt", "--tiny", "--device", "cpu",
           "--calls", "6", "--max-batch", "3", "--max-seq", "16", "--check-every", "2", "--pass2-repeats", "2",
           "--modes", "eager,kpt[bucketing]", "--kpt-codegen", "eager", "--timeout-per-mode", "240",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "bench_shapes.json").read_text())
    assert record["stream"]["sizes"] == [list(s) for s in bench_shapes.stream(6, 0, 3, 16)]
    assert record["commit"] and record["card"] == "cpu"
    rows = {r["mode"]: r for r in record["rows"]}
    assert list(rows) == ["eager", "kpt[bucketing]"]
    eager = rows["eager"]
    assert eager["status"] == "ok", eager["status"]
    assert eager["pass1_s"] > 0 and eager["max_rel_err"] in (0.0, None) and eager["peak_gib"] is None
    kpt = rows["kpt[bucketing]"]
    assert kpt["status"] == "ok", kpt["status"]
    assert kpt["max_rel_err"] < 1e-4 and kpt["checked_calls"] == 9  # calls 0, 2, 4 of pass 1 and twice pass 2
    assert len(kpt["pass2_runs_s"]) == 2 and kpt["pass2_s"] in kpt["pass2_runs_s"]
    assert kpt["graphs"] >= 1 and kpt["fell_back"] == [] and "bucketing" in kpt["kpt_passes"]
    # pad="captured": without CUDA graphs (the CPU) no call is padded, so no bucket is entered
    assert kpt["buckets_used"] == 0 and kpt["buckets_captured"] == 0, kpt
    table = (tmp_path / "bench_shapes.md").read_text()
    assert "| eager |" in table and "| kpt[bucketing] |" in table
    # pass 1 call by call: Dynamo compiles at the first three calls (sizes first seen, batch 1, then dynamic)
    calls = kpt["pass1_call_s"]
    assert len(calls) == 6 and sum(calls) <= kpt["pass1_s"] + 1e-3 and len(kpt["compile_s"]) == 3, kpt
    assert min(calls[:3]) > max(calls[3:]), calls
    assert f"- kpt[bucketing]: {kpt['pass1_call_s'].index(max(kpt['pass1_call_s']))} (" in table


def test_append_keeps_the_rows_of_an_earlier_run_of_the_same_stream(tmp_path, monkeypatch):
    def fake(args, mode, model):
        return {"model": model, "mode": mode, "status": "ok", "pass1_s": 2.0 if mode == "inductor" else 3.0,
                "pass2_s": 1.0, "process_s": 1.0, "ran_with": args.modes}

    monkeypatch.setattr(bench_shapes, "_spawn", fake)
    base = ["--device", "cpu", "--models", "gpt2", "--calls", "5", "--out", str(tmp_path)]
    assert bench_shapes.main(base + ["--modes", "kpt,inductor"]) == 0
    assert bench_shapes.main(base + ["--modes", "kpt[bucketing],kpt", "--append"]) == 0
    record = json.loads((tmp_path / "bench_shapes.json").read_text())
    assert [(r["mode"], r["ran_with"]) for r in record["rows"]] == [
        ("kpt", "kpt[bucketing],kpt"), ("inductor", "kpt,inductor"), ("kpt[bucketing]", "kpt[bucketing],kpt")]
    assert record["rows"][2]["pass1_vs_inductor"] == 1.5 and " ; " in record["command"]
    with pytest.raises(SystemExit, match="another stream"):
        bench_shapes.main(base[:-4] + ["--calls", "6", "--out", str(tmp_path), "--modes", "kpt", "--append"])


def test_runs_of_one_stream_merge_with_each_rows_commit(tmp_path):
    from benchmarks import merge_shapes

    base = {"stream": {"calls": 3}, "card": "c", "dtype": "bf16", "recompile_limit": 8}
    a = {**base, "commit": "aaa", "date": "d1", "command": "x", "rows": [
        {"model": "m", "mode": "inductor", "status": "ok", "pass1_s": 10.0, "pass2_s": 2.0},
        {"model": "m", "mode": "kpt", "status": "ok", "pass1_s": 8.0, "pass2_s": 1.0}]}
    b = {**base, "commit": "bbb", "date": "d2", "command": "y", "rows": [
        {"model": "m", "mode": "kpt", "status": "ok", "pass1_s": 5.0, "pass2_s": 0.5}]}
    merged = merge_shapes.merge([a, {**b, "stream": {"calls": 3, "pass2_repeats": 3}}])
    kpt = {r["commit"]: r for r in merged["rows"] if r["mode"] == "kpt"}  # both runs of kpt are shown
    assert kpt["bbb"]["pass1_vs_inductor"] == 0.5 and kpt["bbb"]["pass2_vs_inductor"] == 0.25
    assert kpt["aaa"]["pass1_vs_inductor"] == 0.8 and len(merged["rows"]) == 3
    with pytest.raises(ValueError, match="stream or card"):
        merge_shapes.merge([a, {**b, "card": "other"}])


def test_the_graphs_pool_is_read_from_the_capture_notes():
    from benchmarks._shapes_mode import pool_mib

    notes = [["bucket s0=4: captured (10.0 MiB more in the graphs' pool, 10.0 MiB in all)",
              "bucket s0=8: captured (22.5 MiB more in the graphs' pool, 32.5 MiB in all)"],
             ["not captured: too big"],
             ["bucket (one shape): captured (18.0 MiB more in the graphs' pool, 18.0 MiB in all)"]]
    assert pool_mib(notes) == 50.5
    assert pool_mib([["not captured: too big"]]) is None
