"""What an attention mask of dynamic size allows, read from the graph as a formula in the positions.

A mask that depends on no input tensor, only on sizes (transformers builds its causal mask from ``arange`` of
the sequence length), cannot be computed at compile time when the length is dynamic: passes/_attention_masks.py
then keeps it dense, and SDPA reads a [batch, 1, L, S] tensor where ``is_causal`` would read nothing. This
module interprets the mask's subgraph over symbolic positions instead: each tensor is a sympy formula in the
indices of its own dimensions (``arange(n)`` is its index; a view renames indices; an integer comparison is a
relation between formulas), exactly, for every size. It answers the predicate "key j is allowed for query i"
over the mask's last two dimensions, or None where any step is outside what it models (then the mask stays
dense, as before). Integer values only (no float rounding to reason about), and a float mask only as
``where(allowed, 0, v)`` with v a dtype's lowest, as transformers writes it.

Modeled: ``arange``, integer add/sub with a constant or size, unsqueeze/expand/view-free indexing (None, full
or constant-start slices, integer tensors indexing leading dims), ``diff`` along the last dim with a one-wide
``prepend``, comparisons, ``&``/``|``/``~``, ``cumsum`` of all zeros, ``new_ones``/``zeros`` scalars, ``.to``
a device or bool/integer dtype, ``where`` between scalars (Python numbers, 0-dim ``zeros``, or a 0-dim
``torch.tensor`` of a Python number, at the value its dtype holds: transformers 5.17 writes its float mask with
``torch.tensor(0.0)``).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from kpt_compiler import graph_utils, torch_ir as ir


class _Unknown(Exception):
    pass


_BOUND = 2**31  # constants stay below this: sums of positions and a few of them cannot reach int64's limit


def _var(d: int) -> sympy.Symbol:
    return sympy.Symbol(f"_i{d}", integer=True, nonnegative=True)


@dataclasses.dataclass
class SV:
    """A tensor as a formula: ``expr`` in the index variables _i0.._i{n-1} of ``shape`` (sympy sizes); a size-1
    dim's variable never appears (it is 0). ``kind``: "int", "bool" (expr a sympy Boolean), or "float"
    (a Piecewise of constants)."""

    shape: tuple
    expr: Any
    kind: str


def _size(s: Any) -> Any:
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s) if isinstance(s, int) else _fail()


def _fail(*_: Any) -> Any:
    raise _Unknown


def _scalar(a: Any) -> Any:
    """A Python number, a SymInt or a size node's value, as a sympy expression."""
    if isinstance(a, fx.Node):
        a = ir.example_value(a)
    if isinstance(a, bool):
        return sympy.true if a else sympy.false
    if isinstance(a, int) and abs(a) >= _BOUND:
        raise _Unknown  # int64 arithmetic near its limits wraps; the formulas do not
    if isinstance(a, (int, torch.SymInt)):
        return _size(a)
    raise _Unknown  # a float: compared with an integer tensor in float32, not exactly


def _align(v: SV, shape: tuple) -> Any:
    """``v.expr`` broadcast to ``shape``: its dims right-aligned, its index variables renamed."""
    off = len(shape) - len(v.shape)
    if off < 0:
        raise _Unknown
    for d, s in enumerate(v.shape):
        if s != 1 and s != shape[off + d]:
            raise _Unknown
    return v.expr.xreplace({_var(d): _var(d + off) for d in range(len(v.shape))}) if off else v.expr


def _broadcast(*vs: SV) -> tuple:
    n = max(len(v.shape) for v in vs)
    out = []
    for d in range(n):
        sizes = {v.shape[d - n + len(v.shape)] for v in vs if d - n + len(v.shape) >= 0} - {1}
        if len(sizes) > 1:
            raise _Unknown
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _with_ones(shape: tuple, expr: Any) -> Any:
    """Size-1 dims read index 0."""
    return expr.xreplace({_var(d): sympy.Integer(0) for d, s in enumerate(shape) if s == 1})


def _const(value: Any, kind: str) -> SV:
    return SV((), value, kind)


_CMP = {operator.le: sympy.Le, operator.lt: sympy.Lt, operator.ge: sympy.Ge, operator.gt: sympy.Gt,
        operator.eq: sympy.Eq, operator.ne: sympy.Ne, torch.le: sympy.Le, torch.lt: sympy.Lt, torch.ge: sympy.Ge,
        torch.gt: sympy.Gt, torch.eq: sympy.Eq, torch.ne: sympy.Ne}
_LOGIC = {operator.and_: sympy.And, operator.or_: sympy.Or, torch.logical_and: sympy.And,
          torch.logical_or: sympy.Or, torch.bitwise_and: sympy.And, torch.bitwise_or: sympy.Or}
_DUNDER = {"__eq__": operator.eq, "__ne__": operator.ne, "__le__": operator.le, "__lt__": operator.lt,
           "__ge__": operator.ge, "__gt__": operator.gt, "__and__": operator.and_, "__or__": operator.or_,
           "__invert__": operator.invert, "__add__": operator.add, "__sub__": operator.sub}
_ARITH = {operator.add: operator.add, operator.sub: operator.sub, torch.add: operator.add, torch.sub: operator.sub}


def _kind_of(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if not t.dtype.is_floating_point and not t.dtype.is_complex:
        return "int"
    return "float"


class _Interp:
    def __init__(self) -> None:
        self.env: dict[fx.Node, SV] = {}

    def value(self, a: Any) -> SV:
        if isinstance(a, fx.Node):
            if a not in self.env:
                raise _Unknown
            v = self.env[a]
            if isinstance(v, SV):
                return v
        return _const(_scalar(a), "bool" if isinstance(a, bool) else "int")

    def run(self, node: fx.Node) -> SV:
        for n in ir.ancestors(node):
            val = ir.example_value(n)
            if n.op == "placeholder":
                if isinstance(val, torch.Tensor):
                    raise _Unknown  # an input tensor: its values are not known
                self.env[n] = val  # a size
                continue
            if isinstance(val, torch.SymInt) or isinstance(val, int) and not isinstance(val, bool):
                self.env[n] = val  # size arithmetic: its example value is the formula
                continue
            if not isinstance(val, torch.Tensor):
                raise _Unknown
            if val.dtype not in (torch.int64, torch.bool) and _kind_of(val) != "float":
                raise _Unknown  # narrower or unsigned integers wrap; the formulas are unbounded integers
            sv = self.step(n, val)
            shape = tuple(_size(s) for s in val.shape)
            if sv.kind != _kind_of(val):  # (each step takes its shape from the trace)
                raise _Unknown  # the model disagrees with the trace: trust neither
            self.env[n] = SV(shape, _with_ones(shape, sv.expr), sv.kind)
        return self.env[node]

    def step(self, n: fx.Node, val: torch.Tensor) -> SV:
        t, args, kw = n.target, n.args, n.kwargs
        shape = tuple(_size(s) for s in val.shape)
        kind = _kind_of(val)
        if n.op == "call_method" and t in _DUNDER:  # torch 2.9's Dynamo records some operators as methods
            t = _DUNDER[t]
        elif n.op == "call_method":
            return self.method(t, args, kw, shape, kind)
        if t is torch.arange and len(args) == 1 and kind == "int":
            return SV(shape, _var(0), kind)
        if t in (torch.zeros, torch.ones) and shape == ():
            return SV((), sympy.Integer(int(t is torch.ones)) if kind != "bool" else sympy.true if t is torch.ones
                      else sympy.false, kind)
        if t in _ARITH and kind == "int" and not kw:
            a, b = (self.value(x) for x in args[:2])
            return SV(shape, _ARITH[t](_align(a, shape), _align(b, shape)), kind)
        if t in _CMP:
            a, b = (self.value(x) for x in args[:2])
            if a.kind != "int" or b.kind != "int":
                raise _Unknown
            return SV(shape, _CMP[t](_align(a, shape), _align(b, shape)), kind)
        if t in _LOGIC:
            a, b = (self.value(x) for x in args[:2])
            if a.kind != "bool" or b.kind != "bool":
                raise _Unknown
            return SV(shape, _LOGIC[t](_align(a, shape), _align(b, shape)), kind)
        if t in (operator.invert, torch.logical_not, torch.bitwise_not):
            a = self.value(args[0])
            if a.kind != "bool":
                raise _Unknown
            return SV(shape, sympy.Not(_align(a, shape)), kind)
        if t is operator.getitem:
            return self.index(self.value(args[0]), args[1], shape, kind)
        if t is torch.diff:
            return self.diff(args, kw, shape, kind)
        if t is torch.tensor and len(args) == 1 and type(args[0]) in (int, float) and shape == () \
                and kind == "float":  # a literal, as its dtype holds it
            held = float(val.new_tensor(args[0]).item())
            return SV((), sympy.Float(held) if held else sympy.Integer(0), kind)
        if t is torch.where and len(args) == 3 and kind == "float":
            cond = self.value(args[0])
            a, b = (self.float_scalar(x) for x in args[1:])
            if cond.kind != "bool":
                raise _Unknown
            return SV(shape, sympy.Piecewise((a, _align(cond, shape)), (b, True)), kind)
        raise _Unknown

    def float_scalar(self, a: Any) -> Any:
        """A where() branch: a Python number, or a 0-dim float tensor this module has read (a literal)."""
        if isinstance(a, fx.Node):
            v = self.value(a)
            if v.kind != "float" or v.shape != ():
                raise _Unknown
            return v.expr
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return sympy.Float(a) if a else sympy.Integer(0)
        raise _Unknown

    def method(self, name, args, kw, shape, kind) -> SV:
        a = self.value(args[0])
        if name in ("unsqueeze", "expand", "view", "reshape", "squeeze"):
            return self.view(a, shape, kind, name, args[1:])
        if name == "to":
            # a device, or bool / a 32- or 64-bit integer dtype (positions fit): the values stay exact
            if kind != a.kind or any(isinstance(x, fx.Node) for x in (*args[1:], *kw.values())):
                raise _Unknown  # .to(other_tensor): its dtype, not checked here
            return SV(shape, _align(a, shape), kind)
        if name == "new_ones" and shape == () and kind == "bool":
            return SV((), sympy.true, kind)
        if name == "cumsum" and a.expr in (0, sympy.false) and kind == "int":
            return SV(shape, sympy.Integer(0), kind)
        raise _Unknown

    def view(self, a: SV, shape: tuple, kind: str, name: str, rest: tuple) -> SV:
        if name == "expand":
            return SV(shape, _align(a, shape), kind)
        if name == "unsqueeze" and len(rest) == 1 and isinstance(rest[0], int):
            d = rest[0] % (len(a.shape) + 1)
            return SV(shape, a.expr.xreplace({_var(k): _var(k + 1) for k in range(d, len(a.shape))}), kind)
        raise _Unknown

    def index(self, a: SV, idx: Any, shape: tuple, kind: str) -> SV:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if all(isinstance(i, fx.Node) and i in self.env and isinstance(self.env[i], SV) for i in idx):
            # integer tensors indexing the leading dims: the result is their broadcast shape, then a's other dims
            ivs = [self.env[i] for i in idx]
            if any(v.kind != "int" for v in ivs) or len(ivs) > len(a.shape):
                raise _Unknown
            lead = _broadcast(*ivs)
            sub = {_var(d): _align(v, lead) for d, v in enumerate(ivs)}
            if any(e.is_nonnegative is not True for e in sub.values()):
                raise _Unknown  # a negative index wraps around to the end: not the formula's value

            sub.update({_var(d): _var(d - len(ivs) + len(lead)) for d in range(len(ivs), len(a.shape))})
            return SV(shape, a.expr.xreplace(sub), a.kind)
        sub, d_in, d_out = {}, 0, 0
        for i in idx:
            if i is None:
                d_out += 1
            elif isinstance(i, slice) and i.step in (None, 1) and (i.start is None or isinstance(i.start, int)
                                                                    and i.start >= 0):
                sub[_var(d_in)] = _var(d_out) + sympy.Integer(i.start or 0)
                d_in, d_out = d_in + 1, d_out + 1
            else:
                raise _Unknown
        for k in range(d_in, len(a.shape)):
            sub[_var(k)] = _var(d_out + k - d_in)
        return SV(shape, a.expr.xreplace(sub), a.kind)

    def diff(self, args, kw, shape, kind) -> SV:
        x = self.value(args[0])
        dim, prepend = kw.get("dim", -1), kw.get("prepend")
        if len(args) > 1 or set(kw) - {"dim", "prepend"} or kw.get("n", 1) != 1 or prepend is None \
                or dim not in (-1, len(x.shape) - 1) or x.kind != "int":
            raise _Unknown
        p = self.value(prepend)
        d = len(shape) - 1
        if len(p.shape) != len(shape) or p.shape[-1] != 1 or p.kind != "int":
            raise _Unknown
        k = _var(d)
        inner = _align(x, shape).xreplace({k: k - 1})  # x[k - 1]
        later = sympy.expand(_align(x, shape) - inner)  # out[k] for k >= 1
        first = sympy.expand(_align(x, shape).xreplace({k: 0}) - _align(p, shape))  # out[0]
        if sympy.expand(later.xreplace({k: 0}) - first) != 0:
            raise _Unknown  # a different first entry: a piecewise value we do not model
        return SV(shape, later, kind)


def mutated(node: fx.Node) -> bool:
    """Some op in the graph writes into ``node`` or a tensor it is computed from (or a view of one): an
    in-place method or function, ``setitem``, ``out=``, an ATen overload whose schema writes an argument
    (``aten.fill_.Scalar``), or a foreach op's list. Its values are then not what its ancestors say."""
    mine = set(ir.ancestors(node))
    for n in node.graph.nodes:
        if n.op in ("call_function", "call_method"):
            if any(t in mine or mine & set(ir.ancestors(t)) for t in graph_utils.written(n)):
                return True
    return False


def allowed(node: fx.Node, how: str, fill: Any) -> Any:
    """The predicate in _i{-2} (query) and _i{-1} (key) that ``node``, used as ``how`` ("add", "keep" or
    "drop") with ``fill``, allows, or None where the graph does more than this module models."""
    if mutated(node):
        return None
    try:
        v = _Interp().run(node)
    except (_Unknown, TypeError, ValueError, ZeroDivisionError, IndexError):
        return None
    if how == "add":
        if v.kind != "float" or not isinstance(v.expr, sympy.Piecewise) or len(v.expr.args) != 2:
            return None
        (ok, cond), (blocked, rest) = v.expr.args
        dtype_min = torch.finfo(torch.float32).min
        if ok != 0 or rest != sympy.true or not (blocked.is_number and float(blocked) <= dtype_min / 2):
            return None
        pred = cond
    elif how in ("keep", "drop") and v.kind == "bool" and fill == -float("inf"):
        pred = v.expr if how == "keep" else sympy.Not(v.expr)
    else:
        return None
    n = len(v.shape)
    if n < 2 or pred.free_symbols - {_var(n - 2), _var(n - 1)} or v.shape[-2] != v.shape[-1]:
        # a predicate reading the batch or head, or a size, is not one pattern for every row; and is_causal's
        # top-left triangle agrees with the mask's only with as many queries as keys
        return None
    return pred.xreplace({_var(n - 2): _Q, _var(n - 1): _K})


_Q, _K = sympy.Symbol("q", integer=True, nonnegative=True), sympy.Symbol("k", integer=True, nonnegative=True)


def is_causal(pred: Any) -> bool:
    """``pred`` is "k <= q" (integers), the lower triangle ``is_causal`` keeps, for every size."""
    if not isinstance(pred, sympy.core.relational.Relational) or isinstance(pred, (sympy.Eq, sympy.Ne)):
        return False
    lhs = sympy.expand(pred.lhs - pred.rhs)
    form = {sympy.Le: lhs, sympy.Lt: lhs + 1, sympy.Ge: -lhs, sympy.Gt: -lhs + 1}.get(type(pred))
    return form is not None and sympy.expand(form - (_K - _Q)) == 0
