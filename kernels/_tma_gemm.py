"""The persistent TMA GEMM (Hopper and later), which every GEMM kernel here hands its large GEMMs to.

Math: out [M, N] = act(x @ w^T + bias) + residual, for x [M, K] and w [N, K], accumulated in float32 and
rounded once at the store (``linear_epilogue``'s); or, ``GATED``, out = act(x @ w_gate^T) * (x @ w_up^T)
(``gated_linear``'s). Activations: ``_gemm_common``.

The pointer kernels (``linear_epilogue``, ``gated_linear``) top out near 80% of cuBLAS on an H100: every
program pays its prologue and epilogue in turn, and address arithmetic competes with the tensor cores. This
one is Triton's persistent matmul tutorial with our epilogue: one program per SM walks the output tiles
(grouped, ``_gemm_common.tile_of``), tiles move between global and shared memory through TMA descriptors
(which also zero-fill reads and clip writes past the edges, so no masks), and the pipelining is flattened
over the tile and K loops, so the next tile's loads overlap this tile's epilogue. EPILOGUE_SUBTILE stores
the output in two halves, which frees shared memory for a deeper pipeline. GATED is gated_linear's form: one
3-D descriptor over both weights (see launch_tma_gated), so the tile and the pipeline are this kernel's (a
form with two descriptors and two accumulators measured 2-5% slower than the pointer kernel on the H100). The
descriptors are built on the host (``TensorDescriptor``; built on the device with ``tl.make_tensor_descriptor``
the kernel measured slower on the H100, 2026-11-26). Building and encoding them costs tens of microseconds
per launch, so an op takes this kernel only for GEMMs large enough to hide that (``use_tma``: ``TMA_MIN_M``
rows), on a device with TMA (compute capability 9.0 and up) and operands aligned for it (``tma_ok``); else
its pointer kernel. ``launches["tma"]`` counts this kernel's launches (tests assert on it).
"""

import collections
from typing import Optional

import torch

from ._gemm_common import apply_activation, tile_of
from ._launch import (HAVE_TMA, INTERPRETED, TensorDescriptor, has_tma, input_precision, launch_tuned, sm_count,
                      tl, triton)

launches = collections.Counter()  # "tma" -> number of launches of the TMA kernel

# ---------------------------------------------------------------------------------------------------------
# Autotune configs
# ---------------------------------------------------------------------------------------------------------
def _tma_block_shapes(nargs):
    """Autotune pre-hook (and explicit configs): the descriptors' block shapes follow the config."""
    BM, BN, BK = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    gated = nargs.get("GATED", False)
    out_bn = BN // 2 if nargs["EPILOGUE_SUBTILE"] or gated else BN
    nargs["x_desc"].block_shape = [BM, BK]
    nargs["w_desc"].block_shape = [2, BN // 2, BK] if gated else [BN, BK]
    nargs["r_desc"].block_shape = [BM, out_bn]
    nargs["out_desc"].block_shape = [BM, out_bn]


def tma_config(BM, BN, BK, stages, warps, subtile, group=8):
    return triton.Config({"BLOCK_M": BM, "BLOCK_N": BN, "BLOCK_K": BK, "GROUP_M": group, "EPILOGUE_SUBTILE": subtile},
                         num_stages=stages, num_warps=warps, pre_hook=_tma_block_shapes)


# From a sweep on the H100 (bf16; 128/64 x 64..256 x 64/128 tiles, 2-5 stages, 4/8 warps, subtiled or not;
# an uncommitted script, 2026-11-26): 128x256x64 with 3 stages and a subtiled epilogue won at every shape from
# 1024 rows up; the others are the runners-up, with more tiles per SM for narrower outputs. What it reaches:
# benchmarks/bench_linear_epilogue.py.
TMA_CONFIGS = [
    tma_config(128, 256, 64, 3, 8, True),
    tma_config(128, 128, 64, 5, 8, True),
    tma_config(128, 128, 64, 4, 4, True),
    tma_config(64, 128, 64, 5, 4, False),
]
# Below this many rows the pointer kernel: on the H100 the TMA kernel's launch (descriptors built and
# encoded on the host) made it slower than the pointer kernel at 128 x 4096 x 4096 and no faster at
# 8192 x 1024 x 2816 (bench_linear_epilogue, 2026-11-26)
TMA_MIN_M = 1024
TMA_MIN_MNK = 1 << 35  # and M * N * K at least this (4096^3 is 2^36)


def prune_tma_configs(configs, named_args, **kwargs):
    """Half the K step for float32 (twice the shared memory per tile)."""
    kept = configs
    if named_args["x_desc"].base.element_size() == 4:
        kept = [tma_config(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], max(16, c.kwargs["BLOCK_K"] // 2), c.num_stages,
                           c.num_warps, c.kwargs["EPILOGUE_SUBTILE"]) for c in kept]
    return kept or configs


# ---------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _gemm_tma_kernel(
    # descriptors: x [M, K], w [N, K], residual and out [M, N]; bias pointer [N]
    x_desc, w_desc, r_desc, out_desc, bias_ptr,
    M, N, K,
    # meta
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
    # gated_linear: w_desc is 3-D [2, N, K] over both weights (see launch_tma_gated); each tile multiplies
    # BLOCK_N / 2 rows of each as one [BLOCK_N, BLOCK_K] operand and stores act(g) * u, [BLOCK_M, BLOCK_N / 2]
    GATED: tl.constexpr = False, UP_FIRST: tl.constexpr = False,
):
    OUT_N: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N  # output columns per tile
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, OUT_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # the epilogue recomputes its tile from its own counter, so it does not depend on the loop's prologue
    # (the flattened software pipeline overlaps the next tile's loads with this epilogue)
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * OUT_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            x = x_desc.load([off_m, off_k])
            if GATED:  # rows off_n.. of the first weight, then the same rows of the second
                w = tl.reshape(w_desc.load([0, off_n, off_k]), (BLOCK_N, BLOCK_K))
            else:
                w = w_desc.load([off_n, off_k])
            acc = tl.dot(x, w.T, acc, input_precision=INPUT_PRECISION)

        tile_id_c += NUM_SMS
        pid_m, pid_n = tile_of(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * OUT_N
        # epilogue in float32, one rounding at the store
        if GATED:
            first, second = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            if UP_FIRST:
                out = apply_activation(second, ACTIVATION) * first
            else:
                out = apply_activation(first, ACTIVATION) * second
            out_desc.store([off_m, off_n], out.to(out_desc.dtype))
        else:
            if HAS_BIAS:
                cols = off_n + tl.arange(0, BLOCK_N)
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            acc = apply_activation(acc, ACTIVATION)
            if EPILOGUE_SUBTILE:
                acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                off_n1 = off_n + BLOCK_N // 2
                if HAS_RESIDUAL:
                    acc0 += r_desc.load([off_m, off_n]).to(tl.float32)
                    acc1 += r_desc.load([off_m, off_n1]).to(tl.float32)
                out_desc.store([off_m, off_n], acc0.to(out_desc.dtype))
                out_desc.store([off_m, off_n1], acc1.to(out_desc.dtype))
            else:
                if HAS_RESIDUAL:
                    acc += r_desc.load([off_m, off_n]).to(tl.float32)
                out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


# the key names the constexprs that change the best config (Triton keys on M, N, K and tensor dtypes only;
# descriptors are not tensors, bias_ptr carries the dtype)
_gemm_tma_autotuned = triton.autotune(
    configs=TMA_CONFIGS, key=["M", "N", "K", "HAS_BIAS", "HAS_RESIDUAL", "ACTIVATION", "GATED"],
    prune_configs_by={"early_config_prune": prune_tma_configs},
)(_gemm_tma_kernel)


def use_tma(M: int, N: int, K: int) -> bool:
    """Whether the GEMM is large enough for the TMA kernel (see TMA_MIN_M)."""
    return M >= TMA_MIN_M and M * N * K >= TMA_MIN_MNK


def tma_ok(*tensors) -> bool:
    """Whether the TMA kernel can run on these 2-D CUDA tensors (None skipped): a device with TMA (compute
    capability 9.0 and up), unit last stride, 16-byte aligned base and row stride. (The CPU's interpreter runs
    the TMA kernel too, but only when a test calls ``launch_tma``: the ops run their pointer kernels there.)"""
    if not HAVE_TMA or INTERPRETED:
        return False
    for t in tensors:
        if t is None:
            continue
        if not has_tma(t.device):
            return False
        if t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------
def launch_tma(x2, w, bias, res2, activation: str, config: Optional[dict] = None,
               num_sms: Optional[int] = None, out: Optional[torch.Tensor] = None):
    """The persistent TMA kernel: out [M, N] = act(x2 @ w^T + bias) + res2; inputs checked and ``tma_ok``.
    ``config`` (a ``tma_config``'s kwargs plus num_warps and num_stages) skips the autotuner; ``num_sms`` sets
    the persistent grid (tests in the interpreter use a small one)."""
    M, K = x2.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device) if out is None else out
    if M == 0 or N == 0:
        return out
    dummy = [1, 1]  # block shapes are set per config (pre-hook, or below)
    descs = [TensorDescriptor.from_tensor(t, dummy) for t in (x2, w, res2 if res2 is not None else out, out)]
    _run_tma(descs, bias if bias is not None else out, M, N, K, x2, activation, config, num_sms,
             dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=res2 is not None), lambda meta: meta["BLOCK_N"])
    return out


def gated_tma_ok(w_gate, w_up) -> bool:
    """Whether ``launch_tma_gated`` can address both weights with one descriptor: same row stride, and a
    distance between them that is a positive multiple of 16 bytes (distinct tensors, or distinct halves)."""
    return (w_gate.stride() == w_up.stride() and w_gate.shape == w_up.shape
            and abs(w_up.data_ptr() - w_gate.data_ptr()) >= w_gate.shape[0] * w_gate.stride(0) * w_gate.element_size()
            and (w_up.data_ptr() - w_gate.data_ptr()) % 16 == 0)


def launch_tma_gated(x2, w_gate, w_up, activation: str, config: Optional[dict] = None,
                     num_sms: Optional[int] = None):
    """act(x2 @ w_gate^T) * (x2 @ w_up^T) with the persistent TMA kernel (``GATED``); ``tma_ok`` and
    ``gated_tma_ok``. One 3-D descriptor spans both weights, [2, N, K] with the distance between them as its
    first stride (TMA reads only the tiles asked for, never the memory between), so each K step feeds one
    [BLOCK_N, BLOCK_K] tile, BLOCK_N / 2 rows of each weight, to one dot, and the accumulator's halves are g
    and u: the linear kernel's 128 x 256 tile with no copy of the weights."""
    M, K = x2.shape
    N = w_gate.shape[0]
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    up_first = w_up.data_ptr() < w_gate.data_ptr()  # the descriptor's strides must be positive
    lo = w_up if up_first else w_gate
    hi = w_gate if up_first else w_up
    apart = (hi.data_ptr() - lo.data_ptr()) // lo.element_size()
    w_desc = TensorDescriptor(lo, [2, N, K], [apart, lo.stride(0), 1], [1, 1, 1])
    descs = [TensorDescriptor.from_tensor(x2, [1, 1]), w_desc, *(TensorDescriptor.from_tensor(out, [1, 1]),) * 2]
    _run_tma(descs, out, M, N, K, x2, activation, config, num_sms,
             dict(HAS_BIAS=False, HAS_RESIDUAL=False, GATED=True, UP_FIRST=up_first),
             lambda meta: meta["BLOCK_N"] // 2)
    return out


def _run_tma(descs, bias_arg, M, N, K, x2, activation, config, num_sms, flags: dict, out_cols) -> None:
    """Launch the TMA kernel on ``descs`` (x, w, residual, out) with ``launch_tuned``: autotuned on a key's
    first call, then with the config chosen then, whose block shapes are set on the descriptors first."""
    num_sms = num_sms or (sm_count(x2.device) if x2.is_cuda else 2)
    meta = dict(ACTIVATION=activation, INPUT_PRECISION=input_precision(x2.dtype), NUM_SMS=num_sms, **flags)
    args = (*descs, bias_arg, M, N, K)

    def grid(meta):
        return (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, out_cols(meta))),)

    def block_shapes(config):  # under the autotuner the configs' pre-hook does this
        _tma_block_shapes({**config, **flags, **dict(zip(("x_desc", "w_desc", "r_desc", "out_desc"), descs))})

    key = (M, N, K, x2.dtype, activation, num_sms, *sorted(flags.items()))
    launch_tuned(_gemm_tma_autotuned, _gemm_tma_kernel, key, grid, args, meta, config=config, prepare=block_shapes)
    launches["tma"] += 1
