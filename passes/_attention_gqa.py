"""Grouped-query attention at small query lengths: SDPA over the key/value heads, not over ``repeat_kv``'s copies.

With an attention mask, transformers' SDPA path repeats each key/value head once for each of its query heads
(``repeat_kv``: ``x[:, :, None]`` expanded to [B, KVH, r, L, D], reshaped to [B, KVH * r, L, D]) because the
fused kernels take no grouped-query form with a mask on CUDA. The reshape of the expanded view is a copy: at each
decode step, for k and for v, the whole cache r times over (Llama's 32 query heads over 8 key/value heads: 4
times). Eagerly, transformers packs a one-token query instead (``pack_gqa``); under torch.compile it does not.

Here, for any query length T up to ``MAX_QUERY``, in the graph::

    q [B, H, T, D]    -> [B, KVH, r * T, D]   (query head h = kvh * r + j reads key/value head kvh)
    mask [.., 1, T', L] -> as it is where T' == 1, else each row r times: [.., 1, r * T, L]
    SDPA(q, k, v, mask) over the KVH heads of k and v as they are (no copy)
    out [B, KVH, r * T, D] -> [B, H, T, D]

Row j * T + t of a packed head is query head kvh * r + j at position t, which read key/value head kvh: the same
sums, in another kernel's order. The mask must be the same for every head (its head dimension 1); a causal flag
(positions counted from the first query row), dropout or ``enable_gqa`` leave the call as it is.

With ``gqa_kernel="flex"`` (it needs ``pack_gqa`` on), and by default (``"auto"``) under Inductor on GPUs of compute
capability 9.x, the call becomes FlexAttention over the query as it is and k and v un-repeated instead
(kernels/flex_attention.py, ``flex_masked_sdpa``: a mask per head is fine there), where ``_flex_why_not`` finds
nothing against it; else packed SDPA as above.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kpt_compiler import torch_ir as ir

from ._attention_gate import Call, _random

MAX_QUERY = 64  # decode, speculative and small chunked steps; a prefill's causal call takes enable_gqa instead


_FUNCTIONS = {"reshape": (torch.reshape, torch.Tensor.reshape), "view": (torch.Tensor.view,),
              "expand": (torch.Tensor.expand,), "unsqueeze": (torch.unsqueeze, torch.Tensor.unsqueeze)}


def _is_method(node, *names: str) -> bool:
    """Whether ``node`` calls one of the tensor methods ``names`` (as a method or as torch's function)."""
    return isinstance(node, fx.Node) and (node.op == "call_method" and node.target in names or node.op ==
                                          "call_function" and any(node.target in _FUNCTIONS[n] for n in names))


def _unsqueezed(node) -> fx.Node | None:
    """x where ``node`` is ``x[:, :, None]`` (slices around the None) or ``x.unsqueeze(2)``."""
    if _is_method(node, "unsqueeze") and len(node.args) == 2 and node.args[1] == 2:
        return node.args[0]
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        x, index = node.args
        full = slice(None, None, None)
        if isinstance(index, tuple) and len(index) >= 3 and index[:2] == (full, full) and index[2] is None \
                and all(i == full or i is Ellipsis for i in index[3:]):
            return x
    return None


def repeated(node) -> tuple[fx.Node, int] | None:
    """(x, r) where ``node`` is ``repeat_kv(x, r)`` as transformers writes it, x [B, KVH, L, D], r > 1."""
    if not _is_method(node, "reshape", "view"):
        return None
    expand = node.args[0]
    if not _is_method(expand, "expand"):
        return None
    x = _unsqueezed(expand.args[0])
    xv, ev, out = ir.example_value(x), ir.example_value(expand), ir.example_value(node)
    if not all(isinstance(t, torch.Tensor) for t in (xv, ev, out)) or xv.dim() != 4 or ev.dim() != 5:
        return None
    b, kvh, length, d = xv.shape
    r = ev.shape[2]
    if tuple(ev.shape) != (b, kvh, r, length, d) or tuple(out.shape) != (b, kvh * r, length, d) or r == 1:
        return None
    return x, r


def why_not(call: Call, r: int) -> str | None:
    """Why the SDPA call ``call`` (k and v repeated r times, at a query length up to MAX_QUERY) is not packed."""
    qv, kv = ir.example_value(call.q), ir.example_value(call.k)
    if call.causal or call.dropout or call.gqa:
        return "causal, dropout or enable_gqa"
    if not isinstance(qv.shape[1], int) or qv.shape[1] != kv.shape[1] * r:
        return "query heads that are not the key/value heads times the repeat"
    if call.mask is not None:
        mv = ir.example_value(call.mask)
        if mv.dim() >= 3 and mv.shape[-3] != 1:  # [.., H, T', L] (a 3-D mask's first dimension is the heads')
            return "a mask that differs between heads"
    return None


def _small_query(call: Call, run) -> bool:
    """A query of at most MAX_QUERY positions (a static length), and a mask from the inputs or none: a constant
    mask goes to the pass's proofs instead (is_causal and the like), and a prefill's call is left as it is."""
    qv, mask = ir.example_value(call.q), call.mask
    if qv.dim() != 4 or not isinstance(qv.shape[2], int) or qv.shape[2] > MAX_QUERY:
        return False
    return mask is None or ir.depends_on_inputs(mask, tensors_only=True) and not run.marked(mask)


def _few_pairs(run, kv: fx.Node) -> str | None:
    """On CUDA, why the packed call has too few (batch, key/value head) pairs for the GPU, or None. SDPA's fused
    kernels run a block per pair and query tile and do not split the keys: packed, a batch of one has KVH blocks
    where the repeated call had H. On an H200 (s33, bench_decode --step, 2000-token prompt) 8 pairs were 9%
    slower than the copies (1.590 against 1.457 ms a step at batch 1) and 128 pairs 1.83x faster (2.101 against
    3.839 at batch 16); s34: 16 pairs 15% slower (1.859 against 1.619, batch 2), 32 pairs 7% faster (1.875
    against 2.017, batch 4). Under a fifth of the SMs the pass leaves the call as it is (between 16 and 32 pairs
    on 132 SMs). Not under decide="always"; under "measure" the gate times the packed call against ``WithCopies``."""
    target = run.ctx.target
    if not target.is_cuda or not target.multiprocessors:
        return None
    b, kvh = ir.example_value(kv).shape[:2]
    if not isinstance(b, int):
        return "a dynamic batch: the blocks the packed call would have are not known"
    if 5 * b * kvh < target.multiprocessors:
        return f"{b} x {kvh} (batch, key/value head) pairs, under a fifth of the GPU's {target.multiprocessors} SMs"
    return None


def rewrite(run, node: fx.Node, call: Call, gated, replace) -> bool | None:
    """``node``, an SDPA call over repeat_kv's k and v at a small query length, packed and made if the attention
    pass's gate takes it (``gated``: attention._gated_sdpa; ``replace``: attention._replace). None where the call
    is not of this form (then the pass's other rules look at it)."""
    k, v = repeated(call.k), repeated(call.v)
    graph = run.gm.graph
    if k is None or v is None or k[1] != v[1] or not _small_query(call, run):
        return None
    reduced = Call(call.q, k[0], v[0], call.mask, call.dropout, call.causal, call.scale, call.gqa)  # un-repeated
    if _flex(run, node, reduced, k[1], replace):
        _erase_copies(graph, call)
        run.ctx.count("gqa_flex")
        return True
    why = why_not(reduced, k[1])
    if why:
        run.ctx.note(f"{node.name}: k and v are repeat_kv's copies; not packed: {why}")
        return None
    few = _few_pairs(run, k[0]) if run.how != "always" else None
    if few:
        run.ctx.near_miss(f"{node.name}: k and v are repeat_kv's copies; the packed grouped-query form is not made: "
                          f"{few}")
        return None
    r, before = k[1], set(graph.nodes)
    with graph.inserting_before(node):
        fused, gate_why = gated(run, node, pack(graph, call, (k[0], v[0]), r, node), WithCopies(call, r), before)
        if fused is None:  # the gate declined it (a near miss with its reason): the pass's other rules look
            return None
        out = unpack(graph, fused, call, r, node)
    replace(run, node, out, f"grouped-query attention packed: the query's {r} heads a key/value head as {r} times "
                            f"its rows, over k and v as they are (no repeat_kv copy){gate_why}", None)
    _erase_copies(graph, call)
    run.ctx.count("gqa_packed")
    return True


def _erase_copies(graph: fx.Graph, call: Call) -> None:
    """repeat_kv's nodes for k and v (reshape, expand, unsqueeze), where nothing else reads them."""
    for n in list(dict.fromkeys(n for kv in (call.k, call.v) for n in (kv, kv.args[0], kv.args[0].args[0]))):
        if not n.users:
            graph.erase_node(n)


def _flex_why_not(run, call: Call, r: int) -> str | None:
    """Why the grouped-query call (k and v un-repeated) does not run as FlexAttention's decoding kernel, or None.
    Inductor takes that kernel at query lengths under 128 with static batch and heads and a power-of-two head
    ratio (torch/_inductor/kernel/flex/flex_decoding.py, ``_use_flex_decoding``)."""
    ctx = run.ctx
    if ctx.codegen == "inductor" and not ctx.target.is_cuda:
        return "not on the CPU (no figure there; Inductor's FlexAttention for the CPU has no backward)"
    if ctx.codegen not in ("inductor", "eager"):
        return f"not under codegen {ctx.codegen!r}"
    if call.causal or call.dropout:
        return "causal or dropout"
    q, k, v, m = call.values()
    if not call.static():
        return "dynamic shapes (the decoding kernel needs a static batch and heads)"
    if r & (r - 1) or q.shape[1] != k.shape[1] * r or q.shape[-1] != v.shape[-1]:
        return f"{q.shape[1]} query heads over {k.shape[1]} key/value heads: not a power-of-two ratio"
    if min(q.shape[-1], v.shape[-1]) < 16:
        return f"a head size of {min(q.shape[-1], v.shape[-1])}: Inductor's FlexAttention needs 16 or more"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "q, k and v not of one floating dtype"
    if m is not None and m.dtype != torch.bool and not m.dtype.is_floating_point:
        return f"a {m.dtype} mask"
    if m is not None and m.dim() >= 3 and m.shape[-3] not in (1, q.shape[1]):
        return "a mask whose head dimension is neither 1 nor the query's heads"
    return None


def _flex_wanted(run) -> bool:
    """Whether the option asks for FlexAttention's form: ``"flex"``, or ``"auto"`` under Inductor on compute
    capability 9.x. There, on an H200, captured decode steps against the default they replace (step ms): at a
    16-token prompt, batch 1, 1.271 against 1.248 in s34 and 1.259 against 1.271 in s35 (fp4: 0.690 against 0.696,
    0.657 against 0.682); at a 2000-token prompt (s35) 1.281 against 1.428 (batch 1), 1.415 against 1.861 (4),
    1.965 against 2.098 (16) (docs/attention.md). Not measured on other cards: there "auto" keeps packed SDPA."""
    kernel, ctx = run.ctx.options.gqa_kernel, run.ctx
    if kernel != "auto":
        return kernel == "flex"
    target = ctx.target
    if not target.is_cuda or ctx.codegen != "inductor":
        return False
    if target.capability is None or target.capability[0] != 9:
        if not run.flex_said:
            run.flex_said = True
            ctx.note("grouped-query attention: FlexAttention's decoding form was timed on compute capability 9.0 "
                     f"only, not on {target.card}: packed SDPA here (gqa_kernel='flex' takes FlexAttention)")
        return False
    return True


def _flex(run, node: fx.Node, call: Call, r: int, replace) -> bool:
    """Replace ``node`` by FlexAttention over k and v as they are (``call``: the un-repeated k and v), where the
    option asks for it (``_flex_wanted``) and it applies; else False (then packed SDPA)."""
    if not _flex_wanted(run):
        return False
    why = _flex_why_not(run, call, r)
    if why:
        run.ctx.near_miss(f"{node.name}: k and v are repeat_kv's copies; FlexAttention's decoding form is not made: "
                          f"{why}")
        return False
    from kpt_compiler.kernels.flex_attention import flex_masked_sdpa

    qv = ir.example_value(call.q)
    scale = call.scale if call.scale is not None else qv.shape[-1] ** -0.5
    spec, blocks = _full_blocks(run, qv.shape[2], ir.example_value(call.k).shape[2], qv)
    with run.gm.graph.inserting_before(node):
        out = ir.emit(run.gm.graph, flex_masked_sdpa, (call.q, call.k, call.v, call.mask, blocks),
                      {"scale": scale, "block_spec": spec}, like=node,
                      fake_fn=lambda q, *_, **__: torch.empty_like(q, memory_format=torch.contiguous_format))
    replace(run, node, out, f"grouped-query attention as FlexAttention ({r} query heads a key/value head, over k "
                            "and v as they are: no repeat_kv copy; at query lengths under 128 on CUDA, Inductor's "
                            "decoding kernel, which splits the keys across blocks)", None)
    return True


class WithCopies(Call):
    """The original call as it runs, for decide="measure": repeat_kv's copies of k and v, then SDPA."""

    def __init__(self, call: Call, r: int):
        super().__init__(call.q, call.k, call.v, call.mask, call.dropout, call.causal, call.scale, call.gqa)
        self.r = r

    def run(self, device):
        q, k, v, m = (None if t is None else _random(t, device) for t in self.values())
        b, h, length, d = k.shape
        k0, v0 = k[:, ::self.r].contiguous(), v[:, ::self.r].contiguous()  # [B, KVH, L, D]
        kwargs = {"attn_mask": m, "dropout_p": self.dropout, "is_causal": self.causal, "scale": self.scale}

        def call():
            kr, vr = (x[:, :, None].expand(b, h // self.r, self.r, length, d).reshape(b, h, length, d)
                      for x in (k0, v0))
            return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, **kwargs)
        return call


def pack(graph: fx.Graph, call: Call, kv: tuple[fx.Node, fx.Node], r: int, like: fx.Node) -> Call:
    """The packed call's q and mask, emitted at the insertion point (``unpack`` makes the output again). Only
    H, T and r are read as numbers: a dynamic batch or key length stays symbolic."""
    _, h, t, _ = ir.example_value(call.q).shape
    heads = ir.emit(graph, torch.unflatten, (call.q, 1, (h // r, r)), like=like)  # [B, KVH, r, T, D]
    q = ir.emit(graph, torch.flatten, (heads, 2, 3), like=like)
    mask = call.mask
    if mask is not None:
        for _ in range(4 - ir.example_value(mask).dim()):  # [L], [T', L], [1, T', L]: leading dimensions of 1
            mask = ir.emit(graph, torch.unsqueeze, (mask, 0), like=like)
        if ir.example_value(mask).shape[2] != 1:  # a row per query position: r copies, in the packed rows' order
            rows = ir.emit(graph, torch.unsqueeze, (mask, 2), like=like)
            wide = ir.emit(graph, torch.Tensor.expand, (rows, (-1, -1, r, -1, -1)), like=like)
            mask = ir.emit(graph, torch.flatten, (wide, 2, 3), like=like)
    return Call(q, kv[0], kv[1], mask, call.dropout, False, call.scale, False)


def unpack(graph: fx.Graph, out: fx.Node, call: Call, r: int, like: fx.Node) -> fx.Node:
    """The packed call's output [B, KVH, r * T, D] as the original's [B, H, T, D]."""
    t = ir.example_value(call.q).shape[2]
    rows = ir.emit(graph, torch.unflatten, (out, 2, (r, t)), like=like)  # [B, KVH, r, T, D]
    return ir.emit(graph, torch.flatten, (rows, 1, 2), like=like)


def _full_blocks(run, t: int, s: int, qv: torch.Tensor) -> tuple[tuple, tuple[fx.Node, ...]]:
    """The full block mask of a t x s attention as the graph's constants, computed once a graph and size (every
    layer's call reads the same): its spec and get_attr nodes (kernels/flex_attention.py, ``full_blocks``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from kpt_compiler.kernels.flex_attention import full_blocks

    cache, key = run.flex_blocks, (t, s, qv.device)
    if key not in cache:
        graph, where = run.gm.graph, str(qv.device).replace(":", "")
        with unset_fake_temporarily():
            spec, tensors = full_blocks(t, s, qv.device)
        with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
            nodes = tuple(ir.add_constant(run.gm, f"_kpt_flex_blocks_{t}x{s}_{where}_{i}", x, qv.fake_mode)
                          for i, x in enumerate(tensors))
        cache[key] = spec, nodes
    return cache[key]
