"""What the fusion passes share: the ``fusion`` group, its options, the rule driver, matching helpers, and the
question each GEMM or norm rule asks the cost model before it rewrites.

The fusion group's members are one pass each (fold-conv-bn, fuse-add-norm, fuse-gated-linear,
fuse-linear-epilogue, merge-parallel-linears), so each can be disabled, timed, dumped and bisected alone.
``options={"fusion": False}`` switches them all off; ``{"fusion": {"decide": "measure"}}`` passes ``decide``
to each; ``{"fusion": {"gated": False}}`` switches one off (as ``{"fuse_gated_linear": False}`` does).
Inductor fuses chains of pointwise and reduction ops itself; these rules fuse across the GEMMs it calls from
cuBLAS and across weights, in Dynamo's torch-level graph (stage pre_aot, so each custom op's own autograd
gives the backward, as for the attention pass).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.cost_model import Candidate, CostModel
from kpt_compiler.graph_utils import drop_unused
from kpt_compiler.registry import PassContext, PassGroup, register_group

MEMBERS = ("fold-conv-bn", "fuse-add-norm", "fuse-gated-linear", "fuse-linear-epilogue", "merge-parallel-linears")


@dataclasses.dataclass(frozen=True)
class RuleOptions:
    """Each fusion pass's options."""

    # "auto": cached measurements, else the calibrated cost model; "measure": time on the device at compile
    # time (the default under mode="max-autotune"); "always": every match (tests; users who measured)
    decide: Literal["auto", "measure", "always"] = "auto"


@dataclasses.dataclass(frozen=True)
class FusionOptions:
    """``options={"fusion": {...}}``: ``decide`` for every member, and one switch per member."""

    conv_bn: bool = True  # fold-conv-bn
    norm: bool = True  # fuse-add-norm
    gated: bool = True  # fuse-gated-linear
    epilogue: bool = True  # fuse-linear-epilogue
    horizontal: bool = True  # merge-parallel-linears
    decide: Literal["auto", "measure", "always"] = "auto"


FUSION = register_group(PassGroup(
    "fusion", summary="what Inductor leaves apart (across GEMMs and weights), fused where that is faster",
    members=MEMBERS, options=FusionOptions,
    toggles={"conv_bn": "fold-conv-bn", "norm": "fuse-add-norm", "gated": "fuse-gated-linear",
             "epilogue": "fuse-linear-epilogue", "horizontal": "merge-parallel-linears"}))

# Declared with every member: what its @graph_pass shares with the others.
RULE = dict(stage="pre_aot", options=RuleOptions, default=True, statistics=("matches", "near_misses"),
            supports=lambda target, options: "XLA fuses for itself" if target.device == "xla" else None)


def apply_rule(gm: fx.GraphModule, ctx: PassContext, rule: Callable[..., bool]) -> bool:
    """Try ``rule(gm, node, ctx, how)`` at every node that is still in use, then drop what the rewrites
    replaced (so that it cannot match the next pass)."""
    how = ctx.decide
    changed = False
    for node in list(gm.graph.nodes):
        if node.graph is gm.graph and (node.users or node.op == "placeholder"):  # not replaced already
            changed |= bool(rule(gm, node, ctx, how))
    drop_unused(gm.graph)
    return changed


# ---------------------------------------------------------------------------------------------- matching


def val(node: Any) -> Any:
    return ir.example_value(node)


def one_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def needs_grad(node: fx.Node) -> bool:
    """Whether a gradient flows through ``node`` (training). Where none does, the GEMM rules emit the kernels'
    forms without autograd (``fused_op``)."""
    v = val(node)
    return not isinstance(v, torch.Tensor) or v.requires_grad


def rows(x: fx.Node) -> int | None:
    v = val(x)
    if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape) or v.dim() < 1:
        return None
    return v.numel() // max(v.shape[-1], 1)


def activation(node: Any) -> str | None:
    """The activation a node applies, in our kernels' names, or None."""
    k = ir.kind(node)
    if k in ("silu", "relu"):
        return k
    if k == "gelu":
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(ir.arg(node, "approximate", "none"))
    return None


def plain_linear(node: Any, x: Any = None) -> bool:
    """A bias-free linear (of ``x`` if given) whose output has one user."""
    return (ir.kind(node) == "linear" and ir.arg(node, "bias", None) is None and one_user(node)
            and (x is None or ir.arg(node, "input") is x))


def same_tensor_shape(a: Any, b: Any) -> bool:
    va, vb = val(a), val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device)


def emit(gm, fn, args, kwargs=None, like=None):
    return ir.emit(gm.graph, fn, args, kwargs or {}, like=like)


# ---------------------------------------------------------------------------------------------- deciding


def triton_form(ctx: PassContext) -> bool:
    """Whether the GEMM rules emit the kernels' triton_op form where no gradient flows: where Inductor
    compiles for CUDA, which then launches the kernel as one of its own (see linear_epilogue_triton)."""
    from kpt_compiler.kernels._launch import HAVE_TRITON

    return HAVE_TRITON and ctx.codegen == "inductor" and ctx.target.device == "cuda"


def fused_op(ctx: PassContext, kernel, name: str, grad: bool):
    """The op a GEMM rule emits: the custom op (with autograd) where a gradient flows; else the triton_op
    form (``triton_form``), or the ``*_inference`` op, which skips the custom op's Python autograd layer."""
    if grad:
        return getattr(kernel, name)
    return getattr(torch.ops.kpt, f"{name}_triton" if triton_form(ctx) else f"{name}_inference").default


def verdict(ctx: PassContext, how: str, x: fx.Node, kind: str, shapes: dict, source: Any, *,
            table: str | None = None, gemm_ns: list[int] | None = None, unfused_kernels: int = 1,
            ours: Callable[[], Callable] | None = None, baseline_ms: Callable[[], float] | None = None,
            cost_model: Any = None):
    """The cost model's answer for a rewrite on input ``x`` (a cost_model.Decision), nothing written to the report;
    None where ``x`` has dynamic rows (the decision needs sizes). Arguments: ``ask``'s; ``cost_model`` in place
    of the compile's."""
    n, v = rows(x), val(x)
    if n is None:
        return None
    N = sum(shapes["N"]) if isinstance(shapes.get("N"), list) else shapes.get("N")  # merged linears: the total N
    mkn = (n, shapes["K"], N) if isinstance(N, int) and "K" in shapes else None
    measuring = how == "measure"
    candidate = Candidate(kind, n, shapes, v.dtype, source, table=table, mkn=mkn,
                          form="triton" if triton_form(ctx) else "inference", gemm_ns=gemm_ns,
                          unfused_kernels=unfused_kernels, ours=ours() if measuring and ours else None,
                          baseline_ms=baseline_ms if measuring else None,
                          timeable=ours is not None and baseline_ms is not None)
    return (cost_model or ctx.cost_model or CostModel(ctx.target, ctx.mode, ctx.codegen)).decide(how, candidate)


def ask(ctx: PassContext, how: str, node: fx.Node, kind: str, x: fx.Node, shapes: dict, source: Any, *,
        table: str | None = None, gemm_ns: list[int] | None = None, unfused_kernels: int = 1,
        ours: Callable[[], Callable] | None = None, baseline_ms: Callable[[], float] | None = None) -> bool:
    """Whether to rewrite ``node`` (the cost model's answer, noted in the report either way).

    ``table``: the calibration entry (default ``kind``); ``gemm_ns`` and ``unfused_kernels``: the GEMMs' N and
    the kernel count on Inductor's side, for its estimated device time (weighed against host times without
    CUDA graphs); ``ours`` and ``baseline_ms`` make the callables ``decide="measure"`` times (only called then).
    """
    if rows(x) is None:
        ctx.near_miss(f"{node.name}: {kind} with dynamic shapes (the decision needs sizes)")
        return False
    if how != "always" and needs_grad(node):
        # the calibration and the measured decisions time forward passes; in training the backward weighs as
        # much (ours recomputes its GEMMs), and the H100 suite had the Llama training step slower with fusion
        ctx.near_miss(f"{node.name}: {kind} in a training graph: the cost model covers the forward only "
                      "(decide='always' takes it)")
        return False
    d = verdict(ctx, how, x, kind, shapes, source, table=table, gemm_ns=gemm_ns, unfused_kernels=unfused_kernels,
                ours=ours, baseline_ms=baseline_ms)
    if not d.rewrite:
        ctx.near_miss(f"{node.name}: {kind} not faster here ({d.why})")
    else:
        ctx.note(f"{node.name}: {kind} {rows(x)}x{shapes} ({d.why})")
        fallback = reference_reason(val(x), source) if _is_kernel(source) else None
        if fallback:
            ctx.note(f"{node.name}: {kind} will run its eager reference here, not our kernel: {fallback}")
    return d.rewrite


def _is_kernel(source: Any) -> bool:
    """Whether a rewrite's source is one of our kernels (a module in kernels/), not plain torch code."""
    return getattr(source, "__name__", "").startswith("kpt_compiler.kernels.")


def reference_reason(x: torch.Tensor, kernel) -> str | None:
    """Why ``kernel``'s op will run its eager reference for inputs like ``x`` (the graph's fake tensor, on the
    target's device) instead of its Triton kernel; None where the kernel runs. The answer is the kernels' own
    (``_launch.kernel_runs``); the text says which of its conditions failed."""
    from kpt_compiler.kernels import _launch
    from kpt_compiler.kernels._gemm_common import GEMM_DTYPES
    from kpt_compiler.kernels._norm_common import SUPPORTED_DTYPES

    gemm = "_gemm_common" in getattr(kernel, "SOURCE_MODULES", ())
    dtypes = GEMM_DTYPES if gemm else SUPPORTED_DTYPES
    if _launch.kernel_runs(x, dtypes, needs_3_6_interpreter=gemm):
        return None
    if not _launch.HAVE_TRITON:
        return "triton is not installed"
    if x.dtype not in dtypes:
        return f"the kernel takes {', '.join(str(d).replace('torch.', '') for d in dtypes)}, not " \
               f"{str(x.dtype).replace('torch.', '')}"
    if x.is_cuda:
        return "the kernels were loaded for Triton's interpreter (TRITON_INTERPRET=1)"
    if x.device.type == "cpu":
        if _launch.INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1":
            return "triton < 3.6's interpreter cannot run the GEMM kernels"
        return "on the CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 before importing)"
    return f"the kernels run on cuda (and the CPU's interpreter), not {x.device.type}"


def bytes_baseline(device, nbytes: int) -> Callable[[], float]:
    """Inductor at its best on a memory-bound kernel, for ``decide="measure"``: its bytes at this card's copy
    bandwidth."""
    def ms():
        from kpt_compiler.bench import copy_bandwidth

        return nbytes / (copy_bandwidth(device=device.type) * 1e12) * 1e3
    return ms


def gemm_baseline(device, n: int, K: int, Ns: list[int], dtype, epilogue_bytes: int) -> Callable[[], float]:
    """Inductor at its best, for ``decide="measure"``: the cuBLAS GEMMs, then its fused epilogue at this card's
    copy bandwidth."""
    def ms():
        from kpt_compiler.bench import median_ms

        x = torch.randn(n, K, device=device, dtype=dtype)
        ws = [torch.randn(m, K, device=device, dtype=dtype) for m in Ns]
        gemm = median_ms(lambda: [F.linear(x, w) for w in ws], device.type, warmup_ms=25, rep_ms=100)
        return gemm + bytes_baseline(device, epilogue_bytes)()
    return ms
