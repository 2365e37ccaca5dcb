"""What the weight passes (fp8, fp4) read off a linear layer in a Dynamo graph: its operands and its module path."""

from __future__ import annotations

import re

import torch.fx as fx

from kpt_compiler import torch_ir as ir


def operands(node: fx.Node):
    """(x, weight, bias, whether the weight is stored [K, N]) of a linear or an addmm."""
    if ir.kind(node) == "addmm":
        return ir.arg(node, "mat1"), ir.arg(node, "mat2"), ir.arg(node, "input"), True
    return ir.arg(node, "input"), ir.arg(node, "weight"), ir.arg(node, "bias", None), False


def module_path(node: fx.Node) -> str | None:
    """The dotted path of the module that called this linear (``model.layers.0.mlp.up_proj``), or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    return re.sub(r"^L(\[[^\]]*\])+\.?", "", path) or None  # Dynamo's L['self'] / L['args'][0] prefix
