"""CUDA-graph capture of small inference graphs, where launching the kernels costs more than running them.

A graph whose kernels take well under a millisecond on the device (a batch of one, a short sequence, a decoding
step) spends most of its time in the host launching them: GPT-2 small at 1x64 runs 2.2 ms under Inductor and
0.6 ms replayed from a CUDA graph (``mode="reduce-overhead"``, benchmarks/results/nvidia-h100-80gb-hbm3/
2026-11-25-full.md). This pass takes that for the user: it decides per graph, and has Inductor capture it
with its CUDA-graph trees (one memory pool per device shared by every graph, static inputs such as parameters
and ``mark_static_address`` buffers read in place, the others copied into static buffers; replays checked
against the recorded input addresses). It writes no replay engine of its own.

Whether to capture (``decide="auto"``, the default): only inference graphs on CUDA under Inductor, with static
shapes (a dynamic graph would record one CUDA graph per size: bucketing's job) and nothing that synchronizes
with the host (``.item()``, ``nonzero``, ``.cpu()``, an op tagged ``cudagraph_unsafe``); and only where the
graph is small: its estimated device time (a roofline over its matrix products and the bytes its ops write, at
the card's calibrated ceilings) is under ``launch_bound_ms``, and copying its outputs costs under a tenth of that.
Without a calibration for the card, "auto" declines and says that ``decide="always"`` captures anyway.
Inductor makes its own checks when it compiles (inputs it cannot treat as static and the graph mutates, CPU
tensors); a refusal there is caught from its log and put in the report.

Training graphs are captured under ``decide="always"`` only: forward and backward, by Inductor's trees as under
``mode="reduce-overhead"`` (a new step's graphs replay once the last backward has run, or after
``torch.compiler.cudagraph_mark_step_begin()``). A training step with its optimizer is no inference graph the
roofline above can weigh, so "auto" leaves it and says how to ask. On the H100 a Llama training step was
host-bound without graphs (README, "Distributed training"), which is what capture removes. Run on one GPU and
under DDP; not yet under FSDP2, which frees and gathers the parameters again each step (the trees record again
when a static input moves).

Outputs: a replay writes its outputs into the pool, where the next replay overwrites them. Code that keeps an
output past the next call (``generate()`` keeps the logits while it runs the next step) would then read another
call's values, which cudagraph trees turn into an error ("accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run"). So by default the outputs are copied out after each replay (those that are
views of the inputs are not: they live outside the pool); ``copy_outputs=False`` saves the copy for code that
never keeps an output past the next call. Not yet shown on the GPU: in tests/gpu an output kept past the next call
without the copy was not overwritten (cudagraph trees saw it alive); the failure above is the decoding recipe's
(issue 17), which has not been run under this pass yet. Until it has, the copy stays on by default.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Literal, Sequence

import sympy
import torch
import torch.fx as fx

from kpt_compiler import graph_utils, torch_ir as ir
from kpt_compiler.registry import PassContext, graph_pass

from ._bucket_graphs import own_capture, per_bucket
from ._flops import _count_flops, _flops_expr, _int
from ._cudagraph_log import SkipLog as _SkipLog
from ._cudagraph_log import listening as _listening

# CUDA graphs pay where launches dominate: under 1 ms of estimated device time a transformer's 50-300 kernels
# cost the host as much as the device or more (GPT-2 1x64 and the 8-layer Llama at 1x128 gain 3.5-3.9x with
# graphs on the H100, 2026-11-25-full.md); above it the saving shrinks and the output copy grows
DEFAULT_LAUNCH_BOUND_MS = 1.0
COPY_SHARE = 0.1  # the output copy may cost this share of the graph's estimated device time

# host synchronizations a CUDA graph cannot hold (Dynamo breaks the graph at most data-dependent ones)
_SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero"}
_SYNC_FUNCTIONS = {torch.nonzero, torch.masked_select}


@dataclasses.dataclass(frozen=True)
class CudaGraphsOptions:
    # "auto": capture small inference graphs where the card's calibration says launches dominate; "always":
    # every inference graph that is safe to capture
    decide: Literal["auto", "always"] = "auto"
    # under "auto": capture graphs whose estimated device time is under this many milliseconds
    launch_bound_ms: float = DEFAULT_LAUNCH_BOUND_MS
    # copy the outputs out of the graph's memory pool after each replay, so they stay valid after the next call
    copy_outputs: bool = True
    # bucketed graphs (one CUDA graph per bucket): stop capturing new buckets once their pool holds this much
    max_pool_mb: float | None = None
    # graphs that write into their inputs (a static KV cache): a new buffer of the captured layout, where nothing
    # else holds it or the old one, moves into the storage the last capture kept instead of being captured
    # (passes/_bucket_graphs.py); False captures each new one and keeps no storage
    move_inputs: bool = True

    def __post_init__(self):
        if not self.launch_bound_ms > 0:
            raise ValueError(f"launch_bound_ms must be positive, got {self.launch_bound_ms}")
        if self.max_pool_mb is not None and not self.max_pool_mb > 0:
            raise ValueError(f"max_pool_mb must be positive (or None for no cap), got {self.max_pool_mb}")


def _supports(target, options) -> str | None:
    if not target.is_cuda:
        return f"CUDA graphs need a CUDA device; this graph runs on {target.device}"
    return None


@graph_pass("cudagraphs", summary="small inference graphs captured as CUDA graphs (Inductor's cudagraph trees), "
            "outputs copied out of the pool", stage="pre_aot", options=CudaGraphsOptions, default=True,
            statistics=("captured",), supports=_supports)
def cudagraphs(gm: fx.GraphModule, ctx: PassContext) -> bool:
    if gm.meta.get("kpt_served"):  # passes/_bucket_frames.py: never compiled
        ctx.note("not captured: the frame's dynamic graph serves this one, and its buckets are captured there; "
                 "calls it cannot take run this graph as it is (eagerly), uncaptured")
        return False
    why = _refusal(gm, ctx)
    if why:
        ctx.note(f"not captured: {why}")
        return False
    plan = _bucketing_plan(gm)
    if plan is not None:
        return per_bucket(gm, ctx, plan,
                          lambda sizes, ceilings: bucket_ms(gm, sizes, ceilings, ctx.options.launch_bound_ms))
    keep = _outputs_in_pool(gm) if ctx.options.copy_outputs else None
    if ctx.options.decide == "auto":
        why = _too_big(gm, ctx, keep)
        if why:
            ctx.note(f"not captured: {why}")
            return False
    mutated = _mutated_inputs(gm) if ctx.is_inference else None  # training: Inductor's trees weigh mutations
    if mutated:  # a static KV cache's update: Inductor's trees decline it (tokens as without graphs on the H100)
        return own_capture(ctx, mutated)
    # Inductor's refusals come in its log, at compile time or at the first call (cudagraph trees check the
    # inputs when they record): listened to until the first call is over, then put in this pass's notes
    listener = _SkipLog()
    ctx.inductor_config({"triton.cudagraphs": True})  # the forward's compile and, later, the backward's
    ctx.during_aot(lambda: _listening(listener))
    ctx.note_after_compile(listener.report_to)
    ctx.count("captured")
    ctx.note(f"captured as a CUDA graph (Inductor's cudagraph trees; decide={ctx.options.decide!r})"
             if ctx.is_inference else "forward and backward captured as CUDA graphs (Inductor's cudagraph trees; "
             "decide='always'); a step's graphs replay once its backward has run, or from "
             "torch.compiler.cudagraph_mark_step_begin()")
    if keep is not None:
        ctx.note("outputs copied out of the CUDA graphs' pool after each call (copy_outputs=False leaves them there, "
                 "valid until the next call)")

    # a training graph's backward is compiled and recorded at the first backward, which a training loop runs
    # before the second call: its refusals are heard until that call ends
    calls_heard = 1 if ctx.is_inference else 2

    def after(outputs):
        if listener.listening:  # counted only until then: this runs on every call
            listener.calls += 1
            if listener.calls >= calls_heard:
                listener.stop()
        return _copy_out(outputs, keep) if keep is not None else outputs

    ctx.after_each_call(after)
    return True  # applied: the graph is the same, Inductor compiles it into a CUDA graph


def _refusal(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    """Why this graph must not be captured, or None."""
    if not ctx.is_inference and ctx.options.decide != "always":
        return ("a training graph: decide='auto' weighs inference graphs only; decide='always' captures forward "
                "and backward (Inductor's cudagraph trees, as mode='reduce-overhead' does)")
    if ctx.codegen != "inductor":
        return f"codegen {ctx.codegen!r} (Inductor captures the graphs)"
    if ctx.mode in ("reduce-overhead", "max-autotune"):
        return f"mode={ctx.mode!r} captures every graph already"
    if ctx.mode == "max-autotune-no-cudagraphs":
        return "mode='max-autotune-no-cudagraphs' asks for none"
    return graph_refusal(gm)


def graph_refusal(gm: fx.GraphModule) -> str | None:
    """What in the graph itself forbids a capture (dynamic sizes no bucket fixes, a host sync, an op tagged
    cudagraph_unsafe, an input off the GPU), or None; the sparsity-2-4 pass asks it too."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    plan = _bucketing_plan(gm)
    bucketed = frozenset(plan.symbols) if plan is not None else frozenset()
    for node in placeholders:
        value = ir.example_value(node)
        sizes = [value] if isinstance(value, torch.SymInt) else list(value.shape) if isinstance(
            value, torch.Tensor) else []
        free = set().union(*[s.node.expr.free_symbols for s in sizes if isinstance(s, torch.SymInt)])
        if free - bucketed:
            return (f"input {node.name} has dynamic sizes ({', '.join(sorted(map(str, free - bucketed)))}): a CUDA "
                    "graph holds one size, so each new size would record another (options={'bucketing': True} "
                    "pads them to a few sizes)")
    for node in gm.graph.nodes:
        if node.op in ("call_method", "call_function"):
            if node.op == "call_method" and node.target in _SYNC_METHODS or node.target in _SYNC_FUNCTIONS:
                return f"{node.name} ({getattr(node.target, '__name__', node.target)}) waits for the host"
            tag = getattr(torch.Tag, "cudagraph_unsafe", None)
            if tag is not None and isinstance(node.target, torch._ops.OpOverload) and tag in node.target.tags:
                return f"{node.name} ({node.target}) is tagged cudagraph_unsafe"
    for node in placeholders:
        value = ir.example_value(node)
        if isinstance(value, torch.Tensor) and value.device.type != "cuda":
            return f"input {node.name} is on {value.device}, not on the GPU"
    return None


def _bucketing_plan(gm: fx.GraphModule):
    plan = gm.meta.get("kpt_bucketing")
    return plan if plan is not None and not plan.withdrawn else None


def _mutated_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of the inputs the graph writes into in place (through views too): a static cache's update."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        for base in graph_utils.written(node):  # methods, setitem, out=, ATen overloads, foreach lists
            while base.op != "placeholder" and _is_view(base) and base.args and isinstance(base.args[0], fx.Node):
                base = base.args[0]
            if base.op == "placeholder":
                written.add(placeholders.index(base))
    return frozenset(written)


def _too_big(gm: fx.GraphModule, ctx: PassContext, keep: frozenset[int] | None) -> str | None:
    """Under "auto": why the graph is not small enough to pay for capture, or None where it is (``keep``: the
    outputs to copy out after each call, None for none)."""
    cal = ctx.cost_model.calibration if ctx.cost_model is not None else None
    ceilings = cal.ceilings if cal is not None else None
    if not ceilings or not ceilings.get("tflops") or not ceilings.get("copy_tbps"):
        return (f"no calibration of {ctx.target.name} says where launches dominate; decide='always' captures "
                "anyway")
    tflops, tbps = ceilings["tflops"], ceilings["copy_tbps"]
    host = _host_ms(gm, cal)
    try:
        written, params = _bytes(gm)
    except Exception as e:  # noqa: BLE001 - no estimate, no capture under "auto"
        return (f"its device time could not be estimated ({type(e).__name__}: {str(e)[:200]}); decide='always' "
                "captures anyway")
    least_ms = roofline_ms(0.0, written, params, ceilings)  # the bytes alone: the FLOPs only add to it
    if least_ms >= ctx.options.launch_bound_ms and (host is None or host[0] < least_ms):
        # too big on its bytes alone; counting the FLOPs (a run under fake tensors: 0.6 s of GPT-2's warm restart
        # under cProfile on the H100, results/.../2026-11-27-s19-warm-prof-gpt2-kpt-d3322c9.txt) would not change
        # the answer
        launches = f"; at least {host[1]} kernels to launch: {host[0]:.3f} ms on the host" if host else ""
        return (f"its bytes alone take {least_ms:.3f} ms on the device ({(2 * written + params) / 2**20:.0f} MiB at "
                f"{tbps:.1f} TB/s, {cal.card}){launches}: not under launch_bound_ms={ctx.options.launch_bound_ms}, "
                "so launches do not dominate")
    try:
        flops = _count_flops(gm, _fake_inputs(gm))
    except Exception as e:  # noqa: BLE001 - no estimate, no capture under "auto"
        return (f"its device time could not be estimated ({type(e).__name__}: {str(e)[:200]}); decide='always' "
                "captures anyway")
    device_ms = roofline_ms(flops, written, params, ceilings)
    copy_ms = 2 * _output_bytes(gm, keep) / (tbps * 1e9) if keep else 0.0
    figures = (f"estimated {device_ms:.3f} ms on the device ({flops / 1e9:.1f} GFLOP at {tflops:.0f} TFLOP/s, "
               f"{(2 * written + params) / 2**20:.0f} MiB at {tbps:.1f} TB/s, {cal.card})")
    if host is not None:
        figures += f"; at least {host[1]} kernels at {host[2]:.0f} us each to launch: {host[0]:.3f} ms on the host"
    if device_ms >= ctx.options.launch_bound_ms and (host is None or host[0] < device_ms):
        return f"{figures}: not under launch_bound_ms={ctx.options.launch_bound_ms}, so launches do not dominate"
    if copy_ms > COPY_SHARE * device_ms:
        return f"{figures}; copying its outputs out would take {copy_ms:.3f} ms (copy_outputs=False avoids it)"
    ctx.note(f"{figures}: launches dominate")
    return None


def roofline_ms(flops: float, written: int, params: int, ceilings: dict) -> float:
    """A graph's device time at the card's calibrated ceilings: its FLOPs, plus the bytes it writes (and reads
    back) and its inputs' bytes; at least one kernel's floor (a graph of a few bytes still launches)."""
    return max(flops / (ceilings["tflops"] * 1e9) + (2 * written + params) / (ceilings["copy_tbps"] * 1e9),
               ceilings.get("kernel_floor_us", 0.0) / 1e3)


_HEAVY = {"matmul", "linear", "addmm", "sdpa", "softmax", "mean", "layer_norm"}


def _host_ms(gm: fx.GraphModule, cal) -> tuple[float, int, float] | None:
    """(the host's launch time for the graph, the kernels counted, microseconds per launch), a lower bound: one
    kernel per matrix product, attention, reduction, in-place write (a cache update) or op of ours, none for
    pointwise chains (Inductor fuses them into those), at the host time per call of the card's cheapest
    calibrated Inductor kernel (``host_us``); None without that figure. A decoding step on a 4096-wide Llama
    reads 3.8 GiB of weights (1.3 ms on the H100) but launches 160 kernels at ~30 us: the host bounds it."""
    per = [v["inductor"] for v in (cal.data.get("host_us") or {}).values() if isinstance(v, dict) and v.get("inductor")]
    if not per:
        return None
    kernels = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        ours = (getattr(node.target, "__module__", "").startswith("kpt_compiler") and node.target is not operator.getitem
                or getattr(node.target, "namespace", None) == "kpt")  # torch.ops.kpt.*: our custom ops
        if ir.kind(node) in _HEAVY or ours or node.target is torch.nn.functional.embedding or (
                name.endswith("_") and not name.startswith("_") and name != "requires_grad_"):
            kernels += 1
    us = min(per)
    return kernels * us / 1e3, kernels, us


def estimate(gm: fx.GraphModule, sizes: dict | None = None) -> tuple[float, int, int]:
    """(FLOPs of the graph, as torch.utils.flop_counter counts them on a run over the recorded fake values; bytes
    its ops write; bytes of the tensors it reads: the inputs it uses and its constants). An input no node uses
    is not read: a layer's 16-bit weight stays an input of Dynamo's graph after the fp4 pass has replaced it by
    a quarter of its bytes in constants. ``sizes``: values of the dynamic sizes (symbol -> int); the ones not
    given take the sizes of the example Dynamo compiled with."""
    written, inputs = _bytes(gm, sizes)
    return _count_flops(gm, _fake_inputs(gm, sizes), sizes), written, inputs


def bucket_ms(gm: fx.GraphModule, sizes: dict, ceilings: dict, bound_ms: float) -> float:
    """A bucket's device time at the card's ceilings; where its bytes alone take ``bound_ms`` or more, that lower
    bound, as the FLOPs would only add to it: counting them runs the graph under fake tensors, 0.42 s a bucket of
    the 8-layer Llama under cProfile on the H100, 8.8 s of its 100-call stream's pass 1 (s39,
    benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-06-s39-prof-llama-kpt-6591fc4.txt)."""
    written, params = _bytes(gm, sizes)
    least = roofline_ms(0.0, written, params, ceilings)
    if least >= bound_ms:
        return least
    expr = _flops_expr(gm)
    flops = expr.xreplace({s: sympy.Integer(v) for s, v in sizes.items()}) if expr is not None else None
    if flops is None or not flops.is_number:  # no expression, or one of sizes not given: a count at these
        flops = _count_flops(gm, _fake_inputs(gm, sizes), sizes)
    return roofline_ms(float(flops), written, params, ceilings)


def _bytes(gm: fx.GraphModule, sizes: dict | None = None) -> tuple[int, int]:
    """(bytes the graph's ops write, bytes of the tensors it reads): ``estimate`` without the FLOPs."""
    written, inputs = 0, 0
    for node in gm.graph.nodes:
        value = ir.example_value(node)
        if node.op == "placeholder" or node.op == "get_attr":
            inputs += _nbytes(value, sizes) if node.users else 0
        elif node.op in ("call_function", "call_method", "call_module") and isinstance(value, torch.Tensor):
            if not _is_view(node):
                written += _nbytes(value, sizes)
    return written, inputs


def _fake_inputs(gm: fx.GraphModule, sizes: dict | None = None) -> list[Any]:
    """The recorded example inputs, dynamic scalar sizes as ints at ``sizes``."""
    values = [ir.example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    return [_int(v, sizes) if isinstance(v, torch.SymInt) else v for v in values]


_VIEWS = {"view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "flatten", "contiguous",
          "size", "t", "unflatten", "split", "chunk", "narrow"}


def _is_view(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in _VIEWS or node.target is operator.getitem


def _nbytes(value: Any, sizes: dict | None = None) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return math.prod(_int(s, sizes) for s in value.shape) * value.element_size()


def _output_nodes(gm: fx.GraphModule) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]


def _output_bytes(gm: fx.GraphModule, keep: frozenset[int]) -> int:
    return sum(_nbytes(ir.example_value(n)) for i, n in enumerate(_output_nodes(gm)) if i in keep)


def _outputs_in_pool(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of the outputs a replay writes into the pool: not the inputs themselves or views of them."""
    from kpt_compiler.graph_utils import outputs_aliasing_inputs

    aliasing = outputs_aliasing_inputs(gm)
    return frozenset(i for i, n in enumerate(_output_nodes(gm))
                     if isinstance(ir.example_value(n), torch.Tensor) and i not in aliasing)


def _copy_out(outputs: Any, keep: frozenset[int]) -> Any:
    if isinstance(outputs, (list, tuple)):
        copied = [o.clone() if i in keep and isinstance(o, torch.Tensor) else o for i, o in enumerate(outputs)]
        return type(outputs)(copied) if isinstance(outputs, tuple) else copied
    return outputs.clone() if 0 in keep and isinstance(outputs, torch.Tensor) else outputs


__all__: Sequence[str] = ("cudagraphs", "CudaGraphsOptions", "estimate")
