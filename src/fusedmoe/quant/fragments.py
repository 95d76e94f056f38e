"""mxfp4 weights in wgmma fragment order: the storage the Triton weight-only kernels read fastest.

The checkpoint layout (codes [E, N, K/2], byte j = k 2j | 2j+1 << 4; e8m0 scales [E, N, K/32])
makes the kernels decode a [BLOCK_K/2, BLOCK_N] tile in its load layout and then move it through
shared memory into the tensor-core operand layout, every K step. This layout stores each 16 x 64
block of W (a "fragment": 512 bytes) in the order of Hopper wgmma's register operand A (16-bit
m64nNk16: lane l = 4g + c of a warp holds rows g and g + 8 and, of each 16-wide k chunk j,
k = 2c, 2c + 1, 2c + 8, 2c + 9), so a warp loads whole fragments, one 16-byte vector per lane, and
the decoded values are already where the dot wants them (`kernels._w4_frag_tile`, the product
computed swapped: W's tile as A, the activations' rows as B).

Within a lane's 16 bytes, word j (k chunk j) holds the lane's four A registers of that chunk,
(rh, kh) = 00, 01, 10, 11 (row g + 8rh, k 16j + 8kh + 2c + u), each register's two codes (u = 0, 1)
in the word's two 16-bit halves at the same bit places: a code's sign / E1 / E0 / M bits at
15 / 8 / 7 / 6 of its half for register 00, at those minus 3 for 01, minus 6 for 10, and at
14 / 13 / 11 / 10 for 11. Then `w & 0x81C081C0` (after a shift for 01 and 10, two shifts and a
select for 11) is a bf16 pair of value * 2^-126, and one bf16x2 multiply by 2^126 times the
scale finishes it: 15 instructions for 8 weights where the checkpoint layout's decode takes 26
(benchmarks/bench_w4_fragments.py).

Scales go the same way, [E, N/16, K/64, 32]: lane group g reads its four (rh, 32-group) scales as
one word. Their 4-D shape is what marks the layout: `is_fragments(scale)`. The payload keeps its
shape [E, N, K/2] (the same bytes, reordered), so shape checks, views and expert slicing by the
first dim still hold; anything that reads the codes by position (dequantization, other backends)
goes through `from_fragments` first.

Conditions (`fragments_reason`): N a multiple of 16 and K of 64 (whole fragments), and e8m0 scale
codes <= 128 (scales <= 2, so 2^126 * scale is a finite bf16 and the decode multiplies once).
"""

from __future__ import annotations

import torch

from fusedmoe.quant.formats import unpack_nibbles

FRAG_N, FRAG_K = 16, 64  # the W block one fragment holds
FRAG_BYTES = FRAG_N * FRAG_K // 2
FRAG_SCALES = FRAG_N * FRAG_K // 32
MAX_SCALE_CODE = 128  # e8m0 2^1: 2^126 * scale is finite in bf16


def _place(code: torch.Tensor, reg: int) -> torch.Tensor:
    """int32 bits of 4-bit e2m1 codes in one 16-bit half, for register (rh, kh) = reg (00..11)."""
    code = code.to(torch.int32)
    if reg == 3:  # sign 14, E1 13, E0 M 11 10
        return ((code & 12) << 11) | ((code & 3) << 10)
    return (((code & 8) << 12) | ((code & 7) << 6)) >> (3 * reg)  # sign 15, E1 E0 M 8 7 6, then >> 3r


def _unplace(bits: torch.Tensor, reg: int) -> torch.Tensor:
    """Inverse of `_place`: the codes from one half's bits (int32)."""
    if reg == 3:
        return ((bits >> 11) & 12) | ((bits >> 10) & 3)
    bits = bits << (3 * reg)
    return ((bits >> 12) & 8) | ((bits >> 6) & 7)


def fragments_reason(codes: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Why one mxfp4 weight (codes [E, N, K/2], e8m0 scales [E, N, K/32]) cannot take the
    fragment layout, or None. Reads the scales' max: one device-to-host sync (load time)."""
    if codes.dim() != 3 or scales.dim() != 3 or codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return f"codes {tuple(codes.shape)} {codes.dtype} / scales {tuple(scales.shape)} {scales.dtype}"
    n, k = codes.shape[1], 2 * codes.shape[2]
    if n % FRAG_N or k % FRAG_K:
        return f"[{n}, {k}] is not made of whole {FRAG_N} x {FRAG_K} fragments"
    if scales.numel() and int(scales.max()) > MAX_SCALE_CODE:
        return f"an e8m0 scale code above {MAX_SCALE_CODE} (a scale above 2)"
    return None


def is_fragments(scale: torch.Tensor | None) -> bool:
    """Whether an mxfp4 weight's scales (and so its codes) are in the fragment layout."""
    return scale is not None and scale.dim() == 4


def to_fragments(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [E, N, K/2] in fragment order, scales [E, N/16, K/64, 32]) from the checkpoint
    layout; `fragments_reason` must be None."""
    E, N, half = codes.shape
    K = 2 * half
    # value (n, k): n = 16 n16 + 8 rh + g, k = 64 k64 + 16 j + 8 kh + 2 c + u
    v = unpack_nibbles(codes).view(E, N // 16, 2, 8, K // 64, 4, 2, 4, 2)  # e n16 rh g k64 j kh c u
    v = v.permute(0, 1, 4, 3, 7, 5, 8, 2, 6)  # e n16 k64 g c j u | rh kh
    half_bits = _place(v[..., 0, 0], 0) | _place(v[..., 0, 1], 1) | _place(v[..., 1, 0], 2) | _place(v[..., 1, 1], 3)
    words = half_bits[..., 0] | (half_bits[..., 1] << 16)  # e n16 k64 g c j
    frag = words.contiguous().view(torch.uint8).view(E, N, half)
    s = scales.view(E, N // 16, 2, 8, K // 64, 2)  # e n16 rh g k64 j2
    s = s.permute(0, 1, 4, 3, 2, 5).reshape(E, N // 16, K // 64, FRAG_SCALES)  # e n16 k64 | g rh j2
    return frag, s.contiguous()


def from_fragments(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `to_fragments`: the checkpoint layout's codes [E, N, K/2] and scales [E, N, K/32]."""
    E, N, half = codes.shape
    K = 2 * half
    words = codes.contiguous().view(E, N // 16, K // 64, 8, 4, 4, 4).view(torch.int32)[..., 0]  # e n16 k64 g c j
    halves = torch.stack((words & 0xFFFF, (words >> 16) & 0xFFFF), -1)  # ... u
    regs = torch.stack([_unplace(halves, r) for r in range(4)], -1).view(*halves.shape, 2, 2)  # ... u rh kh
    v = regs.permute(0, 1, 7, 3, 2, 5, 8, 4, 6)  # e n16 rh g k64 j kh c u
    v = v.reshape(E, N, K // 2, 2).to(torch.uint8)
    packed = v[..., 0] | (v[..., 1] << 4)
    s = scales.view(E, N // 16, K // 64, 8, 2, 2).permute(0, 1, 4, 3, 2, 5)  # e n16 rh g k64 j2
    return packed.contiguous(), s.reshape(E, N, K // 32).contiguous()
