"""fp4_linear's tensor-core form for bf16 activations (``_fp4_mma_kernel``, ``decode=3``): the weight decoded
straight to scaled bf16 pairs and fed to the MMA as its first operand, from registers.

Why: the dot form (fp4_linear._fp4_linear_kernel) decodes to fp32, multiplies by the scale in fp32 and packs
to bf16: about 8 instructions a code in Triton 3.6's sm_90 loop, and its weight is tl.dot's second operand,
which a Hopper wgmma takes only from shared memory (Triton picks the Ampere MMA instead). Here
``acc[n, m] = sum_k w[n, k] x[m, k]``: the decoded weight is wgmma's A operand (registers), x its B (shared
memory), and each pair of codes costs two shifts, three logic operations and one bf16x2 FMA that applies
the block scale (an FMA with -0 rather than a multiply: ``mul.bf16x2`` needs sm_90, ``fma.bf16x2`` sm_80).
Compiled for sm_90 on the CPU (benchmarks/diag_fp4_sass.py, triton 3.6): 6.1-6.6 instructions a code
against decode=2's 7.7-8.2 at the same tiles; measured on an H200, 7-14% faster at M=2-16 (bench_fp4 --sweep,
s28), less than the count says: ncu finds both forms latency-bound at one wave of 3.6 warps a scheduler
(benchmarks/diag_fp4_ncu.py; results/nvidia-h200/2026-11-29-s28-*).

The numbers (exact wherever a weight fits; the reference is fmt.dequantize):
- A code's bf16 bits: sign at bit 15, its 3 magnitude bits at 6-8 of each 16-bit half. As bf16 that is its
  E2M1 value times 2^-126 (the 0.5 code is bf16's subnormal 2^-127; bf16 arithmetic keeps subnormals). Pair t
  of a word (nibbles t and t + 4, elements 8j + t and 8j + t + 4) takes one shift per field.
- The scale pair s' multiplies both halves: NVFP4: the E4M3 block scale times 2^(126 - 8) (at most 448 * 2^118,
  below bf16's top); the weight becomes e2m1 * e4m3 * 2^-8, which has at most 6 significant bits and lies
  within [2^-18, 11]: exact. The tensor scale and the 2^8 go onto the fp32 sums at the end. MXFP4: the E8M0
  exponent E gives s' = 2^(E - 127 + 126 - 8), built from E's bits (exponent field E + 118) and capped at inf:
  the weight is e2m1 * 2^(E - 127 - 8), exact and normal for block scales 2^-117 to 2^9 (weights quantized
  from magnitudes below 4096); above that the products are inf or NaN, never a quiet wrong value. So MXFP4
  takes this form only when asked (``decode=3``); by default it stays on decode=2, which takes any scale (on
  the H200 the two were within 3% for MXFP4, s28). NVFP4 takes any weight here. The 2^8 goes onto the sums.
  (A larger shift would widen the top and move the weights' products 2^8 further towards fp32's subnormals,
  which the MMA need not keep.)
- The MMA sums bf16 products in fp32, as cuBLAS does for a bf16 weight.
On the CPU (Triton's interpreter, no inline asm) the same bits are built in fp32, which has bf16's exponent,
and multiplied there (exact, as on the GPU), and the dot runs in fp32 (the interpreter's bf16 dot is wrong in
triton 3.8 and 3.9).
"""

from __future__ import annotations

from ._fp4_gemv import weight_words, x_tile
from ._launch import HAVE_TRITON, tl, triton

# log2 of the factor taken off the weights (E4M3 scales reach 448 < 2^9; E8M0: the range above)
SHIFT = tl.constexpr(8) if HAVE_TRITON else 8
E8M0_MAX = 127 + 9  # the largest E8M0 byte (block scale 2^9) this form takes (the tests probe one past it)

# Pair t (0-3): magnitude bits 4t..4t+2 -> 6-8 and sign bit 4t+3 -> 15 in both halves, times the scale pair.
_SHIFTS = {3: ("shr.b32 %m, $8, 6;", "mov.b32 %s, $8;"), 2: ("shr.b32 %m, $8, 2;", "shl.b32 %s, $8, 4;"),
           1: ("shl.b32 %m, $8, 2;", "shl.b32 %s, $8, 8;"), 0: ("shl.b32 %m, $8, 6;", "shl.b32 %s, $8, 12;")}


def _word_asm() -> str:
    """$0-$7: element t of the word as scaled bf16; $8: the word; $9: the block's scale as bf16 in both halves."""
    lines = ["{", ".reg .b32 %m, %s, %h, %z;", "mov.b32 %z, 0x80008000;"]  # -0 in both halves: x * s - 0 = x * s
    for t in (3, 2, 1, 0):
        mag, sign = _SHIFTS[t]
        lines += [mag, sign, "and.b32 %m, %m, 0x01C001C0;", "and.b32 %s, %s, 0x80008000;", "or.b32 %h, %m, %s;",
                  "fma.rn.bf16x2 %h, %h, $9, %z;", f"mov.b32 {{${t}, ${t + 4}}}, %h;"]
    return "\n".join(lines + ["}"])


_WORD_ASM = _word_asm()
_WORD_ASM_C = tl.constexpr(_WORD_ASM) if HAVE_TRITON else _WORD_ASM


@triton.jit
def _scale_bits(raw, E8M0: tl.constexpr):
    """Scale bytes (int32) -> the bf16 bits of s' (above), int32 in 0..0xFFFF."""
    if E8M0:
        return tl.minimum(raw + 118, 255) << 7  # 2^(E - 9): exponent field E + 118 (255: inf)
    s = raw.to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * 2.0**118
    return s.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _code_scaled(word, T: tl.constexpr, scale):
    """Element T of each word times the scale (fp32 holding s'), as bf16: the asm's bits, in fp32."""
    c = (word >> (4 * T)) & 0xF
    return ((((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True) * scale).to(tl.bfloat16)


@triton.jit
def _decode(words, s2, ASM: tl.constexpr):
    """Words [R, W] and their scale pairs -> the 8 scaled bf16 values of each word (element 8j + t at t)."""
    if ASM:
        return tl.inline_asm_elementwise(_WORD_ASM_C, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, s2],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    s = (s2 << 16).to(tl.float32, bitcast=True)
    return (_code_scaled(words, 0, s), _code_scaled(words, 1, s), _code_scaled(words, 2, s),
            _code_scaled(words, 3, s), _code_scaled(words, 4, s), _code_scaled(words, 5, s),
            _code_scaled(words, 6, s), _code_scaled(words, 7, s))


@triton.jit
def _fp4_mma_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ys, stride_ym,
                    stride_yn, E8M0: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Programs over (M tiles, N tiles, shares of K). Per step: x [BLOCK_M, BLOCK_K], the words
    [BLOCK_N, BLOCK_K / 8] and their blocks' scales, decoded to w' [BLOCK_N, BLOCK_K] in bf16 and
    acc [BLOCK_N, BLOCK_M] += w' x^T in fp32; at the end the factor taken off the weights goes back on."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    NW: tl.constexpr = BLOCK_K // 8
    NB: tl.constexpr = BLOCK_K // BLOCK
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, NB)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    for k0 in range(k_start, k_end, BLOCK_K):
        x = x_tile(x_ptr, rm, k0, k_end, stride_xm, stride_xk, m_ok, BLOCK_K)
        words = weight_words(w_ptr, rn, k0, k_end, stride_wn, stride_wk, n_ok, NW)
        sk = k0 // BLOCK + rs
        raw = tl.load(s_ptr + rn[:, None] * stride_sn + sk[None, :] * stride_sk,
                      mask=n_ok & (sk < k_end // BLOCK)[None, :], other=0).to(tl.int32)
        bits = _scale_bits(raw, E8M0)
        s2 = tl.reshape(tl.broadcast_to((bits | (bits << 16))[:, :, None], (BLOCK_N, NB, BLOCK // 8)), (BLOCK_N, NW))
        v0, v1, v2, v3, v4, v5, v6, v7 = _decode(words, s2, ASM)
        joined = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        w = tl.reshape(joined, (BLOCK_N, BLOCK_K))  # [.., c, b, a] holds element 4c + 2b + a of a word
        if ASM:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
    acc = acc * (2.0**SHIFT * tl.load(gs_ptr))
    y_ptr += pid_k * stride_ys
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rm[None, :] < M) & n_ok)
