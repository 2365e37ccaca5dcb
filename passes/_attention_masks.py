"""What an attention mask amounts to when it depends on no graph input: nothing, causal, a sliding window, or a
dense tensor, with an additive bias linear in the positions (ALiBi) on top. The attention pass computes such a
mask at compile time (``torch_ir.evaluate``), or, where its sizes are dynamic, reads what it allows as a
formula in the positions (passes/_symbolic_masks.py), and asks ``mask_kind`` what it is; passes/attention.py
rewrites by the answer (drop the mask, ``is_causal=True``, a FlexAttention block mask and score_mod, or keep it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx

from kpt_compiler import distributed, torch_ir as ir

from . import _symbolic_masks as symbolic_masks


# Measured in session 24 (benchmarks/results/nvidia-h200/2026-11-28-s24-sdpa-hidden-rows-f321ea3.txt and the CPU)
HIDDEN_ROWS = ("a dense mask may hide a query row whole (a padded query): eager's softmax gives such a row the "
               "average of every key's value, the fused SDPA kernels other values (on CUDA in the forward, on the "
               "CPU in the gradients); rows it leaves a key are the same, so read only those (as a loss that "
               "ignores padding does)")


def hides_rows_in_training(a) -> bool:
    """Whether attention ``a`` (whose dense mask may hide a query row whole) computes gradients through a mask
    that has rows of its own (not one broadcast over the queries, which hides a row only where a whole sequence
    is padding) and is built from the caller's data (an attention mask: left padding under a causal mask hides
    every row before the first real token) or computed whole at compile time (then it does hide one). There the
    fused kernels' gradients differ from eager's through the hidden rows, and a causal LM's shifted loss reads
    one: the last left pad predicts the first real token (the review of 2026-12-04). A mask read from the
    model's own buffers (a causal triangle) is not held to this."""
    if not any(getattr(ir.example_value(n), "requires_grad", False) for n in (a.q, a.k, a.kt, a.v) if n is not None):
        return False
    for _, m, _ in a.masks:
        shape = getattr(ir.example_value(m), "shape", ())
        if len(shape) < 2 or shape[-2] == 1:
            continue
        seen, todo, sources = set(), [m], []
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += n.all_input_nodes
                if n.op == "placeholder":
                    name = getattr(getattr(n.meta.get("grapharg"), "source", None), "name", "")
                    sources.append((name() if callable(name) else name) or "")
        if not sources or any("._buffers[" not in s and "._parameters[" not in s for s in sources):
            return True
    return False


@dataclasses.dataclass
class MaskForm:
    """What the masks amount to, when they depend on no input: "none"; "causal" (the top-left lower
    triangle); "window" (a causal sliding window of ``window`` positions); "tensor" (anything else, kept as a
    dense mask). ``bias``: an additive bias linear in the positions (ALiBi), (a_h, b_h, c_h) per head for
    a_h * j + b_h * i + c_h, on top of what is allowed; ``bias_dtype`` the dtype it was computed in."""

    kind: str
    window: int | None = None
    bias: tuple[tuple[float, float, float], ...] | None = None
    bias_dtype: torch.dtype | None = None
    failed: str | None = None  # why a mask that depends on no input could not be computed at compile time
    # whether a query row may be hidden whole (where fused kernels and eager's softmax differ): unknown is True
    hides_rows: bool = True
    # how it was read: "" computed at the sizes of the trace; " for every size" read as a formula in the
    # positions (dynamic sizes)
    proof: str = ""
    # the graph inputs (placeholder -> value) the form was read from: marked tensors of an earlier graph of ours
    relies_on: dict | None = None


def mask_kind(gm: fx.GraphModule, masks: list, dtype: torch.dtype, heads: int, cache: dict,
              query_len: Any = None, marked: Callable[[fx.Node], dict] | None = None) -> MaskForm:
    """``query_len``: the scores' query length (a mask of one query row broadcast over them is not causal).
    ``marked``: the inputs a mask depends on whose values an earlier graph of ours computed from no input, with
    those values (passes/_mask_provenance.py); a form read from them has ``relies_on`` set, and holds only for
    calls that pass those tensors."""
    form = _mask_kind(gm, masks, dtype, heads, cache, query_len, marked)
    relied = {x: v for _, m, _ in masks if m in cache for x, v in cache[m][2].items()}
    if relied and (form.kind != "tensor" or form.bias is not None):
        form.relies_on = relied
        form.proof += ", built by an earlier graph of ours (each call checks it is that tensor)"
    return form


def _mask_kind(gm, masks, dtype, heads, cache, query_len, marked) -> MaskForm:
    allowed, bias, formulas, split = None, None, [], False
    for how, m, fill in masks:
        why: list[str] = []
        if symbolic_masks.mutated(m):
            return MaskForm("tensor")  # written in place after it was built: what it computes is not its value
        if m not in cache:
            # up to 2^28 entries: an ALiBi bias [16 heads, 4096, 4096] is fitted too (larger stays a dense mask);
            # in a piece of DDP's split, a mask that the whole graph built before the cut is known as well
            known = distributed.values_before_cut(m, 1 << 28, usable=lambda source: not symbolic_masks.mutated(source))
            from_marks = marked(m) if marked is not None and not known else {}
            cache[m] = ir.evaluate(gm, m, max_elements=1 << 28, why=why, known=known or from_marks), bool(known), \
                from_marks
        val, before_cut, _ = cache[m]
        split = split or before_cut
        if val is None and not why:  # dynamic sizes: what it allows, as a formula in the positions
            formula = symbolic_masks.allowed(m, how, fill)
            if formula is not None:
                formulas.append(formula)
                continue
        if val is None:
            return MaskForm("tensor", failed=f"{m.name} ({why[0]})" if why else None)
        if how == "add":
            if not val.is_floating_point():
                return MaskForm("tensor")
            # blocked entries must be so negative that exp() makes them exactly 0, as -inf does
            blocked = val <= torch.finfo(val.dtype).min / 2
            if not bool(((val == 0) | blocked).all()):  # a real bias (ALiBi, relative position), not just a mask
                if bias is not None:
                    return MaskForm("tensor")
                bias = val
            ok = ~blocked
        else:
            if val.dtype != torch.bool or fill > torch.finfo(dtype).min / 2:
                return MaskForm("tensor")
            ok = val if how == "keep" else ~val
        allowed = ok if allowed is None else allowed & ok
    if formulas:
        if allowed is not None or bias is not None:
            return MaskForm("tensor")  # a formula and a computed mask together: not modeled
        formula = sympy.And(*formulas)
        kind = "none" if formula == sympy.true else "causal" if symbolic_masks.is_causal(formula) else "tensor"
        return MaskForm(kind, proof=" for every size")
    hides = allowed is not None and not bool(allowed.any(-1).all())  # computed: known for every row
    coefficients = _linear_bias(bias, allowed, heads) if bias is not None else None
    if bias is not None and coefficients is None:
        return MaskForm("tensor", hides_rows=hides)  # a bias FlexAttention would have to read from memory: SDPA does
    form = MaskForm("tensor", bias=coefficients, bias_dtype=bias.dtype if bias is not None else None,
                    proof=", built before a cut of DDP's split: computed in the whole graph" if split else "",
                    hides_rows=hides)
    if allowed is None or bool(allowed.all()):
        return dataclasses.replace(form, kind="none")
    L, S = allowed.shape[-2:]
    if query_len is not None and not (isinstance(query_len, int) and L == query_len):
        return MaskForm("tensor", hides_rows=hides)  # broadcast over the queries (or sized otherwise): no triangle
    i = torch.arange(L, device=allowed.device)[:, None]
    j = torch.arange(S, device=allowed.device)[None, :]
    if bool((allowed == (j <= i)).all()):
        return dataclasses.replace(form, kind="causal")
    window = int(allowed[..., -1, :].sum(-1).max())  # the last row sees the whole window
    if L == S and bool((allowed == ((j <= i) & (i - j < window))).all()):
        return dataclasses.replace(form, kind="window", window=window)
    return MaskForm("tensor", hides_rows=hides)


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
