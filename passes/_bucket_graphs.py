"""CUDA graphs per bucket for a bucketed graph: one ``torch.cuda.CUDAGraph`` per bucket, one memory pool for all.

Why not Inductor's cudagraph trees here (the cudagraphs pass uses them for graphs of one shape): a bucketed graph
meets several sizes through one compiled callable, and trees capture every size it meets or none. Per bucket is
what pays: a small bucket's kernels take less time than launching them, a large one's do not, and every capture
holds memory. So this records a graph only for the buckets where the cost model says launches dominate, until a
memory cap, and says in the report what each capture holds; other buckets run the compiled code as it is.

Per bucket: the first call runs the compiled code (Triton compiles and tunes its kernels for those sizes), the
second captures it (``torch.cuda.graph`` into the shared pool, warmed up on a side stream first) and replays it;
later calls replay. Inputs: the padded ones go into static buffers owned by the capture (zeroed, then the real
part copied in), others are read where they are (parameters and buffers) when their address is the one captured,
or copied into a static buffer when it changes from call to call (a new tensor each time); a static input met at
another address runs uncaptured. Outputs are copied out after each replay: graphs share the pool, and a later
replay of another bucket may write where this one's outputs were.

Inputs the graph writes into (a static KV cache) are read and written where they are, and a graph is kept per
set of their addresses. generate() makes a new cache per call; a capture for it costs milliseconds (about 7 on
the H200, s23, inferred: ``run`` took 0.11 ms per token beyond its replay over a 64-token call with one
capture). So the last capture keeps its written tensors' storage,
and a new cache of the same layout is moved into that storage instead (its content copied in, its tensors
``set_`` onto it) when nothing else holds either: the old cache's tensors are gone (the caller dropped them) and
no other tensor views the new ones (a view would no longer see the writes), nor a Python storage object of the
caller's. Otherwise it is captured again. What this costs: one cache's memory held past the caller's last use,
until the graph goes (``torch._dynamo.reset()``); kept only where each written input owns its storage alone (a
K and V sliced from one buffer never move, and nothing is kept). Not seen: aliases made outside torch's
bookkeeping (DLPack, ``__cuda_array_interface__``, CUDA IPC), which a move would leave on freed memory;
``cudagraphs={"move_inputs": False}`` captures every new cache instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from ._graph_memory import movable, pool_bytes, same_layout, sole_owner

__all__ = ["BucketGraphs", "CaptureSettings", "per_bucket", "own_capture"]


@dataclasses.dataclass
class CaptureSettings:
    """What the cudagraphs pass decided for a bucketed graph (passes/cudagraphs.py)."""

    decide: str  # "auto": per bucket, by the estimate; "always": every bucket until the cap
    launch_bound_ms: float
    max_pool_mb: float | None
    estimate_ms: Callable[[dict], float | None]  # the bucket's estimated device time (None: no estimate)


@dataclasses.dataclass
class _Captured:
    graph: Any
    buffers: dict[int, torch.Tensor]  # argument -> the static buffer it is copied into
    in_place: dict[int, int]  # argument -> the address captured (read where it is)
    outputs: Any
    pool_mb: float
    checked: tuple[int, ...] = ()  # the in-place arguments whose address each replay checks
    checked_at: list[int] = dataclasses.field(default_factory=list)  # their captured addresses, in that order
    copied: tuple[int, ...] = ()  # the unpadded arguments copied into static buffers, in one foreach copy
    kept: list[torch.Tensor] | None = None  # the written inputs at capture (mutated order): their storage held

    def __post_init__(self):
        self.checked_at = [self.in_place[i] for i in self.checked]


class BucketGraphs:
    # addresses of written inputs held per bucket: generate() makes a new static cache per call, and the
    # allocator tends to hand the freed cache's blocks back, so a few sets cover a run of calls
    MAX_ADDRESS_SETS = 4

    def __init__(self, settings: CaptureSettings, mutated_inputs: bool, mutated: frozenset[int] | None = None,
                 move: bool = True):
        self.settings = settings
        # mutated: the arguments the graph writes into, read in place (a capture replays the write into them; a
        # new address is a new capture); None when they are not known (then a graph that mutates is not captured)
        self.mutated_inputs = mutated_inputs and mutated is None
        self.mutated = mutated or frozenset()
        self.mutated_order = tuple(sorted(self.mutated))
        self.pool = None
        self.graphs: dict[tuple, _Captured] = {}
        self.declined: dict[tuple, str] = {}
        self.calls: dict[tuple, int] = {}
        self.last_ptrs: dict[tuple, list[int]] = {}
        self.pool_mb = 0.0
        self.recaptures = 0
        self.adopted = 0  # new caches moved into the storage of the one captured (no capture; see _adopt)
        self.move = move  # the cudagraphs pass's move_inputs
        self.kept_mb = 0.0  # what the last capture's kept storage holds
        self.fallbacks = 0  # replays refused because a static input moved (the call ran uncaptured)
        # graphs that write into their inputs: per bucket, one graph per set of those inputs' addresses
        self.by_address: dict[tuple, dict[tuple, _Captured]] = {}
        self.read_in_place: dict[tuple, set[int]] = {}  # per bucket: the arguments its first capture read in place
        self.notes: list[str] | None = None

    def note(self, message: str) -> None:
        if self.notes is not None:
            self.notes.append(message)

    def run(self, key: tuple, compiled: Callable, args: Sequence[Any], padded_args: list[int],
            padded_shapes: dict[int, tuple], sizes: dict) -> Any | None:
        """The outputs of ``compiled`` on ``args`` padded to this bucket, from its CUDA graph (in the shared pool:
        copy them out before the next replay); None where the bucket runs without one (the caller then pads and
        calls ``compiled`` itself)."""
        recapture = False
        if self.mutated:  # one graph per set of addresses of the written inputs (a cache per generate() call)
            where = tuple(args[i].data_ptr() for i in self.mutated_order)
            held = self.by_address.setdefault(key, {})
            cap = held.get(where)
            if cap is None and held and self.move:
                moved_to, cap = self._adopt(held, args)
                # a failed move may have moved some tensors: the capture below is keyed where they are now
                where = moved_to if cap is not None else tuple(args[i].data_ptr() for i in self.mutated_order)
            if cap is not None:
                held[where] = held.pop(where)  # most recently used last
                return self._replay(cap, args, padded_args)
            recapture = bool(held)
            if recapture:
                self._make_room(held)
        else:
            cap = self.graphs.get(key)
            if cap is not None:
                return self._replay(cap, args, padded_args)
        if key in self.declined:
            return None
        n = self.calls[key] = self.calls.get(key, 0) + 1
        ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else 0 for a in args]
        previous, self.last_ptrs[key] = self.last_ptrs.get(key), ptrs
        why = self._why_not(key, sizes, estimate=n == 1)  # decided at the first call: it runs padded only if so
        if why:
            self.declined[key] = why
            self.note(f"bucket {_label(sizes)}: not captured, its calls run unpadded (unless bucketing's "
                      f"pad='always'): {why}")
            return None
        if n < 2:
            return None  # the first call compiles the kernels for these sizes
        if recapture:  # read in place what the first capture read in place (the written inputs at their new place)
            stable = self.read_in_place[key] | set(self.mutated)
        else:
            stable = {i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in padded_args
                      and (isinstance(a, torch.nn.Parameter) or getattr(a, "_dynamo_static_input_type", None)
                           or previous is not None and previous[i] == ptrs[i] or i in self.mutated)}
        cap = self._capture(compiled, args, padded_args, padded_shapes, stable, warm_up=not recapture)
        if cap is None:
            return None
        self.pool_mb += cap.pool_mb
        self.read_in_place.setdefault(key, set(cap.in_place))
        if self.mutated:  # kept by address only (self.graphs holds the graphs of the others)
            held = self.by_address[key]
            for other in held.values():
                other.kept = None  # only the last capture holds its cache's storage (one cache more at most)
            written = [args[i] for i in self.mutated_order]
            if self.move and all(movable(t) and sole_owner(t) for t in written):  # else no move could happen
                cap.kept = [t.detach() for t in written]
                self.kept_mb = sum(t.untyped_storage().nbytes() for t in written) / 2**20
            held[where] = cap
            if recapture:
                cap_mb = self.settings.max_pool_mb
                while cap_mb is not None and self.pool_mb > cap_mb and len(held) > 1:  # the least recently used go
                    self.pool_mb -= held.pop(next(iter(held))).pool_mb
                self.recaptures += 1
                if self.recaptures == 1:
                    self.note("the written inputs moved (a new cache): captured again for their addresses, without a "
                              "warm-up (each later time too; not noted again)")
                if cap_mb is None or self.pool_mb <= cap_mb:
                    return self._replay(cap, args, padded_args)  # else alone over the cap: released below
        else:
            self.graphs[key] = cap
        self.note(f"bucket {_label(sizes)}: captured ({cap.pool_mb:.1f} MiB more in the graphs' pool, "
                  f"{self.pool_mb:.1f} MiB in all)")
        if self.settings.max_pool_mb is not None and self.pool_mb > self.settings.max_pool_mb:
            self.graphs.pop(key, None)
            self.by_address.pop(key, None)
            self.pool_mb -= cap.pool_mb
            self.declined[key] = f"the pool would hold {self.pool_mb + cap.pool_mb:.0f} MiB, over max_pool_mb"
            self.note(f"bucket {_label(sizes)}: capture released: {self.declined[key]}")
            return None
        return self._replay(cap, args, padded_args)

    def _make_room(self, held: dict) -> None:
        """Before capturing for a new set of written inputs' addresses: the least recently used graphs of this
        bucket go while MAX_ADDRESS_SETS are held, or while one more of them would pass max_pool_mb (otherwise
        the cap would decline every later cache for good while holding graphs of caches that are gone)."""
        size = next(reversed(held.values())).pool_mb
        cap_mb = self.settings.max_pool_mb
        while held and (len(held) >= self.MAX_ADDRESS_SETS or cap_mb is not None and self.pool_mb + size > cap_mb):
            self.pool_mb -= held.pop(next(iter(held))).pool_mb  # an upper bound: graphs share the pool's blocks

    def _adopt(self, held: dict, args: Sequence[Any]) -> tuple[tuple, _Captured | None]:
        """Written inputs at new addresses (a new cache): moved into the storage the last capture kept, where
        nothing else holds it or them (see the module's docstring); then that graph replays. (None, None) if not."""
        where, cap = next(((w, c) for w, c in held.items() if c.kept is not None), (None, None))
        if cap is None:
            return None, None
        news = [args[i] for i in self.mutated_order]
        # the kept storage where the graph writes (a storage resized since, as FSDP frees, is elsewhere); one new
        # storage per written input
        if tuple(o.data_ptr() for o in cap.kept) != where or len({n.data_ptr() for n in news}) != len(news):
            return None, None
        if not all(movable(n) and movable(o) and same_layout(n, o) and sole_owner(n) and sole_owner(o)
                   for n, o in zip(news, cap.kept)):
            return None, None
        try:  # the content first: a tensor moved before a failure (then captured as before) keeps its values
            torch._foreach_copy_(cap.kept, news)
            for n, o in zip(news, cap.kept):
                n.set_(o.untyped_storage(), o.storage_offset(), o.size(), o.stride())
        except RuntimeError as e:  # not foreseen by the checks above: no move is tried again
            self.move = False
            for c in held.values():
                c.kept = None
            self.note(f"a new cache could not be moved into the kept storage ({type(e).__name__}: {str(e)[:120]}); "
                      "captured again, and each later one too")
            return None, None
        self.adopted += 1
        if self.adopted == 1:
            self.note(f"the written inputs moved (a new cache): moved into the storage the last capture kept "
                      f"({self.kept_mb:.1f} MiB, held until the graph goes), replayed without capturing again (each "
                      "later time too; not noted again)")
        return where, cap

    def _why_not(self, key: tuple, sizes: dict, estimate: bool = True) -> str | None:
        if self.mutated_inputs:
            return "the graph writes into an input (a capture would write into its own copy)"
        if self.settings.max_pool_mb is not None and self.pool_mb >= self.settings.max_pool_mb:
            return f"the graphs' pool holds {self.pool_mb:.0f} MiB, max_pool_mb={self.settings.max_pool_mb}"
        if self.settings.decide == "auto" and estimate:
            ms = self.settings.estimate_ms(sizes)
            if ms is None:
                return "no estimate of its device time on this card; decide='always' captures anyway"
            if ms >= self.settings.launch_bound_ms:
                return (f"estimated {ms:.3f} ms or more on the device, not under launch_bound_ms="
                        f"{self.settings.launch_bound_ms}: launches do not dominate")
        return None

    def _capture(self, compiled, args, padded_args, padded_shapes, stable, warm_up: bool = True) -> _Captured | None:
        buffers, static_args, in_place = {}, list(args), {}
        for i, a in enumerate(args):
            if i in padded_args:
                buffers[i] = torch.zeros(padded_shapes[i], dtype=a.dtype, device=a.device)
            elif isinstance(a, torch.Tensor) and i not in stable:
                buffers[i] = a.clone()
            elif isinstance(a, torch.Tensor):
                in_place[i] = a.data_ptr()
            if i in buffers:
                static_args[i] = buffers[i]
        _fill(buffers, args, padded_args)
        pool = self._pool_for_capture()
        torch.cuda.synchronize()
        held = pool_bytes(pool)
        # where the allocator names no pools: the reserved memory's growth across the warm-up and the capture (an
        # upper bound, but torch.cuda.graph empties the cache first, which made it read 0 MiB in s39-s44's streams)
        before = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm-up on a side stream, as torch.cuda.graphs asks; inputs the graph writes into get copies there, or
        # the warm-up would apply the write twice (a cache's length counter one ahead: out-of-bounds indices)
        if warm_up:  # not when capturing again for moved inputs: the kernels and workspaces exist by then
            warm = [a.clone() if i in self.mutated else a for i, a in enumerate(static_args)]
            with torch.cuda.stream(side):
                compiled(*warm)
            del warm
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = compiled(*static_args)
        torch.cuda.synchronize()
        now = pool_bytes(pool) if held is not None else None
        grown = ((now - held) if now is not None else torch.cuda.memory_reserved() - before) / 2**20
        # the written inputs' addresses are the key a graph is found by (run): checked there, not again
        checked = tuple(i for i in in_place if i not in self.mutated)
        copied = tuple(i for i in buffers if i not in padded_args)
        return _Captured(graph, buffers, in_place, outputs, max(grown, 0.0), checked, copied=copied)

    def _pool_for_capture(self):
        """The shared pool, or a new one once none of our graphs holds it: a pool whose graphs were all let go
        (max_pool_mb, _make_room) may keep blocks (a workspace made in a capture), and torch asserts
        ``use_count > 0`` when a capture joins it (s29's GPU-suite failures, our reading; not yet GPU-run)."""
        if self.pool is None or not (self.graphs or any(self.by_address.values())):
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _replay(self, cap: _Captured, args, padded_args) -> Any | None:
        # per decoded token: ~100 parameters checked, a few inputs copied; one list compare and one foreach copy
        if [args[i].data_ptr() for i in cap.checked] != cap.checked_at:
            self.fallbacks += 1  # a static input moved: run uncaptured (said once in the report)
            if self.fallbacks == 1:
                moved = [i for i, p in zip(cap.checked, cap.checked_at) if args[i].data_ptr() != p]
                self.note(f"argument(s) {moved} moved from the address captured: such calls run without the graph "
                          "(noted once; BucketGraphs.fallbacks counts them)")
            return None
        if cap.copied:
            torch._foreach_copy_([cap.buffers[i] for i in cap.copied], [args[i] for i in cap.copied])
        for i in padded_args:
            _fill_padded(cap.buffers[i], args[i])
        cap.graph.replay()
        return cap.outputs  # in the pool: the caller slices them and copies them out


def _fill_padded(buf: torch.Tensor, a: torch.Tensor) -> None:
    buf.zero_()
    buf[tuple(slice(0, s) for s in a.shape)].copy_(a)


def _fill(buffers: dict[int, torch.Tensor], args: Sequence[Any], padded_args: list[int]) -> None:
    for i, buf in buffers.items():
        if i in padded_args:
            _fill_padded(buf, args[i])
        else:
            buf.copy_(args[i])


def _label(sizes: dict) -> str:
    return ", ".join(f"{s}={v}" for s, v in sizes.items()) or "(one shape)"


def per_bucket(gm, ctx, plan, device_ms: Callable[[dict, dict], float]) -> bool:
    """A bucketed graph: one CUDA graph per bucket where it pays (passes/_bucket_graphs.py), not Inductor's trees,
    which would capture every size or none. ``device_ms(sizes, ceilings)``: the graph's estimated device time."""
    cal = ctx.cost_model.calibration if ctx.cost_model is not None else None
    ceilings = cal.ceilings if cal is not None else None

    def estimate_ms(sizes: dict) -> float | None:
        if not ceilings or not ceilings.get("tflops") or not ceilings.get("copy_tbps"):
            return None
        return device_ms(sizes, ceilings)

    graphs = BucketGraphs(CaptureSettings(ctx.options.decide, ctx.options.launch_bound_ms, ctx.options.max_pool_mb,
                                          estimate_ms), plan.mutated_inputs)
    plan.graphs = graphs

    def take_notes(notes: list[str]) -> None:
        graphs.notes = notes

    ctx.note_after_compile(take_notes)
    ctx.count("captured")
    cap = "no cap" if ctx.options.max_pool_mb is None else f"max_pool_mb={ctx.options.max_pool_mb}"
    ctx.note(f"bucketed graph: one CUDA graph per bucket, captured at its second call where "
             f"{'launches dominate (decide=auto)' if ctx.options.decide == 'auto' else 'safe (decide=always)'}, "
             f"one memory pool for all ({cap}); outputs copied out after each replay")
    return True


def own_capture(ctx, mutated: frozenset[int]) -> bool:
    """A graph that writes into its inputs (a static KV cache): Inductor's trees decline it unless those inputs
    are marked static, so it is captured here (passes/_bucket_graphs.py, as one bucket): the written inputs are
    read and written in place, a new address of one of them (a new cache per ``generate()``) captures again."""
    graphs = BucketGraphs(CaptureSettings("always", ctx.options.launch_bound_ms, ctx.options.max_pool_mb,
                                          lambda sizes: None), True, mutated, move=ctx.options.move_inputs)

    def wrap(compiled):
        def call(*args):
            out = graphs.run((), compiled, args, [], {}, {})
            if out is None:
                return compiled(*args)
            return type(out)(o.clone() if isinstance(o, torch.Tensor) else o for o in out) \
                if isinstance(out, (list, tuple)) else out.clone()
        return call

    ctx.wrap_each_call(wrap)
    ctx.note_after_compile(lambda notes: setattr(graphs, "notes", notes))
    ctx.count("captured")
    ctx.note(f"captured as a CUDA graph of ours (it writes into {len(mutated)} inputs, which Inductor's trees "
             "decline): written inputs read in place, one graph per set of their addresses (a new cache per "
             "generate() call; a few held), captured again without a warm-up when they move"
             + (" (or moved into the storage the last capture kept: move_inputs)" if ctx.options.move_inputs else "")
             + "; outputs copied out")
    return True
