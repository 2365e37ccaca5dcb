"""``y = x @ w.T``, ``w`` in fp4 (NVFP4 or MXFP4, _fp4_format.py) dequantized in registers: ``kpt::fp4_linear``.

On NVIDIA GPUs from sm_89, NVFP4 weights with bf16 activations at M=1-16 and K a multiple of 128 take the CUDA
C++ form by default (``config={"cuda": True}``, kernels/_fp4_cuda.py: mma.sync, each lane decoding its own
fragment; docs/fp4.md). Everything else takes the Triton forms below.

The math: w[n, k] = e2m1(code[n, k]) * scale[n, k // block] (* the NVFP4 tensor scale). Two forms:
- GEMV (M=1 by default): CUDA cores. The packed bytes are read as int32 words of 8 codes and decoded by bit
  operations (inline PTX on the GPU: two codes per operation as fp16x2; their fp16 bits are the value times
  2^-14), multiplied by x and summed per scale block within a thread; the sums across threads are taken once,
  at the end. Two arithmetics: for 16-bit activations by default, x scaled per word into fp16's range and the
  products summed in fp16 pairs (``_fp4_gemv.py``, 7-15% faster on an H200, s27); for fp32 activations, or
  ``gemv_math="f32"``, in fp32 (``_fp4_gemv_kernel``). Both bound by the decode (benchmarks/diag_fp4_gemv.py).
- dot (``_fp4_linear_kernel``): per K step x [BLOCK_M, BLOCK_K] and the weight's words [BLOCK_N, BLOCK_K / 8]
  decoded the same way and joined into K order (DECODE=2, the default; 1: bytes by the same bit operations in
  Triton; 0: bytes by integer arithmetic and an int-to-float conversion, the slowest), each block times its
  scale, then tl.dot in x's dtype with an fp32 accumulator. ``scaled_dot``: MXFP4 with bf16 activations
  through triton's ``tl.dot_scaled`` (its own conversion; slower than DECODE=2 on the H200). DECODE=3 (bf16
  activations, the default for them up to M=16 with NVFP4): ``_fp4_mma.py``, the words decoded straight to
  scaled bf16 pairs and the weight as the MMA's first operand (MXFP4 only when asked: block scales up to 2^9).
Small M splits K over several programs (fp32 partial sums added after) so that every SM has work. The NVFP4
tensor scale is read from memory (no host sync: the call can be captured in a CUDA graph)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _fp4_format as fmt
from . import _fp4_cuda
from ._fp4_gemv import _fp4_gemv_h2_kernel, _x_at, block_scales, weight_words, x_tile
from ._fp4_mma import _fp4_mma_kernel
from ._launch import HAVE_TRITON, INTERPRETED, capability, input_precision, kernel_runs, tl, triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# what the cost model's tables are keyed by
SOURCE_MODULES = ("fp4_linear", "_fp4_gemv", "_fp4_mma", "_fp4_cuda", "_fp4_cuda_source", "_fp4_format", "_launch")
# the CUDA form's config (kernels/_fp4_cuda.py)
CUDA_KEYS = {"cuda", "nt", "rw", "wk", "depth", "async", "rt", "split_k"}


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
                       SCALED_DOT: tl.constexpr, DECODE: tl.constexpr, ASM: tl.constexpr):
    """DECODE: 0 bytes by integer arithmetic and int-to-float conversion; 1 bytes by bit operations (fp16
    bits); 2 int32 words by the GEMV form's bit operations (w_ptr then points to words)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # split-K: this program's share of K (partial sums, added up after)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K // 2)  # packed bytes along K: byte j holds elements 2j (low nibble) and 2j + 1
    rs = tl.arange(0, BLOCK_K // BLOCK)
    # the tensor scale (1 for MXFP4) times the decode's factor: 1/2 or 2^14 (on the scale: fp16 activations would
    # make the values subnormal; no fp32 weight has an E8M0 scale past 2^113)
    half_gs = (16384.0 if DECODE > 0 else 0.5) * tl.load(gs_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    for k0 in range(k_start, k_end, BLOCK_K):
        x = x_tile(x_ptr, rm, k0, k_end, stride_xm, stride_xk, m_ok, BLOCK_K)
        sk = k0 // BLOCK + rs
        s_ok = n_ok & (sk < k_end // BLOCK)[None, :]
        if DECODE == 2:
            words = weight_words(w_ptr, rn, k0, k_end, stride_wn, stride_wk, n_ok, BLOCK_K // 8)
            values = _decode_words(words, ASM, BLOCK_N, BLOCK_K // 8)
        else:
            kb = k0 // 2 + rb
            packed = tl.load(w_ptr + rn[:, None] * stride_wn + kb[None, :] * stride_wk,
                             mask=n_ok & (kb < k_end // 2)[None, :], other=0)
            codes = packed.to(tl.int32)
            if SCALED_DOT:  # MXFP4 as triton's microscaled dot takes it (its own fp4 -> bf16 conversion)
                raw = tl.load(s_ptr + rn[:, None] * stride_sn + sk[None, :] * stride_sk, mask=s_ok, other=127)
                acc = tl.dot_scaled(x, None, "bf16", tl.trans(packed), raw, "e2m1", acc)
            elif DECODE == 1:
                values = tl.reshape(tl.join(_code_value(codes, 0), _code_value(codes, 4)), (BLOCK_N, BLOCK_K))
            else:
                values = tl.reshape(tl.join(_e2m1_twice(codes & 0xF), _e2m1_twice((codes >> 4) & 0xF)),
                                    (BLOCK_N, BLOCK_K))  # [.., j, 0] = element 2j, [.., j, 1] = 2j + 1
        if not SCALED_DOT:
            scale = block_scales(s_ptr + rn[:, None] * stride_sn + sk[None, :] * stride_sk, s_ok, E8M0) * half_gs
            w = tl.reshape(tl.reshape(values, (BLOCK_N, BLOCK_K // BLOCK, BLOCK)) * scale[:, :, None],
                           (BLOCK_N, BLOCK_K))
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    y_ptr += pid_k * stride_ys
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok & (rn[None, :] < N))


# The GEMV form (small M, CUDA cores, no tensor cores): packed weights read as int32 words of 8 codes (element 8j
# + t in bits 4t..4t+3), each decoded to 8 float32 values by bit operations on two codes at once (fp16x2), no
# integer-to-float conversion (a quarter-rate instruction: the dot form's decode spends most of its time there).
# A code's fp16 bits: sign at bit 15, its 3 magnitude bits at 9-11; as fp16 that is its E2M1 value times 2^-14,
# subnormal codes (0.5) included, and fp16 -> fp32 is exact. The 2^14 goes onto the sums at the end.
# Pair (e3, e7) is nibbles 3 and 7, at the top of each 16-bit half; a shift left by 4 brings (e2, e6), and so on.
_PAIR = """and.b32 %ws, %wv, 0x80008000;
shr.b32 %wa, %wv, 3;
and.b32 %wa, %wa, 0x0E000E00;
or.b32 %wh, %wa, %ws;
mov.b32 {{%wl, %wu}}, %wh;
cvt.f32.f16 ${lo}, %wl;
cvt.f32.f16 ${hi}, %wu;
"""
_DECODE_WORD_ASM = ("{\n.reg .b32 %wv, %wa, %ws, %wh;\n.reg .b16 %wl, %wu;\nmov.b32 %wv, $8;\n"
                    + "shl.b32 %wv, %wv, 4;\n".join(_PAIR.format(lo=t, hi=t + 4) for t in (3, 2, 1, 0)) + "}")
_DECODE_WORD_ASM_C = tl.constexpr(_DECODE_WORD_ASM) if HAVE_TRITON else _DECODE_WORD_ASM


@triton.jit
def _code_value(word, SHIFT: tl.constexpr):
    """The code at bits SHIFT..SHIFT+3 of each word as float32, times 2^-14 (the asm's arithmetic, one code at
    a time: the form the interpreter runs)."""
    c = (word >> SHIFT) & 0xF
    bits = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_word(word, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise(_DECODE_WORD_ASM_C, "=r,=r,=r,=r,=r,=r,=r,=r,r", [word],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        return (_code_value(word, 0), _code_value(word, 4), _code_value(word, 8), _code_value(word, 12),
                _code_value(word, 16), _code_value(word, 20), _code_value(word, 24), _code_value(word, 28))


@triton.jit
def _decode_words(words, ASM: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Words [ROWS, WORDS] -> their 8 codes each as float32 times 2^-14, [ROWS, 8 * WORDS] in K order (the 8
    values of a word joined as a minor dim in registers: element 8j + t at t)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word(words, ASM)
    joined = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(joined, (ROWS, 8 * WORDS))  # [.., c, b, a] holds t = 4c + 2b + a


@triton.jit
def _fp4_gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ys, stride_ym,
                     stride_yn, E8M0: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """One row of x per program (grid axis 0: M; written for M=1, correct for any). Per step: the words
    [BLOCK_N, BLOCK_K / 8], their 8 values each times x[8j + t] (x read per t), summed per scale block within a
    thread and scaled into an accumulator of one sum per row and block, held across steps and added up across
    threads once at the end (a reduction across threads per step took half the time, H200 s15)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BLOCK_W: tl.constexpr = BLOCK_K // 8  # int32 words per row per step
    NB: tl.constexpr = BLOCK_K // BLOCK  # scale blocks per row per step
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    rs = tl.arange(0, NB)
    acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    n_ok = (rn < N)[:, None]
    x_row = x_ptr + pid_m * stride_xm
    for k0 in range(k_start, k_end, BLOCK_K):
        kw = k0 // 8 + rw
        k_ok = kw < k_end // 8
        words = tl.load(w_ptr + rn[:, None] * stride_wn + kw[None, :] * stride_wk, mask=n_ok & k_ok[None, :],
                        other=0)
        v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word(words, ASM)
        p = v0 * _x_at(x_row, kw, stride_xk, 0, False, k_ok)
        p += v1 * _x_at(x_row, kw, stride_xk, 1, False, k_ok)
        p += v2 * _x_at(x_row, kw, stride_xk, 2, False, k_ok)
        p += v3 * _x_at(x_row, kw, stride_xk, 3, False, k_ok)
        p += v4 * _x_at(x_row, kw, stride_xk, 4, False, k_ok)
        p += v5 * _x_at(x_row, kw, stride_xk, 5, False, k_ok)
        p += v6 * _x_at(x_row, kw, stride_xk, 6, False, k_ok)
        p += v7 * _x_at(x_row, kw, stride_xk, 7, False, k_ok)
        per_block = tl.sum(tl.reshape(p, (BLOCK_N, NB, BLOCK // 8)), axis=2)  # the words of a block: one thread's
        sk = k0 // BLOCK + rs
        s_ok = n_ok & (sk < k_end // BLOCK)[None, :]
        acc += per_block * block_scales(s_ptr + rn[:, None] * stride_sn + sk[None, :] * stride_sk, s_ok, E8M0)
    out = tl.sum(acc, axis=1) * 16384.0 * tl.load(gs_ptr)  # the decode's 2^-14, the tensor scale (1: MXFP4)
    y_ptr += pid_k * stride_ys + pid_m * stride_ym
    tl.store(y_ptr + rn * stride_yn, out.to(y_ptr.dtype.element_ty), mask=rn < N)


def cuda_form_fits(x2: Tensor, q: fmt.Fp4Weight, why: list | None = None) -> bool:
    """Whether the CUDA form (kernels/_fp4_cuda.py) takes this call; the reasons it does not go into ``why``."""
    reasons = _cuda_form_reasons(x2.device, x2.dtype, x2.shape[0], q.shape[0], x2.shape[1], q.format)
    if why is not None:
        why.extend(reasons)
    return not reasons


def _cuda_form_reasons(device: torch.device, dtype: torch.dtype, m: int, n: int, k: int, f: fmt.Fp4Format) -> list:
    reasons = []
    ok, reason = _fp4_cuda.available(device) if device.type == "cuda" and not INTERPRETED else (
        False, "the CUDA form runs on NVIDIA GPUs only (not under the Triton interpreter)")
    if not ok:
        reasons.append(reason)
    if f is not fmt.NVFP4:
        reasons.append(f"it takes NVFP4 weights, not {f.name}")
    if dtype != torch.bfloat16:
        reasons.append(f"it takes bfloat16 activations, not {dtype}")
    if m > _fp4_cuda.MAX_M or m == 0:
        reasons.append(f"it takes 1 to {_fp4_cuda.MAX_M} rows of x, not {m}")
    if k % _fp4_cuda.CHUNK or k == 0:
        reasons.append(f"K must be a positive multiple of {_fp4_cuda.CHUNK}, not {k}")
    if n == 0:
        reasons.append("the weight has no rows (N=0)")
    return reasons


def _loaded_or_not_capturing(x2: Tensor, q: fmt.Fp4Weight) -> bool:
    """The default takes the CUDA form inside a CUDA graph capture only where its kernel is loaded already
    (loading one there breaks the capture); ``prepare_cuda_form`` loads them when the fp4 pass compiles."""
    if not torch.cuda.is_current_stream_capturing():
        return True
    return _fp4_cuda.compiled(_fp4_cuda.pick(x2.shape[0], q.shape[0], q.shape[1], x2.device), x2.device)


def prepare_cuda_form(n: int, k: int, dtype: torch.dtype, device: torch.device, f: fmt.Fp4Format) -> bool:
    """Load the CUDA form's kernels for an N x K weight where the default would take it (see
    ``_loaded_or_not_capturing``); whether it did."""
    if _cuda_form_reasons(device, dtype, 1, n, k, f):
        return False
    try:
        _fp4_cuda.prepare(n, k, device)
    except _fp4_cuda.CompileError as e:  # a default config: the environment's fault; the Triton forms instead
        _fp4_cuda.disable(device, str(e))
        return False
    return True


def _cuda_form(x2: Tensor, q: fmt.Fp4Weight, asked: dict) -> Tensor:
    why = []
    if not cuda_form_fits(x2, q, why):
        raise ValueError("fp4_linear: config cuda=True cannot run this call: " + "; ".join(why))
    if set(asked) - CUDA_KEYS:
        raise ValueError(f"fp4_linear: {sorted(set(asked) - CUDA_KEYS)} are Triton forms' keys; the CUDA form "
                         f"takes {sorted(CUDA_KEYS)}")
    m, k = x2.shape
    cfg = {**_fp4_cuda.pick(m, q.shape[0], k, x2.device), **asked}
    if (cfg["nt"] not in (1, 2) or 8 * cfg["nt"] < m or cfg["depth"] not in (2, 4, 6, 8)
            or min(cfg["rw"], cfg["wk"], cfg["split_k"]) < 1 or cfg["rw"] * cfg["wk"] > 32
            or cfg.get("rt", 1) not in (1, 2, 4) or cfg.get("rt", 1) == 4 and cfg["depth"] > 4
            or cfg["nt"] == 2 and cfg["rw"] * cfg["wk"] > 16 or int(cfg.get("async", 0)) not in (0, 1, 2)):
        raise ValueError(f"fp4_linear: CUDA form config {cfg}: nt 1 or 2 (8 nt >= M={m}), depth 2, 4, 6 or 8, "
                         "rw, wk and split_k at least 1, rw x wk warps at most 32 (16 with nt=2), rt 1, 2 or 4 "
                         "(4 with depth 4 at most): past these the registers spill; async False, True or 2 (x "
                         "through the ring too)")
    static = _fp4_cuda.static_bytes(cfg["nt"], cfg["rw"], cfg["wk"], cfg.get("rt", 1))
    ring = _fp4_cuda.ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], int(cfg.get("async", False)), cfg.get("rt", 1),
                                cfg["nt"])
    limit = _fp4_cuda.shared_optin(x2.device)
    if static > 48 * 1024 or static + ring > limit:
        raise ValueError(f"fp4_linear: CUDA form config {cfg} needs {static} bytes of static and {ring} of dynamic "
                         f"shared memory; {x2.device} gives a block 48 KB static, {limit} in all")
    return _fp4_cuda.fp4_linear_cuda(x2, q.packed, q.scales.view(torch.uint8), q.global_scale, cfg)


def reference(x: Tensor, q: fmt.Fp4Weight) -> Tensor:
    """The eager form: the weight dequantized in full, then a matmul in x's dtype."""
    return x @ fmt.dequantize(q, x.dtype).T


SMS = 132  # an H100's SMs: split-K gives small M at least two programs per SM (a launch heuristic only)
GEMV_MAX_M = 1  # up to this M the GEMV form (CUDA cores) by default; past it the dot form (tensor cores)


def config_for(m: int, n: int, k: int, block: int, scaled_dot: bool = False, gemv: bool | None = None,
               gemv_math: str = "f16x2", dtype: torch.dtype | None = None, e8m0: bool = False) -> dict:
    """The Triton forms' tiles, split-K and form for M x N x K (bench_fp4 --sweep, H200 s15/s27/s28). ``gemv``:
    the form asked for (None: the GEMV up to GEMV_MAX_M); ``gemv_math``: its arithmetic; ``dtype``: the
    activations' (bf16 to M=16 with NVFP4: decode=3, 7-14% faster than 2); ``e8m0``: MXFP4 (decode=3 cannot)."""
    if gemv is None:
        gemv = m <= GEMV_MAX_M and not scaled_dot
    if gemv and gemv_math == "f16x2":
        cfg = dict(block_m=1, block_n=8, block_k=2048, num_warps=4, num_stages=1, gemv=True)
    elif gemv:
        narrow = -(-n // 16) < 2 * SMS  # few rows: 8 a program, longer steps along K
        cfg = dict(block_m=1, block_n=8 if narrow else 16, block_k=2048 if narrow else 1024, num_warps=4,
                   num_stages=1, gemv=True)
    elif m <= 16 and dtype == torch.bfloat16 and not scaled_dot and not e8m0:
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, decode=3)
    elif m <= 16:
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)  # also M=1 asked for the dot
    elif m <= 64:
        cfg = dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    else:
        cfg = dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    cfg["block_k"] = max(cfg["block_k"] // block * block, block)
    cfg.setdefault("gemv", False)
    cfg["scaled_dot"] = scaled_dot
    programs = (m if cfg["gemv"] else -(-m // cfg["block_m"])) * -(-n // cfg["block_n"])
    steps = -(-k // cfg["block_k"])
    split = 1
    while programs * split < 2 * SMS and split * 2 <= max(steps // 2, 1):
        split *= 2
    cfg["split_k"] = split
    return cfg


def fp4_linear(x: Tensor, q: fmt.Fp4Weight, *, config: dict | None = None) -> Tensor:
    """``x`` [..., K] times the fp4 weight [N, K] transposed: [..., N] in x's dtype. ``config`` overrides
    ``config_for`` (keys block_m, block_n, block_k, split_k, num_warps, num_stages; gemv: the CUDA-core form
    (default at M=1), or False for the dot form; gemv_math: the GEMV's arithmetic, "f16x2" (the default for
    16-bit x) or "f32" (for fp32 x); decode: the dot form's decode, 0-3 (3: bf16 x only, _fp4_mma.py);
    scaled_dot: MXFP4 with bf16 activations through ``tl.dot_scaled``)."""
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp4_linear: x has K={x.shape[-1]}, the weight {k}")
    if x.dtype not in DTYPES:
        raise ValueError(f"fp4_linear takes float32, float16 or bfloat16 activations, got {x.dtype}")
    if x.is_cuda and capability(x.device) < (8, 9):
        raise ValueError(f"fp4_linear needs compute capability 8.9 (Ada) or newer (Triton converts E4M3 from "
                         f"there); {x.device} has {'.'.join(map(str, capability(x.device)))}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    asked = config or {}
    if asked.get("cuda"):
        return _cuda_form(x2, q, asked).reshape(*lead, n)
    if not asked and cuda_form_fits(x2, q) and _loaded_or_not_capturing(x2, q):  # the default where it fits
        try:  # its config is valid by construction: no checks a call
            cfg = _fp4_cuda.pick(m, n, k, x2.device)
            return _fp4_cuda.fp4_linear_cuda(x2, q.packed, q.scales.view(torch.uint8), q.global_scale,
                                             cfg).reshape(*lead, n)
        except _fp4_cuda.CompileError as e:  # not offered on this device again; a Triton form instead
            _fp4_cuda.disable(x.device, str(e))
    if not kernel_runs(x, DTYPES, needs_3_6_interpreter=True):
        return reference(x, q)
    math = asked.get("gemv_math", "f32" if x.dtype == torch.float32 else "f16x2")  # f16x2: bf16/fp16 exactly
    cfg = config_for(m, n, k, q.format.block, asked.get("scaled_dot", False), asked.get("gemv"), math, x.dtype,
                     q.format.scale_dtype == "e8m0")
    cfg = {**cfg, "gemv_math": math, **asked}
    bk, split = cfg["block_k"], cfg["split_k"]
    if cfg.get("decode", 2) not in (0, 1, 2, 3):
        raise ValueError(f"fp4_linear: decode={cfg['decode']!r}; 0 (integers), 1 (bytes' bits), 2 (words' bits) "
                         "or 3 (bf16 pairs, weights as the MMA's first operand)")
    if cfg.get("decode") == 3 and (x.dtype != torch.bfloat16 or cfg["gemv"] or cfg["scaled_dot"]):
        raise ValueError(f"fp4_linear: decode=3 is a dot form for bfloat16 activations (got {x.dtype}; "
                         "gemv and scaled_dot off)")
    if cfg["gemv_math"] not in ("f16x2", "f32"):
        raise ValueError(f"fp4_linear: gemv_math={cfg['gemv_math']!r}; 'f16x2' (fp16 pair sums) or 'f32'")
    if cfg["scaled_dot"] and cfg["gemv"]:
        raise ValueError("fp4_linear: scaled_dot is a form of the dot kernel; it cannot go with gemv=True")
    if bk % q.format.block or bk % 2 or k % q.format.block:
        raise ValueError(f"fp4_linear: block_k={bk} must be a multiple of the format's {q.format.block}")
    if cfg["scaled_dot"] and (q.format.scale_dtype != "e8m0" or x.dtype != torch.bfloat16):
        raise ValueError("fp4_linear: scaled_dot takes MXFP4 weights (E8M0 scales) and bfloat16 activations")
    per_split = -(-k // (split * bk)) * bk
    split = -(-k // per_split)
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (m if cfg.get("gemv") else triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]), split)
    decode = cfg.get("decode", 2) if not cfg["scaled_dot"] else 0
    asm = x.is_cuda and not INTERPRETED
    if cfg.get("gemv") or decode >= 2:  # 8 codes an int32 word, element 8j + t in bits 4t..4t+3
        w = q.packed.contiguous().view(torch.int32)
    else:
        w = q.packed
    if cfg.get("gemv") and cfg["gemv_math"] == "f16x2":
        kernel, extra = _fp4_gemv_h2_kernel, dict(ASM=asm, EVEN_K=k % bk == 0)  # per_split: whole steps
    elif cfg.get("gemv"):
        kernel, extra = _fp4_gemv_kernel, dict(ASM=asm)
    elif decode == 3:
        kernel, extra = _fp4_mma_kernel, dict(ASM=asm, BLOCK_M=cfg["block_m"])
    else:
        kernel = _fp4_linear_kernel
        extra = dict(PRECISION=input_precision(x.dtype), SCALED_DOT=cfg["scaled_dot"], DECODE=decode, ASM=asm,
                     BLOCK_M=cfg["block_m"])
    kernel[grid](
        x2, w, q.scales.view(torch.uint8), q.global_scale.reshape(1).float(),  # E4M3 scales as bytes
        out, m, n, k, per_split,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), q.scales.stride(0), q.scales.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        E8M0=q.format.scale_dtype == "e8m0", BLOCK=q.format.block, BLOCK_N=cfg["block_n"],
        BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra)
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
