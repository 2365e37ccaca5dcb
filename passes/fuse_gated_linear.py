"""fuse-gated-linear: Llama's gated MLP, both projections in one GEMM kernel.

Before (Dynamo's graph)::

    act(linear(x, Wg)) * linear(x, Wu)        # act: silu, gelu, gelu (tanh), relu; bias-free linears

After::

    gated_linear(x, Wg, Wu, act)              # kernels/gated_linear.py: x read once, no [M, 2N] tensor

Each rewrite asks the cost model (``_fusion_common.ask``), calibrated against Inductor's two cuBLAS GEMMs
and its fused activation-product kernel. Where no gradient flows the pass emits the kernel's forms without
autograd (the triton_op where Inductor compiles for CUDA). Member of the fusion group.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from ._fusion_common import RULE, activation, apply_rule, ask, emit, fused_op, gemm_baseline, needs_grad, \
    one_user, plain_linear, rows, val


@graph_pass("fuse-gated-linear", summary="act(x @ Wg^T) * (x @ Wu^T) -> one GEMM kernel reading x once", **RULE)
def fuse_gated_linear(gm: fx.GraphModule, ctx: PassContext) -> bool:
    return apply_rule(gm, ctx, _fuse)


def _match(node: fx.Node):
    """(activation name, gate linear, up linear, x) where the ``mul`` ``node`` is act(linear(x, Wg)) * linear(x, Wu)
    with weights of one shape, else None."""
    if ir.kind(node) != "mul":
        return None
    a, b = ir.arg(node, "input"), ir.arg(node, "other")
    for act, up in ((a, b), (b, a)):
        name = activation(act)
        if name is None or not one_user(act) or not plain_linear(ir.arg(act, "input")):
            continue
        gate = ir.arg(act, "input")
        x = ir.arg(gate, "input")
        if plain_linear(up, x) and val(ir.arg(gate, "weight")).shape == val(ir.arg(up, "weight")).shape:
            return name, gate, up, x
    return None


def _ask_args(name: str, gate: fx.Node, x: fx.Node) -> dict:
    """``ask``'s arguments bar ``how`` and the node for fusing the gated pair on ``x``."""
    N, K = val(ir.arg(gate, "weight")).shape
    M, dtype, device = rows(x) or 0, val(x).dtype, val(x).device
    from kpt_compiler.kernels import gated_linear as kernel

    def ours():
        t = [torch.randn(*s, device=device, dtype=dtype) for s in ((M, K), (N, K), (N, K))]
        return lambda: kernel.gated_linear(*t, name)

    return dict(x=x, kind="gated_linear", shapes={"K": K, "N": N, "act": name}, source=kernel, gemm_ns=[N, N],
                unfused_kernels=3, ours=ours, baseline_ms=gemm_baseline(device, M, K, [N, N], dtype, 3 * M * N * 2))


def gated_candidate(linear: fx.Node) -> dict | None:
    """``ask``'s arguments bar ``how`` for fusing the linear ``linear`` into a gated pair (as its gate or its
    up projection), or None where it is in none. Asked by sparsity-2-4, which runs first and weighs this rewrite
    against its own."""
    for user in linear.users:  # the up projection's user is the mul; the gate's, its activation
        muls = [user] + ([next(iter(user.users))] if activation(user) is not None and one_user(user) else [])
        for mul in muls:
            found = _match(mul)
            if found is not None and linear in (found[1], found[2]):
                return _ask_args(found[0], found[1], found[3])
    return None


def _fuse(gm, node, ctx, how):  # act(linear(x, Wg)) * linear(x, Wu) -> gated_linear(x, Wg, Wu, act)
    found = _match(node)
    if found is None:
        return False
    name, gate, up, x = found
    asked = _ask_args(name, gate, x)
    if not ask(ctx, how, node, **asked):
        return False
    kernel = asked["source"]  # kernels/gated_linear.py
    wg, wu = ir.arg(gate, "weight"), ir.arg(up, "weight")
    with gm.graph.inserting_before(node):
        new = emit(gm, fused_op(ctx, kernel, "gated_linear", needs_grad(node)), (x, wg, wu, name), like=node)
    node.replace_all_uses_with(new)
    ctx.count()
    return True
