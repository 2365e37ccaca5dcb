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

Why this runs before AOTAutograd (stage pre_aot) rather than on the joint graph: at the torch level the
attention chain is six nodes (softmax is one call), and SDPA's own autograd formula gives the backward when
AOTAutograd traces the graph, so the fused op brings its own backward without matching backward graphs
node by node (Inductor's joint-graph patterns need ~30 traced variants and still miss today's
transformers). The SDPA backend is chosen by the dispatcher while AOTAutograd traces; this pass sets the
priority for that trace: on Hopper, cuDNN first (about 1.8x the flash backend there, ../shared/ANCHORS.md),
then flash, memory-efficient and math, each used only where it supports the case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.graph_utils import drop_unused
from kpt_compiler.registry import PassContext, graph_pass

from ._attention_match import Attention, Miss, match

# torch 2.9's fake tensors cannot trace torch.tensor(python floats) inside flex_sdpa (the ALiBi coefficients)
BIAS_IN_FLEX = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)
_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    # Which SDPA implementation to prefer. "auto": cudnn, flash, efficient, math on compute capability >= 9.0,
    # torch's default order elsewhere. A named one goes first; the others follow as fallbacks.
    backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    # Leave attention over fewer key positions than this alone (the fused kernel's fixed cost can lose there).
    min_seq_len: int = 1

    def __post_init__(self):
        if self.min_seq_len < 1:
            raise ValueError(f"min_seq_len must be at least 1, got {self.min_seq_len}")


def _supports(target, options) -> str | None:
    if target.device == "xla":
        return "XLA lowers attention itself (torch_xla); the rewrite targets CUDA and CPU kernels"
    return None


@graph_pass("attention", summary="hand-written attention (matmul, scale, mask, softmax, matmul) -> fused SDPA",
            stage="pre_aot", options=AttentionOptions, statistics=("matches", "near_misses", "causal", "window", "linear_bias"),
            supports=_supports)
def fuse_attention(gm: fx.GraphModule, ctx: PassContext) -> bool:
    changed, evaluated_masks = False, {}
    for node in list(gm.graph.nodes):
        if ir.kind(node) != "softmax" or node.graph is not gm.graph:
            continue
        found = match(node)
        if isinstance(found, Miss):
            if found.looks_like_attention:
                ctx.near_miss(f"{node.name}: {found.reason}")
            continue
        if found.seq_len < ctx.options.min_seq_len:
            ctx.near_miss(f"{node.name}: {found.seq_len} key positions < min_seq_len={ctx.options.min_seq_len}")
            continue
        changed |= _rewrite(gm, found, ctx, evaluated_masks)
    if changed:
        drop_unused(gm.graph, only=lambda n: not ir.depends_on_inputs(n))  # what only the old masks used
        order = _backend_order(ctx)
        if order is not None:
            ctx.note("SDPA backends, in priority order: " + ", ".join(b.name.lower() for b in order))
            ctx.during_aot(lambda: _sdpa_priority(order))
    return changed


# ---------------------------------------------------------------------------------------------- rewriting


@dataclasses.dataclass
class _MaskForm:
    """What the masks amount to, when they depend on no input: "none"; "causal" (the top-left lower
    triangle); "window" (a causal sliding window of ``window`` positions); "tensor" (anything else, kept as a
    dense mask). ``bias``: an additive bias linear in the positions (ALiBi), (a_h, b_h, c_h) per head for
    a_h * j + b_h * i + c_h, on top of what is allowed; ``bias_dtype`` the dtype it was computed in."""

    kind: str
    window: int | None = None
    bias: tuple[tuple[float, float, float], ...] | None = None
    bias_dtype: torch.dtype | None = None
    failed: str | None = None  # why a mask that depends on no input could not be computed at compile time


def _mask_kind(gm: fx.GraphModule, masks: list, dtype: torch.dtype, heads: int, cache: dict) -> _MaskForm:
    allowed, bias = None, None
    for how, m, fill in masks:
        why: list[str] = []
        if m not in cache:
            # up to 2^28 entries: an ALiBi bias [16 heads, 4096, 4096] is fitted too (larger stays a dense mask)
            cache[m] = ir.evaluate(gm, m, max_elements=1 << 28, why=why)
        val = cache[m]
        if val is None:
            return _MaskForm("tensor", failed=f"{m.name} ({why[0]})" if why else None)
        if how == "add":
            if not val.is_floating_point():
                return _MaskForm("tensor")
            # blocked entries must be so negative that exp() makes them exactly 0, as -inf does
            blocked = val <= torch.finfo(val.dtype).min / 2
            if not bool(((val == 0) | blocked).all()):  # a real bias (ALiBi, relative position), not just a mask
                if bias is not None:
                    return _MaskForm("tensor")
                bias = val
            ok = ~blocked
        else:
            if val.dtype != torch.bool or fill > torch.finfo(dtype).min / 2:
                return _MaskForm("tensor")
            ok = val if how == "keep" else ~val
        allowed = ok if allowed is None else allowed & ok
    coefficients = _linear_bias(bias, allowed, heads) if bias is not None else None
    if bias is not None and coefficients is None:
        return _MaskForm("tensor")  # a bias FlexAttention would have to read from memory: SDPA does that
    form = _MaskForm("tensor", bias=coefficients, bias_dtype=bias.dtype if bias is not None else None)
    if allowed is None or bool(allowed.all()):
        return dataclasses.replace(form, kind="none")
    L, S = allowed.shape[-2:]
    i = torch.arange(L, device=allowed.device)[:, None]
    j = torch.arange(S, device=allowed.device)[None, :]
    if bool((allowed == (j <= i)).all()):
        return dataclasses.replace(form, kind="causal")
    window = int(allowed[..., -1, :].sum(-1).max())  # the last row sees the whole window
    if L == S and bool((allowed == ((j <= i) & (i - j < window))).all()):
        return dataclasses.replace(form, kind="window", window=window)
    return _MaskForm("tensor")


def _linear_bias(bias: torch.Tensor, allowed: torch.Tensor | None, heads: int):
    """(a_h, b_h, c_h) per head with bias[h, i, j] == a_h * j + b_h * i + c_h (to the bias dtype's rounding)
    wherever attention is allowed, or None. Batch dims must not matter; heads come third from last."""
    if bias.dim() > 3 and any(s != 1 for s in bias.shape[:-3]):
        return None
    # evaluated where the model lives: checked there on CUDA (16M entries per head at 4096 positions), else on
    # a CPU copy; the least-squares fit itself runs on the CPU (its gelsd driver has no CUDA kernel)
    if bias.device.type not in ("cpu", "cuda"):
        bias, allowed = bias.cpu(), allowed.cpu() if allowed is not None else None
    device = bias.device
    b = bias.reshape(*([1] * max(0, 3 - bias.dim())), *bias.shape[-3:])
    if b.shape[0] not in (1, heads):
        return None
    rows, cols = b.shape[-2:]
    ok = None
    if allowed is not None:  # allowed is the same for every batch and head here (causal, window or all)
        ok = allowed.reshape(-1, *allowed.shape[-2:])[0]
        rows, cols = max(rows, ok.shape[-2]), max(cols, ok.shape[-1])
    if rows * cols > 1 << 24:
        return None
    compute = torch.float64 if bias.dtype.itemsize > 2 else torch.float32  # see the check below
    i = torch.arange(rows, dtype=compute, device=device)[:, None]
    j = torch.arange(cols, dtype=compute, device=device)[None, :]
    ok = torch.ones(rows, cols, dtype=torch.bool, device=device) if ok is None else ok.to(device).expand(rows, cols)
    where = ok.nonzero()
    if len(where) == 0:
        return None
    sample = where[:: max(1, len(where) // 4096)]  # fit on a sample, check everywhere
    eps = torch.finfo(bias.dtype).eps
    coefficients = []
    x = torch.stack([sample[:, 1], sample[:, 0], torch.ones_like(sample[:, 0])], -1).cpu().double()
    for h in range(b.shape[0]):
        y = b[h].expand(rows, cols)[sample[:, 0], sample[:, 1]].cpu().double()
        # weighted by 1 / |value|: a low-precision bias is rounded relative to its size, so large entries
        # (far from the diagonal, rounded by up to 8 in bfloat16 at 4096 positions) must not pull the fit
        weight = 1 / y.abs().clamp_min(max(1e-3 * y.abs().max().item(), 1e-30))
        fit = torch.linalg.lstsq(x * weight[:, None], (y * weight).unsqueeze(-1), driver="gelsd")
        a_h, b_h, c_h = fit.solution.squeeze(-1).tolist()
        # checked at every allowed entry, in float32 for 16-bit biases (its rounding is far below theirs):
        # |expected - bias| <= 2 eps (|bias| + 1), with no boolean indexing (16M entries per head at 4096)
        expected = torch.add(j * a_h, i, alpha=b_h).add_(c_h).to(bias.dtype).to(compute)
        actual = b[h].to(compute).expand(rows, cols)
        excess = expected.sub_(actual).abs_().sub_(actual.abs().add_(1).mul_(2 * eps))
        if bool((excess > 0).logical_and_(ok).any()):
            return None  # not linear in the positions: a learned relative-position table, say
        coefficients.append((a_h, b_h, c_h))
    return tuple(coefficients * heads if len(coefficients) == 1 else coefficients)


def _build_mask(graph: fx.Graph, masks: list, dtype: torch.dtype, like: fx.Node) -> fx.Node:
    """One attn_mask computing what the where/masked_fill/add steps did, in forward order."""
    if len(masks) == 1 and masks[0][0] == "keep" and masks[0][2] == -math.inf:
        return masks[0][1]  # boolean: True attends
    if len(masks) == 1 and masks[0][0] == "drop" and masks[0][2] == -math.inf:
        return ir.emit(graph, torch.logical_not, (masks[0][1],), like=like)
    total = None
    for how, m, fill in masks:
        if how == "add":  # match checked the query's dtype holds the mask exactly
            term = m if ir.example_value(m).dtype == dtype else ir.emit(graph, torch.Tensor.to, (m, dtype), like=like)
        else:
            zero = ir.emit(graph, torch.zeros, ((),), {"dtype": dtype, "device": ir.example_value(m).device},
                           like=like)
            keep, drop = (zero, fill) if how == "keep" else (fill, zero)
            term = ir.emit(graph, torch.where, (m, keep, drop), like=like)
        total = term if total is None else ir.emit(graph, torch.add, (total, term), like=like)
    return total


def _rewrite(gm: fx.GraphModule, a: Attention, ctx: PassContext, cache: dict) -> bool:
    graph = gm.graph
    dtype = ir.example_value(a.q).dtype
    form = _mask_kind(gm, a.masks, dtype, ir.example_value(a.softmax).shape[-3], cache)
    if form.failed:
        ctx.note(f"{a.softmax.name}: the mask depends on no input but could not be computed at compile time, so "
                 f"it stays a dense mask (not proven causal): {form.failed}")
    kind, window = form.kind, form.window
    # FlexAttention for what SDPA cannot express (soft-capping, a bias computed from the positions) or cannot
    # make fast (a sliding window: SDPA reads a dense mask and skips nothing); SDPA with the exact dense mask
    # where FlexAttention cannot go.
    wants_flex = a.softcap is not None or kind == "window" or form.bias is not None
    flex_why = _flex_unsupported(a, kind, ctx) if wants_flex else "not needed"
    if not flex_why and form.bias is not None and BIAS_IN_FLEX is False:
        flex_why = "on torch < 2.11 (its tracer cannot build the bias coefficients in the graph)"
    if a.softcap is not None and flex_why:
        ctx.near_miss(f"{a.softmax.name}: soft-capped attention {flex_why}")
        return False
    with graph.inserting_before(a.out):
        key = a.k if a.k is not None else ir.emit(graph, torch.transpose, (a.kt, -2, -1), like=a.softmax)
        if not flex_why:
            from kpt_compiler.kernels.flex_attention import flex_sdpa

            # The output looks like SDPA's; computing it through the higher-order op would trace its autograd.
            fused = ir.emit(graph, flex_sdpa, (a.q, key, a.v),
                            {"scale": a.scale, "softcap": a.softcap, "causal": kind == "causal", "window": window,
                             "bias": form.bias, "bias_dtype": form.bias_dtype},
                            like=a.softmax, fake_fn=lambda q, k, v, **_: F.scaled_dot_product_attention(q, k, v))
        else:
            dense = kind in ("tensor", "window") or form.bias is not None
            mask = _build_mask(graph, a.masks, dtype, a.softmax) if dense else None
            fused = ir.emit(graph, F.scaled_dot_product_attention, (a.q, key, a.v),
                            {"attn_mask": mask, "dropout_p": a.dropout, "is_causal": kind == "causal" and not dense,
                             "scale": a.scale}, like=a.softmax)
    a.out.replace_all_uses_with(fused)
    for node in reversed(a.chain):
        if not node.users:
            graph.erase_node(node)
    if flex_why and form.bias is not None:
        kind = "tensor"  # the position bias goes in as part of the dense mask
    ctx.count()
    if kind in ("causal", "window"):
        ctx.count(kind)
    detail = {"causal": "causal (mask proven lower-triangular)", "none": "no mask",
              "window": f"sliding window of {window} (mask proven)",
              "tensor": "attn_mask " + "+".join(h for h, _, _ in a.masks)}[kind]
    how = "FlexAttention, " if not flex_why else ""
    cap = f"soft-cap {a.softcap:g}, " if a.softcap is not None else ""
    if form.bias is not None and not flex_why:
        ctx.count("linear_bias")
        cap += "position bias a*j + b*i + c (ALiBi) as score_mod, "
    ctx.note(f"{a.softmax.name}: {how}{cap}{detail}, scale {a.scale:.4g}, dropout {a.dropout:g}")
    return True


def _flex_unsupported(a: Attention, kind: str, ctx: PassContext) -> str | None:
    """Why the FlexAttention form cannot take this attention, or None."""
    if ctx.codegen == "inductor" and not ctx.target.is_cuda:
        return "on the CPU (Inductor's FlexAttention for the CPU has no backward)"
    if ctx.codegen == "xla":
        return "on XLA"
    if kind == "tensor":
        return "with a mask that is not provably causal or a sliding window"
    if a.dropout:
        return "with dropout (FlexAttention has none)"
    q, k = ir.example_value(a.q), ir.example_value(a.k if a.k is not None else a.kt)
    if q.dim() != 4 or not all(isinstance(s, int) for s in (*q.shape, *k.shape)):
        return "with dynamic shapes or not [batch, heads, seq, dim] inputs"
    return None


def _backend_order(ctx: PassContext):
    from torch.nn.attention import SDPBackend

    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    choice = ctx.options.backend
    if choice == "auto":
        if not (ctx.target.is_cuda and ctx.target.capability and ctx.target.capability >= (9, 0)):
            return None
        choice = "cudnn"
    first = names[choice]
    return [first] + [b for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]


@contextlib.contextmanager
def _sdpa_priority(order):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(order, set_priority=True):
        yield
