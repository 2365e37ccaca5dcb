"""The sparsity-2-4 pass on the CPU with kernel="dense" (the pruned weight as a dense matrix: the reference the
issue asks the CPU tests to use; torch's sparse kernels are CUDA only, tests/gpu/test_sparsity_2_4_gpu.py):
which linears it rewrites, that the output is the dense masked reference's, each layer's error in dB of SQNR,
exact layers that were already 2:4, the guard backing layers out, the copies following their parameters, each
refusal with its reason, and asking for it where it cannot run."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kpt_compiler
import kpt_compiler.backend as backend_module
from kpt_compiler import OptionError
from kpt_compiler.lossy_guard import sqnr_db
from kpt_compiler.passes._sparse24 import is_2_4, prune_2_4
from kpt_compiler.target import Target
from models import up_down

DENSE = {"kernel": "dense"}


def _compile(model, sparsity=None, **options):
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    return torch.compile(model, backend="kernelpytorch",
                         options={"codegen": "eager", "fusion": False, "sparsity_2_4": sparsity or DENSE, **options})


def _model(dtype=torch.bfloat16, **kw):
    return up_down(dtype, **kw)


def _masked(model):
    """The dense masked reference: the model with each weight pruned to 2:4 by magnitude, run eagerly."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for lin in (ref.up, ref.down):
            lin.weight.copy_(prune_2_4(lin.weight))
    return ref


def _same(a, b) -> bool:
    """Equal up to bf16 rounding (the rewrite adds the bias after the product, F.linear inside it)."""
    return sqnr_db(a.float(), b.float()) > 40


def _record():
    return kpt_compiler.last_report().pass_record("sparsity-2-4")


def test_inference_linears_are_pruned_and_give_the_dense_masked_references_output():
    model = _model()
    x = torch.randn(4, 7, 256, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="their errors add up"):  # 4.6 dB at the output
        out = _compile(model)(x)
    with torch.no_grad():
        ref = _masked(model)(x)
        dense = model.float()(x.float())
    rec = _record()
    assert rec.status == "applied" and rec.matches == 2 and rec.stats.get("exact", 0) == 0, rec.notes
    assert _same(out, ref)  # the same pruned weights
    # pruning keeps about 7 dB of a layer's output with nn.Linear's uniform init (8.8 with Gaussian weights);
    # the guard's figure per layer (6.9-7.2 on torch 2.9 and 2.13)
    assert set(rec.layer_db) == {"linear", "linear_1"} and all(6 < v < 9 for v in rec.layer_db.values()), rec
    assert 3 < sqnr_db(out.float(), dense) < 11
    assert sum("pruned to 2:4 by magnitude, 50.0% zeros" in n for n in rec.notes) == 2, rec.notes
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert any("sparse24_linear" in k for k in ops) and not any(k.endswith(".linear") for k in ops), ops


def test_weights_already_2_4_are_taken_exactly_and_prune_false_takes_only_those():
    model = _model()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        _compile(model, {**DENSE, "prune": False})(x)
        rec = _record()
        assert rec.matches == 0 and sum("not 2:4 and prune=False" in n for n in rec.notes) == 2, rec.notes
        kpt_compiler.prune_2_4(model)
        assert is_2_4(model.up.weight) and is_2_4(model.down.weight)
        out = _compile(model, {**DENSE, "prune": False})(x)
        assert _same(out, model(x))
    rec = _record()
    assert rec.matches == 2 and rec.stats["exact"] == 2, rec.notes
    assert all(v == float("inf") or v > 60 for v in rec.layer_db.values()), rec.layer_db
    assert sum("already 2:4 (exact)" in n for n in rec.notes) == 2, rec.notes


def test_a_layer_under_the_bound_is_backed_out_and_runs_dense():
    model = _model()
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        out = _compile(model, {**DENSE, "error_bound_db": 20.0})(x)
        ref = model(x)
    rec = _record()
    assert rec.status == "backed_out" and set(rec.backed_out) == {"linear", "linear_1"}, rec
    assert torch.equal(out, ref)


@pytest.mark.parametrize("case, reason", [
    ("float32", "a float32 layer: 2:4 weights are for bfloat16 and float16 models"),
    ("odd_k", "a 512x258 weight: dense needs N a multiple of 1 and K of 4"),
    ("small", "is under min_features=256"),
    ("training", "a training graph"),
    ("skip", "matches skip pattern 'up'"),
])
def test_each_refusal_names_its_reason(case, reason):
    model = {"float32": lambda: _model(torch.float32), "odd_k": lambda: _model(d=258),
             "small": lambda: _model(h=128)}.get(case, _model)()
    sparsity = {**DENSE, **({"skip": ["up"]} if case == "skip" else {})}
    x = torch.randn(2, model.up.in_features, dtype=model.up.weight.dtype)
    if case == "training":
        model.train()
        _compile(model, sparsity)(x.requires_grad_()).float().sum().backward()
    else:
        with torch.no_grad():
            _compile(model, sparsity)(x)
    rec = _record()
    assert any(reason in n for n in rec.notes), rec.notes


def test_compress_names_the_kernels_multiples_and_its_device():
    from kpt_compiler.kernels import sparse24_linear as kernel

    w = prune_2_4(torch.randn(64, 264, dtype=torch.bfloat16))  # K=264: a multiple of 4 and 8, not 16 or 64
    for backend, multiple in (("cusparselt", 16), ("cutlass", 64)):
        with pytest.raises(ValueError, match=f"{backend} needs N a multiple of .* and K of {multiple}"):
            kernel.compress(w, backend)
    with pytest.raises(ValueError, match="CUDA only"):
        kernel.compress(w[:, :256], "cusparselt")
    with pytest.raises(ValueError, match="one of cusparselt, cutlass, dense"):
        kernel.compress(w, "sparse")


def test_the_copy_follows_its_parameter_and_refresh_weights_covers_what_the_check_cannot_see():
    model = _model()
    compiled = _compile(model)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled(x)
        model.down.weight.mul_(-1)  # an in-place write: the version moves, the copy is made again
        assert _same(compiled(x), _masked(model)(x))
        model.down.weight.data.mul_(-1)  # through .data: no version moves, the copy is not made again
        assert _same(compiled(x), -_masked(model)(x))
        assert kpt_compiler.refresh_weights(model) == 2
        assert _same(compiled(x), _masked(model)(x))


def test_a_weight_taken_exactly_that_stops_being_2_4_is_pruned_with_a_warning():
    model = _model()
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        kpt_compiler.prune_2_4(model)
        compiled = _compile(model, {**DENSE, "prune": False})
        assert _same(compiled(x), model(x))
        model.up.weight.add_(0.01)  # every position written: the pattern is gone
        with pytest.warns(RuntimeWarning, match="no longer 2:4 after a write"):
            out = compiled(x)
    assert _same(out, _masked(model)(x))


def test_a_replaced_parameter_takes_its_copy_over_for_refresh_weights():
    model = _model()
    compiled = _compile(model)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled(x)
        model.down.weight = nn.Parameter(-model.down.weight.detach().clone())  # a new object, same shape
        assert _same(compiled(x), _masked(model)(x))  # the check before the call saw it
        model.down.weight.data.mul_(-1)  # then a write the check cannot see
        assert kpt_compiler.refresh_weights(model) == 2
        assert _same(compiled(x), _masked(model)(x))


def test_asked_for_where_the_sparse_kernels_cannot_run_is_an_error(monkeypatch):
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with pytest.raises(OptionError, match="CUDA only.*kernel='dense'"):
        _compile(_model(), True)(x)
    monkeypatch.setattr(backend_module, "detect_target", lambda *a, **k: Target("xla", "xla"))
    with pytest.raises(OptionError, match="XLA"):
        _compile(_model())(x)
    monkeypatch.setattr(backend_module, "detect_target", lambda *a, **k: Target("cuda", "Tesla V100", (7, 0)))
    with pytest.raises(OptionError, match="no sparse tensor cores"):
        _compile(_model(), True)(x)


def _ctx(target, cuda_graphs):
    from kpt_compiler.cost_model import CostModel
    from kpt_compiler.passes import sparsity_2_4 as pass_module
    from kpt_compiler.registry import PassContext

    return PassContext(options=pass_module.Sparse24Options(), target=target, stage="pre_aot", is_inference=True,
                       mode="default", codegen="inductor", cost_model=CostModel(target), cuda_graphs=cuda_graphs)


def test_off_by_default_and_auto_declines_on_a_card_without_a_table():
    from kpt_compiler.passes import sparsity_2_4 as pass_module

    model = _model()
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, backend="kernelpytorch", options={"codegen": "eager"})(x)
    assert _record().status == "disabled"
    ctx = _ctx(Target("cuda", "Some Future GPU", (12, 0)), cuda_graphs=True)
    assert not pass_module._decide(ctx, "up", 8192, 4096, 14336, torch.bfloat16, "cuda", "cusparselt")
    assert any("not faster here" in n and "measure" in n for n in ctx.notes), ctx.notes


def test_auto_takes_the_h100s_large_layers_only_where_a_cuda_graph_hides_the_host_cost(monkeypatch):
    """The H100's sparse24_linear table says 1.4x at M=8192 (CUDA-graph replays); issued one by one, torch's
    cuSPARSELt call costs the host 0.5 ms, so without graphs the pass declines and says how to get them."""
    from kpt_compiler.passes import sparsity_2_4 as pass_module

    monkeypatch.delenv("KPT_CALIBRATION_DIR", raising=False)
    h100 = Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    graphs = _ctx(h100, cuda_graphs=True)
    if graphs.cost_model.calibration is None or graphs.cost_model.calibration.table(
            "sparse24_linear", torch.bfloat16) is None:
        pytest.skip("no H100 sparse24_linear table committed")
    assert pass_module._decide(graphs, "up", 8192, 4096, 14336, torch.bfloat16, "cuda", "cusparselt"), graphs.notes
    assert not pass_module._decide(graphs, "o", 16, 4096, 4096, torch.bfloat16, "cuda", "cusparselt")  # 0.5x
    plain = _ctx(h100, cuda_graphs=False)
    assert not pass_module._decide(plain, "up", 8192, 4096, 14336, torch.bfloat16, "cuda", "cusparselt",
                                   "no CUDA graphs asked for")
    assert any("without CUDA graphs (no CUDA graphs asked for)" in n and "reduce-overhead" in n
               for n in plain.notes), plain.notes


def test_a_graph_the_cudagraphs_pass_would_refuse_is_not_sure_to_be_captured():
    from kpt_compiler.passes import sparsity_2_4 as pass_module

    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_model(), backend=capture)(torch.randn(2, 256, dtype=torch.bfloat16))
    h100 = Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    assert pass_module._captured(seen[0], _ctx(h100, cuda_graphs=False)) == "no CUDA graphs asked for"
    why = pass_module._captured(seen[0], _ctx(h100, cuda_graphs=True))
    assert why and "is on cpu, not on the GPU" in why, why  # these inputs live on the CPU


@pytest.mark.parametrize("options, mode, expected", [
    ({}, "default", False), ({"cudagraphs": {"decide": "always"}}, "default", True),
    ({}, "reduce-overhead", True), ({"cudagraphs": False}, "default", False)])
def test_the_pass_manager_says_when_the_graph_is_sure_to_be_captured(options, mode, expected):
    from kpt_compiler.options import parse_options
    from kpt_compiler.pass_manager import PassManager

    opts = parse_options(mode if mode != "default" else None, options)
    pm = PassManager(opts, Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0)), report=None)
    assert pm._cuda_graphs() is expected
    assert PassManager(opts, Target("cpu", "cpu"), report=None)._cuda_graphs() is False


@pytest.mark.parametrize("options, message", [
    ({"kernel": "sparse"}, "must be 'auto' or 'cusparselt' or 'cutlass' or 'dense'"),
    ({"min_features": 8}, "at least 16"),
    ({"error_bound_db": 0}, "positive"),
    ({"skip": "up"}, "must be a list of str"),
])
def test_bad_options_say_what_would_be_right(options, message):
    with pytest.raises(OptionError, match=message):
        _compile(_model(), {**DENSE, **options})(torch.randn(2, 256, dtype=torch.bfloat16))


def test_the_op_counts_a_dense_gemms_flops_for_the_cost_estimates():
    from torch.utils.flop_counter import FlopCounterMode

    from kpt_compiler.kernels import sparse24_linear as kernel

    w = kernel.compress(prune_2_4(torch.randn(64, 128)), "dense")
    with FlopCounterMode(display=False) as counter:
        torch.ops.kpt.sparse24_linear(torch.randn(3, 5, 128), *kernel.op_args(w))
    assert counter.get_total_flops() == 2 * 15 * 128 * 64


class _Block(nn.Module):
    """q, k and v on one input, bias-free (merge-parallel-linears would merge them), an MLP up with bias and GELU
    (fuse-linear-epilogue), a gated pair (fuse-gated-linear), an output projection with a residual add and no
    activation (fuse-linear-epilogue, against a plain GEMM) and a bias-free layer that nothing would take."""

    def __init__(self, d=256):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))  # a bias would be an epilogue
        self.up, self.out = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.gate, self.up2, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(d, d)

    def forward(self, x):
        qkv = torch.stack([self.q(x), self.k(x), self.v(x)]).sum(0)  # no add on a projection: not a residual
        h = qkv * self.out(F.gelu(self.up(x)))  # a product: no epilogue for out
        g = F.silu(self.gate(h)) * self.up2(h)
        return self.o(g) + h


def _graph_of(model, x):
    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(x)
    return seen[0]


@pytest.mark.parametrize("merge_speedup, qkv_taken, mode", [(1.5, False, "reduce-overhead"),
                                                            (1.1, True, "reduce-overhead"),
                                                            (1.5, False, "default")])
def test_a_layer_the_fusion_group_would_fuse_or_merge_is_weighed_against_that(tmp_path, monkeypatch, merge_speedup,
                                                                              qkv_taken, mode):
    """The fusion group runs after this pass and takes what this pass leaves dense: under "auto" a 2:4 layer must
    beat what it would run (issue 19: BERT and ViT ran 0.98x and 0.94x on the H100 while each layer paid against
    a plain GEMM). A fake H100 file: 2:4 pays 1.3x at every layer, the GELU epilogue 1.2x, the gated pair 1.25x,
    the bias-and-residual epilogue 1.1x over a plain GEMM, the q/k/v merge ``merge_speedup``. Mode "default" with
    CUDA graphs asked by the cudagraphs pass: the rivals are still weighed in device time, not host time."""
    import json

    from kpt_compiler import cost_model as cm
    from kpt_compiler.kernels import gated_linear, linear_epilogue, sparse24_linear
    from kpt_compiler.options import parse_options
    from kpt_compiler.passes import merge_parallel_linears, sparsity_2_4 as pass_module
    from kpt_compiler.pass_manager import PassManager
    from kpt_compiler.registry import PassContext

    M, d = 64, 256
    h100 = Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    point = lambda n, s: [{"M": M, "K": d, "N": n, "speedup": s, "run": 0}]  # noqa: E731
    tables = {"sparse24_linear": (sparse24_linear, point(d, 1.3)), "linear_epilogue": (linear_epilogue, point(d, 1.2)),
              "linear_epilogue_vs_gemm": (linear_epilogue, point(d, 1.1)),
              "gated_linear": (gated_linear, point(d, 1.25)),
              "horizontal": (merge_parallel_linears.merged_linear, point(3 * d, merge_speedup))}
    (tmp_path / cm.calibration_file(h100.name, h100.capability)).write_text(json.dumps({
        "device": {"name": h100.name, "capability": [9, 0]},
        "runs": [{"command": "python -m benchmarks.calibrate", "date": "2026-11-28", "commit": "abc1234"}],
        "ceilings": {"tflops": 700.0, "copy_tbps": 3.0, "kernel_floor_us": 3.0, "run": 0},
        "device_time": {k: {"bfloat16": {"source": cm.source_hash(src), "points": p}}
                        for k, (src, p) in tables.items()},
        "host_us": {}}))
    monkeypatch.setenv("KPT_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path / "decisions"))

    gm = _graph_of(_Block(d).to(torch.bfloat16).eval(), torch.randn(M, d, dtype=torch.bfloat16))
    layers = {label.split("(")[-1].rstrip(")"): node for node, label in pass_module.linear_layers(gm)}  # "linear (q)"
    assert set(layers) >= {"q", "k", "v", "up", "out", "gate", "up2", "o"}, layers
    asked = {"cudagraphs": {"decide": "always"}} if mode == "default" else {}
    fusion_on = PassManager(parse_options(mode, asked), h100, report=None)

    def decide(name, pm):
        ctx = PassContext(options=pass_module.Sparse24Options(), target=h100, stage="pre_aot", is_inference=True,
                          mode=mode, codegen="inductor", cost_model=cm.CostModel(h100, mode),
                          cuda_graphs=True, other_pass=pm.options_if_runs)
        taken = pass_module._decide(ctx, name, M, d, d, torch.bfloat16, "cuda", "cusparselt", None, layers[name])
        return taken, " ".join(ctx.notes)

    taken, notes = decide("q", fusion_on)
    assert taken is qkv_taken and "merge-parallel-linears would take it" in notes, notes
    assert ("beats the dense alternative" in notes) is qkv_taken
    # G = 3.1 us (the kernel floor, at this size), E = 3.0: fused (G + E)/1.2 = 5.1 us against G/1.3 + E = 5.4
    taken, notes = decide("up", fusion_on)
    assert not taken and "fuse-linear-epilogue would take it" in notes and "under the 1.03x margin" in notes, notes
    # a gated pair: (2G + E)/1.25 = 7.4 us against 2G/1.3 + E = 7.8
    for name in ("gate", "up2"):
        taken, notes = decide(name, fusion_on)
        assert not taken and "fuse-gated-linear would take it" in notes and "0.95x" in notes, notes
    # bias and residual, no activation: Inductor adds them in its GEMM or the next kernel either way: 1.3 / 1.1
    taken, notes = decide("o", fusion_on)
    assert taken and "fuse-linear-epilogue would take it" in notes and "(1.18x)" in notes, notes
    taken, notes = decide("out", fusion_on)  # nothing to fuse or merge: the plain GEMM's 1.3x decides
    assert taken and "would take it" not in notes, notes
    # with the fusion group off nothing would take them after this pass: 2:4 against the plain GEMM
    fusion_off = PassManager(parse_options(mode, {**asked, "fusion": False}), h100, report=None)
    assert fusion_off.options_if_runs("merge-parallel-linears") is None
    assert all(decide(name, fusion_off)[0] for name in ("q", "up", "gate"))
