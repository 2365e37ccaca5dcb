"""The padding proof's rules, op by op (passes/_padding_proof.py says what they prove and why)."""

from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx as fx

from ._padding_proof import (EXACT_POSITIONS, SMALL, UNBOUNDED, UNKNOWN, AV, NEG, VERY_NEG, VISIBLE, _dim, _hides,
                             _is_neg, _Prover, _sees, _small, _syms, finite_along, finite_value)

aten = torch.ops.aten

RULES: dict[Any, Any] = {}


def _rule(*ops):
    def register(fn):
        for op in ops:
            RULES[op] = fn
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
                    aten.contiguous, aten.type_as, aten.to]
# ops that can make a finite value infinite: their result is finite where their argument is bounded away from 0
_UNBOUNDED = {aten.div, aten.reciprocal, aten.log, aten.log1p, aten.rsqrt, aten.sqrt, aten.pow, aten.exp,
              aten.expm1, aten.tan, aten.atan2, aten.fmod, aten.remainder, aten.floor_divide, aten.lerp,
              aten.addcdiv, aten.softplus}
_NEUTRAL = {"sum": 0, "max": NEG, "any": False}


def _broadcast_value(p: _Prover, a: Any, out_ndim: int, d: int, shape: tuple) -> Any:
    """The value operand ``a`` has where out dim ``d`` is padded and the others real: a constant, "?"
    (unknown and finite: a real value, or a padded one not known), or "?inf" (a padded one that may be
    infinite)."""
    if not isinstance(a, fx.Node):
        return a if isinstance(a, (bool, int, float)) else UNKNOWN
    av = p.av(a)
    if av is None:
        return UNKNOWN
    if av.const is not None:
        return av.const
    ad = d - (out_ndim - len(av.shape))
    if av.masks and ad >= 0 and ad not in av.fill:  # a mask's value there may be its hiding one, far past SMALL
        return UNBOUNDED
    if ad < 0 or not _syms(av.shape[ad], p.padded):
        return UNKNOWN  # broadcast along d, or not padded there: a real value
    return av.fill.get(ad, UNKNOWN if av.finite else UNBOUNDED)


def _combine(op, values: list[Any], kwargs: dict | None = None, dtypes: list | None = None) -> Any:
    """A pointwise op's value at one region from its operands' values there (constants, "?" or "?inf"),
    computed in the operands' dtypes."""
    kwargs = dict(kwargs or {})
    if kwargs.get("alpha", 1) != 1:
        return UNKNOWN  # add/sub with alpha: not followed
    packet = op.overloadpacket
    if any(v in (VERY_NEG, VISIBLE) for v in values):  # markers, not numbers: only these ops keep them
        to = kwargs.get("dtype")
        return _markers(packet, values) if to is None or to.is_floating_point else UNKNOWN
    if all(v not in (UNKNOWN, UNBOUNDED) for v in values):
        # the op's own keywords (gelu's approximate, div's rounding_mode, the dtype), not where the result lives
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "memory_format",
                                                                "non_blocking")}
        dtypes = dtypes or [None] * len(values)
        try:
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                r = op(*[torch.tensor(v, dtype=dt) if isinstance(v, (bool, int, float)) else v
                         for v, dt in zip(values, dtypes)], **kwargs)
            return r.item() if isinstance(r, torch.Tensor) and r.numel() == 1 else UNKNOWN
        except Exception:  # noqa: BLE001 - no constant then
            return UNKNOWN
    finite = UNBOUNDED not in values  # the absorbing rules below hold for finite partners only
    if packet in (aten.add,) and finite and any(_is_neg(v) for v in values):
        return NEG
    if packet in (aten.sub,) and finite and _is_neg(values[0]) and not any(_is_neg(v) for v in values[1:]):
        return NEG
    if packet is aten.mul and finite and any(v == 0 and not isinstance(v, bool) for v in values
                                             if v not in (UNKNOWN, UNBOUNDED)):
        return 0.0
    if packet in (aten.bitwise_and, aten.logical_and) and any(v is False or v == 0 for v in values
                                                               if v not in (UNKNOWN, UNBOUNDED)):
        return False
    if packet in (aten.bitwise_or, aten.logical_or) and any(v is True for v in values):
        return True
    if packet is aten.where and values[0] not in (UNKNOWN, UNBOUNDED):
        return values[1] if values[0] else values[2]
    if packet is aten.masked_fill and values[1] not in (UNKNOWN, UNBOUNDED):
        return values[2] if values[1] else values[0]
    return _hide(values, packet)


_KEEP = (aten._to_copy, aten.clone, aten.alias, aten.detach, aten.contiguous, aten.lift_fresh_copy, aten.to,
         aten.type_as)


def _markers(packet, values: list[Any]) -> Any:
    """VERY_NEG (a hiding mask value plus a real one) and VISIBLE (a real value no mask hid) through an op."""
    if packet is aten.where and isinstance(values[0], bool):
        return values[1] if values[0] else values[2]
    if packet in _KEEP:
        return values[0]
    if packet in (aten.add, aten.sub) and len(values) == 2:
        hide = _hide(values, packet)
        return hide if hide != UNKNOWN else VISIBLE if all(_sees(v) for v in values) else UNKNOWN
    if packet in (aten.mul, aten.div) and values[0] == VISIBLE and len(values) == 2 and _small(values[1]) \
            and values[1] not in (0, "?", VISIBLE) and (packet is aten.mul or abs(values[1]) >= 1 / SMALL):
        return VISIBLE  # scores times a scale
    return UNKNOWN


def _hide(values: list[Any], packet) -> Any:
    """A hiding mask value (finite, <= HIDE) plus or minus one within SMALL stays hiding: VERY_NEG."""
    if len(values) != 2:
        return UNKNOWN
    a, b = values
    if packet is aten.add and (_hides(a) and _small(b) or _hides(b) and _small(a)):
        return VERY_NEG
    if packet is aten.sub and _hides(a) and _small(b):
        return VERY_NEG
    return UNKNOWN


def _dtype(a: Any) -> Any:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


@_rule(*_POINTWISE_BINARY, *_POINTWISE_UNARY)
def _pointwise(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    operands = [a for a in node.args] + [v for k, v in node.kwargs.items() if k in ("other", "value", "self")]
    tensors = [a for a in operands if isinstance(a, fx.Node) and isinstance(p.av(a), AV)]
    out = AV(shape)
    nd, nan_fill = len(shape), False
    for a in tensors:  # dims kept position for position keep what they were merged from
        av = p.av(a)
        for d, f in av.factors.items():
            o = d + nd - len(av.shape)
            if sympy.simplify(av.shape[d] - shape[o]) == 0:
                out.factors.setdefault(o, f)
    for a in tensors:  # a partner laid out otherwise along a merged dim would meet other positions
        av = p.av(a)
        for o in out.factors:
            d = o - (nd - len(av.shape))
            if d >= 0 and av.shape[d] != 1 and av.factors.get(d) != out.factors[o] and p.scrambled(out, o):
                p.in_order(node, out, o, "combines along")
    dtypes = [_dtype(a) for a in node.args]
    if all(p.av(a).const is not None for a in tensors) and tensors:
        out.const = _combine(node.target, [p.av(a).const if isinstance(a, fx.Node) and p.av(a) else a
                                           for a in node.args], node.kwargs, dtypes)
        out.const = None if out.const in (UNKNOWN, UNBOUNDED, VERY_NEG, VISIBLE) else out.const
    for d, s in enumerate(shape):
        if not _syms(s, p.padded):
            continue
        v = _combine(node.target, [_broadcast_value(p, a, nd, d, shape) for a in node.args], node.kwargs, dtypes)
        if isinstance(v, float) and v != v:  # NaN ((-0.5) ** 0.5 at a zero): no fill, and not finite there
            nan_fill = True
        elif v not in (UNKNOWN, UNBOUNDED, VISIBLE):
            out.fill[d] = v
    out.diag = _diagonal(p, node, shape, dtypes)
    out.masks = any(p.av(a).masks or _hides(p.av(a).const) for a in tensors) or any(_hides(a) for a in node.args)
    packet = node.target.overloadpacket
    out.finite, out.lower = _finite(p, node, packet, tensors, out)
    out.finite = out.finite and not nan_fill
    # position tensors: arange + c stays a position (in a dtype that holds every position exactly); a comparison
    # of two positions is a causal mask
    if packet in (aten.add, aten.sub, aten._to_copy, aten.clone, aten.detach, aten.alias) and tensors \
            and node.kwargs.get("alpha", 1) == 1 and node.meta["val"].dtype in EXACT_POSITIONS:
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


def _square(p: _Prover, shape: tuple) -> bool:
    return len(shape) >= 2 and bool(_syms(shape[-1], p.padded)) and sympy.simplify(shape[-1] - shape[-2]) == 0


def _diagonal(p: _Prover, node: fx.Node, shape: tuple, dtypes: list) -> Any:
    """The result's value on the real diagonal of its last two dims (AV.diag), or None where not known."""
    if not _square(p, shape):
        return None
    nd, values, keys = len(shape), [], []
    for a in node.args:
        av = p.av(a) if isinstance(a, fx.Node) else None
        if av is None:
            values.append(a if isinstance(a, (bool, int, float)) and not isinstance(a, fx.Node) else UNKNOWN)
            continue
        full = len(av.shape) >= 2 and all(sympy.simplify(av.shape[j] - shape[-1]) == 0 for j in (-1, -2))
        values.append(av.diag if full and av.diag is not None else av.const if av.const is not None else UNKNOWN)
        keys.append(av.keyed[:3] + (av.keyed[3] + nd - len(av.shape),) if av.keyed else None)
    packet = node.target.overloadpacket
    if packet in (aten.eq, aten.ne) and len(keys) == 2 and all(keys) and keys[0][:3] == keys[1][:3] and \
            {keys[0][3], keys[1][3]} == {nd - 2, nd - 1}:
        return packet is aten.eq  # one source read at the query's and at the key's position: equal on the diagonal
    v = _combine(node.target, values, node.kwargs, dtypes)
    return None if v in (UNKNOWN, UNBOUNDED) else v


def _finite(p: _Prover, node: fx.Node, packet, tensors: list, out: AV) -> tuple[bool, float | None]:
    """(whether the result's padded values not in its fills are finite, a lower bound on them or None)."""
    avs = [p.av(a) for a in tensors]
    finite = all(a.finite for a in avs)
    consts = [a for a in node.args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    lower = None
    if packet is aten.pow and consts and consts[0] == 2 or packet is aten.mul and len(node.args) == 2 \
            and node.args[0] is node.args[1]:
        lower = 0.0  # x * x
    elif packet is aten.add and len(avs) == 1 and consts and avs[0].lower is not None:
        lower = avs[0].lower + consts[0]
    if packet in _UNBOUNDED:
        arg = avs[0] if avs else None
        bounded = arg is not None and arg.lower is not None and arg.lower > 0 and packet in (
            aten.rsqrt, aten.sqrt, aten.log, aten.reciprocal)  # rsqrt(mean(x * x) + eps)
        divisor_const = packet is aten.div and len(node.args) > 1 and isinstance(node.args[1], (int, float)) \
            and node.args[1] != 0
        # x ** 2: as finite as x; a fractional power of a negative value is NaN
        power = packet is aten.pow and consts and consts[0] >= 0 and float(consts[0]).is_integer()
        finite = finite and (bounded or divisor_const or power)
    if packet in (aten.where, aten.masked_fill):  # an infinite constant shows where the condition picks it
        picks = [a for a in node.args[1:] if isinstance(a, float) and not torch.isfinite(torch.tensor(a))]
        picks += [a for a in tensors[1:] if p.av(a).const is not None and isinstance(p.av(a).const, float)
                  and not torch.isfinite(torch.tensor(p.av(a).const))]
        if picks:  # finite where, for every padded dim, the fill is known or the condition picks the other side
            cond = node.args[1] if packet is aten.masked_fill else node.args[0]
            other = False if packet is aten.masked_fill else True
            nd = len(out.shape)
            finite = finite and all(d in out.fill or _broadcast_value(p, cond, nd, d, out.shape) is other
                                    for d, e in enumerate(out.shape) if _syms(e, p.padded))
    return finite, lower


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
    if {da, db} == {nd - 2, nd - 1}:  # equal positions on the diagonal
        out.diag = packet in (aten.le, aten.ge)


def _dim_arg(node: fx.Node) -> Any:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


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
        if node.target.overloadpacket in (aten.argmax, aten.argmin) and _dim_arg(node) is None and \
                any(d > 0 for d in pd):
            p.fail(node, "an index into the flattened tensor, whose inner padded dims move the real positions",
                   frozenset().union(*pd.values()))
        reduced = [d for d in _reduce_dims(node, len(x.shape)) if d in pd]
        for d in reduced:
            p.in_order(node, x, d, "reduces over")
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
        lower = x.lower if kind in ("sum", "mean") and x.lower is not None and x.lower >= 0 else None
        return AV(shape, finite=x.finite, lower=lower)

    return rule


RULES[aten.sum] = _reduction("sum")
RULES[aten.mean] = _reduction("mean")
RULES[aten.var] = _reduction("mean")
RULES[aten.var_mean] = _reduction("mean")
RULES[aten.amax] = _reduction("max")
RULES[aten.amin] = _reduction("min")
RULES[aten.any] = _reduction("any")
RULES[aten.argmax] = _reduction("max")
RULES[aten.logsumexp] = _reduction("max")


@_rule(aten._softmax, aten._log_softmax, aten.softmax, aten.log_softmax)
def _softmax(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])
    d = _dim(node.args[1], len(shape))
    pd = p.pdims(x)
    p.in_order(node, x, d, "softmax over")
    out = p.keep_dims(x, shape, {o: o for o in range(len(shape)) if o != d})
    # along other dims: a softmax of the row (weights in [0, 1]: no mask value left in them)
    out.pos, out.const, out.fill, out.lower, out.masks = {}, None, {}, None, False
    # a row padded along another dim whose fill is -inf (a query the mask hides from every key) is NaN
    out.finite = x.finite and all(finite_value(f) for e, f in x.fill.items() if e != d)
    if d in pd:
        f = x.fill.get(d, "?")
        hidden = _hides(f) and d == len(shape) - 1 and p.sees_diagonal(x, x.shape[-2], x.shape[-1])
        if not (_is_neg(f) or hidden):
            p.fail(node, f"softmax over dim {d}, which is padded and not masked there (-inf, or a finite mask "
                         "with a visible real key in each real row)", pd[d])
        out.fill[d] = 0.0 if node.target.overloadpacket in (aten._softmax, aten.softmax) else NEG
    return out


@_rule(aten.cumsum, aten.cumprod)
def _cumsum(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x = p.av(node.args[0])  # prefix sums: a real position reads only the ones before it
    p.in_order(node, x, _dim(node.args[1], len(shape)), "sums a prefix along")
    return AV(shape, finite=x.finite and node.target.overloadpacket is aten.cumsum)


def _contract(p: _Prover, node: fx.Node, a: AV, b: AV, ka: int, kb: int, shape: tuple) -> AV:
    s = _syms(a.shape[ka], p.padded) | _syms(b.shape[kb], p.padded)
    # zeros on one side, finite values on the other (0 * inf is NaN)
    if s and not (a.fill.get(ka) == 0 and finite_along(b, kb) or b.fill.get(kb) == 0 and finite_along(a, ka)):
        p.fail(node, "a matrix product sums over a padded dim that is not known to be zero on one side and "
                     "finite on the other", s)
    if s:
        p.in_order(node, a, ka, "a matrix product sums over")
        p.in_order(node, b, kb, "a matrix product sums over")
    out = AV(shape, finite=a.finite and b.finite)
    for d in range(len(shape) - 1):  # batch and rows come from a; the last dim from b
        if d in a.factors and d < len(a.shape) - 1:
            out.factors[d] = a.factors[d]
    if len(b.shape) - 1 in b.factors:
        out.factors[len(shape) - 1] = b.factors[len(b.shape) - 1]
    return out


@_rule(aten.mm, aten.bmm)
def _mm(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    a, b = p.av(node.args[0]), p.av(node.args[1])
    out = _contract(p, node, a, b, len(a.shape) - 1, len(b.shape) - 2, shape)
    # scores: real values no mask has hidden yet (a product of masks is none)
    out.diag = VISIBLE if _square(p, shape) and not (a.masks or b.masks) else None
    return out


@_rule(aten.addmm, aten.baddbmm)
def _addmm(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    bias, a, b = (p.av(x) for x in node.args[:3])
    out = _contract(p, node, a, b, len(a.shape) - 1, len(b.shape) - 2, shape)
    out.finite = out.finite and bias.finite
    return out


@_rule(aten.linear)
def _linear(p: _Prover, node: fx.Node, shape: tuple) -> AV:
    x, w = p.av(node.args[0]), p.av(node.args[1])
    bias = p.av(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
    out = _contract(p, node, x, w, len(x.shape) - 1, len(w.shape) - 1, shape)
    out.finite = out.finite and (bias is None or bias.finite)
    return out


@_rule(aten.sym_size, aten.sym_stride, aten.sym_numel)
def _sym(p, node, shape):
    return None


from . import _padding_views  # noqa: E402,F401  (registers the rules for views, slices and indexing)
