"""What the weight passes (fp8, fp4) read off a linear layer in a Dynamo graph: its operands, its module path, and
why it is not a plain layer they can rewrite."""

from __future__ import annotations

import fnmatch
import re

import torch
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


def not_plain(node: fx.Node, skip: tuple[str, ...]) -> str | None:
    """Why a linear / addmm node is not a layer a weight pass may replace (it writes into ``out=``, an addmm that
    is not x @ W + b, no 2-D weight, a module path matching a ``skip`` pattern), or None."""
    if "out" in node.kwargs:
        return "it writes into out= (the rewrite returns a new tensor)"
    x, w, b, transposed = operands(node)
    if transposed and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 3
                       or not isinstance(b, fx.Node) or ir.example_value(b).dim() != 1):
        return "an addmm that is not x @ W + b (beta, alpha or a bias that is not a vector)"
    wv, xv = ir.example_value(w), ir.example_value(x)
    if not isinstance(wv, torch.Tensor) or wv.dim() != 2 or not isinstance(xv, torch.Tensor):
        return "not a linear layer with a 2-D weight"
    path = module_path(node)
    for pattern in skip:
        if path and fnmatch.fnmatchcase(path, pattern):
            return f"module {path} matches skip pattern {pattern!r}"
    return None


def measured_ms(fn) -> float:
    """A layer's device time under ``decide="measure"`` (the weight passes' compile-time timing)."""
    from kpt_compiler.bench import median_ms

    return median_ms(fn, "cuda", warmup_ms=25, rep_ms=100)
