"""Graphs Dynamo specializes, served by their frame's bucketed dynamic graph instead of compiled (issue 17).

A stream of changing sizes gives one frame (one compiled ``forward``) several graphs: the one for the sizes first
seen, before Dynamo makes them dynamic; the dynamic one, which bucketing pads; and one for batch 1, because
Dynamo specializes sizes 0 and 1 (batch 1 keeps the sequence dynamic: a graph dynamic in fewer dims). Each costs
a full compile (seconds) for sizes the dynamic graph also covers once padded to one of its buckets (a size under
its least, 1 under 2, pads up to it). So a static inference graph whose frame has a bucketed dynamic graph (now,
or by the call where its own deferred compile would start), or a graph dynamic in fewer dims compiled after it,
is served by that graph. A static one's compile is deferred and runs only where serving stops; one with dynamic
sizes (checked before it would compile, ``why_not``) is never compiled and runs as it is there:
- the frame is Dynamo's (``CompileId.frame_id``, one per code object: two models of one class share it; ids
  restart at ``torch._dynamo.reset``, so the code objects traced are part of the key), and the compile's options
  must be the same;
- its arguments map onto the dynamic graph's by their Dynamo sources (``L['input_ids']``): the same tensors,
  dtypes and ranks, equal static sizes, the dynamic graph's sizes read off them (its own dynamic sizes only
  where the dynamic graph's are dynamic, and sizes that graph holds equal equal here); its parameters and buffers
  must be the very objects the dynamic graph was compiled with (another model of the class is not served);
- sizes under which the dynamic code's guards hold go through it as a call Dynamo would have sent there; others
  are padded to a bucket where they hold (``Plan._forced``), else that call runs the graph's own code;
- the two graphs must be one program: node for node the same ops, constants and outputs, the dynamic one's sizes
  evaluated at the other's (ints, or its own symbols: sympy expressions compared after substitution, so the
  program is the same at every size the other graph takes; a size the dynamic graph derives, 2*s, must be
  that expression here too; a forward that branches on batch 1, breaks the graph there, or reads a global that
  changed since is another program; a view that is the identity at those sizes, expand/view/reshape to its
  input's own shape, is left out on both sides: transformers' Llama expands its positions to the batch except
  at batch 1);
- the first served call is checked against the graph run as it is (eagerly, as the deferred compile runs it):
  outputs of other structure, shapes or dtypes, or values off by more than the dtype's tolerance, and the graph
  runs its own code from then on. The report says which.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx

from kpt_compiler.bench import relative_error

from ._bucket_inputs import _guards_hold, _value
from ._graph_structure import _evaluated, _fake, _program, _Size, _source, _structure, _sympified


class CannotServe(Exception):
    """A call from another graph that the dynamic graph's padding cannot take (that graph compiles its own)."""


TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 1e-2, torch.bfloat16: 4e-2}
OTHER_PARAMETERS = "it reads other parameters than the dynamic graph was compiled with (another model of the class?)"
_FRAMES: dict[tuple, "_Dynamic"] = {}  # frame_key -> the frame's latest bucketed dynamic graph


def frame_key(ctx) -> tuple | None:
    """Dynamo's frame and the code it traced (frame ids restart at torch._dynamo.reset) and the options."""
    try:
        frame = torch._guards.CompileContext.current_compile_id().frame_id
        code = tuple(torch._guards.TracingContext.try_get().traced_code)
    except Exception:  # noqa: BLE001 - outside Dynamo (a graph compiled by hand): nothing to share
        return None
    return None if frame is None or not code else (frame, code, ctx.compile_key)


def known(key: tuple | None) -> bool:
    entry = _FRAMES.get(key) if key is not None else None
    return entry is not None and entry.built() is not None


def _owned(name: str) -> bool:
    return "._parameters[" in name or "._buffers[" in name


class _Dynamic:
    """A bucketed dynamic graph as the caller gets it (weakly held), with what mapping onto it needs."""

    def __init__(self, gm: fx.GraphModule, plan: Any, example_inputs: Sequence[Any], built: Callable,
                 structure: list | None):
        self.plan, self.built, self.structure = plan, weakref.ref(built), structure
        # Dynamo's global state at the compile (autocast, grad mode, default dtype...): a guard, not a node
        self.state = torch._C._dynamo.guards.GlobalStateGuard()
        self.args: list[tuple[str | None, Any]] = []  # per argument: (its source, a tensor's shape or a SymInt's expr)
        self.owned: dict[str, Any] = {}  # source -> weakref to the parameter or buffer compiled with
        for node, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
            name, v = _source(node), node.meta.get("example_value")
            self.args.append((name, v.node.expr if isinstance(v, torch.SymInt) else
                              (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else None))
            if name and _owned(name) and isinstance(x, torch.Tensor):
                self.owned[name] = weakref.ref(x)


def register(ctx, gm: fx.GraphModule, plan: Any) -> None:
    """Keep a bucketed dynamic graph for its frame's static graphs (pass manager: once built)."""
    key, inputs, structure = frame_key(ctx), list(ctx.example_inputs), _structure(gm)  # as the pass sees it
    if key is None or plan.mutated_inputs or structure is None:
        return

    def keep(built: Callable, notes: list[str]) -> Callable:
        if plan.withdrawn:  # withdrawn at the compile (fp8's tensorwise scales): its calls are never padded
            return built
        try:
            entry = _FRAMES[key] = _Dynamic(gm, plan, inputs, built, structure)
        except TypeError:  # a callable without weak references: not kept
            return built
        # the plan holds the graphs' pool: let it go with the graph (torch._dynamo.reset, the model deleted)
        weakref.finalize(built, lambda: _FRAMES.get(key) is entry and _FRAMES.pop(key))
        return built

    ctx.wrap_built(keep)


class _Mapping:
    """Another graph's arguments -> the dynamic graph's, or why not (``why``). ``symbolic``: each dynamic size
    of the dynamic graph as the other graph has it (an int in a static graph, its own expression where it is
    dynamic too); ``dims``: where a call's arguments give it."""

    def __init__(self, sources: list[str | None], fakes: list[Any], dyn: _Dynamic):
        mine = {name: i for i, name in enumerate(sources)}
        self.dyn, self.why, self.take, self.owned, self.dims, self.symbolic = dyn, None, [], [], {}, {}
        self.why = self._map(mine, fakes) or self._covered(mine, fakes)

    def _map(self, mine: dict, fakes: list[Any]) -> str | None:
        derived: list[tuple] = []
        for name, what in self.dyn.args:
            if what is None:
                return f"argument {name} is neither a tensor nor a size"
            if not isinstance(what, tuple):
                self.take.append(what)  # a size: its value from the dynamic graph's other sizes
                continue
            if name not in mine:
                return f"the dynamic graph reads {name}, this one does not"
            i, (shape, dtype, device) = mine[name], what
            fake = fakes[i]
            if not isinstance(fake, tuple) or fake[1:] != (dtype, device) or len(fake[0]) != len(shape):
                return f"{name} differs in dtype, device or rank"
            self.take.append(i)
            for d, (size, have) in enumerate(zip(shape, fake[0])):
                if not isinstance(size, torch.SymInt):
                    if have != size:
                        return f"{name} has size {have} where the dynamic graph's is {size}"
                    continue
                s = size.node.expr
                if not isinstance(s, sympy.Symbol):  # a size the dynamic graph derives (2*s27): checked below
                    derived.append((name, d, s, have))
                    continue
                if self.symbolic.setdefault(s, have) != have:  # two sizes the dynamic graph takes as one
                    return f"{name} dim {d}: sizes the dynamic graph holds equal are not equal here"
                self.dims.setdefault(s, (i, d))
            if name in self.dyn.owned:
                self.owned.append((i, self.dyn.owned[name]))
        for name, d, expr, have in derived:  # must be that expression of this graph's sizes, not a size of its own
            if expr.free_symbols - set(self.symbolic) or _evaluated(_Size(expr), _sympified(self.symbolic)) != (
                    have if isinstance(have, int) else _Size(have)):
                return f"{name} dim {d}: the dynamic graph derives it ({expr}) and this graph does not"
        return None

    def _covered(self, mine: dict, fakes: list[Any]) -> str | None:
        if None in mine:
            return "the graphs read different inputs"
        taken = {t for t in self.take if isinstance(t, int)}
        given = {v for v in self.symbolic.values() if not isinstance(v, int)}
        for i, fake in enumerate(fakes):  # every tensor mapped; a size of its own, one a tensor of it gives
            if i not in taken and not (fake is not None and not isinstance(fake, tuple) and fake in given):
                return "the graphs read different inputs"
        unread = {s for t in self.take if not isinstance(t, int) for s in t.free_symbols} | set(self.dyn.plan.sources)
        if unread - set(self.dims):
            return f"sizes of the dynamic graph that no tensor of this one gives: {sorted(map(str, unread))}"
        return None

    def values(self, args: Sequence[Any]) -> dict:
        """The dynamic graph's sizes at these arguments (the other graph's own guards hold their dtypes, devices
        and static sizes, checked against the dynamic graph's once)."""
        return {s: int(args[i].shape[d]) for s, (i, d) in self.dims.items()}

    def same_owned(self, args: Sequence[Any]) -> bool:
        """The parameters and buffers are the objects the dynamic graph was compiled with (per call)."""
        return all(args[i] is ref() for i, ref in self.owned)

    def template(self, values: dict) -> list[tuple[int | None, Any]]:
        """Per argument of the dynamic graph: (this graph's argument, None), or (None, a size's value)."""
        return [(t, None) if isinstance(t, int) else (None, _value(t, values)) for t in self.take]


class Served:
    """The other graph's callable: its calls go to the dynamic graph where they map, else to ``own``."""

    def __init__(self, key: tuple, gm: fx.GraphModule, own: Callable, notes: list[str]):
        self.key, self.gm, self.own, self.notes = key, gm, own, notes
        # read now: Dynamo drops its placeholders' sources once the backend returns
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.sources, self.fakes = [_source(n) for n in placeholders], [_fake(n) for n in placeholders]
        self.structure = _structure(gm)
        self.bound: _Dynamic | None = None  # the dynamic graph checked at the first served call
        self.mapping: _Mapping | None = None
        self.sizes: dict[tuple, tuple[list, bool]] = {}  # the dynamic graph's sizes -> (template, forced)
        self.off: str | None = None
        self.served = self.unserved = 0

    def _stop(self, why: str) -> None:
        self.off = why
        self.notes.append(f"not served by the frame's dynamic graph from call {self.served + 1}: {why}; this graph "
                          "runs its own code from then on (compiled, or as it is where its note says so)")

    def _cannot(self, why: str) -> None:
        self.unserved += 1
        if self.unserved == 1:
            self.notes.append(f"a call the dynamic graph cannot take ({why}) ran this graph's own code; later calls "
                              "are served where they map (each such call counted)")

    def _prepare(self, dyn: _Dynamic) -> str | None:
        """Map onto ``dyn`` once: the arguments, the sizes, the same program."""
        if not dyn.state.check():
            return "the dynamic graph was compiled under another global state (autocast, grad mode, default dtype)"
        mapping = _Mapping(self.sources, self.fakes, dyn)
        if mapping.why:
            return mapping.why
        if self.structure is None or (_program(_evaluated(dyn.structure, _sympified(mapping.symbolic)))
                                      != _program(self.structure)):
            return "it is not the dynamic graph's program at its sizes (another op, constant or output)"
        self.mapping, self.sizes = mapping, {}  # only once it is checked
        return None

    def _at(self, args: Sequence[Any]) -> tuple[list, bool]:
        """The dynamic graph's arguments template and whether its guards need a bucket, per distinct sizes (one
        for a static graph; sympy once per sizes, not per call)."""
        values = self.mapping.values(args)
        key = tuple(values.values())
        at = self.sizes.get(key)
        if at is None:
            if len(self.sizes) > 4096:
                self.sizes.clear()
            at = self.sizes[key] = (self.mapping.template(values),
                                    not _guards_hold(self.mapping.dyn.plan.shape_env, values))
        return at

    def __call__(self, *args: Any) -> Any:
        if self.off is not None:
            return self.own(*args)
        dyn = self.bound or _FRAMES.get(self.key)
        built = dyn.built() if dyn is not None else None
        if built is None:
            return self.own(*args)
        if self.mapping is None or self.mapping.dyn is not dyn:
            try:
                why = self._prepare(dyn)
            except Exception as e:  # noqa: BLE001 - a comparison this module did not foresee: its own code runs
                why = f"the graphs could not be compared ({type(e).__name__}: {str(e)[:200]})"
            if why:
                self._stop(why)
                return self.own(*args)
        if not self.mapping.same_owned(args):
            self._stop(OTHER_PARAMETERS)
            return self.own(*args)
        try:
            template, dyn.plan.forced = self._at(args)
            out = built(*[args[i] if i is not None else v for i, v in template])
            why = None if self.bound is not None else _differs(out, self.gm(*args))  # the first: checked
        except CannotServe as e:  # these sizes only: this call runs the graph's own code, later ones are served
            self._cannot(str(e))
            return self.own(*args)
        except Exception as e:  # noqa: BLE001 - the dynamic code refused these inputs: this graph's own code runs
            why = f"the dynamic graph raised {type(e).__name__}: {str(e)[:200]}"
        finally:
            dyn.plan.forced = False
        if why:
            self._stop(why if self.bound is not None or why.startswith("the dynamic") else
                       f"its first call differs from this graph run as it is ({why})")
            return self.own(*args)
        if self.bound is None:
            self.bound = dyn
            self.notes.append("served by the frame's bucketed dynamic graph (the same program at its sizes, checked "
                              "against this graph on its first call): no compile of its own")
        self.served += 1
        return out


def prepared(gm: fx.GraphModule, key: tuple | None, example_inputs: Sequence[Any]) -> "Served | str":
    """A graph dynamic in fewer dims, mapped onto its frame's dynamic graph before it would compile (it is not
    compiled where it is served; ``serve`` takes this, so the comparison is not made again at its first call), or
    why it cannot be: the arguments, the program, the parameters' identity (Dynamo's example inputs hold the real
    parameters); the values are checked at its first call."""
    dyn = _FRAMES.get(key) if key is not None else None
    if dyn is None or dyn.built() is None:
        return "the frame has no bucketed dynamic graph"
    try:
        served = Served(key, gm, lambda *a: None, [])
        why = served._prepare(dyn)
    except Exception as e:  # noqa: BLE001 - a comparison this module did not foresee: compiled as any graph
        return f"the graphs could not be compared ({type(e).__name__}: {str(e)[:200]})"
    if why is None and not served.mapping.same_owned(example_inputs):
        why = OTHER_PARAMETERS
    plan = dyn.plan
    unpadded = sorted(map(str, plan.unpadded))
    for s, have in (served.mapping.symbolic.items() if why is None else ()):
        vr = plan.shape_env.var_to_range.get(s) if plan.shape_env is not None else None
        if not isinstance(have, int) or vr is None or vr.lower <= have <= vr.upper:
            continue
        if s not in plan.symbols:
            why = f"the dynamic graph does not pad {s} (bucketing's dims), and {have} is outside its code's sizes"
        elif unpadded:  # Plan._forced pads a call to a bucket only where every dynamic size is padded
            why = (f"{s}={have} is outside the dynamic code's sizes, and the dynamic graph pads a call up to them "
                   f"only where it pads every dynamic size; it does not pad {', '.join(unpadded)}")
        break
    if plan.withdrawn:
        why = why or f"the dynamic graph's padding was withdrawn: {plan.withdrawn}"
    return why or served


def serve(ctx, gm: fx.GraphModule, key: tuple | None, served: Served | None = None) -> None:
    """A static inference graph (or one ``prepared``): served by its frame's dynamic graph where one is (or will
    be) bucketed. Its structure is read here, as bucketing sees the graph, as the dynamic graph's was (``register``):
    the passes after bucketing rewrite both graphs, and not alike (the attention pass's mask analysis at a static
    sequence of 1 finds no mask), so read after them every static graph of a model they rewrite was another
    program."""
    # popped at the wrap: held by this closure past it, it would close a cycle (Served.own -> the pass manager ->
    # its wrappers -> this closure) that keeps the graph's compiled code until the collector runs
    held = [served if served is not None else Served(key, gm, lambda *a: None, [])]

    def wrap(built: Callable, notes: list[str]) -> Served:
        done = held.pop()
        done.own, done.notes = built, notes
        return done

    ctx.wrap_built(wrap)


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
        odd = ~torch.isfinite(yf)
        if not torch.equal(torch.isfinite(xf), ~odd) or not torch.equal(xf[odd].nan_to_num(0.0),
                                                                         yf[odd].nan_to_num(0.0)):
            return f"output {i}: non-finite values differ"
        err = relative_error(xf.nan_to_num(0.0, 0.0, 0.0), yf.nan_to_num(0.0, 0.0, 0.0))
        if err > TOLERANCE.get(y.dtype, 1e-3):
            return f"output {i}: relative error {err:.1e}"
    return None
