"""The pass manager's guard for lossy passes, with a deliberately lossy test pass (``test-lossy-round``:
tanh(x) -> tanh(round(x / step) * step)). The figures the guard reports are checked against the signal-to-noise
ratio computed here, in float64, from eager."""

import json
import math

import pytest
import torch

import kpt_compiler
from kpt_compiler.lossy_guard import sqnr_db
from kpt_compiler.registry import GraphPass

from kpt_test_passes import rounded_tanh


def two_outputs(a, b):
    return torch.tanh(a) * 2, torch.tanh(b) * 3


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 64, generator=g), 0.01 * torch.randn(64, 64, generator=g)  # b: far under the step


def _db(fn_out, ref_out):
    return min(sqnr_db(o.double(), r.double()) for o, r in zip(fn_out, ref_out))


def _run(fn, inputs, options):
    compiled = torch.compile(fn, backend="kernelpytorch", options={"codegen": "eager", **options})
    out = compiled(*inputs)
    return out, kpt_compiler.last_report().pass_record("test-lossy-round")


def test_sqnr_in_db():
    ref = torch.tensor([1.0, -1.0, 2.0, 0.0])
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(ref + 0.1, ref) == pytest.approx(10 * math.log10(6.0 / 0.04))
    assert sqnr_db(torch.full((4,), float("nan")), ref) == -math.inf
    inf = torch.tensor([math.inf, 1.0])
    assert sqnr_db(inf, inf) == math.inf and sqnr_db(torch.tensor([1.0, 1.0]), inf) == -math.inf


def test_a_rewrite_under_its_bound_is_backed_out_and_one_over_it_is_kept():
    a, b = _inputs()
    step = 0.02
    out, rec = _run(two_outputs, (a, b), {"test_lossy_round": {"step": step}})
    # expected, from eager: rounding a's tanh input costs ~43 dB; b (100x smaller than the step) rounds to 0
    kept_db = sqnr_db(rounded_tanh(a, step).double() * 2, torch.tanh(a.double()) * 2)
    lost_db = sqnr_db(rounded_tanh(b, step).double() * 3, torch.tanh(b.double()) * 3)
    assert kept_db > 30 > lost_db, (kept_db, lost_db)
    assert rec.status == "applied" and rec.matches == 1 and rec.error_bound_db == 30.0
    assert rec.error_db == pytest.approx(kept_db, abs=1e-6)
    [(label, value)] = rec.backed_out.items()
    assert value == pytest.approx(lost_db, abs=1e-6) and any(f"backed out {label}" in n for n in rec.notes)
    torch.testing.assert_close(out[0], rounded_tanh(a, step) * 2)  # kept
    torch.testing.assert_close(out[1], torch.tanh(b) * 3)  # backed out: exact again


def test_a_pass_that_names_no_rewrites_is_backed_out_whole():
    a, b = _inputs()
    out, rec = _run(two_outputs, (a, b), {"test_lossy_round": {"name_rewrites": False}})
    assert rec.status == "backed_out" and "names no rewrites" in rec.reason and "under the pass's bound" in rec.reason
    assert rec.error_db < 30
    for o, r in zip(out, two_outputs(a, b)):
        torch.testing.assert_close(o, r)
    assert "rounded_tanh" not in kpt_compiler.last_report().stages["pre_aot"].ops_after


def test_rewrites_over_the_bound_stay_with_their_figure():
    a, b = _inputs()
    out, rec = _run(two_outputs, (a, 100 * b), {"test_lossy_round": {"step": 1e-4}})
    assert rec.status == "applied" and rec.matches == 2 and not rec.backed_out
    assert rec.error_db == pytest.approx(_db(out, two_outputs(a, 100 * b)), abs=1e-6)
    assert rec.error_db > 30


def test_rewrites_each_over_the_bound_but_under_it_together_lose_the_worst():
    """Two roundings feeding one output: each alone is over the bound, their noise together is not, so the
    guard keeps the better one and backs out the other."""
    a, b = _inputs()
    b = b * 50  # on a's scale, so the two errors are alike

    def summed(a, b):
        return torch.tanh(a) + torch.tanh(b)

    step = 0.05
    ref = summed(a.double(), b.double())
    alone_a = sqnr_db(rounded_tanh(a, step).double() + torch.tanh(b.double()), ref)
    alone_b = sqnr_db(torch.tanh(a.double()) + rounded_tanh(b, step).double(), ref)
    both = sqnr_db(rounded_tanh(a, step).double() + rounded_tanh(b, step).double(), ref)
    bound = (min(alone_a, alone_b) + both) / 2
    assert both < bound < min(alone_a, alone_b)
    out, rec = _run(summed, (a, b), {"test_lossy_round": {"step": step, "error_bound_db": bound}})
    assert rec.status == "applied" and rec.matches == 1 and len(rec.backed_out) == 1, rec
    assert rec.error_db == pytest.approx(max(alone_a, alone_b), abs=1e-6)
    assert list(rec.backed_out.values())[0] == pytest.approx(min(alone_a, alone_b), abs=1e-6)
    assert any("backed out" in n for n in rec.notes)


def test_the_figure_is_in_the_report_and_the_dump(tmp_path):
    a, b = _inputs()
    _run(two_outputs, (a, b), {"test_lossy_round": True, "dump_dir": str(tmp_path)})
    report = kpt_compiler.last_report()
    assert "SQNR" in report.table() and "(bound 30 dB)" in report.table()
    summary = report.pass_record("test-lossy-round").summary()
    assert summary["error_bound_db"] == 30.0 and len(summary["backed_out"]) == 1
    saved = json.loads((tmp_path / "summary.json").read_text())
    [entry] = [p for s in saved["graphs"][0]["stages"].values() for p in s["passes"] if p["name"] == "test-lossy-round"]
    assert entry["error_db"] == round(report.pass_record("test-lossy-round").error_db, 2)
    page = (tmp_path / "index.html").read_text()
    assert "error (SQNR)" in page and "backed out:" in page and "(bound 30 dB)" in page


def test_lossy_passes_declare_their_bound_and_stay_off_by_default():
    def run(gm, ctx):
        return False

    with pytest.raises(ValueError, match="must state its error bound"):
        GraphPass("x-lossy", "s", "pre_aot", run, default=False, lossy=True)
    with pytest.raises(ValueError, match="off by default"):
        GraphPass("x-lossy", "s", "pre_aot", run, default=True, lossy=True, error_bound_db=20.0)


def test_runs_are_seeded_alike_so_dropout_is_no_error():
    """Dropout draws its masks from the generator: the unmodified and the rewritten graph must draw the same."""
    a, b = _inputs()

    def dropped(a):
        return torch.tanh(torch.nn.functional.dropout(a, 0.5, training=True))

    _out, rec = _run(dropped, (a,), {"test_lossy_round": {"step": 1e-4}})
    assert rec.status == "applied" and rec.error_db > 60, rec


def test_inputs_a_graph_mutates_are_cloned_for_the_guards_runs():
    a, _b = _inputs()
    x = a.clone()

    def bump(x):
        x.add_(1)
        return torch.tanh(x)

    out, rec = _run(bump, (x,), {"test_lossy_round": {"step": 1e-4}})
    torch.testing.assert_close(x, a + 1)  # the call mutated it once; the guard's runs left it alone
    assert rec.status == "applied" and rec.error_db > 60, rec
    torch.testing.assert_close(out, torch.tanh(a + 1), atol=1e-4, rtol=0)


def test_a_bound_of_zero_db_is_a_bound():
    a, b = _inputs()
    _out, rec = _run(two_outputs, (a, b), {"test_lossy_round": {"error_bound_db": 0.0}})
    assert rec.error_bound_db == 0.0


def test_a_graph_with_dynamic_sizes_is_measured_at_the_sizes_it_was_traced_with():
    # Dynamo passes a dynamic dimension's size as a SymInt placeholder; run eagerly, a .view by it took integers
    # only, so the guard could not run the graph and every lossy pass stepped aside (until session 32)
    def viewed(a):
        b, t, _ = a.shape
        return torch.tanh(a).view(b, t, 8, 8) * 2

    a = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(a, 0)
    torch._dynamo.mark_dynamic(a, 1)
    out, rec = _run(viewed, (a,), {"test_lossy_round": {"step": 0.02}})
    ref = torch.tanh(a.double()).view(2, 3, 8, 8) * 2
    assert rec.status == "applied" and rec.matches == 1, (rec.status, rec.reason)
    assert rec.error_db == pytest.approx(sqnr_db(rounded_tanh(a, 0.02).double().view(2, 3, 8, 8) * 2, ref), abs=1e-4)
    torch.testing.assert_close(out, rounded_tanh(a, 0.02).view(2, 3, 8, 8) * 2)
