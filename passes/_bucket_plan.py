"""The padding plan of one bucketed graph (passes/bucketing.py makes it): at each call, the sizes read off the
arguments, rounded up to a bucket where the compiled code's guards hold, the inputs padded with zeros and the
outputs sliced back; read by the cudagraphs pass to capture per bucket and by passes/_bucket_frames.py to serve
another graph of the frame."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.nn.functional as F

from . import _ladder as ladder
from ._bucket_frames import CannotServe
from ._bucket_inputs import _guards_hold, _value

FIT_AFTER_SHAPES = 8  # buckets="fit": the fewest distinct sizes a ladder is fitted to


@dataclasses.dataclass
class Plan:
    """How one graph is padded: read by the wrapper at each call and by the cudagraphs pass."""

    symbols: tuple[sympy.Symbol, ...]  # padded
    sources: dict[sympy.Symbol, tuple[int, int]]  # every dynamic symbol -> (argument, dim) that gives its value
    tensors: list[tuple[int, list[tuple[int, Any]]]]  # (argument, [(dim, size expression)]) to pad
    sym_args: list[tuple[int, Any]]  # SymInt arguments: (argument, expression)
    outputs: list[tuple[int, list[tuple[int, Any]]]]  # (output, [(dim, size expression)]) to slice back
    buckets: tuple[int, ...] | str | None  # str: "fit", until fitted (then ``ladders``)
    shape_env: Any = None
    withdrawn: str | None = None  # a later pass made padding unsafe (the fp8 pass's tensorwise scales)
    seen: dict[tuple, bool] = dataclasses.field(default_factory=dict)  # bucket -> the guards hold there
    notes: list[str] | None = None
    calls: int = 0
    pad_always: bool = False  # the options' pad="always"; else only the calls a CUDA graph replays are padded
    mutated_inputs: bool = False  # the graph writes into one of its inputs
    graphs: Any = None  # a _bucket_graphs.BucketGraphs when the cudagraphs pass captures per bucket
    _memo: dict = dataclasses.field(default_factory=dict)  # real sizes -> what _sizes says
    watched: list = dataclasses.field(default_factory=list)  # buffers the proof read: (input, version, address)
    after_shapes: int = 1  # pads from the call at which the graph has met this many distinct sizes
    met: set = dataclasses.field(default_factory=set)  # the distinct sizes met while waiting
    ladders: dict | None = None  # buckets="fit": symbol -> its fitted ladder
    forced: bool = False  # this call's sizes break the code's guards (another graph served by this one): pad

    @property
    def unpadded(self) -> set:
        """Dynamic sizes this graph does not pad: no call is padded up to the code's sizes then (``_forced``)."""
        return set(self.sources) - set(self.symbols)

    def __post_init__(self):
        where = list(self.sources)  # the padded symbols' places among the sizes ``call`` reads
        self._padded_at = [where.index(s) for s in self.symbols if s in self.sources]

    def bucket(self, n: int, symbol: Any = None) -> int:
        if self.ladders is not None:
            return ladder.round_up(n, self.ladders.get(symbol), past="power_of_two")
        return ladder.round_up(n, self.buckets if self.buckets != "fit" else None)

    def waits_for(self) -> int:
        return max(self.after_shapes, FIT_AFTER_SHAPES) if self.buckets == "fit" else self.after_shapes

    def _fit(self) -> None:
        self.ladders = {s: ladder.fit([m[i] for m in self.met]) for i, s in enumerate(self.symbols)}
        if self.notes is not None:
            fitted = "; ".join(f"{s}: {list(v)}" for s, v in self.ladders.items())
            self.notes.append(f"call {self.calls}: ladders fitted to the {len(self.met)} sizes met: {fitted}")

    def wrap(self, compiled: Callable) -> Callable:
        if self.withdrawn:
            return compiled

        def call(*args: Any) -> Any:
            return self.call(compiled, args)

        return call

    def call(self, compiled: Callable, args: Sequence[Any]) -> Any:
        self.calls += 1
        for i, version, ptr in self.watched:
            if args[i]._version != version or args[i].data_ptr() != ptr:  # a buffer the proof read has changed
                if self.notes is not None and self.watched:
                    self.notes.append(f"call {self.calls}: a buffer the proof read changed; calls run unpadded")
                self.watched, self.withdrawn = [], "a buffer the proof read changed"
        if self.forced:
            return self._forced(compiled, args)
        if self.withdrawn or self.graphs is None and not self.pad_always:
            return compiled(*args)
        real = tuple(_size(args, where) for where in self.sources.values())
        if self.met is not None:  # waiting for enough distinct sizes of the padded dims (others may vary too)
            self.met.add(tuple(real[i] for i in self._padded_at))
            if len(self.met) < self.waits_for():
                return compiled(*args)
            if self.buckets == "fit":
                self._fit()
            if self.notes is not None and self.waits_for() > 1:
                self.notes.append(f"call {self.calls}: {len(self.met)} distinct sizes met; padding to buckets from "
                                  "here on")
            self.met = None
        sizes = self._sizes_of(real, args)
        if sizes[0] is None:  # every size a bucket already (and no graphs to replay), or a guard broken there
            return compiled(*args)
        return self._padded(compiled, args, sizes)

    def _padded(self, compiled: Callable, args: Sequence[Any], sizes: tuple, forced: bool = False) -> Any:
        key, shapes, sym_values, out_sizes = sizes
        new = list(args)
        for (i, _), v in zip(self.sym_args, sym_values):
            new[i] = v
        if self.graphs is not None:
            outs = self.graphs.run(key, compiled, new, list(shapes), shapes, dict(zip(self.symbols, key)))
            if outs is not None:
                return self._slice(outs, out_sizes, copy=True) if self._fits(outs, out_sizes) else compiled(*args)
            if not forced and not self.pad_always and key in self.graphs.declined:
                return compiled(*args)  # no CUDA graph holds this bucket: its own sizes cost less than padded ones
        for i, shape in shapes.items():
            t = args[i]
            pad = [p for d in reversed(range(t.dim())) for p in (0, shape[d] - t.shape[d])]
            new[i] = F.pad(t, pad) if any(pad) else t
        outs = compiled(*new)
        return self._slice(outs, out_sizes, copy=False) if self._fits(outs, out_sizes) else compiled(*args)

    def _fits(self, outs: Any, out_sizes: list) -> bool:
        """Whether each output holds its real sizes (the proof makes every padded dim grow). If one does not, the
        proof was wrong: padding is withdrawn, said in the report, and the call runs at its own sizes."""
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if all(flat[i].size(d) >= n for (i, _), sizes in zip(self.outputs, out_sizes) for d, n in sizes):
            return True
        self.withdrawn = "an output came out smaller than its real size once padded (a gap in the proof)"
        if self.notes is not None:
            self.notes.append(f"call {self.calls}: {self.withdrawn}; padding withdrawn, calls run unpadded")
        return False

    def _forced(self, compiled: Callable, args: Sequence[Any]) -> Any:
        """A call whose sizes the code was not compiled for (a graph of the same frame that Dynamo specialized,
        batch 1 say, served by this one: passes/_bucket_frames.py): padded to a bucket where the code's guards
        hold, never run at its own sizes; CannotServe where no bucket does."""
        if self.withdrawn or self.unpadded:
            raise CannotServe(self.withdrawn or "a dynamic size this graph does not pad")
        sizes = self._sizes_of(tuple(_size(args, where) for where in self.sources.values()), args)
        if sizes[0] is None:
            raise CannotServe("no bucket of these sizes keeps the guards the code was compiled under")
        return self._padded(compiled, args, sizes, forced=True)

    def _sizes_of(self, real: tuple, args: Sequence[Any]) -> tuple:
        sizes = self._memo.get(real)
        if sizes is None:  # sympy once per distinct set of sizes, not on every call
            if len(self._memo) > 4096:
                self._memo.clear()
            sizes = self._memo[real] = self._sizes(dict(zip(self.sources, real)), args)
        return sizes

    def _lowest(self, s: Any) -> int:
        """The least size the code was compiled for (Dynamo's dynamic sizes start at 2: 0 and 1 specialize)."""
        vr = self.shape_env.var_to_range.get(s) if self.shape_env is not None else None
        lower = getattr(vr, "lower", 0)
        return int(lower) if lower is not None and lower != -sympy.oo else 0

    def _sizes(self, real: dict, args: Sequence[Any]) -> tuple:
        """For one set of real sizes: (the bucket, or None to call unpadded; padded input shapes; SymInt
        arguments; the real sizes of the outputs' padded dims). A bucket is never under the least size the code
        was compiled for."""
        padded = dict(real)
        for s in self.symbols:
            padded[s] = self.bucket(max(real[s], self._lowest(s)), s)
        key = tuple(padded[s] for s in self.symbols)
        if self.graphs is None and all(padded[s] == real[s] for s in self.symbols):
            return None, {}, [], []
        ok = self.seen.get(key)
        if ok is None:
            ok = self.seen[key] = _guards_hold(self.shape_env, padded, self.symbols)
            if self.notes is not None:
                label = ", ".join(f"{s}={padded[s]}" for s in self.symbols)
                self.notes.append(f"call {self.calls}: first call in bucket {label}" if ok else
                                  f"call {self.calls}: bucket {label} breaks a guard the code was compiled under; "
                                  "calls there run unpadded")
        if not ok:
            return None, {}, [], []
        shapes = {i: tuple(_value(e, padded) if d in dict(dims) else args[i].shape[d]
                           for d, e in enumerate(_full_dims(args[i], dims)))
                  for i, dims in self.tensors}
        out_sizes = [[(d, _value(expr, real)) for d, expr in dims] for _, dims in self.outputs]
        return key, shapes, [_value(e, padded) for _, e in self.sym_args], out_sizes

    def _slice(self, outs: Any, out_sizes: list, copy: bool) -> Any:
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for (i, _), sizes in zip(self.outputs, out_sizes):
            o = flat[i]
            for d, n in sizes:
                o = o.narrow(d, 0, n)
            # contiguous as eager's would be (a narrowed inner dim leaves a view .view() cannot always take)
            flat[i] = o if copy or o.is_contiguous() else o.contiguous()
        if copy:  # out of the CUDA graphs' pool, which the next replay writes
            flat = [o.clone() if isinstance(o, torch.Tensor) else o for o in flat]
        return type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0]


def _full_dims(t: torch.Tensor, dims: list[tuple[int, Any]]) -> list[Any]:
    given = dict(dims)
    return [given.get(d) for d in range(t.dim())]


def _size(args: Sequence[Any], where: tuple[int, int]) -> int:
    i, d = where
    return int(args[i]) if d < 0 else int(args[i].shape[d])
