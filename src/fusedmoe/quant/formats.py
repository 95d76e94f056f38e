"""Number formats of the quantized schemes: vectorised encode/decode pairs in plain PyTorch.

    fp8 e4m3   q = cast(clamp(x / s, +-448))                 x ~ q * s
    int8/int4  q = clamp(round_half_even(x / s), qmin, qmax)  x ~ q * s
    e2m1       4-bit code, round to nearest on the grid, packed two per byte (low nibble = even k)
    e8m0       uint8 exponent s, value 2^(s - 127): the power-of-two scale of the MX formats
    nvfp4      e2m1 code * (e4m3 scale per 16) * fp32 global scale
    mxfp4      e2m1 code * e8m0 scale per 32;   mxfp8   e4m3 * e8m0 scale per 32
Every function takes values along the last dim ([..., K]) and works on any device. Scales are
multipliers (dequantize = code * scale), computed in float32.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT_RANGE = {8: (-128, 127), 4: (-8, 7)}  # bits -> (qmin, qmax), symmetric two's complement
E2M1_MAX = 6.0
# Value of each 4-bit E2M1 code: bits 0-2 index the magnitudes, bit 3 is the sign.
E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
E8M0_BIAS = 127
NVFP4_GROUP = 16
MX_GROUP = 32


def group_view(x: torch.Tensor, size: int) -> torch.Tensor:
    """View x [..., K] as [..., K / size, size]; K must be a multiple of size."""
    k = x.shape[-1]
    if k % size:
        raise ValueError(f"the last dim ({k}) must be a multiple of the group size {size}")
    return x.unflatten(-1, (k // size, size))


def absmax_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """s = amax / fmt_max, so that x / s spans the format; all-zero groups get s = 1 (0 / s = 0).

    A NaN or Inf amax gives a NaN or Inf scale: the group dequantizes to NaN, as unquantized
    arithmetic would make it (s = 1 instead turned int8 NaN codes into arbitrary finite values).
    """
    amax = amax.float()
    return torch.where(amax == 0, torch.ones_like(amax), _divide(amax, fmt_max))


def _divide(x: torch.Tensor, constant: float) -> torch.Tensor:
    # CUDA divides by a host scalar as a multiply by its reciprocal, which can be one ulp off the
    # CPU's quotient; dividing by a device tensor keeps scales bit-identical across devices.
    return x / torch.full((), constant, dtype=x.dtype, device=x.device)


# FP8 e4m3 -------------------------------------------------------------------------------------
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """q = float8_e4m3fn(clamp(x / scale, -448, 448)), round to nearest even."""
    # Clamp first: x / scale may overshoot 448 by an fp32 rounding, and CUDA's cast does not
    # saturate (500 -> NaN on an H200 with torch 2.11, where the CPU gives 448).
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x = float32(q) * scale."""
    return q.float() * scale


# Symmetric integers ---------------------------------------------------------------------------
def int_quantize(x: torch.Tensor, scale: torch.Tensor | float, bits: int) -> torch.Tensor:
    """q = clamp(round(x / scale), qmin, qmax) as int8 (one value per element, even for 4 bits).

    Rounds half to even (torch.round). bits = 8: [-128, 127]; bits = 4: [-8, 7].
    """
    qmin, qmax = INT_RANGE[bits]
    return torch.round(x.float() / scale).clamp(qmin, qmax).to(torch.int8)


def int_dequantize(q: torch.Tensor, scale: torch.Tensor | float,
                   zero: torch.Tensor | float | None = None) -> torch.Tensor:
    """x = float32(q) * scale, or (float32(q) - zero) * scale with a zero point."""
    return q.float() * scale if zero is None else (q.float() - zero) * scale


def int4_asym_quantize(x_g: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of groups x_g [..., G, g] -> (codes int8 [..., G, g], scale [..., G],
    zero [..., G]), both in `scale_dtype`.

    Unsigned AWQ math shifted by 8 so codes share symmetric int4's storage: s = (max - min) / 15
    over the group's range widened to hold 0, z = round(-min / s) in [0, 15], q = clamp(round(x / s)
    + z, 0, 15); returned as codes q - 8 and zero z - 8 in [-8, 7], so x ~ s * (code - zero) and a
    0 weight is exact. The codes and z are rounded against the stored (scale_dtype) scale; an
    all-zero group gets s = 1, z = 0 (codes 0).
    """
    lo = x_g.float().amin(-1).clamp(max=0)
    hi = x_g.float().amax(-1).clamp(min=0)
    span = hi - lo
    scale = torch.where(span == 0, torch.ones_like(span), _divide(span, 15.0)).to(scale_dtype)
    s = scale.float()
    z = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(x_g.float() / s.unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15)
    return (q - 8).to(torch.int8), scale, (z - 8).to(scale_dtype)


# Nibble packing -------------------------------------------------------------------------------
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] 4-bit codes -> uint8 [..., K / 2]: byte j = codes[2j] | codes[2j + 1] << 4."""
    k = codes.shape[-1]
    if k % 2:
        raise ValueError(f"cannot pack {k} 4-bit values two per byte: the last dim must be even")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> uint8 codes [..., K]; the low nibble is the even element."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., K] in [-8, 7] -> uint8 [..., K / 2] of two's-complement nibbles, low = even k."""
    return pack_nibbles((q & 0xF).to(torch.uint8))


def int4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> int8 [..., K] in [-8, 7] (nibbles >= 8 are negative)."""
    nibbles = unpack_nibbles(packed).to(torch.int8)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


# E2M1 (FP4) -----------------------------------------------------------------------------------
# Midpoints between neighbouring magnitudes, split by the parity of the code below them: a value
# exactly on a midpoint rounds to the even code, so it stays below midpoints that follow an even
# code (0.25, 1.25, 2.5, 5) and crosses those that follow an odd one (0.75, 1.75, 3.5).
_E2M1_MIDPOINTS_AFTER_EVEN = (0.25, 1.25, 2.5, 5.0)
_E2M1_MIDPOINTS_AFTER_ODD = (0.75, 1.75, 3.5)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 code of the nearest E2M1 value (ties to the even code, saturating at +-6).

    Bit 3 is the sign of x, so negative values that round to zero give code 8 (-0).
    """
    x = x.float()
    mag = x.abs()
    after_even = torch.tensor(_E2M1_MIDPOINTS_AFTER_EVEN, device=x.device)
    after_odd = torch.tensor(_E2M1_MIDPOINTS_AFTER_ODD, device=x.device)
    # Code = number of midpoints passed: strictly past the even ones, at-or-past the odd ones.
    code = torch.bucketize(mag, after_even) + torch.bucketize(mag, after_odd, right=True)
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each 4-bit code (bit 3 = sign, bits 0-2 index 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


# E8M0 (MX scales) -----------------------------------------------------------------------------
def e8m0_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """uint8 biased exponent s of the smallest 2^(s - 127) with amax / 2^(s - 127) <= fmt_max.

    Rounding the scale up keeps every value in range, as triton_kernels' default MX downcast does;
    OCP MX's floor(log2(amax)) - emax is one smaller whenever amax's mantissa exceeds
    fmt_max / 2^emax (1.5 for e2m1, 1.75 for e4m3) and then saturates the group's largest values.
    Clamped to [2^-127, 2^127]; all-zero groups (and amax / fmt_max underflowing to 0) get s = 0.
    """
    amax = amax.float()
    mant, exp = torch.frexp(amax / fmt_max)  # amax / fmt_max = mant * 2^exp, mant in [0.5, 1)
    e = exp - (mant == 0.5).int()  # ceil(log2(amax / fmt_max)); exact powers of two stay put
    e = torch.where(mant == 0, -E8M0_BIAS, e)
    # amax / fmt_max is rounded: step up where that rounding hid an overshoot.
    e = torch.where(amax > fmt_max * torch.exp2(e.float()), e + 1, e)
    return (e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """float32 2^(s - 127) for uint8 s; s = 255 is NaN (OCP MX)."""
    # Built from the fp32 bit pattern so that it is exact on every device: exponent field s for
    # s >= 1, the subnormal 2^-127 (mantissa bit 22) for s = 0.
    s = scale.to(torch.int32)
    bits = torch.where(s == 0, 1 << 22, s << 23)
    bits = torch.where(s == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


# Block-scaled FP4 / FP8 -----------------------------------------------------------------------
def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """global = amax / (448 * 6), so the largest block scale is e4m3's 448 (1 where amax = 0)."""
    return absmax_scale(amax, FP8_MAX * E2M1_MAX)


def nvfp4_quantize(
    x: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed e2m1 uint8 [..., K / 2], block scale float8_e4m3fn [..., K / 16]).

    block = e4m3(amax_16 / 6 / global);  code = e2m1(x / (block * global)).
    global_scale broadcasts against [..., K / 16]. A block whose scale rounds to 0 encodes zeros.
    """
    x_g = group_view(x.float(), NVFP4_GROUP)
    block = _divide(x_g.abs().amax(-1), E2M1_MAX) / global_scale
    block = block.clamp(max=FP8_MAX).to(FP8_DTYPE)
    # Encode against the e4m3-rounded scale that dequantization will use, not the exact one.
    scale = block.float() * global_scale
    nonzero = scale > 0
    codes = e2m1_encode(x_g / torch.where(nonzero, scale, 1.0).unsqueeze(-1))
    codes = torch.where(nonzero.unsqueeze(-1), codes, 0)
    return pack_nibbles(codes.flatten(-2)), block


def nvfp4_dequantize(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor | float
) -> torch.Tensor:
    """float32 [..., K] = e2m1(code) * block_scale * global_scale."""
    values = group_view(e2m1_decode(unpack_nibbles(packed)), NVFP4_GROUP)
    return (values * (block_scale.float() * global_scale).unsqueeze(-1)).flatten(-2)


def mxfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed e2m1 uint8 [..., K / 2], e8m0 scale uint8 [..., K / 32])."""
    x_g = group_view(x.float(), MX_GROUP)
    scale = e8m0_scale(x_g.abs().amax(-1), E2M1_MAX)
    codes = e2m1_encode(x_g / e8m0_decode(scale).unsqueeze(-1))
    return pack_nibbles(codes.flatten(-2)), scale


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] = e2m1(code) * 2^(scale - 127), one scale per 32 values."""
    values = group_view(e2m1_decode(unpack_nibbles(packed)), MX_GROUP)
    return (values * e8m0_decode(scale).unsqueeze(-1)).flatten(-2)


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8_e4m3fn [..., K], e8m0 scale uint8 [..., K / 32])."""
    x_g = group_view(x.float(), MX_GROUP)
    scale = e8m0_scale(x_g.abs().amax(-1), FP8_MAX)
    return fp8_quantize(x_g, e8m0_decode(scale).unsqueeze(-1)).flatten(-2), scale


def mxfp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] = float32(q) * 2^(scale - 127), one scale per 32 values."""
    return (group_view(q.float(), MX_GROUP) * e8m0_decode(scale).unsqueeze(-1)).flatten(-2)
