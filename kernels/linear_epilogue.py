"""A linear layer with its epilogue fused into the GEMM: bias, activation and residual in one kernel.

Math, for x [..., K], weight [N, K] (``nn.Linear``'s layout), bias [N], residual [..., N]::

    z   = x @ weight^T + bias            accumulated in float32
    out = act(z) + residual              in float32, rounded once to x.dtype at the store

    act: none (z), relu max(z, 0), gelu z * Phi(z) (erf), gelu_tanh z * sigmoid(2 u) with
         u = sqrt(2 / pi) (z + 0.044715 z^3) (= 0.5 z (1 + tanh u), torch's approximate="tanh"), silu z * sigmoid(z)

The unfused sequence (``F.linear``, the activation, ``+``) rounds to x.dtype after each of the three steps;
this kernel rounds once, so it is at least as accurate. float32 inputs follow torch's matmul precision
(``torch.get_float32_matmul_precision()``: "highest" computes in IEEE float32, "high"/"medium" allow TF32).

The kernel is the classic tiled GEMM (Triton's matmul tutorial): each program computes a BLOCK_M x BLOCK_N
tile of the output over K in BLOCK_K steps (tl.dot; wgmma on Hopper), programs are ordered in groups of
GROUP_M tile rows so neighbouring programs share weight tiles in L2, and the epilogue runs on the float32
accumulator before the one store. Rows and columns past M and N wrap to valid ones when loaded (never
stored), the K tail is masked, so any M, N, K works. On Hopper, large GEMMs take a second kernel instead:
persistent, with TMA loads and stores (``_tma_gemm``; 88-96% of cuBLAS at 4096 and up on the H100, where
this one reached 72-81%). Activations, tile order and config pruning: ``_gemm_common``; launching: ``_launch``.

Registered as the custom op ``torch.ops.kpt.linear_epilogue`` (a ``torch.library.custom_op`` with a fake
implementation and autograd; the backward is plain torch matmuls that recompute z from the saved inputs).
The custom op is one opaque call that works on every device, in eager, under CUDA graphs and under every
torch.compile backend; Inductor calls it as an extern kernel, a Python call per launch. Two more forms have
no autograd and serve graphs without gradients: ``linear_epilogue_inference`` (the same call without the
custom op's Python autograd layer) and ``linear_epilogue_triton``, a ``torch.library.triton_op`` that
Inductor traces and launches as one of its own kernels (12-14 us to issue per call inside a compiled graph
on the H100 machine, against 53-58 us for the inference op: ``benchmarks/bench_dispatch.py``). The fusion
pass emits the triton_op where Inductor compiles for CUDA. It cannot be the only form: its body is traced
with fake tensors, and on the CPU a triton_op launching the interpreted kernel fails under
torch.compile(backend="eager" and "aot_eager") ("Cannot access data pointer of Tensor", checked with torch
2.13 and triton 3.9). The three forms are registered by ``_op_forms.register_op_forms``. Dispatch inside
the op (``_launch.kernel_runs``): CUDA tensors in float16/bfloat16/float32 run the Triton kernel; CPU tensors
run it in Triton's interpreter when ``TRITON_INTERPRET=1`` (set before this module was imported), else the
eager ``reference``; every other case (no triton installed, float64, other devices) runs ``reference``.
``launches`` counts kernel launches (tests assert on it; the TMA kernel's: ``_tma_gemm.launches``). Import
this module as ``kpt_compiler.kernels.linear_epilogue`` only (the op registers once, when it is imported).
"""

import collections
from typing import Optional

import torch
import torch.nn.functional as F

from ._gemm_common import (ACTIVATIONS, GEMM_DTYPES, INTERPRETER_META, activation_backward, apply_activation,
                           check_activation, grouped_tile, prune_configs)
from ._launch import HAVE_TRITON  # noqa: F401  (passes/fusion.py imports it from here)
from ._launch import input_precision, kernel_runs, launch_grid, launch_tuned, tl, triton, wrapped_launch
from ._op_forms import register_op_forms
from ._tma_gemm import launch_tma, tma_ok, use_tma

__all__ = ["linear_epilogue", "reference", "ACTIVATIONS", "launches"]

# the kernel modules whose source decides this op's speed (the cost model keys its calibration on them)
SOURCE_MODULES = ("linear_epilogue", "_gemm_common", "_tma_gemm", "_launch", "_op_forms")
launches = collections.Counter()  # "linear_epilogue" -> number of Triton launches: tests assert the kernel ran

# ---------------------------------------------------------------------------------------------------------
# Autotune configs. Autotuning is paid once per (M, N, K), so the list is short and pruned by M
# (``_gemm_common.prune_configs``).
# ---------------------------------------------------------------------------------------------------------
CONFIGS = [
    # large M: the usual Hopper winners (wgmma, 64-row warpgroups)
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    # medium M (65 .. ~1024): smaller tiles so there are enough programs for every SM
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_stages=4, num_warps=4),
    # small M (decode, M <= 64): memory-bound on the weight; narrow N tiles spread it over every SM, and
    # GROUP_M 8 puts the few tile rows that share a weight tile next to each other
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 8}, num_stages=3, num_warps=4),
]


# ---------------------------------------------------------------------------------------------------------
# Kernel (tile order and activation: ``_gemm_common``)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _linear_epilogue_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
    # sizes: x [M, K], weight [N, K], bias [N], residual and out [M, N]
    M, N, K,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_rm, stride_rn,
    stride_om, stride_on,
    # meta
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (float32 inputs only)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows and columns past the end wrap to valid ones: loaded and computed, never stored, so no M/N masks
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K  # the K tail is masked to zeros
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # epilogue in float32: + bias, act, + residual, one rounding at the store
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    out_m = offs_m.to(tl.int64)[:, None]
    out_n = offs_n.to(tl.int64)[None, :]
    mask = (out_m < M) & (out_n < N)
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + out_m * stride_rm + out_n * stride_rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_m * stride_om + out_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


_linear_epilogue_autotuned = triton.autotune(
    configs=CONFIGS, key=["M", "N", "K"], prune_configs_by={"early_config_prune": prune_configs},
)(_linear_epilogue_kernel)


# ---------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------
def _pointer_args(x2, weight, bias, res2, out, activation: str) -> tuple[tuple, dict]:
    """The pointer kernel's arguments and constexprs for out [M, N] = act(x2 @ weight^T + bias) + res2.
    Without a bias or residual, x2 stands in for its pointer (never read: HAS_BIAS / HAS_RESIDUAL)."""
    M, K = x2.shape
    N = weight.shape[0]
    bias_arg = bias.contiguous() if bias is not None else x2
    res_arg = res2 if res2 is not None else x2
    args = (x2, weight, bias_arg, res_arg, out, M, N, K, x2.stride(0), x2.stride(1), weight.stride(0),
            weight.stride(1), res_arg.stride(0), res_arg.stride(1), out.stride(0), out.stride(1))
    meta = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=res2 is not None, ACTIVATION=activation,
                INPUT_PRECISION=input_precision(x2.dtype))
    return args, meta


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], res2: Optional[torch.Tensor],
            activation: str, config: Optional[dict] = None) -> torch.Tensor:
    """out [M, N] = act(x2 @ weight^T + bias) + res2 with the Triton kernel; inputs already checked.

    ``config`` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, optionally num_warps and num_stages) skips the autotuner:
    the CPU's interpreter runs ``INTERPRETER_META``, tests run each autotune config."""
    M, K = x2.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    args, meta = _pointer_args(x2, weight, bias, res2, out, activation)
    config = config or (None if x2.is_cuda else INTERPRETER_META)
    if config is None and use_tma(M, N, K) and tma_ok(x2, weight, res2, out):
        launch_tma(x2, weight, args[2] if bias is not None else None, res2, activation, out=out)
    else:
        launch_tuned(_linear_epilogue_autotuned, _linear_epilogue_kernel, (M, N, K, x2.dtype), launch_grid(M, N),
                     args, meta, config=config)
    launches["linear_epilogue"] += 1
    return out


def _check(x, weight, bias, residual, activation) -> None:
    check_activation(activation)
    if x.dim() < 1:
        raise ValueError("x: expected at least one dimension [..., K], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected 2 dimensions [N, K] (nn.Linear's layout), got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight: K mismatch, x is {tuple(x.shape)} (K={x.shape[-1]}) but weight is "
                         f"{tuple(weight.shape)} (K={weight.shape[1]}); weight must be [N, K]")
    out_shape = (*x.shape[:-1], weight.shape[0])
    for name, t, shape in (("weight", weight, None), ("bias", bias, (weight.shape[0],)),
                           ("residual", residual, out_shape)):
        if t is None:
            continue
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from x's {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, x is on {x.device}")


# ---------------------------------------------------------------------------------------------------------
# Eager reference
# ---------------------------------------------------------------------------------------------------------
def reference(x, weight, bias=None, residual=None, activation: str = "none") -> torch.Tensor:
    """The unfused sequence the kernel replaces: F.linear, the activation, + residual (each in x.dtype)."""
    out = ACTIVATIONS[activation](F.linear(x, weight, bias))
    return out if residual is None else out + residual


# ---------------------------------------------------------------------------------------------------------
# Ops: torch.ops.kpt.linear_epilogue (custom op, fake, autograd), linear_epilogue_inference (no autograd) and
# linear_epilogue_triton (triton_op); see ``_op_forms``
# ---------------------------------------------------------------------------------------------------------
def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
             residual: Optional[torch.Tensor] = None, activation: str = "none") -> torch.Tensor:
    _check(x, weight, bias, residual, activation)
    if not kernel_runs(x, GEMM_DTYPES, needs_3_6_interpreter=True):
        return reference(x, weight, bias, residual, activation)
    K, N = x.shape[-1], weight.shape[0]
    res2 = residual.reshape(-1, N) if residual is not None else None
    return _launch(x.reshape(-1, K), weight, bias, res2, activation).view(*x.shape[:-1], N)


def _fake(x, weight, bias=None, residual=None, activation="none"):
    _check(x, weight, bias, residual, activation)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, activation = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.activation = activation


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    K, N = weight.shape[1], weight.shape[0]
    x2, g2 = x.reshape(-1, K), grad.reshape(-1, N)
    # dL/dz: z recomputed from the saved inputs (cheaper in memory than saving it)
    gz = g2 if ctx.activation == "none" else activation_backward(g2, F.linear(x2, weight, bias), ctx.activation)
    # defaulted arguments left out of the call have no entry in needs_input_grad
    need_x, need_w, need_b, need_r = (tuple(ctx.needs_input_grad) + (False,) * 4)[:4]
    grad_x = (gz @ weight).view(x.shape) if need_x else None
    grad_w = gz.t() @ x2 if need_w else None
    grad_b = gz.sum(0) if need_b and bias is not None else None
    grad_r = grad if need_r else None
    return grad_x, grad_w, grad_b, grad_r, None


# Inductor's form, the pointer kernel as a torch.library.triton_op: inside an Inductor graph a custom op is an
# extern call: the dispatcher, our checks and Triton's Python launcher on every call (50-100 us per call on the
# H100 machine's host, benchmarks/bench_dispatch.py). A triton_op is traced into the graph instead (AOTAutograd
# decomposes it), and Inductor compiles and launches the kernel as one of its own. The fusion pass emits this
# form only where Inductor generates the code for CUDA and no gradient flows: it has no autograd, and the CPU's
# interpreter cannot run a traced kernel under torch.compile (the module docstring). GEMMs large enough for the
# TMA kernel call the inference op from inside it (their launch is hidden behind their run time); so do CPU
# tensors, outside the interpreter.
def _triton_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None, activation: str = "none") -> torch.Tensor:
    _check(x, weight, bias, residual, activation)
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    if not kernel_runs(x, GEMM_DTYPES, needs_3_6_interpreter=True) or use_tma(M, N, K) or M == 0 or N == 0:
        return torch.ops.kpt.linear_epilogue_inference(x, weight, bias, residual, activation)
    x2 = x.reshape(M, K)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    args, meta = _pointer_args(x2, weight, bias, residual.reshape(M, N) if residual is not None else None, out,
                               activation)
    wrapped_launch(_linear_epilogue_kernel, CONFIGS, M, x.dtype, launch_grid(M, N), args, meta)
    return out.view(*x.shape[:-1], N)


register_op_forms("linear_epilogue", _forward, _fake, _setup_context, _backward, _triton_forward)


def linear_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None, activation: str = "none") -> torch.Tensor:
    """act(x @ weight^T + bias) + residual in one kernel; see the module docstring."""
    return torch.ops.kpt.linear_epilogue(x, weight, bias, residual, activation)
