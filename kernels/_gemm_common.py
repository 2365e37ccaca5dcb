"""What every GEMM kernel here shares: the activations (Triton and eager), the grouped tile order, and the
pointer kernels' config pruning.

Activations, on a float32 tile z (``apply_activation``; ``ACTIVATIONS`` is the same in torch)::

    none z, relu max(z, 0), gelu z * Phi(z) (erf), gelu_tanh z * sigmoid(2 u) with
    u = sqrt(2 / pi) (z + 0.044715 z^3) (= 0.5 z (1 + tanh u), torch's approximate="tanh"), silu z * sigmoid(z)

Tiles are ordered in groups of GROUP_M tile rows (``tile_of``, Triton's matmul tutorial), so neighbouring
programs share weight tiles in L2. The pointer kernels' configs are pruned by M and the element size
(``prune_configs``); Triton's interpreter on the CPU runs one small fixed config (``INTERPRETER_META``).
"""

import torch
import torch.nn.functional as F

from ._launch import tl, triton

GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the GEMM kernels take; others: the reference

# ---------------------------------------------------------------------------------------------------------
# Activations: eager, their backward, the check
# ---------------------------------------------------------------------------------------------------------
ACTIVATIONS = {
    "none": lambda z: z,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def activation_backward(grad: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(z) / dz * grad, with ATen's backward ops (exact, and differentiable again)."""
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, z, 0)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, z)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, z, approximate="tanh")
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, z)
    return grad


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: unknown {activation!r}; expected one of {', '.join(map(repr, ACTIVATIONS))}")


# ---------------------------------------------------------------------------------------------------------
# Pointer kernels' configs: pruned by M, interpreter's config
# ---------------------------------------------------------------------------------------------------------
def prune_configs(configs, named_args, **kwargs):
    """Small-M configs for M <= 64, the others above (both keep the 64-row tiles); half the BLOCK_K for
    float32 inputs, whose tiles take twice the shared memory. (Triton's autotuner keys on the dtypes too.)"""
    return kept_configs(configs, named_args["M"], named_args["x_ptr"].element_size())


def kept_configs(configs, M: int, element_size: int):
    """``prune_configs`` for M rows of elements of ``element_size`` bytes."""
    small = M <= 64
    kept = [c for c in configs if (c.kwargs["BLOCK_M"] <= 64 if small else c.kwargs["BLOCK_M"] >= 64)] or configs
    if element_size == 4:
        kept = [triton.Config({**c.kwargs, "BLOCK_K": max(16, c.kwargs["BLOCK_K"] // 2)}, num_warps=c.num_warps,
                              num_stages=c.num_stages) for c in kept]
    return kept


# Triton's interpreter (CPU): one small fixed config, several programs and groups even at test sizes.
INTERPRETER_META = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)


# ---------------------------------------------------------------------------------------------------------
# Triton pieces: tile order, activation
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of a linear tile index, ordered in groups of GROUP_M tile rows for L2 reuse."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile row, tile column) (``tile_of`` its program id)."""
    return tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit
def apply_activation(z, ACTIVATION: tl.constexpr):
    """act(z) on a float32 tile (see the module docstring)."""
    if ACTIVATION == "relu":
        z = tl.maximum(z, 0.0)
    elif ACTIVATION == "gelu":
        z = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        z = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))  # 2 * sqrt(2 / pi)
    elif ACTIVATION == "silu":
        z = z * tl.sigmoid(z)
    return z
