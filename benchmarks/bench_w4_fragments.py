"""4-bit weights stored in wgmma fragment order, decoded in registers as the dot's left operand

    python benchmarks/bench_w4_fragments.py [--shapes gpt-oss-gate-up,...] [--rows 16,64]
                                            [--variants frag,plain] [--ir DIR] [--smoke]
                                            [--format mxfp4|nvfp4|int4]

One expert-grouped GEMM, y[e] = x[e] @ W[e]^T with W [E, N, K] mxfp4 (e2m1 codes, an e8m0 scale
per 32 along K) and x [E, rows, K] bf16, the shape of a weight-only MoE GEMM whose experts each
hold `rows` tokens. Each program owns (expert, N tile); the product is computed swapped (the
decoded weight tile is wgmma's register operand A, x's rows its shared-memory operand B).

Variants (same codes and scales, same decode asm as the library's `_w4_ptx_decode`):
  plain   the library's storage: codes [E, N, K/2] (byte = k 2j | 2j+1 << 4), scales [E, N, K/32].
          The decoded [BLOCK_N, BLOCK_K] tile is in the load's layout, so Triton converts it to
          the dot operand's (through shared memory) every K step.
  frag    codes stored per 16 x 64 fragment of W (512 bytes: lane l = 4g + c of a warp holds 16
          bytes), in the order of wgmma's register operand A (m64nNk16, 16-bit: a lane holds rows
          g and g + 8, k 2c, 2c + 1 and those + 8 of each k16 chunk j, two consecutive k per
          register). Byte 4j + 2rh + u of lane (g, c): its low nibble is (row 8rh + g,
          k 16j + 2c + u), its high nibble the same row at k + 8. The decode's registers pair the
          low (high) nibbles of two adjacent bytes, so each is one A register as it comes out (k,
          k + 1), and both nibbles of a byte share its row's scale group (32, or 16 for nvfp4). A
          warp loads whole fragments, one 16-byte vector per lane; after the decode a reshape and
          permute within each thread's registers give the [BLOCK_N, BLOCK_K] tile in the dot
          operand's layout. Scales: [E, N/16, K/64, 32], lane group g reads its four (rh, 32-group)
          scales as one word.

  frag2   the same fragment order, the codes bit-placed for a cheaper decode: each 32-bit word (a
          lane's k16 chunk j) holds the lane's four A registers of that chunk, (rh, kh) = 00, 01,
          10, 11, each register's two codes (u = 0, 1) in the two 16-bit halves at the same
          places. A code's sign / E1 / E0 / M bits sit at 15 / 8 / 7 / 6 of its half for 00 (so
          `and 0x81C081C0` is the bf16 of value * 2^-126), at those minus 3 for 01 and minus 6 for
          10 (a shift, then that and), and at 14 / 13 / 11 / 10 for 11 (three shifts, a select,
          an and, an or). Then one bf16x2 multiply by the row's scale times 2^126 (e8m0 codes up
          to 128, scales <= 2; `frag2n` multiplies by 2^126 and the scale apart): 15 instructions
          for 8 weights where the library's e2m1 decode takes 26.

  nvfrag_bf16 / nvfrag_cvt (`--format nvfp4`: e2m1 codes, e4m3 block scales per 16, an fp32
          global scale per expert): the same fragment order and decode, scales per (row, k16
          chunk) [E, N/16, K/64, 64], lane group g's eight (j, rh) together. 2^126 * s overflows
          bf16 for s >= 4, so the multiplier is s * 2^118 (at most 448 * 2^118 < 2^127), giving
          value * s * 2^-8 (a normal bf16, exact), and 2^8 goes onto the accumulator with the
          global scale. bf16: the multipliers stored as bf16 by the host (+1/16 byte a weight);
          cvt: stored as e4m3 bytes, converted in the kernel (fp8 -> fp32 cast, * 2^118, -> bf16).

  i4frag (`--format int4`: int4 g32, two's complement codes, bf16 group scales): the fragment
          order with its own bit placement, register r = 2rh + kh's code u at bits 4r + 16u of
          the word, so `(w >> 4r) & 0x000F000F ^ 0x43084308` (one lop3) is the bf16 of 136 + q;
          then x * 1 - 136 (exact) and the scale: 15 instructions for 8 weights. Multipliers per
          (row, k16 chunk) as bf16, as nvfrag_bf16.

The question it answers: does the fragment order remove the per-step layout conversion, and how
many TB/s of 4-bit weights does each variant stream (H200 roof ~4.2-4.8)? `--ir DIR` writes each
variant's TTGIR and SASS instruction counts for the first shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fusedmoe.backends.triton.kernels import W4_MXFP4, W4_PTX_FRAG, W4_PTX_I4FRAG, _w4_ptx_decode  # noqa: E402
from fusedmoe.bench import time_rotated  # noqa: E402
from fusedmoe.quant.formats import (  # noqa: E402
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    unpack_nibbles,
)
from fusedmoe.quant.fragments import to_fragments as lib_to_fragments  # noqa: E402
from fusedmoe.quant.weights import dequantize_weight, quantize_weight  # noqa: E402

SHAPES = {  # name: (E, N, K): gate/up (N = 2I, K = H) and down (N = H, K = I) of the presets
    "gpt-oss-gate-up": (32, 5760, 2880),
    "gpt-oss-down": (32, 2880, 2880),
    "qwen3-gate-up": (64, 1536, 2048),
    "qwen3-down": (64, 2048, 768),
    "deepseek-gate-up": (64, 512, 7168),
    "mixtral-gate-up": (4, 28672, 4096),
}


# storage ---------------------------------------------------------------------------------------
def to_fragments(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [E, N, K/2], scales [E, N, K/32] -> [E, N/16, K/64, 512], [E, N/16, K/64, 32]."""
    E, N, KH = codes.shape
    K = 2 * KH
    assert N % 16 == 0 and K % 64 == 0, (N, K)
    # value (n, k): n = 16 n16 + 8 rh + g, k = 64 k64 + 16 j + 8 kh + 2 c + u
    v = unpack_nibbles(codes).view(E, N // 16, 2, 8, K // 64, 4, 2, 4, 2)  # e, n16, rh, g, k64, j, kh, c, u
    v = v.permute(0, 1, 4, 3, 7, 5, 2, 8, 6).reshape(E, N // 16, K // 64, 512, 2)  # ..., g, c, j, rh, u | kh
    frag = v[..., 0] | (v[..., 1] << 4)
    sc = scales.view(E, N // 16, 2, 8, K // 64, 2)  # e, n16, rh, g, k64, j2
    sc = sc.permute(0, 1, 4, 3, 2, 5)  # e, n16, k64, g, rh, j2
    return frag.contiguous(), sc.reshape(E, N // 16, K // 64, 32).contiguous()


def to_fragments2(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """frag2's storage: the library's fragment layout (`fusedmoe.quant.fragments`, which this
    prototype led to), codes as bytes [E, N/16, K/64, 512], scales [E, N/16, K/64, 32]."""
    E, N, half = codes.shape
    frag, sc = lib_to_fragments(codes, scales)
    return frag.view(E, N // 16, 2 * half // 64, 512), sc


# frag2's decode is the library's (kernels.W4_PTX_FRAG); frag2n multiplies by 2^126 and the scale apart
W4_FRAG2_TEXT = W4_PTX_FRAG.value
W4_FRAG2N_TEXT = W4_FRAG2_TEXT.replace("mul.rn.bf16x2 $0, $0, $5;", """.reg .b32 k;
mov.b32 k, 0x7E807E80;
mul.rn.bf16x2 $0, $0, k;
mul.rn.bf16x2 $1, $1, k;
mul.rn.bf16x2 $2, $2, k;
mul.rn.bf16x2 $3, $3, k;
mul.rn.bf16x2 $0, $0, $5;""")
W4_FRAG2_PTX = tl.constexpr(W4_FRAG2_TEXT)
W4_FRAG2N_PTX = tl.constexpr(W4_FRAG2N_TEXT)


W4_I4FRAG_PTX = W4_PTX_I4FRAG  # the library's int4 fragment decode (kernels.W4_PTX_I4FRAG), which this led to


@triton.jit
def _e8m0_bf16(s):
    """e8m0 codes (uint8) -> bf16 2^(s - 127) (s = 0 -> 2^-127, which bf16 holds as a subnormal)."""
    v = s.to(tl.int16) << 7
    v = tl.where(s == 0, 64, v)
    return v.to(tl.bfloat16, bitcast=True)


# Scale modes of frag2_gemm_kernel: e8m0 per (row, 32) as 2^126 * s (mxfp4, folded: frag2) or
# 2^(s - 127) times 2^126 apart (frag2n); bf16 multipliers per (row, k16) (nvfrag_bf16, i4frag);
# e4m3 bytes per (row, k16) made s * 2^118 in the kernel (nvfrag_cvt)
S_E8M0, S_E8M0_UNFOLDED, S_BF16, S_E4M3 = (tl.constexpr(i) for i in range(4))
TWO_118 = tl.constexpr(2.0**118)


@triton.jit
def _frag_decode(b, s, SCALES: tl.constexpr, INT4: tl.constexpr):
    """One word per 4 bytes of `b` decoded and times the multipliers `s`: (rh = 0, rh = 1)
    registers, element 4j + 2kh + u of a lane."""
    if INT4:
        r0, r1 = tl.inline_asm_elementwise(W4_I4FRAG_PTX, "=r,=r,=r,=r,r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    elif SCALES == S_E8M0_UNFOLDED:
        r0, r1 = tl.inline_asm_elementwise(W4_FRAG2N_PTX, "=r,=r,=r,=r,r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        r0, r1 = tl.inline_asm_elementwise(W4_FRAG2_PTX, "=r,=r,=r,=r,r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return r0, r1


@triton.jit
def _frag_multipliers(ws, k0, F: tl.constexpr, SCALES: tl.constexpr):
    """[F, 512] bf16 multipliers of one K step (element 4j + 2rh + dup of a lane), from the
    fragment scales: e8m0 [.., 32] (g, rh, j2), or [.., 64] (g, j, rh) bf16 / e4m3."""
    lane_g = tl.arange(0, 32) // 4
    if SCALES == S_E8M0 or SCALES == S_E8M0_UNFOLDED:  # noqa: SIM109 (constexprs)
        sc = tl.load(ws + (k0 // 64) * 32 + lane_g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :])
        if SCALES == S_E8M0:  # 2^(e - 1) = 2^126 * 2^(e - 127), finite for e <= 128
            sc = ((sc.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)
        else:
            sc = _e8m0_bf16(sc)
        sc = tl.permute(tl.reshape(sc, (F, 32, 2, 2)), (0, 1, 3, 2))  # [F, 32, j2, rh]
        sc = tl.broadcast_to(tl.reshape(sc, (F, 32, 2, 1, 2, 1)), (F, 32, 2, 2, 2, 2))  # j2, j1, rh, dup
    else:
        sc = tl.load(ws + (k0 // 64) * 64 + lane_g[None, :, None] * 8 + tl.arange(0, 8)[None, None, :])
        if SCALES == S_E4M3:  # e4m3 bytes -> s * 2^118 (exact: <= 448 * 2^118, subnormal codes included)
            sc = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * TWO_118).to(tl.bfloat16)
        sc = tl.broadcast_to(tl.reshape(sc, (F, 32, 4, 2, 1)), (F, 32, 4, 2, 2))  # j, rh, dup
    return tl.reshape(sc, (F, 512))


def to_int4_fragments(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [E, N, K/2] (two's complement nibbles, low = even k) in i4frag's order:
    bytes [E, N/16, K/64, 512], word j of lane 4g + c holding register r = 2rh + kh's code u
    (row 8rh + g, k 16j + 8kh + 2c + u) at bits 4r + 16u."""
    E, N, half = codes.shape
    K = 2 * half
    v = unpack_nibbles(codes).to(torch.int32).view(E, N // 16, 2, 8, K // 64, 4, 2, 4, 2)  # e n16 rh g k64 j kh c u
    v = v.permute(0, 1, 4, 3, 7, 5, 8, 2, 6).reshape(E, N // 16, K // 64, 8, 4, 4, 2, 4)  # ... g c j | u, r
    shifts = (4 * torch.arange(4, device=codes.device)).view(1, 4) + 16 * torch.arange(2, device=codes.device).view(2, 1)
    words = (v << shifts).sum((-1, -2), dtype=torch.int64).to(torch.int32)  # disjoint bits: the sum is an or
    return words.contiguous().view(torch.uint8).reshape(E, N // 16, K // 64, 512)


def row_k16_multipliers(scale: torch.Tensor, group: int) -> torch.Tensor:
    """Per-(row, group) scales [E, N, K/group] as bf16 multipliers per (row, k16 chunk) in
    fragment order [E, N/16, K/64, 64] (lane group g's (j, rh) together)."""
    E, N, G = scale.shape
    k16 = scale.repeat_interleave(group // 16, dim=2)  # [E, N, K/16]
    sc = k16.view(E, N // 16, 2, 8, k16.shape[2] // 4, 4).permute(0, 1, 4, 3, 5, 2)
    return sc.reshape(E, N // 16, k16.shape[2] // 4, 64).to(torch.bfloat16).contiguous()


@triton.jit
def frag2_gemm_kernel(x_ptr, wq_ptr, ws_ptr, gs_ptr, y_ptr, N, K, stride_xe, stride_xm, stride_we, stride_wn16,
                      stride_se, stride_sn16, stride_ye, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SCALES: tl.constexpr, INT4: tl.constexpr):
    """The bit-placed fragment GEMM (frag2, frag2n, nvfrag_*, i4frag; module docstring): the
    weight tile is the dot's register operand; nvfp4's multipliers leave 2^8 and the global
    scale (gs_ptr[e]) for the accumulator."""
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    K64: tl.constexpr = BLOCK_K // 64
    NB16: tl.constexpr = BLOCK_N // 16
    F: tl.constexpr = K64 * NB16
    f = tl.arange(0, F)
    k64 = f // NB16
    n16 = pid_n * NB16 + f % NB16
    wq = (wq_ptr + e.to(tl.int64) * stride_we + n16[:, None].to(tl.int64) * stride_wn16 + k64[:, None] * 512
          + tl.arange(0, 512)[None, :])
    SW: tl.constexpr = 32 if SCALES == S_E8M0 or SCALES == S_E8M0_UNFOLDED else 64  # noqa: SIM109 (scales a fragment)
    ws = ws_ptr + e.to(tl.int64) * stride_se + n16[:, None, None].to(tl.int64) * stride_sn16 + k64[:, None, None] * SW
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    xp = x_ptr + e.to(tl.int64) * stride_xe + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b = tl.load(wq + (k0 // 64) * 512)  # [F, 512]
        r0, r1 = _frag_decode(b, _frag_multipliers(ws, k0, F, SCALES), SCALES, INT4)  # rh = 0, 1; byte 4j + 2kh + u
        v = tl.reshape(tl.join(r0, r1), (K64, NB16, 8, 4, 4, 2, 2, 2))  # k64, n16, g, c, j, kh, u, rh
        w = tl.reshape(tl.permute(v, (1, 7, 2, 0, 4, 5, 3, 6)), (BLOCK_N, BLOCK_K))  # n16 rh g | k64 j kh c u
        xa = tl.load(xp + k0)
        acc = tl.dot(w, tl.trans(xa), acc)
    if (SCALES == S_BF16 or SCALES == S_E4M3) and not INT4:  # noqa: SIM109 (constexprs)
        acc = acc * (tl.load(gs_ptr + e) * 256.0)  # the global scale, and the 2^8 the multipliers left out
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    yp = y_ptr + e.to(tl.int64) * stride_ye + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(yp, acc.to(tl.bfloat16))


def nv_fragment_scales(block: torch.Tensor, as_bf16: bool) -> torch.Tensor:
    """nvfp4 block scales [E, N, K/16] (e4m3) in fragment order [E, N/16, K/64, 64] (lane group g's
    (j, rh) together): as bf16 multipliers s * 2^118, or as the e4m3 bytes."""
    E, N, G = block.shape
    sc = block.view(torch.uint8).view(E, N // 16, 2, 8, G // 4, 4)  # e n16 rh g k64 j
    sc = sc.permute(0, 1, 4, 3, 5, 2).reshape(E, N // 16, G // 4, 64).contiguous()  # e n16 k64 | g j rh
    if as_bf16:
        return (sc.view(torch.float8_e4m3fn).float() * 2.0**118).to(torch.bfloat16)
    return sc


@triton.jit
def frag_gemm_kernel(x_ptr, wq_ptr, ws_ptr, y_ptr, N, K, stride_xe, stride_xm, stride_we, stride_wn16,
                     stride_se, stride_sn16, stride_ye, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    K64: tl.constexpr = BLOCK_K // 64
    NB16: tl.constexpr = BLOCK_N // 16
    F: tl.constexpr = K64 * NB16
    f = tl.arange(0, F)
    k64 = f // NB16
    n16 = pid_n * NB16 + f % NB16
    wq = (wq_ptr + e.to(tl.int64) * stride_we + n16[:, None].to(tl.int64) * stride_wn16 + k64[:, None] * 512
          + tl.arange(0, 512)[None, :])
    lane_g = tl.arange(0, 32) // 4
    ws = (ws_ptr + e.to(tl.int64) * stride_se + n16[:, None, None].to(tl.int64) * stride_sn16
          + k64[:, None, None] * 32 + lane_g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :])
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    xp = x_ptr + e.to(tl.int64) * stride_xe + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b = tl.load(wq + (k0 // 64) * 512)  # [F, 512]
        s = _e8m0_bf16(tl.load(ws + (k0 // 64) * 32))  # [F, 32, 4]: (rh, j2)
        s = tl.permute(tl.reshape(s, (F, 32, 2, 2)), (0, 1, 3, 2))  # [F, 32, j2, rh]
        s = tl.broadcast_to(tl.reshape(s, (F, 32, 2, 1, 2, 1)), (F, 32, 2, 2, 2, 2))  # j2, j1, rh, u
        s = tl.reshape(s, (F, 512))
        lo, hi = _w4_ptx_decode(b, s, W4_MXFP4)  # k and k + 8 of each byte
        v = tl.reshape(tl.join(lo, hi), (K64, NB16, 8, 4, 4, 2, 2, 2))  # k64, n16, g, c, j, rh, u, kh
        w = tl.reshape(tl.permute(v, (1, 5, 2, 0, 4, 7, 3, 6)), (BLOCK_N, BLOCK_K))  # n16 rh g | k64 j kh c u
        xa = tl.load(xp + k0)
        acc = tl.dot(w, tl.trans(xa), acc)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    yp = y_ptr + e.to(tl.int64) * stride_ye + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(yp, acc.to(tl.bfloat16))


@triton.jit
def plain_gemm_kernel(x_ptr, wq_ptr, ws_ptr, y_ptr, N, K, stride_xe, stride_xm, stride_we, stride_wn,
                      stride_se, stride_sn, stride_ye, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)
    wq = wq_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_j[None, :]
    groups = tl.arange(0, BLOCK_K // 32)
    ws = ws_ptr + e.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + groups[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    xp = x_ptr + e.to(tl.int64) * stride_xe + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b = tl.load(wq + k0 // 2)  # [BLOCK_N, BLOCK_K / 2]
        s = _e8m0_bf16(tl.load(ws + k0 // 32))  # [BLOCK_N, BLOCK_K / 32]
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
        lo, hi = _w4_ptx_decode(b, s, W4_MXFP4)
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
        xa = tl.load(xp + k0)
        acc = tl.dot(w, tl.trans(xa), acc)
    yp = y_ptr + e.to(tl.int64) * stride_ye + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(yp, acc.to(tl.bfloat16))


class Problem:
    def __init__(self, E, N, K, rows, copies, device, fmt="mxfp4"):
        self.E, self.N, self.K, self.rows, self.fmt = E, N, K, rows, fmt
        self.x = torch.randn(E, rows, K, device=device).to(torch.bfloat16)
        self.copies = []
        if fmt == "int4":
            for _ in range(copies):
                q, scale, *_ = quantize_weight(torch.randn(E, N, K, device=device), "int4_w4a16_g32")
                scale = scale.to(torch.bfloat16)  # as the bench and the library run int4
                self.copies.append(dict(i4frag=(to_int4_fragments(q), row_k16_multipliers(scale, 32),
                                                torch.ones(E, device=device)), plain=(q, scale)))
            q, scale = self.copies[0]["plain"]
            w = dequantize_weight(q, scale.float(), "int4_w4a16_g32").view(E, N, K)
            self.ref = torch.bmm(self.x.float(), w.transpose(1, 2))
            self.y = torch.empty(E, rows, N, device=device, dtype=torch.bfloat16)
            return
        if fmt == "nvfp4":
            for _ in range(copies):
                w = torch.randn(E, N, K, device=device)
                gs = nvfp4_global_scale(w.abs().amax(dim=(1, 2)))
                codes, block = nvfp4_quantize(w, gs.view(-1, 1, 1))
                del w
                frag, _ = to_fragments2(codes, torch.zeros(E, N, K // 32, dtype=torch.uint8, device=device))
                self.copies.append(dict(nvfrag_bf16=(frag, nv_fragment_scales(block, True), gs),
                                        nvfrag_cvt=(frag, nv_fragment_scales(block, False), gs),
                                        plain=(codes, block, gs)))
            codes, block, gs = self.copies[0]["plain"]
            w = nvfp4_dequantize(codes, block, gs.view(-1, 1, 1)).view(E, N, K)
            self.ref = torch.bmm(self.x.float(), w.transpose(1, 2))
            self.y = torch.empty(E, rows, N, device=device, dtype=torch.bfloat16)
            return
        for _ in range(copies):
            codes, scales = mxfp4_quantize(torch.randn(E, N, K, device=device))
            fc, fs = to_fragments(codes, scales)
            f2, _ = to_fragments2(codes, scales)
            self.copies.append(dict(plain=(codes, scales), frag=(fc, fs), frag2=(f2, fs), frag2n=(f2, fs)))
        self.max_scale = int(self.copies[0]["plain"][1].max())
        w = mxfp4_dequantize(*self.copies[0]["plain"]).view(E, N, K)
        self.ref = torch.bmm(self.x.float(), w.transpose(1, 2))
        self.y = torch.empty(E, rows, N, device=device, dtype=torch.bfloat16)

    def launch(self, variant, copy, tile):
        bn, bk, warps, stages = tile
        bm = max(16, self.rows)
        assert bm == self.rows, "rows must be a power of two >= 16"
        grid = (self.E, self.N // bn)
        if variant.startswith(("frag2", "nvfrag", "i4frag")):
            if variant == "frag2":
                assert self.max_scale <= 128, "frag2 folds 2^126 into scales <= 2 (e8m0 <= 128)"
            wq, ws, *gs = copy[variant]
            x, y = self.x, self.y
            scales = {"frag2": S_E8M0, "frag2n": S_E8M0_UNFOLDED, "nvfrag_cvt": S_E4M3}.get(variant, S_BF16).value
            return frag2_gemm_kernel[grid](
                x, wq, ws, gs[0] if gs else ws, y, self.N, self.K, x.stride(0), x.stride(1), wq.stride(0),
                wq.stride(1), ws.stride(0), ws.stride(1), y.stride(0), y.stride(1), BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk, SCALES=scales, INT4=variant == "i4frag", num_warps=warps, num_stages=stages)
        wq, ws = copy[variant]
        x, y = self.x, self.y
        args = (x, wq, ws, y, self.N, self.K, x.stride(0), x.stride(1), wq.stride(0), wq.stride(1),
                ws.stride(0), ws.stride(1), y.stride(0), y.stride(1))
        meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        kern = frag_gemm_kernel if variant == "frag" else plain_gemm_kernel
        return kern[grid](*args, **meta)


def sass_counts(compiled) -> dict:
    """SASS instruction counts of a compiled kernel (whole kernel), from Triton's cuobjdump."""
    import re
    import subprocess
    import tempfile

    from fusedmoe.backends.triton.kernel_report import _tool

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z0-9_.]+)", out)
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.split(".")[0]] = counts.get(op.split(".")[0], 0) + 1
    return dict(total=len(ops), **dict(sorted(counts.items(), key=lambda kv: -kv[1])[:14]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="gpt-oss-gate-up,gpt-oss-down,qwen3-gate-up,qwen3-down,deepseek-gate-up")
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--variants", default="plain,frag,frag2,frag2n")
    ap.add_argument("--tiles", default="64x128x4x3,128x128x4x3,128x128x4x4,64x256x4x3",
                    help="BLOCK_N x BLOCK_K x warps x stages, comma separated")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--ir", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="one small shape, check only")
    ap.add_argument("--format", choices=("mxfp4", "nvfp4", "int4"), default="mxfp4",
                    help="nvfp4: the nvfrag_bf16 / nvfrag_cvt variants, int4: i4frag (--variants defaults to them)")
    args = ap.parse_args()
    if args.format != "mxfp4" and args.variants == ap.get_default("variants"):
        args.variants = "nvfrag_bf16,nvfrag_cvt" if args.format == "nvfp4" else "i4frag"
    device = torch.device("cuda")
    torch.manual_seed(0)
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    shapes = {"smoke": (3, 256, 256)} if args.smoke else {n: SHAPES[n] for n in args.shapes.split(",")}
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'shape':<18}{'rows':>5} {'variant':<6}{'tile':>14}{'us':>10}{'TB/s w4':>9}{'rel err':>10}")
    rows_out = []
    for name, (E, N, K) in shapes.items():
        for rows in (int(r) for r in args.rows.split(",")):
            prob = Problem(E, N, K, rows, 1 if args.smoke else args.copies, device, args.format)
            wbytes = E * N * K * (0.5 + {"nvfp4": 1 / 16, "int4": 2 / 32}.get(args.format, 1 / 32))  # scale bytes
            for variant in args.variants.split(","):
                for tile in tiles:
                    if N % tile[0] or K % tile[1]:
                        continue
                    prob.y.fill_(float("nan"))
                    try:
                        compiled = prob.launch(variant, prob.copies[0], tile)
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a row
                        print(f"{name:<18}{rows:>5} {variant:<6}{'x'.join(map(str, tile)):>14}  error "
                              f"{type(exc).__name__}: {str(exc)[:160]}")
                        continue
                    err = ((prob.y.float() - prob.ref).norm() / prob.ref.norm()).item()
                    us = float("nan") if args.smoke else 1e6 * time_rotated(
                        [lambda c=c, p=prob, v=variant, t=tile: p.launch(v, c, t) for c in prob.copies])
                    row = dict(shape=name, E=E, N=N, K=K, rows=rows, variant=variant, tile=tile, us=us,
                               tbps=wbytes / (us * 1e-6) / 1e12, rel_err=err)
                    print(f"{name:<18}{rows:>5} {variant:<6}{'x'.join(map(str, tile)):>14}{us:>10.1f}"
                          f"{row['tbps']:>9.2f}{err:>10.1e}", flush=True)
                    if args.ir and name == next(iter(shapes)) and rows == int(args.rows.split(",")[0]):
                        args.ir.mkdir(parents=True, exist_ok=True)
                        tag = f"{variant}_{'x'.join(map(str, tile))}"
                        (args.ir / f"{tag}.ttgir").write_text(compiled.asm["ttgir"])
                        row["sass"] = sass_counts(compiled)
                        row["converts"] = compiled.asm["ttgir"].count("convert_layout")
                        row["local_stores"] = compiled.asm["ttgir"].count("local_store") + \
                            compiled.asm["ttgir"].count("local_alloc")
                        print(f"{'':<24}ttgir convert_layout {row['converts']}, local_alloc/store "
                              f"{row['local_stores']}; sass {row['sass']}", flush=True)
                    rows_out.append(row)
            del prob
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
