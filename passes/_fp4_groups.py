"""fp4 layers that share their input, quantized as one weight: q, k and v (or gate and up) in one kernel launch.

At decode sizes an fp4 GEMV is bound by latency as much as by bytes: on an H200 at batch 1 the k and v
projections of a 4096-wide Llama with grouped-query attention (1024 rows each) took a split of K, a reduction and
a cast, 10 us each, for 2 MiB of weights, beside 7 us for q's 8 MiB (profile of s31,
benchmarks/results/nvidia-h200/2026-11-29-s31-decode-profile-b1-08f7303.md). The fusion group's
merge-parallel-linears does this for 16-bit layers; the fp4 pass runs before it (it must see the plain linears),
so it merges its own: the concatenation [sum of N, K] is quantized once (NVFP4: one tensor scale for the group)
and the outputs are split back.

The group's copy is made again, whole and in place, when any member's parameter changes. Each member also has a
handle in the fp4 pass's copy table (``Fp4Member``: the member's rows of the group's codes and scales), so that
``kpt_compiler.refresh_weights`` and ``release_weights`` find every parameter, as they do a layer's own copy.
"""

from __future__ import annotations

import operator
import weakref

import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir

from . import _weight_copies
from .merge_parallel_linears import _mergeable


class Fp4GroupCopy:
    """The weights of ``params`` ([N_i, K] each, 16-bit) concatenated along N, in fp4 format ``fmt``."""

    def __init__(self, params: list[torch.Tensor], fmt):
        self.fmt, self.widths = fmt, [p.shape[0] for p in params]
        self.refs = [weakref.ref(p) for p in params]
        self.q = q = self._quantized(params)
        self.parts = (q.packed, q.scales, q.global_scale)
        self._mark(params)
        self.members = []
        row = 0
        for j, (p, n) in enumerate(zip(params, self.widths)):
            self.members.append(Fp4Member(self, j, p, row, n))
            row += n

    def register(self, table, params) -> None:
        """Each member's handle into the pass's copy table under a key of the group's own (a layer's own copy,
        from a compile without groups, stays beside it): refresh_weights and release_weights look there."""
        for p, member in zip(params, self.members):
            mine = table.get(p)
            if mine is None:
                mine = table[p] = weakref.WeakValueDictionary()
            member.key = ("group", self.fmt.name, id(self))
            mine[member.key] = member

    def _mark(self, params) -> None:
        self.made_from = [(weakref.ref(p), p._version, p.data_ptr()) for p in params]

    def stale(self, params) -> bool:
        return any(ref() is not p or (p._version, p.data_ptr()) != (v, ptr)
                   for (ref, v, ptr), p in zip(self.made_from, params))

    def _quantized(self, params):
        from kpt_compiler.kernels import _fp4_format

        with torch.no_grad():
            return _fp4_format.quantize(torch.cat([p.detach() for p in params]), self.fmt)

    def remake(self, params) -> None:
        """Quantize the members' weights again into the same tensors (the graphs read them)."""
        q = self._quantized(params)
        with torch.no_grad():
            for mine, theirs in zip(self.parts, (q.packed, q.scales, q.global_scale)):
                mine.copy_(theirs)
        self.refs = [weakref.ref(p) for p in params]
        self._mark(params)
        for m, p in zip(self.members, params):
            m._mark(p)

    def current(self, but: dict | None = None) -> list[torch.Tensor] | None:
        """The members' parameters (``but``: position -> the one to take there instead), None if one is gone."""
        params = [(but or {}).get(j, r()) for j, r in enumerate(self.refs)]
        return None if any(p is None for p in params) else params

    def same(self, params, fmt) -> bool:
        """Whether this group is the copy of ``params`` (by identity, in order) in ``fmt``."""
        mine = self.current()
        return fmt is self.fmt and mine is not None and len(mine) == len(params) and all(
            a is b for a, b in zip(mine, params))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes()


class Fp4Member(_weight_copies.WeightCopy):
    """One member's view of a group copy, as the copy table holds a layer's own copy: ``q`` is the member's rows
    of the group's codes and block scales with the group's tensor scale (a valid fp4 weight of its own)."""

    def __init__(self, group: Fp4GroupCopy, j: int, param: torch.Tensor, row: int, n: int):
        from kpt_compiler.kernels import _fp4_format

        self._group, self.j = weakref.ref(group), j  # the group holds its members: no cycle to keep it alive
        self.transposed, self.dtype, self.device, self.shape = False, param.dtype, param.device, tuple(param.shape)
        packed, scales, scale = group.parts
        self.parts = (packed[row:row + n], scales[row:row + n], scale)
        self.q = _fp4_format.Fp4Weight(group.fmt, *self.parts, self.shape)
        self._mark(param)

    def _params(self, param: torch.Tensor) -> list[torch.Tensor] | None:
        group = self._group()
        return None if group is None else group.current(but={self.j: param})

    def fits(self, param: torch.Tensor) -> bool:
        """Also: the group can be made again from here (every other member's parameter still there; one that
        was replaced is remade by the graph's own check before its next call). Else refresh_weights and
        release_weights pass this handle by: a release would take codes that may be out of date."""
        return super().fits(param) and self._params(param) is not None

    def refresh(self, param: torch.Tensor) -> None:
        """Make the whole group again (refresh_weights asks each member: a write through ``.data`` moves no
        version, so there is nothing to tell a fresh group from a stale one)."""
        params = self._params(param)
        if params is not None:
            self._group().remake(params)


def groups(candidates: list[dict], gm: fx.GraphModule, declined: list | None = None) -> list[list[dict]]:
    """Of ``candidates`` (the layers the pass would rewrite: dicts with ``node``, ``x``, ``K``, ``dtype``,
    ``transposed``), the groups of two or more that share their input (each member's inputs defined before the
    group's first layer, every ``.view`` of a member valid on a slice of the merged output). Layers on one input
    left apart go into ``declined`` as (their candidates, why)."""
    by_node = {c["node"]: c for c in candidates}
    keyed: dict = {}
    for c in candidates:
        if not c["transposed"]:
            keyed.setdefault((c["x"], c["K"], c["dtype"]), []).append(c["node"])
    order, apart = {n: i for i, n in enumerate(gm.graph.nodes)}, []
    out = [[by_node[n] for n in nodes] for _key, nodes in _mergeable(keyed, order, apart)]
    if declined is not None:
        declined.extend(([by_node[n] for n in nodes], why) for nodes, why in apart)
    return out


def find_or_make(table, params: list[torch.Tensor], fmt) -> Fp4GroupCopy:
    """The group copy of ``params`` that another graph already made (the prefill and the decode graph of one
    model share theirs, as single layers share their copies), made again if a member changed since; else a
    new one, registered in ``table``."""
    for handle in list((table.get(params[0]) or {}).values()):
        group = handle._group() if isinstance(handle, Fp4Member) else None
        if group is not None and group.same(params, fmt):
            if group.stale(params):
                group.remake(params)
            return group
    group = Fp4GroupCopy(params, fmt)
    group.register(table, params)
    return group


def refresh(table, groups_: list[tuple[Fp4GroupCopy, list[int]]], args) -> None:
    """Before a call: remake each group whose members' arguments (by position) are not what it was made from;
    a parameter replaced by another object gets the member's handle in ``table`` (refresh_weights looks there)."""
    for group, indices in groups_:
        params = [args[i] for i in indices]
        if group.stale(params):
            mine = group.current()
            replaced = mine is None or any(a is not b for a, b in zip(mine, params))
            group.remake(params)
            if replaced:
                group.register(table, params)


def emit(gm: fx.GraphModule, members: list[dict], q, kernel) -> fx.Node:
    """``kpt::fp4_linear`` over the fp4 weight ``q`` before the first member (one layer, or a group whose rows
    ``q`` holds one after another), its output split back where there are several (each member's bias added),
    each member's uses moved to its part. Returns the fp4_linear node (what the guard measures)."""
    first = members[0]["node"]
    x = members[0]["x"]
    parts = kernel.op_args(q)
    suffix = "_group" if len(members) > 1 else ""
    with gm.graph.inserting_before(first):
        consts = [ir.add_constant(gm, f"_kpt_fp4_{kind}_{first.name}{suffix}", t, ir.example_value(x).fake_mode)
                  for kind, t in zip(("packed", "scales", "scale"), parts[:3])]
        op = ir.emit(gm.graph, torch.ops.kpt.fp4_linear, (x, *consts, *parts[3:]), like=first)
        if len(members) > 1:
            split = ir.emit(gm.graph, torch.split, (op, [m["N"] for m in members], -1), like=first)
        news = []
        for i, m in enumerate(members):
            new = ir.emit(gm.graph, operator.getitem, (split, i), like=m["node"]) if len(members) > 1 else op
            if m["b"] is not None:
                new = ir.emit(gm.graph, torch.add, (new, m["b"]), like=m["node"])
            news.append(new)
    for m, new in zip(members, news):
        m["node"].replace_all_uses_with(new)
        gm.graph.erase_node(m["node"])
    return op


def released_rows(members: list[dict]):
    """The released weights of ``members`` (``release_weights`` over a group: each member's codes are rows of
    its group's tensors) as one weight, where they are consecutive rows of the same tensors with one tensor
    scale, in this order; else None (they run one kernel each). A view: nothing is copied."""
    try:
        return _released_rows(members)
    except RuntimeError:  # a tensor without storage (a fake one): no group
        return None


def _released_rows(members: list[dict]):
    from types import SimpleNamespace

    from kpt_compiler.kernels import _fp4_format

    ws = [m["param"] for m in members]
    if any(w.transposed or w.fmt != ws[0].fmt or w.global_scale.data_ptr() != ws[0].global_scale.data_ptr()
           for w in ws):
        return None
    parts = []
    for name in ("packed", "scales"):
        ts = [getattr(w, name) for w in ws]
        base = ts[0]._base
        if base is None or base.dim() != 2 or any(t._base is not base or not t.is_contiguous() or t.dtype != base.dtype
                                                  or t.stride() != base.stride() for t in ts):
            return None
        row_bytes = base.stride(0) * base.element_size()
        if any(b.data_ptr() != a.data_ptr() + a.shape[0] * row_bytes for a, b in zip(ts, ts[1:])):
            return None
        first = (ts[0].data_ptr() - base.data_ptr()) // row_bytes
        parts.append(base[first:first + sum(t.shape[0] for t in ts)])
    widths = [w.shape[0] for w in ws]
    q = _fp4_format.Fp4Weight(_fp4_format.FORMATS[ws[0].fmt], *parts, ws[0].global_scale,
                              (sum(widths), members[0]["K"]))
    return SimpleNamespace(q=q, widths=widths)
