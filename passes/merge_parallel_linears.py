"""merge-parallel-linears: linear layers that share their input -> one GEMM over concatenated weights.

Before (Dynamo's graph; the q, k and v projections of attention)::

    q, k, v = linear(x, Wq, bq), linear(x, Wk, bk), linear(x, Wv, bv)

After (``merged_linear``)::

    q, k, v = split(linear(x, cat([Wq, Wk, Wv]), cat([bq, bk, bv])), [Nq, Nk, Nv], -1)

The weights are concatenated on every call (they are graph inputs), so the gain is the launches saved: on
the H100 it is large at decode sizes and gone from 8192 rows (2026-11-26-s6-bench_dispatch-qkv*.md). Each
rewrite asks the cost model (calibration ``horizontal``, keyed by ``merged_linear``'s source). A group whose
outputs are reshaped with ``.view`` in a way the merged output's strides cannot take is left alone. Member
of the fusion group.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from ._fusion_common import RULE, apply_rule, ask, emit, gemm_baseline, rows, val


@graph_pass("merge-parallel-linears", summary="linears sharing their input -> one GEMM over concatenated weights",
            **RULE)
def merge_parallel_linears(gm: fx.GraphModule, ctx: PassContext) -> bool:
    return apply_rule(gm, ctx, _merge)


def merged_linear(x, weights, biases, widths):
    """What a group becomes (the replacement, and the source the calibration is keyed by)."""
    b = None if biases is None else torch.cat(biases, 0)
    return torch.split(F.linear(x, torch.cat(weights, 0), b), widths, -1)


def _groups(x: fx.Node) -> dict:
    """The linears of ``x``, grouped by what a merge needs in common: (dtype, K, whether bias-free)."""
    groups: dict = {}
    for m in x.users:
        if ir.kind(m) != "linear" or ir.arg(m, "input") is not x:
            continue
        w, b = ir.arg(m, "weight"), ir.arg(m, "bias", None)
        wv = val(w)
        if isinstance(w, fx.Node) and isinstance(wv, torch.Tensor) and wv.dim() == 2:
            groups.setdefault((wv.dtype, wv.shape[1], b is None), []).append(m)
    return groups


def _merge(gm, x, ctx, how):  # linear(x, W1), linear(x, W2), ... -> split(linear(x, cat(Ws)))
    groups = _groups(x)
    if all(len(g) < 2 for g in groups.values()):
        return False  # the common case (this runs for every node): no graph walk
    changed = False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for (dtype, K, no_bias), group in groups.items():
        first = min(group, key=order.__getitem__)
        group = [m for m in group if all(order.get(a, -1) < order[first] for a in m.all_input_nodes)]
        if len(group) < 2 or not _views_stay_valid(group):
            continue
        group.sort(key=order.__getitem__)
        Ns = [val(ir.arg(m, "weight")).shape[0] for m in group]
        M, device = rows(x) or 0, val(x).device

        def ours(Ns=Ns, K=K):
            xs = torch.randn(M, K, device=device, dtype=dtype)
            ws = [torch.randn(n, K, device=device, dtype=dtype) for n in Ns]
            return lambda: merged_linear(xs, ws, None, Ns)

        if not ask(ctx, how, first, "horizontal", x, {"K": K, "N": Ns}, merged_linear, gemm_ns=Ns,
                   unfused_kernels=len(Ns), ours=ours, baseline_ms=gemm_baseline(device, M, K, Ns, dtype, 0)):
            continue
        with gm.graph.inserting_before(first):
            biases = None if no_bias else [ir.arg(m, "bias") for m in group]
            parts = emit(gm, merged_linear, (x, [ir.arg(m, "weight") for m in group], biases, Ns), like=first)
            for i, m in enumerate(group):
                m.replace_all_uses_with(emit(gm, operator.getitem, (parts, i), like=m))
        ctx.count()
        changed = True
    return changed


def _views_stay_valid(group: list[fx.Node]) -> bool:
    """A slice of the merged output has the merged row stride: check each ``.view`` user still works on it."""
    total = sum(val(m).shape[-1] for m in group)
    for m in group:
        v = val(m)
        strides, acc = [1] * v.dim(), total  # the slice's strides: rows of the merged output
        for d in range(v.dim() - 2, -1, -1):
            strides[d] = acc
            acc *= v.shape[d]
        fake = torch.empty_strided(v.shape, strides, dtype=v.dtype, device="meta")
        for u in m.users:
            if u.op == "call_method" and u.target == "view":
                shape = u.args[1:] if not isinstance(u.args[1], (list, tuple)) else u.args[1]
                if not all(isinstance(s, int) for s in shape):
                    return False
                try:
                    fake.view(*shape)
                except RuntimeError:
                    return False
    return True
