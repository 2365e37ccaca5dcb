"""Proof that padding an input dimension cannot change the real part of a graph's outputs (the bucketing pass).

Padding appends positions to some dimensions of the inputs (zeros, or False); the padded run computes a larger
result, of which the bucketing pass keeps the leading, real part. That part equals the unpadded result when no
real value reads a padded one. This module checks that over the graph traced to ATen (``make_fx`` under
Dynamo's fake mode, so sizes are sympy expressions over Dynamo's symbols), op by op, as an abstract
interpretation. A dimension is *padded* when its size involves a padded symbol; its real extent is that size
with the real values substituted. Per tensor it keeps:

  clean   its real part equals the unpadded computation's (what the outputs must be)
  fill    per padded dim d: a constant known to sit where d is padded and every other dim is real (zero,
          False, -inf...): what makes a reduction across d harmless (a sum over zeros, a softmax over -inf)
  pos     per dim: the value is the index along it plus a constant (``arange``): what makes a causal mask
          provable (a key index past the real ones exceeds every real query index)
  const   the value of every element, where known (``full``, ``scalar_tensor``, a scalar)
  concrete  a static tensor's real values (a causal mask kept as a buffer, sliced to the sequence length)

The rules, each a reason the real part stays clean:
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
Values of the real computation are assumed finite (a real +inf meeting a -inf mask would give NaN unpadded too).
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
    clean: bool = True
    fill: dict[int, Any] = dataclasses.field(default_factory=dict)
    pos: dict[int, int] = dataclasses.field(default_factory=dict)
    const: Any = None
    concrete: torch.Tensor | None = None
    # per dim merged by a reshape: the sizes it was merged from, outermost first (a split must follow them)
    factors: dict[int, tuple] = dataclasses.field(default_factory=dict)


def _op_name(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", None) or str(t)


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _syms(expr: Any, padded: frozenset) -> frozenset:
    return frozenset(getattr(expr, "free_symbols", ())) & padded


NEG = float("-inf")


def _is_neg(v: Any) -> bool:
    return isinstance(v, float) and v <= -1e30  # -inf, or a dtype's lowest value as masks use it


class _Prover:
    def __init__(self, gm: fx.GraphModule, padded: frozenset, inputs: dict[str, AV]):
        self.gm, self.padded, self.env = gm, padded, {}
        self.inputs = inputs

    # ------------------------------------------------------------------ helpers
    def av(self, x: Any) -> AV | None:
        return self.env.get(x.name) if isinstance(x, fx.Node) else None

    def pdims(self, av: AV) -> dict[int, frozenset]:
        return {d: s for d, e in enumerate(av.shape) if (s := _syms(e, self.padded))}

    def fail(self, node, message, symbols=()):
        raise Unprovable(node, message, symbols)

    def sym_value_used(self, node: fx.Node, value: Any, what: str) -> None:
        """A SymInt (or an expression of one) given as a value, not a size: the result depends on the padded size."""
        if isinstance(value, fx.Node) and not isinstance(value.meta.get("val"), torch.Tensor):
            s = _syms(_expr(value.meta["val"]), self.padded) if isinstance(value.meta.get("val"), torch.SymInt) \
                else frozenset()
            if s:
                self.fail(node, f"{what} is computed from the padded size {', '.join(map(str, s))}", s)

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
                self.env[node.name] = AV(tuple(_expr(s) for s in t.shape), concrete=t) \
                    if isinstance(t, torch.Tensor) else None
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
        ins = [a for a in _flat_args(node) if isinstance(a, fx.Node) and isinstance(self.av(a), AV)]
        touched = any(self.pdims(self.av(a)) for a in ins) or any(_syms(e, self.padded) for e in shape)
        if target._schema.is_mutable:
            for a in ins:
                if a.op == "placeholder" and self.pdims(self.av(a)):
                    self.fail(node, f"writes into the padded input {a.name} (the user's tensor would not see it)")
        rule = _RULES.get(target.overloadpacket) or _RULES.get(target)
        if rule is None:
            if "scaled_dot_product" in target.name():
                return self.attention(node, shape)
            if not touched:
                return AV(shape, clean=all(self.av(a).clean for a in ins))
            self.fail(node, "no rule for this op on a padded dimension",
                      frozenset().union(*[_syms(e, self.padded) for e in shape]) if shape else ())
        return rule(self, node, shape)

    def multi(self, node: fx.Node, vals: Iterable[Any]) -> list[AV | None]:
        """Ops with several outputs: native_layer_norm (rows), split (views), attention."""
        name = node.target.overloadpacket
        shapes = [tuple(_expr(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in vals]
        if "scaled_dot_product" in node.target.name():
            first = self.attention(node, shapes[0])
            return [first] + [AV(s, clean=first.clean) if s is not None else None for s in shapes[1:]]
        if name in (aten.native_layer_norm, aten._fused_rms_norm):
            x = self.av(node.args[0])
            nd = len(node.args[1])
            self.no_padded_dims(node, x, range(len(x.shape) - nd, len(x.shape)), "normalizes over")
            return [AV(s, clean=x.clean) if s is not None else None for s in shapes]
        if name in (aten.split, aten.split_with_sizes, aten.unbind, aten.chunk):
            x = self.av(node.args[0])
            dim = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(x.shape))
            self.no_padded_dims(node, x, [dim], "splits")
            return [self.keep_dims(x, s, {d: d for d in range(len(s))}) for s in shapes]
        ins = [a for a in _flat_args(node) if isinstance(a, fx.Node) and isinstance(self.av(a), AV)]
        if any(self.pdims(self.av(a)) for a in ins):
            self.fail(node, "no rule for this op on a padded dimension")
        return [AV(s, clean=all(self.av(a).clean for a in ins)) if s is not None else None for s in shapes]

    def no_padded_dims(self, node, x: AV, dims: Iterable[int], verb: str) -> None:
        pd = self.pdims(x)
        for d in dims:
            if d in pd:
                self.fail(node, f"{verb} dim {d}, which is padded ({', '.join(map(str, pd[d]))})", pd[d])

    def keep_dims(self, x: AV, shape: tuple, mapping: dict[int, int], *, clean: bool | None = None) -> AV:
        """An AV for a result whose dim o holds x's dim mapping[o] position for position."""
        out = AV(shape, clean=x.clean if clean is None else clean, const=x.const)
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
        clean = q.clean and k.clean and v.clean
        mask = args.get("attn_mask") or args.get("attn_bias")
        mav = self.av(mask) if isinstance(mask, fx.Node) else None
        if mav is not None:
            clean = clean and mav.clean
        if args.get("dropout_p", 0.0):
            self.fail(node, "attention with dropout draws different random numbers once padded")
        kd, qd = len(k.shape) - 2, len(q.shape) - 2
        ks = _syms(k.shape[kd], self.padded)
        if ks:
            causal = bool(args.get("is_causal", False)) and sympy.simplify(q.shape[qd] - k.shape[kd]) == 0
            masked = mav is not None and (mav.fill.get(len(mav.shape) - 1) in (False,) or
                                          _is_neg(mav.fill.get(len(mav.shape) - 1)))
            if not (causal or masked):
                self.fail(node, "attention over padded keys without a causal flag or a mask that hides them", ks)
        return AV(shape, clean=clean)


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


# ---------------------------------------------------------------------- rules
_RULES: dict[Any, Any] = {}


def _rule(*ops):
    def register(fn):
        for op in ops:
            _RULES[op] = fn
        return fn

    return register


_POINTWISE_BINARY = [aten.add, aten.sub, aten.mul, aten.div, aten.rsub, aten.pow, aten.maximum, aten.minimum,
                     aten.eq, aten.ne, aten.le, aten.lt, aten.ge, aten.gt, aten.bitwise_and, aten.bitwise_or,
                     aten.logical_and, aten.logical_or, aten.bitwise_xor, aten.where, aten.masked_fill,
                     aten.fmod, aten.remainder, aten.atan2, aten.copysign, aten.floor_divide, aten.clamp,
                     aten.clamp_min, aten.clamp_max, aten.lerp, aten.addcmul, aten.addcdiv]
_POINTWISE_UNARY = [aten.neg, aten.exp, aten.log, aten.sqrt, aten.rsqrt, aten.tanh, aten.sigmoid, aten.sin,
                    aten.cos, aten.relu, aten.gelu, aten.silu, aten.abs, aten.reciprocal, aten.erf, aten.log1p,
                    aten.expm1, aten.bitwise_not, aten.logical_not, aten._to_copy, aten.clone, aten.detach,
                    aten.alias, aten.lift_fresh_copy, aten.hardtanh, aten.leaky_relu, aten.elu, aten.softplus,
                    aten.mish, aten.hardswish, aten.hardsigmoid, aten.sign, aten.floor, aten.ceil, aten.round,
                    aten.trunc, aten.square, aten.isnan, aten.isinf, aten.nan_to_num, aten.tan, aten.atan,
                    aten.contiguous, aten.type_as, aten.to, aten.gelu_, aten.dropout]
_NEUTRAL = {"sum": 0, "max": NEG, "any": False}


def _broadcast_value(p: _Prover, a: Any, out_ndim: int, d: int, shape: tuple) -> Any:
    """The value operand ``a`` has where out dim ``d`` is padded and the others real: a constant, or
    "?" (unknown, finite: a real value, or a padded one not known)."""
    if not isinstance(a, fx.Node):
        return a if isinstance(a, (bool, int, float)) else "?"
    av = p.av(a)
    if av is None:
        return "?"
    if av.const is not None:
        return av.const
    ad = d - (out_ndim - len(av.shape))
    if ad < 0 or not _syms(av.shape[ad], p.padded):
        return "?"  # broadcast along d, or not padded there: a real value
    return av.fill.get(ad, "?")


def _combine(op, values: list[Any], kwargs: dict | None = None) -> Any:
    """A pointwise op's value at one region from its operands' values there (constants or "?")."""
    if all(v != "?" for v in values):
        kwargs = {k: v for k, v in (kwargs or {}).items() if k == "dtype"}
        try:
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                r = op(*[torch.tensor(v) if isinstance(v, (bool, int, float)) else v for v in values], **kwargs)
            return r.item() if isinstance(r, torch.Tensor) and r.numel() == 1 else "?"
        except Exception:  # noqa: BLE001 - no constant then
            return "?"
    packet = op.overloadpacket
    if packet in (aten.add,) and any(_is_neg(v) for v in values):
        return NEG
    if packet in (aten.sub,) and _is_neg(values[0]):
        return NEG
    if packet is aten.mul and any(v == 0 and not isinstance(v, bool) for v in values):
        return 0.0
    if packet in (aten.bitwise_and, aten.logical_and) and any(v is False or v == 0 for v in values if v != "?"):
        return False
    if packet in (aten.bitwise_or, aten.logical_or) and any(v is True for v in values):
        return True
    if packet is aten.where and values[0] != "?":
        return values[1] if values[0] else values[2]
    if packet is aten.masked_fill and values[1] != "?":
        return values[2] if values[1] else values[0]
    return "?"


@_rule(*_POINTWISE_BINARY, *_POINTWISE_UNARY)
def _pointwise(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    operands = [a for a in node.args] + [v for k, v in node.kwargs.items() if k in ("other", "value", "self")]
    tensors = [a for a in operands if isinstance(a, fx.Node) and isinstance(p.av(a), AV)]
    for a in operands:
        p.sym_value_used(node, a, "an operand")
    clean = all(p.av(a).clean for a in tensors)
    out = AV(shape, clean=clean)
    nd = len(shape)
    for a in tensors:  # dims kept position for position keep what they were merged from
        av = p.av(a)
        for d, f in av.factors.items():
            o = d + nd - len(av.shape)
            if sympy.simplify(av.shape[d] - shape[o]) == 0:
                out.factors.setdefault(o, f)
    if all(p.av(a).const is not None for a in tensors) and tensors:
        out.const = _combine(node.target, [p.av(a).const if isinstance(a, fx.Node) and p.av(a) else a
                                           for a in node.args], node.kwargs)
        out.const = None if out.const == "?" else out.const
    for d, s in enumerate(shape):
        if not _syms(s, p.padded):
            continue
        v = _combine(node.target, [_broadcast_value(p, a, nd, d, shape) for a in node.args], node.kwargs)
        if v != "?":
            out.fill[d] = v
    # position tensors: arange + c stays a position; a comparison of two positions is a causal mask
    packet = node.target.overloadpacket
    if packet in (aten.add, aten.sub, aten._to_copy, aten.clone, aten.detach, aten.alias) and tensors:
        a = p.av(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        c = node.args[1] if len(node.args) > 1 else 0
        if a is not None and a.pos and isinstance(c, int) and not isinstance(c, bool):
            off = len(shape) - len(a.shape)
            out.pos = {d + off: o + (c if packet is aten.add else -c if packet is aten.sub else 0)
                       for d, o in a.pos.items()}
    if packet in (aten.le, aten.lt, aten.ge, aten.gt) and len(tensors) == 2:
        _compare_positions(p, node, out)
    if p.av(node.args[0]) is not None and packet in (aten._to_copy, aten.clone, aten.detach, aten.alias):
        out.concrete = p.av(node.args[0]).concrete
    return out


def _compare_positions(p: _Prover, node: fx.Node, out: AV) -> None:
    a, b = p.av(node.args[0]), p.av(node.args[1])
    nd = len(out.shape)
    pa = {d + nd - len(a.shape): o for d, o in a.pos.items()}
    pb = {d + nd - len(b.shape): o for d, o in b.pos.items()}
    if len(pa) != 1 or len(pb) != 1:
        return
    (da, oa), (db, ob) = next(iter(pa.items())), next(iter(pb.items()))
    if da == db or oa != ob or _syms(out.shape[da], p.padded) != _syms(out.shape[db], p.padded):
        return
    if sympy.simplify(out.shape[da] - out.shape[db]) != 0:
        return
    packet = node.target.overloadpacket
    # where b's dim is padded and a's real: b > a
    out.fill[db] = packet in (aten.lt, aten.le)
    out.fill[da] = packet in (aten.gt, aten.ge)


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
    kept = [i for i, e in enumerate(x.shape) if not (e == 1 and len(shape) < len(x.shape))]
    if len(kept) != len(shape):
        kept = [i for i, e in enumerate(x.shape) if e != 1][: len(shape)]
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
    if x.concrete is not None and start == 0:
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
    if s and (not isinstance(index, int) or index < 0):
        p.fail(node, f"reads dim {dim} at {index}, which moves once padded", s)
    return p.keep_dims(x, shape, {o: (o if o < dim else o + 1) for o in range(len(shape))})


@_rule(aten.arange)
def _arange(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    args = [a for a in node.args]
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    for v, what in ((start, "the start of an arange"), (step, "the step of an arange")):
        p.sym_value_used(node, v, what)
    out = AV(shape)
    if isinstance(start, int) and step == 1:
        out.pos[0] = start
    return out


@_rule(aten.full, aten.zeros, aten.ones, aten.empty, aten.new_ones, aten.new_zeros, aten.new_full,
       aten.new_empty, aten.scalar_tensor, aten.full_like, aten.zeros_like, aten.ones_like, aten.empty_like)
def _creation(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    packet = node.target.overloadpacket
    value = {aten.zeros: 0, aten.ones: 1, aten.new_ones: 1, aten.new_zeros: 0, aten.zeros_like: 0,
             aten.ones_like: 1}.get(packet)
    if packet in (aten.full, aten.new_full, aten.full_like, aten.scalar_tensor):
        value = node.args[1] if packet is not aten.scalar_tensor else node.args[0]
        p.sym_value_used(node, value, "the fill value")
    dtype = node.meta["val"].dtype
    if value is not None and dtype == torch.bool:
        value = bool(value)
    return AV(shape, const=value if isinstance(value, (bool, int, float)) else None)


@_rule(aten.embedding)
def _embedding(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    w, idx = p.av(node.args[0]), p.av(node.args[1])
    p.no_padded_dims(node, w, range(len(w.shape)), "looks up a table padded in")
    return AV(shape, clean=w.clean and idx.clean)


@_rule(aten.index)
def _index(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    indices = list(node.args[1])
    clean = x.clean
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
        clean = clean and iav.clean
        s = _syms(x.shape[d], p.padded)
        if not s:
            continue
        # reading a padded dim: only at positions (arange of the same length) or constant indices >= 0
        ipos = {k + nd - len(iav.shape): o for k, o in iav.pos.items()}  # nd: index dims end there
        if len(ipos) == 1 and next(iter(ipos.values())) == 0:
            od = next(iter(ipos))
            if sympy.simplify(shape[od] - x.shape[d]) == 0 and d in x.pos:
                out.pos[od] = x.pos[d]
            continue
        if iav.const is not None and isinstance(iav.const, int) and iav.const >= 0:
            continue
        p.fail(node, f"indexes the padded dim {d} with values not known to be real positions", s)
    out.clean = clean
    return out


@_rule(aten.cat)
def _cat(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    parts = [p.av(a) for a in node.args[0]]
    dim = _dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    # along a padded dim, only the last part may be padded (its positions stay after every real one)
    padded_parts = [i for i, a in enumerate(parts) if _syms(a.shape[dim], p.padded)]
    if padded_parts and padded_parts != [len(parts) - 1]:
        p.fail(node, f"concatenates along dim {dim} after a padded part: the parts after it would move",
               _syms(parts[padded_parts[0]].shape[dim], p.padded))
    out = AV(shape, clean=all(a.clean for a in parts))
    if len(parts) == 1 or padded_parts:
        last = parts[-1]
        for d in last.fill:
            if d != dim:
                vals = [a.fill.get(d, "?") for a in parts]
                if all(v == vals[0] for v in vals) and vals[0] != "?":
                    out.fill[d] = vals[0]
    return out


def _reduce_dims(node: fx.Node, ndim: int) -> list[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    dims = [dims] if isinstance(dims, int) else dims
    return [_dim(d, ndim) for d in dims]


def _reduction(kind: str):
    def rule(p: _Prover, node: fx.Node, shape: tuple) -> AV:
        x = p.av(node.args[0])
        pd = p.pdims(x)
        reduced = [d for d in _reduce_dims(node, len(x.shape)) if d in pd]
        if len(reduced) > 1:  # the fills say what sits where one dim is padded, not where several are
            p.fail(node, f"reduces ({kind}) over several padded dims at once ({reduced})",
                   frozenset().union(*[pd[d] for d in reduced]))
        for d in reduced:
            if d in pd:
                neutral = _NEUTRAL.get(kind)
                f = x.fill.get(d, "?")
                ok = kind != "mean" and f != "?" and (f == neutral or kind == "max" and _is_neg(f))
                if not ok:
                    p.fail(node, f"reduces ({kind}) over dim {d}, which is padded and not known to hold "
                                 f"{neutral if neutral is not None else 'nothing'} there", pd[d])
        return AV(shape, clean=x.clean)

    return rule


_RULES[aten.sum] = _reduction("sum")
_RULES[aten.mean] = _reduction("mean")
_RULES[aten.var] = _reduction("mean")
_RULES[aten.var_mean] = _reduction("mean")
_RULES[aten.amax] = _reduction("max")
_RULES[aten.amin] = _reduction("min")
_RULES[aten.any] = _reduction("any")
_RULES[aten.argmax] = _reduction("max")
_RULES[aten.logsumexp] = _reduction("max")


@_rule(aten._softmax, aten._log_softmax, aten.softmax, aten.log_softmax)
def _softmax(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    d = _dim(node.args[1], len(shape))
    pd = p.pdims(x)
    out = p.keep_dims(x, shape, {o: o for o in range(len(shape)) if o != d})
    out.pos, out.const = {}, None
    if d in pd:
        if not _is_neg(x.fill.get(d, "?")):
            p.fail(node, f"softmax over dim {d}, which is padded and not masked (-inf) there", pd[d])
        out.fill[d] = 0.0 if node.target.overloadpacket in (aten._softmax, aten.softmax) else NEG
    return out


@_rule(aten.cumsum, aten.cumprod)
def _cumsum(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])  # prefix sums: a real position reads only the ones before it
    return AV(shape, clean=x.clean)


def _contract(p: _Prover, node: fx.Node, a: AV, b: AV, ka: int, kb: int, shape: tuple, clean: bool) -> AV:
    s = _syms(a.shape[ka], p.padded) | _syms(b.shape[kb], p.padded)
    if s and not (a.fill.get(ka) == 0 or b.fill.get(kb) == 0):
        p.fail(node, "a matrix product sums over a padded dim that is not known to be zero on either side", s)
    out = AV(shape, clean=clean and a.clean and b.clean)
    for d in range(len(shape) - 1):  # batch and rows come from a; the last dim from b
        if d in a.factors and d < len(a.shape) - 1:
            out.factors[d] = a.factors[d]
    if len(b.shape) - 1 in b.factors:
        out.factors[len(shape) - 1] = b.factors[len(b.shape) - 1]
    return out


@_rule(aten.mm, aten.bmm)
def _mm(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    a, b = p.av(node.args[0]), p.av(node.args[1])
    return _contract(p, node, a, b, len(a.shape) - 1, len(b.shape) - 2, shape, True)


@_rule(aten.addmm, aten.baddbmm)
def _addmm(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    bias, a, b = (p.av(x) for x in node.args[:3])
    return _contract(p, node, a, b, len(a.shape) - 1, len(b.shape) - 2, shape, bias.clean)


@_rule(aten.linear)
def _linear(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x, w = p.av(node.args[0]), p.av(node.args[1])
    bias = p.av(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
    return _contract(p, node, x, w, len(x.shape) - 1, len(w.shape) - 1, shape, bias is None or bias.clean)


@_rule(aten.sym_size, aten.sym_stride, aten.sym_numel)
def _sym(p, node, shape):
    return None


def prove(gm: fx.GraphModule, padded: frozenset, inputs: dict[str, AV]) -> list[AV | None]:
    """Walk ``gm`` (ATen, sizes as sympy over Dynamo's symbols); ``padded``: the symbols to pad; ``inputs``:
    what is known of each tensor placeholder (padded ones with fill zero/False). Returns the outputs' AVs, or
    raises Unprovable naming the op and symbols at fault."""
    outs = _Prover(gm, padded, inputs).run()
    for i, o in enumerate(outs):
        if o is not None and not o.clean:
            raise Unprovable(None, f"output {i} reads padded positions")
    return outs

