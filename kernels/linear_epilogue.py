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
persistent, with TMA loads and stores (see "Hopper (and later)" below; 88-96% of cuBLAS at 4096 and up on
the H100, where this one reached 72-81%).

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
2.13 and triton 3.9). Dispatch inside the op:
CUDA tensors in float16/bfloat16/float32 run the Triton kernel; CPU tensors run it in Triton's interpreter
when ``TRITON_INTERPRET=1`` (set before this module was imported), else the eager ``reference``; every other
case (no triton installed, float64, other devices) runs ``reference``. ``launches`` counts kernel launches
(tests assert on it). Import this module as ``kpt_compiler.kernels.linear_epilogue`` only (the op registers
once, when it is imported).
"""

import collections
import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from .rms_norm import sm_count

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # torch 2.9's CI environment has no triton: the op runs the eager reference there
    HAVE_TRITON = False

    class _NoTriton:
        """Stands in for triton and triton.language so the kernels below still define (and never run)."""

        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

        @staticmethod
        def Config(*args, **kwargs):
            return None

        @staticmethod
        def autotune(*args, **kwargs):
            return lambda fn: fn

    triton = tl = _NoTriton()

__all__ = ["linear_epilogue", "reference", "ACTIVATIONS", "launches"]

# triton.jit chooses the interpreter when decorating, so what counts is the environment at import time
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
launches = collections.Counter()  # "linear_epilogue" -> number of Triton launches: tests assert the kernel ran

# ---------------------------------------------------------------------------------------------------------
# Autotune configs. Autotuning is paid once per (M, N, K), so the list is short and pruned by M.
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
# Kernels
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


# (kernel, the autotuner's key) -> the launch keywords of the config it chose. Triton's Autotuner rebuilds its
# key, looks it up and merges the config's keywords on every call: on the H100 machine's host our launcher
# issued a decode-size call in 39-43 us through the autotuner and 28-30 us with the config passed in (the
# first benchmarks/bench_dispatch.py run, commit ef9723f). After the first call with a key, ``launch_tuned``
# launches the kernel with the chosen config directly.
_chosen: dict = {}


def launch_tuned(autotuned, kernel, key: tuple, grid, args: tuple, meta: dict) -> dict:
    """``autotuned[grid](*args, **meta)``: the first call with ``key`` autotunes, later ones launch ``kernel``
    with the config chosen then. ``key`` must hold everything the autotuner keys on (its key arguments and the
    tensors' dtypes), or a config tuned for one case would run another. Returns the config's keywords."""
    config = _chosen.get((kernel, key))
    if config is None:
        autotuned[grid](*args, **meta)
        config = _chosen[(kernel, key)] = autotuned.best_config.all_kwargs()
        return config
    kernel[grid(config) if callable(grid) else grid](*args, **meta, **config)
    return config


# ---------------------------------------------------------------------------------------------------------
# Hopper (and later): persistent kernel with tensor-memory-accelerator (TMA) loads and stores
# ---------------------------------------------------------------------------------------------------------
# The pointer kernel above tops out near 80% of cuBLAS on an H100: every program pays its prologue and
# epilogue in turn, and address arithmetic competes with the tensor cores. This one is Triton's persistent
# matmul tutorial with our epilogue: one program per SM walks the output tiles (grouped as above), tiles
# move between global and shared memory through TMA descriptors (which also zero-fill reads and clip writes
# past the edges, so no masks), and the pipelining is flattened over the tile and K loops, so the next
# tile's loads overlap this tile's epilogue. EPILOGUE_SUBTILE stores the output in two halves, which frees
# shared memory for a deeper pipeline. GATED is gated_linear's form: one 3-D descriptor over both weights (see
# launch_tma_gated), so the tile and the pipeline are this kernel's (a form with two descriptors and two
# accumulators measured 2-5% slower than the pointer kernel on the H100). The descriptors are built on the
# host (``TensorDescriptor``; built on the device with ``tl.make_tensor_descriptor`` the kernel measured
# slower on the H100, 2026-11-26). Building and encoding them costs tens of microseconds per launch, so the
# op takes this kernel only for GEMMs large enough to hide that (``TMA_MIN_M`` rows), on a device with TMA
# (compute capability 9.0 and up) and operands aligned for it (``tma_ok``); else the pointer kernel.
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # triton < 3.4, or no triton: the pointer kernel only
    TensorDescriptor = None
HAVE_TMA = HAVE_TRITON and TensorDescriptor is not None


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


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def tma_ok(*tensors) -> bool:
    """Whether the TMA kernel can run on these 2-D CUDA tensors (None skipped): a device with TMA (compute
    capability 9.0 and up), unit last stride, 16-byte aligned base and row stride. (The CPU's interpreter runs
    the TMA kernel too, but only when a test calls ``launch_tma``: the op runs the pointer kernel there.)"""
    if not HAVE_TMA or _INTERPRETED:
        return False
    for t in tensors:
        if t is None:
            continue
        if not t.is_cuda or _capability_major(t.device.index if t.device.index is not None
                                              else torch.cuda.current_device()) < 9:
            return False
        if t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


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
    """Launch the TMA kernel on ``descs`` (x, w, residual, out): autotuned on a key's first call, then with the
    config chosen then (as ``launch_tuned``, with the descriptors' block shapes set by hand)."""
    num_sms = num_sms or (sm_count(x2.device) if x2.is_cuda else 2)
    meta = dict(ACTIVATION=activation, INPUT_PRECISION=input_precision(x2.dtype), NUM_SMS=num_sms, **flags)
    args = (*descs, bias_arg, M, N, K)

    def grid(meta):
        return (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, out_cols(meta))),)

    key = (_gemm_tma_kernel, (M, N, K, x2.dtype, activation, num_sms, *sorted(flags.items())))
    config = config or _chosen.get(key)
    if config is None:
        _gemm_tma_autotuned[grid](*args, **meta)
        _chosen[key] = _gemm_tma_autotuned.best_config.all_kwargs()
    else:
        _tma_block_shapes({**config, **flags, **dict(zip(("x_desc", "w_desc", "r_desc", "out_desc"), descs))})
        _gemm_tma_kernel[grid(config)](*args, **meta, **config)
    launches["tma"] += 1


# ---------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------
def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: TF32 for float32 only where torch's matmul precision allows it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def launch_grid(M: int, N: int):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


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
    elif config is None:
        launch_tuned(_linear_epilogue_autotuned, _linear_epilogue_kernel, (M, N, K, x2.dtype), launch_grid(M, N),
                     args, meta)
    else:
        _linear_epilogue_kernel[launch_grid(M, N)(config)](*args, **meta, **config)
    launches["linear_epilogue"] += 1
    return out


def use_kernel(x: torch.Tensor) -> bool:
    """Whether the op runs the Triton kernel on x's device and dtype (else the eager reference)."""
    if not HAVE_TRITON or x.dtype not in _KERNEL_DTYPES:
        return False
    if x.is_cuda:
        return not _INTERPRETED
    # triton 3.5's interpreter fails on these kernels (a numpy scalar conversion); 3.6 and later run them
    return x.device.type == "cpu" and _INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1" and \
        INTERPRETER_OK


def _interpreter_ok() -> bool:
    try:
        return tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 6)
    except (NameError, ValueError):
        return False


INTERPRETER_OK = HAVE_TRITON and _interpreter_ok()


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: unknown {activation!r}; expected one of {', '.join(map(repr, ACTIVATIONS))}")


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
ACTIVATIONS = {
    "none": lambda z: z,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def reference(x, weight, bias=None, residual=None, activation: str = "none") -> torch.Tensor:
    """The unfused sequence the kernel replaces: F.linear, the activation, + residual (each in x.dtype)."""
    out = ACTIVATIONS[activation](F.linear(x, weight, bias))
    return out if residual is None else out + residual


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


# ---------------------------------------------------------------------------------------------------------
# Custom op: torch.ops.kpt.linear_epilogue, its fake implementation and autograd
# ---------------------------------------------------------------------------------------------------------
def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
             residual: Optional[torch.Tensor] = None, activation: str = "none") -> torch.Tensor:
    _check(x, weight, bias, residual, activation)
    if not use_kernel(x):
        return reference(x, weight, bias, residual, activation)
    K, N = x.shape[-1], weight.shape[0]
    res2 = residual.reshape(-1, N) if residual is not None else None
    return _launch(x.reshape(-1, K), weight, bias, res2, activation).view(*x.shape[:-1], N)


def _fake(x, weight, bias=None, residual=None, activation="none"):
    _check(x, weight, bias, residual, activation)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_linear_epilogue_op = torch.library.custom_op("kpt::linear_epilogue", mutates_args=())(_forward)
_linear_epilogue_op.register_fake(_fake)


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


_linear_epilogue_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Inference op: torch.ops.kpt.linear_epilogue_inference, the same computation without autograd
# ---------------------------------------------------------------------------------------------------------
# A custom_op runs a Python autograd layer in front of the kernel even under torch.no_grad(): at decode
# sizes that is about half of the op's host time on the H100 machine (benchmarks/bench_dispatch.py, "op"
# against "launch"), and a model compiled without CUDA graphs is bound by host time there. Where no gradient
# flows through the call, the fusion pass emits this op instead: defined with torch.library.Library and no
# autograd kernel, so PyTorch's C++ autograd fallback stands in front (it warns if a gradient is asked for).
_lib = torch.library.Library("kpt", "FRAGMENT")
_lib.define("linear_epilogue_inference(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, "
            "str activation='none') -> Tensor")
_lib.impl("linear_epilogue_inference", _forward, "CompositeExplicitAutograd")
torch.library.register_fake("kpt::linear_epilogue_inference", _fake, lib=_lib)


# ---------------------------------------------------------------------------------------------------------
# Inductor's form: torch.ops.kpt.linear_epilogue_triton, the pointer kernel as a torch.library.triton_op
# ---------------------------------------------------------------------------------------------------------
# Inside an Inductor graph a custom op is an extern call: the dispatcher, our checks and Triton's Python
# launcher on every call (50-100 us per call on the H100 machine's host, benchmarks/bench_dispatch.py). A
# triton_op is traced into the graph instead (AOTAutograd decomposes it), and Inductor compiles and launches
# the kernel as one of its own. The fusion pass emits this form only where Inductor generates the code for
# CUDA and no gradient flows: it has no autograd, and the CPU's interpreter cannot run a traced kernel under
# torch.compile (the module docstring). GEMMs large enough for the TMA kernel call the inference op from
# inside it (their launch is hidden behind their run time); so do CPU tensors, outside the interpreter.
_inductor_autotuners: dict = {}


def inductor_autotuner(kernel, configs, M: int, dtype: torch.dtype):
    """The autotuner Inductor sees for ``kernel`` at M rows of ``dtype``: the configs ``prune_configs`` keeps
    (Inductor autotunes a traced kernel over its ``configs`` and skips ``prune_configs_by``)."""
    key = (kernel, M <= 64, dtype.itemsize)
    if key not in _inductor_autotuners:
        kept = kept_configs(configs, M, dtype.itemsize)
        _inductor_autotuners[key] = triton.autotune(configs=kept, key=["M", "N", "K"])(kernel)
    return _inductor_autotuners[key]


def wrapped_launch(kernel, configs, M: int, dtype: torch.dtype, grid, args: tuple, meta: dict) -> None:
    """Launch a pointer kernel from a triton_op: on CUDA its Inductor autotuner (see ``inductor_autotuner``),
    on the CPU's interpreter ``INTERPRETER_META``."""
    wrap = torch.library.wrap_triton
    if args[0].is_cuda:
        wrap(inductor_autotuner(kernel, configs, M, dtype))[grid](*args, **meta)
    else:
        wrap(kernel)[grid(INTERPRETER_META)](*args, **meta, **INTERPRETER_META)


def _triton_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None, activation: str = "none") -> torch.Tensor:
    _check(x, weight, bias, residual, activation)
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    if not use_kernel(x) or use_tma(M, N, K) or M == 0 or N == 0:
        return torch.ops.kpt.linear_epilogue_inference(x, weight, bias, residual, activation)
    x2 = x.reshape(M, K)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    args, meta = _pointer_args(x2, weight, bias, residual.reshape(M, N) if residual is not None else None, out,
                               activation)
    wrapped_launch(_linear_epilogue_kernel, CONFIGS, M, x.dtype, launch_grid(M, N), args, meta)
    return out.view(*x.shape[:-1], N)


if HAVE_TRITON:
    torch.library.triton_op("kpt::linear_epilogue_triton", mutates_args=())(_triton_forward)


def linear_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None, activation: str = "none") -> torch.Tensor:
    """act(x @ weight^T + bias) + residual in one kernel; see the module docstring."""
    return torch.ops.kpt.linear_epilogue(x, weight, bias, residual, activation)
