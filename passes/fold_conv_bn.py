"""fold-conv-bn: an inference batch norm folded into the convolution before it.

Before (Dynamo's graph; batch norm with running statistics, ``training=False``)::

    y = batch_norm(conv2d(x, W, b), mean, var, gamma, beta, training=False, eps=eps)

After::

    s = gamma / sqrt(var + eps)
    y = conv2d(x, W * s, (b - mean) * s + beta)

It removes a pass over the activations where the graph runs as written (``codegen="eager"``), and steps
aside under Inductor, which fuses an inference batch norm into the kernel after the convolution itself: the
folded weights, graph inputs recomputed on every call, would cost a pass over the weights instead
(ResNet-50 on the H100: 3.29 ms with the fold, 3.18 without, 2026-11-26-s5-suite-gpt2-bert-resnet.md).
``decide="always"`` folds there too. Member of the fusion group (``passes/_fusion_common.py``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from ._fusion_common import RULE, apply_rule, emit, one_user


def folded_weight(w, var, gamma, eps):
    scale = torch.rsqrt(var.float() + eps) * (gamma.float() if gamma is not None else 1.0)
    return (w.float() * scale.reshape(-1, *([1] * (w.dim() - 1)))).to(w.dtype)


def folded_bias(b, mean, var, gamma, beta, eps, like):
    scale = torch.rsqrt(var.float() + eps) * (gamma.float() if gamma is not None else 1.0)
    shift = ((b.float() if b is not None else 0.0) - mean.float()) * scale
    return (shift + (beta.float() if beta is not None else 0.0)).to(like.dtype)


@graph_pass("fold-conv-bn", summary="batch_norm(conv2d(x), running stats) -> conv2d with folded weights", **RULE)
def fold_conv_bn(gm: fx.GraphModule, ctx: PassContext) -> bool:
    return apply_rule(gm, ctx, _fold)


def _fold(gm, bn, ctx, how):  # batch_norm(conv2d(x, W, b), ..., training=False) -> conv2d(x, W', b')
    if ir.kind(bn) != "batch_norm" or ir.arg(bn, "training", False) is not False:
        return False
    conv = ir.arg(bn, "input")
    if ir.kind(conv) != "conv2d" or not one_user(conv):
        return False
    mean, var = ir.arg(bn, "running_mean"), ir.arg(bn, "running_var")
    gamma, beta, eps = ir.arg(bn, "weight", None), ir.arg(bn, "bias", None), ir.arg(bn, "eps", 1e-5)
    if not (isinstance(mean, fx.Node) and isinstance(var, fx.Node) and isinstance(eps, float)):
        return False
    if ctx.codegen == "inductor" and how != "always":
        ctx.near_miss(f"{bn.name}: left to Inductor (it fuses the batch norm into the kernel after {conv.name}; "
                      "the fold would recompute the weights on every call)")
        return False
    w, b = ir.arg(conv, "weight"), ir.arg(conv, "bias", None)
    with gm.graph.inserting_before(bn):
        w2 = emit(gm, folded_weight, (w, var, gamma, eps), like=conv)
        b2 = emit(gm, folded_bias, (b, mean, var, gamma, beta, eps, w), like=conv)
        rest = [ir.arg(conv, n, d) for n, d in (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))]
        new = emit(gm, torch.conv2d, (ir.arg(conv, "input"), w2, b2, *rest), like=bn)
    bn.replace_all_uses_with(new)
    ctx.count()
    ctx.note(f"{bn.name}: batch norm folded into {conv.name}")
    return True
