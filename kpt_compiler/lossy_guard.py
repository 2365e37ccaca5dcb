"""The guard for lossy passes: measure a rewrite's error, back it out when it is over the pass's bound.

A lossy pass (fp8, fp4, sparsity-2-4: passes/fp8.py, fp4.py, sparsity_2_4.py) declares ``lossy=True`` and an error
bound in dB of signal-to-noise ratio. For each stage with such a pass enabled, the pass manager runs the unmodified graph once on the
stage's example inputs (Dynamo's real inputs for pre_aot; random ones of the recorded shapes later) and keeps
its outputs. After the lossy pass, it runs the rewritten graph on the same inputs and computes, for every
floating-point output, the signal-to-noise ratio against the unmodified graph::

    SQNR = 10 log10( sum(ref^2) / sum((out - ref)^2) )   in float64; inf when equal, -inf for NaN or inf

A pass that says what each rewrite replaced (``ctx.check_locally(label, node, exact)``, as the fp8 pass does
for each layer) is measured rewrite by rewrite, where each happens: in one run of the rewritten graph, each
new node's output against ``exact`` computed on the same inputs (the layer's own error, whatever came before
it). The bound applies to each of these figures: a rewrite under it is backed out (the pass runs again
without it), the others stay. The graph's output figure is measured and reported beside them; when the
layers' errors add up to less than the bound at the output, the report says so. Only an output that is no
longer finite (-inf dB) sends such a pass to the search below. The cost is one run of the rewritten graph,
whatever the number of rewrites.

For other passes the graph's figure (the lowest over its outputs) is the measure. At or over the bound, every
rewrite stays. Under it:

- a pass that names its rewrites (``ctx.propose(label)`` before each) is run again from the graph before it
  with one rewrite at a time allowed; each rewrite under the bound on its own is backed out; the others are
  run together, and while that combination is under the bound the worst of them is backed out too;
- a pass that names none is backed out whole (status ``backed_out``).

The figures go into the pass's record (``error_db``, ``error_bound_db``, ``backed_out``), the report and
``index.html``. Runs are seeded identically (dropout draws the same masks) and do not record gradients;
tensors a mutating graph would change are cloned first.

The reference is the graph before any pass of the stage, so the figure is the lossy pass's error on top of
what the exact passes before it changed (the order of floating-point sums, one rounding instead of several):
small against any bound worth stating, but counted.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from . import graph_utils

__all__ = ["sqnr_db", "LossyGuard"]


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The signal-to-noise ratio of ``out`` against ``ref`` in dB (see the module docstring). Where ``ref`` is
    not finite, ``out`` must equal it (NaN where NaN); where it is, ``out`` must be finite too, else -inf."""
    if ref.is_complex():
        ref, out = torch.view_as_real(ref.resolve_conj()), torch.view_as_real(out.resolve_conj())
    # on the tensors' device (a large layer's output is slow to copy to the host), unless it has no float64
    device = ref.device if ref.device.type in ("cpu", "cuda") else torch.device("cpu")
    ref64, out64 = ref.detach().to(device, torch.float64), out.detach().to(device, torch.float64)
    bad = ~torch.isfinite(ref64)
    if bad.any():
        r, o = ref64[bad], out64[bad]
        if not ((r == o) | (r.isnan() & o.isnan())).all():
            return -math.inf
    ref64, out64 = ref64[~bad], out64[~bad]
    if not torch.isfinite(out64).all():
        return -math.inf
    noise = (out64 - ref64).square().sum().item()
    if noise == 0:
        return math.inf
    signal = ref64.square().sum().item()
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _outputs_db(outs: Any, refs: Any) -> float:
    """The lowest SQNR over the tensor outputs (non-float ones must be equal: inf or -inf)."""
    worst = math.inf
    for out, ref in zip(torch.utils._pytree.tree_leaves(outs), torch.utils._pytree.tree_leaves(refs)):
        if not isinstance(ref, torch.Tensor):
            continue
        if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
            return -math.inf
        if ref.dtype.is_floating_point or ref.dtype.is_complex:
            worst = min(worst, sqnr_db(out, ref))
        elif not torch.equal(out.cpu(), ref.cpu()):
            return -math.inf
    return worst


def _mutates(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        if n.op == "call_method" and str(n.target).endswith("_"):
            return True
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            return True
        if n.op == "call_function" and getattr(n.target, "__name__", "").endswith("_"):
            return True
    return False


def run_graph(gm: fx.GraphModule, inputs: Sequence[Any], interpreter: fx.Interpreter | None = None) -> Any:
    """Run ``gm`` on flat ``inputs`` (whatever its calling convention), seeded, without recording gradients."""
    mutates = _mutates(gm)
    args = [x.clone() if isinstance(x, torch.Tensor) and (mutates or not isinstance(x, torch.nn.Parameter)) else x
            for x in inputs]
    # every CUDA device's generator is seeded below, so every one is saved and restored
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(0)
        return (interpreter or fx.Interpreter(gm)).run(*args)


class _LocalErrors(fx.Interpreter):
    """Runs the rewritten graph and, at each checked node, its ``exact`` function on the same arguments: the
    SQNR of that node's output against it, by label."""

    def __init__(self, gm: fx.GraphModule, checks: dict[str, tuple[str, Callable]]):
        super().__init__(gm)
        self.by_node = {name: (label, exact, split) for label, (name, exact, split) in checks.items()}
        self.figures: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.by_node:
            label, exact, split = self.by_node[n.name]
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            mine, ref = out, exact(*args, **kwargs)
            if split:  # each part on its own (PassContext.check_locally)
                mine, ref = torch.split(out, split, -1), torch.split(ref, split, -1)
            self.figures[label] = _outputs_db(mine, ref)
        return out


def _concrete(x: Any) -> Any:
    """A size Dynamo passes symbolic (a dynamic dimension's placeholder) as the value it was traced with, its
    hint: run eagerly, a ``.view`` or ``.reshape`` by it takes integers only. Anything else as it is, an unbacked
    size too (no hint: where the graph needs it as an integer the guard cannot run, and lossy passes step aside)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) and x.node.hint is not None:
        return x.node.hint
    return x


class LossyGuard:
    """The unmodified graph's outputs for one stage, and the check each lossy pass goes through."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[Any]):
        self.inputs = [_concrete(x) for x in inputs]
        self.reference = run_graph(gm, self.inputs)

    def measure(self, gm: fx.GraphModule) -> float:
        return _outputs_db(run_graph(gm, self.inputs), self.reference)

    def check(self, spec, bound: float, gm: fx.GraphModule, snap, first_ctx, attempt: Callable, rec) -> tuple:
        """After ``spec`` rewrote ``gm`` (from ``snap``): keep, narrow or back out its rewrites (module docstring).

        ``attempt(allowed)`` restarts the pass on the graph from before it with only the ``allowed`` labels
        permitted and returns ``(changed, ctx)``. Returns the final ``(changed, ctx)`` and fills ``rec``:
        ``error_db`` is the figure of the graph the pass leaves (of its whole rewrite where none of it stays),
        ``backed_out`` maps each rewrite backed out to its figure on its own."""
        rec.error_bound_db = bound
        labels = list(dict.fromkeys(first_ctx.proposed))
        if labels and all(label in first_ctx.local_checks for label in labels):
            local = self._check_locally(bound, gm, snap, first_ctx, attempt, rec)
            if local is not None:
                return local
        rec.error_db = db = self.measure(gm)
        if db >= bound:
            return True, first_ctx
        whole = f"SQNR {db:.1f} dB is under the pass's bound of {bound:g} dB"
        if not labels:  # the pass does not name its rewrites: all or nothing
            graph_utils.restore(gm, snap)
            rec.status, rec.reason = "backed_out", f"{whole}; the pass names no rewrites, so all of it is backed out"
            return False, first_ctx
        alone = {}
        for label in labels:
            graph_utils.restore(gm, snap)
            changed, _ = attempt(frozenset({label}))
            alone[label] = self.measure(gm) if changed else math.inf
        rec.backed_out = {label: value for label, value in alone.items() if value < bound}
        keep = sorted((label for label in labels if alone[label] >= bound), key=lambda label: -alone[label])
        while keep:
            graph_utils.restore(gm, snap)
            changed, ctx = attempt(frozenset(keep))
            kept_db = self.measure(gm)
            if changed and kept_db >= bound:
                rec.error_db = kept_db
                rec.notes += [f"backed out {label}: SQNR {value:.1f} dB (bound {bound:g} dB)"
                              for label, value in rec.backed_out.items()]
                return True, ctx
            worst = keep.pop()  # together they are under the bound: drop the worst of them too
            rec.backed_out[worst] = alone[worst]
        graph_utils.restore(gm, snap)
        rec.status, rec.reason = "backed_out", f"{whole}; every rewrite backed out: " + ", ".join(
            f"{label} {value:.1f} dB" for label, value in rec.backed_out.items())
        return False, first_ctx

    def _measure_locally(self, gm: fx.GraphModule, checks) -> tuple[float, dict[str, float]]:
        interpreter = _LocalErrors(gm, checks)
        db = _outputs_db(run_graph(gm, self.inputs, interpreter), self.reference)
        return db, interpreter.figures

    def _check_locally(self, bound: float, gm: fx.GraphModule, snap, ctx, attempt: Callable, rec):
        """Each rewrite's own figure against the bound (module docstring); None sends the pass to the search
        (the graph's output is not finite with every rewrite the local figures keep)."""
        whole_db, figures = self._measure_locally(gm, ctx.local_checks)
        db = whole_db
        under = {label: value for label, value in figures.items() if value < bound}
        changed = True
        if under:
            graph_utils.restore(gm, snap)
            keep = frozenset(figures) - set(under)
            changed, ctx = attempt(keep) if keep else (False, ctx)
            db, kept = self._measure_locally(gm, ctx.local_checks) if changed else (db, {})
            figures = {**under, **kept}
        if changed and db == -math.inf:
            graph_utils.restore(gm, snap)
            rec.notes.append("each rewrite's own figure was over the bound but the graph's output was not finite "
                             "with them: searched rewrite by rewrite")
            attempt(None)
            return None
        rec.layer_db = {label: value for label, value in figures.items() if label not in under}
        rec.backed_out = under
        rec.notes += [f"backed out {label}: SQNR {value:.1f} dB (bound {bound:g} dB)" for label, value in under.items()]
        if not changed:
            rec.status, rec.reason = "backed_out", "every rewrite was under the bound on its own: " + ", ".join(
                f"{label} {value:.1f} dB" for label, value in under.items())
            rec.error_db = whole_db  # of the whole rewrite, none of which stays (as check() says)
            return False, ctx
        rec.error_db = db
        if db < bound:
            said = (f"the graph's output is at {db:.1f} dB, under the bound, though each of the "
                    f"{len(rec.layer_db)} rewrites kept is over it on its own: their errors add up")
            rec.notes.append(said)
            # kept by design (the bound is per rewrite), but not silently: the user sees it without the report
            warnings.warn(f"kernelpytorch: pass {rec.name!r}: {said} (bound {bound:g} dB per rewrite; "
                          "error_bound_db or skip keeps more layers exact)", RuntimeWarning, stacklevel=2)
        return True, ctx
