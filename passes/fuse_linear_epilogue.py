"""fuse-linear-epilogue: a linear layer with what follows it fused into the GEMM's store.

Before (Dynamo's graph; any subset of bias, activation and residual, at least one)::

    act(linear(x, W, b)) + r                  # act: relu, gelu, gelu (tanh), silu

After::

    linear_epilogue(x, W, b, r, act)          # kernels/linear_epilogue.py: one kernel, one rounding

Each rewrite asks the cost model (``_fusion_common.ask``). With an activation it is weighed against
Inductor's cuBLAS GEMM and its fused pointwise kernel (calibration ``linear_epilogue``); without one against
the GEMM alone (``linear_epilogue_vs_gemm``), since cuBLAS adds a bias in its own epilogue and Inductor folds
a residual add into the kernel after it (the next norm). Member of the fusion group.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from ._fusion_common import RULE, activation, apply_rule, ask, emit, fused_op, gemm_baseline, needs_grad, \
    one_user, rows, same_tensor_shape, val


@graph_pass("fuse-linear-epilogue", summary="GEMM + bias / activation / residual add -> one GEMM kernel", **RULE)
def fuse_linear_epilogue(gm: fx.GraphModule, ctx: PassContext) -> bool:
    return apply_rule(gm, ctx, _fuse)


def _epilogue_of(node: fx.Node) -> tuple[fx.Node, str, fx.Node | None]:
    """(the last node of the epilogue, its activation, the residual) after the linear ``node``."""
    last, act, residual = node, "none", None
    if one_user(last) and activation(next(iter(last.users))) is not None:
        last = next(iter(last.users))
        act = activation(last)
    if one_user(last) and ir.kind(next(iter(last.users))) == "add":
        add = next(iter(last.users))
        other = ir.arg(add, "other") if ir.arg(add, "input") is last else ir.arg(add, "input")
        if add.kwargs.get("alpha", 1) == 1 and isinstance(other, fx.Node) and same_tensor_shape(other, add) \
                and same_tensor_shape(last, add):
            last, residual = add, other
    return last, act, residual


def fusion_candidate(node: fx.Node) -> tuple[fx.Node, fx.Node | None, dict] | None:
    """(the epilogue's last node, its residual, ``ask``'s arguments bar ``how``) for fusing the linear ``node``
    with what follows it, or None where there is nothing to fuse. Also asked by sparsity-2-4, which runs first
    and weighs this rewrite against its own."""
    if ir.kind(node) != "linear":
        return None
    x, w, bias = ir.arg(node, "input"), ir.arg(node, "weight"), ir.arg(node, "bias", None)
    last, act, residual = _epilogue_of(node)
    if bias is None and act == "none" and residual is None:
        return None
    if isinstance(bias, fx.Node) and val(bias).dtype != val(x).dtype:
        return None
    N, K = val(w).shape
    M, dtype, device = rows(x) or 0, val(x).dtype, val(x).device
    from kpt_compiler.kernels import linear_epilogue as kernel

    def ours():
        t = [torch.randn(*s, device=device, dtype=dtype) for s in ((M, K), (N, K), (N,), (M, N))]
        return lambda: kernel.linear_epilogue(t[0], t[1], t[2] if bias is not None else None,
                                              t[3] if residual is not None else None, act)

    shapes = {"K": K, "N": N, "act": act, "bias": bias is not None, "residual": residual is not None}
    epilogue_bytes = (2 + (residual is not None)) * M * N * 2
    return last, residual, dict(
        x=x, kind="linear_epilogue", shapes=shapes, source=kernel,
        table="linear_epilogue" if act != "none" else "linear_epilogue_vs_gemm", gemm_ns=[N],
        unfused_kernels=2 if act != "none" else 1, ours=ours,
        baseline_ms=gemm_baseline(device, M, K, [N], dtype, epilogue_bytes))


def _fuse(gm, node, ctx, how):  # act(linear(x, W, b)) + r -> linear_epilogue(x, W, b, r, act)
    found = fusion_candidate(node)
    if found is None:
        return False
    last, residual, asked = found
    if not ask(ctx, how, last, **asked):
        return False
    kernel = asked["source"]  # kernels/linear_epilogue.py
    x, w, bias = ir.arg(node, "input"), ir.arg(node, "weight"), ir.arg(node, "bias", None)
    act = asked["shapes"]["act"]
    with gm.graph.inserting_before(last):
        op = fused_op(ctx, kernel, "linear_epilogue", needs_grad(last))
        new = emit(gm, op, (x, w, bias, residual, act), like=last)
    last.replace_all_uses_with(new)
    ctx.count()
    return True
