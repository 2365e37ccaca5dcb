"""Masks built in one graph of ours and read in another (issue 20: FSDP2, graph breaks).

Where Dynamo breaks a model's graph between the construction of its attention mask and its attention (FSDP2's
hooks around each block: the mask is built in a graph of its own and every block's graph receives it as an
input), the attention pass cannot compute that input at compile time, and a causal mask stays a dense one: SDPA
then reads it from memory and skips nothing.

Here a graph of ours marks the tensors it returns that it computes from no input (``tag_outputs``): their values
are fixed by the graph (the attention pass's ``torch_ir.evaluate`` computes them at compile time; it refuses
random ops and uninitialized memory) and named by a digest of them. A later graph whose mask is such an input
(its example input, the real tensor, carries the mark with the version it had when marked: nothing wrote into it
since) takes the value as known (``known_inputs``) and proves what it allows as it would a mask it built itself.
The rewrite then holds only while each call passes a tensor with the same mark (``guard``): a call that does not
(a mask the caller built, or one written into since) runs the graph as it was before the pass, eagerly, and the
report says so once. The marks live in a table keyed by the tensor's id with a weak reference (never an
attribute on the tensor), dropped when the tensor goes.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from kpt_compiler import graph_utils, torch_ir as ir

from ._symbolic_masks import mutated

# id(tensor) -> (weak reference, tensor._version when marked, digest of its value)
_MARKED: dict[int, tuple[weakref.ref, int, str]] = {}
MAX_ELEMENTS = 1 << 26
log = logging.getLogger(__name__)


def digest(value: torch.Tensor) -> str:
    """What names a value: its dtype, sizes, strides, device type and bytes."""
    h = hashlib.sha256(f"{value.dtype} {tuple(value.shape)} {value.stride()} {value.device.type}".encode())
    h.update(value.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def mark(t: torch.Tensor, key: str) -> None:
    """Mark ``t`` (not an inference tensor: those keep no version, so a write into one would go unseen)."""
    if t.is_inference():
        return
    k = id(t)

    def forget(ref: weakref.ref, k: int = k) -> None:
        if _MARKED.get(k, (None,))[0] is ref:
            del _MARKED[k]
    _MARKED[k] = (weakref.ref(t, forget), t._version, key)


def mark_of(t: Any) -> str | None:
    """The digest ``t`` was marked with, if it is the tensor marked and nothing wrote into it since; else None."""
    entry = _MARKED.get(id(t))
    if entry is None or entry[0]() is not t or t.is_inference() or t._version != entry[1]:
        return None
    return entry[2]


def constant_outputs(gm: fx.GraphModule) -> list[tuple[int, str]]:
    """(position in the graph's flat outputs, digest of the value) for each tensor output that depends on no input
    and can be computed now: a mask (floating or boolean, two dims or more) made from sizes and constants."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    found = []
    for i, n in enumerate(flat):
        v = ir.example_value(n) if isinstance(n, fx.Node) else None
        if not isinstance(v, torch.Tensor) or v.dim() < 2 or not (v.is_floating_point() or v.dtype == torch.bool) \
                or n.op == "placeholder" or ir.depends_on_inputs(n):
            continue
        if mutated(n):
            continue
        value = ir.evaluate(gm, n, max_elements=MAX_ELEMENTS)
        if isinstance(value, torch.Tensor) and _mask_like(value):
            found.append((i, digest(value)))
    return found


def _mask_like(value: torch.Tensor) -> bool:
    """Boolean, or additive with entries 0 and blocked ones (a cache of zeros is no mask: not hashed, not marked)."""
    if value.dtype == torch.bool:
        return True
    blocked = value <= torch.finfo(value.dtype).min / 2
    return bool(blocked.any()) and bool(((value == 0) | blocked).all())


def _storage(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def tag_outputs(found: list[tuple[int, str]]) -> Callable[[Callable, list[str]], Callable]:
    """A built-graph wrapper that marks the outputs ``constant_outputs`` found at each call."""

    def wrap(built: Callable, notes: list[str]) -> Callable:
        def call(*args: Any) -> Any:
            out = built(*args)
            flat = out if isinstance(out, (list, tuple)) else (out,)
            for i, key in found:
                if i < len(flat) and isinstance(flat[i], torch.Tensor):
                    try:
                        mark(flat[i], key)
                    except Exception:  # unmarked, the later graph's check fails over to the graph as it was
                        pass
            return out
        return call
    return wrap


def known_inputs(node: fx.Node, ctx, usable: Callable[[fx.Node], bool]) -> dict:
    """The inputs ``node`` depends on, with their values, where every one of them is a marked tensor (computed by
    a graph of ours from no input) that ``usable`` accepts (nothing in this graph writes into it); else {}.
    ``ctx``: the pass's context, for the example inputs (the real tensors of the call that compiles)."""
    try:
        example_inputs = ctx.example_inputs
    except RuntimeError:  # a context without inputs (a pass run on a graph alone)
        return {}
    placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    known = {}
    for x in (n for n in ir.ancestors(node) if n.op == "placeholder"):
        i = placeholders.index(x)
        real = example_inputs[i] if i < len(example_inputs) else None
        if not isinstance(real, torch.Tensor) or mark_of(real) is None or not usable(x) \
                or real.numel() > MAX_ELEMENTS:
            return {}
        # another input sharing its memory (a view the graph may write through, which ``usable`` does not see)
        if any(isinstance(a, torch.Tensor) and j != i and _storage(a) == _storage(real)
               for j, a in enumerate(example_inputs)):
            return {}
        known[x] = real.detach()
    return known


class Guard:
    """The inputs a graph's rewrites took as known, by position, and the digest each must carry at each call;
    ``fallback``: the graph as it was before (a copy), run where a call's input does not."""

    def __init__(self, gm: fx.GraphModule, written: list[int]):
        self.gm, self.expected, self.fallback, self.misses = gm, {}, None, 0
        self.written = written  # the inputs the graph writes into: none may share a relied-on input's memory

    def expect(self, inputs: dict, example_inputs: Sequence[Any]) -> None:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for x in inputs:
            i = placeholders.index(x)
            self.expected[i] = mark_of(example_inputs[i])

    def keep_original(self) -> None:
        """Before the first rewrite that relies on a marked input: the graph as it is, for calls without it."""
        if self.fallback is None:  # the module's parameters and attributes shared, the graph copied
            self.fallback = fx.GraphModule(self.gm, graph_utils.copy_graph(self.gm.graph))

    def holds(self, args: Sequence[Any]) -> bool:
        if not all(mark_of(args[i]) == key for i, key in self.expected.items()):
            return False
        return not self.written or not ({_storage(args[i]) for i in self.expected}
                                        & {_storage(args[w]) for w in self.written if isinstance(args[w], torch.Tensor)})

    def wrapper(self, built: Callable, notes: list[str]) -> Callable:
        """Outside every hook and capture of the compiled graph (``wrap_built``): a CUDA graph of ours must not
        capture the check, nor the graph as it was."""
        def call(*args: Any) -> Any:
            if self.holds(args):
                return built(*args)
            self.misses += 1
            if self.misses == 1:
                message = (f"a call passed another mask than the one computed by an earlier graph of ours (input(s) "
                           f"{sorted(self.expected)}): it ran the graph as it was before the pass, eagerly, and each "
                           "such call will (noted once; Guard.misses counts them; options={'attention': False} "
                           "keeps the dense mask compiled)")
                notes.append(message)
                log.warning("kernelpytorch: %s", message)
            return self.fallback(*args)
        return call


def marked(run, mask: fx.Node) -> dict:
    """``known_inputs`` for the attention pass's ``run``, once per mask node (SDPA calls ask twice)."""
    if mask not in run.marks:
        run.marks[mask] = known_inputs(mask, run.ctx, usable=lambda x: not mutated(x))
    return run.marks[mask]


def rely(run, form, done: bool) -> None:
    """For the attention pass's ``run``, before (``done`` False) and after a rewrite read from marked inputs
    (``form.relies_on``): keep the graph as it is for calls that pass other tensors, then have each call check
    its inputs (one guard per graph, wrapping the compiled graph)."""
    if not form.relies_on:
        return
    if run.guard is None:
        placeholders = [n for n in run.gm.graph.nodes if n.op == "placeholder"]
        run.guard = Guard(run.gm, [i for i, x in enumerate(placeholders) if mutated(x)])
        run.ctx.wrap_built(run.guard.wrapper)
    if done:
        run.guard.expect(form.relies_on, run.ctx.example_inputs)
    else:
        run.guard.keep_original()
