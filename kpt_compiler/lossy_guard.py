"""The guard for lossy passes: measure a rewrite's error, back it out when it is over the pass's bound.

A lossy pass (fp8, passes/fp8.py; fp4 and 2:4 sparsity are planned) declares ``lossy=True`` and an error
bound in dB of signal-to-noise ratio. For each stage with such a pass enabled, the pass manager runs the unmodified graph once on the
stage's example inputs (Dynamo's real inputs for pre_aot; random ones of the recorded shapes later) and keeps
its outputs. After the lossy pass, it runs the rewritten graph on the same inputs and computes, for every
floating-point output, the signal-to-noise ratio against the unmodified graph::

    SQNR = 10 log10( sum(ref^2) / sum((out - ref)^2) )   in float64; inf when equal, -inf for NaN or inf

The graph's figure is the lowest over its outputs. At or over the bound, every rewrite stays. Under it:

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
    ref64, out64 = ref.detach().to(torch.float64).cpu(), out.detach().to(torch.float64).cpu()
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


def run_graph(gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
    """Run ``gm`` on flat ``inputs`` (whatever its calling convention), seeded, without recording gradients."""
    mutates = _mutates(gm)
    args = [x.clone() if isinstance(x, torch.Tensor) and (mutates or not isinstance(x, torch.nn.Parameter)) else x
            for x in inputs]
    # every CUDA device's generator is seeded below, so every one is saved and restored
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(0)
        return fx.Interpreter(gm).run(*args)


class LossyGuard:
    """The unmodified graph's outputs for one stage, and the check each lossy pass goes through."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[Any]):
        self.inputs = list(inputs)
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
        rec.error_db = db = self.measure(gm)
        if db >= bound:
            return True, first_ctx
        labels = list(dict.fromkeys(first_ctx.proposed))
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
