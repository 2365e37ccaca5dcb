"""fp8: linear layers -> fp8 matrix products with dynamic scaling (lossy; off by default).

Before (Dynamo's graph)::

    y = F.linear(x, W, b)                     # nn.Linear, or F.linear in user code

After::

    y = fp8_linear(x, W, b, recipe=...)       # passes/_fp8_recipes.py: scale, cast, torch._scaled_mm

forward and backward (the recipe says in which format each gradient GEMM runs). Eligible: a 2-D weight with
both dimensions multiples of 16 (``_scaled_mm``'s rule), at least ``min_features`` each, a floating-point
layer, static shapes, and a module path (``nn_module_stack``, e.g. ``lm_head`` or ``model.layers.0.mlp.up_proj``)
matching none of ``skip``. Each rewrite then asks the cost model whether it pays at its shape (``decide``, as
the fusion passes do: ``"always"`` for every eligible layer); where no calibration or measurement says so it
declines with the reason. The lossy guard measures each layer's own error on the example inputs (its output
against ``F.linear`` on the same inputs, in dB of signal-to-noise ratio) and backs out every layer under
``error_bound_db``; the report has each layer's figure and the graph output's.

fp8 matrix products need compute capability 8.9 (Ada) or newer: asking for the pass on an older GPU is an
error that says so. On the CPU ``torch._scaled_mm`` runs too (how CI tests the rewrite and its numerics).
Runs in stage pre_aot, so AOTAutograd traces the replacement's own backward, as for the attention pass.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from . import _fp8_recipes, _fp8_release, _fp8_static
from ._fp8_recipes import fp8_linear
from kpt_compiler.cost_model import Candidate, CostModel, source_hash

from ._fusion_common import needs_grad
from ._linear_layers import module_path as _module_path
from ._linear_layers import not_plain
from ._linear_layers import operands as _operands

DEFAULT_BOUND_DB = 20.0


@dataclasses.dataclass(frozen=True)
class Fp8Options:
    # the scaling: one scale per tensor, or per row of each operand along its reduction dimension
    granularity: Literal["tensorwise", "rowwise"] | None = None
    # torchao's training recipe (passes/_fp8_recipes.py), when more than the granularity: "rowwise_with_gw_hp"
    # keeps the weight gradient in the layer's precision. Default: the granularity's own recipe (tensorwise).
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    # module paths to keep in their precision, as fnmatch patterns ("lm_head", "*.0.*", "model.embed*")
    skip: tuple[str, ...] = ()
    # leave layers with fewer input or output features than this alone
    min_features: int = 16
    # the lossy guard backs out a layer whose own output is under this many dB of SQNR (on the example inputs)
    error_bound_db: float = DEFAULT_BOUND_DB
    # "auto": cached measurements, else the calibrated cost model; "measure": time on the device at compile
    # time (the default under mode="max-autotune"); "always": every eligible layer
    decide: Literal["auto", "measure", "always"] = "auto"
    # in inference graphs, quantize weights that are parameters once, at compile time (passes/_fp8_static.py),
    # instead of on every call. "frozen": the parameters with requires_grad=False (frozen by the user: no
    # optimizer steps them); True: every parameter (a write the check before each call cannot see, through
    # ``.data`` or a fused optimizer's step, is then the user's to announce: _fp8_static.refresh_weights);
    # False: none, every call quantizes them, as in training
    static_weights: bool | Literal["frozen"] = "frozen"

    def __post_init__(self):
        if self.min_features < 16 or self.min_features % 16:
            raise ValueError(f"min_features must be a multiple of 16 (torch._scaled_mm's rule), at least 16; "
                             f"got {self.min_features}")
        if isinstance(self.skip, str) or not all(isinstance(p, str) for p in self.skip):
            raise ValueError(f"skip must be a list of module-path patterns (strings), got {self.skip!r}")
        if self.recipe and self.granularity and self.recipe.split("_")[0] != self.granularity:
            raise ValueError(f"recipe={self.recipe!r} scales {self.recipe.split('_')[0]}, but granularity="
                             f"{self.granularity!r}; give one of them")
        if not self.error_bound_db > 0:
            raise ValueError(f"error_bound_db must be positive (dB of SQNR), got {self.error_bound_db}")

    @property
    def chosen_recipe(self) -> str:
        return self.recipe or self.granularity or "tensorwise"


def _supports(target, options) -> str | None:
    if target.device == "xla":
        return "fp8 matrix products on XLA are torch_xla's to lower; the rewrite targets CUDA and the CPU"
    if target.is_cuda and not target.has_fp8:
        cap = ".".join(map(str, target.capability or ()))
        return (f"fp8 matrix products need compute capability 8.9 (Ada) or newer, and {target.name} has "
                f"{cap or 'an unknown one'}")
    return None


@graph_pass("fp8", summary="linear layers -> fp8 matrix products (torch._scaled_mm), dynamic scaling, "
            "forward and backward", stage="pre_aot", options=Fp8Options, default=False, lossy=True,
            error_bound_db=DEFAULT_BOUND_DB, statistics=("matches", "near_misses"), supports=_supports)
def fp8(gm: fx.GraphModule, ctx: PassContext) -> bool:
    how = ctx.decide
    recipe, changed = ctx.options.chosen_recipe, False
    static, saved, kept = [], 0, 0  # (placeholder index, Fp8Weight) of the weights quantized at compile time
    n_released = 0
    for node in list(gm.graph.nodes):
        if ir.kind(node) not in ("linear", "addmm"):
            continue
        label = f"{node.name} ({_module_path(node)})" if _module_path(node) else node.name
        why = _ineligible(node, ctx.options)
        if why:
            ctx.near_miss(f"{label}: {why}")
            continue
        if how != "always" and not ctx.target.is_cuda:
            ctx.near_miss(f"{label}: on {ctx.target.device} no figure says fp8 pays (torch._scaled_mm runs "
                          "there, unfused); decide='always' rewrites anyway")
            continue
        x, w, b, transposed = _operands(node)
        xv, (N, K) = ir.example_value(x), ir.example_value(w).shape[::-1] if transposed else ir.example_value(w).shape
        M = xv.numel() // K
        device, dtype = xv.device, xv.dtype
        param, index = _static_weight(node, w, ctx)
        released = isinstance(param, _fp8_release.Fp8WeightTensor)  # no bf16 weight left to choose instead
        if not released and not _decide(ctx, how, label, M, K, N, dtype, device, recipe, training=needs_grad(node),
                                        static=param is not None):
            continue
        if not ctx.propose(node.name):
            continue
        with gm.graph.inserting_before(node):
            if released:  # kpt_compiler.release_weights replaced the parameter by its fp8 copy
                new = ir.emit(gm.graph, _fp8_release.fp8_linear_released, (x, w, b), like=node)
                exact = _exact_transposed if transposed else _exact
                n_released += 1
            elif param is not None:  # an inference graph's parameter: quantized now, once
                new, exact, weight = _emit_static(gm, node, x, b, param, recipe, transposed)
                static.append((index, weight))
                saved += weight.nbytes
                kept += param.nbytes
            else:
                if transposed:  # addmm(b, x, W) with W [K, N], as GPT-2's Conv1D: the linear of W^T
                    w = ir.emit(gm.graph, torch.t, (w,), like=node)
                new = ir.emit(gm.graph, fp8_linear_bias_after if _fp8_release.bias_after(b, xv) else fp8_linear,
                              (x, w, b), {"recipe": recipe}, like=node, fake_fn=lambda x, w, b, **_: F.linear(x, w, b))
                exact = _exact
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        ctx.check_locally(node.name, new, exact)  # the guard's figure for this layer alone
        ctx.count()
        ctx.note(f"{label}: {M}x{K} @ {K}x{N} in fp8, "
                 + (f"{param.granularity}, weight released to fp8 (its SQNR is against the dequantized weight: the "
                    "activation's quantization only)" if released else recipe
                    + (", weight quantized at compile time" if param is not None else "")))
        changed = True
    if static:
        ctx.count("static_weights", len(static))
        ctx.before_each_call(lambda args: _fp8_static.refresh(static, args))
        ctx.note(f"{len(static)} weights quantized once, at compile time: {saved / 2**20:.1f} MiB of fp8 beside the "
                 f"module's own copies ({kept / 2**20:.1f} MiB), which it keeps: each call checks that a weight did "
                 "not change since, and a recompile quantizes from them. Frozen ones can be freed: "
                 "kpt_compiler.release_weights(model)")
    if n_released:
        ctx.count("released_weights", n_released)
    plan = gm.meta.get("kpt_bucketing")
    if changed and plan is not None and _granularity(recipe) == "tensorwise":
        # one scale per activation tensor: its amax would read the padded rows
        plan.withdrawn = ("the fp8 pass scales each activation tensorwise, by an amax over every row, padded ones "
                          "included; granularity='rowwise' keeps rows apart")
        ctx.note(f"bucketing withdrawn: {plan.withdrawn}")
    return changed


def _static_weight(node: fx.Node, w: fx.Node, ctx: PassContext) -> tuple[torch.Tensor | None, int | None]:
    """(the parameter behind the weight of an inference layer, its position among the graph's inputs) when it
    is a graph input (Dynamo's real one) to quantize once, as ``static_weights`` says; else (None, None)."""
    if needs_grad(node) or not isinstance(w, fx.Node) or w.op != "placeholder":
        return None, None  # a released weight in a graph that trains (LoRA on a frozen base): the per-call
        # recipe, which dequantizes it and quantizes it again, since _scaled_mm has no backward
    index = [n for n in w.graph.nodes if n.op == "placeholder"].index(w)
    try:
        real = ctx.example_inputs[index]
    except (RuntimeError, IndexError):  # no example inputs (a later stage), or not Dynamo's calling convention
        return None, None
    if isinstance(real, _fp8_release.Fp8WeightTensor):
        return real, index  # released: fp8 is all there is
    if not ctx.options.static_weights or not isinstance(real, torch.nn.Parameter) or (
            ctx.options.static_weights == "frozen" and real.requires_grad):
        return None, None
    return real, index


def _emit_static(gm, node, x, b, param, recipe, transposed):
    """``fp8_linear_static(x, w8, w_scale, b)`` reading the parameter's shared ``Fp8Weight`` as constants."""
    granularity = _granularity(recipe)
    weight = _fp8_static.weight_for(param, granularity, transposed)
    fake_mode = ir.example_value(x).fake_mode
    consts = [ir.add_constant(gm, f"_kpt_fp8_{kind}_{node.name}", tensor, fake_mode)
              for kind, tensor in (("w8", weight.w8), ("scale", weight.scale))]
    fn = _fp8_static.fp8_linear_static
    if _fp8_release.bias_after(b, ir.example_value(x)):  # cuBLAS takes no bias with a float32 output
        fn = fp8_linear_static_bias_after
    new = ir.emit(gm.graph, fn, (x, *consts, b), {"granularity": granularity}, like=node)
    w = param.detach().t() if transposed else param.detach()
    return new, lambda x, _w8, _scale, b=None, **_: F.linear(x, w, b), weight


# where _fp8_release.bias_after: the bias added after the fp8 GEMM
def fp8_linear_bias_after(x, w, b, *, recipe):
    return fp8_linear(x, w, recipe=recipe) + b


def fp8_linear_static_bias_after(x, w8, w_scale, b, *, granularity):
    return _fp8_static.fp8_linear_static(x, w8, w_scale, granularity=granularity) + b


def _granularity(recipe: str) -> str:
    """How a recipe scales the forward's operands: "tensorwise", or "rowwise" (both rowwise recipes)."""
    return "tensorwise" if recipe == "tensorwise" else "rowwise"


def _exact(x, w, b=None, **_recipe):
    """What an ``fp8_linear`` node replaced, on its arguments: the lossy guard's reference for that layer."""
    return F.linear(x, w, b)


def _exact_transposed(x, w, b=None):
    """The guard's reference for a released weight stored [K, N] (an addmm: x @ w + b)."""
    return torch.addmm(b, x, w)


def _ineligible(node: fx.Node, options: Fp8Options) -> str | None:
    why = not_plain(node, options.skip)
    if why:
        return why
    x, w, _b, transposed = _operands(node)
    w, x = ir.example_value(w), ir.example_value(x)
    if transposed:
        w = w.t()
    if not all(isinstance(s, int) for s in (*x.shape, *w.shape)):
        return "dynamic shapes (the scaled GEMM needs its sizes at compile time)"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return f"a {x.dtype} layer (fp8 takes float32, bfloat16 and float16 layers)"
    N, K = w.shape
    if K % 16 or N % 16:
        return f"{K} input and {N} output features: torch._scaled_mm needs multiples of 16"
    if min(K, N) < options.min_features:
        return f"{K}x{N} is under min_features={options.min_features}"
    if x.device.type == "cuda" and options.chosen_recipe != "tensorwise" and x.dtype != torch.bfloat16:
        return f"rowwise scaling on CUDA gives bfloat16 outputs only; this layer is {x.dtype}"
    return None


def _decide(ctx: PassContext, how: str, label: str, M: int, K: int, N: int, dtype, device, recipe: str,
            training: bool, static: bool) -> bool:
    """The cost model's answer for one layer, from the card's ``fp8_linear_<recipe>[_train]`` table (forward, or
    forward + backward where a gradient flows) or ``fp8_linear_<granularity>_static`` (inference, the weight
    quantized once), or timed under "measure"; noted in the report either way. Where the card has no
    calibration of static weights, the per-call table answers: static weights only do less work."""
    granularity = _granularity(recipe)
    cost_model = ctx.cost_model or CostModel(ctx.target, ctx.mode, ctx.codegen)
    table, source = f"fp8_linear_{recipe}" + ("_train" if training else ""), _fp8_recipes
    fallback = ""
    if static:
        cal = cost_model.calibration
        entry = cal.table(f"fp8_linear_{granularity}_static", dtype) if cal is not None else None
        if how == "measure" or entry and entry["source"] == source_hash(_fp8_static):
            table, source = f"fp8_linear_{granularity}_static", _fp8_static
        else:
            fallback = (" (no calibration with static weights here" if not entry else
                        " (the static-weight table was calibrated with other kernel source")
            fallback += ": the per-call figure, which static weights only beat)"
    measuring = how == "measure"
    candidate = Candidate(table, M, {"K": K, "N": N}, dtype, source, mkn=(M, K, N),
                          ours=_call(M, K, N, dtype, device, recipe, training, static) if measuring else None,
                          baseline_ms=(lambda: _ms(_call(M, K, N, dtype, device, None, training))) if measuring
                          else None)
    d = cost_model.decide(how, candidate)
    if d.rewrite:
        ctx.note(f"{label}: {table} {M}x{K}x{N} ({d.why}){fallback}")
    else:
        ctx.near_miss(f"{label}: {table} not faster here ({d.why}){fallback}")
    return d.rewrite


def _call(M, K, N, dtype, device, recipe, training, static=False):
    """One layer call at this shape, ours (``recipe``) or the bf16 linear (None), with its backward if training;
    with ``static`` the weight quantized beforehand (an inference graph's parameter)."""
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=training)
    w = torch.randn(N, K, device=device, dtype=dtype, requires_grad=training)
    if static:
        granularity = _granularity(recipe)
        q = _fp8_static.Fp8Weight(w, granularity, transposed=False)
        return lambda: _fp8_static.fp8_linear_static(x, q.w8, q.scale, granularity=granularity)
    fn = (lambda: F.linear(x, w)) if recipe is None else (lambda: fp8_linear(x, w, recipe=recipe))
    if not training:
        return fn
    grad = torch.randn(M, N, device=device, dtype=dtype)
    return lambda: torch.autograd.grad(fn(), (x, w), grad)


def _ms(fn) -> float:
    from kpt_compiler.bench import median_ms

    return median_ms(fn, "cuda", warmup_ms=25, rep_ms=100)

