"""The fp8 pass on the GPU: each recipe's numerics in bf16 on an fp8 card, a compiled training step through
Inductor, and what decide="auto" and "measure" say where no calibration exists."""

import copy

import pytest
import torch
import torch.nn as nn

import kpt_compiler
from kpt_compiler.lossy_guard import sqnr_db
from kpt_compiler.passes._fp8_recipes import RECIPES, fp8_linear
from kpt_compiler.passes.fp8 import fp8_linear_bias_after

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an fp8 GPU")]


# float32: cuBLAS's fp8 GEMM takes no bias with a float32 output, and the pass emits fp8_linear_bias_after
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_forward_and_backward(recipe, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(2048, 1024, device="cuda", dtype=dtype, generator=g) * 0.03).requires_grad_()
    b = torch.randn(2048, device="cuda", dtype=dtype, generator=g).requires_grad_()
    out = (fp8_linear if dtype == torch.bfloat16 else fp8_linear_bias_after)(x, w, b, recipe=recipe)
    grad = torch.randn_like(out)
    out.backward(grad)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    ref = torch.nn.functional.linear(xr, wr, br)
    ref.backward(grad.float())
    assert sqnr_db(out, ref) >= 28
    assert sqnr_db(x.grad, xr.grad) >= 22
    assert sqnr_db(w.grad, wr.grad) >= (35 if recipe == "rowwise_with_gw_hp" else 22)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(1024, 4096), nn.Linear(4096, 1024)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_compiled_training_step_through_inductor(recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP().cuda().bfloat16()
    ref_model = MLP().cuda()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(8, 256, 1024, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="kernelpytorch", options={"fp8": {"recipe": recipe, "decide": "always"}})
    out = compiled(x)
    out.float().square().mean().backward()
    rec = kpt_compiler.last_report().pass_record("fp8")
    assert rec.matches == 2 and rec.error_db is not None and rec.error_db >= 20, rec
    ref = ref_model(x.float())
    ref.square().mean().backward()
    assert sqnr_db(out, ref) >= 25
    assert sqnr_db(model.up.weight.grad, ref_model.up.weight.grad) >= 15


def test_auto_declines_without_a_calibration_and_measure_times_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KPT_CALIBRATION_DIR", str(tmp_path))  # no card's file here
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    layer = nn.Linear(4096, 4096, bias=False).cuda().bfloat16()
    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(layer, backend="kernelpytorch", options={"fp8": True})(x)
        rec = kpt_compiler.last_report().pass_record("fp8")
        assert rec.matches == 0 and any("no calibration" in n and "decide='measure'" in n for n in rec.notes), \
            rec.notes
        torch._dynamo.reset()
        torch.compile(layer, backend="kernelpytorch", options={"fp8": {"decide": "measure"}})(x)
        rec = kpt_compiler.last_report().pass_record("fp8")
        assert any("measured on" in n for n in rec.notes), rec.notes


def test_auto_reads_the_cards_fp8_table():
    # the committed calibration decides each layer as its nearest calibrated shape says
    from kpt_compiler.cost_model import load_calibration
    from kpt_compiler.target import detect_target

    cal = load_calibration(detect_target([torch.empty(1, device="cuda")]))
    # an inference layer whose weight is a parameter: the static-weight table decides (quantized once)
    table = "fp8_linear_tensorwise_static"
    if cal is None or cal.table(table, torch.bfloat16) is None:
        pytest.skip("no static-weight fp8 calibration for this card")
    layer = nn.Linear(4096, 14336, bias=False).cuda().bfloat16().requires_grad_(False)  # frozen: quantized once
    with torch.no_grad():
        for rows in (8192, 128):
            torch._dynamo.reset()
            torch.compile(layer, backend="kernelpytorch", options={"fp8": True})(
                torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16))
            rec = kpt_compiler.last_report().pass_record("fp8")
            point = min(cal.table(table, torch.bfloat16)["points"],
                        key=lambda p: abs(p["M"] - rows) + abs(p["N"] - 14336) + abs(p["K"] - 4096))
            assert rec.matches == (1 if point["speedup"] >= 1.03 else 0), (rec.notes, point)
            assert any("cost model" in n and table in n for n in rec.notes), rec.notes


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_inference_weights_quantized_once_follow_changes_under_inductor_and_cuda_graphs(recipe, mode):
    """Static weights through Inductor (and replayed CUDA graphs): the weight is a constant of the graph, an
    in-place change of the parameter is seen at the next call, and the output is fp8-accurate throughout."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP().cuda().bfloat16().eval()
    x = torch.randn(8, 256, 1024, device="cuda", dtype=torch.bfloat16)
    options = {"fp8": {"recipe": recipe, "decide": "always", "static_weights": True},
               **({"mode": mode} if mode != "default" else {})}
    compiled = torch.compile(model, backend="kernelpytorch", options=options)
    with torch.no_grad():
        for step in range(3):
            if step == 2:
                model.up.weight.mul_(-1)  # as load_state_dict or an optimizer would
            out = compiled(x).clone()
            ref = copy.deepcopy(model).float()(x.float())
            assert sqnr_db(out, ref) >= 22, (step, sqnr_db(out, ref))
    rec = kpt_compiler.last_report().pass_record("fp8")
    assert rec.stats["static_weights"] == 2 and all(v >= 25 for v in rec.layer_db.values()), rec


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_released_weights_free_gpu_memory_and_give_the_static_graphs_output(mode):
    """release_weights on a frozen bf16 model compiled through Inductor (and CUDA graphs): the bf16 weights'
    memory is returned, the recompiled graph reads the same e4m3 values and gives the same output."""
    import gc

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP().cuda().bfloat16().eval().requires_grad_(False)
    x = torch.randn(8, 256, 1024, device="cuda", dtype=torch.bfloat16)
    options = {"fp8": {"decide": "always"}, **({"mode": mode} if mode != "default" else {})}
    compiled = torch.compile(model, backend="kernelpytorch", options=options)
    with torch.no_grad():
        before = compiled(x).clone()
        compiled(x)
        gc.collect()
        allocated = torch.cuda.memory_allocated()
        done = kpt_compiler.release_weights(model)
        gc.collect()
        freed = allocated - torch.cuda.memory_allocated()
        assert done.count == 2 and done.freed_bytes == 2 * 1024 * 4096 * 2, done
        after = compiled(x).clone()
        compiled(x)
    rec = kpt_compiler.last_report().pass_record("fp8")
    assert rec.stats.get("released_weights") == 2, rec.stats
    assert freed >= done.freed_bytes, (freed, done)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
