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


def _fuse(gm, node, ctx, how):  # act(linear(x, Wg)) * linear(x, Wu) -> gated_linear(x, Wg, Wu, act)
    if ir.kind(node) != "mul":
        return False
    a, b = ir.arg(node, "input"), ir.arg(node, "other")
    for act, up in ((a, b), (b, a)):
        name = activation(act)
        if name is None or not one_user(act) or not plain_linear(ir.arg(act, "input")):
            continue
        gate = ir.arg(act, "input")
        x = ir.arg(gate, "input")
        if not plain_linear(up, x):
            continue
        wg, wu = ir.arg(gate, "weight"), ir.arg(up, "weight")
        if val(wg).shape != val(wu).shape:
            continue
        N, K = val(wg).shape
        M, dtype, device = rows(x) or 0, val(x).dtype, val(x).device
        from kpt_compiler.kernels import gated_linear as kernel

        def ours():
            t = [torch.randn(*s, device=device, dtype=dtype) for s in ((M, K), (N, K), (N, K))]
            return lambda: kernel.gated_linear(*t, name)

        if not ask(ctx, how, node, "gated_linear", x, {"K": K, "N": N, "act": name}, kernel, gemm_ns=[N, N],
                   unfused_kernels=3, ours=ours,
                   baseline_ms=gemm_baseline(device, M, K, [N, N], dtype, 3 * M * N * 2)):
            return False
        with gm.graph.inserting_before(node):
            new = emit(gm, fused_op(ctx, kernel, "gated_linear", needs_grad(node)), (x, wg, wu, name), like=node)
        node.replace_all_uses_with(new)
        ctx.count()
        return True
    return False
