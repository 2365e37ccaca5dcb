"""The fp4 kernels' inline PTX run by a small emulator on the CPU, so that CI covers the asm text the GPU runs
(the interpreter runs the kernels' tl twins instead): the fp16-pair GEMV (kernels/_fp4_gemv.py) and the
bf16-pair decode of the MMA form (kernels/_fp4_mma.py). An instruction the emulator does
not know fails the test: a change of the asm must come with its emulation."""

import re

import numpy as np
import pytest

from kpt_compiler.kernels import _fp4_gemv as g
from kpt_compiler.kernels import _fp4_mma

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MASK = 0xFFFFFFFF


def _halves(u: int):
    return np.array([u & 0xFFFF, u >> 16], np.uint16).view(np.float16)


def _pack(lo, hi) -> int:
    b = np.array([lo, hi], np.float16).view(np.uint16)
    return int(b[0]) | (int(b[1]) << 16)


def _bf16(bits: int) -> float:
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


def _to_bf16(v: float) -> int:
    """Round to nearest even bf16 bits (through float32: a product of two bf16 values is exact there)."""
    b = int(np.array([v], np.float32).view(np.uint32)[0])
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def run(asm: str, regs: dict) -> dict:
    """Execute the asm's instructions over integer/float registers (fp16 arithmetic rounded as the GPU does:
    an FMA rounds once, exact in float64 for fp16 operands)."""
    r = dict(regs)

    def get(s):
        return r[s] if s in r else int(s, 0)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        a = [s.strip() for s in re.split(r",(?![^{]*})", rest)]
        if op == "shr.b32":
            r[a[0]] = get(a[1]) >> int(a[2])
        elif op == "shl.b32":
            r[a[0]] = (get(a[1]) << int(a[2])) & MASK
        elif op == "fma.rn.bf16x2":  # one rounding of x * y + z (exact in float64 for bf16 operands)
            x, y, z = get(a[1]), get(a[2]), get(a[3])
            r[a[0]] = (_to_bf16(_bf16(x & 0xFFFF) * _bf16(y & 0xFFFF) + _bf16(z & 0xFFFF))
                       | _to_bf16(_bf16(x >> 16) * _bf16(y >> 16) + _bf16(z >> 16)) << 16)
        elif op == "mov.b32" and a[0].startswith("{"):
            lo, hi = (s.strip() for s in a[0].strip("{}").split(","))
            r[lo], r[hi] = get(a[1]) & 0xFFFF, get(a[1]) >> 16
        elif op == "mov.b32":
            r[a[0]] = get(a[1])
        elif op == "mul.lo.u32":
            r[a[0]] = (get(a[1]) * get(a[2])) & MASK
        elif op == "and.b32":
            r[a[0]] = get(a[1]) & get(a[2])
        elif op == "or.b32":
            r[a[0]] = get(a[1]) | get(a[2])
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            x, y = _halves(get(a[1])), _halves(get(a[2]))
            c = _halves(get(a[3])) if op.startswith("fma") else np.zeros(2, np.float16)
            r[a[0]] = _pack(*(np.float16(float(x[i]) * float(y[i]) + float(c[i])) for i in range(2)))
        elif op == "cvt.f32.f16":
            r[a[0]] = np.float32(np.array([get(a[1])], np.uint16).view(np.float16)[0])
        elif op == "add.f32":
            r[a[0]] = np.float32(r[a[1]] + r[a[2]])
        elif op == "cvt.rn.f16x2.f32":  # d = {a (upper half), b (lower half)}
            r[a[0]] = _pack(np.float16(get(a[2])), np.float16(get(a[1])))
        else:
            raise AssertionError(f"the emulator does not know {line!r}: emulate it here with the asm's change")
    return r


def word_sum(word: int, x: np.ndarray) -> float:
    """The asm's f32 sum of a word's 8 codes times x (8 fp16 values), x's pair t = (x[t], x[t + 4])."""
    regs = {"$1": word, **{f"${2 + t}": _pack(x[t], x[t + 4]) for t in range(4)}}
    return float(run(g._WORD_ASM, regs)["$0"])


def code_value(c: int) -> float:
    return (-1.0 if c & 8 else 1.0) * E2M1[c & 7]


@pytest.mark.parametrize("t", range(8))
def test_every_code_at_every_nibble_decodes_to_its_value_times_2_to_the_minus_14(t):
    rng = np.random.default_rng(t)
    for c in range(16):
        for _ in range(4):  # the other nibbles random: they must not leak in
            word = int(rng.integers(0, 2**32)) & ~(0xF << (4 * t)) | (c << (4 * t))
            x = np.zeros(8, np.float16)
            x[t] = 1.0
            assert word_sum(word, x) == code_value(c) * 2.0**-14, (t, c, hex(word))


def test_random_words_sum_as_float64_does_to_fp16_rounding():
    rng = np.random.default_rng(0)
    for _ in range(300):
        word = int(rng.integers(0, 2**32))
        # x' as the kernel makes it: bf16 values scaled so that the largest is in [2^14, 2^15)
        x = rng.standard_normal(8) * 10.0 ** rng.uniform(-3, 3, 8)
        x = x / np.abs(x).max() * 2.0**14 * rng.uniform(1.0, 1.99)
        x = np.float16(x)
        terms = [code_value((word >> (4 * t)) & 0xF) * 2.0**-14 * float(x[t]) for t in range(8)]
        got = word_sum(word, x)
        assert abs(got - sum(terms)) <= 4 * 2.0**-11 * sum(abs(v) for v in terms) + 2.0**-24, (hex(word), x)


def test_the_pack_puts_its_first_operand_in_the_low_half():
    text = getattr(g._PACK_ASM, "value", g._PACK_ASM)
    if text is None:
        pytest.skip("no triton here: the pack's asm is not defined")
    u = run(text, {"$1": np.float32(1.5), "$2": np.float32(-3.0)})["$0"]
    assert list(_halves(u)) == [1.5, -3.0]


def mma_word(word: int, scale_bits: int) -> list:
    """The MMA form's decode of one word with a block scale (bf16 bits in both halves): its 8 values."""
    out = run(_fp4_mma._WORD_ASM, {"$8": word, "$9": scale_bits | (scale_bits << 16)})
    return [_bf16(out[f"${t}"]) for t in range(8)]


@pytest.mark.parametrize("t", range(8))
def test_the_bf16_pair_decode_gives_each_code_times_its_scale_at_every_nibble(t):
    # s' carries 2^126 (the codes' bf16 bits are their values times 2^-126): the values come out times s' / 2^126
    rng = np.random.default_rng(10 + t)
    # E4M3 scales 2^-9, 1.625 and 448 times 2^118; E8M0 bytes 10 and 136: 2^(E - 9)
    for scale in (2.0**-9 * 2**118, 1.625 * 2**118, 448.0 * 2**118, 2.0**(10 - 9), 2.0**(136 - 9)):
        bits = _to_bf16(scale)
        assert _bf16(bits) == scale
        for c in range(16):
            word = int(rng.integers(0, 2**32)) & ~(0xF << (4 * t)) | (c << (4 * t))
            assert mma_word(word, bits)[t] == code_value(c) * 2.0**-126 * scale, (t, c, scale, hex(word))


def test_a_scale_past_bf16s_top_gives_inf_not_a_finite_value():
    inf_bits = 0x7F80  # what the kernel builds for an E8M0 byte past _fp4_mma.E8M0_MAX (exponent field capped)
    values = mma_word(0x76543217, inf_bits)  # codes 7, 1, 2, ..., 7: no zero
    assert all(np.isinf(v) for v in values)


def test_zero_codes_keep_their_sign_through_the_fma_with_minus_zero():
    values = mma_word(0x00000008, _to_bf16(2.0**118))  # code 8 (-0) at nibble 0, +0 elsewhere
    assert [np.signbit(v) for v in values] == [True] + [False] * 7 and not any(values)
