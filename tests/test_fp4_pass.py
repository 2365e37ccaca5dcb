"""The fp4 pass on the CPU, its kernel under Triton's interpreter (float16 models: the interpreter's bf16 dot is
unreliable): which linears it rewrites, each layer's error in dB of SQNR against eager, the guard backing layers
out, the weight copies following their parameters, and each refusal with its reason."""

import copy

import pytest
import torch
import torch.nn as nn

import kpt_compiler
import kpt_compiler.backend as backend_module
from kpt_compiler import OptionError
from kpt_compiler.kernels import _launch
from kpt_compiler.lossy_guard import sqnr_db
from kpt_compiler.target import Target
from models import up_down

if not _launch.kernel_runs(torch.empty(0), needs_3_6_interpreter=True):
    pytest.skip("the fp4 kernel runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, triton >= 3.6)",
                allow_module_level=True)

DB = 15.0  # the pass's default bound; NVFP4 keeps about 20 dB of these Gaussian weights


def _compile(model, fp4=None, **options):
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    return torch.compile(model, backend="kernelpytorch",
                         options={"codegen": "eager", "fusion": False, "fp4": fp4 or {"decide": "always"},
                                  **options})


def _model(dtype=torch.float16, **kw):
    return up_down(dtype, **kw)


def test_inference_linears_get_fp4_weights_and_each_layer_keeps_its_bound():
    model = _model()
    x = torch.randn(4, 7, 256, dtype=torch.float16)
    with torch.no_grad():
        out = _compile(model)(x)
        ref = model.float()(x.float())
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.status == "applied" and rec.matches == 2, rec.notes
    assert set(rec.layer_db) == {"linear", "linear_1"} and all(DB < v < 30 for v in rec.layer_db.values()), rec
    assert sqnr_db(out.float(), ref) > DB
    assert any("2 weights in nvfp4" in n and "less" in n for n in rec.notes), rec.notes
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert any("fp4_linear" in k for k in ops) and not any(k.endswith("linear") and "fp4" not in k for k in ops), ops


def test_mxfp4_too():
    model = _model()
    x = torch.randn(3, 256, dtype=torch.float16)
    with torch.no_grad():
        out = _compile(model, {"decide": "always", "format": "mxfp4"})(x)
        ref = model.float()(x.float())
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.matches == 2 and any("mxfp4" in n for n in rec.notes) and sqnr_db(out.float(), ref) > DB


def test_a_layer_under_the_bound_is_backed_out_and_runs_as_before():
    model = _model()
    x = torch.randn(5, 256, dtype=torch.float16)
    with torch.no_grad():
        out = _compile(model, {"decide": "always", "error_bound_db": 40.0})(x)
        ref = model(x)
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.status == "backed_out" and set(rec.backed_out) == {"linear", "linear_1"}, rec
    assert torch.equal(out, ref)


@pytest.mark.parametrize("case, reason", [
    ("float32", "a float32 layer: fp4 weights are for bfloat16 and float16 models"),
    ("odd_k", "K=264 input features are not a multiple of nvfp4's block of 16"),
    ("small", "is under min_features=256"),
    ("training", "a training graph"),
    ("skip", "matches skip pattern 'up'"),
])
def test_each_refusal_names_its_reason(case, reason):
    model = {"float32": lambda: _model(torch.float32), "odd_k": lambda: _model(d=264),
             "small": lambda: _model(h=128)}.get(case, _model)()
    fp4 = {"decide": "always", **({"skip": ["up"]} if case == "skip" else {})}
    x = torch.randn(2, model.up.in_features, dtype=model.up.weight.dtype)
    if case == "training":
        model.train()
        _compile(model, fp4)(x.requires_grad_()).sum().backward()
    else:
        with torch.no_grad():
            _compile(model, fp4)(x)
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert any(reason in n for n in rec.notes), rec.notes


def test_auto_declines_without_a_calibration_and_off_by_default():
    model = _model()
    x = torch.randn(2, 256, dtype=torch.float16)
    with torch.no_grad():
        _compile(model, True)(x)
        rec = kpt_compiler.last_report().pass_record("fp4")
        assert rec.matches == 0 and any("not faster here" in n for n in rec.notes), rec.notes
        torch._dynamo.reset()
        torch.compile(model, backend="kernelpytorch", options={"codegen": "eager"})(x)
    assert kpt_compiler.last_report().pass_record("fp4").status == "disabled"


def test_asked_for_where_the_kernel_cannot_run_is_an_error(monkeypatch):
    x = torch.randn(2, 256, dtype=torch.float16)
    monkeypatch.setattr(_launch, "INTERPRETED", False)
    with pytest.raises(OptionError, match="TRITON_INTERPRET=1"):
        _compile(_model())(x)
    monkeypatch.setattr(backend_module, "detect_target", lambda *a, **k: Target("xla", "xla"))
    with pytest.raises(OptionError, match="XLA"):
        _compile(_model())(x)
    # an A100: Triton converts E4M3 (NVFP4's scales; the kernels compile the conversion for both formats) from sm_89
    monkeypatch.setattr(backend_module, "detect_target", lambda *a, **k: Target("cuda", "NVIDIA A100", (8, 0)))
    with pytest.raises(OptionError, match=r"compute capability 8.9 \(Ada\) or newer.*NVIDIA A100 has 8.0"):
        _compile(_model())(x)


@pytest.mark.parametrize("options, message", [
    ({"format": "fp4"}, "'nvfp4' or 'mxfp4'"),
    ({"min_features": 16}, "at least 32"),
    ({"error_bound_db": 0}, "positive"),
])
def test_bad_options_say_what_would_be_right(options, message):
    with pytest.raises(OptionError, match=message):
        _compile(_model(), options)(torch.randn(2, 256, dtype=torch.float16))


def test_the_copy_follows_its_parameter_and_refresh_weights_covers_what_the_check_cannot_see():
    model = _model()
    compiled = _compile(model)
    x = torch.randn(2, 256, dtype=torch.float16)
    with torch.no_grad():
        compiled(x)
        model.down.weight.mul_(-1)  # an in-place write: the version moves, the copy is made again
        assert sqnr_db(compiled(x).float(), copy.deepcopy(model).float()(x.float())) > DB
        model.down.weight.data.mul_(-1)  # through .data: no version moves, the copy is not made again
        ref = copy.deepcopy(model).float()(x.float())
        assert sqnr_db(compiled(x).float(), ref) < 0
        assert kpt_compiler.refresh_weights(model) == 2
        assert sqnr_db(compiled(x).float(), ref) > DB


class _Writes(nn.Module):  # cases a review found rewritten wrongly (2026-11-27)
    def __init__(self, case):
        super().__init__()
        self.case, self.lin = case, nn.Linear(256, 256)

    def forward(self, x):
        if self.case == "out":
            o = torch.zeros(x.shape[0], 256, dtype=x.dtype)
            torch.addmm(self.lin.bias, x, self.lin.weight.t(), out=o)
            return o
        self.lin.weight.mul_(1.0)  # the graph writes into the weight before reading it
        return self.lin(x)


@pytest.mark.parametrize("case, reason", [("out", "writes into out="), ("mutated", "writes into its weight")])
def test_a_layer_whose_output_or_weight_the_graph_writes_stays(case, reason):
    torch.manual_seed(0)
    model = _Writes(case).half().eval()
    x = torch.randn(3, 256, dtype=torch.float16)
    with torch.no_grad():
        out = _compile(model)(x)
        assert torch.allclose(out, model(x))
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.matches == 0 and any(reason in n for n in rec.notes), rec.notes


def test_a_frozen_layer_in_a_training_graph_and_an_inference_tensor_weight_stay():
    model = _model()
    model.up.requires_grad_(False)  # frozen, in a graph that trains the next layer
    model.train()
    x = torch.randn(2, 256, dtype=torch.float16)
    _compile(model)(x).float().sum().backward()
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.matches == 0 and any("a training graph" in n for n in rec.notes), rec.notes
    with torch.inference_mode():
        built = _model()
    with torch.no_grad():
        _compile(built)(x)
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.matches == 0 and any("inference tensor" in n for n in rec.notes), rec.notes


def test_released_weights_free_their_copies_and_the_recompile_reads_the_fp4_codes():
    import gc
    import weakref

    from kpt_compiler.passes._fp4_release import Fp4WeightTensor

    model = _model()
    x = torch.randn(3, 256, dtype=torch.float16)
    compiled = _compile(model)
    with torch.no_grad():
        before = compiled(x)
    model.down.weight.requires_grad_(True)  # a trainable weight stays
    model.up.requires_grad_(False)
    old = weakref.ref(model.up.weight)
    done = kpt_compiler.release_weights(model)
    assert done.count == 1 and done.to == "fp4" and "requires grad" in done.skipped["down.weight"], done
    assert done.freed_bytes == 512 * 256 * 2 and done.kept_bytes == 512 * 128 + 512 * 16 + 4  # codes, E4M3, fp32
    gc.collect()
    assert old() is None  # nothing else held the float16 parameter: its storage is gone
    w = model.up.weight
    assert isinstance(w, Fp4WeightTensor) and w.shape == (512, 256) and w.dtype == torch.float16
    model.down.weight.requires_grad_(False)
    with torch.no_grad():
        eager = model.up(x)  # eager: every op sees the dequantized weight
        assert torch.equal(eager, torch.nn.functional.linear(x, w.dequantize(), model.up.bias))
        after = _compile(model)(x)  # a new parameter: compiled again, the released codes read directly
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.stats.get("released_weights") == 1 and rec.matches == 2, rec.notes
    assert any("released to nvfp4" in n and "kernel's own error" in n for n in rec.notes), rec.notes
    assert torch.allclose(after, before, atol=1e-3, rtol=1e-2)  # the same codes, the same kernel
    with pytest.raises(RuntimeError, match="released to fp4 by kpt_compiler.release_weights"):
        with torch.no_grad():
            model.up.weight.copy_(torch.zeros(512, 256, dtype=torch.float16))


# Tables taken out of a card's file because the kernel changed after their run and the card was not calibrated
# again: "auto" declines there and says how to time it. The test fails once such a table is back: take it out then.
UNCALIBRATED: dict = {  # (card, format) -> why its table is missing (s28's H200 MXFP4: back at 84d5802)
    ("NVIDIA H200", f): "s48 changed the CUDA form (async=2, M=1's ring) and got no H200 to measure it on"
    for f in ("nvfp4", "mxfp4")}


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_committed_tables_take_decoding_sizes_and_decline_prefill_sizes(monkeypatch, fmt, card):
    """The H200's tables (benchmarks/calibrate.py at a224583, 2026-11-29, committed in 84d5802): NVFP4 through the
    CUDA form at M=1-16, 1.96-2.06x bf16 cuBLAS at M=1-4 and 1.23x at M=16 at this shape (N x K 14336x4096);
    MXFP4 through the Triton forms, 1.79x at M=1 and 0.87x at M=16 here. At M=256 both are about 3x slower. The
    H100's NVFP4 table (s38 at 15f3e23, 2026-12-06): 2.63x at M=1 and 2.38x at M=16 at K=4096, N=14336, 0.33x at M=256;
    its MXFP4 table is not measured since 7193f79 (the call's timeout cut that table), so there "auto" declines.
    Another card has no table."""
    from kpt_compiler import cost_model as cm
    from kpt_compiler.kernels import fp4_linear
    from kpt_compiler.target import Target

    monkeypatch.delenv("KPT_CALIBRATION_DIR", raising=False)
    gpu = Target("cuda", card, (9, 0))
    cal = cm.CostModel(gpu).calibration

    def decide(M, target=gpu):
        return cm.CostModel(target).decide("auto", cm.Candidate(
            f"fp4_linear_{fmt}", M, {"K": 4096, "N": 14336}, torch.bfloat16, fp4_linear, mkn=(M, 4096, 14336)))

    if cal is None or cal.table(f"fp4_linear_{fmt}", torch.bfloat16) is None:
        assert card != "NVIDIA H200" or (card, fmt) in UNCALIBRATED, "the H200's fp4 tables are committed"
        first = decide(1)  # the H100's MXFP4 until it is calibrated: declined, and the report says how to time it
        assert not first.rewrite and "measure" in first.why, first.why
        return
    assert (card, fmt) not in UNCALIBRATED, f"{card}'s {fmt} table is back: take it out of UNCALIBRATED"
    assert decide(1).rewrite, decide(1).why
    late = decide(256)
    assert not late.rewrite and "M,K,N=256,4096,14336" in late.why, late.why
    if card == "NVIDIA H200":  # M=16: the CUDA form (NVFP4) pays, MXFP4's Triton forms do not
        assert decide(16).rewrite == (fmt == "nvfp4"), decide(16).why
    other = decide(1, Target("cuda", "NVIDIA A100-SXM4-80GB", (8, 0)))
    assert not other.rewrite and "measure" in other.why, other.why
