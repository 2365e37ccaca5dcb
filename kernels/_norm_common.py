"""What the norm kernels (rms_norm.py, layer_norm.py) share: input checks, the row view, the launch heuristic,
the backward's grid, and one ``launches`` counter.

No autotuning: the best block is the whole row (at most ``MAX_N`` elements), so only the rows and warps per
program are left, and a heuristic picks them without timing runs (``launch_config``). The backwards loop over
tiles of rows and write one row of weight-gradient partials per program (``backward_grid``).
"""

import collections
from typing import Optional

import torch
from torch import Tensor

from ._launch import sm_count, triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_N = 65536  # one row lives in registers: wider rows would spill (Liger-Kernel's limit too)
launches = collections.Counter()  # "<kernel>" -> number of Triton launches, for tests (both modules' kernels)


def launch_config(M: int, N: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M rows per program, BLOCK_N = next power of two >= N, num_warps) for an M x N problem."""
    BLOCK_N = triton.next_power_of_2(N)
    # narrow rows: several rows per program, about 4K elements per tile, while there are enough programs
    BLOCK_M = max(1, min(16, 4096 // BLOCK_N))
    while BLOCK_M > 1 and triton.cdiv(M, BLOCK_M) < 2 * sm_count(device):
        BLOCK_M //= 2
    tile = BLOCK_M * BLOCK_N
    num_warps = 32 if tile >= 32768 else 16 if tile >= 8192 else 8 if tile >= 2048 else 4
    return BLOCK_M, BLOCK_N, num_warps


def backward_grid(M: int, BLOCK_M: int, num_warps: int, device: torch.device,
                  per_sm: Optional[int] = None) -> tuple[int, int]:
    """(programs, TILES tiles of BLOCK_M rows per program) for a backward kernel.

    Each program loops over its tiles and writes one row of weight-gradient partials, so a few programs per
    SM keep memory busy and the partials stay small. TILES is a power of two: it is a compile-time constant
    (Triton 3.5's interpreter cannot loop to a run-time bound), and powers of two keep the variants few.
    On the CPU (the interpreter) two programs, so that tests cover the loop and the partial sums.
    """
    per_sm = per_sm or max(1, 32 // num_warps)  # programs per SM
    target = sm_count(device) * per_sm if device.type == "cuda" else 2
    tiles = triton.next_power_of_2(triton.cdiv(triton.cdiv(M, BLOCK_M), target))
    return triton.cdiv(M, tiles * BLOCK_M), tiles


def check_inputs(op: str, x, residual, params: dict) -> None:
    """ValueError naming what is wrong, for x [..., N], residual like x, and 1-D [N] parameters."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: x has dtype {x.dtype}; supported: float16, bfloat16, float32")
    if x.dim() == 0:
        raise ValueError(f"{op}: x is a scalar; it needs a last dimension to normalize over")
    N = x.shape[-1]
    if N == 0 or N > MAX_N:
        raise ValueError(f"{op}: x's last dimension is {N}; supported: 1 to {MAX_N}")
    if residual is not None:
        if not isinstance(residual, Tensor):
            raise ValueError(f"{op}: residual must be a tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; "
                             "they must be equal (no broadcasting)")
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual has dtype {residual.dtype} but x has {x.dtype}; they must be equal")
        if residual.device != x.device:
            raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    for name, p in params.items():
        if p is None:
            continue
        if not isinstance(p, Tensor):
            raise ValueError(f"{op}: {name} must be a tensor or None, got {type(p).__name__}")
        if p.dim() != 1 or p.shape[0] != N:
            raise ValueError(f"{op}: {name} has shape {tuple(p.shape)}; expected ({N},), x's last dimension")
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {p.dtype}; supported: float16, bfloat16, float32")
        if p.device != x.device:
            raise ValueError(f"{op}: {name} is on {p.device} but x is on {x.device}")


def rows_of(t: Tensor, N: int) -> Tensor:
    """t as a 2-D [rows, N] tensor whose rows are contiguous (a view where possible)."""
    t = t.reshape(-1, N)
    return t if t.stride(1) == 1 else t.contiguous()

