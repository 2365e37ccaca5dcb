"""The cost model on a real card: this card has its own calibration file, measured with today's kernels, and
the fusion passes decide from it (the reason names the card)."""

import pytest
import torch
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler import cost_model as cm
from kpt_compiler.target import cuda_target

pytestmark = pytest.mark.gpu


def test_this_card_has_its_own_calibration_measured_with_todays_kernels():
    target = cuda_target()
    cal = cm.CostModel(target).calibration
    assert cal is not None, f"no {cm.calibration_file(target.name, target.capability)} in {cm.CALIBRATION_DIR}"
    assert cal.card == target.card and cal.path.name == cm.calibration_file(target.name, target.capability)
    from kpt_compiler.kernels import gated_linear, linear_epilogue

    assert cal.table("gated_linear", torch.bfloat16)["source"] == cm.source_hash(gated_linear)
    assert cal.table("linear_epilogue", torch.bfloat16)["source"] == cm.source_hash(linear_epilogue)


def test_the_gated_mlp_is_decided_from_this_cards_file():
    """The zoo Llama's MLP at 8192 tokens (a calibrated shape): the pass asks, and the answer names the card."""
    x = torch.randn(8, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(2816, 1024, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(2))

    def mlp(x, wg, wu):
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)

    with torch.no_grad():
        out = torch.compile(mlp, backend="kernelpytorch")(x, wg, wu)
        torch.testing.assert_close(out, mlp(x, wg, wu), atol=2e-2, rtol=2e-2)
    rec = kpt_compiler.last_report().pass_record("fuse-gated-linear")
    decision = next(n for n in rec.notes if "gated_linear" in n)
    assert f"measured on {cuda_target().card}" in decision, decision
