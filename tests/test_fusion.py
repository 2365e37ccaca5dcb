"""The fusion group: each of its passes on a small graph (match counts; numerics and gradients against float64
eager), what each asks the cost model, and the near misses. On this CPU machine our kernels run in Triton's
interpreter. The cost model itself: test_cost_model.py."""

import copy
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.bench import first_tensor, relative_error
from kpt_compiler.registry import PassContext
from kpt_compiler.target import Target

TOL = 1e-5
ALWAYS = {"fusion": {"decide": "always"}}
FUSION = ("fold-conv-bn", "fuse-add-norm", "fuse-gated-linear", "fuse-linear-epilogue", "merge-parallel-linears")


def _compile(fn, options=None):
    return torch.compile(fn, backend="kernelpytorch", options={"codegen": "eager", **(ALWAYS if options is None else options)})


def _check(fn, *inputs, rule, matches=1, train=True, options=None):
    """Compile ``fn``, compare with float64 eager (output and gradients), return the record of pass ``rule``."""
    args = [t.detach().clone().requires_grad_(train and t.is_floating_point()) for t in inputs]
    out = _compile(fn, options)(*args)
    ref_args = [t.detach().double().requires_grad_(train and t.is_floating_point()) for t in inputs]
    ref = fn(*ref_args)
    assert relative_error(first_tensor(out), first_tensor(ref)) < TOL
    if train:
        first_tensor(out).square().sum().backward()
        first_tensor(ref).square().sum().backward()
        for t, r in zip(args, ref_args):
            if r.grad is not None:
                assert relative_error(t.grad, r.grad) < TOL
    rec = kpt_compiler.last_report().pass_record(rule)
    assert rec.matches == matches, rec.notes
    fired = [r.name for r in kpt_compiler.last_report().passes() if r.status == "applied" and r.name in FUSION]
    assert fired == [rule], fired  # no other rule took it
    return rec


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


M, K, N = 9, 24, 20  # odd sizes on purpose


@pytest.mark.parametrize("act", [F.silu, F.gelu, F.relu, lambda t: F.gelu(t, approximate="tanh")])
def test_gated_mlp(act):
    def mlp(x, wg, wu, wd):
        return F.linear(act(F.linear(x, wg)) * F.linear(x, wu), wd)

    rec = _check(mlp, _randn(2, M, K), _randn(N, K, seed=1), _randn(N, K, seed=2), _randn(K, N, seed=3),
                 rule="fuse-gated-linear")
    assert "gated_linear" in rec.notes[0]
    assert "gated_linear" in kpt_compiler.last_report().stages["pre_aot"].ops_after


@pytest.mark.parametrize("with_bias,act,residual", [(True, None, False), (True, F.gelu, False),
                                                    (False, F.relu, True), (True, F.silu, True)])
def test_gemm_epilogue(with_bias, act, residual):
    def layer(x, w, b, r):
        y = F.linear(x, w, b if with_bias else None)
        y = act(y) if act is not None else y
        return y + r if residual else y * 1.0

    rec = _check(layer, _randn(M, K), _randn(N, K, seed=1), _randn(N, seed=2), _randn(M, N, seed=3),
                 rule="fuse-linear-epilogue")
    assert "linear_epilogue" in rec.notes[0]


def test_training_graphs_are_left_alone_unless_always():
    """The cost model times forward passes only: where a gradient flows it declines, and says so."""
    from kpt_compiler.kernels import gated_linear
    from kpt_compiler.passes import _fusion_common as common

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(4096, 1024, requires_grad=True, device="meta")
    node = graph.call_function(torch.relu, (x,))
    node.meta["example_value"] = torch.empty(4096, 1024, requires_grad=True, device="meta")
    h100 = Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    ctx = PassContext(options=common.RuleOptions(), target=h100, stage="pre_aot", is_inference=False, mode="default")
    assert not common.ask(ctx, "auto", node, "gated_linear", x, {"K": 1024, "N": 2816}, gated_linear)
    assert not common.ask(ctx, "measure", node, "gated_linear", x, {"K": 1024, "N": 2816}, gated_linear)
    assert all("training graph" in m for m in ctx.notes) and ctx.stats["near_misses"] == 2, ctx.notes


def test_inference_graphs_call_the_ops_without_autograd():
    """Under no_grad the rules emit the *_inference ops (no Python autograd layer: less host time per call);
    with gradients they keep the custom ops, whose backward the training tests above check."""
    def mlp(x, wg, wu, wd, r):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd) + r

    inputs = (_randn(2, M, K), _randn(N, K, seed=1), _randn(N, K, seed=2), _randn(K, N, seed=3), _randn(2, M, K, seed=4))
    with torch.no_grad():
        out = _compile(mlp)(*inputs)
        ref = mlp(*(t.double() for t in inputs))
    assert relative_error(out, ref) < TOL
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert ops.get("gated_linear_inference") == 1 and ops.get("linear_epilogue_inference") == 1, ops
    assert "gated_linear" not in ops and "linear_epilogue" not in ops, ops
    _compile(mlp)(inputs[0], *(t.requires_grad_() for t in inputs[1:]))  # weights need gradients: autograd ops
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert ops.get("gated_linear") == 1 and ops.get("linear_epilogue") == 1, ops


def _hf_rms_norm(h, w, eps=1e-6):  # transformers' LlamaRMSNorm, as written there
    dtype = h.dtype
    hf = h.to(torch.float32)
    variance = hf.pow(2).mean(-1, keepdim=True)
    hf = hf * torch.rsqrt(variance + eps)
    return w * hf.to(dtype)


def test_residual_add_and_llama_rms_norm():
    def block(x, r, w, w2):
        h = x + r
        y = _hf_rms_norm(h, w)
        return F.linear(y, w2) + h  # h is used again: the fused op returns it

    x, r, w, w2 = _randn(2, M, K), _randn(2, M, K, seed=1), _randn(K, seed=2), _randn(K, K, seed=3)
    _check(block, x, r, w, w2, rule="fuse-add-norm", options={"fusion": {"decide": "always", "epilogue": False}})
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert "add_rms_norm" in ops and "rsqrt" not in ops, ops


def test_residual_add_and_layer_norm():
    def block(x, r, w, b):
        return F.layer_norm(x + r, (K,), w, b, 1e-5)

    _check(block, _randn(M, K), _randn(M, K, seed=1), _randn(K, seed=2), _randn(K, seed=3), rule="fuse-add-norm")


def test_qkv_projections_become_one_gemm():
    def qkv(x, wq, wk, wv):
        B, L, _ = x.shape
        q = F.linear(x, wq).view(B, L, -1, 4).transpose(1, 2)
        k = F.linear(x, wk).view(B, L, -1, 4).transpose(1, 2)
        v = F.linear(x, wv).view(B, L, -1, 2).transpose(1, 2)
        return (q @ k.transpose(-2, -1)) @ v

    rec = _check(qkv, _randn(2, M, K), _randn(16, K, seed=1), _randn(16, K, seed=2), _randn(8, K, seed=3),
                 rule="merge-parallel-linears", options={"attention": False, **ALWAYS})
    assert "'N': [16, 16, 8]" in rec.notes[0]
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert ops.get("merged_linear") == 1 and "linear" not in ops, ops


def test_horizontal_fusion_steps_aside_when_a_view_would_break():
    def two(x, w1, w2):  # merging the last two dims of a slice of the fused output is not a view
        return F.linear(x, w1).view(-1) + F.linear(x, w2).view(-1)

    q = _compile(two)(_randn(M, K), _randn(N, K, seed=1), _randn(N, K, seed=2))
    assert q.shape == (M * N,)
    assert kpt_compiler.last_report().pass_record("merge-parallel-linears").matches == 0


def test_conv_bn_folded_in_inference_only():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1, bias=False),
                          nn.BatchNorm2d(4))
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
    x = _randn(2, 3, 9, 11)
    model.eval()
    out = _compile(model)(x)
    assert relative_error(out, copy.deepcopy(model).double()(x.double())) < TOL
    rec = kpt_compiler.last_report().pass_record("fold-conv-bn")
    assert rec.matches == 2, rec.notes
    assert "batch_norm" not in kpt_compiler.last_report().stages["pre_aot"].ops_after
    torch._dynamo.reset()
    model.train()  # batch statistics: nothing to fold
    _compile(model)(x)
    assert kpt_compiler.last_report().pass_record("fold-conv-bn").matches == 0


def test_on_the_cpu_the_cost_model_declines_and_says_why():
    def mlp(x, wg, wu):
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)

    x, wg, wu = _randn(M, K), _randn(N, K, seed=1), _randn(N, K, seed=2)
    torch.testing.assert_close(_compile(mlp, {"fusion": True})(x, wg, wu), mlp(x, wg, wu))
    rec = kpt_compiler.last_report().pass_record("fuse-gated-linear")
    assert rec.matches == 0 and any("our kernels run their eager reference" in n for n in rec.notes), rec.notes


def test_each_rule_is_a_pass_of_its_own_and_the_group_switches_them_all():
    def mlp(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd, torch.ones(K))

    inputs = (_randn(M, K), _randn(N, K, seed=1), _randn(N, K, seed=2), _randn(K, N, seed=3))

    def statuses(options):
        torch._dynamo.reset()
        _compile(mlp, options)(*inputs)
        return {r.name: r.status for r in kpt_compiler.last_report().passes("pre_aot") if r.name in FUSION}

    assert list(statuses({})) == list(FUSION)  # on by default, each its own record, in the pipeline's order
    # pipeline=["fusion"] runs the members in the group's order: the default pipeline's
    members = kpt_compiler.registered_groups()["fusion"].members
    assert list(members) == [n for n in kpt_compiler.DEFAULT_PIPELINE if n in members]
    assert set(statuses({"fusion": False}).values()) == {"disabled"}
    assert set(statuses({"disable": ["fusion"]}).values()) == {"disabled"}
    one_off = statuses({"fuse_linear_epilogue": {"decide": "always"}, "disable": ["fuse-gated-linear"]})
    assert one_off.pop("fuse-gated-linear") == "disabled" and one_off["fuse-linear-epilogue"] == "applied", one_off
    assert "disabled" not in one_off.values()
    # the group's switches and options reach its members
    toggled = statuses({"fusion": {"decide": "always", "gated": False}})
    assert toggled["fuse-gated-linear"] == "disabled" and toggled["fuse-linear-epilogue"] == "applied", toggled
    assert kpt_compiler.last_report().options["fuse_linear_epilogue"] == {"decide": "always"}
    # a member's own setting wins over its group's, on/off and options alike
    opts = kpt_compiler.parse_options(None, {"fusion": {"decide": "measure"}, "fuse_gated_linear": {"decide": "always"}})
    assert opts.pass_options("fuse-gated-linear").decide == "always"
    assert opts.pass_options("fuse-linear-epilogue").decide == "measure"
    own = statuses({"fusion": False, "fuse_gated_linear": {"decide": "always"}})
    assert own["fuse-gated-linear"] == "applied" and own["fuse-linear-epilogue"] == "disabled", own
    text = kpt_compiler.describe_pipeline(kpt_compiler.parse_options(None, {"disable": ["fuse-gated-linear"]}))
    assert "-fuse-gated-linear(off), fuse-linear-epilogue, merge-parallel-linears" in text, text


def test_options_are_validated():
    with pytest.raises(Exception, match="decide"):
        _compile(lambda x: x + 1, {"fusion": {"decide": "sometimes"}})(torch.ones(2))
    with pytest.raises(kpt_compiler.OptionError, match=r"unknown option 'gatd' in options\['fusion'\].*'gated'"):
        kpt_compiler.parse_options(None, {"fusion": {"gatd": False}})
    with pytest.raises(kpt_compiler.OptionError, match=r"names pass 'fuse-gated-linear' twice \(through 'fusion'"):
        kpt_compiler.parse_options(None, {"pipeline": ["fusion", "fuse-gated-linear"]})
    with pytest.raises(kpt_compiler.OptionError, match=r"'decide' in options\['fuse_add_norm'\]"):
        kpt_compiler.parse_options(None, {"fuse_add_norm": {"decide": 1}})


def test_llama_block_training_matches_eager():
    pytest.importorskip("transformers")
    from kpt_compiler.models.zoo import build

    torch.manual_seed(0)
    model, make_inputs = build("llama", n_layer=1, hidden=32, heads=4, kv_heads=2)
    model.train()
    ref_model = copy.deepcopy(model).double()
    (ids,) = make_inputs(2, 6, "cpu")
    out = first_tensor(_compile(model)(ids))
    ref = first_tensor(ref_model(ids))
    assert relative_error(out, ref) < TOL
    out.square().mean().backward()
    ref.square().mean().backward()
    for p, pr in zip(model.parameters(), ref_model.parameters()):
        if pr.grad is not None:
            assert relative_error(p.grad, pr.grad) < 1e-4
    report = kpt_compiler.last_report()
    matches = {name: report.pass_record(name, "pre_aot").matches for name in FUSION}
    assert matches == {"fold-conv-bn": 0, "fuse-add-norm": 2, "fuse-gated-linear": 1, "fuse-linear-epilogue": 0,
                       "merge-parallel-linears": 1}, matches


@pytest.mark.parametrize("act, table", [(None, "linear_epilogue_vs_gemm"), (F.gelu, "linear_epilogue")])
def test_an_epilogue_without_activation_is_weighed_against_the_gemm_alone(monkeypatch, act, table):
    """Inductor folds a bias into cuBLAS and a residual add into the next kernel: with no activation the
    rule must ask with the table and host costs of the GEMM alone (where ours never wins)."""
    from kpt_compiler.cost_model import CostModel, Decision

    asked = []

    def record(self, how, c):
        asked.append(c)
        return Decision(False, "recorded")
    monkeypatch.setattr(CostModel, "decide", record)

    def layer(x, w, b, r):
        y = F.linear(x, w, b)
        return (act(y) if act else y) + r

    bf16 = [t.bfloat16() for t in (_randn(M, K), _randn(N, K, seed=1), _randn(N, seed=2), _randn(M, N, seed=3))]
    with torch.no_grad():
        _compile(layer, {"fusion": True})(*bf16)
    (c,) = [c for c in asked if c.kind == "linear_epilogue"]
    assert c.entry == table and c.unfused_kernels == (2 if act else 1), c


def test_inductor_on_cuda_gets_the_triton_op_form():
    """Where no gradient flows, Inductor compiling for CUDA gets the *_triton ops (it launches our kernels as its
    own); other code generators and devices the *_inference ops; training graphs the autograd ops. (That
    Inductor traces the triton_op form and launches the kernel itself is checked on the GPU: tests/gpu.)"""
    from kpt_compiler.kernels import gated_linear as gl
    from kpt_compiler.passes._fusion_common import fused_op

    def ctx(codegen, device):
        return types.SimpleNamespace(codegen=codegen, target=types.SimpleNamespace(device=device))
    form = "triton" if gl.HAVE_TRITON else "inference"  # torch 2.9's XLA environment has no triton
    assert fused_op(ctx("inductor", "cuda"), gl, "gated_linear", False) is \
        getattr(torch.ops.kpt, f"gated_linear_{form}").default
    assert fused_op(ctx("inductor", "cuda"), gl, "gated_linear", True) is gl.gated_linear
    for codegen, device in (("inductor", "cpu"), ("eager", "cuda"), ("xla", "xla")):
        assert fused_op(ctx(codegen, device), gl, "linear_epilogue", False) is \
            torch.ops.kpt.linear_epilogue_inference.default


def test_conv_bn_is_left_to_inductor():
    """Under Inductor the fold saves nothing (Inductor fuses the batch norm into the kernel after the
    convolution) and costs a pass over the weights per call: the rule steps aside and says why."""
    from kpt_compiler.passes import fold_conv_bn

    class ConvBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

        def forward(self, x):
            return F.batch_norm(F.conv2d(x, self.conv.weight), self.bn.running_mean, self.bn.running_var,
                                training=False)
    gm = torch.fx.symbolic_trace(ConvBN())
    bn = next(n for n in gm.graph.nodes if n.target is F.batch_norm)
    misses = []
    assert not fold_conv_bn._fold(gm, bn, types.SimpleNamespace(codegen="inductor", near_miss=misses.append), "auto")
    assert len(misses) == 1 and "left to Inductor" in misses[0], misses
    assert bn.users and bn.args[0].target is F.conv2d  # the graph is untouched (the fold itself: tests above)


def test_a_fused_op_that_will_run_its_reference_says_so():
    """float64 is no dtype of the GEMM kernels: decide='always' still rewrites, and the report says the op will
    run its eager reference (not our kernel); in float32 (the interpreter runs the kernel here) it says nothing."""
    def mlp(x, wg, wu):
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)

    def notes(dtype):
        torch._dynamo.reset()
        x, wg, wu = (t.to(dtype) for t in (_randn(M, K), _randn(N, K, seed=1), _randn(N, K, seed=2)))
        _compile(mlp)(x, wg, wu)
        rec = kpt_compiler.last_report().pass_record("fuse-gated-linear")
        assert rec.matches == 1, rec.notes
        return [n for n in rec.notes if "eager reference" in n]

    from kpt_compiler.kernels._gemm_common import GEMM_DTYPES
    from kpt_compiler.kernels._launch import HAVE_TRITON, kernel_runs

    (said,) = notes(torch.float64)
    assert ("the kernel takes float16, bfloat16, float32, not float64" if HAVE_TRITON else
            "triton is not installed") in said, said
    # float32: as the kernel itself dispatches here (torch 2.9's environment: triton 3.5, whose interpreter
    # cannot run the GEMM kernels, says so)
    runs = kernel_runs(torch.empty(1), GEMM_DTYPES, needs_3_6_interpreter=True)
    assert (notes(torch.float32) == []) == runs


def test_merging_linears_runs_no_kernel_of_ours_and_says_nothing_of_one(monkeypatch):
    """merge-parallel-linears emits plain torch (merged_linear): no note of a kernel falling back, even where our
    kernels would (the CPU outside the interpreter, as in a user's process)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def qkv(x, wq, wk):
        return F.linear(x, wq), F.linear(x, wk)

    _compile(qkv, {"attention": False, **ALWAYS})(_randn(M, K), _randn(N, K, seed=1), _randn(N, K, seed=2))
    rec = kpt_compiler.last_report().pass_record("merge-parallel-linears")
    assert rec.matches == 1 and not [n for n in rec.notes if "eager reference" in n], rec.notes


def test_inference_concatenates_parameters_once_and_again_when_one_changes():
    class Qkv(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(32, n, bias=False) for n in (32, 16, 16))

        def forward(self, x):
            return self.q(x).sum(-1) + self.k(x).sum(-1) * self.v(x).sum(-1)

    torch._dynamo.reset()
    model, x = Qkv().eval(), torch.randn(4, 32)
    fn = torch.compile(model, backend="kernelpytorch",
                       options={"codegen": "eager", "fusion": {"decide": "always"}, "attention": False})
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x))
        rec = kpt_compiler.last_report().pass_record("merge-parallel-linears")
        assert rec.stats.get("concatenated_once") == 1, rec
        model.k.weight.mul_(2)  # an in-place write: the next call concatenates again
        torch.testing.assert_close(fn(x), model(x))
