"""4-bit floating-point weights (issue 18): the E2M1 values, their packing, and two block-scaled formats.

E2M1 holds sign, 2 exponent bits and 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Code c (0-15): bit 3 the
sign, bits 0-2 the magnitude's index in that list. Two codes per byte, the element at the even index in the
low nibble, as ``torch.float4_e2m1fn_x2`` and cuBLAS lay them out, so a packed weight can be viewed as that
dtype and handed to a GPU with fp4 tensor cores.

Formats (both published; weights along K, the reduction dim of ``x @ w.T``, in blocks):
- NVFP4 (the default): blocks of 16, each with an E4M3 scale, and one fp32 scale per tensor that brings the
  block scales into E4M3's range. Finer blocks and fractional scales: the more accurate of the two.
  4.5 bits per weight.
- MXFP4 (OCP): blocks of 32, each with a power-of-two E8M0 scale (a biased exponent byte). 4.25 bits per weight.

Rounding is to nearest, ties to the even code, saturating at 6 (as the hardware conversions do).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 22  # quantize() encodes this many weights at a time (s15: whole 4096x14336 weights at once
# held gigabytes of temporaries; the fp4 pass's decode model peaked at 11.3 GiB against 4.2 GiB in bf16)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9  # its smallest subnormal
_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclasses.dataclass(frozen=True)
class Fp4Format:
    name: str
    block: int  # weights per scale, along K
    scale_dtype: str  # "e4m3" (with a per-tensor fp32 scale) or "e8m0"


NVFP4 = Fp4Format("nvfp4", 16, "e4m3")
MXFP4 = Fp4Format("mxfp4", 32, "e8m0")
FORMATS = {f.name: f for f in (NVFP4, MXFP4)}


@dataclasses.dataclass
class Fp4Weight:
    """A weight [N, K] in fp4: ``packed`` uint8 [N, K // 2]; ``scales`` [N, K // block] (float8_e4m3fn for
    NVFP4, uint8 biased exponents for MXFP4); ``global_scale`` fp32 scalar (NVFP4; 1 for MXFP4)."""

    format: Fp4Format
    packed: Tensor
    scales: Tensor
    global_scale: Tensor
    shape: tuple[int, int]

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * self.scales.element_size() + 4


def encode_e2m1(x: Tensor) -> Tensor:
    """E2M1 codes (uint8, 0-15) of ``x`` (any float dtype): nearest value, ties to the even code, saturating."""
    x = x.float()
    mag = x.abs().clamp(max=E2M1_MAX)
    edges = torch.tensor(_MIDPOINTS, device=x.device)
    low = torch.bucketize(mag, edges, right=False)  # at a midpoint: the smaller neighbour
    high = torch.bucketize(mag, edges, right=True)  # at a midpoint: the larger
    # the neighbours differ by one code at a midpoint: keep the even one
    code = torch.where(low == high, low, torch.where(low % 2 == 0, low, high))
    sign = (x < 0) | ((x == 0) & torch.signbit(x))
    return (code | (sign.to(torch.int64) << 3)).to(torch.uint8)


def decode_e2m1(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    table = torch.tensor(_VALUES, dtype=dtype, device=codes.device)
    c = codes.to(torch.int64)
    value = table[c & 7]
    return torch.where((c & 8) != 0, -value, value)


def pack(codes: Tensor) -> Tensor:
    """[..., K] codes -> [..., K // 2] bytes, the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packs two values per byte: the last dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: Tensor) -> Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantize(w: Tensor, fmt: Fp4Format = NVFP4) -> Fp4Weight:
    """``w`` [N, K] in fp4 blocks along K. K must be a multiple of the block."""
    if w.dim() != 2:
        raise ValueError(f"fp4 quantizes 2-D weights [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % fmt.block:
        raise ValueError(f"{fmt.name} scales blocks of {fmt.block} along K: K={k} is not a multiple of {fmt.block}")
    blocks = w.reshape(n, k // fmt.block, fmt.block)
    amax = blocks.abs().amax(-1).float()  # [N, K // block]
    if fmt.scale_dtype == "e4m3":
        # the per-tensor scale puts the largest block scale at E4M3's top
        global_scale = (amax.max() / (E2M1_MAX * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
        block_scale = (amax / E2M1_MAX / global_scale).clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
        scale = block_scale.float() * global_scale
        stored = block_scale
    else:
        # OCP: 2^(floor(log2(amax)) - 2), E2M1's largest exponent being 2; an all-zero block gets 2^-127
        exp = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2
        exp = exp.clamp(-127, 127)
        scale = torch.exp2(exp)
        stored = (exp + 127).to(torch.uint8)
        global_scale = torch.ones((), device=w.device)
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    rows = max(1, CHUNK_ELEMENTS // k)  # a chunk of rows at a time: encoding holds several 8-byte temporaries
    for r in range(0, n, rows):
        packed[r:r + rows] = pack(encode_e2m1(blocks[r:r + rows] / scale[r:r + rows, :, None]).reshape(-1, k))
    return Fp4Weight(fmt, packed, stored, global_scale.float().reshape(()), (n, k))


def block_scales(q: Fp4Weight) -> Tensor:
    """The fp32 scale each block's values are multiplied by, [N, K // block]."""
    if q.format.scale_dtype == "e4m3":
        return q.scales.float() * q.global_scale
    return torch.exp2(q.scales.float() - 127)


def dequantize(q: Fp4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    n, k = q.shape
    values = decode_e2m1(unpack(q.packed)).reshape(n, k // q.format.block, q.format.block)
    return (values * block_scales(q)[..., None]).reshape(n, k).to(dtype)
