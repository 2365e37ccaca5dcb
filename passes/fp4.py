"""fp4: the weights of inference linear layers stored as 4-bit floats with block scales (lossy; off by default).

Before (Dynamo's graph)::

    y = F.linear(x, W, b)                     # nn.Linear in an inference graph, W a parameter

After::

    y = kpt::fp4_linear(x, packed, scales, global_scale, block, e8m0) + b     # kernels/fp4_linear.py

The weight is quantized once, when the graph compiles (kernels/_fp4_format.py: NVFP4 by default, E2M1 values in
blocks of 16 with E4M3 scales and one fp32 scale per tensor, the format of GPUs with fp4 tensor cores; or
MXFP4, blocks of 32 with power-of-two scales), and the graph reads the packed weight as constants: a quarter of
bf16's bytes, plus the scales. Weight-only: the activation stays in its dtype and the kernel dequantizes the
weight in registers, so it pays where reading the weight is the cost (small batches, decoding). Before each
call the copy is checked against the parameter it was made from and made again if that changed (as the fp8
pass's static weights, passes/_fp8_static.py). The module keeps its own weight until
``kpt_compiler.release_weights(model)`` replaces it by its fp4 copy (passes/_fp4_release.py).

Eligible: inference graphs (no gradient flows), a linear whose weight is a parameter of the module with both
dimensions at least ``min_features`` and K a multiple of the format's block, a bfloat16 or float16 layer (fp4
weights are for models that run in 16 bits; a float32 layer is left alone), a module path matching none of
``skip``. Each rewrite asks the cost model (``decide``): under "auto" the card's calibration table
``fp4_linear_<format>`` (measured on the H100, M 1-256 at three Llama shapes: fp4 pays at small M only); a
card without one declines and says that "measure" would time it; "always" takes every eligible layer. The lossy guard
measures each layer's own output against the bf16 layer's on the example inputs (SQNR, dB) and backs out a
layer under ``error_bound_db``.

Layers taken that share their input (q, k and v; gate and up) are quantized as one weight, their rows
concatenated, and run as one kernel whose output is split back (``merge_parallel_linears``, on by default;
passes/_fp4_groups.py): at decode sizes a launch costs about as much as a small layer's bytes. The guard then
measures each member's part of the group's output and takes the lowest figure as the group's (a narrow member,
v beside q, would weigh little in the whole output's), and backs out the group as one.

Runs on CUDA; on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1``, how CI tests it). Asked for
on XLA or on a CPU without the interpreter, it is an error that says so.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from . import _fp4_groups, _weight_copies
from ._fp4_release import Fp4WeightTensor
from ._linear_layers import (check_options, decide_layer, frozen_parameter, linear_layers, not_16bit_inference,
                             operands, traced_rows)

DEFAULT_BOUND_DB = 15.0  # NVFP4 keeps about 20 dB of a Gaussian weight, MXFP4 about 19 (tests/test_fp4_format.py)


@dataclasses.dataclass(frozen=True)
class Fp4Options:
    # NVFP4 (blocks of 16, E4M3 scales, a tensor scale) or MXFP4 (blocks of 32, power-of-two scales)
    format: Literal["nvfp4", "mxfp4"] = "nvfp4"
    # module paths to keep in their precision, as fnmatch patterns ("lm_head", "*.0.*")
    skip: tuple[str, ...] = ()
    # leave layers with fewer input or output features than this alone
    min_features: int = 256
    # the lossy guard backs out a layer whose own output is under this many dB of SQNR (on the example inputs)
    error_bound_db: float = DEFAULT_BOUND_DB
    # "auto": the card's calibration (a card without an fp4 table declines); "measure": time ours against the
    # 16-bit layer on the device at compile time; "always": every eligible layer
    decide: Literal["auto", "measure", "always"] = "auto"
    # layers that share their input (q, k and v; gate and up) quantized as one weight: one kernel launch
    merge_parallel_linears: bool = True

    def __post_init__(self):
        check_options(self, 32, " (one MXFP4 block)")


def _supports(target, options) -> str | None:
    from kpt_compiler.kernels import _launch

    if target.device == "xla":
        return "the fp4 kernel is a Triton kernel for CUDA; XLA devices lower their own matrix products"
    if target.is_cuda and not target.has_fp8:  # the kernels convert E4M3 scales, which Triton has from sm_89
        cap = ".".join(map(str, target.capability or ()))
        return (f"the fp4 kernels need compute capability 8.9 (Ada) or newer (Triton converts E4M3 from there), "
                f"and {target.name} has {cap or 'an unknown one'}")
    if not target.is_cuda and not (_launch.INTERPRETED and _launch.INTERPRETER_OK):
        return (f"the fp4 kernel runs on CUDA, and on the CPU only in Triton's interpreter (TRITON_INTERPRET=1 "
                f"before import, triton 3.6 or later); this graph runs on {target.device}")
    return None


# parameter -> {(format, transposed): Fp4Copy} (passes/_weight_copies.py; the fp8 pass's static weights keep
# theirs in a table of their own: that module stays as its calibration measured it)
_TABLE = _weight_copies.new_table()


class Fp4Copy(_weight_copies.WeightCopy):
    """A parameter's weight [N, K] in fp4 (``q``: its parts are the copy's, refreshed in place)."""

    def __init__(self, param: torch.Tensor, fmt, transposed: bool):
        from kpt_compiler.kernels import _fp4_format

        self.fmt = fmt
        super().__init__(param, transposed)
        self.q = _fp4_format.Fp4Weight(fmt, *self.parts, self.shape)

    def make(self, w: torch.Tensor) -> tuple:
        from kpt_compiler.kernels import _fp4_format

        q = _fp4_format.quantize(w, self.fmt)
        return q.packed, q.scales, q.global_scale


def copy_for(param: torch.Tensor, fmt, transposed: bool) -> Fp4Copy:
    """The shared copy of ``param`` in ``fmt`` (made, remade or refreshed as _weight_copies.copy_in says)."""
    return _weight_copies.copy_in(_TABLE, param, (fmt.name, transposed), lambda: Fp4Copy(param, fmt, transposed))


def refresh_weights(module: torch.nn.Module) -> int:
    """Make again every fp4 copy of ``module``'s parameters (kpt_compiler.refresh_weights)."""
    return _weight_copies.refresh_all(_TABLE, module)


@graph_pass("fp4", summary="inference linear weights -> 4-bit floats with block scales (NVFP4 or MXFP4), "
            "dequantized in the GEMM kernel", stage="pre_aot", options=Fp4Options, default=False, lossy=True,
            error_bound_db=DEFAULT_BOUND_DB, statistics=("matches", "near_misses", "released_weights", "merged_groups"),
            supports=_supports)
def fp4(gm: fx.GraphModule, ctx: PassContext) -> bool:
    from kpt_compiler.kernels import _fp4_format
    from kpt_compiler.kernels import fp4_linear as kernel

    fmt = _fp4_format.FORMATS[ctx.options.format]
    count_flops()
    if not ctx.is_inference:
        ctx.note("not applied: a training graph (fp4 weights are for inference; the fp8 pass trains)")
        return False
    candidates = []
    for node, label in linear_layers(gm):
        why, shape = not_16bit_inference(node, ctx, "fp4 weights")
        if why is None and shape[1] % fmt.block:
            why = f"K={shape[1]} input features are not a multiple of {fmt.name}'s block of {fmt.block}"
        if why is None:
            param, index, why = frozen_parameter(operands(node)[1], ctx, (torch.nn.Parameter, Fp4WeightTensor))
        if why:
            ctx.near_miss(f"{label}: {why}")
            continue
        x, _w, b, transposed = operands(node)
        xv = ir.example_value(x)
        (N, K), M = shape, traced_rows(x, shape[1])
        released = isinstance(param, Fp4WeightTensor)  # kpt_compiler.release_weights: fp4 is all there is
        if not released and not _decide(ctx, label, M, K, N, xv.dtype, xv.device, fmt):
            continue
        candidates.append(dict(node=node, label=label, param=param, index=index, x=x, b=b, transposed=transposed,
                               N=N, K=K, M=M, dtype=xv.dtype, device=xv.device, released=released))
    merged = []  # (members, the released codes read as one weight, or None: fresh weights)
    if ctx.options.merge_parallel_linears:
        apart = []  # layers on one input left as single layers, and why: the report says so
        merged = [(g, None) for g in _fp4_groups.groups([c for c in candidates if not c["released"]], gm, apart)]
        for g in _fp4_groups.groups([c for c in candidates if c["released"]], gm, apart):
            rows = _fp4_groups.released_rows(g)  # one weight only where they were a group's rows
            if rows is not None:
                merged.append((g, rows))
            else:
                apart.append((g, "their released codes are not one group's rows, in this order (released from "
                                 "copies of their own, or from groups of other layers)"))
        for members, why in apart:
            ctx.near_miss(f"{' + '.join(m['label'] for m in members)} share their input but run one kernel each: {why}")
    taken = {id(c) for g, _ in merged for c in g}
    singles = [c for c in candidates if id(c) not in taken]
    copies, saved, kept, grouped, group_checks = [], 0, 0, 0, []
    for members, rows in merged:
        if not ctx.propose("+".join(m["node"].name for m in members)):
            continue
        params = [m["param"] for m in members]
        released = rows is not None  # the codes release_weights left, read as they are
        # fresh: each member in the table, for refresh_weights and release_weights
        group = rows if released else _fp4_groups.find_or_make(_TABLE, params, fmt)
        op = _fp4_groups.emit(gm, members, group.q, kernel)
        N, K, dtype, device = sum(group.widths), members[0]["K"], members[0]["dtype"], members[0]["device"]
        kernel.prepare_cuda_form(N, K, dtype, device, group.q.format)  # a released group keeps its own format
        # the guard's reference is made when it runs: a copy held here would stay as long as the compile
        ctx.check_locally("+".join(m["node"].name for m in members), op,
                          lambda x, *_, ps=params: F.linear(x, torch.cat([_exact(p) for p in ps])), split=group.widths)
        ctx.count(n=len(members))
        ctx.count("merged_groups")
        names = " + ".join(m["label"] for m in members)
        if released:
            ctx.count("released_weights", len(members))
            ctx.note(f"{names}: {members[0]['M']}x{K} @ {K}x{N}, weights released to {group.q.format.name}, read as "
                     f"one (one kernel launch instead of {len(members)}; SQNR against the dequantized weights)")
            continue
        grouped += len(members)
        group_checks.append((group, [m["index"] for m in members]))
        saved += group.nbytes
        kept += sum(p.nbytes for p in params)
        ctx.note(f"{names}: {members[0]['M']}x{K} @ {K}x{N} as one weight in {fmt.name} (they share their input: "
                 f"one kernel launch instead of {len(members)}; {group.nbytes / 2**20:.2f} MiB against "
                 f"{sum(p.nbytes for p in params) / 2**20:.2f} MiB)")
    for c in singles:
        node, label, param, transposed = (c[k] for k in ("node", "label", "param", "transposed"))
        N, K, M, released = c["N"], c["K"], c["M"], c["released"]
        if not ctx.propose(node.name):
            continue
        copy = None if released else copy_for(param, fmt, transposed)
        q = param.q if released else copy.q
        op = _fp4_groups.emit(gm, [c], q, kernel)
        # the CUDA form's kernels are loaded now, outside any CUDA graph capture (kernels/fp4_linear.py)
        kernel.prepare_cuda_form(N, K, c["dtype"], c["device"], q.format)
        # the guard's figure, bias aside; a released weight is dequantized only while the guard measures
        ctx.check_locally(node.name, op, lambda x, *_, p=param, t=transposed: F.linear(x, _exact(p, t)))
        ctx.count()
        if released:
            ctx.count("released_weights")
            ctx.note(f"{label}: {M}x{K} @ {K}x{N}, weight released to {q.format.name} (its SQNR is against the "
                     f"dequantized weight: the kernel's own error; {q.nbytes() / 2**20:.2f} MiB)")
            continue
        copies.append((c["index"], copy))
        saved += copy.nbytes
        kept += param.nbytes
        ctx.note(f"{label}: {M}x{K} @ {K}x{N} with {fmt.name} weights ({copy.nbytes / 2**20:.2f} MiB against "
                 f"{param.nbytes / 2**20:.2f} MiB)")
    weights = len(copies) + grouped
    if not weights:
        return ctx.stats.get("released_weights", 0) > 0
    ctx.count("static_weights", weights)
    if copies:
        ctx.before_each_call(lambda args: _weight_copies.refresh(_TABLE, copies, args))
    if group_checks:
        ctx.before_each_call(lambda args: _fp4_groups.refresh(_TABLE, group_checks, args))
    ctx.note(f"{weights} weights in {fmt.name}: {saved / 2**20:.1f} MiB read per call instead of "
             f"{kept / 2**20:.1f} MiB ({kept / max(saved, 1):.1f}x less); the module keeps its own copies "
             "(kpt_compiler.release_weights frees them)")
    return True


def _exact(param: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """The layer's weight [N, K] in its precision (a released one dequantized) for the guard's reference;
    ``transposed``: the layer stores it [K, N] (an addmm)."""
    w = param.dequantize() if isinstance(param, Fp4WeightTensor) else param.detach()
    return w.t() if transposed else w


@functools.cache
def count_flops() -> None:
    """Teach torch's FLOP counter kpt::fp4_linear (a GEMM: 2 M N K), so cost estimates over a rewritten graph
    (passes/cudagraphs.py's) count its work. Here, not in the kernel's file: that file's hash keys its
    calibration."""
    from torch.utils.flop_counter import register_flop_formula

    importlib.import_module("kpt_compiler.kernels.fp4_linear")  # defines the op

    @register_flop_formula(torch.ops.kpt.fp4_linear)
    def _flops(x_shape, packed_shape, *args, **kwargs) -> int:
        return 2 * math.prod(x_shape) * packed_shape[0]


def _decide(ctx: PassContext, label: str, M: int, K: int, N: int, dtype, device, fmt) -> bool:
    """The cost model's answer for one layer (table ``fp4_linear_<format>``), or timed under "measure"."""
    from kpt_compiler.kernels import _fp4_format
    from kpt_compiler.kernels import fp4_linear as kernel

    def ours(x, w):
        q = _fp4_format.quantize(w, fmt)
        return lambda: kernel.fp4_linear(x, q)

    return decide_layer(ctx, label, f"fp4_linear_{fmt.name}", (M, K, N), dtype, device, kernel, ours)
