"""merge-parallel-linears: linear layers that share their input -> one GEMM over concatenated weights.

Before (Dynamo's graph; the q, k and v projections of attention)::

    q, k, v = linear(x, Wq, bq), linear(x, Wk, bk), linear(x, Wv, bv)

After (``merged_linear``)::

    q, k, v = split(linear(x, cat([Wq, Wk, Wv]), cat([bq, bk, bv])), [Nq, Nk, Nv], -1)

In training graphs the weights are concatenated on every call (they are graph inputs that change), so the gain
is the launches saved: on the H100 it is large at decode sizes and gone from 8192 rows
(2026-11-26-s6-bench_dispatch-qkv*.md). In inference graphs whose weights are parameters the concatenation is
made once, at compile time (``merged_linear_static`` reads it as a constant): decoding a 4096-wide Llama
spent 12% of its device time concatenating q, k and v weights on every token (2026-11-26-s11-decode). Before
each call a check sees whether a parameter changed since (``load_state_dict``, an in-place write) and
concatenates again into the same tensor; the copy costs the weights' size once more. Each
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


def merged_linear_static(x, weight, bias, widths):
    """A group over weights concatenated beforehand (inference on parameters)."""
    return torch.split(F.linear(x, weight, bias), widths, -1)


class _Concatenated:
    """The concatenation of some parameters, made once and made again in place when one of them changes."""

    def __init__(self, params: list[torch.Tensor], indices: list[int]):
        self.indices = indices
        with torch.no_grad():
            self.tensor = torch.cat([p.detach() for p in params], 0)
        self._seen(params)

    def _seen(self, params) -> None:
        self.versions = [(p._version, p.data_ptr()) for p in params]

    def refresh(self, args) -> None:
        params = [args[i] for i in self.indices]
        if [(p._version, p.data_ptr()) for p in params] != self.versions:
            with torch.no_grad():
                torch.cat([p.detach() for p in params], 0, out=self.tensor)
            self._seen(params)


def _static_params(ctx: PassContext, nodes: list) -> tuple[list[torch.Tensor], list[int]] | None:
    """The parameters behind ``nodes`` (graph inputs) in an inference graph, with their input positions."""
    if not ctx.is_inference or ctx.stage != "pre_aot":
        return None
    placeholders = [n for n in nodes[0].graph.nodes if n.op == "placeholder"] if nodes else []
    params, indices = [], []
    for n in nodes:
        if not isinstance(n, fx.Node) or n.op != "placeholder":
            return None
        i = placeholders.index(n)
        try:
            real = ctx.example_inputs[i]
        except (RuntimeError, IndexError):
            return None
        if not isinstance(real, torch.nn.Parameter) or type(real.data) is not torch.Tensor:
            return None
        params.append(real)
        indices.append(i)
    return params, indices


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


def _ask_args(x: fx.Node, group: list[fx.Node], K: int, dtype: torch.dtype) -> dict:
    """``ask``'s arguments bar ``how`` for merging ``group``, the linears on ``x``."""
    Ns = [val(ir.arg(m, "weight")).shape[0] for m in group]
    M, device = rows(x) or 0, val(x).device

    def ours():
        xs = torch.randn(M, K, device=device, dtype=dtype)
        ws = [torch.randn(n, K, device=device, dtype=dtype) for n in Ns]
        return lambda: merged_linear(xs, ws, None, Ns)

    return dict(x=x, kind="horizontal", shapes={"K": K, "N": Ns}, source=merged_linear, gemm_ns=Ns,
                unfused_kernels=len(Ns), ours=ours, baseline_ms=gemm_baseline(device, M, K, Ns, dtype, 0))


def _mergeable(groups: dict, order: dict, declined: list | None = None) -> list[tuple[tuple, list[fx.Node]]]:
    """Of ``_groups(x)``, those a merge can take, in graph order: each member's inputs defined before the
    group's first linear (the merged one stands there), and every ``.view`` of a member still valid. A group of
    two or more left whole goes into ``declined`` as (its nodes, why); members dropped from a group that is still
    merged are not (fp4's candidates, whose inputs are x and parameters, never have one computed later)."""
    out = []
    for key, whole in groups.items():
        if len(whole) < 2:
            continue
        first = min(whole, key=order.__getitem__)
        group = [m for m in whole if all(order.get(a, -1) < order[first] for a in m.all_input_nodes)]
        why = "" if len(group) >= 2 else f"{len(whole) - len(group)} of them take an input computed after " \
            f"{first.name}, where the merged layer would stand"
        why = why or _view_problem(group)
        if why:
            if declined is not None:
                declined.append((sorted(whole, key=order.__getitem__), why))
            continue
        out.append((key, sorted(group, key=order.__getitem__)))
    return out


def merge_candidate(node: fx.Node) -> dict | None:
    """``ask``'s arguments bar ``how`` for merging the linear ``node`` with the other linears on its input (the
    group ``_merge`` would take), or None where it has none. Asked by sparsity-2-4, which runs first and weighs
    this rewrite against its own."""
    x = ir.arg(node, "input")
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for (dtype, K, _), group in _mergeable(_groups(x), order):
        if node in group:
            return _ask_args(x, group, K, dtype)
    return None


def _merge(gm, x, ctx, how):  # linear(x, W1), linear(x, W2), ... -> split(linear(x, cat(Ws)))
    groups = _groups(x)
    if all(len(g) < 2 for g in groups.values()):
        return False  # the common case (this runs for every node): no graph walk
    changed = False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for (dtype, K, no_bias), group in _mergeable(groups, order):
        first = group[0]
        asked = _ask_args(x, group, K, dtype)
        Ns = asked["shapes"]["N"]
        if not ask(ctx, how, first, **asked):
            continue
        with gm.graph.inserting_before(first):
            biases = None if no_bias else [ir.arg(m, "bias") for m in group]
            weights = [ir.arg(m, "weight") for m in group]
            static = [_static_params(ctx, nodes) for nodes in ([weights] if no_bias else [weights, biases])]
            if all(s is not None for s in static):
                fake_mode = val(x).fake_mode
                consts = []
                for kind, (params, indices) in zip(("w", "b"), static):
                    cat = _Concatenated(params, indices)
                    ctx.before_each_call(cat.refresh)
                    consts.append(ir.add_constant(gm, f"_kpt_merged_{kind}_{first.name}", cat.tensor, fake_mode))
                parts = emit(gm, merged_linear_static, (x, consts[0], None if no_bias else consts[1], Ns), like=first)
                ctx.count("concatenated_once")
            else:
                parts = emit(gm, merged_linear, (x, weights, biases, Ns), like=first)
            for i, m in enumerate(group):
                m.replace_all_uses_with(emit(gm, operator.getitem, (parts, i), like=m))
        ctx.count()
        changed = True
    return changed


def _view_problem(group: list[fx.Node]) -> str:
    """A slice of the merged output has the merged row stride: each ``.view`` user must still work on it. Why
    one does not ("" where all do)."""
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
                    return f"{u.name} views {m.name}'s output with symbolic sizes, which a slice may not take"
                try:
                    fake.view(*shape)
                except RuntimeError:
                    return f"{u.name}'s view{tuple(shape)} of {m.name}'s output would not hold on a slice of the " \
                        "merged output"
    return ""
