"""What the weight passes (fp8, fp4, sparsity-2-4) read off a linear layer in a Dynamo graph: its operands, its
module path, why it is not a plain layer they can rewrite, and the checks and option rules they share."""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable

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


def linear_layers(gm: fx.GraphModule):
    """Each linear / addmm node of ``gm`` (a list taken first: the caller may replace them) with its label for the
    report: ``linear_3 (model.layers.0.mlp.up_proj)``."""
    for node in list(gm.graph.nodes):
        if ir.kind(node) in ("linear", "addmm"):
            path = module_path(node)
            yield node, f"{node.name} ({path})" if path else node.name


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


def decide_layer(ctx, label: str, kind: str, mkn: tuple[int, int, int], dtype, device, source,
                 ours: Callable[[torch.Tensor, torch.Tensor], Callable[[], Any]]):
    """A weight pass's answer for one layer (a cost_model.Decision: true when it pays): "always" takes it; "auto"
    asks the card's calibration table ``kind`` (measured with kernel ``source``); "measure" times ``ours(x, w)``
    (a call on random x [M, K] and w [N, K], made only then) against the 16-bit ``F.linear`` on the device. The
    answer is a note or a near miss."""
    import torch.nn.functional as F

    from kpt_compiler.bench import median_ms
    from kpt_compiler.cost_model import Candidate, CostModel, Decision

    how = ctx.decide
    if how == "always":
        return Decision(True, "decide='always'")
    M, K, N = mkn
    timed = {}
    if how == "measure":
        x, w = torch.randn(M, K, device=device, dtype=dtype), torch.randn(N, K, device=device, dtype=dtype)
        timed = {"ours": ours(x, w),
                 "baseline_ms": lambda: median_ms(lambda: F.linear(x, w), "cuda", warmup_ms=25, rep_ms=100)}
    candidate = Candidate(kind, M, {"K": K, "N": N}, dtype, source, mkn=mkn, **timed)
    d = (ctx.cost_model or CostModel(ctx.target, ctx.mode, ctx.codegen)).decide(how, candidate)
    if d.rewrite:
        ctx.note(f"{label}: {kind} {M}x{K}x{N} pays ({d.why})")
    else:
        ctx.near_miss(f"{label}: {kind} {M}x{K}x{N} not faster here ({d.why})")
    return d


def check_options(options, floor: int, floor_why: str = "") -> None:
    """The weight passes' shared option checks: ``min_features`` at least ``floor``, ``skip`` a list of patterns,
    a positive ``error_bound_db`` (ValueError, which the options parser reports with the pass's key)."""
    if options.min_features < floor:
        raise ValueError(f"min_features must be at least {floor}{floor_why}, got {options.min_features}")
    if isinstance(options.skip, str) or not all(isinstance(p, str) for p in options.skip):
        raise ValueError(f"skip must be a list of module-path patterns (strings), got {options.skip!r}")
    if not options.error_bound_db > 0:
        raise ValueError(f"error_bound_db must be positive (dB of SQNR), got {options.error_bound_db}")


def not_16bit_inference(node: fx.Node, ctx, weights: str) -> tuple[str | None, tuple[int, int] | None]:
    """(why ``node`` is not a 16-bit inference linear a weight pass may take, or None; its weight's (N, K)).
    ``weights`` names the pass's weights in the reasons ("fp4 weights")."""
    from ._fusion_common import needs_grad

    if needs_grad(node):
        return f"a gradient flows through it ({weights} are for inference)", None
    why = not_plain(node, ctx.options.skip)
    if why:
        return why, None
    x, w, _b, transposed = operands(node)
    wv, xv = ir.example_value(w), ir.example_value(x)
    if xv.dtype not in (torch.bfloat16, torch.float16) or wv.dtype != xv.dtype:
        return (f"a {str(xv.dtype).replace('torch.', '')} layer: {weights} are for bfloat16 and float16 models "
                "(cast the model, or leave this layer as it is)"), None
    N, K = wv.shape[::-1] if transposed else wv.shape
    if not all(isinstance(s, int) for s in (N, K)):
        return "dynamic weight sizes", None
    if min(K, N) < ctx.options.min_features:
        return f"{K}x{N} is under min_features={ctx.options.min_features}", None
    return None, (N, K)


def frozen_parameter(w: fx.Node, ctx, kinds: tuple = (torch.nn.Parameter,)) -> tuple[Any, int | None, str | None]:
    """(the module parameter behind ``w``, its position among the graph's inputs, None), or (None, None, why not):
    a weight pass copies it once at compile time, so it must be a parameter (of one of ``kinds``) that the graph
    does not write into and whose changes can be seen (not an inference tensor)."""
    from . import _symbolic_masks

    real = index = None
    if isinstance(w, fx.Node) and w.op == "placeholder":
        index = [n for n in w.graph.nodes if n.op == "placeholder"].index(w)
        try:
            real = ctx.example_inputs[index]
        except (RuntimeError, IndexError):  # no example inputs (a later stage), or not Dynamo's calling convention
            real = None
    if not isinstance(real, kinds):
        return None, None, "its weight is not a parameter of the module (it is copied once, at compile time)"
    if _symbolic_masks.mutated(w):
        return None, None, "the graph writes into its weight (a copy made before the call would lag it)"
    if real.is_inference():
        return None, None, ("its weight is an inference tensor (made under torch.inference_mode), whose changes "
                            "cannot be seen; build the model outside inference_mode and compile under no_grad")
    return real, index, None


def traced_rows(x: fx.Node, K: int) -> int:
    """The rows of ``x`` as [M, K]; a dynamic batch at the size traced (decisions are made, and timed, there)."""
    M = ir.example_value(x).numel() // K
    if isinstance(M, torch.SymInt):
        M = M.node.hint if M.node.hint is not None else 1
    return M
