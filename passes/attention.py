"""attention: hand-written attention -> ``scaled_dot_product_attention``.

Before (Dynamo's graph, as GPT-2, Llama, BERT and nanoGPT write it)::

    s = (q @ k.transpose(-2, -1)) * scale        # or / d; or q * a before the product
    s = s + mask | torch.where(keep, s, min) | s.masked_fill(~keep, -inf)
    p = softmax(s.float(), dim=-1).to(q.dtype)   # casts optional
    p = dropout(p, p_drop, training)             # optional
    out = p @ v                                  # k, v may come from repeat_kv (grouped-query attention)

After::

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=M, dropout_p=p_drop, is_causal=C, scale=scale)

The mask is kept exactly: an additive mask goes in as ``attn_mask``; ``where``/``masked_fill`` with -inf become
a boolean mask, with a finite value (GPT-2's dtype minimum) an additive one. When the mask depends on no
graph input (transformers builds its causal mask from arange), it is computed at compile time, and if it is
exactly lower-triangular the rewrite uses ``is_causal=True`` and drops it: the fused kernels then skip the
masked half. A candidate whose scores or probabilities are used elsewhere (a model returning attention
weights), or whose form is not one of the above, is left alone and reported as a near miss.

An SDPA call already in the graph (transformers' default path, timm, user code) gets the same mask analysis: a
mask that depends on no input is dropped, made ``is_causal`` or a FlexAttention form; one from the inputs stays
exact. On CUDA a mask whose last dimension is not dense is read through one contiguous copy (every fused kernel
needs stride 1 there). Each SDPA call a rewrite would make goes through the profit gate
(passes/_attention_gate.py): under ``decide="auto"`` it is made only where the dispatcher gives it a fused kernel,
not SDPA's math backend.

Why this runs before AOTAutograd (stage pre_aot) rather than on the joint graph: at the torch level the
attention chain is six nodes (softmax is one call), and SDPA's own autograd formula gives the backward when
AOTAutograd traces the graph, so the fused op brings its own backward without matching backward graphs
node by node (Inductor's joint-graph patterns need ~30 traced variants and still miss today's
transformers). The SDPA backend is chosen by the dispatcher while AOTAutograd traces; this pass sets the
priority for that trace: on Hopper, cuDNN first (about 1.8x the flash backend there, ../shared/ANCHORS.md),
then flash, memory-efficient and math, each where it supports the case (with dynamic sizes cuDNN last).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.graph_utils import drop_unused
from kpt_compiler.registry import PassContext, graph_pass

from . import _attention_gate as gate, _attention_gqa as gqa_pack, _mask_provenance as provenance
from ._attention_gate import Call
from ._attention_masks import HIDDEN_ROWS, hides_rows_in_training, mask_kind
from ._attention_match import Attention, Miss, match, scalar

# torch 2.9's fake tensors cannot trace torch.tensor(python floats) inside flex_sdpa (the ALiBi coefficients)
BIAS_IN_FLEX = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    # Which SDPA implementation to prefer. "auto": cudnn, flash, efficient, math on compute capability >= 9.0
    # (flash, efficient, math with dynamic sizes), torch's default order elsewhere. A named one goes first.
    backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    # Leave attention over fewer key positions than this alone (the fused kernel's fixed cost can lose there).
    min_seq_len: int = 1
    # "auto": on CUDA, rewrite where SDPA then runs a fused kernel (not its math backend); "measure" (the
    # default under mode="max-autotune"): time the call on the device against what runs instead; "always"
    decide: Literal["auto", "measure", "always"] = "auto"
    # "auto": a dense mask that may hide a query row whole (left padding, causal) is left alone in graphs that
    # compute gradients (the fused kernels change them through such rows), rewritten in others; "rewrite": in both
    hidden_rows: Literal["auto", "rewrite"] = "auto"
    # SDPA over repeat_kv's copies at query lengths up to 64 runs over the key/value heads (passes/_attention_gqa.py)
    pack_gqa: bool = True
    # ... as SDPA over the packed query or FlexAttention over k, v as they are; "auto": flex under Inductor on sm_9x
    gqa_kernel: Literal["auto", "sdpa", "flex"] = "auto"

    def __post_init__(self):
        if self.min_seq_len < 1:
            raise ValueError(f"min_seq_len must be at least 1, got {self.min_seq_len}")
        if self.gqa_kernel == "flex" and not self.pack_gqa:
            raise ValueError("gqa_kernel='flex' rewrites the calls pack_gqa finds: it needs pack_gqa=True")


def _supports(target, options) -> str | None:
    if target.device == "xla":
        return "XLA lowers attention itself (torch_xla); the rewrite targets CUDA and CPU kernels"
    return None


@graph_pass("attention", summary="attention -> fused SDPA or FlexAttention: hand-written attention rewritten, "
            "existing SDPA calls' constant masks proven away", stage="pre_aot", options=AttentionOptions,
            statistics=("matches", "near_misses", "causal", "window", "linear_bias", "sdpa_calls", "gqa_packed",
                        "gqa_flex"), supports=_supports)
def fuse_attention(gm: fx.GraphModule, ctx: PassContext) -> bool:
    how = ctx.decide
    run = _Run(gm, ctx, how, _backend_order(ctx, gm))
    changed = False
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph:
            continue
        if ir.kind(node) == "sdpa":
            changed |= _revisit_sdpa(run, node)
            continue
        if ir.kind(node) != "softmax":
            continue
        found = match(node)
        if isinstance(found, Miss):
            if found.looks_like_attention:
                ctx.near_miss(f"{node.name}: {found.reason}")
            continue
        if found.seq_len < ctx.options.min_seq_len:
            ctx.near_miss(f"{node.name}: {found.seq_len} key positions < min_seq_len={ctx.options.min_seq_len}")
            continue
        changed |= _rewrite(run, found)
    if changed:
        # what only the old masks used (not a user's runtime check on the sizes: torch._check is no FX effect)
        drop_unused(gm.graph, only=lambda n: not ir.depends_on_inputs(n, tensors_only=True)
                    and not getattr(n.target, "__name__", "").startswith(("_check", "_assert")))
    found = provenance.constant_outputs(gm)  # masks a later graph may receive (FSDP2 breaks the graph per block)
    if found:
        ctx.wrap_built(provenance.tag_outputs(found))
        ctx.note(f"output(s) {[i for i, _ in found]} computed from no input: marked at each call, for the attention "
                 "of later graphs that receive them")
    if run.order is not None and any(ir.kind(n) == "sdpa" for n in gm.graph.nodes):
        ctx.note("SDPA backends, in priority order: " + ", ".join(b.name.lower() for b in run.order))
        ctx.during_aot(lambda: _sdpa_priority(run.order))
    return changed


@dataclasses.dataclass
class _Run:
    """One run of the pass over a graph: what every rewrite needs."""

    gm: fx.GraphModule
    ctx: PassContext
    how: str  # the decide answer in effect
    order: list | None  # the SDPA backend priority the trace runs under (None: torch's default)
    # mask node -> (its value at compile time, DDP-cut?, the marked inputs it was computed from)
    masks: dict = dataclasses.field(default_factory=dict)
    contiguous: dict = dataclasses.field(default_factory=dict)  # mask node -> its contiguous copy
    hidden_rows_noted: bool = False
    guard: provenance.Guard | None = None  # rewrites read from marked inputs hold for calls that pass them
    marks: dict = dataclasses.field(default_factory=dict)  # mask node -> provenance.marked(run, mask), once
    flex_blocks: dict = dataclasses.field(default_factory=dict)  # (t, s, device) -> FlexAttention's block constants
    flex_said: bool = False  # the note on why "auto" keeps packed SDPA on this card, once a graph

    def marked(self, mask: fx.Node) -> dict:
        return provenance.marked(self, mask)


def _build_mask(graph: fx.Graph, masks: list, dtype: torch.dtype, like: fx.Node) -> fx.Node:
    """One attn_mask computing what the where/masked_fill/add steps did, in forward order."""
    if len(masks) == 1 and masks[0][0] == "keep" and masks[0][2] == -math.inf:
        return masks[0][1]  # boolean: True attends
    if len(masks) == 1 and masks[0][0] == "drop" and masks[0][2] == -math.inf:
        return ir.emit(graph, torch.logical_not, (masks[0][1],), like=like)
    total = None
    for how, m, fill in masks:
        if how == "add":  # match checked the query's dtype holds the mask exactly
            cast = ir.example_value(m).dtype != dtype  # an op (torch.Tensor.to would leave AOTAutograd's cache)
            term = ir.emit(graph, torch.ops.aten.to.dtype, (m, dtype), like=like) if cast else m
        else:
            zero = ir.emit(graph, torch.zeros, ((),), {"dtype": dtype, "device": ir.example_value(m).device},
                           like=like)
            keep, drop = (zero, fill) if how == "keep" else (fill, zero)
            term = ir.emit(graph, torch.where, (m, keep, drop), like=like)
        total = term if total is None else ir.emit(graph, torch.add, (total, term), like=like)
    return total


def _rewrite(run: _Run, a: Attention) -> bool:
    gm, ctx, graph = run.gm, run.ctx, run.gm.graph
    dtype = ir.example_value(a.q).dtype
    scores = ir.example_value(a.softmax).shape
    form = mask_kind(gm, a.masks, dtype, scores[-3], run.masks, query_len=scores[-2], marked=run.marked)
    provenance.rely(run, form, done=False)
    if form.failed:
        ctx.note(f"{a.softmax.name}: the mask depends on no input but could not be computed at compile time, so "
                 f"it stays a dense mask (not proven causal): {form.failed}")
    kind, window = form.kind, form.window
    # FlexAttention for what SDPA cannot express (soft-capping, a bias computed from the positions) or cannot make
    # fast (a sliding window: SDPA reads a dense mask, skips nothing); SDPA with the exact dense mask elsewhere.
    wants_flex = a.softcap is not None or kind == "window" or form.bias is not None
    flex_why = _flex_unsupported(ctx, a.q, a.k if a.k is not None else a.kt, a.dropout, kind) if wants_flex \
        else "not needed"
    if not flex_why and form.bias is not None and BIAS_IN_FLEX is False:
        flex_why = "on torch < 2.11 (its tracer cannot build the bias coefficients in the graph)"
    if a.softcap is not None and flex_why:
        ctx.near_miss(f"{a.softmax.name}: soft-capped attention {flex_why}")
        return False
    if kind == "tensor" and form.hides_rows and ctx.options.hidden_rows == "auto" and hides_rows_in_training(a):
        ctx.near_miss(f"{a.softmax.name}: left as it is in a graph that computes gradients: {HIDDEN_ROWS}; "
                      "hidden_rows='rewrite' rewrites it anyway")
        return False
    before = set(graph.nodes)
    with graph.inserting_before(a.out):
        key = a.k if a.k is not None else ir.emit(graph, torch.transpose, (a.kt, -2, -1), like=a.softmax)
        if not flex_why:
            fused, why = _emit_flex(graph, a.q, key, a.v, a.scale, a.softcap, kind, window, form, a.softmax), ""
        else:
            dense = kind in ("tensor", "window") or form.bias is not None
            mask = _build_mask(graph, a.masks, dtype, a.softmax) if dense else None
            fused, why = _gated_sdpa(run, a.softmax, Call(a.q, key, a.v, mask, a.dropout,
                                                          kind == "causal" and not dense, a.scale), None, before)
            if fused is None:
                return False
    a.out.replace_all_uses_with(fused)
    provenance.rely(run, form, done=True)
    for node in reversed(a.chain):
        if not node.users:
            graph.erase_node(node)
    if flex_why and form.bias is not None:
        kind = "tensor"  # the position bias goes in as part of the dense mask
    ctx.count()
    if kind in ("causal", "window"):
        ctx.count(kind)
    detail = {"causal": f"causal (mask proven lower-triangular{form.proof})", "none": "no mask",
              "window": f"sliding window of {window} (mask proven{form.proof})",
              "tensor": "attn_mask " + "+".join(h for h, _, _ in a.masks)}[kind]
    how = "FlexAttention, " if not flex_why else ""
    cap = f"soft-cap {a.softcap:g}, " if a.softcap is not None else ""
    if form.bias is not None and not flex_why:
        ctx.count("linear_bias")
        cap += "position bias a*j + b*i + c (ALiBi) as score_mod, "
    ctx.note(f"{a.softmax.name}: {how}{cap}{detail}, scale {a.scale:.4g}, dropout {a.dropout:g}{why}")
    if kind == "tensor" and form.hides_rows and not run.hidden_rows_noted:
        run.hidden_rows_noted = True
        ctx.note(HIDDEN_ROWS)
    return True


def _emit_flex(graph, q, key, v, scale, softcap, kind, window, form, like) -> fx.Node:
    from kpt_compiler.kernels.flex_attention import flex_sdpa

    # The output looks like SDPA's; computing it through the higher-order op would trace its autograd.
    return ir.emit(graph, flex_sdpa, (q, key, v),
                   {"scale": scale, "softcap": softcap, "causal": kind == "causal", "window": window,
                    "bias": form.bias, "bias_dtype": form.bias_dtype},
                   like=like, fake_fn=lambda q, k, v, **_: F.scaled_dot_product_attention(q, k, v))


def _gated_sdpa(run: _Run, at: fx.Node, planned: Call, original: Call | None,
                before: set) -> tuple[fx.Node | None, str]:
    """Emit ``planned`` (at the insertion point) if the gate takes it, with its mask's last dimension made
    dense where the fused kernels need that; else erase what was emitted for it (every node not in
    ``before``), record the near miss and return None. Also returns the gate's reason for the note."""
    graph, ctx = run.gm.graph, run.ctx
    if planned.mask is not None:
        planned.mask = _dense_last_dim(run, planned.mask)
    with ir.hints_only(planned.q, planned.k, planned.v):  # a decision at the sizes seen; the rewrite fits all
        d = gate.decide(ctx, run.how, planned, original, run.order)
    if not d.rewrite:
        for node in reversed([n for n in graph.nodes if n not in before]):
            if not node.users:
                graph.erase_node(node)
        run.contiguous = {m: c for m, c in run.contiguous.items() if c in before}
        ctx.near_miss(f"{at.name}: not faster here ({d.why})")
        return None, ""
    kwargs = {"attn_mask": planned.mask, "dropout_p": planned.dropout, "is_causal": planned.causal,
              "scale": planned.scale}
    if planned.gqa:
        kwargs["enable_gqa"] = True
    fused = ir.emit(graph, F.scaled_dot_product_attention, (planned.q, planned.k, planned.v), kwargs, like=at)
    return fused, f" ({d.why})" if d.why and run.how != "always" else ""


def _dense_last_dim(run: _Run, mask: fx.Node, probe: bool = False) -> fx.Node | None:
    """On CUDA, ``mask`` laid out as the fused SDPA kernels read it, made once per mask right after it for
    every call that reads it: itself if its last dimension has stride 1 and a static size; one contiguous
    copy where that stride is not 1; rows padded to a multiple of 8 where the size is dynamic. ``probe``: only
    whether it would be ``mask`` itself (None where it would not), emitting nothing."""
    val = ir.example_value(mask)
    if not run.ctx.target.is_cuda or val.dim() == 0:
        return mask
    dynamic = val.dim() in (3, 4) and isinstance(val.shape[-1], torch.SymInt)
    dense = not isinstance(val.stride(-1), int) or val.stride(-1) == 1 or val.shape[-1] == 1
    if dense and not dynamic:
        return mask
    if probe:
        return None
    if mask not in run.contiguous:
        if dynamic:
            run.contiguous[mask] = _aligned_rows(run.gm.graph, mask)
            run.ctx.note(f"{mask.name}: the mask's last dimension is dynamic; Inductor's SDPA lowering would "
                         "guard its rows' alignment to 8 (a graph compiled at an aligned length recompiles for the "
                         "others), so the call reads rows padded to a multiple of 8 (kpt::pad_rows)")
            return run.contiguous[mask]
        with run.gm.graph.inserting_after(mask):
            run.contiguous[mask] = ir.emit(run.gm.graph, torch.ops.aten.contiguous.default, (mask,), like=mask)
        run.ctx.note(f"{mask.name}: the mask's last dimension has stride {val.stride(-1)}; the fused SDPA kernels "
                     "need 1, so the call reads a contiguous copy")
    return run.contiguous[mask]


def _aligned_rows(graph: fx.Graph, mask: fx.Node) -> fx.Node:
    """``mask`` read through a copy whose rows are padded to a multiple of 8 elements (kernels/aligned_rows.py
    says why an opaque op, and why the padding is never zero)."""
    from kpt_compiler.kernels import aligned_rows

    val = ir.example_value(mask)
    op = aligned_rows.op(val.requires_grad)
    with graph.inserting_after(mask):
        n = ir.emit(graph, torch.ops.aten.sym_size.int, (mask, val.dim() - 1), like=mask)
    with graph.inserting_after(n):
        padded = ir.emit(graph, op, (mask,), like=mask)
    with graph.inserting_after(padded):
        return ir.emit(graph, torch.narrow, (padded, -1, 0, n), like=mask)


def _revisit_sdpa(run: _Run, node: fx.Node) -> bool:
    """An SDPA call already in the graph: a mask that depends on no input is computed at compile time and
    dropped, made ``is_causal`` or a FlexAttention form as for the hand-written form; a mask from the inputs
    stays exact (its layout made dense where the fused kernels need it)."""
    gm, ctx = run.gm, run.ctx
    ctx.count("sdpa_calls")
    q, k, v = (ir.arg(node, n) for n in ("query", "key", "value"))
    mask, dropout = ir.arg(node, "attn_mask", None), ir.arg(node, "dropout_p", 0.0)
    causal, scale, gqa = ir.arg(node, "is_causal", False), ir.arg(node, "scale", None), ir.arg(node, "enable_gqa", False)
    if not all(isinstance(x, fx.Node) for x in (q, k, v)) or not isinstance(dropout, (int, float)) \
            or not isinstance(causal, bool) or not isinstance(gqa, bool) or scale is not None and scalar(scale) is None:
        ctx.near_miss(f"{node.name}: SDPA call with arguments known only at run time")
        return False
    scale = scalar(scale) if scale is not None else None
    original = Call(q, k, v, mask, float(dropout), causal, scale, gqa)
    packed = gqa_pack.rewrite(run, node, original, _gated_sdpa, _replace) if ctx.options.pack_gqa else None
    if packed is not None:
        return packed
    if mask is None:
        ctx.note(f"{node.name}: SDPA call with no mask{' (causal)' if causal else ''}: nothing to prove")
        return False
    qv, mv = ir.example_value(q), ir.example_value(mask)
    planned, found = Call(q, k, v, mask, float(dropout), causal, scale, gqa), "a mask from the inputs (kept exact)"
    form = None
    if not ir.depends_on_inputs(mask, tensors_only=True) or run.marked(mask):
        masks = [("keep", mask, -math.inf)] if mv.dtype == torch.bool else [("add", mask, None)]
        form = mask_kind(gm, masks, qv.dtype, qv.shape[-3], run.masks, query_len=qv.shape[-2], marked=run.marked)
        provenance.rely(run, form, done=False)
        if form.failed:
            ctx.note(f"{node.name}: the mask depends on no input but could not be computed at compile time: "
                     f"{form.failed}")
        if form.bias is None and form.kind in ("none", "causal"):
            planned.mask, planned.causal = None, form.kind == "causal"
            found = "the constant mask masks nothing: dropped" if form.kind == "none" else \
                f"the constant mask is lower-triangular{form.proof}: is_causal=True"
        elif form.kind in ("window", "none", "causal") and not gqa:
            flex_why = _flex_unsupported(ctx, q, k, dropout, form.kind) or \
                (None if form.bias is None or BIAS_IN_FLEX else "on torch < 2.11")
            if not flex_why:
                with gm.graph.inserting_before(node):
                    fused = _emit_flex(gm.graph, q, k, v, scale if scale is not None else qv.shape[-1] ** -0.5,
                                       None, form.kind, form.window, form, node)
                provenance.rely(run, form, done=True)
                return _replace(run, node, fused, f"FlexAttention for the constant mask ({form.kind}"
                                                  f"{', position bias' if form.bias else ''})", form.kind)
            found = f"a constant {form.kind} mask FlexAttention cannot take {flex_why} (kept dense)"
        else:
            found = "a constant mask with no structure the kernels skip (kept exact)"
    if planned.mask is mask and _dense_last_dim(run, mask, probe=True) is mask:
        ctx.note(f"{node.name}: SDPA call, {found}: nothing to change")
        return False
    with gm.graph.inserting_before(node):
        fused, why = _gated_sdpa(run, node, planned, original, set(gm.graph.nodes))
    if fused is None:
        return False
    if form is not None and planned.mask is not mask:
        provenance.rely(run, form, done=True)
    return _replace(run, node, fused, found + why, "causal" if planned.causal and not original.causal else None)


def _replace(run: _Run, node: fx.Node, fused: fx.Node, what: str, kind: str | None) -> bool:
    node.replace_all_uses_with(fused)
    run.gm.graph.erase_node(node)
    run.ctx.count()
    if kind in ("causal", "window"):
        run.ctx.count(kind)
    run.ctx.note(f"{node.name}: SDPA call, {what}")
    return True


def _flex_unsupported(ctx: PassContext, q: fx.Node, k: fx.Node, dropout: Any, kind: str) -> str | None:
    """Why the FlexAttention form cannot take this attention, or None."""
    if ctx.codegen == "inductor" and not ctx.target.is_cuda:
        return "on the CPU (Inductor's FlexAttention for the CPU has no backward)"
    if ctx.codegen == "xla":
        return "on XLA"
    if kind == "tensor":
        return "with a mask that is not provably causal or a sliding window"
    if dropout:
        return "with dropout (FlexAttention has none)"
    qv, kv = ir.example_value(q), ir.example_value(k)
    if qv.dim() != 4 or not all(isinstance(s, int) for s in (*qv.shape, *kv.shape)):
        return "with dynamic shapes or not [batch, heads, seq, dim] inputs"
    return None


def _backend_order(ctx: PassContext, gm: fx.GraphModule):
    from torch.nn.attention import SDPBackend

    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    choice, dynamic = ctx.options.backend, False
    if choice == "auto":
        if not (ctx.target.is_cuda and ctx.target.capability and ctx.target.capability >= (9, 0)):
            return None
        dynamic = ir.attention_sizes_dynamic(gm)  # then cuDNN last: it plans each new problem on the host
        choice = "flash" if dynamic else "cudnn"
    rest = [b for b in names.values() if b != names[choice]]
    return [names[choice]] + (rest[1:] + rest[:1] if dynamic else rest)


@contextlib.contextmanager
def _sdpa_priority(order):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(order, set_priority=True):
        yield
