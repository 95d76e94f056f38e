"""4-bit weights in wgmma fragment order: the storage the Triton weight-only kernels read fastest.

Formats: mxfp4 (e2m1 codes, e8m0 scale per 32), nvfp4 (e2m1, e4m3 scale per 16, fp32 global
scale per expert) and int4 (two's complement codes, float scale per 32, 64 or 128).

The checkpoint layout (codes [E, N, K/2], byte j = k 2j | 2j+1 << 4; scales [E, N, K/group])
makes the kernels decode a [BLOCK_K/2, BLOCK_N] tile in its load layout and then move it through
shared memory into the tensor-core operand layout, every K step. This layout stores each 16 x 64
block of W (a "fragment": 512 bytes) in the order of Hopper wgmma's register operand A (16-bit
m64nNk16: lane l = 4g + c of a warp holds rows g and g + 8 and, of each 16-wide k chunk j,
k = 2c, 2c + 1, 2c + 8, 2c + 9), so a warp loads whole fragments, one 16-byte vector per lane, and
the decoded values are already where the dot wants them (`kernels._w4_frag_tile`, the product
computed swapped: W's tile as A, the activations' rows as B).

Within a lane's 16 bytes, word j (k chunk j) holds the lane's four A registers of that chunk,
r = (rh, kh) = 00, 01, 10, 11 (row g + 8rh, k 16j + 8kh + 2c + u), each register's two codes
(u = 0, 1) in the word's two 16-bit halves at the same bit places:
  e2m1 (mxfp4, nvfp4): a code's sign / E1 / E0 / M bits at 15 / 8 / 7 / 6 of its half for
      register 00, at those minus 3 for 01, minus 6 for 10, and at 14 / 13 / 11 / 10 for 11.
      `w & 0x81C081C0` (after a shift for 01 and 10, two shifts and a select for 11) is a bf16
      pair of value * 2^-126, and one bf16x2 multiply by the row's multiplier finishes it: 15
      instructions for 8 weights where the checkpoint layout's decode takes 26
      (benchmarks/bench_w4_fragments.py). Multipliers: mxfp4 2^126 * scale; nvfp4 s * 2^118
      (2^126 * s overflows bf16 for s >= 4), so the tile holds value * s * 2^-8, exact, and the
      kernels put 2^8 with the global scale on the accumulator.
  int4: register r's codes at bits 4r of each half, so `(w >> 4r) & 0x000F000F ^ 0x43084308`
      (one lop3) is the bf16 pair of 136 + q; x * 1 - 136 (exact) and the scale follow.

Scales go the same way, [E, N/16, K/GF, 16 * GF / group] with GF = max(group, 64) (one chunk per
fragment, per two for int4 g128): lane group g reads its (rh, group-in-chunk) scales together
(mxfp4 [.., 32], nvfp4 [.., 64], int4 g32 [.., 32], g64 and g128 [.., 16]). Their values and
dtype are the checkpoint's, only reordered, except nvfp4's: each e4m3 scale becomes a byte code
whose bf16 multiplier the kernels make with a shift and an add (`nv_scale_codes`; uint8, 0 to 448
only: negative or NaN scales keep the checkpoint layout). Each row block's run of K/GF chunks lies
`scale_run` chunks after the last (by default a run of a power of two bytes >= 1 KB gets a line
of padding: FUSEDMOE_TRITON_W4_SCALE_PAD), so the tensor may be a view with
stride(1) > K/GF * 16 * GF / group; the kernels take that stride, so a contiguous copy (which
`.to(device)` of the view makes) is as correct, only slower on those shapes. Their 4-D shape is
what marks the layout:
`is_fragments(scale)`. The payload keeps its shape [E, N, K/2] (the same bytes, reordered), so
shape checks, views and expert slicing by the first dim still hold; anything that reads the codes
by position (dequantization, other backends) goes through `from_fragments` first.

Conditions (`fragments_reason`): N a multiple of 16 and K of 64 (whole fragments), and for mxfp4
e8m0 scale codes <= 128 (scales <= 2, so 2^126 * scale is a finite bf16 and the decode multiplies
once).
"""

from __future__ import annotations

import functools

import torch

from fusedmoe.quant.formats import unpack_nibbles

FRAG_N, FRAG_K = 16, 64  # the W block one fragment holds
FRAG_BYTES = FRAG_N * FRAG_K // 2
FRAG_SCALES = FRAG_N * FRAG_K // 32  # mxfp4's scales per fragment
MAX_SCALE_CODE = 128  # e8m0 2^1: 2^126 * scale is finite in bf16
FORMATS = ("mxfp4", "nvfp4", "int4")
_SCALE_DTYPES = {"mxfp4": (torch.uint8,), "nvfp4": (torch.float8_e4m3fn,),
                 "int4": (torch.float32, torch.bfloat16, torch.float16)}


def scale_chunk(group: int) -> int:
    """K width of one fragment-scale chunk: max(group, 64)."""
    return max(group, FRAG_K)


SCALE_LINE = 128  # bytes: the cache line a padded scale run stays aligned to (the default padding)
SCALE_PAD_UNIT = 32  # bytes: padding is a multiple of this, rounded up to whole chunks
SCALE_PAD_FROM = 1024  # bytes: runs of a power of two from this long get one line of padding


def scale_run(chunks: int, chunk_bytes: int, pad: int = SCALE_LINE) -> int:
    """Scale chunks (of `chunk_bytes` each) a row block's run of `chunks` spans in storage.

    Runs a power of two >= 1 KB apart put every row block's k-th chunk at one address modulo the
    run; all programs of a GEMM stream their tiles' scales at about the same k, and those loads
    queue on the same memory channels. So a run of a power of two bytes >= 1 KB gets `pad` bytes of
    padding (a multiple of 32, rounded up to whole chunks; 0: none; by default one 128-byte line:
    the runs then lie an odd number of lines apart). H100, GEMM1 alone, nvfp4 16 x 64 x 64
    (results/2026-11-28_h100_869188f_scale_stride.txt): Qwen3-235B (4 KB runs) M=64 194 -> 139 us,
    Qwen3-30B (2 KB) M=16 110 -> 89; whole calls 1-5% faster there, and on an H200 up to 9%
    (mxfp4 Qwen3-30B, 1 KB, M=16; results/2026-11-28_h200_1036438_scale_pad.txt). Runs of other
    lengths are left alone: DeepSeek-V3's 7 KB (nvfp4) and 3.5 KB (mxfp4) runs, padded, were 1.5-2.4%
    slower whole-call on the H200, GEMM1 alone 3-6% on the H100. A chunk's worth of padding (64
    bytes, nvfp4) was slower: the 128-byte scale reads of 128-wide K steps then straddle two lines.
    Shorter runs too (DeepSeek-V3's w2, 4 chunks, would grow 50%)."""
    if pad < 0 or pad % SCALE_PAD_UNIT:
        raise ValueError(f"scale run padding {pad} bytes: expected a non-negative multiple of {SCALE_PAD_UNIT}")
    run = chunks * chunk_bytes
    if pad and run >= SCALE_PAD_FROM and run & (run - 1) == 0:
        return chunks + -(-pad // chunk_bytes)
    return chunks


def scale_run_bytes(k: int, group: int, itemsize: int, pad: int = SCALE_LINE) -> tuple[int, int]:
    """(bytes of a row block's scale run over K = k, bytes between two runs in storage): what
    `to_fragments` stores for scales of `itemsize` bytes in groups of `group`."""
    chunks, chunk_bytes = k // scale_chunk(group), FRAG_N * scale_chunk(group) // group * itemsize
    return chunks * chunk_bytes, scale_run(chunks, chunk_bytes, pad) * chunk_bytes


def fragment_scale_shape(num_experts: int, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    """[E, N/16, K/GF, 16 * GF / group] (GF = `scale_chunk(group)`): the fragment layout's scales."""
    gf = scale_chunk(group)
    return (num_experts, n // FRAG_N, k // gf, FRAG_N * gf // group)


def _place(code: torch.Tensor, reg: int, fmt: str) -> torch.Tensor:
    """int32 bits of 4-bit codes in one 16-bit half, for register (rh, kh) = reg (00..11)."""
    code = code.to(torch.int32)
    if fmt == "int4":
        return code << (4 * reg)
    if reg == 3:  # sign 14, E1 13, E0 M 11 10
        return ((code & 12) << 11) | ((code & 3) << 10)
    return (((code & 8) << 12) | ((code & 7) << 6)) >> (3 * reg)  # sign 15, E1 E0 M 8 7 6, then >> 3r


def _unplace(bits: torch.Tensor, reg: int, fmt: str) -> torch.Tensor:
    """Inverse of `_place`: the codes from one half's bits (int32)."""
    if fmt == "int4":
        return (bits >> (4 * reg)) & 15
    if reg == 3:
        return ((bits >> 11) & 12) | ((bits >> 10) & 3)
    bits = bits << (3 * reg)
    return ((bits >> 12) & 8) | ((bits >> 6) & 7)


# nvfp4's scales in the fragment layout: one byte code c per e4m3 scale s (>= 0, not NaN) whose
# 16-bit pattern (c << 4) + NV_CODE_BASE is the bf16 of s * 2^118, -0 for s = 0. The kernels'
# multiplier is then a shift and an add (`kernels._frag_multiplier`) where an e4m3 -> fp32 ->
# bf16 conversion took about a sixth of the K step's instructions (sm90 SASS: 584 -> 492 at a
# 128-wide step). 2^109 (the smallest subnormal's) has the pattern 0x7600, and 0x7600 + 160 * 16
# is 0x8000, -0, so a zero scale is exact without a select, and no code carries past 16 bits:
# the kernels make two multipliers with one 32-bit shift-add (`kernels.W4_PTX_MULT_NV`). The tiles
# hold value * s * 2^-8 and the kernels put 2^8 on the accumulator. Normal scales: c = byte + 16;
# subnormal ones (m * 2^-9): 0, 8, 12, 16, 18, 20, 22; zero: 160.
NV_CODE_BASE = 0x7600


@functools.cache
def nv_scale_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """(code of each e4m3 byte 0..127 (127: NaN, refused, coded 255), e4m3 byte of each code)."""
    byte = torch.arange(128, dtype=torch.uint8)
    s = byte.view(torch.float8_e4m3fn).double()
    target = torch.where(s == 0, -0.0, s * 2.0**118).bfloat16().view(torch.int16).int() & 0xFFFF
    code = target - NV_CODE_BASE
    assert bool((code[:127] % 16 == 0).all()) and int(code[:127].min()) >= 0 and int(code[:127].max()) <= 160 * 16
    code = (code // 16).to(torch.uint8)
    code[127] = 255
    back = torch.zeros(256, dtype=torch.uint8)
    back[code[:127].long()] = byte[:127]
    assert len(set(code[:127].tolist())) == 127
    return code, back


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"the fragment layout holds {FORMATS} weights, not {fmt!r}")


def whole_fragments(n: int, k: int) -> bool:
    """Whether an [n, k] weight is made of whole FRAG_N x FRAG_K fragments (the shape half of
    `fragments_reason`)."""
    return n % FRAG_N == 0 and k % FRAG_K == 0


def fragments_reason(codes: torch.Tensor, scales: torch.Tensor, fmt: str = "mxfp4") -> str | None:
    """Why one 4-bit weight (codes [E, N, K/2], scales [E, N, K/group]) cannot take the fragment
    layout, or None. mxfp4 reads the scales' max: one device-to-host sync (load time)."""
    _check_format(fmt)
    if codes.dim() != 3 or scales.dim() != 3 or codes.dtype != torch.uint8 or scales.dtype not in _SCALE_DTYPES[fmt]:
        return f"codes {tuple(codes.shape)} {codes.dtype} / scales {tuple(scales.shape)} {scales.dtype}"
    n, k = codes.shape[1], 2 * codes.shape[2]
    if not whole_fragments(n, k):
        return f"[{n}, {k}] is not made of whole {FRAG_N} x {FRAG_K} fragments"
    groups = scales.shape[2]
    group = k // groups if groups and k % groups == 0 else 0
    if scales.shape[:2] != codes.shape[:2] or group not in (16, 32, 64, 128) or k % scale_chunk(group):
        return f"scales {tuple(scales.shape)} are not one per group of 16-128 k of [{n}, {k}]"
    if fmt == "mxfp4" and scales.numel() and int(scales.max()) > MAX_SCALE_CODE:
        return f"an e8m0 scale code above {MAX_SCALE_CODE} (a scale above 2)"
    if fmt == "nvfp4" and scales.numel() and int(scales.view(torch.uint8).max()) >= 0x7F:
        return "a negative or NaN e4m3 scale (the fragment scale codes take 0 to 448)"
    return None


def is_fragments(scale: torch.Tensor | None) -> bool:
    """Whether a 4-bit weight's scales (and so its codes) are in the fragment layout."""
    return scale is not None and scale.dim() == 4


def fragment_group(codes: torch.Tensor, scale: torch.Tensor) -> int:
    """The scale group of fragment-layout codes [E, N, K/2] and scales [E, N/16, K/GF, S]."""
    gf = 2 * codes.shape[2] // scale.shape[2]
    return FRAG_N * gf // scale.shape[3]


def to_fragments(codes: torch.Tensor, scales: torch.Tensor, fmt: str = "mxfp4",
                 scale_pad: int = SCALE_LINE) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [E, N, K/2] in fragment order, scales `fragment_scale_shape`, their row-block runs
    padded by `scale_run(..., scale_pad)`) from the checkpoint layout (scales in any strides);
    `fragments_reason` must be None."""
    _check_format(fmt)
    E, N, half = codes.shape
    K = 2 * half
    # value (n, k): n = 16 n16 + 8 rh + g, k = 64 k64 + 16 j + 8 kh + 2 c + u
    v = unpack_nibbles(codes).view(E, N // 16, 2, 8, K // 64, 4, 2, 4, 2)  # e n16 rh g k64 j kh c u
    v = v.permute(0, 1, 4, 3, 7, 5, 8, 2, 6)  # e n16 k64 g c j u | rh kh
    half_bits = (_place(v[..., 0, 0], 0, fmt) | _place(v[..., 0, 1], 1, fmt) | _place(v[..., 1, 0], 2, fmt)
                 | _place(v[..., 1, 1], 3, fmt))
    words = half_bits[..., 0] | (half_bits[..., 1] << 16)  # e n16 k64 g c j
    frag = words.contiguous().view(torch.uint8).view(E, N, half)
    group = K // scales.shape[2]
    gf = scale_chunk(group)
    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales  # CPU copies of e4m3
    if fmt == "nvfp4":  # e4m3 bytes -> multiplier codes (NV_CODE_BASE), uint8 from here on
        raw = nv_scale_codes()[0].to(raw.device)[raw.long()]
    s = raw.reshape(E, N // 16, 2, 8, K // gf, gf // group)  # e n16 rh g kc jg
    shape = fragment_scale_shape(E, N, K, group)
    run = scale_run(shape[2], shape[3] * s.element_size(), scale_pad)
    store = s.new_zeros(shape[:2] + (run, shape[3]))  # the padding is never read
    store[:, :, :shape[2]] = s.permute(0, 1, 4, 3, 2, 5).reshape(shape)  # e n16 kc | g rh jg
    s = store[:, :, :shape[2]]
    return frag, (s.view(scales.dtype) if raw is not scales and fmt != "nvfp4" else s)


def from_fragments(codes: torch.Tensor, scales: torch.Tensor, fmt: str = "mxfp4") -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `to_fragments`: the checkpoint layout's codes [E, N, K/2] and scales [E, N, K/group]."""
    _check_format(fmt)
    E, N, half = codes.shape
    K = 2 * half
    words = codes.contiguous().view(E, N // 16, K // 64, 8, 4, 4, 4).view(torch.int32)[..., 0]  # e n16 k64 g c j
    halves = torch.stack((words & 0xFFFF, (words >> 16) & 0xFFFF), -1)  # ... u
    regs = torch.stack([_unplace(halves, r, fmt) for r in range(4)], -1).view(*halves.shape, 2, 2)  # ... u rh kh
    v = regs.permute(0, 1, 7, 3, 2, 5, 8, 4, 6)  # e n16 rh g k64 j kh c u
    v = v.reshape(E, N, K // 2, 2).to(torch.uint8)
    packed = v[..., 0] | (v[..., 1] << 4)
    group = fragment_group(codes, scales)
    gf = scale_chunk(group)
    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    if fmt == "nvfp4":  # multiplier codes -> e4m3 bytes
        if scales.dtype != torch.uint8:
            raise ValueError(f"nvfp4 fragment scales are multiplier codes (uint8, to_fragments), not {scales.dtype}")
        raw = nv_scale_codes()[1].to(raw.device)[raw.long()].view(torch.float8_e4m3fn)
    s = raw.reshape(E, N // 16, K // gf, 8, 2, gf // group).permute(0, 1, 4, 3, 2, 5)  # e n16 rh g kc jg
    s = s.reshape(E, N, K // group).contiguous()
    if fmt == "nvfp4":
        return packed.contiguous(), s
    return packed.contiguous(), (s.view(scales.dtype) if raw is not scales else s)
