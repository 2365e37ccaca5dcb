"""sparsity-2-4: inference linear layers with 2:4 semi-structured sparse weights (lossy when it prunes; off by
default).

Before (Dynamo's graph)::

    y = F.linear(x, W, b)                       # nn.Linear in an inference graph, W a parameter

After::

    y = kpt::sparse24_linear(x, packed, meta, N, K, kernel) + b     # kernels/sparse24_linear.py

In every group of four weights along K (the input features) two are zero, and NVIDIA's sparse tensor cores
(Ampere and later) skip them: torch's cuSPARSELt or CUTLASS kernels, the ones behind
``torch.sparse.to_sparse_semi_structured``. A weight that already has the pattern (``kpt_compiler.prune_2_4``
and fine-tuning with the mask kept, passes/_sparse24.py) is taken as it is, exactly; otherwise, with ``prune``
(the default), the pass prunes it by magnitude (the two largest |w| of each group stay), which is lossy. The
compressed weight is made once, when the graph compiles, and made again before a call if its parameter changed
(passes/_weight_copies.py); the module keeps its own weight.

Eligible: inference graphs, a linear whose weight is a parameter of the module, a bfloat16 or float16 layer,
both dimensions at least ``min_features`` and the kernel's multiples (``WEIGHT_MULTIPLES``), a module path
matching none of ``skip``. Small shapes lose to dense (a 1x4096 by 4096x4096 product ran at 0.11x dense in
pytorch/pytorch#111339), so each rewrite asks the cost model (``decide``): under "auto" the card's calibration
table ``sparse24_linear`` (benchmarks/calibrate.py); a card without one declines and says that "measure" would
time it; "always" takes every eligible layer. Under "auto" it takes layers only in graphs sure to replay from a
CUDA graph (``mode="reduce-overhead"``, or ``cudagraphs={"decide": "always"}``): torch's cuSPARSELt call costs
the host about 0.5 ms to issue (a dense GEMM's: 0.02 ms), which outside a captured graph made BERT and ViT 2.6x
and 7.1x slower than Inductor on the H100. Every declined layer is a near miss with its figures. The lossy
guard measures each layer's own output against the dense layer's on the example inputs (SQNR, dB) and backs out
a layer under ``error_bound_db``. The fusion group runs after this pass and would fuse a layer with its epilogue
or merge it with the linears beside it; a layer taken here is no longer either, so under "auto" and "measure"
the 2:4 GEMM must also beat what that pass's cost model says it would run (``_rival``).

Runs on CUDA (sm_80 and later). ``kernel="dense"`` keeps the pruned weight as a dense matrix: no faster, but it
runs anywhere, so a pruned model's accuracy can be seen on the CPU (the CPU tests' reference); it rewrites
every eligible layer (there is no speed to decide on). Asked for on XLA, or on a CPU without ``kernel="dense"``,
it is an error that says so.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from . import _sparse24, _weight_copies
from ._linear_layers import (check_options, decide_layer, frozen_parameter, linear_layers, not_16bit_inference,
                             operands, traced_rows)

# magnitude pruning keeps 8.8 dB of a layer's output with Gaussian weights, about 7 with nn.Linear's uniform init
# (tests/test_sparsity_2_4.py); a layer under 6 is one whose weights pruning hurts more than usual: backed out
DEFAULT_BOUND_DB = 6.0
# issuing one call, H100, torch 2.11 (benchmarks/diag_sparse24_host.py): the calibration times CUDA-graph replays,
# which hide this; under "auto" the pass takes layers only in graphs sure to be captured
HOST_MS, DENSE_HOST_MS = 0.5, 0.02
HOST_SOURCE = "nvidia-h100-80gb-hbm3/2026-11-27-s16-sparse24-host-e4c9142.txt"


@dataclasses.dataclass(frozen=True)
class Sparse24Options:
    # prune weights to 2:4 by magnitude (lossy); False: take only layers whose weights already have the pattern
    prune: bool = True
    # "auto": cuSPARSELt where torch has it, else CUTLASS; "dense": the pruned weight as a dense matrix (a
    # reference that runs anywhere, the CPU included; no faster)
    kernel: Literal["auto", "cusparselt", "cutlass", "dense"] = "auto"
    # module paths to keep dense, as fnmatch patterns ("lm_head", "*.0.*")
    skip: tuple[str, ...] = ()
    # leave layers with fewer input or output features than this alone
    min_features: int = 256
    # the lossy guard backs out a layer whose own output is under this many dB of SQNR (on the example inputs)
    error_bound_db: float = DEFAULT_BOUND_DB
    # "auto": the card's calibration (a card without a sparse24_linear table declines); "measure": time the
    # sparse layer against the dense one on the device at compile time; "always": every eligible layer
    decide: Literal["auto", "measure", "always"] = "auto"

    def __post_init__(self):
        check_options(self, 16)


def _kernel(options: Sparse24Options) -> str:
    from kpt_compiler.kernels import sparse24_linear as kernel

    return kernel.default_backend() if options.kernel == "auto" else options.kernel


def _supports(target, options) -> str | None:
    if target.device == "xla":
        return ("2:4 sparse kernels are CUDA kernels (torch.sparse.to_sparse_semi_structured); XLA devices lower "
                "their own matrix products")
    if options.kernel == "dense":
        return None
    if not target.is_cuda:
        return (f"2:4 sparse kernels (torch.sparse.to_sparse_semi_structured: cuSPARSELt or CUTLASS) run on CUDA "
                f"only, and this graph runs on {target.device}; kernel='dense' runs the pruned weights as dense "
                "matrices here (to see the accuracy; no faster)")
    if not target.has_sparse_2_4:
        return (f"{target.card} has no sparse tensor cores (2:4 needs sm_80 or later); kernel='dense' runs the "
                "pruned weights as dense matrices (no faster)")
    if options.kernel == "cusparselt" and _kernel(Sparse24Options()) != "cusparselt":
        return "this torch was built without cuSPARSELt (torch.backends.cusparselt); kernel='cutlass' runs"
    if torch.cuda.is_available():  # the card is this process's: try the kernel once
        from kpt_compiler.kernels import sparse24_linear as kernel

        why = kernel.unavailable(_kernel(options))
        if why:
            return f"{why}; kernel='dense' runs the pruned weights as dense matrices (no faster)"
    return None


# parameter -> {(kernel, transposed): Sparse24Copy} (passes/_weight_copies.py)
_TABLE = _weight_copies.new_table()


class Sparse24Copy(_weight_copies.WeightCopy):
    """A parameter's weight [N, K] pruned to 2:4 (where it was not already) and compressed for ``kernel``."""

    def __init__(self, param: torch.Tensor, kernel: str, transposed: bool, prune: bool):
        self.kernel, self.prune = kernel, prune
        super().__init__(param, transposed)

    def make(self, w: torch.Tensor) -> tuple:
        from kpt_compiler.kernels import sparse24_linear as kernel

        if not self.prune and hasattr(self, "parts") and not _sparse24.is_2_4(w):
            # a weight taken exactly (prune=False) written to since: still 2:4 only if the writes kept the mask
            warnings.warn(f"sparsity-2-4: a {w.shape[0]}x{w.shape[1]} weight compiled with prune=False is no "
                          "longer 2:4 after a write; it was pruned by magnitude to keep running (lossy, not "
                          "measured by the guard). Keep the mask while training (kpt_compiler.prune_2_4, "
                          "keep_mask=True) or compile again", RuntimeWarning, stacklevel=2)
        c = kernel.compress(_sparse24.prune_2_4(w), self.kernel)
        return c.packed, c.meta

    def weight(self):
        from kpt_compiler.kernels import sparse24_linear as kernel

        return kernel.Sparse24Weight(self.kernel, self.shape, *self.parts)


def copy_for(param: torch.Tensor, kernel: str, transposed: bool, prune: bool) -> Sparse24Copy:
    return _weight_copies.copy_in(_TABLE, param, (kernel, transposed, prune),
                                  lambda: Sparse24Copy(param, kernel, transposed, prune))


def refresh_weights(module: torch.nn.Module) -> int:
    """Make again every 2:4 copy of ``module``'s parameters (kpt_compiler.refresh_weights)."""
    return _weight_copies.refresh_all(_TABLE, module)


@graph_pass("sparsity-2-4", summary="inference linear weights -> 2:4 semi-structured sparse (pruned by magnitude "
            "or already sparse), torch's sparse tensor-core kernels", stage="pre_aot", options=Sparse24Options,
            default=False, lossy=True, error_bound_db=DEFAULT_BOUND_DB, statistics=("matches", "near_misses",
            "exact"), supports=_supports)
def sparsity_2_4(gm: fx.GraphModule, ctx: PassContext) -> bool:
    from kpt_compiler.kernels import sparse24_linear as kernel

    if not ctx.is_inference:
        ctx.note("not applied: a training graph (2:4 weights here are for inference; prune with "
                 "kpt_compiler.prune_2_4 and fine-tune, then compile for inference)")
        return False
    backend = _kernel(ctx.options)
    captured = _captured(gm, ctx)
    copies = []
    for node, label in linear_layers(gm):
        why, shape = not_16bit_inference(node, ctx, "2:4 weights")
        rows, cols = kernel.WEIGHT_MULTIPLES[backend]
        if why is None and (shape[0] % rows or shape[1] % cols):
            why = f"a {shape[0]}x{shape[1]} weight: {backend} needs N a multiple of {rows} and K of {cols}"
        if why is None:
            param, index, why = frozen_parameter(operands(node)[1], ctx)
        if why:
            ctx.near_miss(f"{label}: {why}")
            continue
        x, w, b, transposed = operands(node)
        dense = param.detach().t() if transposed else param.detach()
        exact = _sparse24.is_2_4(dense)
        if not exact and not ctx.options.prune:
            ctx.near_miss(f"{label}: its weight is not 2:4 and prune=False (kpt_compiler.prune_2_4(model) prunes "
                          "it; fine-tuning then recovers what pruning lost)")
            continue
        xv = ir.example_value(x)
        (N, K), M = shape, traced_rows(x, shape[1])
        if not _decide(ctx, label, M, K, N, xv.dtype, xv.device, backend, captured, node) \
                or not ctx.propose(node.name):
            continue
        copy = copy_for(param, backend, transposed, ctx.options.prune)
        weight = copy.weight()
        if xv.device.type == "cuda":
            weight.alg_id = kernel.search_alg(weight, M, xv.dtype)
        parts = kernel.op_args(weight)
        with gm.graph.inserting_before(node):
            packed = ir.add_constant(gm, f"_kpt_sparse24_packed_{node.name}", parts[0], xv.fake_mode)
            meta = None if parts[1] is None else ir.add_constant(gm, f"_kpt_sparse24_meta_{node.name}", parts[1],
                                                                  xv.fake_mode)
            op = new = ir.emit(gm.graph, torch.ops.kpt.sparse24_linear, (x, packed, meta, *parts[2:]), like=node)
            if b is not None:
                new = ir.emit(gm.graph, torch.add, (op, b), like=node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        ctx.check_locally(node.name, op, lambda x, *_, w=dense: F.linear(x, w))  # the guard's figure, bias aside
        ctx.count()
        if exact:
            ctx.count("exact")
        copies.append((index, copy))
        zeros = float((_sparse24.prune_2_4(dense) == 0).float().mean())
        ctx.note(f"{label}: {M}x{K} @ {K}x{N}, " + ("already 2:4 (exact)" if exact else "pruned to 2:4 by magnitude")
                 + f", {zeros:.1%} zeros, {backend} ({copy.nbytes / 2**20:.2f} MiB against "
                 f"{param.nbytes / 2**20:.2f} MiB)")
    if not copies:
        return False
    ctx.before_each_call(lambda args: _weight_copies.refresh(_TABLE, copies, args))
    return True


def _captured(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    """None where the graph is sure to replay from a CUDA graph (asked for, and nothing in it that the cudagraphs
    pass refuses: inputs on the CPU, dynamic sizes, host syncs), else why not."""
    from . import cudagraphs

    if not ctx.cuda_graphs:
        return "no CUDA graphs asked for"
    return cudagraphs.graph_refusal(gm)


def _decide(ctx: PassContext, label: str, M: int, K: int, N: int, dtype, device, backend: str,
            captured: str | None = None, node: fx.Node | None = None) -> bool:
    """The cost model's answer for one layer (table ``sparse24_linear``), or timed under "measure"; the dense
    reference is taken whenever it is eligible (it is asked for to see accuracy, not speed). Where the layer
    (``node``) would otherwise be fused or merged by a later pass, the 2:4 GEMM must beat that too (``_rival``)."""
    from kpt_compiler.kernels import sparse24_linear as kernel

    how = ctx.decide
    if how == "always" or backend == "dense":
        return True
    if how == "auto" and captured is not None:
        ctx.near_miss(f"{label}: sparse24_linear {M}x{K}x{N} not taken without CUDA graphs ({captured}): torch's "
                      "cuSPARSELt call "
                      f"costs the host {HOST_MS} ms to issue against a dense GEMM's {DENSE_HOST_MS} ms ({HOST_SOURCE}), "
                      "so outside a captured graph it is bound by the host; mode='reduce-overhead' or "
                      "cudagraphs={'decide': 'always'} captures the graph, decide='measure' times this one")
        return False

    def ours(x, w):
        s = kernel.compress(_sparse24.prune_2_4(w), backend)
        return lambda: kernel.sparse24_linear(x, s)

    d = decide_layer(ctx, label, "sparse24_linear", (M, K, N), dtype, device, kernel, ours)
    if not d or node is None:
        return bool(d)
    rival = _rival(ctx, node, M, K, N, dtype, d.speedup)
    if rival is not None:
        ctx.near_miss(f"{label}: sparse24_linear {M}x{K}x{N} left dense: {rival}")
        return False
    return True


def _rival(ctx: PassContext, node: fx.Node, M: int, K: int, N: int, dtype, speedup: float | None) -> str | None:
    """Why the dense layer ``node`` is faster than its 2:4 form (the 2:4 GEMM ``speedup`` times a dense one)
    once the fusion group, which runs after this pass, has fused it into a gated pair (fuse-gated-linear), with
    its epilogue (fuse-linear-epilogue) or merged it with the linears beside it (merge-parallel-linears); None
    where none would, or 2:4 still wins.

    A layer this pass takes is no longer fused or merged: on the H100 BERT and ViT ran 0.98x and 0.94x with the
    pass on while their layers, each against a plain dense GEMM, paid (README, issue 19). Where the later pass's
    cost model says its rewrite pays (``r`` times Inductor's), the two are weighed in device time, with G the
    dense GEMM and E an elementwise kernel over its output:
    - merged, or an epilogue without an activation (a bias, a residual: Inductor adds them in its GEMM or the
      next kernel, on either side): this layer's share of the rewrite, G/r, against the 2:4 GEMM's G/s;
    - an epilogue with an activation: (G + E)/r against G/s + E (Inductor's activation kernel after the 2:4 GEMM);
    - a gated pair, taken by 2:4 both: (2G + E)/r against 2G/s + E (E: reading two outputs, writing one).
    G and E are estimated from the card's ceilings (cost_model). The later pass's answer comes from the decision
    cache and the card's calibration only: nothing is timed here (its own "measure" times it later). Known
    approximation: where fuse-add-norm would take a residual add, the epilogue weighed still holds it."""
    from kpt_compiler.cost_model import MARGIN, CostModel, gemm_device_us, pass_device_us

    from . import fuse_gated_linear, fuse_linear_epilogue, merge_parallel_linears
    from ._fusion_common import verdict

    s = speedup or 1.0
    model = ctx.cost_model or CostModel(ctx.target, ctx.mode, ctx.codegen)
    if ctx.cuda_graphs and not model.cudagraphs:  # the graph is captured: device times, as this pass's own figure
        model = CostModel(ctx.target, "reduce-overhead", ctx.codegen, calibration=model.calibration or False)
    rivals = (("fuse-gated-linear", fuse_gated_linear.gated_candidate),
              ("fuse-linear-epilogue", lambda n: (fuse_linear_epilogue.fusion_candidate(n) or (None, None, None))[2]),
              ("merge-parallel-linears", merge_parallel_linears.merge_candidate))
    for name, found in rivals:  # in the pipeline's order: the first that takes the layer is its alternative
        opts = ctx.other_pass(name)
        asked = found(node) if opts is not None else None
        if asked is None:
            continue
        how = "always" if getattr(opts, "decide", "auto") == "always" else "auto"
        d = verdict(ctx, how, cost_model=model, **asked)  # "auto" and "always" never call asked's timers
        if d is None or not d.rewrite:
            continue  # the later pass leaves it: the plain GEMM this pass's table compares against
        r = d.speedup or 1.0
        what = f"{name} would take it ({d.why})"
        act = asked["shapes"].get("act", "none")
        if name == "merge-parallel-linears" or act == "none":
            ratio = s / r
            figures = f"its share of that rewrite 1/{r:.2f} of a dense GEMM's time, the 2:4 GEMM's 1/{s:.2f}"
        else:
            cal = model.calibration
            if cal is None or not cal.data.get("ceilings"):
                return f"{what}, and without the card's ceilings (python -m benchmarks.calibrate --tables " \
                       "ceilings) the two cannot be weighed"
            size = torch.empty((), dtype=dtype).element_size()
            gemms = 2 if name == "fuse-gated-linear" else 1
            G = gemms * gemm_device_us(cal, M, K, [N], dtype)
            E = pass_device_us(cal, (3 if gemms == 2 else 2) * M * N * size)
            fused, sparse = (G + E) / r, G / s + E
            ratio = fused / sparse
            figures = (f"fused {fused:.1f} us against 2:4 {sparse:.1f} us (the 2:4 GEMM{'s' * (gemms - 1)} "
                       f"{G / s:.1f} us and Inductor's {act} kernel {E:.1f} us, estimated from {cal.card}'s ceilings)")
        if ratio < MARGIN:
            return f"{what}; {figures}: 2:4 at {ratio:.2f}x of it, under the {MARGIN}x margin"
        ctx.note(f"{node.name}: sparse24_linear beats the dense alternative, {what}; {figures} ({ratio:.2f}x)")
        return None
    return None
