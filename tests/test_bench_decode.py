"""benchmarks/bench_decode.py on the CPU: a tiny Llama decoded with a static cache, eager and kpt modes."""

import json
import math
import os

import pytest

pytest.importorskip("transformers")

from benchmarks import bench_decode  # noqa: E402


def _rows(out):
    with open(os.path.join(out, "bench_decode.json")) as f:
        record = json.load(f)
    assert os.path.isfile(os.path.join(out, "bench_decode.md"))
    return record, {r["mode"]: r for r in record["rows"]}


def test_tiny_decode_on_cpu(tmp_path):
    out = str(tmp_path)
    assert bench_decode.main(["--device", "cpu", "--tiny", "--modes",
                              "eager,kpt,kpt[no-cudagraphs],inductor-ro,kpt+deferred-stop", "--out", out]) == 0
    record, rows = _rows(out)
    assert list(rows) == ["eager", "kpt", "kpt[no-cudagraphs]", "inductor-ro", "kpt+deferred-stop"]
    assert record["reference"] == "kpt[no-cudagraphs]" and record["new_tokens"] == 8 and record["transformers"]
    assert rows["inductor-ro"]["status"] == "skipped: needs CUDA"
    # a mode's generate() with the stop check deferred: the mode's compile, CUDA only (it waits on an event)
    assert rows["kpt+deferred-stop"]["status"].startswith("skipped: the deferred stop check waits on a torch.Event")
    assert rows["kpt+deferred-stop"]["compile_kwargs"] == rows["kpt"]["compile_kwargs"]
    for mode in ("eager", "kpt", "kpt[no-cudagraphs]"):
        row = rows[mode]
        assert row["status"] == "ok", row["status"]
        # a timing, not asserted on: on the CPU's tiny model generate(8) - generate(1) is within the noise and
        # came out negative once in CI (2 cores); only that it is a figure from each repeat
        assert isinstance(row["ms_per_token"], float) and math.isfinite(row["ms_per_token"])
        assert len(row["per_token_ms"]) == record["repeats"] >= 1
        assert len(row["tokens"]) == 8
        assert row["vs_reference"] == "identical" and row["vs_eager"] == "identical"
        # the margins come from one more generate() (scored), which made the timed run's tokens
        assert row["scored_vs_timed"] == "identical" and len(row["margins"]) == 8
        assert all(m["gap"] >= 0 and 0 < m["ulp"] < 1e-3 for m in row["margins"]), row["margins"]  # float32 here
    assert rows["kpt"]["compile_kwargs"]["options"] == {"codegen": "eager"}
    graphs = rows["kpt"]["graphs"]
    assert len(graphs) == 2  # the prefill and the decode step
    assert all(g["cudagraphs"] == "skipped" and not g["captured"] for g in graphs)
    assert all(g["cudagraphs"] == "disabled" for g in rows["kpt[no-cudagraphs]"]["graphs"])


def test_a_failing_mode_is_a_row(tmp_path, monkeypatch):
    real = bench_decode.run_mode

    def run_mode(model, forward, ids, mode, *args):
        if mode == "kpt":
            raise RuntimeError("boom")
        return real(model, forward, ids, mode, *args)

    monkeypatch.setattr(bench_decode, "run_mode", run_mode)
    out = str(tmp_path)
    bench_decode.main(["--device", "cpu", "--tiny", "--modes", "kpt,eager", "--repeats", "2", "--new-tokens", "4",
                       "--reference", "eager", "--out", out])
    _, rows = _rows(out)
    assert rows["kpt"]["status"] == "error: RuntimeError: boom"
    assert rows["kpt"]["vs_eager"] == "-"
    assert rows["eager"]["status"] == "ok" and rows["eager"]["vs_reference"] == "identical"


def test_separate_runs_each_mode_in_its_own_process(tmp_path):
    out = str(tmp_path)
    assert bench_decode.main(["--device", "cpu", "--tiny", "--modes", "eager,kpt", "--repeats", "1",
                              "--new-tokens", "4", "--reference", "eager", "--separate", "--out", out]) == 0
    record, rows = _rows(out)
    assert record["separate_processes"] and record["attn_implementation"]
    assert rows["eager"]["status"] == "ok" and rows["kpt"]["status"] == "ok", rows
    assert rows["kpt"]["vs_reference"] == "identical" and len(rows["kpt"]["graphs"]) == 2


def test_generate_host_diag_times_generate_with_and_without_a_forward(tmp_path):
    """Both rows: generate with the tiny model's forward and with the stub (generate accepts its output)."""
    from benchmarks import diag_generate_host

    diag_generate_host.main(["--device", "cpu", "--new-tokens", "4", "--repeats", "1", "--out", str(tmp_path)])
    record = json.load(open(tmp_path / "diag_generate_host.json"))
    assert [r["forward"].split()[0] for r in record["rows"]] == ["tiny", "none"]
    # a difference of two timings (T(new) - T(1)): on a loaded machine one repeat of it may come out negative
    assert all(len(r["per_token_ms"]) == 1 and math.isfinite(r["per_token_ms"][0]) for r in record["rows"])
    assert "generate()'s own host time" in (tmp_path / "diag_generate_host.md").read_text()
    stub = record["rows"][1]  # its decode steps split around the forward: 3 of 4 tokens are decode steps
    assert stub["steps_split"] == 3 and stub["before_forward_ms"] > 0 and stub["after_forward_ms"] > 0
    assert "to the forward" in (tmp_path / "diag_generate_host.md").read_text()


def test_a_difference_at_a_tie_is_told_from_one_at_a_clear_margin():
    # bf16 logits of random weights tie exactly (the H200's decode, s23: two best logits 0 apart at steps 9 and 10),
    # where one rounding of any kernel decides the token
    steps = [{"gap": 0.5, "ulp": 0.03125}, {"gap": 0.0, "ulp": 0.03125}, {"gap": 0.03125, "ulp": 0.03125}]
    assert bench_decode.first_difference([1, 2], [1, 2], steps) == "identical"
    assert bench_decode.first_difference([9, 2, 3], [1, 2, 3], steps).startswith("differs at 0 (") \
        and "a tie" not in bench_decode.first_difference([9, 2, 3], [1, 2, 3], steps)
    assert bench_decode.first_difference([1, 9, 3], [1, 2, 3], steps).endswith(": a tie)")
    assert bench_decode.first_difference([1, 2, 9], [1, 2, 3], steps).endswith(": a tie)")  # within one step
    assert bench_decode.first_difference([1, 9], [1, 2, 3]) == "differs at 1"  # no margins: as before
