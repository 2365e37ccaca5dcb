"""The fp4 GEMV in half-precision pairs (``_fp4_gemv_h2_kernel``): fp4_linear's GEMV form for 16-bit activations.

Why: the fp32 GEMV (fp4_linear._fp4_gemv_kernel) spends, per code, about two integer operations on the decode,
one fp16 -> fp32 conversion and one fp32 FMA, and it is bound by that work, not by memory
(benchmarks/diag_fp4_gemv.py, H200 s15: 17 us against 5.5 us for the loads alone). Here two codes are decoded
into one register as fp16x2 and multiplied-added with x's pair in one instruction (``fma.rn.f16x2``): no
conversion per code and half the FMAs. Triton 3.6's SASS (benchmarks/diag_fp4_sass.py, compiled on the CPU):
3.9-4.8 instructions a code against the fp32 form's 5.0-5.5 at the same tiles; measured, 7-15% faster at M=1
(bench_fp4 --sweep, H200 s27), less than the count suggests: what else bounds the loop (latency, by our guess)
is not measured.

The numbers:
- A code's fp16 bits: sign at bit 15 and its 3 magnitude bits at 9-11 of each 16-bit half, which as fp16 is
  its E2M1 value times 2^-14 (0.5 is subnormal; fp16 arithmetic keeps subnormals). Pair t of a word (nibbles t
  and t + 4) lands in the low and high halves with one shift per field: the magnitude moved by 9 - 4t bits,
  the sign by 12 - 4t.
- Each word's 8 values of x are multiplied by a power of two that brings their largest magnitude to
  [2^14, 2^15): x' is then exact in fp16 (bf16 activations down to 2^-31 of the word's largest), and each
  product x' * value * 2^-14 is below 12, a half's sum of 4 below 48. For bf16 x a product is exact (8
  significant bits times 2); for fp16 x (11 bits) the FMA rounds it. A product below 2^-14 (an x under about
  2^-14 of its word's largest) is subnormal in fp16: an error of at most 2^-25 there, against the word's
  largest x' times 2^-14, which is at least 1. The power is undone on the word's f32 sum, exactly.
- A word's two half sums (fp16: 3 FMA roundings of 2^-11 each, 4 with fp16 x) go to f32, are multiplied by
  the block's scale and summed in f32: an error far below fp4's own (about 20 dB SQNR).
- fp32 activations take the fp32 GEMV unless ``gemv_math="f16x2"`` is asked for; then x' is rounded to fp16.
- Known, not yet changed (a kernel change needs the cards' calibration again): the decode's 2^-14 is applied
  to the f32 total at the end, so activations below about 1e-33 make the f32 partial sums subnormal (as in the
  fp32 form); folding it into each word's power of two would avoid that.
The asm takes one word at a time (pack=1), so its result does not depend on how Triton lays the tile out over
threads. On the CPU (Triton's interpreter, no inline asm) the same fp16 products and sums run through tl
operations, added in another order (codes 0 to 3 where the asm goes 3 to 0 with FMAs): the results agree to
fp16's rounding, not bit for bit.
"""

from __future__ import annotations

from ._launch import HAVE_TRITON, tl, triton

# Pair t (0-3) of a word: magnitude bits 4t..4t+2 -> 9-11 and sign bit 4t+3 -> 15 (both halves at once), then
# one fp16x2 FMA with x's pair (x[8j + t], x[8j + t + 4]). Shifts left as multiplies (ptxas may put them on the
# FMA pipe); pair 3's magnitude moves right (a shift), its sign is in place.
_SHIFTS = {3: ("shr.b32 %m, {w}, 3;", "mov.b32 %s, {w};"), 2: ("mul.lo.u32 %m, {w}, 2;", "mul.lo.u32 %s, {w}, 16;"),
           1: ("mul.lo.u32 %m, {w}, 32;", "mul.lo.u32 %s, {w}, 256;"),
           0: ("mul.lo.u32 %m, {w}, 512;", "mul.lo.u32 %s, {w}, 4096;")}


def _word_asm(word: str, xregs: list, acc: str) -> str:
    """A word's 8 products summed into the fp16x2 register acc (low half: codes 0-3; high: 4-7)."""
    lines = []
    for t in (3, 2, 1, 0):
        mag, sign = _SHIFTS[t]
        fma = f"mul.rn.f16x2 {acc}, %h, {xregs[t]};" if t == 3 else f"fma.rn.f16x2 {acc}, %h, {xregs[t]}, {acc};"
        lines += [mag.format(w=word), sign.format(w=word), "and.b32 %m, %m, 0x0E000E00;",
                  "and.b32 %s, %s, 0x80008000;", "or.b32 %h, %m, %s;", fma]
    return "\n".join(lines) + "\n"


# One word (8 codes of a row), pack=1 (each element on its own: right whatever the layout): $1 the word; $2-$5
# x's pairs t = 0-3; one fp16x2 sum of the 8 products, its two halves added in f32 into $0.
_WORD_ASM = ("{\n.reg .b32 %m, %s, %h, %a0;\n.reg .b16 %lo, %hi;\n.reg .f32 %fl, %fh;\n"
             + _word_asm("$1", ["$2", "$3", "$4", "$5"], "%a0")
             + "mov.b32 {%lo, %hi}, %a0;\ncvt.f32.f16 %fl, %lo;\ncvt.f32.f16 %fh, %hi;\nadd.f32 $0, %fl, %fh;\n}")
_WORD_ASM_C = tl.constexpr(_WORD_ASM) if HAVE_TRITON else _WORD_ASM
_PACK_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;") if HAVE_TRITON else None  # $1 low half, $2 high


@triton.jit
def _code_f16(word, T: tl.constexpr):
    """Code T of each word as fp16 (its value times 2^-14), by the asm's bit placement, one code at a time."""
    c = (word >> (4 * T)) & 0xF
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _half_sums_f16(word, x0, x1, x2, x3):
    """The sum in fp16 of codes T..T+3 of each word times x0-x3 (fp16): the interpreter's form of one half."""
    return x0 * _code_f16(word, 0) + x1 * _code_f16(word, 1) + x2 * _code_f16(word, 2) + x3 * _code_f16(word, 3)


@triton.jit
def _x_at(x_row, kw, stride_xk, T: tl.constexpr, EVEN_K: tl.constexpr, k_ok):
    """x[8j + T] as float32, [1, words]."""
    if EVEN_K:
        v = tl.load(x_row + (8 * kw + T) * stride_xk)
    else:
        v = tl.load(x_row + (8 * kw + T) * stride_xk, mask=k_ok, other=0.0)
    return v.to(tl.float32)[None, :]


@triton.jit
def _x_pair(lo, hi, ASM: tl.constexpr):
    """Two float32 rows -> one fp16x2 per element (lo in the low half) as int32."""
    if ASM:
        return tl.inline_asm_elementwise(_PACK_ASM, "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)
    else:
        lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo_bits | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _x_word(x_row, kw, stride_xk, EVEN_K: tl.constexpr, k_ok, ASM: tl.constexpr):
    """x for each word j of the step: its 8 values times a power of two that brings their largest magnitude to
    [2^14, 2^15), as the asm's 4 fp16x2 registers (pair t: x[8j + t], x[8j + t + 4]), and the power's inverse."""
    x0 = _x_at(x_row, kw, stride_xk, 0, EVEN_K, k_ok)
    x1 = _x_at(x_row, kw, stride_xk, 1, EVEN_K, k_ok)
    x2 = _x_at(x_row, kw, stride_xk, 2, EVEN_K, k_ok)
    x3 = _x_at(x_row, kw, stride_xk, 3, EVEN_K, k_ok)
    x4 = _x_at(x_row, kw, stride_xk, 4, EVEN_K, k_ok)
    x5 = _x_at(x_row, kw, stride_xk, 5, EVEN_K, k_ok)
    x6 = _x_at(x_row, kw, stride_xk, 6, EVEN_K, k_ok)
    x7 = _x_at(x_row, kw, stride_xk, 7, EVEN_K, k_ok)
    peak = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                      tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    # 2^(d - 127) with d = 268 - peak's biased exponent, clamped so that 2^(127 - d) is a normal float32 too
    d = tl.minimum(tl.maximum(268 - ((peak.to(tl.int32, bitcast=True) >> 23) & 0xFF), 1), 253)
    up = (d << 23).to(tl.float32, bitcast=True)
    down = ((254 - d) << 23).to(tl.float32, bitcast=True)
    return (_x_pair(x0 * up, x4 * up, ASM), _x_pair(x1 * up, x5 * up, ASM), _x_pair(x2 * up, x6 * up, ASM),
            _x_pair(x3 * up, x7 * up, ASM), down)


@triton.jit
def block_scales(ptrs, mask, E8M0: tl.constexpr):
    """The scale bytes at ``ptrs`` as float32: E8M0 exponents (MXFP4) or E4M3 values (NVFP4). Where masked (the
    words there are 0 too): 0, or 2^-127 for E8M0."""
    raw = tl.load(ptrs, mask=mask, other=0)
    if E8M0:
        return tl.exp2(raw.to(tl.float32) - 127.0)
    return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def x_tile(x_ptr, rm, k0, k_end, stride_xm, stride_xk, m_ok, BLOCK_K: tl.constexpr):
    """x [rows rm, BLOCK_K from k0], zero past k_end and where m_ok is false (the dot forms' step)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=m_ok & (rk < k_end)[None, :],
                   other=0.0)


@triton.jit
def weight_words(w_ptr, rn, k0, k_end, stride_wn, stride_wk, n_ok, WORDS: tl.constexpr):
    """The int32 words (8 codes each) of weight rows rn from element k0, [rows, WORDS], zero past k_end."""
    kw = k0 // 8 + tl.arange(0, WORDS)
    return tl.load(w_ptr + rn[:, None] * stride_wn + kw[None, :] * stride_wk, mask=n_ok & (kw < k_end // 8)[None, :],
                   other=0)


@triton.jit
def _low(p):
    return (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _high(p):
    return ((p >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp4_gemv_h2_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ys, stride_ym,
                        stride_yn, E8M0: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr):
    """One row of x per program (grid axis 0: M), BLOCK_N rows of the weight, a share of K (axis 2). Per step:
    the words [BLOCK_N, BLOCK_K / 8], x' per word as 4 fp16x2 registers, each word's sum in fp16 halves to f32,
    the sums of a block times its scale into an fp32 accumulator per row and block, summed across threads once
    at the end. EVEN_K: every step is whole (no mask along K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    NW: tl.constexpr = BLOCK_K // 8  # words per step
    NB: tl.constexpr = BLOCK_K // BLOCK  # scale blocks per step
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, NW)
    rs = tl.arange(0, NB)
    n_ok = rn < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kw = k0 // 8 + rw
        k_ok = kw < k_end // 8
        w_ptrs = w_ptr + rn[:, None] * stride_wn + kw[None, :] * stride_wk
        if EVEN_K:
            words = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        else:
            words = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        p0, p1, p2, p3, down = _x_word(x_row, kw, stride_xk, EVEN_K, k_ok, ASM)
        if ASM:
            sums = tl.inline_asm_elementwise(_WORD_ASM_C, "=f,r,r,r,r,r", [words, p0, p1, p2, p3],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:  # the asm's arithmetic: each half's 4 products summed in fp16, then to f32
            sums = (_half_sums_f16(words, _low(p0), _low(p1), _low(p2), _low(p3)).to(tl.float32)
                    + _half_sums_f16(words >> 16, _high(p0), _high(p1), _high(p2), _high(p3)).to(tl.float32))
        sums = sums * down
        per_block = tl.sum(tl.reshape(sums, (BLOCK_N, NB, BLOCK // 8)), axis=2)
        sk = k0 // BLOCK + rs
        s_ok = n_ok[:, None] if EVEN_K else n_ok[:, None] & (sk < k_end // BLOCK)[None, :]
        acc += per_block * block_scales(s_ptr + rn[:, None] * stride_sn + sk[None, :] * stride_sk, s_ok, E8M0)
    out = tl.sum(acc, axis=1) * 16384.0 * tl.load(gs_ptr)  # the decode's 2^-14, the tensor scale (1: MXFP4)
    y_ptr += pid_k * stride_ys + pid_m * stride_ym
    tl.store(y_ptr + rn * stride_yn, out.to(y_ptr.dtype.element_ty), mask=n_ok)
