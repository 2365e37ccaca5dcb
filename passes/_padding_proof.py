"""Proof that padding an input dimension cannot change the real part of a graph's outputs (the bucketing pass).

Padding appends positions to some dimensions of the inputs (zeros, or False); the padded run computes a larger
result, of which the bucketing pass keeps the leading, real part. That part equals the unpadded result when no
real value reads a padded one. This module checks that over the graph traced to ATen (``make_fx`` under
Dynamo's fake mode, so sizes are sympy expressions over Dynamo's symbols), op by op, as an abstract
interpretation. A dimension is *padded* when its size involves a padded symbol; its real extent is that size
with the real values substituted. Per tensor it keeps:

  fill    per padded dim d: a constant known to sit where d is padded and every other dim is real (zero,
          False, -inf...): what makes a reduction across d harmless (a sum over zeros, a softmax over -inf)
  pos     per dim: the value is the index along it plus a constant (``arange``): what makes a causal mask
          provable (a key index past the real ones exceeds every real query index)
  const   the value of every element, where known (``full``, ``scalar_tensor``, a scalar)
  concrete  a static tensor's real values (a causal mask kept as a buffer, sliced to the sequence length)

The rules, each a reason the real part stays what it was unpadded (a step no rule covers fails the proof):
  rows      ops that act on each position alone (pointwise with broadcasting, views that split and merge dims
            without moving a padded factor, matrix products and norms over unpadded dims, embedding lookups)
  prefix    a cumulative sum along a padded dim (positions are appended at the end)
  masked    a reduction across a padded dim whose fill is neutral for it: a sum or matrix product over zeros, a
            softmax or max over -inf, an ``any`` over False
  causal    attention with ``is_causal`` and queries and keys padded alike; or a mask that is False/-inf where
            keys are padded and queries real (built from ``arange`` comparisons, a lower-triangular buffer, or
            an input mask padded with zeros)
  index     reading a padded dim at a constant index >= 0 (real whenever the unpadded run was valid), or by a
            position tensor of the same symbol; slicing from a constant start
Anything else that touches a padded dim (an unknown op, a reduction without a neutral fill, a value computed
from a padded size, an input mutated in place) fails the proof, and the failure names the op and the symbol.
A padded size may reach any op only as a size (of a view, a new tensor, an arange, a slice's end) that grows
with the padding, and every result's padded sizes must grow (``sizes_only``): an index, a slice's start, a
shift, a fill value or a scale computed from a padded size, or a size like ``32 - s``, fails (the review of
2026-12-04). Positions stay positions only in dtypes that hold them exactly (``EXACT_POSITIONS``).
Values of the real computation are assumed finite (a real +inf meeting a -inf mask would give NaN unpadded too);
values at padded positions are followed as finite or not (zeros stay finite through sums and products, a
reciprocal or log of them need not), and "0 * x" or "x + -inf" count only for finite x. A mask's "hidden" is
False or -inf; or a float32/bfloat16 dtype's lowest (<= -1e38, as transformers' masks; not fp16's -65504) only
where every real row is shown to see a real key (its diagonal: ``diag``), since it does not absorb a row whose
every key it masks, and with partners within 1e30 (real values are assumed to be; constants are checked), so
exp underflows to 0 in fp32 as it does unpadded.
A dim merged from several whose padded factor is not the outermost has its real positions scattered: only
row-wise ops may follow it before it is split again. A module's mask buffer is read when the proof runs; each
call checks that it did not change since (bucketing.py). The review of 2026-11-26 found fifteen ways the first
version was wrong; tests/test_bucketing.py keeps them.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

__all__ = ["Unprovable", "prove", "AV"]

aten = torch.ops.aten
_INT_MAX = 2**62


class Unprovable(Exception):
    """The proof failed at ``node`` because of ``symbol`` (None: not tied to one symbol)."""

    def __init__(self, node: fx.Node | None, message: str, symbols: Iterable[sympy.Symbol] = ()):
        self.node, self.symbols = node, frozenset(symbols)
        where = f"{node.name} ({_op_name(node)}): " if node is not None else ""
        super().__init__(where + message)


@dataclasses.dataclass
class AV:
    """What the proof knows about one tensor (see the module's docstring)."""

    shape: tuple[Any, ...]
    fill: dict[int, Any] = dataclasses.field(default_factory=dict)
    pos: dict[int, int] = dataclasses.field(default_factory=dict)
    const: Any = None
    concrete: torch.Tensor | None = None
    # per dim merged by a reshape: the sizes it was merged from, outermost first (a split must follow them)
    factors: dict[int, tuple] = dataclasses.field(default_factory=dict)
    # the values at padded positions are finite (zeros padded in stay finite through sums and products; a
    # reciprocal or log of them may not): what lets "0 * x" and "x + -inf" be read as 0 and -inf there
    finite: bool = True
    lower: float | None = None  # a lower bound on its padded values (x * x: 0): rsqrt(mean(x * x) + eps) is finite
    # the value at [..., i, i] of the last two dims (equal lengths) for every real i: True in a causal mask, 0.0
    # once made additive, VISIBLE in scores: every real query then sees a real key, so a finite mask hides too
    diag: Any = None
    masks: bool = False  # may hold a hiding value (<= HIDE) at real positions: a product of it is no score
    # an index result: (source, the other indices, source dim, out dim): the source read along out dim at the
    # positions of the source dim; two of them alike but for the out dim meet on the diagonal (eq: True there)
    keyed: tuple | None = None


def _op_name(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", None) or str(t)


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _syms(expr: Any, padded: frozenset) -> frozenset:
    return frozenset(getattr(expr, "free_symbols", ())) & padded


NEG = float("-inf")
# dtypes that hold every position exactly (a size past 2**31 aside): positions cast to another (int8 wraps at 128,
# bfloat16 rounds past 256) are positions no more
EXACT_POSITIONS = (torch.int64, torch.int32, torch.float64)
# a finite mask value this low (a float32 or bfloat16 dtype's lowest: transformers' masks) hides a key in a row
# that sees another, whose values are at most SMALL: exp underflows to 0. fp16's -65504 does not qualify (real
# scores may come near it); values past SMALL are not followed as real ones
HIDE, SMALL = -1e38, 1e30
VERY_NEG, VISIBLE = "-big", "seen"  # a value <= HIDE plus one within SMALL; a real value no mask hid
UNKNOWN, UNBOUNDED = "?", "?inf"  # a value not known (finite), one not known to be finite


def finite_value(v: Any) -> bool:
    """A fill that is a finite number (or a bool, a finite hiding value, or a marker of a real value)."""
    return not isinstance(v, float) or v - v == 0


def finite_along(av: AV, d: int) -> bool:
    """Whether av's values are finite where dim d is padded and the others real: its fill there, or else its
    ``finite``."""
    return finite_value(av.fill[d]) if d in av.fill else av.finite


def _is_neg(v: Any) -> bool:
    # -inf only: a dtype's lowest value (transformers' eager masks) does not absorb, and a real row whose every
    # key it masks would average over the padded keys too
    return isinstance(v, float) and v == NEG


def _hides(v: Any) -> bool:
    """A finite mask value that hides a key only where the row sees another (the diagonal: AV.diag)."""
    return v == VERY_NEG or isinstance(v, float) and not isinstance(v, bool) and NEG < v <= HIDE


def _sees(v: Any) -> bool:
    """A diagonal value a real row attends to: True (bool mask), a real score, an additive mask value within
    SMALL of 0."""
    return v is True or v == VISIBLE or isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= SMALL


def _small(v: Any) -> bool:
    """A partner that leaves a hiding value hiding: a real value (assumed within SMALL) or a constant within it."""
    return v in (UNKNOWN, VISIBLE) or isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= SMALL


class _Prover:
    def __init__(self, gm: fx.GraphModule, padded: frozenset, inputs: dict[str, AV]):
        self.gm, self.padded, self.env = gm, padded, {}
        self.inputs = inputs
        self.big = _big_constant(gm)  # a constant past SMALL outside a mask's picked value: no finite masks

    # ------------------------------------------------------------------ helpers
    def av(self, x: Any) -> AV | None:
        return self.env.get(x.name) if isinstance(x, fx.Node) else None

    def pdims(self, av: AV) -> dict[int, frozenset]:
        return {d: s for d, e in enumerate(av.shape) if (s := _syms(e, self.padded))}

    def fail(self, node, message, symbols=()):
        raise Unprovable(node, message, symbols)

    def sizes_only(self, node: fx.Node, shapes: list[tuple]) -> None:
        """Padded sizes may reach an op only as sizes (a view's, a new tensor's, an arange's or a slice's end),
        each growing with the padding, and the op's result may only grow where padded: an index, a start, a
        shift, a fill value or a scale computed from a padded size reads other data once padded (r1-r5 of the
        review of 2026-12-04), and a size that shrinks (``32 - s``) leaves no real prefix to slice back."""
        from ._padding_views import SIZE_ARGS, grows

        packet, schema = node.target.overloadpacket, node.target._schema.arguments
        for arg, value in zip(schema, list(node.args) + [None] * len(schema)):
            value = node.kwargs.get(arg.name, value)
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                sym = v.meta.get("val") if isinstance(v, fx.Node) else None
                if not isinstance(sym, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    continue
                syms = _syms(sym.node.expr, self.padded)
                if not syms:
                    continue
                size = arg.name in SIZE_ARGS or arg.name == "end" and packet in (aten.arange, aten.slice)
                if not size:
                    self.fail(node, f"its argument {arg.name} ({sym}) is computed from the padded size "
                                    f"{', '.join(map(str, syms))}", syms)
                if not grows(sym.node.expr, syms):
                    self.fail(node, f"its {arg.name} {sym} shrinks as {', '.join(map(str, syms))} grows", syms)
        for shape in shapes:
            for e in shape:
                syms = _syms(e, self.padded)
                if syms and not grows(e, syms):
                    self.fail(node, f"its result's size {e} does not grow with {', '.join(map(str, syms))}: no real "
                                    "prefix to keep", syms)

    def scrambled(self, av: AV, d: int) -> bool:
        """Whether dim ``d`` merges a padded factor inside another: its real positions are not its first ones."""
        return any(_syms(f, self.padded) for f in av.factors.get(d, ())[1:])

    def in_order(self, node, av: AV, d: int, what: str) -> None:
        if self.scrambled(av, d):
            self.fail(node, f"{what} dim {d}, which merges padded dims ({' x '.join(map(str, av.factors[d]))}): its "
                            "real positions are not its first ones", _syms(av.shape[d], self.padded))

    # ------------------------------------------------------------------ the walk
    def run(self) -> list[AV | None]:
        outputs = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                self.env[node.name] = self.inputs.get(node.name) if isinstance(val, torch.Tensor) else None
            elif node.op == "call_function":
                self.env[node.name] = self.call(node)
            elif node.op == "output":
                outputs = node.args[0]
            elif node.op == "get_attr":
                t = getattr(self.gm, node.target, None)
                self.env[node.name] = AV(tuple(_expr(s) for s in t.shape), concrete=t, const=t.item() if isinstance(
                    t, torch.Tensor) and t.numel() == 1 else None) if isinstance(t, torch.Tensor) else None
        flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return [self.av(o) for o in flat]

    def call(self, node: fx.Node) -> AV | None:
        val = node.meta.get("val")
        target = node.target
        if target is operator.getitem:
            src = node.args[0]
            parts = self.env.get(src.name)
            return parts[node.args[1]] if isinstance(parts, list) else None
        if not isinstance(target, torch._ops.OpOverload):
            return None  # SymInt arithmetic: checked where it is used
        if isinstance(val, (list, tuple)):
            return self.multi(node, val)
        if not isinstance(val, torch.Tensor):
            return None
        shape = tuple(_expr(s) for s in val.shape)
        self.sizes_only(node, [shape])
        ins = [a for a in _flat_args(node) if isinstance(a, fx.Node) and isinstance(self.av(a), AV)]
        touched = any(self.pdims(self.av(a)) for a in ins) or any(_syms(e, self.padded) for e in shape)
        if target._schema.is_mutable:
            for a in ins:
                if a.op == "placeholder" and self.pdims(self.av(a)):
                    self.fail(node, f"writes into the padded input {a.name} (the user's tensor would not see it)")
        from ._padding_rules import RULES

        rule = RULES.get(target.overloadpacket) or RULES.get(target)
        if rule is None:
            if "scaled_dot_product" in target.name():
                return self.attention(node, shape)
            if not touched:
                return AV(shape)
            self.fail(node, "no rule for this op on a padded dimension",
                      frozenset().union(*[_syms(e, self.padded) for e in shape]) if shape else ())
        return rule(self, node, shape)

    def multi(self, node: fx.Node, vals: Iterable[Any]) -> list[AV | None]:
        """Ops with several outputs: native_layer_norm (rows), split (views), attention."""
        name = node.target.overloadpacket
        shapes = [tuple(_expr(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in vals]
        self.sizes_only(node, [s for s in shapes if s is not None])
        if "scaled_dot_product" in node.target.name():
            first = self.attention(node, shapes[0])
            return [first] + [AV(s) if s is not None else None for s in shapes[1:]]
        if name in (aten.native_layer_norm, aten._fused_rms_norm):
            x = self.av(node.args[0])
            nd = len(node.args[1])
            self.no_padded_dims(node, x, range(len(x.shape) - nd, len(x.shape)), "normalizes over")
            return [AV(s, finite=x.finite) if s is not None else None for s in shapes]
        if name is aten.unbind:
            x = self.av(node.args[0])
            dim = _dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(x.shape))
            self.no_padded_dims(node, x, [dim], "unbinds")
            return [self.keep_dims(x, s, {o: (o if o < dim else o + 1) for o in range(len(s))}) for s in shapes]
        if name in (aten.split, aten.split_with_sizes, aten.chunk):
            x = self.av(node.args[0])
            dim = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(x.shape))
            self.no_padded_dims(node, x, [dim], "splits")
            return [self.keep_dims(x, s, {d: d for d in range(len(s))}) for s in shapes]
        ins = [a for a in _flat_args(node) if isinstance(a, fx.Node) and isinstance(self.av(a), AV)]
        if any(self.pdims(self.av(a)) for a in ins):
            self.fail(node, "no rule for this op on a padded dimension")
        return [AV(s) if s is not None else None for s in shapes]

    def no_padded_dims(self, node, x: AV, dims: Iterable[int], verb: str) -> None:
        pd = self.pdims(x)
        for d in dims:
            if d in pd:
                self.fail(node, f"{verb} dim {d}, which is padded ({', '.join(map(str, pd[d]))})", pd[d])

    def keep_dims(self, x: AV, shape: tuple, mapping: dict[int, int]) -> AV:
        """An AV for a result whose dim o holds x's dim mapping[o] position for position."""
        out = AV(shape, const=x.const, finite=x.finite, lower=x.lower, masks=x.masks)
        n, m = len(shape), len(x.shape)
        if n >= 2 and m >= 2 and mapping.get(n - 2) == m - 2 and mapping.get(n - 1) == m - 1:
            out.diag = x.diag
        for o, i in mapping.items():
            if i in x.factors:
                out.factors[o] = x.factors[i]
            if i in x.fill:
                out.fill[o] = x.fill[i]
            if i in x.pos:
                out.pos[o] = x.pos[i]
        return out

    # ------------------------------------------------------------------ attention
    def attention(self, node: fx.Node, shape: tuple) -> AV:
        schema = node.target._schema
        args = {a.name: v for a, v in zip(schema.arguments, node.args)}
        args.update(node.kwargs)
        q, k, v = (self.av(args[n]) for n in ("query", "key", "value"))
        mask = args.get("attn_mask") or args.get("attn_bias")
        mav = self.av(mask) if isinstance(mask, fx.Node) else None
        if args.get("dropout_p", 0.0):
            self.fail(node, "attention with dropout draws different random numbers once padded")
        kd, qd = len(k.shape) - 2, len(q.shape) - 2
        for t, name in ((q, "query"), (k, "key")):  # the head dim: summed over, and the default scale reads it
            hs = _syms(t.shape[-1], self.padded)
            if hs:
                self.fail(node, f"attention over a padded {name} head dim", hs)
        for t in (q, k, v):
            for d in range(len(t.shape) - 1):
                self.in_order(node, t, d, "attention reads")
        ks = _syms(k.shape[kd], self.padded)
        if ks:
            causal = bool(args.get("is_causal", False)) and sympy.simplify(q.shape[qd] - k.shape[kd]) == 0
            fill = mav.fill.get(len(mav.shape) - 1, "?") if mav is not None else "?"
            bool_mask = mav is not None and isinstance(mask, fx.Node) and mask.meta["val"].dtype == torch.bool
            masked = fill is False if bool_mask else _is_neg(fill)
            masked = masked or _hides(fill) and self.sees_diagonal(mav, q.shape[qd], k.shape[kd])
            real_kv = finite_along(k, kd) and finite_along(v, kd)
            if not (causal or masked) or not real_kv:
                self.fail(node, "attention over padded keys without a causal flag or a mask that hides them"
                          + ("" if real_kv else " (or keys and values not known finite there)"), ks)
        # its padded query rows: finite unless a mask hides every key from them (a softmax over nothing: NaN)
        finite = all(t.finite and all(finite_value(f) for f in t.fill.values()) for t in (q, k, v))
        if mav is not None and len(mav.shape) >= 2 and _syms(mav.shape[-2], self.padded):
            fq = mav.fill.get(len(mav.shape) - 2, UNKNOWN)
            bool_mask = mask.meta["val"].dtype == torch.bool
            finite = finite and (fq is True if bool_mask else fq == VERY_NEG or isinstance(fq, (int, float))
                                 and not isinstance(fq, bool) and finite_value(float(fq)))
        return AV(shape, finite=finite)

    def sees_diagonal(self, x: AV, rows: Any, cols: Any) -> bool:
        """Every real row of x's last two dims (rows x cols, padded alike) has a key it sees: its diagonal."""
        return x is not None and self.big is None and len(x.shape) >= 2 and _sees(x.diag) and all(
            sympy.simplify(a - cols) == 0 for a in (rows, x.shape[-1], x.shape[-2]))


def _big_constant(gm: fx.GraphModule) -> str | None:
    """The first constant of the graph beyond SMALL (infinities too) used otherwise than as the value a mask
    picks (where's branches, masked_fill's value, or a full / scalar_tensor / one-element constant read only
    there), or None. Such a constant can make values past SMALL, which finite masks need not hide."""
    def picked(node: fx.Node, i: int) -> bool:
        packet = getattr(node.target, "overloadpacket", None)
        return packet is aten.where and i in (1, 2) or packet is aten.masked_fill and i == 2

    def big(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > SMALL

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = getattr(gm, node.target, None)
            values = [t.item()] if isinstance(t, torch.Tensor) and t.numel() == 1 else []
        elif node.op == "call_function" and getattr(node.target, "overloadpacket", None) in (aten.full,
                                                                                            aten.scalar_tensor):
            values = [a for a in node.args if isinstance(a, (int, float))]
        else:
            values = []
        if any(big(v) for v in values) and not all(
                picked(u, i) for u in node.users for i, a in enumerate(u.args) if a is node):
            return node.name
        for i, a in enumerate(_flat_args(node) if node.op == "call_function" else ()):
            if big(a) and not picked(node, i) and getattr(node.target, "overloadpacket", None) not in (
                    aten.full, aten.scalar_tensor):
                return node.name
    return None


def _flat_args(node: fx.Node) -> list[Any]:
    out: list[Any] = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def prove(gm: fx.GraphModule, padded: frozenset, inputs: dict[str, AV]) -> list[AV | None]:
    """Walk ``gm`` (ATen, sizes as sympy over Dynamo's symbols); ``padded``: the symbols to pad; ``inputs``:
    what is known of each tensor placeholder (padded ones with fill zero/False). Returns the outputs' AVs, or
    raises Unprovable naming the op and symbols at fault."""
    prover = _Prover(gm, padded, inputs)
    outs = prover.run()
    for i, o in enumerate(outs):
        for d in range(len(o.shape) if o is not None else 0):
            if prover.scrambled(o, d):  # sliced back as a prefix, which it is not
                raise Unprovable(None, f"output {i} merges padded dims in dim {d}", _syms(o.shape[d], padded))
    return outs

