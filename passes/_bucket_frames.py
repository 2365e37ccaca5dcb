"""Graphs Dynamo specializes, served by their frame's bucketed dynamic graph instead of compiled (issue 17).

A stream of changing sizes gives one frame (one compiled ``forward``) several graphs: the one for the sizes first
seen, before Dynamo makes them dynamic; the dynamic one, which bucketing pads; and one for batch 1, because
Dynamo specializes sizes 0 and 1. Each static graph costs a full compile (seconds) for sizes the dynamic graph
also covers once padded to one of its buckets (a size under its least, 1 under 2, pads up to it). So a static
inference graph whose frame has a bucketed dynamic graph (now, or by the call where its own deferred compile
would start) is served by that graph:
- the frame is Dynamo's (``CompileId.frame_id``, one per code object: two models of one class share it), and the
  compile's options must be the same;
- its arguments map onto the dynamic graph's by their Dynamo sources (``L['input_ids']``): the same tensors,
  dtypes and ranks, equal static sizes, and the dynamic graph's sizes read off them; its parameters and buffers
  must be the very objects the dynamic graph was compiled with (another model of the class is not served);
- sizes under which the dynamic code's guards hold go through it as a call Dynamo would have sent there; others
  are padded to a bucket where they hold (``Plan._forced``), else the graph compiles its own code;
- the first served call is checked against the graph run as it is (eagerly, as the deferred compile runs it):
  outputs of other structure, shapes or dtypes, or values off by more than the dtype's tolerance, and the graph
  compiles its own code from then on. The report says which, and counts the served calls.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ._bucket_inputs import _guards_hold, _value


class CannotServe(Exception):
    """A call from another graph that the dynamic graph's padding cannot take (that graph compiles its own)."""


TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_FRAMES: dict[tuple, "_Dynamic"] = {}  # (frame id, the compile's options) -> its latest bucketed dynamic graph


def frame_key(ctx) -> tuple | None:
    try:
        frame = torch._guards.CompileContext.current_compile_id().frame_id
    except Exception:  # noqa: BLE001 - outside Dynamo (a graph compiled by hand): nothing to share
        return None
    return None if frame is None else (frame, ctx.compile_key)


def known(key: tuple | None) -> bool:
    entry = _FRAMES.get(key) if key is not None else None
    return entry is not None and entry.built() is not None


def _source(node: fx.Node) -> str | None:
    src = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(src, "name", None)
    return name() if callable(name) else name


def _owned(name: str) -> bool:
    return "._parameters[" in name or "._buffers[" in name


class _Dynamic:
    """A bucketed dynamic graph as the caller gets it (weakly held), with what mapping onto it needs."""

    def __init__(self, gm: fx.GraphModule, plan: Any, example_inputs: Sequence[Any], built: Callable):
        self.plan, self.built = plan, weakref.ref(built)
        self.args: list[tuple[str | None, Any]] = []  # per argument: (its source, a tensor's shape or a SymInt's expr)
        self.owned: dict[str, Any] = {}  # source -> weakref to the parameter or buffer compiled with
        for node, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
            name, v = _source(node), node.meta.get("example_value")
            self.args.append((name, v.node.expr if isinstance(v, torch.SymInt) else
                              (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None))
            if name and _owned(name) and isinstance(x, torch.Tensor):
                self.owned[name] = weakref.ref(x)


def register(ctx, gm: fx.GraphModule, plan: Any) -> None:
    """Keep a bucketed dynamic graph for its frame's static graphs (pass manager: once built)."""
    key, inputs = frame_key(ctx), list(ctx.example_inputs)
    if key is None or plan.mutated_inputs:
        return

    def keep(built: Callable, notes: list[str]) -> Callable:
        if plan.withdrawn:  # withdrawn at the compile (fp8's tensorwise scales): its calls are never padded
            return built
        try:
            entry = _FRAMES[key] = _Dynamic(gm, plan, inputs, built)
        except TypeError:  # a callable without weak references: not kept
            return built
        # the plan holds the graphs' pool: let it go with the graph (torch._dynamo.reset, the model deleted)
        weakref.finalize(built, lambda: _FRAMES.get(key) is entry and _FRAMES.pop(key))
        return built

    ctx.wrap_built(keep)


class _Mapping:
    """A static graph's arguments -> the dynamic graph's, or why not (``why``)."""

    def __init__(self, sources: list[str | None], dyn: _Dynamic):
        mine = {name: i for i, name in enumerate(sources)}
        self.dyn, self.why, self.take, self.owned, self.dims = dyn, None, [], [], {}
        for k, (name, what) in enumerate(dyn.args):
            if isinstance(what, tuple):
                if name not in mine:
                    self.why = f"the dynamic graph reads {name}, this one does not"
                    return
                self.take.append(mine[name])
                for d, size in enumerate(what[0]):
                    if isinstance(size, torch.SymInt):
                        self.dims.setdefault(size.node.expr, (mine[name], d))
                if name in dyn.owned:
                    self.owned.append((mine[name], dyn.owned[name]))
            elif what is None:
                self.why = f"argument {name} is neither a tensor nor a size"
                return
            else:
                self.take.append(what)  # a size: evaluated per call
        if None in mine or len([t for t in self.take if isinstance(t, int)]) != len(mine):
            self.why = "the graphs read different inputs"
        unread = {s for t in self.take if not isinstance(t, int) for s in t.free_symbols} | set(dyn.plan.sources)
        if unread - set(self.dims):
            self.why = f"sizes of the dynamic graph that no tensor of this one gives: {sorted(map(str, unread))}"
        self.shapes = [(i, what) for (name, what), i in zip(dyn.args, self.take) if isinstance(what, tuple)]

    def values(self, args: Sequence[Any]) -> dict | None:
        for i, ref in self.owned:
            if args[i] is not ref():
                return None  # another model's parameters (or one replaced): not this graph's
        for i, (shape, dtype) in self.shapes:
            t = args[i]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != len(shape) or any(
                    not isinstance(s, torch.SymInt) and s != n for s, n in zip(shape, t.shape)):
                return None
        return {s: int(args[i].shape[d]) for s, (i, d) in self.dims.items()}

    def args(self, args: Sequence[Any], values: dict) -> list[Any]:
        return [args[t] if isinstance(t, int) else _value(t, values) for t in self.take]


class Served:
    """The static graph's callable: its calls go to the dynamic graph where they map, else to ``own``."""

    def __init__(self, key: tuple, gm: fx.GraphModule, own: Callable, notes: list[str]):
        self.key, self.gm, self.own, self.notes = key, gm, own, notes
        # read now: Dynamo drops its placeholders' sources once the backend returns
        self.sources = [_source(n) for n in gm.graph.nodes if n.op == "placeholder"]
        self.bound: _Dynamic | None = None  # the dynamic graph checked at the first served call
        self.mapping: _Mapping | None = None
        self.off: str | None = None
        self.served = 0
        self._outside: dict[tuple, bool] = {}

    def _stop(self, why: str) -> None:
        self.off = why
        self.notes.append(f"not served by the frame's dynamic graph from call {self.served + 1}: {why}; this graph "
                          "compiles its own code")

    def __call__(self, *args: Any) -> Any:
        if self.off is not None:
            return self.own(*args)
        dyn = self.bound or _FRAMES.get(self.key)
        built = dyn.built() if dyn is not None else None
        if built is None:
            return self.own(*args)
        if self.mapping is None or self.mapping.dyn is not dyn:
            self.mapping = _Mapping(self.sources, dyn)
        values = self.mapping.values(args) if self.mapping.why is None else None
        if values is None:
            self._stop(self.mapping.why or "its inputs do not map onto the dynamic graph's (other parameters, "
                       "dtypes or static sizes)")
            return self.own(*args)
        real = tuple(values.values())
        outside = self._outside.get(real)
        if outside is None:
            outside = self._outside[real] = not _guards_hold(dyn.plan.shape_env, values)
        try:
            dyn.plan.forced = outside
            out = built(*self.mapping.args(args, values))
        except CannotServe as e:
            self._stop(str(e))
            return self.own(*args)
        except Exception as e:  # noqa: BLE001 - the dynamic code refused these inputs: this graph's own code runs
            self._stop(f"the dynamic graph raised {type(e).__name__}: {str(e)[:200]}")
            return self.own(*args)
        finally:
            dyn.plan.forced = False
        if self.bound is None:
            reference = self.gm(*args)  # this graph as it is, eagerly (as its deferred compile runs it until then)
            why = _differs(out, reference)
            if why:
                self._stop(f"its first call differs from this graph run as it is ({why})")
                return reference
            self.bound = dyn
            self.notes.append("served by the frame's bucketed dynamic graph (checked against this graph on its first "
                              "call): no compile of its own")
        self.served += 1
        return out


def serve(ctx, gm: fx.GraphModule, key: tuple | None) -> None:
    """A static inference graph: served by its frame's dynamic graph where one is (or will be) bucketed."""
    ctx.wrap_built(lambda built, notes: Served(key, gm, built, notes))


def _differs(out: Any, ref: Any) -> str | None:
    a = list(out) if isinstance(out, (list, tuple)) else [out]
    b = list(ref) if isinstance(ref, (list, tuple)) else [ref]
    if len(a) != len(b):
        return f"{len(a)} outputs against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if not isinstance(y, torch.Tensor):
            if x != y:
                return f"output {i}: {x!r} against {y!r}"
            continue
        if not isinstance(x, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
            return f"output {i}: {getattr(x, 'shape', x)} against {tuple(y.shape)} {y.dtype}"
        if not y.is_floating_point():
            if not torch.equal(x, y):
                return f"output {i} differs"
            continue
        xf, yf = x.detach().double(), y.detach().double()
        if not torch.equal(torch.isfinite(xf), torch.isfinite(yf)):
            return f"output {i}: non-finite values differ"
        xf, yf = torch.nan_to_num(xf, 0.0, 0.0, 0.0), torch.nan_to_num(yf, 0.0, 0.0, 0.0)
        err = float((xf - yf).norm() / yf.norm().clamp_min(1e-30))
        if err > TOLERANCE.get(y.dtype, 1e-3):
            return f"output {i}: relative error {err:.1e}"
    return None
