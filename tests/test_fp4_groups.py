"""The fp4 pass's groups (passes/_fp4_groups.py): layers sharing their input quantized as one weight and run as one
kernel, on the CPU under Triton's interpreter (float16: the interpreter's bf16 dot is unreliable). Each output
against eager in float32, the guard backing a group out as one, the group's copy following each member's
parameter, refresh_weights and release_weights reaching every member."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn

import kpt_compiler
from kpt_compiler.kernels import _launch
from kpt_compiler.lossy_guard import sqnr_db

if not _launch.kernel_runs(torch.empty(0), needs_3_6_interpreter=True):
    pytest.skip("the fp4 kernel runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, triton >= 3.6)",
                allow_module_level=True)

DB = 15.0


class QKV(nn.Module):
    """Three projections of one input (k without a bias, v narrower, as grouped-query attention has them) and an
    output layer that reads all three: a group of three and a layer alone."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(256, 512)
        self.k = nn.Linear(256, 256, bias=False)
        self.v = nn.Linear(256, 256)
        self.o = nn.Linear(1024, 256)

    def forward(self, x):
        return self.o(torch.cat([self.q(x), self.k(x).relu(), self.v(x)], -1))


def _model():
    torch.manual_seed(0)
    return QKV().half().eval()


def _compile(model, **fp4):
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    return torch.compile(model, backend="kernelpytorch",
                         options={"codegen": "eager", "fusion": False, "fp4": {"decide": "always", **fp4}})


def _fp4_ops():
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    return sum(n for k, n in ops.items() if "fp4_linear" in k)


def test_layers_on_one_input_run_as_one_fp4_weight_and_each_output_keeps_the_bound():
    model = _model()
    x = torch.randn(2, 5, 256, dtype=torch.float16)
    with torch.no_grad():
        out = _compile(model)(x)
        ref = copy.deepcopy(model).float()(x.float())
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.status == "applied" and rec.matches == 4 and rec.stats["merged_groups"] == 1, rec.notes
    assert _fp4_ops() == 2  # q, k and v in one; o alone
    group = [k for k in rec.layer_db if "+" in k]
    assert len(group) == 1 and len(group[0].split("+")) == 3 and all(DB < v < 30 for v in rec.layer_db.values())
    assert any("one kernel launch instead of 3" in n for n in rec.notes), rec.notes
    assert any("4 weights in nvfp4" in n for n in rec.notes), rec.notes
    assert sqnr_db(out.float(), ref) > DB
    with torch.no_grad():  # the split-back parts are the layers': k's ReLU and v's bias land on their own rows
        apart = _compile(model, merge_parallel_linears=False)(x)
    assert _fp4_ops() == 4 and kpt_compiler.last_report().pass_record("fp4").stats.get("merged_groups", 0) == 0
    assert sqnr_db(apart.float(), ref) > DB and sqnr_db(out.float(), apart.float()) > DB


def test_a_group_under_the_bound_is_backed_out_whole():
    model = _model()
    x = torch.randn(3, 256, dtype=torch.float16)
    with torch.no_grad():
        out = _compile(model, error_bound_db=35.0)(x)  # NVFP4 keeps about 20 dB: every rewrite is backed out
        eager = model(x)
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert _fp4_ops() == 0 and rec.status == "backed_out", rec.notes
    assert sorted(len(k.split("+")) for k in rec.backed_out) == [1, 3], rec.backed_out  # the group as one
    assert torch.equal(out, eager)


def test_the_group_follows_each_member_and_refresh_and_release_reach_every_member():
    from kpt_compiler.passes._fp4_release import Fp4WeightTensor

    model = _model()
    compiled = _compile(model)
    x = torch.randn(2, 256, dtype=torch.float16)
    with torch.no_grad():
        compiled(x)
        model.k.weight.mul_(-1)  # one member written in place: the whole group is made again
        assert sqnr_db(compiled(x).float(), copy.deepcopy(model).float()(x.float())) > DB
        model.v.weight.data.mul_(-1)  # through .data: no version moves, the check cannot see it
        ref = copy.deepcopy(model).float()(x.float())
        assert sqnr_db(compiled(x).float(), ref) < DB
        assert kpt_compiler.refresh_weights(model) == 4  # three members' handles and o's own copy
        before = compiled(x)
        assert sqnr_db(before.float(), ref) > DB
    model.requires_grad_(False)  # a weight that trains is not released
    old = weakref.ref(model.q.weight)
    done = kpt_compiler.release_weights(model)
    assert done.count == 4 and done.to == "fp4", done
    gc.collect()
    assert old() is None
    assert all(isinstance(m.weight, Fp4WeightTensor) for m in (model.q, model.k, model.v, model.o))
    with torch.no_grad():
        after = _compile(model)(x)  # each member reads its rows of the group's codes, with the group's scale
    rec = kpt_compiler.last_report().pass_record("fp4")
    assert rec.stats.get("released_weights") == 4 and rec.stats.get("merged_groups", 0) == 0, rec.notes
    assert torch.allclose(after, before, atol=1e-3, rtol=1e-2)
