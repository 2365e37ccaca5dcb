"""fusion: what Inductor leaves apart, fused with our kernels (kernels/), where that is faster.

Inductor fuses chains of pointwise and reduction ops itself; these rules fuse across the GEMMs it calls from
cuBLAS and across weights, in Dynamo's torch-level graph (stage pre_aot, so each custom op's own autograd
gives the backward, as for the attention pass). Rules, in the order they run::

    batch_norm(conv2d(x, W, b), mean, var, g, beta, training=False)   # conv_bn (inference: running stats)
        -> conv2d(x, W * s, (b - mean) * s + beta), s = g / sqrt(var + eps)
    rms_norm(a + r) as Llama writes it (or F.rms_norm), layer_norm(a + r)   # norm
        -> y, h = add_rms_norm(a, r, w, eps)   /  add_layer_norm(a, r, w, b, eps)  (h keeps its other users)
    act(linear(x, Wg)) * linear(x, Wu)                                # gated (Llama's MLP)
        -> gated_linear(x, Wg, Wu, act)                                 (x read once, no [M, 2I] tensor)
    act(linear(x, W, b)) + r                                          # epilogue (bias/act/residual, any subset)
        -> linear_epilogue(x, W, b, r, act)
    linear(x, W1), linear(x, W2), ... (same x)                        # horizontal (q, k, v projections)
        -> split(linear(x, cat([W1, W2, ...])), [N1, N2, ...])

On by default (``options={"fusion": False}`` turns it off). On the H100 (2026-11-26, README) it takes the zoo
Llama from 5.01 to 4.60 ms at 8x1024, and at 1x128 without CUDA graphs from 1.92 to 1.58 ms (Inductor: 1.97);
under CUDA graphs that step takes 0.471 ms against Inductor's 0.561. Where Inductor compiles for CUDA and no
gradient flows, the GEMM rules emit the kernels' triton_op forms, which Inductor launches as its own kernels
(a quarter of the host time of a custom op). On BERT fusion neither gains nor costs (6.98 ms against 6.97
without, 2026-11-26-s6-suite-llama-bert.md): q/k/v merging saves launches, which count at decode sizes and
not at its 16384 rows. Fusion stays out of training graphs unless ``decide="always"``: its calibration times
forward passes, and a Llama training step measured slower with it.

Each GEMM and norm rewrite is taken only when ``kpt_compiler.profitability.decide`` says ours is faster
for that shape, dtype and device (``decide`` option: "auto", "measure", "always"; see that module); the report
notes every decision with its figures. The conv_bn rule removes a pass over the activations where the code
is run as written (codegen="eager"), and steps aside under Inductor, which fuses an inference batch norm
into the kernel after the convolution itself.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.graph_utils import drop_unused
from kpt_compiler.pipeline import PassContext, graph_pass
from kpt_compiler.profitability import Candidate, decide

# The cost model (kpt_compiler/profitability.py): ours against Inductor in device time (CUDA-graph replays),
# (M, K, N, speed-up), bf16, on an NVIDIA H100 80GB HBM3, 2026-11-26: `python -m benchmarks.bench_gated_linear`
# and `python -m benchmarks.bench_linear_epilogue --activation gelu_tanh` (results under benchmarks/results/),
# and linear_epilogue's point at 128 x 1024 x 1024 from the zoo Llama's profile under CUDA graphs, fusion on and
# off (`python -m benchmarks.profile_case --model llama-eager --case inference:1x128`, saved as
# 2026-11-26-profile-llama-1x128.json: 7.7 us per call against cuBLAS's 5.2 us; there the gated kernel took
# 9.4 us against 13.1 us for two cuBLAS GEMMs and Inductor's silu-mul, as its bench says).
CALIBRATION = {
    "gated_linear": ((4096, 4096, 4096, 1.09), (8192, 8192, 8192, 1.05), (8192, 4096, 14336, 1.06),
                     (8192, 1024, 2816, 1.39), (128, 4096, 4096, 1.08), (1, 4096, 4096, 1.25),
                     (128, 1024, 1024, 1.24), (128, 1024, 2816, 1.41), (128, 2816, 1024, 0.90)),
    "linear_epilogue": ((4096, 4096, 4096, 1.10), (8192, 8192, 8192, 1.01), (8192, 4096, 14336, 1.03),
                        (8192, 1024, 2816, 0.73), (128, 4096, 4096, 1.08), (1, 4096, 4096, 0.76),
                        (128, 1024, 1024, 0.68)),
    # the horizontal rule on q, k, v projections: one GEMM over the weights concatenated on every call against
    # three (bench_dispatch, Inductor's marginal device time): grouped-query as in the zoo Llama (K=1024,
    # N=1024+256+256), multi-head (N=3K: `--k 1024` and `--k 768 --rows 16384` for BERT's shape). The gain is
    # the launches saved; from 8192 rows it is gone (2026-11-26-s6-bench_dispatch-qkv*.md)
    "horizontal": ((1, 1024, 1536, 1.81), (128, 1024, 1536, 1.74), (1024, 1024, 1536, 1.67),
                   (8192, 1024, 1536, 0.99), (1024, 1024, 3072, 1.16), (8192, 1024, 3072, 0.98),
                   (16384, 768, 2304, 1.06)),
    # an epilogue without activation (bias and/or residual only) against the GEMM alone: cuBLAS adds a bias
    # in its own epilogue and Inductor folds a residual add into the kernel after (the next norm), so the
    # unfused side is one cuBLAS call (bench_linear_epilogue's "ours / cuBLAS" column)
    "linear_epilogue_vs_gemm": ((4096, 4096, 4096, 0.91), (8192, 8192, 8192, 0.96), (8192, 4096, 14336, 0.87),
                                (8192, 1024, 2816, 0.47), (128, 4096, 4096, 0.94), (1, 4096, 4096, 0.67),
                                (128, 1024, 1024, 0.68)),
}
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs

# Host time per call in microseconds for modes without CUDA graphs: ours as the *_inference op, ours as the
# triton_op form (which Inductor launches as its own kernel: the form the pass emits where Inductor compiles for
# CUDA), and Inductor's, each the marginal cost of one more call inside a compiled graph (`python -m
# benchmarks.bench_dispatch`, columns inductor+inference, inductor+triton and inductor; on the H100 machine's
# host, 2026-11-26, M=128: host time hardly depends on M). Inductor's side is two GEMMs and a pointwise kernel
# for gated; a GEMM and a pointwise kernel for an epilogue with activation, the GEMM alone without. The
# figures move by 10-20% between runs; the decisions they drive differ by more.
HOST_US = {
    "gated_linear": {"inference": 53.5, "triton": 12.4, "inductor": 36.9},
    "linear_epilogue": {"inference": 58.5, "triton": 13.7, "inductor": 25.2},
    "linear_epilogue_vs_gemm": {"inference": 58.5, "triton": 13.7, "inductor": 15.2},
    # the concatenation and one GEMM against three GEMMs (Inductor generates both sides)
    "horizontal": {"inference": 40.4, "triton": 40.4, "inductor": 49.6},
}
# Inductor's device time per call, estimated for weighing the host times: the GEMMs at PEAK_TFLOPS or their
# bytes at COPY_TBPS, whichever is slower, plus KERNEL_FLOOR_US per kernel (a cuBLAS GEMM at 128 x 1024 x 1024
# takes 3.7 us, its bytes 0.7 us). H100 figures from ../ANCHORS.md and bench_dispatch.
PEAK_TFLOPS, COPY_TBPS, KERNEL_FLOOR_US = 700.0, 3.0, 3.0


def calibration(kind: str) -> tuple:
    """The calibrated device-time points of a kind (empty: the kind has none)."""
    return CALIBRATION.get(kind, ())


def host_costs(kind: str, mode: str, form: str = "inference") -> tuple[float, float] | None:
    """(ours, Inductor's) host microseconds per call, ours as ``form`` ("inference" or "triton"; see HOST_US);
    they count only where no CUDA graph replays the calls."""
    if mode in CUDA_GRAPH_MODES or kind not in HOST_US:
        return None
    return HOST_US[kind][form], HOST_US[kind]["inductor"]


def inductor_device_us(rows: int, K: int, Ns: list[int], kernels: int) -> float:
    """Inductor's device time per call, estimated (see PEAK_TFLOPS): GEMMs [rows, K] x [K, N] in bf16."""
    flops = 2 * rows * K * sum(Ns)
    nbytes = 2 * (rows * K + sum(Ns) * K + rows * sum(Ns))
    return max(flops / (PEAK_TFLOPS * 1e6), nbytes / (COPY_TBPS * 1e6)) + KERNEL_FLOOR_US * kernels


# Kinds without a calibration (the norms; the GEMM kinds in dtypes other than bf16, which no table measured):
# taken from this many rows up; None: never, unless decide="measure" times it. Never for all of them today: the
# norms do not beat Inductor's own, and the GEMM figures are bf16's (q/k/v merging, for one, gains at small M
# and nothing from 8192 rows, which no row threshold can say).
MIN_ROWS = {"gated_linear": None, "linear_epilogue": None, "horizontal": None, "add_rms_norm": None,
            "add_layer_norm": None}


@dataclasses.dataclass(frozen=True)
class FusionOptions:
    conv_bn: bool = True  # inference: fold batch norm (running statistics) into the convolution before it
    norm: bool = True  # residual add + RMSNorm / LayerNorm -> one kernel returning both
    gated: bool = True  # act(x @ Wg^T) * (x @ Wu^T) -> one GEMM kernel reading x once
    epilogue: bool = True  # GEMM + bias / activation / residual add -> one GEMM kernel
    horizontal: bool = True  # linears sharing their input -> one GEMM over concatenated weights
    # "auto": cached measurements, else the cost model; "measure": time on the device at compile time
    # (the default under mode="max-autotune"); "always": every match (tests; users who measured)
    decide: Literal["auto", "measure", "always"] = "auto"


def _activation(node: Any) -> str | None:
    """The activation a node applies, in our kernels' names, or None."""
    k = ir.kind(node)
    if k in ("silu", "relu"):
        return k
    if k == "gelu":
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(ir.arg(node, "approximate", "none"))
    return None


@graph_pass("fusion", summary="GEMM epilogues, gated MLPs, residual+norm, q/k/v projections, conv+bn -> fused",
            stage="pre_aot", options=FusionOptions, default=True,
            statistics=("matches", "near_misses", "conv_bn", "norm", "gated", "epilogue", "horizontal"),
            supports=lambda target, options: "XLA fuses for itself" if target.device == "xla" else None)
def fuse(gm: fx.GraphModule, ctx: PassContext) -> bool:
    how = "measure" if ctx.options.decide == "auto" and ctx.mode == "max-autotune" else ctx.options.decide
    changed = False
    for rule in (_conv_bn, _norm, _gated, _epilogue, _horizontal):
        if getattr(ctx.options, rule.__name__[1:]):
            for node in list(gm.graph.nodes):
                if node.graph is gm.graph and (node.users or node.op == "placeholder"):  # not replaced already
                    changed |= bool(rule(gm, node, ctx, how))
            drop_unused(gm.graph)  # what a rewrite replaced must not match the next rule
    return changed


# ---------------------------------------------------------------------------------------------- helpers


def _val(node: Any) -> Any:
    return ir.example_value(node)


def _one_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _needs_grad(node: fx.Node) -> bool:
    """Whether a gradient flows through ``node`` (training). Where none does, the rules emit the kernels'
    ``*_inference`` ops, which skip the custom op's Python autograd layer (host time; see linear_epilogue)."""
    v = _val(node)
    return not isinstance(v, torch.Tensor) or v.requires_grad


def _rows(x: fx.Node) -> int | None:
    v = _val(x)
    if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape) or v.dim() < 1:
        return None
    return v.numel() // max(v.shape[-1], 1)


def _ask(ctx: PassContext, how: str, node: fx.Node, kind: str, x: fx.Node, shapes: dict, ours=None,
         baseline_ms=None, source=None, table: str | None = None, gemm_ns: list[int] | None = None,
         unfused_kernels: int = 1) -> bool:
    """Whether to rewrite (profitability.decide). ``table``: the calibration and host-cost entry (default
    ``kind``); ``gemm_ns`` and ``unfused_kernels``: the GEMMs' N and the kernel count on Inductor's side, for
    its estimated device time (weighed against host times without CUDA graphs)."""
    rows, v = _rows(x), _val(x)
    if rows is None:
        ctx.near_miss(f"{node.name}: {kind} with dynamic shapes (the decision needs sizes)")
        return False
    if how != "always" and _needs_grad(node):
        # the calibration and the measured decisions time forward passes; in training the backward weighs as
        # much (ours recomputes its GEMMs), and the H100 suite had the Llama training step slower with fusion
        ctx.near_miss(f"{node.name}: {kind} in a training graph: the cost model covers the forward only "
                      "(decide='always' takes it)")
        return False
    table = table or kind
    N = sum(shapes["N"]) if isinstance(shapes.get("N"), list) else shapes.get("N")  # horizontal: the fused N
    mkn = (rows, shapes["K"], N) if isinstance(N, int) and "K" in shapes else None
    host = host_costs(table, ctx.mode, "triton" if _triton_form(ctx) else "inference")
    device_us = inductor_device_us(rows, shapes["K"], gemm_ns, unfused_kernels) if host and gemm_ns else None
    d = decide(how, Candidate(kind, rows, shapes, v.dtype, v.device, MIN_ROWS[kind], ours, baseline_ms, source,
                              mkn, calibration(table) if v.dtype == torch.bfloat16 else (),
                              host if device_us is not None else None, device_us))
    if not d.rewrite:
        ctx.near_miss(f"{node.name}: {kind} not faster here ({d.why})")
    else:
        ctx.note(f"{node.name}: {kind} {rows}x{shapes} ({d.why})")
    return d.rewrite


def _triton_form(ctx: PassContext) -> bool:
    """Whether the GEMM rules emit the kernels' triton_op form where no gradient flows: where Inductor
    compiles for CUDA, which then launches the kernel as one of its own (see linear_epilogue_triton)."""
    from kpt_compiler.kernels.linear_epilogue import HAVE_TRITON

    return HAVE_TRITON and ctx.host == "inductor" and ctx.target.device == "cuda"


def _fused_op(ctx: PassContext, kernel, name: str, needs_grad: bool):
    """The op a GEMM rule emits: the custom op (with autograd) where a gradient flows; else the triton_op
    form (``_triton_form``), or the ``*_inference`` op, which skips the custom op's Python autograd layer."""
    if needs_grad:
        return getattr(kernel, name)
    return getattr(torch.ops.kpt, f"{name}_triton" if _triton_form(ctx) else f"{name}_inference").default


def _emit(gm, fn, args, kwargs=None, like=None):
    return ir.emit(gm.graph, fn, args, kwargs or {}, like=like)


def _replace(old: fx.Node, new: fx.Node) -> None:
    old.replace_all_uses_with(new)


def _same_tensor_shape(a: Any, b: Any) -> bool:
    va, vb = _val(a), _val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device)


# ---------------------------------------------------------------------------------------------- conv + bn


def folded_weight(w, var, gamma, eps):
    scale = torch.rsqrt(var.float() + eps) * (gamma.float() if gamma is not None else 1.0)
    return (w.float() * scale.reshape(-1, *([1] * (w.dim() - 1)))).to(w.dtype)


def folded_bias(b, mean, var, gamma, beta, eps, like):
    scale = torch.rsqrt(var.float() + eps) * (gamma.float() if gamma is not None else 1.0)
    shift = ((b.float() if b is not None else 0.0) - mean.float()) * scale
    return (shift + (beta.float() if beta is not None else 0.0)).to(like.dtype)


def _conv_bn(gm, bn, ctx, how):  # batch_norm(conv2d(x, W, b), ..., training=False) -> conv2d(x, W', b')
    if ir.kind(bn) != "batch_norm" or ir.arg(bn, "training", False) is not False:
        return False
    conv = ir.arg(bn, "input")
    if ir.kind(conv) != "conv2d" or not _one_user(conv):
        return False
    mean, var = ir.arg(bn, "running_mean"), ir.arg(bn, "running_var")
    gamma, beta, eps = ir.arg(bn, "weight", None), ir.arg(bn, "bias", None), ir.arg(bn, "eps", 1e-5)
    if not (isinstance(mean, fx.Node) and isinstance(var, fx.Node) and isinstance(eps, float)):
        return False
    if ctx.host == "inductor" and how != "always":
        # Inductor already fuses an inference batch norm into the pointwise kernel after the convolution, so
        # folding saves no pass over the activations; the folded weights, computed on every call (they are
        # graph inputs), cost one over the weights. ResNet-50 on the H100: 3.29 ms with the fold, 3.18 without
        # (2026-11-26-s5-suite-gpt2-bert-resnet.md).
        ctx.near_miss(f"{bn.name}: conv_bn left to Inductor (it fuses the batch norm into the kernel after "
                      f"{conv.name}; the fold would recompute the weights on every call)")
        return False
    w, b = ir.arg(conv, "weight"), ir.arg(conv, "bias", None)
    with gm.graph.inserting_before(bn):
        w2 = _emit(gm, folded_weight, (w, var, gamma, eps), like=conv)
        b2 = _emit(gm, folded_bias, (b, mean, var, gamma, beta, eps, w), like=conv)
        rest = [ir.arg(conv, n, d) for n, d in (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))]
        new = _emit(gm, torch.conv2d, (ir.arg(conv, "input"), w2, b2, *rest), like=bn)
    _replace(bn, new)
    ctx.count()
    ctx.count("conv_bn")
    ctx.note(f"{bn.name}: batch norm folded into {conv.name}")
    return True


# ---------------------------------------------------------------------------------------------- norms


def _rms_chain(out: fx.Node):
    """Llama's RMSNorm: w * (hf * rsqrt(mean(hf ** 2, -1, keepdim=True) + eps)).to(dtype), hf = h.float()
    -> (h, w, eps) or None."""
    if ir.kind(out) != "mul":
        return None
    for w, c in ((ir.arg(out, "input"), ir.arg(out, "other")), (ir.arg(out, "other"), ir.arg(out, "input"))):
        if ir.kind(c) != "cast" or not _one_user(c) or not isinstance(w, fx.Node):
            continue
        m = ir.arg(c, "input")
        if ir.kind(m) != "mul" or not _one_user(m):
            continue
        a, r = ir.arg(m, "input"), ir.arg(m, "other")
        hf, r = (a, r) if ir.kind(r) == "rsqrt" else (r, a)
        if ir.kind(r) != "rsqrt" or ir.kind(ir.arg(r, "input")) != "add":
            continue
        add = ir.arg(r, "input")
        mean, eps = ir.arg(add, "input"), ir.arg(add, "other")
        if ir.kind(mean) != "mean" or not isinstance(eps, float):
            continue
        sq = ir.arg(mean, "input")
        if ir.kind(sq) != "pow" or ir.arg(sq, "input") is not hf or ir.arg(sq, "exponent") != 2:
            continue
        dim, keep = ir.arg(mean, "dim", None), ir.arg(mean, "keepdim", False)
        if dim not in (-1, [-1], (-1,)) or keep is not True:
            continue
        h = ir.arg(hf, "input") if ir.kind(hf) == "cast" and ir.cast_dtype(hf) == torch.float32 else hf
        if c.args[1:] and ir.cast_dtype(c) != _val(h).dtype or _val(w).dim() != 1:
            continue
        return h, w, eps
    return None


def _norm(gm, node, ctx, how):  # norm(a + r) -> y, h = add_<norm>(a, r, ...)
    k = ir.kind(node)
    if k in ("rms_norm", "layer_norm"):
        h = ir.arg(node, "input")
        shape = ir.arg(node, "normalized_shape")
        if not isinstance(shape, (list, tuple)) or len(shape) != 1:
            return False
        w = ir.arg(node, "weight", None)
        eps = ir.arg(node, "eps", None)
        extra = {"cast_before_weight": False} if k == "rms_norm" else {"bias": ir.arg(node, "bias", None)}
        if k == "rms_norm" and eps is None:  # F.rms_norm's default: float32's eps for half-precision inputs
            eps = torch.finfo(torch.promote_types(_val(h).dtype, torch.float32)).eps
        elif k == "layer_norm" and eps is None:
            eps = 1e-5
    else:
        found = _rms_chain(node)
        if found is None:
            return False
        (h, w, eps), extra, k = found, {"cast_before_weight": True}, "rms_norm"
    if ir.kind(h) != "add" or h.kwargs.get("alpha", 1) != 1 or not isinstance(eps, float):
        return False
    a, r = ir.arg(h, "input"), ir.arg(h, "other")
    if not (isinstance(a, fx.Node) and isinstance(r, fx.Node) and _same_tensor_shape(a, r) and _same_tensor_shape(a, h)):
        return False
    kind = "add_" + k
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    params = [p for p in (w, extra.get("bias")) if isinstance(p, fx.Node)]
    if any(order[p] > order[h] for p in params):
        return False  # the fused op goes where the add was: its weights must exist there
    if not _ask(ctx, how, node, kind, a, {"N": _val(a).shape[-1]}, source=_kernels(kind)):
        return False
    fn = getattr(_kernels(kind), kind)
    with gm.graph.inserting_before(h.next):
        if k == "rms_norm":
            both = _emit(gm, fn, (a, r, w, eps), extra, like=node)
        else:
            both = _emit(gm, fn, (a, r, w, extra["bias"], eps), like=node)
        y = _emit(gm, operator.getitem, (both, 0), like=node)
        h_new = _emit(gm, operator.getitem, (both, 1), like=h)
    _replace(node, y)
    _replace(h, h_new)
    ctx.count()
    ctx.count("norm")
    return True


def _kernels(kind: str):
    import importlib

    module = {"add_rms_norm": "rms_norm", "add_layer_norm": "layer_norm"}.get(kind, kind)
    return importlib.import_module(f"kpt_compiler.kernels.{module}")


# ---------------------------------------------------------------------------------------------- GEMMs


def _plain_linear(node: Any, x: Any = None) -> bool:
    """A bias-free linear (of ``x`` if given) whose output has one user."""
    return (ir.kind(node) == "linear" and ir.arg(node, "bias", None) is None and _one_user(node)
            and (x is None or ir.arg(node, "input") is x))


def _gemm_baseline(device, rows: int, K: int, Ns: list[int], dtype, epilogue_bytes: int):
    """Inductor at its best: the cuBLAS GEMMs, then its fused epilogue at this card's copy bandwidth."""
    def ms():
        from kpt_compiler.bench import copy_bandwidth, median_ms

        x = torch.randn(rows, K, device=device, dtype=dtype)
        ws = [torch.randn(n, K, device=device, dtype=dtype) for n in Ns]
        gemm = median_ms(lambda: [F.linear(x, w) for w in ws], device.type, warmup_ms=25, rep_ms=100)
        return gemm + epilogue_bytes / (copy_bandwidth(device=device.type) * 1e12) * 1e3
    return ms


def _gated(gm, node, ctx, how):  # act(linear(x, Wg)) * linear(x, Wu) -> gated_linear(x, Wg, Wu, act)
    if ir.kind(node) != "mul":
        return False
    a, b = ir.arg(node, "input"), ir.arg(node, "other")
    for act, up in ((a, b), (b, a)):
        name = _activation(act)
        if name is None or not _one_user(act) or not _plain_linear(ir.arg(act, "input")):
            continue
        gate = ir.arg(act, "input")
        x = ir.arg(gate, "input")
        if not _plain_linear(up, x):
            continue
        wg, wu = ir.arg(gate, "weight"), ir.arg(up, "weight")
        if _val(wg).shape != _val(wu).shape:
            continue
        N, K = _val(wg).shape
        rows, dtype, device = _rows(x), _val(x).dtype, _val(x).device
        from kpt_compiler.kernels import gated_linear as kernel

        def ours(rows=rows, N=N, K=K):
            t = [torch.randn(*s, device=device, dtype=dtype) for s in ((rows, K), (N, K), (N, K))]
            return lambda: kernel.gated_linear(*t, name)
        if not _ask(ctx, how, node, "gated_linear", x, {"K": K, "N": N, "act": name},
                    ours=ours() if how == "measure" else None, source=kernel,
                    baseline_ms=_gemm_baseline(device, rows or 0, K, [N, N], dtype, 3 * (rows or 0) * N * 2),
                    gemm_ns=[N, N], unfused_kernels=3):
            return False
        with gm.graph.inserting_before(node):
            op = _fused_op(ctx, kernel, "gated_linear", _needs_grad(node))
            new = _emit(gm, op, (x, wg, wu, name), like=node)
        _replace(node, new)
        ctx.count()
        ctx.count("gated")
        return True
    return False


def _epilogue(gm, node, ctx, how):  # act(linear(x, W, b)) + r -> linear_epilogue(x, W, b, r, act)
    if ir.kind(node) != "linear":
        return False
    x, w, bias = ir.arg(node, "input"), ir.arg(node, "weight"), ir.arg(node, "bias", None)
    last, act, residual = node, "none", None
    if _one_user(last) and _activation(next(iter(last.users))) is not None:
        last = next(iter(last.users))
        act = _activation(last)
    if _one_user(last) and ir.kind(next(iter(last.users))) == "add":
        add = next(iter(last.users))
        other = ir.arg(add, "other") if ir.arg(add, "input") is last else ir.arg(add, "input")
        if add.kwargs.get("alpha", 1) == 1 and isinstance(other, fx.Node) and _same_tensor_shape(other, add) \
                and _same_tensor_shape(last, add):
            last, residual = add, other
    if bias is None and act == "none" and residual is None:
        return False
    if isinstance(bias, fx.Node) and _val(bias).dtype != _val(x).dtype:
        return False
    N, K = _val(w).shape
    rows, dtype, device = _rows(x), _val(x).dtype, _val(x).device
    from kpt_compiler.kernels import linear_epilogue as kernel

    def ours():
        t = [torch.randn(*s, device=device, dtype=dtype) for s in ((rows, K), (N, K), (N,), (rows, N))]
        return lambda: kernel.linear_epilogue(t[0], t[1], t[2] if bias is not None else None,
                                              t[3] if residual is not None else None, act)
    epilogue = (2 + (residual is not None)) * (rows or 0) * N * 2
    if not _ask(ctx, how, last, "linear_epilogue", x, {"K": K, "N": N, "act": act, "bias": bias is not None,
                                                       "residual": residual is not None},
                ours=ours() if how == "measure" else None, source=kernel,
                baseline_ms=_gemm_baseline(device, rows or 0, K, [N], dtype, epilogue),
                table="linear_epilogue" if act != "none" else "linear_epilogue_vs_gemm", gemm_ns=[N],
                unfused_kernels=2 if act != "none" else 1):
        return False
    with gm.graph.inserting_before(last):
        op = _fused_op(ctx, kernel, "linear_epilogue", _needs_grad(last))
        new = _emit(gm, op, (x, w, bias, residual, act), like=last)
    _replace(last, new)
    ctx.count()
    ctx.count("epilogue")
    return True


def _horizontal(gm, x, ctx, how):  # linear(x, W1), linear(x, W2), ... -> split(linear(x, cat(Ws)))
    members = [u for u in x.users if ir.kind(u) == "linear" and ir.arg(u, "input") is x]
    groups: dict = {}
    for m in members:
        w, b = ir.arg(m, "weight"), ir.arg(m, "bias", None)
        wv = _val(w)
        if isinstance(w, fx.Node) and isinstance(wv, torch.Tensor) and wv.dim() == 2:
            groups.setdefault((wv.dtype, wv.shape[1], b is None), []).append(m)
    if all(len(g) < 2 for g in groups.values()):
        return False  # the common case (this runs for every node): no graph walk
    changed = False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for (dtype, K, no_bias), group in groups.items():
        first = min(group, key=order.__getitem__)
        group = [m for m in group if all(order.get(a, -1) < order[first] for a in m.all_input_nodes)]
        if len(group) < 2 or not _views_stay_valid(group):
            continue
        group.sort(key=order.__getitem__)
        Ns = [_val(ir.arg(m, "weight")).shape[0] for m in group]
        rows, device = _rows(x), _val(x).device

        def ours(Ns=Ns, K=K):
            xs = torch.randn(rows, K, device=device, dtype=dtype)
            ws = [torch.randn(n, K, device=device, dtype=dtype) for n in Ns]
            return lambda: F.linear(xs, torch.cat(ws))
        if not _ask(ctx, how, first, "horizontal", x, {"K": K, "N": Ns},
                    ours=ours() if how == "measure" else None, source=_horizontal,
                    baseline_ms=_gemm_baseline(device, rows or 0, K, Ns, dtype, 0), gemm_ns=Ns,
                    unfused_kernels=len(Ns)):
            continue
        with gm.graph.inserting_before(first):
            w = _emit(gm, torch.cat, ([ir.arg(m, "weight") for m in group], 0), like=first)
            b = None if no_bias else _emit(gm, torch.cat, ([ir.arg(m, "bias") for m in group], 0), like=first)
            y = _emit(gm, F.linear, (x, w, b), like=first)
            parts = _emit(gm, torch.split, (y, Ns, -1), like=first)
            for i, m in enumerate(group):
                _replace(m, _emit(gm, operator.getitem, (parts, i), like=m))
        ctx.count()
        ctx.count("horizontal")
        changed = True
    return changed


def _views_stay_valid(group: list[fx.Node]) -> bool:
    """A slice of the fused output has the fused row stride: check each ``.view`` user still works on it."""
    total = sum(_val(m).shape[-1] for m in group)
    for m in group:
        v = _val(m)
        strides, acc = [1] * v.dim(), total  # the slice's strides: rows of the fused output
        for d in range(v.dim() - 2, -1, -1):
            strides[d] = acc
            acc *= v.shape[d]
        fake = torch.empty_strided(v.shape, strides, dtype=v.dtype, device="meta")
        for u in m.users:
            if u.op == "call_method" and u.target == "view":
                shape = u.args[1:] if not isinstance(u.args[1], (list, tuple)) else u.args[1]
                if not all(isinstance(s, int) for s in shape):
                    return False
                try:
                    fake.view(*shape)
                except RuntimeError:
                    return False
    return True
