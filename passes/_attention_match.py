"""Matching for the attention pass: from a softmax, the chain of hand-written attention around it.

``match(softmax)`` walks down from the softmax (casts, dropout, the product with the values) and up from it
(casts, masks, soft-capping, the scale, the query-key product) and returns what it found (``Attention``) or
why it is not attention it can rewrite (``Miss``); passes/attention.py rewrites what it finds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir


@dataclasses.dataclass
class Miss:
    reason: str
    looks_like_attention: bool = True


@dataclasses.dataclass
class Attention:
    q: fx.Node
    k: fx.Node | None  # None: use kt transposed
    kt: fx.Node
    v: fx.Node
    scale: float
    masks: list[tuple[str, fx.Node, Any]]  # ("add", m, None) | ("keep", cond, fill) in forward order
    dropout: Any
    out: fx.Node  # the final matmul
    chain: list[fx.Node]  # nodes the rewrite replaces, inputs first
    softmax: fx.Node
    seq_len: int
    softcap: float | None = None  # tanh(s / c) * c between the scale and the masks


def only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def scalar(x: Any) -> float | None:
    """A python number, or a 0-d tensor Dynamo recorded a constant for (torch.full([], c))."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, fx.Node) and not ir.depends_on_inputs(x):
        val = ir.example_value(x)
        if isinstance(val, torch.Tensor) and val.dim() == 0:
            real = ir.evaluate(x.graph.owning_module, x)
            return float(real) if real is not None else None
    return None


def _is_last_dims_swap(node: fx.Node) -> bool:
    val = ir.example_value(node)
    nd = val.dim()
    if ir.kind(node) == "transpose":
        dims = {ir.arg(node, "dim0") % nd, ir.arg(node, "dim1") % nd}
        return dims == {nd - 1, nd - 2}
    if ir.kind(node) == "permute":
        dims = [d % nd for d in ir.arg(node, "dims")]
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _peel_scale(node: Any, limit: int = 8) -> tuple[Any, float, list[fx.Node]]:
    """x * a, a * x, x / a (a a constant), repeatedly -> (x, the product of the factors, the nodes peeled)."""
    factor, peeled = 1.0, []
    while ir.kind(node) in ("mul", "div") and only_user(node) is not None and len(peeled) < limit:
        x, c = ir.arg(node, "input"), ir.arg(node, "other")
        if ir.kind(node) == "mul" and not isinstance(x, fx.Node):
            x, c = c, x
        value = scalar(c)
        if value is None or value == 0 or not isinstance(x, fx.Node) or scalar(x) is not None:
            break
        factor *= value if ir.kind(node) == "mul" else 1.0 / value
        peeled.append(node)
        node = x
    return node, factor, peeled


def match(sm: fx.Node) -> Attention | Miss:
    val = ir.example_value(sm)
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return Miss("not a tensor softmax", False)
    dim = ir.arg(sm, "dim", None)
    if not isinstance(dim, int) or dim % val.dim() != val.dim() - 1:
        return Miss("softmax is not over the last dimension", False)

    # downwards from softmax: casts, dropout, then the product with the values
    down, node, dropout = [], sm, 0.0
    while True:
        user = only_user(node)
        if user is None:
            return Miss("the attention probabilities are also used elsewhere (returned as attention weights?)",
                         _reaches_matmul(node))
        k = ir.kind(user)
        if k == "matmul" and ir.arg(user, "input") is node:
            out, v = user, ir.arg(user, "other")
            break
        if k == "dropout":
            p, training = ir.arg(user, "p", 0.5), ir.arg(user, "training", True)
            if not isinstance(p, (int, float)) or not isinstance(training, bool):
                return Miss("dropout with a probability or mode known only at run time")
            dropout = float(p) if training else 0.0
        elif not (k == "contiguous" or k == "cast" and ir.cast_dtype(user) != "other"):
            return Miss(f"softmax feeds {user.format_node()[:80]}", False)
        down.append(user)
        node = user

    # upwards from softmax: casts, then masks (where / masked_fill / add), then the scale, then q @ k^T
    up, masks, node = [], [], ir.arg(sm, "input")
    while ir.kind(node) in ("cast", "contiguous", "add", "where", "masked_fill"):
        if only_user(node) is None:
            return Miss("the attention scores are also used elsewhere")
        k = ir.kind(node)
        if k == "cast":
            if ir.cast_dtype(node) not in (None, torch.float32):
                return Miss("the scores are cast to a lower precision before softmax")
            scores = ir.arg(node, "input")
        elif k == "contiguous":
            scores = ir.arg(node, "input")
        elif k == "add":
            a, b = ir.arg(node, "input"), ir.arg(node, "other")
            if node.kwargs.get("alpha", 1) != 1 or not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                return Miss("an add on the scores that is not a mask")
            scores, m = (a, b) if _reaches_matmul_up(a) else (b, a)
            masks.insert(0, ("add", m, None))
        elif k == "where":
            cond, a, b = ir.arg(node, "condition"), ir.arg(node, "input"), ir.arg(node, "other")
            if scalar(b) is not None and _reaches_matmul_up(a):
                scores, how, fill = a, "keep", scalar(b)
            elif scalar(a) is not None and _reaches_matmul_up(b):
                scores, how, fill = b, "drop", scalar(a)
            else:
                return Miss("torch.where on the scores that is not a mask with a constant")
            masks.insert(0, (how, cond, fill))
        else:
            scores, m, fill = ir.arg(node, "input"), ir.arg(node, "mask"), scalar(ir.arg(node, "value"))
            if fill is None:
                return Miss("masked_fill with a value known only at run time")
            masks.insert(0, ("drop", m, fill))
        up.append(node)
        node = scores
    softcap, capped = _softcap(node)
    if softcap is not None:
        up += capped
        node = ir.arg(capped[-1], "input")
    if ir.kind(node) in ("mul", "div"):
        if only_user(node) is None:
            return Miss("the attention scores are also used elsewhere")
        inner, scale, peeled = _peel_scale(node)
        if not peeled:
            return Miss("the scores are scaled by a value known only at run time (with dynamic=True, Dynamo "
                         "makes float attributes graph inputs)")
        up += peeled
        node = inner
    else:
        scale = 1.0
    if ir.kind(node) != "matmul":
        return Miss(f"{node.format_node()[:70] if isinstance(node, fx.Node) else node} where the scores should be")
    if only_user(node) is None:
        return Miss("the attention scores are also used elsewhere")
    qk = node

    q, q_factor, q_peeled = _peel_scale(ir.arg(qk, "input"))
    kt = ir.arg(qk, "other")
    key, k_factor, k_peeled = None, 1.0, []
    if ir.kind(kt) in ("transpose", "permute") and _is_last_dims_swap(kt):
        key, k_factor, k_peeled = _peel_scale(ir.arg(kt, "input"))
    qv, kv, vv, outv = (ir.example_value(x) for x in (q, key if key is not None else kt, v, out))
    for name, t in (("query", qv), ("key", kv), ("value", vv)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            return Miss(f"{name} is not a batched tensor")
    if not (qv.dtype == kv.dtype == vv.dtype == outv.dtype) or not qv.dtype.is_floating_point:
        return Miss(f"dtypes differ or are not floating point: q {qv.dtype}, k {kv.dtype}, v {vv.dtype}")
    if not qv.dim() == kv.dim() == vv.dim():
        return Miss("query, key and value have different ranks")
    up_dtype = ir.arg(sm, "dtype", None)
    if up_dtype not in (None, torch.float32, qv.dtype):
        return Miss(f"softmax in {up_dtype} for {qv.dtype} inputs")
    for how, m, _ in masks:
        mv = ir.example_value(m)
        if not isinstance(mv, torch.Tensor) or (how == "add" and torch.promote_types(mv.dtype, qv.dtype) != qv.dtype):
            return Miss(f"a {getattr(mv, 'dtype', type(mv).__name__)} mask on {qv.dtype} scores changes their "
                         "precision; SDPA takes masks in the query's dtype")
        if how != "add" and mv.dtype != torch.bool:
            return Miss("a where/masked_fill condition that is not boolean")
    seq = kv.shape[-2] if key is not None else kv.shape[-1]
    return Attention(q=q, k=key, kt=kt, v=v, scale=scale * q_factor * k_factor, masks=masks, dropout=dropout,
                      out=out, chain=[*q_peeled, *k_peeled, kt, qk, *reversed(up), sm, *down, out], softmax=sm,
                      seq_len=seq if isinstance(seq, int) else 1 << 30, softcap=softcap)


def _softcap(node: Any) -> tuple[float | None, list[fx.Node]]:
    """c * tanh(x / c) (or x * (1/c)) -> (c, [the mul, the tanh, the div]); (None, []) otherwise."""
    if ir.kind(node) != "mul" or only_user(node) is None:
        return None, []
    a, b = ir.arg(node, "input"), ir.arg(node, "other")
    tanh, cap = (a, scalar(b)) if ir.kind(a) == "tanh" else (b, scalar(a))
    if ir.kind(tanh) != "tanh" or cap is None or cap <= 0 or only_user(tanh) is None:
        return None, []
    inner = ir.arg(tanh, "input")
    _x, factor, peeled = _peel_scale(inner, limit=1)
    if len(peeled) != 1 or not math.isclose(factor, 1.0 / cap, rel_tol=1e-6):
        return None, []
    return cap, [node, tanh, peeled[0]]


def _reaches_matmul_up(node: Any, depth: int = 6) -> bool:
    """Is ``node`` on the scores path (a query-key product within a few element-wise steps above it)?"""
    while isinstance(node, fx.Node) and depth > 0:
        k = ir.kind(node)
        if k == "matmul":
            return True
        if k in ("mul", "div", "cast", "contiguous", "masked_fill", "tanh"):
            node = next((a for a in node.args if isinstance(a, fx.Node)), None)
        elif k == "add":
            return _reaches_matmul_up(node.args[0], depth - 1) or _reaches_matmul_up(node.args[1], depth - 1)
        elif k == "where":
            return _reaches_matmul_up(node.args[1], depth - 1) or _reaches_matmul_up(node.args[2], depth - 1)
        else:
            return False
        depth -= 1
    return False


def _reaches_matmul(node: fx.Node) -> bool:
    return any(ir.kind(u) == "matmul" or ir.kind(u) in ("cast", "dropout") and _reaches_matmul(u) for u in node.users)
