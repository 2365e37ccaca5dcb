"""The gated linear unit of Llama-style MLPs, both projections in one GEMM kernel.

Math, for x [..., K], w_gate and w_up [N, K] (``nn.Linear``'s layout)::

    g   = x @ w_gate^T                   accumulated in float32
    u   = x @ w_up^T                     accumulated in float32
    out = act(g) * u                     in float32, rounded once to x.dtype at the store

    act: silu (SwiGLU, Llama's default), gelu (erf), gelu_tanh (GeGLU), relu, none (bilinear); as in
    ``linear_epilogue``.

Each program loads a tile of x once per K step and multiplies it with the matching tiles of both weights
into two float32 accumulators, so x is read once for the two projections and g and u never reach memory.
The unfused sequence rounds g, u, act(g) and the product to x.dtype; this rounds once, so it is at least as
accurate. float32 inputs follow torch's matmul precision, as in ``linear_epilogue``. Tiles, grouped program
order (``_gemm_common``) and masks are those of ``linear_epilogue``; the tiles are smaller (two accumulators
share the registers of one). On Hopper, from 1024 rows, the op takes the persistent TMA kernel (``_tma_gemm``)
in its gated form instead: one 3-D descriptor spans both weights (the distance between them is its first
stride), so each K step multiplies a [BLOCK_N, BLOCK_K] tile holding BLOCK_N / 2 rows of each weight with one
dot, and the accumulator's halves are g and u. No weight is copied; 99-100% of cuBLAS at 4096 and up on the H100
(``benchmarks/bench_gated_linear.py``), where the pointer kernel reaches 81-83%.

Registered as the custom op ``torch.ops.kpt.gated_linear`` (``torch.library.custom_op`` with a fake and
autograd; the backward recomputes g and u with plain torch matmuls), with the same two forms without
autograd as ``linear_epilogue``: ``gated_linear_inference`` and the triton_op ``gated_linear_triton``, which
Inductor launches as its own kernel (why both, and where each is used: linear_epilogue's docstring; all three
registered by ``_op_forms.register_op_forms``). Dispatch inside the op is that of ``linear_epilogue``
(``_launch.kernel_runs``): CUDA tensors run the Triton kernel, CPU tensors run it in Triton's interpreter when
``TRITON_INTERPRET=1``, everything else (no triton, float64, other devices) runs the eager ``reference``.
``launches`` counts kernel launches (a launch of the TMA kernel counts here and in ``_tma_gemm.launches``).
Import this module as ``kpt_compiler.kernels.gated_linear`` only (the op registers once).
"""

import collections
from typing import Optional

import torch
import torch.nn.functional as F

from ._gemm_common import (ACTIVATIONS, GEMM_DTYPES, INTERPRETER_META, activation_backward, apply_activation,
                           check_activation, grouped_tile, prune_configs)
from ._launch import HAVE_TRITON  # noqa: F401  (tests read gated_linear.HAVE_TRITON)
from ._launch import input_precision, kernel_runs, launch_grid, launch_tuned, tl, triton, wrapped_launch
from ._op_forms import register_op_forms
from ._tma_gemm import gated_tma_ok, launch_tma_gated, tma_ok, use_tma

__all__ = ["gated_linear", "reference", "launches"]

# the kernel modules whose source decides this op's speed (the cost model keys its calibration on them)
SOURCE_MODULES = ("gated_linear", "_gemm_common", "_tma_gemm", "_launch", "_op_forms")
launches = collections.Counter()  # "gated_linear" -> number of Triton launches: tests assert the kernel ran

# ---------------------------------------------------------------------------------------------------------
# Autotune configs: two float32 accumulators per program, so at most 128 x 128 x 2 of them (8 warps);
# pruned by M as in linear_epilogue (``_gemm_common.prune_configs``).
# ---------------------------------------------------------------------------------------------------------
CONFIGS = [
    # large M (Hopper): x tile reused for both weights, like one 128 x 256 tile
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    # medium M
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_stages=3, num_warps=4),
    # small M (decode): memory-bound on the two weights
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 8}, num_stages=3, num_warps=4),
]


# ---------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _gated_linear_kernel(
    # pointers
    x_ptr, wg_ptr, wu_ptr, out_ptr,
    # sizes: x [M, K], w_gate and w_up [N, K], out [M, N]
    M, N, K,
    # strides
    stride_xm, stride_xk,
    stride_wgn, stride_wgk,
    stride_wun, stride_wuk,
    stride_om, stride_on,
    # meta
    ACTIVATION: tl.constexpr,
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
    wg_ptrs = wg_ptr + cols[:, None] * stride_wgn + offs_k[None, :] * stride_wgk  # [BLOCK_N, BLOCK_K]
    wu_ptrs = wu_ptr + cols[:, None] * stride_wun + offs_k[None, :] * stride_wuk  # [BLOCK_N, BLOCK_K]

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k[None, :] < K - k * BLOCK_K  # the K tail is masked to zeros
        x = tl.load(x_ptrs, mask=k_mask, other=0.0)  # loaded once, used by both products
        wg = tl.load(wg_ptrs, mask=k_mask, other=0.0)
        wu = tl.load(wu_ptrs, mask=k_mask, other=0.0)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=INPUT_PRECISION)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wgk
        wu_ptrs += BLOCK_K * stride_wuk

    # epilogue in float32: act(g) * u, one rounding at the store
    out = apply_activation(acc_g, ACTIVATION) * acc_u
    out_m = offs_m.to(tl.int64)[:, None]
    out_n = offs_n.to(tl.int64)[None, :]
    mask = (out_m < M) & (out_n < N)
    tl.store(out_ptr + out_m * stride_om + out_n * stride_on, out.to(out_ptr.dtype.element_ty), mask=mask)


_gated_linear_autotuned = triton.autotune(
    configs=CONFIGS, key=["M", "N", "K"], prune_configs_by={"early_config_prune": prune_configs},
)(_gated_linear_kernel)


# ---------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------
def _pointer_args(x2, w_gate, w_up, out, activation: str) -> tuple[tuple, dict]:
    """The pointer kernel's arguments and constexprs for out [M, N] = act(x2 @ w_gate^T) * (x2 @ w_up^T)."""
    M, K = x2.shape
    N = w_gate.shape[0]
    args = (x2, w_gate, w_up, out, M, N, K, x2.stride(0), x2.stride(1), w_gate.stride(0), w_gate.stride(1),
            w_up.stride(0), w_up.stride(1), out.stride(0), out.stride(1))
    return args, dict(ACTIVATION=activation, INPUT_PRECISION=input_precision(x2.dtype))


def _launch(x2: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str,
            config: Optional[dict] = None, tma: bool = True) -> torch.Tensor:
    """out [M, N] = act(x2 @ w_gate^T) * (x2 @ w_up^T) with the Triton kernel; inputs already checked.

    ``config`` skips the autotuner, as in ``linear_epilogue._launch``; ``tma=False`` keeps to the pointer
    kernel where the TMA kernel would run (the benchmark compares the two)."""
    M, K = x2.shape
    N = w_gate.shape[0]
    if config is None and tma and use_tma(M, 2 * N, K) and tma_ok(x2, w_gate, w_up) and gated_tma_ok(w_gate, w_up):
        launches["gated_linear"] += 1
        return launch_tma_gated(x2, w_gate, w_up, activation)
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    args, meta = _pointer_args(x2, w_gate, w_up, out, activation)
    config = config or (None if x2.is_cuda else INTERPRETER_META)
    launch_tuned(_gated_linear_autotuned, _gated_linear_kernel, (M, N, K, x2.dtype), launch_grid(M, N), args, meta,
                 config=config)
    launches["gated_linear"] += 1
    return out


def _check(x, w_gate, w_up, activation) -> None:
    check_activation(activation)
    if x.dim() < 1:
        raise ValueError("x: expected at least one dimension [..., K], got a 0-d tensor")
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
        if w.dim() != 2:
            raise ValueError(f"{name}: expected 2 dimensions [N, K] (nn.Linear's layout), got shape {tuple(w.shape)}")
        if w.shape[1] != x.shape[-1]:
            raise ValueError(f"{name}: K mismatch, x is {tuple(x.shape)} (K={x.shape[-1]}) but {name} is "
                             f"{tuple(w.shape)} (K={w.shape[1]}); it must be [N, K]")
        if w.dtype != x.dtype:
            raise ValueError(f"{name}: dtype {w.dtype} differs from x's {x.dtype}")
        if w.device != x.device:
            raise ValueError(f"{name}: on {w.device}, x is on {x.device}")
    if w_up.shape[0] != w_gate.shape[0]:
        raise ValueError(f"w_up: N mismatch, w_gate is {tuple(w_gate.shape)} but w_up is {tuple(w_up.shape)}")


# ---------------------------------------------------------------------------------------------------------
# Eager reference
# ---------------------------------------------------------------------------------------------------------
def reference(x, w_gate, w_up, activation: str = "silu") -> torch.Tensor:
    """The unfused sequence the kernel replaces: two F.linear, the activation, the product (each in x.dtype)."""
    return ACTIVATIONS[activation](F.linear(x, w_gate)) * F.linear(x, w_up)


# ---------------------------------------------------------------------------------------------------------
# Ops: torch.ops.kpt.gated_linear (custom op, fake, autograd), gated_linear_inference (no autograd) and
# gated_linear_triton (triton_op); see ``_op_forms``
# ---------------------------------------------------------------------------------------------------------
def _forward(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    _check(x, w_gate, w_up, activation)
    if not kernel_runs(x, GEMM_DTYPES, needs_3_6_interpreter=True):
        return reference(x, w_gate, w_up, activation)
    K, N = x.shape[-1], w_gate.shape[0]
    return _launch(x.reshape(-1, K), w_gate, w_up, activation).view(*x.shape[:-1], N)


def _fake(x, w_gate, w_up, activation="silu"):
    _check(x, w_gate, w_up, activation)
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


def _setup_context(ctx, inputs, output):
    x, w_gate, w_up, activation = inputs
    ctx.save_for_backward(x, w_gate, w_up)
    ctx.activation = activation


def _backward(ctx, grad):
    x, w_gate, w_up = ctx.saved_tensors
    K, N = w_gate.shape[1], w_gate.shape[0]
    x2, g2 = x.reshape(-1, K), grad.reshape(-1, N)
    # g and u recomputed from the saved inputs (cheaper in memory than saving them)
    g, u = F.linear(x2, w_gate), F.linear(x2, w_up)
    grad_g = activation_backward(g2 * u, g, ctx.activation)  # dL/dg = act'(g) * u * grad
    grad_u = g2 * ACTIVATIONS[ctx.activation](g)  # dL/du = act(g) * grad
    need_x, need_wg, need_wu = ctx.needs_input_grad[:3]
    grad_x = (grad_g @ w_gate + grad_u @ w_up).view(x.shape) if need_x else None
    grad_wg = grad_g.t() @ x2 if need_wg else None
    grad_wu = grad_u.t() @ x2 if need_wu else None
    return grad_x, grad_wg, grad_wu, None


# Inductor's form: torch.ops.kpt.gated_linear_triton, the pointer kernel as a torch.library.triton_op that
# Inductor traces and launches itself (why, and where the fusion pass emits it: linear_epilogue's
# linear_epilogue_triton). GEMMs large enough for the TMA kernel call the inference op from inside it.
def _triton_forward(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    activation: str = "silu") -> torch.Tensor:
    _check(x, w_gate, w_up, activation)
    K, N = x.shape[-1], w_gate.shape[0]
    M = x.numel() // K if K else 0
    if not kernel_runs(x, GEMM_DTYPES, needs_3_6_interpreter=True) or use_tma(M, 2 * N, K) or M == 0 or N == 0:
        return torch.ops.kpt.gated_linear_inference(x, w_gate, w_up, activation)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    args, meta = _pointer_args(x.reshape(M, K), w_gate, w_up, out, activation)
    wrapped_launch(_gated_linear_kernel, CONFIGS, M, x.dtype, launch_grid(M, N), args, meta)
    return out.view(*x.shape[:-1], N)


register_op_forms("gated_linear", _forward, _fake, _setup_context, _backward, _triton_forward)


def gated_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(x @ w_gate^T) * (x @ w_up^T) in one kernel; see the module docstring."""
    return torch.ops.kpt.gated_linear(x, w_gate, w_up, activation)
