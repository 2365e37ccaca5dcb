"""``y = x @ w.T`` with ``w`` stored in fp4 (NVFP4 or MXFP4, kernels/_fp4_format.py), dequantized in registers
(issue 18; not yet emitted by a pass).

The math: w[n, k] = e2m1(code[n, k]) * scale[n, k // block] (* the NVFP4 tensor scale). Each program computes a
BLOCK_M x BLOCK_N tile of y: per K step it loads x [BLOCK_M, BLOCK_K] and the packed bytes [BLOCK_N,
BLOCK_K / 2], splits each byte into its two codes (the even element in the low nibble), turns codes into
values with integer arithmetic (no table: e = bits 1-2, m = bit 0; twice the value is m where e = 0, else
(2 + m) << (e - 1); bit 3 the sign), multiplies each block of values by half its scale, and feeds tl.dot in x's
dtype with an fp32 accumulator. Memory read per weight: half a byte and a scale byte per block. Small M splits
K over several programs (fp32 partial sums added after) so that every SM has work; the NVFP4 tensor scale is
read from memory (no host sync: the call can be captured in a CUDA graph). MXFP4 weights with bf16 activations
go through triton's ``tl.dot_scaled`` instead (its own fp4 conversion), by default: on the H100 it was the
fastest form measured (benchmarks/results/nvidia-h100-80gb-hbm3/2026-11-27-s14-fp4-25f4925.md), and still far
from what the weight bytes allow (1.2x bf16 cuBLAS at 4096x14336, M=1; the issue asks 3x).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _fp4_format as fmt
from ._launch import input_precision, kernel_runs, tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _e2m1_twice(code):
    """Codes (int32, 0-15) -> twice their E2M1 values as float32 (0, 1, 2, 3, 4, 6, 8, 12 and negatives), by
    integer arithmetic; the 0.5 goes into the block scale."""
    e = (code >> 1) & 3
    m = code & 1
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0)).to(tl.float32)
    return tl.where((code & 8) != 0, -twice, twice)


@triton.jit
def _fp4_linear_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ys, stride_ym,
                       stride_yn, E8M0: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       SCALED_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # split-K: this program's share of K (partial sums, added up after)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K // 2)  # packed bytes along K: byte j holds elements 2j (low nibble) and 2j + 1
    rs = tl.arange(0, BLOCK_K // BLOCK)
    half_gs = 0.5 * tl.load(gs_ptr)  # the tensor scale (1 for MXFP4) and the codes' factor 2, from memory
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    for k0 in range(k_start, k_end, BLOCK_K):
        kb = k0 // 2 + rb
        b_ok = (kb < k_end // 2)[None, :]
        packed = tl.load(w_ptr + rn[:, None] * stride_wn + kb[None, :] * stride_wk, mask=n_ok & b_ok, other=0)
        if SCALED_DOT:  # MXFP4 as triton's microscaled dot takes it (its own fp4 -> bf16 conversion on Hopper)
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                        mask=m_ok & (rk < k_end)[None, :], other=0.0)
            sk = k0 // BLOCK + rs
            raw = tl.load(s_ptr + rn[:, None] * stride_sn + sk[None, :] * stride_sk,
                          mask=n_ok & (sk < k_end // BLOCK)[None, :], other=127)
            acc = tl.dot_scaled(x, None, "bf16", tl.trans(packed), raw, "e2m1", acc)
        else:  # the second form (measured faster than reading each byte's scale and two products, 25f4925)
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                        mask=m_ok & (rk < k_end)[None, :], other=0.0)
            codes = packed.to(tl.int32)
            lo = _e2m1_twice(codes & 0xF)
            hi = _e2m1_twice((codes >> 4) & 0xF)
            values = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # [.., j, 0] = element 2j, [.., j, 1] = 2j + 1
            sk = k0 // BLOCK + rs
            raw = tl.load(s_ptr + rn[:, None] * stride_sn + sk[None, :] * stride_sk,
                          mask=n_ok & (sk < k_end // BLOCK)[None, :], other=0)
            if E8M0:
                scale = tl.exp2(raw.to(tl.float32) - 127.0) * half_gs
            else:
                scale = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * half_gs
            w = tl.reshape(tl.reshape(values, (BLOCK_N, BLOCK_K // BLOCK, BLOCK)) * scale[:, :, None],
                           (BLOCK_N, BLOCK_K))
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    y_ptr += pid_k * stride_ys
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok & (rn[None, :] < N))


def reference(x: Tensor, q: fmt.Fp4Weight) -> Tensor:
    """The eager form: the weight dequantized in full, then a matmul in x's dtype."""
    return x @ fmt.dequantize(q, x.dtype).T


SMS = 132  # an H100's SMs: split-K gives small M at least two programs per SM (a launch heuristic only)


def config_for(m: int, n: int, k: int, block: int, scaled_dot: bool = False) -> dict:
    """Tile sizes, split-K and launch settings for an M x N x K product (first heuristic; bench_fp4 --sweep
    times the alternatives)."""
    if m <= 16:
        cfg = dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    else:
        cfg = dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    cfg["block_k"] = max(cfg["block_k"] // block * block, block)
    cfg["scaled_dot"] = scaled_dot
    programs = -(-m // cfg["block_m"]) * -(-n // cfg["block_n"])
    steps = -(-k // cfg["block_k"])
    split = 1
    while programs * split < 2 * SMS and split * 2 <= max(steps // 2, 1):
        split *= 2
    cfg["split_k"] = split
    return cfg


def fp4_linear(x: Tensor, q: fmt.Fp4Weight, *, config: dict | None = None) -> Tensor:
    """``x`` [..., K] times the fp4 weight [N, K] transposed: [..., N] in x's dtype. ``config`` overrides
    ``config_for`` (keys block_m, block_n, block_k, split_k, num_warps, num_stages, and scaled_dot: MXFP4
    with bf16 activations through ``tl.dot_scaled``)."""
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp4_linear: x has K={x.shape[-1]}, the weight {k}")
    if x.dtype not in DTYPES:
        raise ValueError(f"fp4_linear takes float32, float16 or bfloat16 activations, got {x.dtype}")
    if not kernel_runs(x, DTYPES, needs_3_6_interpreter=True):
        return reference(x, q)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    scaled = q.format.scale_dtype == "e8m0" and x.dtype == torch.bfloat16 and hasattr(tl, "dot_scaled")
    cfg = {**config_for(m, n, k, q.format.block, scaled), **(config or {})}
    bk, split = cfg["block_k"], cfg["split_k"]
    if bk % q.format.block or bk % 2 or k % q.format.block:
        raise ValueError(f"fp4_linear: block_k={bk} must be a multiple of the format's {q.format.block}")
    if cfg["scaled_dot"] and (q.format.scale_dtype != "e8m0" or x.dtype != torch.bfloat16):
        raise ValueError("fp4_linear: scaled_dot takes MXFP4 weights (E8M0 scales) and bfloat16 activations")
    per_split = -(-k // (split * bk)) * bk
    split = -(-k // per_split)
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]), split)
    _fp4_linear_kernel[grid](
        x2, q.packed, q.scales.view(torch.uint8), q.global_scale.reshape(1).float(),  # E4M3 scales as bytes
        out, m, n, k, per_split,
        x2.stride(0), x2.stride(1), q.packed.stride(0), q.packed.stride(1), q.scales.stride(0), q.scales.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        E8M0=q.format.scale_dtype == "e8m0", BLOCK=q.format.block, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=bk, PRECISION=input_precision(x.dtype), SCALED_DOT=cfg["scaled_dot"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    y = out[0] if split == 1 else out.sum(0).to(x.dtype)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------------------
# The op a pass emits: inference only (fp4 weights are constants of an inference graph), one opaque call that
# Inductor launches as an extern kernel; the weight's parts are its arguments (packed bytes, scale bytes, the
# tensor scale), so they can be graph constants.
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("kpt::fp4_linear", mutates_args=())
def fp4_linear_op(x: Tensor, packed: Tensor, scales: Tensor, global_scale: Tensor, block: int,
                  e8m0: bool) -> Tensor:
    return fp4_linear(x, _weight(packed, scales, global_scale, block, e8m0))


@fp4_linear_op.register_fake
def _(x, packed, scales, global_scale, block, e8m0):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _weight(packed: Tensor, scales: Tensor, global_scale: Tensor, block: int, e8m0: bool) -> fmt.Fp4Weight:
    f = fmt.MXFP4 if e8m0 else fmt.NVFP4
    if f.block != block:
        raise ValueError(f"fp4_linear: block {block} is not {f.name}'s {f.block}")
    stored = scales if e8m0 else scales.view(torch.float8_e4m3fn)
    return fmt.Fp4Weight(f, packed, stored, global_scale, (packed.shape[0], packed.shape[1] * 2))


def op_args(q: fmt.Fp4Weight) -> tuple:
    """The weight's parts as the op takes them (after x)."""
    return (q.packed, q.scales.view(torch.uint8), q.global_scale.reshape(()).float(), q.format.block,
            q.format.scale_dtype == "e8m0")
