"""The padding proof's rules for ops that move positions: views, slices, indexing, concatenation (see
passes/_padding_proof.py)."""

from __future__ import annotations

from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

from ._padding_proof import _INT_MAX, AV, EXACT_POSITIONS, _dim, _expr, _Prover, _syms
from ._padding_rules import _rule

aten = torch.ops.aten


# the arguments through which a padded size may reach an op: the sizes and strides of a view or a new tensor
SIZE_ARGS = frozenset({"size", "shape", "stride"})


def grows(expr: Any, syms: Iterable[sympy.Symbol]) -> bool:
    """Whether ``expr`` (a size, all of whose symbols are positive) never decreases as any of ``syms`` grows,
    read off its form: sums, products of nonnegative terms, integer powers, floor division by a positive
    constant, min and max of such. Anything else counts as not growing."""
    from torch.utils._sympy.functions import CeilDiv, CleanDiv, FloorDiv, Max, Min

    def up(e: Any) -> bool:
        if not (e.free_symbols & set(syms)):
            return True
        if isinstance(e, sympy.Symbol):
            return True
        if isinstance(e, sympy.Add):
            return all(up(a) for a in e.args)
        if isinstance(e, sympy.Mul):
            return all(up(a) and (a.is_nonnegative is True) for a in e.args)
        if isinstance(e, sympy.Pow):
            return e.exp.is_Integer and e.exp > 0 and up(e.base) and e.base.is_nonnegative is True
        if isinstance(e, (FloorDiv, CeilDiv, CleanDiv)):
            return e.args[1].is_number and e.args[1] > 0 and up(e.args[0])
        if isinstance(e, (sympy.Max, sympy.Min, Max, Min)):
            return all(up(a) for a in e.args)
        return False

    return up(sympy.sympify(expr))


@_rule(aten.view, aten._unsafe_view, aten.reshape)
def _view(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    mapping, factors = _reshape_map(p, node, x, shape)
    out = p.keep_dims(x, shape, mapping)
    out.factors.update(factors)
    return out


def _reshape_map(p: _Prover, node: fx.Node, x: AV, dst: tuple) -> tuple[dict[int, int], dict[int, tuple]]:
    """Check that a reshape splits and merges dims without cutting a padded factor or reordering factors; return
    the dims kept whole (dst dim -> src dim) and the factors of each merged dst dim."""
    src = x.shape
    atoms: list[tuple[Any, int | None]] = []  # (size, the src dim when the atom is that whole dim)
    for i, e in enumerate(src):
        f = x.factors.get(i)
        atoms += [(a, None) for a in f] if f else [(e, i)]
    mapping: dict[int, int] = {}
    factors: dict[int, tuple] = {}
    k = 0

    def bad(why: str):
        s = frozenset().union(*[_syms(e, p.padded) for e in src])
        p.fail(node, f"reshape {list(src)} -> {list(dst)} {why}", s)

    for o, e in enumerate(dst):
        if e == 1 and not (k < len(atoms) and atoms[k][0] == 1):
            continue
        taken: list[Any] = []
        need = e
        while need != 1:
            if k >= len(atoms):
                bad("is not a split or merge of whole dims")
            size, whole = atoms[k]
            if sympy.simplify(size - need) == 0:
                taken.append(size)
                k, need = k + 1, 1
                if len(taken) == 1 and whole is not None:
                    mapping[o] = whole
                break
            q = sympy.simplify(need / size)
            if _polynomial(q) and q != 1:
                taken.append(size)
                need, k = q, k + 1
                continue
            # the atom is bigger than what is left: split it, which only a size without padded symbols allows
            if _syms(size, p.padded):
                bad(f"cuts the padded size {size}")
            r = sympy.simplify(size / need)
            if not _polynomial(r):
                bad("mixes a padded dim with others")
            taken.append(need)
            atoms[k] = (r, None)
            need = 1
        if len(taken) > 1:
            factors[o] = tuple(taken)
        while k < len(atoms) and atoms[k][0] == 1:
            k += 1
    return mapping, factors


def _polynomial(e: Any) -> bool:
    num, den = sympy.fraction(sympy.together(e))
    return den.is_number and den == 1 or (den.is_number and (num / den).is_integer is True)


@_rule(aten.expand)
def _expand(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    off = len(shape) - len(x.shape)
    return p.keep_dims(x, shape, {d + off: d for d in range(len(x.shape)) if x.shape[d] != 1 or shape[d + off] == 1})


@_rule(aten.unsqueeze)
def _unsqueeze(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    d = _dim(node.args[1], len(shape))
    return p.keep_dims(x, shape, {o: (o if o < d else o - 1) for o in range(len(shape)) if o != d})


@_rule(aten.squeeze)
def _squeeze(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    named = node.args[1] if len(node.args) > 1 else None  # squeeze.dim / squeeze.dims: only those dims go
    named = None if named is None else [_dim(d, len(x.shape)) for d in (named if isinstance(named, (list, tuple))
                                                                          else [named])]
    kept = [i for i, e in enumerate(x.shape) if not (e == 1 and (named is None or i in named))]
    if len(kept) != len(shape):
        p.fail(node, f"squeeze {list(x.shape)} -> {list(shape)} not followed")
    return p.keep_dims(x, shape, dict(enumerate(kept)))


@_rule(aten.permute)
def _permute(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    dims = [_dim(d, len(shape)) for d in node.args[1]]
    return p.keep_dims(x, shape, dict(enumerate(dims)))


@_rule(aten.transpose, aten.t)
def _transpose(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    n = len(shape)
    a, b = (0, 1) if node.target.overloadpacket is aten.t else (_dim(node.args[1], n), _dim(node.args[2], n))
    perm = list(range(n))
    if n >= 2:
        perm[a], perm[b] = perm[b], perm[a]
    return p.keep_dims(x, shape, dict(enumerate(perm)))


@_rule(aten.slice)
def _slice(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    n = len(shape)
    dim = _dim(node.args[1] if len(node.args) > 1 else 0, n)
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    out = p.keep_dims(x, shape, {d: d for d in range(n) if d != dim})
    s = _syms(x.shape[dim], p.padded)
    if s:
        p.in_order(node, x, dim, "slices")
        # the real positions must stay first: a constant start, step 1, and an end that is a constant (a real
        # position whenever the unpadded run reached it) or the size plus a constant no larger than the input's
        if not isinstance(start, int) or start < 0 or step != 1:
            p.fail(node, f"slices the padded dim {dim} from {start} (step {step}): the real positions would move", s)
        same_end = end is None or isinstance(end, int) and end >= _INT_MAX // 2
        if isinstance(end, fx.Node):
            gap = sympy.simplify(_expr(end.meta["val"]) - x.shape[dim])
            if not gap.is_number or gap > 0:
                p.fail(node, f"slices the padded dim {dim} up to {end.meta['val']}, past its real positions", s)
            same_end = gap == 0
        elif isinstance(end, int) and end < 0:
            p.fail(node, f"slices the padded dim {dim} up to {end} from its end, which moves once padded", s)
        if same_end:  # the padded positions stay the padded ones: what is known of them holds
            if dim in x.fill:
                out.fill[dim] = x.fill[dim]
            if dim in x.pos:
                out.pos[dim] = x.pos[dim] + start
    elif not _syms(shape[dim], p.padded) and dim in x.pos:
        out.pos[dim] = x.pos[dim] + (start if isinstance(start, int) else 0)
    if start == 0 and step == 1 and dim >= n - 2 and n >= 2:  # positions unmoved: the diagonal stays
        out.diag = x.diag
    if x.concrete is not None and start == 0 and step == 1:  # a top-left block of the buffer: its facts hold
        out.concrete = x.concrete
        _triangle_facts(p, out)
    return out


def _triangle_facts(p: _Prover, av: AV) -> None:
    """A static tensor (a mask buffer) cut to the padded length on two dims: what sits above and below its
    diagonal there is what padded keys meet real queries (a lower-triangular causal mask: False above)."""
    pd = [d for d, e in enumerate(av.shape) if _syms(e, p.padded)]
    t = av.concrete
    if len(pd) != 2 or t is None or t.dim() != len(av.shape):
        return
    a, b = pd
    if _syms(av.shape[a], p.padded) != _syms(av.shape[b], p.padded) or sympy.simplify(av.shape[a] - av.shape[b]) != 0:
        return  # queries and keys of other lengths: the diagonal does not split real from padded
    m = t.movedim((a, b), (-2, -1))
    size = min(m.shape[-2], m.shape[-1])
    m = m[..., :size, :size]
    upper = torch.ones(size, size, dtype=torch.bool).triu(1)
    for d_padded, region in ((b, upper), (a, upper.T)):
        vals = m[..., region]
        if vals.numel() and bool((vals == vals.flatten()[0]).all()):
            av.fill[d_padded] = vals.flatten()[0].item()


@_rule(aten.select)
def _select(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    dim, index = _dim(node.args[1], len(x.shape)), node.args[2]
    s = _syms(x.shape[dim], p.padded)
    if s:
        p.in_order(node, x, dim, "reads")
    if s and (not isinstance(index, int) or index < 0):
        p.fail(node, f"reads dim {dim} at {index}, which moves once padded", s)
    return p.keep_dims(x, shape, {o: (o if o < dim else o + 1) for o in range(len(shape))})


@_rule(aten.arange)
def _arange(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    args = [a for a in node.args]
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    out = AV(shape)
    if isinstance(start, int) and step == 1 and node.meta["val"].dtype in EXACT_POSITIONS:
        out.pos[0] = start
    return out


@_rule(aten.full, aten.zeros, aten.ones, aten.empty, aten.new_ones, aten.new_zeros, aten.new_full,
       aten.new_empty, aten.scalar_tensor, aten.full_like, aten.zeros_like, aten.ones_like, aten.empty_like)
def _creation(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    packet = node.target.overloadpacket
    value = {aten.zeros: 0, aten.ones: 1, aten.new_ones: 1, aten.new_zeros: 0, aten.zeros_like: 0,
             aten.ones_like: 1}.get(packet)
    if packet in (aten.full, aten.new_full, aten.full_like, aten.scalar_tensor):
        value = node.args[0] if packet is aten.scalar_tensor else node.args[2] if packet is aten.new_full \
            else node.args[1]  # new_full(self, size, fill_value)
    dtype = node.meta["val"].dtype
    if value is not None and dtype == torch.bool:
        value = bool(value)
    return AV(shape, const=value if isinstance(value, (bool, int, float)) else None)


@_rule(aten.embedding)
def _embedding(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    w = p.av(node.args[0])  # padded indices are zeros: a real row of the table
    p.no_padded_dims(node, w, range(len(w.shape)), "looks up a table padded in")
    return AV(shape)


@_rule(aten.index)
def _index(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    indices = list(node.args[1])
    used = [d for d, ix in enumerate(indices) if ix is not None]
    lead = used[0] if used else 0  # index tensors next to each other: their broadcast dims replace theirs
    nd = max(len(p.av(ix).shape) for ix in indices if ix is not None) + lead
    if used != list(range(lead, lead + len(used))):
        nd = max(len(p.av(ix).shape) for ix in indices if ix is not None)  # apart: they go first
        lead = 0
    out = AV(shape)
    for d, ix in enumerate(indices):
        if ix is None:
            continue
        iav = p.av(ix)
        s = _syms(x.shape[d], p.padded)
        if not s:
            continue
        p.in_order(node, x, d, "indexes")
        # reading a padded dim: only at positions (arange of the same length) or constant indices >= 0
        ipos = {k + nd - len(iav.shape): o for k, o in iav.pos.items()}  # nd: index dims end there
        if len(ipos) == 1 and next(iter(ipos.values())) == 0:
            od = next(iter(ipos))
            if sympy.simplify(shape[od] - x.shape[d]) == 0 and d in x.pos:
                out.pos[od] = x.pos[d]
            if sympy.simplify(shape[od] - x.shape[d]) == 0 and isinstance(node.args[0], fx.Node):
                out.keyed = (node.args[0].name, tuple(None if j == d or not isinstance(ix, fx.Node) else ix.name
                                                      for j, ix in enumerate(indices)), d, od)
            continue
        if iav.const is not None and isinstance(iav.const, int) and iav.const >= 0:
            continue
        p.fail(node, f"indexes the padded dim {d} with values not known to be real positions", s)
    return out


@_rule(aten.cat)
def _cat(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    parts = [p.av(a) for a in node.args[0]]
    # torch skips a 1-D empty part whatever the others' rank (transformers' legacy cache, torch.tensor([]))
    parts = [a for a in parts if len(a.shape) == len(shape) or a.shape != (0,)] or parts
    dim = _dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    # along a padded dim, only the last part may be padded (its positions stay after every real one)
    padded_parts = [i for i, a in enumerate(parts) if _syms(a.shape[dim], p.padded)]
    for a in parts:
        p.in_order(node, a, dim, "concatenates along")
    if padded_parts and padded_parts != [len(parts) - 1]:
        p.fail(node, f"concatenates along dim {dim} after a padded part: the parts after it would move",
               _syms(parts[padded_parts[0]].shape[dim], p.padded))
    out = AV(shape, finite=all(a.finite for a in parts))
    if len(parts) == 1 or padded_parts:
        last = parts[-1]
        for d in last.fill:
            if d != dim:
                vals = [a.fill.get(d, "?") for a in parts]
                if all(v == vals[0] for v in vals) and vals[0] != "?":
                    out.fill[d] = vals[0]
    return out
