"""fuse-add-norm: a residual add and the norm after it -> one kernel returning both.

Before (Dynamo's graph)::

    h = a + r
    y = rms_norm(h)            # Llama's spelling (w * (hf * rsqrt(mean(hf^2) + eps)).to(dtype)) or F.rms_norm
    y = layer_norm(h)          # F.layer_norm / nn.LayerNorm
    ... h used on (the next residual)

After::

    y, h = add_rms_norm(a, r, w, eps)   /   add_layer_norm(a, r, w, b, eps)   (kernels/rms_norm.py, layer_norm.py)

Each rewrite asks the cost model (``_fusion_common.ask``). No card's calibration has a table for the norms:
on the H100 our kernels run at 0.92-1.08x Inductor's own fused norms (README), so under ``decide="auto"`` this
pass declines every candidate and says ``"measure"`` would time it: ours against the bytes Inductor at its best
moves (x and the residual read, h and y written) at the card's copy bandwidth. Member of the fusion group.
"""

from __future__ import annotations

import importlib
import operator

import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from ._fusion_common import RULE, apply_rule, ask, bytes_baseline, emit, one_user, rows, same_tensor_shape, val


@graph_pass("fuse-add-norm", summary="residual add + RMSNorm / LayerNorm -> one kernel returning both", **RULE)
def fuse_add_norm(gm: fx.GraphModule, ctx: PassContext) -> bool:
    return apply_rule(gm, ctx, _fuse)


def _rms_chain(out: fx.Node):
    """Llama's RMSNorm: w * (hf * rsqrt(mean(hf ** 2, -1, keepdim=True) + eps)).to(dtype), hf = h.float()
    -> (h, w, eps) or None."""
    if ir.kind(out) != "mul":
        return None
    for w, c in ((ir.arg(out, "input"), ir.arg(out, "other")), (ir.arg(out, "other"), ir.arg(out, "input"))):
        if ir.kind(c) != "cast" or not one_user(c) or not isinstance(w, fx.Node):
            continue
        m = ir.arg(c, "input")
        if ir.kind(m) != "mul" or not one_user(m):
            continue
        a, r = ir.arg(m, "input"), ir.arg(m, "other")
        hf, r = (a, r) if ir.kind(r) == "rsqrt" else (r, a)
        if ir.kind(r) != "rsqrt" or ir.kind(ir.arg(r, "input")) != "add":
            continue
        add = ir.arg(r, "input")
        mean, eps = ir.arg(add, "input"), ir.arg(add, "other")
        if ir.kind(mean) != "mean" or not isinstance(eps, float):
            continue
        sq = ir.arg(mean, "input")
        if ir.kind(sq) != "pow" or ir.arg(sq, "input") is not hf or ir.arg(sq, "exponent") != 2:
            continue
        dim, keep = ir.arg(mean, "dim", None), ir.arg(mean, "keepdim", False)
        if dim not in (-1, [-1], (-1,)) or keep is not True:
            continue
        h = ir.arg(hf, "input") if ir.kind(hf) == "cast" and ir.cast_dtype(hf) == torch.float32 else hf
        if c.args[1:] and ir.cast_dtype(c) != val(h).dtype or val(w).dim() != 1:
            continue
        return h, w, eps
    return None


def _norm_call(node: fx.Node):
    """(h, weight, eps, extra, kind) of a norm node, or None: F.rms_norm / F.layer_norm or Llama's chain."""
    k = ir.kind(node)
    if k not in ("rms_norm", "layer_norm"):
        found = _rms_chain(node)
        return None if found is None else (*found, {"cast_before_weight": True}, "rms_norm")
    h = ir.arg(node, "input")
    shape = ir.arg(node, "normalized_shape")
    if not isinstance(shape, (list, tuple)) or len(shape) != 1:
        return None
    w, eps = ir.arg(node, "weight", None), ir.arg(node, "eps", None)
    extra = {"cast_before_weight": False} if k == "rms_norm" else {"bias": ir.arg(node, "bias", None)}
    if k == "rms_norm" and eps is None:  # F.rms_norm's default: float32's eps for half-precision inputs
        eps = torch.finfo(torch.promote_types(val(h).dtype, torch.float32)).eps
    elif k == "layer_norm" and eps is None:
        eps = 1e-5
    return h, w, eps, extra, k


def _fuse(gm, node, ctx, how):  # norm(a + r) -> y, h = add_<norm>(a, r, ...)
    found = _norm_call(node)
    if found is None:
        return False
    h, w, eps, extra, k = found
    if ir.kind(h) != "add" or h.kwargs.get("alpha", 1) != 1 or not isinstance(eps, float):
        return False
    a, r = ir.arg(h, "input"), ir.arg(h, "other")
    if not (isinstance(a, fx.Node) and isinstance(r, fx.Node) and same_tensor_shape(a, r) and same_tensor_shape(a, h)):
        return False
    kind = "add_" + k
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    params = [p for p in (w, extra.get("bias")) if isinstance(p, fx.Node)]
    if any(order[p] > order[h] for p in params):
        return False  # the fused op goes where the add was: its weights must exist there
    kernel = importlib.import_module(f"kpt_compiler.kernels.{k}")
    M, N, dtype, device = rows(a) or 0, val(a).shape[-1], val(a).dtype, val(a).device

    def ours():
        x, r, wt = (torch.randn(*s, device=device, dtype=dtype) for s in ((M, N), (M, N), (N,)))
        args = (x, r, wt) if k == "rms_norm" else (x, r, wt, None)
        return lambda: getattr(kernel, kind)(*args)

    # Inductor at its best reads a and r and writes h and y once each
    if not ask(ctx, how, node, kind, a, {"N": N}, kernel, ours=ours,
               baseline_ms=bytes_baseline(device, 4 * M * N * val(a).element_size())):
        return False
    fn = getattr(kernel, kind)
    with gm.graph.inserting_before(h.next):
        if k == "rms_norm":
            both = emit(gm, fn, (a, r, w, eps), extra, like=node)
        else:
            both = emit(gm, fn, (a, r, w, extra["bias"], eps), like=node)
        y = emit(gm, operator.getitem, (both, 0), like=node)
        h_new = emit(gm, operator.getitem, (both, 1), like=h)
    node.replace_all_uses_with(y)
    h.replace_all_uses_with(h_new)
    ctx.count()
    return True
