"""Triton kernels of the `triton` backend (jitted code only; host code is in experts.py).

Pipeline over the slots (t, k) sorted by local expert and padded to BLOCK_M per expert:
    gemm1:  a[r, :]   = act(w13[e] @ x[token(r)] (* w) + b13[e])          one program per (row block, N tile)
            (split-K for few rows: fp32 partials per H share, then moe_act_kernel sums them)
    gemm2:  y[slot, :] = (w2[e] @ a[r] + b2[e]) * w                      one program per (row block, H tile)
    reduce: out[t, :]  = sum_k y[t*K + k, :] over valid slots, in fp32  one program per (token, H tile)
Direct decode (DIRECT, few slots; experts.choose_plan): no alignment and no reduce
    gemm1:  a[slot, :] as above, row block b = slot b alone (row 0 live), expert from the ids
    gemm2:  out[t, :] = sum_k w * (w2[e_k] @ a[t*K + k] + b2[e_k])       moe_gemm2_direct_kernel,
            one program per (token, H tile), fp32 in slot order
Batched layout ([L, M, H] buffers with counts): moe_batched_rows_kernel makes the aligned rows from
the counts (buffer row e*M + j is the slot), then the same gemm1 / gemm2 with y as the output.
Every row block belongs to one expert (`block_expert`), blocks past the padded row count exit at
once, so the grid can be sized for the worst case and the launch captured in a CUDA graph.
Row offsets are computed in int64: T*K*H may exceed 2^31.

TMA (unquantized bf16/fp16 and W8A8 int8/e4m3 codes, SPLIT_K == 1, BLOCK_M >= 64 on sm90+;
experts.tma_reasons decides): W_DESC loads the weight tiles through a host TensorDescriptor over
w13 / w2 viewed as [L*rows, K], A_DESC gemm2's sorted rows (or codes) through one over a [R, I];
gemm1's x rows are gathered by token and stay on pointers. Off, the pointer loads below are
unchanged. Weight-only codes (Q_W8, Q_W4) and moe_gemm2_rows_kernel keep pointer loads.

W8A8 (QUANT != Q_NONE): 8-bit codes into tl.dot (fp32 accumulation for fp8, int32 for int8);
per-channel/token scales multiply the accumulator after the K loop, 128x128 block scales each
K step (BLOCK_K divides 128). Activation codes come from quant_kernels.py, written before the
GEMM (per-tensor: one scale per expert, so x's codes are made per sorted row and gemm1 reads
them by row, X_SORTED; the scales run as Q_CHANNEL's, a per-row scale times a weight scale
broadcast over the channels), except x's per-token codes on the direct path: GEMM1 makes them
from x itself (FUSE_XQ). Host side: quant.py. W8A8 GEMM2 with I <= 256 on the aligned path:
moe_gemm2_rows_kernel, one program per (row block, share of the N tiles), the block's codes
loaded once (quant.gemm2_rows decides).

Weight-only (Q_W8, Q_W4; activations stay in their float dtype). The weights are dequantized in
registers after their load and never written back; each byte is read once per (row block, N tile):
    Q_W8  fp8 / int8 codes -> activation dtype -> dot; per-channel scale on the fp32 accumulator;
          e4m3 codes into bf16 on a GPU by inline PTX (PTX_DECODE, `_w8_codes`: bit placement and
          one fma.bf16x2 rebias, 2.5 instructions a weight, no conversion unit)
    Q_W4  a byte holds k = 2j (low nibble) and 2j + 1 (high): x is read contiguously and split
          into its even and odd columns in registers, so
              acc += x[:, 0::2] @ (lo * s) + x[:, 1::2] @ (hi * s)   with two K/2 dots
          and no nibble interleave; s = the group scale of each element (int4 any float, mxfp4
          e8m0, nvfp4 e4m3), loaded once per group and K step and broadcast in registers
          (BLOCK_K a multiple or a divisor of the group; int4's and nvfp4's stored group-major:
          weight_only.kernel_scale_layout), nvfp4's per-expert global scale on the
          accumulator. bf16 on a GPU (PTX_DECODE): the codes are decoded and scaled by inline PTX
          (`_w4_ptx_decode`: prmt / lop3 / fma.bf16x2, ~2-3 instructions per weight, no
          conversion instructions); elsewhere (fp16, fp32, the interpreter) in fp32.
          4-bit weights in the fragment layout (W4_FMT = W4_MXFP4_FRAG / W4_NVFP4_FRAG /
          W4_INT4_FRAG; fusedmoe.quant.fragments, made by the backend's process_weights):
          `_w4_frag_tile` loads whole 16 x 64 fragments in the register order of wgmma's A
          operand and decodes them with W4_PTX_FRAG (e2m1) or W4_PTX_I4FRAG (int4), 15
          instructions per 8 weights, so the [BLOCK_N, BLOCK_K] tile needs no layout conversion;
          the GEMMs then multiply swapped, acc [BLOCK_N, BLOCK_M] += w @ x^T, as SWAP_AB, each
          dot's register-operand wgmma waited for where it is issued (`_rs_sync`: in flight it
          raced the next step's decode on an H200, Triton 3.6). GEMM1
          with K steps of 128 and more makes the fragments' pointers once (`_w4_frag_ptrs`) and
          advances them per step (FRAG_INC); 64-wide steps and GEMM2 rebuild them. The
          asm takes a lane's 4 bytes of one word together, as the load's layout holds them;
          consumed by a dot the tile is exact (tests/test_gpu_wo.py, every code and scale). A
          test kernel that stored the decoded tile directly read wrong values (seen once, for
          mxfp4, on an H200): Triton may give the asm another layout when no dot follows.
Host side: weight_only.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedmoe.backends.triton.quant_kernels import (
    FP8_MAX,
    _amax_update,
    _max_nan,
    _quantize,
    _row_block,
    _scale_for,
    _scale_of,
)

# Activation codes (constexpr): keep in sync with experts.ACT_CODES.
ACT_SILU = tl.constexpr(0)
ACT_GELU = tl.constexpr(1)
ACT_GELU_TANH = tl.constexpr(2)
ACT_SWIGLUOAI = tl.constexpr(3)
ACT_SILU_NO_MUL = tl.constexpr(4)
ACT_GELU_NO_MUL = tl.constexpr(5)
ACT_RELU2_NO_MUL = tl.constexpr(6)

# W8A8 scale modes (constexpr): keep in sync with experts.W8A8_QUANT_CODES.
Q_NONE = tl.constexpr(0)
Q_CHANNEL = tl.constexpr(2)  # A codes with a scale per row (token, or sorted row); w a scale per
# output channel (per-tensor W8A8: the expert's one scale, at channel stride 0)
Q_BLOCK = tl.constexpr(3)  # A codes with a scale per row and 128 columns; w per 128x128 block
Q_W8 = tl.constexpr(4)  # weight-only: fp8 / int8 w, a scale per output channel; A unquantized
Q_W4 = tl.constexpr(5)  # weight-only: 4-bit codes two per byte, a scale per group of W_GROUP k

# 4-bit weight formats of Q_W4 (constexpr): keep in sync with weight_only.W4_FORMATS.
W4_INT4 = tl.constexpr(0)  # two's complement nibble in [-8, 7], float scale
W4_MXFP4 = tl.constexpr(1)  # e2m1, e8m0 scale (uint8 exponent, 2^(s - 127))
W4_NVFP4 = tl.constexpr(2)  # e2m1, e4m3 scale, fp32 global scale per expert
# e2m1 with e8m0 scales in the fragment layout (fusedmoe.quant.fragments): `_w4_frag_tile` gives
# the [BLOCK_N, BLOCK_K] weight tile, multiplied swapped (w @ x^T into a [BLOCK_N, BLOCK_M]
# accumulator, transposed back after the K loop, as SWAP_AB)
W4_MXFP4_FRAG = tl.constexpr(3)
W4_NVFP4_FRAG = tl.constexpr(4)  # the same for nvfp4, its scales as multiplier codes
# (fragments.nv_scale_codes): the tile holds value * s * 2^-8, 2^8 and the global scale go onto
# the accumulator (`_w4_global`)
W4_INT4_FRAG = tl.constexpr(5)  # the same for int4 (its own bit placement, W4_PTX_I4FRAG)


@triton.jit
def _gelu_erf(z):
    return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))


@triton.jit
def _gelu_tanh(z):
    inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
    return z * tl.sigmoid(2.0 * inner)  # 0.5 * (1 + tanh(u)) == sigmoid(2u)


@triton.jit
def _activation(g, u, alpha, limit, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """act on fp32 accumulators; u is the up half for gated activations (ignored otherwise)."""
    # Clamps and relu keep NaN as torch's do (the default tl.minimum/maximum, like fminf/fmaxf,
    # return the other operand: a NaN token came out finite).
    if ACT == ACT_SWIGLUOAI:
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.clamp(u, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        out = (u + 1.0) * g * tl.sigmoid(alpha * g)
    else:
        if HAS_LIMIT:
            g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
            u = tl.clamp(u, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        if ACT == ACT_SILU:
            out = g * tl.sigmoid(g) * u
        elif ACT == ACT_GELU:
            out = _gelu_erf(g) * u
        elif ACT == ACT_GELU_TANH:
            out = _gelu_tanh(g) * u
        elif ACT == ACT_SILU_NO_MUL:
            out = g * tl.sigmoid(g)
        elif ACT == ACT_GELU_NO_MUL:
            out = _gelu_erf(g)
        else:  # ACT_RELU2_NO_MUL
            r = tl.maximum(g, 0.0, propagate_nan=tl.PropagateNan.ALL)
            out = r * r
    return out


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, FP8_PROMOTE: tl.constexpr):
    if IEEE:  # fp32 inputs: exact fp32 products, not TF32
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif FP8_PROMOTE and a.dtype.is_fp8():
        # Hopper's fp8 MMA accumulates in reduced precision (~14 bits kept, DeepSeek-V3 report):
        # promoted, each BLOCK_K product is added into the fp32 accumulator (DeepGEMM does every
        # 128), at the price of a wait on every step's wgmma. Chained (the default, below; vLLM's
        # and torch._scaled_mm(use_fast_accum=True)'s choice) is 1.1-1.5% off emulation on the
        # presets' full shapes but no further from the exact reference (4.63% -> 4.65% at
        # Mixtral, where the fp8 activations themselves cost 4.6%): quant.fp8_promoted.
        acc += tl.dot(a, b, out_dtype=tl.float32)
    else:  # out_dtype follows the accumulator: int32 for int8 operands (Triton 3.6 needs it named)
        acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
    return acc


@triton.jit
def _rs_sync(acc, RS_SYNC: tl.constexpr):
    """The accumulator of a dot whose operand A is a register tile (the fragment layout's decoded
    weights), passed through an opaque copy when RS_SYNC (a GPU compile): the dot's result is then
    used by an op in the K loop, so Triton waits for its wgmma right after it (`wait 0`) instead
    of splitting it into K=16 dots kept in flight across the next step's decode. That overlap is a
    read-after-write hazard on Hopper with Triton 3.6 and ptxas before CUDA 13.3 (triton-lang/triton
    issue 9433): the next step's decode may overwrite the A registers of a wgmma not yet issued.
    On an H200 (Triton 3.6) int4 g32 / g64 / g128 fragments under a 128-row, 4-warp GEMM2 computed
    wrong rows in 3-13 of 25-40 runs without it, none in 120 with it
    (benchmarks/results/2026-11-29_h200_ad9161a_rs_wgmma_hazard.txt). ptxas folds the mov.b32 away
    (mxfp4 GEMM2 at Qwen3-30B M=256: 256 SASS instructions a K step against 278 in flight,
    benchmarks/kernel_report.py); the interpreter never sets RS_SYNC (no wgmma there, no PTX)."""
    if RS_SYNC:
        acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)
    return acc


# SWAP_AB (W8A8 with 8-bit codes, row blocks under 64 rows; quant.swap_ab decides): the GEMMs
# hold their accumulators transposed, [BLOCK_N, BLOCK_M], and multiply w^T @ a^T, so the weight
# tile is the MMA's M side. Hopper's wgmma needs 64 rows on that side: a 16-row block of fp8
# codes otherwise runs as HMMA on codes converted to f16. The accumulators are transposed back
# after the K loop, before any epilogue.
@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC_INT: tl.constexpr, SWAP: tl.constexpr):
    """The zero accumulator: int32 for int8 codes, else fp32; [BLOCK_N, BLOCK_M] when SWAP.
    (One return per helper: Triton checks every return's type, constexpr branches included.)"""
    if SWAP:
        shape: tl.constexpr = (BLOCK_N, BLOCK_M)
    else:
        shape: tl.constexpr = (BLOCK_M, BLOCK_N)
    if ACC_INT:  # noqa: SIM108 (constexpr branch)
        acc = tl.zeros(shape, dtype=tl.int32)
    else:
        acc = tl.zeros(shape, dtype=tl.float32)
    return acc


@triton.jit
def _mma(a, w, SWAP: tl.constexpr):
    """a [M, K] @ w [K, N] (8-bit codes: fp32 for fp8, int32 for int8), or its transpose w^T @ a^T
    [N, M] when SWAP."""
    if SWAP:  # noqa: SIM108 (constexpr branch)
        p = tl.dot(tl.trans(w), tl.trans(a))
    else:
        p = tl.dot(a, w)
    return p


@triton.jit
def _dot_acc(a, w, acc, IEEE: tl.constexpr, SWAP: tl.constexpr, FP8_PROMOTE: tl.constexpr):
    """_dot(a, w, acc), with acc the transposed accumulator when SWAP."""
    if SWAP:  # noqa: SIM108 (constexpr branch)
        acc = _dot(tl.trans(w), tl.trans(a), acc, IEEE, FP8_PROMOTE)
    else:
        acc = _dot(a, w, acc, IEEE, FP8_PROMOTE)
    return acc


@triton.jit
def _per_row(v, SWAP: tl.constexpr):
    """A vector over the M rows, shaped to scale a [M, N] accumulator (its transpose when SWAP)."""
    if SWAP:  # noqa: SIM108 (constexpr branch)
        r = v[None, :]
    else:
        r = v[:, None]
    return r


@triton.jit
def _per_col(v, SWAP: tl.constexpr):
    """A vector over the N columns, shaped as _per_row: a row vector's shape with SWAP flipped."""
    return _per_row(v, not SWAP)


@triton.jit
def _w4_value(code, FMT: tl.constexpr):
    """fp32 value of 4-bit codes (int32 in [0, 15]): int4 two's complement or e2m1."""
    if FMT == W4_INT4:
        v = ((code ^ 8) - 8).to(tl.float32)
    else:
        # e2m1 -> fp16 bits: exponent bits 1-2 land on fp16's 10-11, the mantissa bit on 9, the
        # sign on 15. That fp16 is the e2m1 value * 2^-14 (code 1, 0.5, is fp16's subnormal
        # 2^-15), so the exact value is it * 2^14. 4 integer ops, no table.
        bits = ((code & 7) << 9) | ((code & 8) << 12)
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    return v


@triton.jit
def _w4_scale(s, FMT: tl.constexpr):
    """fp32 multiplier of stored group scales: float (int4), e8m0 uint8 (mxfp4), e4m3 (nvfp4)."""
    if FMT == W4_MXFP4:  # 2^(s - 127) from the fp32 bit pattern; s = 0 is the subnormal 2^-127
        e = s.to(tl.int32)
        v = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    else:
        v = s.to(tl.float32)
    return v


# 4-bit codes -> bf16 in registers with integer and packed-bf16 instructions (no conversion
# unit: its int -> float and float -> bf16 casts run at 16 per SM cycle, a quarter of the rate
# the quantized byte roof needs). One asm block takes 4 bytes (b0..b3 in $4) and their bf16
# scales ($5 = s0 | s1 << 16, $6 = s2 | s3 << 16) and returns the low nibbles' values ($0, $1)
# and the high nibbles' ($2, $3) as bf16 pairs. prmt spreads bytes b0, b1 (b2, b3) over the two
# 16-bit lanes of t0 (t1); lop3 (a & b) ^ c = 0x6A, (a & b) | c = 0xEA.
#   int4: (c & 15) ^ 0x4308 is the bf16 of 128 + (c ^ 8); minus 136 (fma x * 1 - 136, exact)
#         is the two's complement nibble.
#   e2m1: (c & 7) << 6 | (c & 8) << 12 is the bf16 of value * 2^-126 (code 1 = 0.5 lands on the
#         subnormal 2^-127); times 2^126 (0x7E80) is exact.
# Then one fma.rn.bf16x2 by the scale (+ -0.0): value * s rounded once, as the fp32 path.
_W4_PTX_HEAD = """
{
.reg .b32 t0, t1, u0, u1, u2, u3, w0, w1, w2, w3, one, neg0, k;
mov.b32 neg0, 0x80008000;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
"""
_W4_PTX_TAIL = """
fma.rn.bf16x2 $0, u0, $5, neg0;
fma.rn.bf16x2 $1, u1, $6, neg0;
fma.rn.bf16x2 $2, u2, $5, neg0;
fma.rn.bf16x2 $3, u3, $6, neg0;
}
"""
_W4_PTX_INT4_BODY = """
mov.b32 one, 0x3F803F80;{set_k}
lop3.b32 u0, t0, 0x000F000F, 0x43084308, 0x6A;
lop3.b32 u1, t1, 0x000F000F, 0x43084308, 0x6A;
shr.u32 t0, t0, 4;
shr.u32 t1, t1, 4;
lop3.b32 u2, t0, 0x000F000F, 0x43084308, 0x6A;
lop3.b32 u3, t1, 0x000F000F, 0x43084308, 0x6A;
fma.rn.bf16x2 u0, u0, one, {k01};
fma.rn.bf16x2 u1, u1, one, {k23};
fma.rn.bf16x2 u2, u2, one, {k01};
fma.rn.bf16x2 u3, u3, one, {k23};
"""
W4_PTX_INT4 = tl.constexpr(_W4_PTX_HEAD + _W4_PTX_INT4_BODY.format(set_k="\nmov.b32 k, 0xC308C308;", k01="k", k23="k")
                           + _W4_PTX_TAIL)
# Asymmetric int4 (W_ZERO): $7 / $8 = bf16 pairs of -(136 + zero) for bytes b0, b1 / b2, b3 (both
# nibbles of a byte share a group), in place of the constant -136: (128 + (c ^ 8)) - (136 + zero)
# is code - zero, exact (integers below 256), then times the scale as above. The same 15
# instructions as W4_PTX_INT4 (one mov fewer).
W4_PTX_INT4_ZP = tl.constexpr(_W4_PTX_HEAD + _W4_PTX_INT4_BODY.format(set_k="", k01="$7", k23="$8") + _W4_PTX_TAIL)
W4_PTX_E2M1 = tl.constexpr(_W4_PTX_HEAD + """
mov.b32 k, 0x7E807E80;
shl.b32 u0, t0, 6;
shl.b32 u1, t1, 6;
shl.b32 u2, t0, 2;
shl.b32 u3, t1, 2;
shl.b32 w0, t0, 12;
shl.b32 w1, t1, 12;
shl.b32 w2, t0, 8;
shl.b32 w3, t1, 8;
and.b32 w0, w0, 0x80008000;
and.b32 w1, w1, 0x80008000;
and.b32 w2, w2, 0x80008000;
and.b32 w3, w3, 0x80008000;
lop3.b32 u0, u0, 0x01C001C0, w0, 0xEA;
lop3.b32 u1, u1, 0x01C001C0, w1, 0xEA;
lop3.b32 u2, u2, 0x01C001C0, w2, 0xEA;
lop3.b32 u3, u3, 0x01C001C0, w3, 0xEA;
fma.rn.bf16x2 u0, u0, k, neg0;
fma.rn.bf16x2 u1, u1, k, neg0;
fma.rn.bf16x2 u2, u2, k, neg0;
fma.rn.bf16x2 u3, u3, k, neg0;
""" + _W4_PTX_TAIL)


@triton.jit
def _w4_ptx_decode(b, s, FMT: tl.constexpr):
    """(low, high) nibbles of uint8 `b` decoded and times bf16 `s` (broadcast to b's shape), bf16."""
    if FMT == W4_INT4:
        lo, hi = tl.inline_asm_elementwise(W4_PTX_INT4, "=r,=r,=r,=r,r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(W4_PTX_E2M1, "=r,=r,=r,=r,r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _w4_ptx_decode_zp(b, s, zk):
    """`_w4_ptx_decode` of asymmetric int4: (code - zero) * s, with zk = bf16 -(136 + zero)
    broadcast as s is (W4_PTX_INT4_ZP)."""
    lo, hi = tl.inline_asm_elementwise(W4_PTX_INT4_ZP, "=r,=r,=r,=r,r,r,r,r,r", [b, s, zk],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


# fp8 (e4m3) codes -> bf16 with integer and packed-bf16 instructions, where Triton's cast goes
# through the conversion unit (fp8 weight-only decode ran slower than int8's on an H200). One asm
# block takes 4 codes ($2 = b0..b3) and returns their bf16 values ($0 = b0 | b1 << 16, $1 = b2,
# b3): prmt puts each code in the high byte of a 16-bit lane (s eeee mmm 0000 0000), the sign
# stays at bit 15 and exponent + mantissa shift right by 4 into bf16's fields (the value times
# 2^-120: e4m3's bias 7 against bf16's 127), and one fma.rn.bf16x2 by 2^120 restores it, exact
# for normals and subnormals alike. The NaN codes (0x7F, 0xFF) would come out as +-480:
# `weight_only.check_fp8_codes` refuses them before a decode can meet one.
W8_PTX_E4M3 = tl.constexpr("""
{
.reg .b32 t0, t1, s0, s1, k, neg0;
mov.b32 k, 0x7B807B80;
mov.b32 neg0, 0x80008000;
prmt.b32 t0, $2, 0, 0x1404;
prmt.b32 t1, $2, 0, 0x3424;
and.b32 s0, t0, 0x80008000;
and.b32 s1, t1, 0x80008000;
shr.u32 t0, t0, 4;
shr.u32 t1, t1, 4;
lop3.b32 t0, t0, 0x07F007F0, s0, 0xEA;
lop3.b32 t1, t1, 0x07F007F0, s1, 0xEA;
fma.rn.bf16x2 $0, t0, k, neg0;
fma.rn.bf16x2 $1, t1, k, neg0;
}
""")


@triton.jit
def _w8_codes(w, DTYPE: tl.constexpr, PTX: tl.constexpr):
    """fp8 / int8 weight codes in the activation dtype DTYPE (exact); PTX (e4m3 codes, bf16 on a
    GPU): decoded by W8_PTX_E4M3 instead of a cast."""
    if PTX:
        return tl.inline_asm_elementwise(W8_PTX_E4M3, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)
    return w.to(DTYPE)


@triton.jit
def _w4_group_tile(cols, k0, k_end, n_ok, stride_sg, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The per-group values (scales or zero points) `cols` points at for one K step: [BLOCK_K /
    GROUP, BLOCK_N] for a step of whole groups, else the step's one group, [1, BLOCK_N]."""
    if BLOCK_K > GROUP:
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        v = tl.load(cols + groups[:, None] * stride_sg, mask=(groups * GROUP < k_end)[:, None] & n_ok[None, :],
                    other=0.0)
    else:
        v = tl.load(cols + (k0 // GROUP) * stride_sg, mask=n_ok[None, :], other=0.0)
    return v


@triton.jit
def _w4_group_spread(v, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_w4_group_tile`'s values over the step's BLOCK_K / 2 bytes (each group's GROUP / 2)."""
    if BLOCK_K > GROUP:
        v = tl.reshape(tl.broadcast_to(v[:, None, :], (BLOCK_K // GROUP, GROUP // 2, BLOCK_N)), (BLOCK_K // 2, BLOCK_N))
    return v


@triton.jit
def _w4_tiles(w_ptrs, s_cols, mask, n_ok, k0, k_end, stride_sg, FMT: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, PTX: tl.constexpr,
              z_cols=None, W_ZERO: tl.constexpr = False):
    """(low, high) dequantized [BLOCK_K / 2, BLOCK_N] tiles of one packed K step, in DTYPE.

    w_ptrs: the bytes (k = 2j, 2j + 1) x n; s_cols: [1, BLOCK_N] pointers to the n columns' first
    group scale. A step covers BLOCK_K / GROUP whole groups (their scales are loaded once and
    repeated over the group's GROUP / 2 bytes) or lies in one group (one scale per column).
    PTX (bf16 on a GPU): the scales are rounded to bf16 (exact for e8m0 and e4m3; int4's float
    scales gain a 2^-9 relative rounding) and the decode runs as `_w4_ptx_decode`; otherwise
    fp32 values * fp32 scales, cast to DTYPE. W_ZERO (asymmetric int4): z_cols points at the
    zero points as s_cols at the scales (the same strides), and each value is (code - zero) * s.
    """
    b = tl.load(w_ptrs, mask=mask, other=0)
    s = _w4_scale(_w4_group_tile(s_cols, k0, k_end, n_ok, stride_sg, GROUP, BLOCK_K, BLOCK_N), FMT)
    if PTX:  # round before the broadcast: one conversion per group, not per weight
        s = s.to(tl.bfloat16)
    s = _w4_group_spread(s, GROUP, BLOCK_K, BLOCK_N)
    if W_ZERO:
        tl.static_assert(FMT == W4_INT4, "W_ZERO: asymmetric int4")
        z = _w4_group_tile(z_cols, k0, k_end, n_ok, stride_sg, GROUP, BLOCK_K, BLOCK_N).to(tl.float32)
        if PTX:  # -(136 + zero), exact in bf16: W4_PTX_INT4_ZP's addend
            z = (-136.0 - z).to(tl.bfloat16)
        z = _w4_group_spread(z, GROUP, BLOCK_K, BLOCK_N)
    if PTX:
        if W_ZERO:
            lo, hi = _w4_ptx_decode_zp(b, s, z)
        else:
            lo, hi = _w4_ptx_decode(b, s, FMT)
    else:
        b = b.to(tl.int32)
        if W_ZERO:
            lo = ((_w4_value(b & 15, FMT) - z) * s).to(DTYPE)
            hi = ((_w4_value((b >> 4) & 15, FMT) - z) * s).to(DTYPE)
        else:
            lo = (_w4_value(b & 15, FMT) * s).to(DTYPE)
            hi = (_w4_value((b >> 4) & 15, FMT) * s).to(DTYPE)
    return lo, hi


# The fragment layout's decode (fusedmoe.quant.fragments): $4 = one word, the four A registers
# (rh, kh) = 00, 01, 10, 11 of a lane's k16 chunk, two codes each; $5 / $6 = the bf16x2
# multipliers (2^126 * scale) of the rh = 0 / rh = 1 rows. Out: $0..$3 = the registers, bf16
# pairs (k, k + 1). 15 instructions for 8 weights.
W4_PTX_FRAG = tl.constexpr("""
{
.reg .b32 a, b, c, d;
and.b32 $0, $4, 0x81C081C0;
shl.b32 a, $4, 3;
and.b32 $1, a, 0x81C081C0;
shl.b32 b, $4, 6;
and.b32 $2, b, 0x81C081C0;
shr.b32 a, $4, 4;
shr.b32 b, $4, 5;
shl.b32 c, $4, 1;
lop3.b32 d, a, b, 0x00C000C0, 0xE4;
and.b32 d, d, 0x01C001C0;
lop3.b32 $3, c, 0x80008000, d, 0xEA;
mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, $5;
mul.rn.bf16x2 $2, $2, $6;
mul.rn.bf16x2 $3, $3, $6;
}
""")


# int4 in the fragment layout: register r's two codes (u = 0, 1) at bits 4r and 16 + 4r of $4.
# (w >> 4r) & 0x000F000F ^ 0x43084308 (one lop3) is the bf16 pair of 136 + q, x * 1 - 136 is q
# (exact), then the bf16x2 scales $5 / $6 of rows rh = 0 / 1. 15 instructions for 8 weights.
_W4_PTX_I4FRAG = """
{{
.reg .b32 t, k, one;
mov.b32 one, 0x3F803F80;{set_k}
lop3.b32 $0, $4, 0x000F000F, 0x43084308, 0x6A;
shr.b32 t, $4, 4;
lop3.b32 $1, t, 0x000F000F, 0x43084308, 0x6A;
shr.b32 t, $4, 8;
lop3.b32 $2, t, 0x000F000F, 0x43084308, 0x6A;
shr.b32 t, $4, 12;
lop3.b32 $3, t, 0x000F000F, 0x43084308, 0x6A;
fma.rn.bf16x2 $0, $0, one, {k0};
fma.rn.bf16x2 $1, $1, one, {k0};
fma.rn.bf16x2 $2, $2, one, {k1};
fma.rn.bf16x2 $3, $3, one, {k1};
mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, $5;
mul.rn.bf16x2 $2, $2, $6;
mul.rn.bf16x2 $3, $3, $6;
}}
"""
W4_PTX_I4FRAG = tl.constexpr(_W4_PTX_I4FRAG.format(set_k="\nmov.b32 k, 0xC308C308;", k0="k", k1="k"))
# Asymmetric int4 (W_ZERO): $7 / $8 = bf16 pairs of -(136 + zero) for the rh = 0 / 1 rows, laid as
# $5 / $6 are, in place of the constant -136 (as W4_PTX_INT4_ZP): code - zero, exact, then the scale.
W4_PTX_I4FRAG_ZP = tl.constexpr(_W4_PTX_I4FRAG.format(set_k="", k0="$7", k1="$8"))
TWO_M126 = tl.constexpr(2.0**-126)
NV_CODE_BASE = tl.constexpr(0x7600)  # fragments.NV_CODE_BASE: nvfp4 scale code c -> bf16 bits (c << 4) + this
# The PTX decode's multipliers (W4_PTX_MULT_MX / _NV), two scales to a 32-bit register: 4 stored scale bytes b0..b3 ($2) ->
# the bf16 pairs (m(b0), m(b1)) in $0 and (m(b2), m(b3)) in $1, with m(b) = (b << shift) + base per
# 16-bit half: one prmt (b0 and b1 into the halves' low bytes) and one shift-add a pair, where a
# multiplier alone took a byte extract and a shift-add. No half carries into the other: nvfp4's
# codes give at most 0x7600 + 160 * 16 = 0x8000, mxfp4's e8m0 codes (<= 128) (128 + 126) << 7.
_PTX_MULT = """
{{
.reg .b32 t;
prmt.b32 t, $2, 0, 0x4140;
shl.b32 t, t, {shift};
add.u32 $0, t, {base};
prmt.b32 t, $2, 0, 0x4342;
shl.b32 t, t, {shift};
add.u32 $1, t, {base};
}}
"""
W4_PTX_MULT_MX = tl.constexpr(_PTX_MULT.format(shift=7, base="0x3F003F00"))
W4_PTX_MULT_NV = tl.constexpr(_PTX_MULT.format(shift=4, base="0x76007600"))


@triton.jit
def _frag_value(reg, HIGH: tl.constexpr, FMT: tl.constexpr):
    """fp32 value of one 16-bit half of a decoded register: e2m1 (uint32 bits: sign at 15, E1 E0 M
    at 8 7 6 of the half) by its code and `_w4_value`; int4 (its code at bits 0-3 of the half)."""
    if HIGH:  # noqa: SIM108 (constexpr branch)
        h = reg >> 16
    else:
        h = reg & 0xFFFF
    if FMT == W4_INT4_FRAG:
        return _w4_value((h & 15).to(tl.int32), W4_INT4)
    code = (((h >> 12) & 8) | ((h >> 6) & 7)).to(tl.int32)
    return _w4_value(code, W4_MXFP4)


@triton.jit
def _frag_multiplier(sc, FMT: tl.constexpr, PTX: tl.constexpr = False):
    """bf16 multipliers of the PTX decode from stored fragment scales: mxfp4 e8m0 -> 2^126 * 2^(e -
    127) = 2^(e - 1), bf16 exponent field e + 126 (finite: e <= 128); nvfp4's scale codes
    (`fragments.nv_scale_codes`) -> s * 2^118, -0 for s = 0 (exact: at most 448 * 2^118,
    subnormal scales included); each a shift and an add; int4 the float scale in bf16.
    PTX: the same bits two to a register (W4_PTX_MULT_*; sc's last dim holds a multiple of 4)."""
    if FMT == W4_MXFP4_FRAG:
        if PTX:
            m = tl.inline_asm_elementwise(W4_PTX_MULT_MX, "=r,=r,r", [sc], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            m = ((sc.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)
    elif FMT == W4_NVFP4_FRAG:  # the zero scale's code 160: 0x7600 + 0xA00 = 0x8000, -0
        if PTX:
            m = tl.inline_asm_elementwise(W4_PTX_MULT_NV, "=r,=r,r", [sc], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            m = ((sc.to(tl.uint16) << 4) + NV_CODE_BASE).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        m = sc.to(tl.bfloat16)
    return m


@triton.jit
def _w4_global(gs, FMT: tl.constexpr):
    """nvfp4's accumulator multiplier: the global scale, times the 2^8 fragment tiles leave out
    (their scale multipliers are s * 2^118: `_frag_multiplier`)."""
    if FMT == W4_NVFP4_FRAG:
        gs = gs * 256.0
    return gs


@triton.jit
def _w4_frag_tile(w_ptr, s_ptr, s_rows, n16_0, n16_end, k0, k_end, kdim, FMT: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, PTX: tl.constexpr,
                  EVEN_K: tl.constexpr = False, up_off=0, TWO_HALVES: tl.constexpr = False, z_ptr=None,
                  W_ZERO: tl.constexpr = False):
    """Rows 16 * n16_0 .. + BLOCK_N, k = k0 .. + BLOCK_K of one expert's 4-bit weight in the
    fragment layout (FMT W4_*_FRAG; w_ptr: its codes, [N, K/2] bytes; s_ptr: its scales,
    [N/16, K/GF, 16 * GF / GROUP] with GF = max(GROUP, 64), s_rows elements apart in its first dim
    (`fragments.to_fragments` pads each row block's run); kdim = K), as a [BLOCK_N, BLOCK_K]
    DTYPE tile (nvfp4: value * s * 2^-8). Fragments past row block n16_end or past k_end read as
    0. PTX (bf16 on a GPU): W4_PTX_FRAG / W4_PTX_I4FRAG, and the tile comes out in the register
    layout of the dot's operand A; otherwise the same bits decoded in fp32 by Triton integer ops.
    EVEN_K: the step lies below k_end whole (the caller's K steps tile it), so only the row bound
    masks the loads, a mask the K loop does not recompute. TWO_HALVES: the tile's first BLOCK_N / 2
    rows are row blocks n16_0.. and its last BLOCK_N / 2 the same blocks plus up_off (GEMM1's gate
    and up rows, one tile), each half bounded by n16_end. W_ZERO (asymmetric int4): z_ptr holds the
    zero points laid as the scales (the same runs and s_rows)."""
    b_ptrs, s_ptrs, ok = _w4_frag_ptrs(w_ptr, s_ptr, s_rows, n16_0, n16_end, k0, kdim, FMT, GROUP, BLOCK_N,
                                       BLOCK_K, PTX, up_off, TWO_HALVES)
    z_ptrs = s_ptrs
    if W_ZERO:
        _, z_ptrs, _ = _w4_frag_ptrs(w_ptr, z_ptr, s_rows, n16_0, n16_end, k0, kdim, FMT, GROUP, BLOCK_N,
                                     BLOCK_K, PTX, up_off, TWO_HALVES)
    if not EVEN_K:
        ok = _w4_frag_kmask(ok, k0, k_end, BLOCK_N, BLOCK_K, False)
    return _w4_frag_decode(b_ptrs, s_ptrs, ok, FMT, GROUP, BLOCK_N, BLOCK_K, DTYPE, PTX, z_ptrs, W_ZERO)


@triton.jit
def _w4_frag_ptrs(w_ptr, s_ptr, s_rows, n16_0, n16_end, k0, kdim, FMT: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, up_off=0,
                  TWO_HALVES: tl.constexpr = False):
    """(code pointers [F, 512], scale pointers, row mask [F]) of the fragment tile `_w4_frag_tile`
    loads at k0 (its docstring: the layout, TWO_HALVES), F = its 16 x 64 fragments; a row block's
    scales start s_rows elements after the last's (the scales' stride(1): runs may be padded).
    The scale pointers are, with PTX, [F, 8, 2 * JG / PER]: row group g's 2 * JG (rh, jg) scales,
    each once (`_w4_lane_tile` hands them to the group's 4 lanes), PER to a 32-bit word where they
    fill whole words (`_w4_group_values` loads the words); [F, NSC] without PTX. A K loop may
    advance them by a constant per BLOCK_K step where each step covers whole scale chunks
    (moe_gemm1_kernel's FRAG_INC); the mask bounds the rows only (`_w4_frag_kmask` adds K's)."""
    NB16: tl.constexpr = BLOCK_N // 16
    F: tl.constexpr = (BLOCK_K // 64) * NB16
    GF: tl.constexpr = 64 if GROUP < 64 else GROUP  # K per scale chunk
    JG: tl.constexpr = GF // GROUP  # groups per chunk
    NSC: tl.constexpr = 16 * JG  # scales per chunk: (g, rh, jg)
    BITS: tl.constexpr = s_ptr.dtype.element_ty.primitive_bitwidth
    PER: tl.constexpr = 32 // BITS if BITS < 32 and (2 * JG * BITS) % 32 == 0 else 1  # a row group's values a word
    f = tl.arange(0, F)  # fragment f: k64 = f // NB16, n16 = f % NB16
    if TWO_HALVES:
        n16 = n16_0 + f % (NB16 // 2)
        ok = n16 < n16_end
        n16 = n16 + tl.where(f % NB16 < NB16 // 2, 0, up_off)
    else:
        n16 = n16_0 + f % NB16
        ok = n16 < n16_end
    k64 = k0 // 64 + f // NB16
    frag = n16.to(tl.int64) * (kdim // 64) + k64
    s_off = n16.to(tl.int64) * s_rows + (k64 // (GF // 64)) * NSC
    b_ptrs = w_ptr + frag[:, None] * 512 + tl.arange(0, 512)[None, :]
    if PTX:
        rg = tl.arange(0, 8) * (2 * JG)
        s_ptrs = s_ptr + s_off[:, None, None] + rg[None, :, None] + (tl.arange(0, 2 * JG // PER) * PER)[None, None, :]
    else:
        s_ptrs = s_ptr + s_off[:, None] + tl.arange(0, NSC)[None, :]
    return b_ptrs, s_ptrs, ok


@triton.jit
def _w4_frag_kmask(ok, k0, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RELATIVE: tl.constexpr):
    """`_w4_frag_ptrs`'s row mask and the K bound: fragments from k_end on read as 0. RELATIVE:
    as k_end - k0 (the pointer-increment loop's form); else from k0 // 64, the form the
    per-step addresses were measured with (the two compile differently)."""
    NB16: tl.constexpr = BLOCK_N // 16
    f = tl.arange(0, (BLOCK_K // 64) * NB16)
    if RELATIVE:
        ok = ok & ((f // NB16) * 64 < k_end - k0)
    else:
        ok = ok & ((k0 // 64 + f // NB16) * 64 < k_end)
    return ok


@triton.jit
def _w4_frag_gemm1_ptrs(w_ptr, s_ptr, s_rows, pid_n, inter, k0, hidden, FMT: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, ONE_DOT: tl.constexpr,
                        GATED: tl.constexpr):
    """`_w4_frag_ptrs` of a GEMM1 N tile at k0: (gate codes, scales, mask, up codes, scales, mask);
    ONE_DOT: the gate and up rows as one tile (the up triple repeats the gate's, unused), as
    does an ungated GEMM1."""
    if ONE_DOT:
        gb, gs, gok = _w4_frag_ptrs(w_ptr, s_ptr, s_rows, pid_n * (BLOCK_N // 16), inter // 16, k0, hidden, FMT,
                                    GROUP, 2 * BLOCK_N, BLOCK_K, PTX, inter // 16, True)
    else:
        gb, gs, gok = _w4_frag_ptrs(w_ptr, s_ptr, s_rows, pid_n * (BLOCK_N // 16), inter // 16, k0, hidden, FMT,
                                    GROUP, BLOCK_N, BLOCK_K, PTX)
    ub, us, uok = gb, gs, gok
    if GATED and not ONE_DOT:  # the up rows start at fragment row I / 16
        ub, us, uok = _w4_frag_ptrs(w_ptr, s_ptr, s_rows, (inter + pid_n * BLOCK_N) // 16, 2 * inter // 16, k0,
                                    hidden, FMT, GROUP, BLOCK_N, BLOCK_K, PTX)
    return gb, gs, gok, ub, us, uok


@triton.jit
def _w4_group_values(ptrs, ok, N: tl.constexpr):
    """[F, 8, N] values (scales or zero points) of `_w4_frag_ptrs`'s [F, 8, W] pointers, rows
    where ok is false 0: loaded as they are where W = N, else as N / W 32-bit words a row group
    (bf16 pairs, e8m0 / e4m3-code quads) split in registers, lowest address first. Why words: a
    row group's values in fewer than 4 bytes a thread (int4 g64 / g128's bf16 pair, mxfp4's 4
    bytes over 2 threads at 4 warps) were loaded into registers, not through the pipeline's
    shared buffers, and the register layout of that load reached the decode's operands, giving
    its pack=4 inline asm registers that are not 4 consecutive codes: wrong results on an H200
    (results/2026-11-30_h200_ff93a3e_int4_lane_tile.txt), flagged on the CPU by
    `kernel_report.asm_pack_hazards`. A 32-bit load a thread is copied through shared memory and
    read back in the operands' layout, as int4 g32's bf16 quads were."""
    if ptrs.shape[2] == N:  # noqa: SIM108 (constexpr branch)
        v = tl.load(ptrs, mask=ok[:, None, None], other=0)
    else:
        dt = ptrs.dtype.element_ty
        w = tl.load(ptrs.to(tl.pointer_type(tl.int32)), mask=ok[:, None, None], other=0)
        if dt.primitive_bitwidth == 16:
            v = tl.join(w.to(tl.int16).to(dt, bitcast=True), (w >> 16).to(tl.int16).to(dt, bitcast=True))
        else:  # bytes 0..3: join(join(b0, b2), join(b1, b3)) lists them in order
            b0 = w.to(tl.int8).to(dt, bitcast=True)
            b1 = (w >> 8).to(tl.int8).to(dt, bitcast=True)
            b2 = (w >> 16).to(tl.int8).to(dt, bitcast=True)
            b3 = (w >> 24).to(tl.int8).to(dt, bitcast=True)
            v = tl.join(tl.join(b0, b2), tl.join(b1, b3))
        v = tl.reshape(v, (ptrs.shape[0], ptrs.shape[1], N))
    return v


@triton.jit
def _w4_lane_tile(v, F: tl.constexpr, JG: tl.constexpr):
    """A fragment tile's per-group values (scale multipliers or zero points) as the decode's
    [F, 512] operand: lane 4g + c's 16 elements (j, rh, pair) each its row's group jg = j // (4 / JG)
    value. v: [F, 8, 2 * JG], row group g's (rh, jg) values loaded once (`_w4_group_values`: the
    pipeline's shared buffers hold each once, not once a lane). H200, Triton 3.6, Mixtral M=16:
    int4 g32 / g32_zp 300 / 488 -> 236 / 259 us (a fifth less shared memory a K stage, one more
    program an SM), and since every format loads so, g128 / g128_zp 358 / 597 -> 233 / 263, nvfp4
    305 -> 256 (results/2026-11-30_h200_4aecf95_w4_group_words.txt)."""
    t = tl.permute(tl.reshape(v, (F, 8, 2, JG)), (0, 1, 3, 2))  # F g jg rh
    t = tl.broadcast_to(tl.reshape(t, (F, 8, 1, JG, 1, 2, 1)), (F, 8, 4, JG, 4 // JG, 2, 2))  # g c | j rh | pair
    return tl.reshape(t, (F, 512))


@triton.jit
def _w4_frag_decode(b_ptrs, s_ptrs, ok, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, PTX: tl.constexpr, z_ptrs=None,
                    W_ZERO: tl.constexpr = False):
    """The [BLOCK_N, BLOCK_K] DTYPE tile of `_w4_frag_ptrs`'s pointers (`_w4_frag_tile`'s
    docstring), fragments where ok is false read as 0. W_ZERO (asymmetric int4): z_ptrs point at
    the zero points as s_ptrs at the scales, and each weight is (code - zero) * s."""
    NB16: tl.constexpr = BLOCK_N // 16
    F: tl.constexpr = (BLOCK_K // 64) * NB16
    GF: tl.constexpr = 64 if GROUP < 64 else GROUP
    JG: tl.constexpr = GF // GROUP
    b = tl.load(b_ptrs, mask=ok[:, None], other=0)
    if PTX:
        sc = _w4_group_values(s_ptrs, ok, 2 * JG)  # [F, 8, (rh, jg)]
        s2 = _w4_lane_tile(_frag_multiplier(sc, FMT, True), F, JG)
        if W_ZERO:  # -(136 + zero) in bf16 (exact), laid as the multipliers
            tl.static_assert(FMT == W4_INT4_FRAG, "W_ZERO: asymmetric int4")
            zk = (-136.0 - _w4_group_values(z_ptrs, ok, 2 * JG).to(tl.float32)).to(tl.bfloat16)
            r0, r1 = tl.inline_asm_elementwise(W4_PTX_I4FRAG_ZP, "=r,=r,=r,=r,r,r,r,r,r",
                                               [b, s2, _w4_lane_tile(zk, F, JG)],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif FMT == W4_INT4_FRAG:
            r0, r1 = tl.inline_asm_elementwise(W4_PTX_I4FRAG, "=r,=r,=r,=r,r,r,r", [b, s2],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            r0, r1 = tl.inline_asm_elementwise(W4_PTX_FRAG, "=r,=r,=r,=r,r,r,r", [b, s2],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        # r0 / r1: rows rh = 0 / 1; element 4j + 2kh + u of a lane
        v = tl.reshape(tl.join(r0, r1), (BLOCK_K // 64, NB16, 8, 4, 4, 2, 2, 2))  # k64 n16 g c j kh u rh
        w = tl.reshape(tl.permute(v, (1, 7, 2, 0, 4, 5, 3, 6)), (BLOCK_N, BLOCK_K))  # n16 rh g | k64 j kh c u
    else:
        by = tl.reshape(b.to(tl.uint32), (F, 128, 2, 2))
        lo, hi = tl.split(by)  # bytes (0, 2), (1, 3) of each word
        b0, b2 = tl.split(lo)
        b1, b3 = tl.split(hi)
        word = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)  # [F, 128]: lane-major (g, c), then j
        if FMT == W4_INT4_FRAG:  # register r's codes at bits 4r of each half
            r00 = word
            r01 = word >> 4
            r10 = word >> 8
            r11 = word >> 12
        else:
            m = 0x81C081C0
            r00 = word & m
            r01 = (word << 3) & m
            r10 = (word << 6) & m
            r11 = ((word >> 4) & 0x00C000C0) | ((word >> 5) & 0x01000100) | ((word << 1) & 0x80008000)
        t00 = tl.join(_frag_value(r00, False, FMT), _frag_value(r00, True, FMT))  # [F, 128, u]
        t01 = tl.join(_frag_value(r01, False, FMT), _frag_value(r01, True, FMT))
        t10 = tl.join(_frag_value(r10, False, FMT), _frag_value(r10, True, FMT))
        t11 = tl.join(_frag_value(r11, False, FMT), _frag_value(r11, True, FMT))
        v = tl.join(tl.join(t00, t01), tl.join(t10, t11))  # [F, 128, u, kh, rh]
        v = tl.reshape(v, (BLOCK_K // 64, NB16, 8, 4, 4, 2, 2, 2))  # k64 n16 g c j u kh rh
        w = tl.reshape(tl.permute(v, (1, 7, 2, 0, 4, 6, 3, 5)), (BLOCK_N, BLOCK_K))  # n16 rh g | k64 j kh c u
        sc = tl.load(s_ptrs, mask=ok[:, None], other=0.0)
        if FMT == W4_MXFP4_FRAG:
            sv = _w4_scale(sc, W4_MXFP4)
        elif FMT == W4_NVFP4_FRAG:  # s * 2^-8, as the PTX decode's tile
            sv = _frag_multiplier(sc, FMT).to(tl.float32) * TWO_M126
        else:
            sv = sc.to(tl.float32)
        s = tl.reshape(sv, (BLOCK_K // 64, NB16, 8, 2, JG))  # k64 n16 g rh jg (G128: a chunk's half)
        s = tl.reshape(tl.permute(s, (1, 3, 2, 0, 4)), (BLOCK_N, (BLOCK_K // 64) * JG))  # n16 rh g | k64 jg
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, (BLOCK_K // 64) * JG, 64 // JG)), (BLOCK_N, BLOCK_K))
        if W_ZERO:  # the zero points through the scales' permutation
            z = tl.reshape(tl.load(z_ptrs, mask=ok[:, None], other=0.0).to(tl.float32), (BLOCK_K // 64, NB16, 8, 2, JG))
            z = tl.reshape(tl.permute(z, (1, 3, 2, 0, 4)), (BLOCK_N, (BLOCK_K // 64) * JG))
            z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, (BLOCK_K // 64) * JG, 64 // JG)), (BLOCK_N, BLOCK_K))
            w = w - z
        w = (w * s).to(DTYPE)
    return w


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Programmatic dependent launch (sm90+, `launch_pdl=True`): wait for the previous kernel in
    the stream to finish (and its writes to be visible) before touching memory."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_release(PDL: tl.constexpr):
    """Let the next kernel's programs launch (they wait in `_pdl_wait` until this one finishes):
    its launch and prologue overlap this kernel's tail."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """`_pdl_wait` then `_pdl_release`, for the short kernels (alignment, activation, reduce)."""
    _pdl_wait(PDL)
    _pdl_release(PDL)


@triton.jit
def _grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile number `tile`, in groups of GROUP_M row blocks that sweep all N
    tiles together: a row block's activations and an expert's weight tiles are reused from L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _tile_ids(num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program (`_grouped_tile` of its program id)."""
    return _grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)


@triton.jit
def _gemm1_epilogue(acc_g, acc_u, slot, row_ok, expert, offs_n, n_ok, b13_ptr, topk_w_ptr,
                    stride_be, stride_bn, inter, alpha, limit,
                    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr):
    """(router weight on input) -> + bias -> activation, on fp32 accumulators."""
    if SCALE_ROWS:  # router weight on input: (w * x) @ W^T == w * (x @ W^T), before the bias
        w = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc_g = acc_g * w[:, None]
        acc_u = acc_u * w[:, None]
    if HAS_BIAS:
        b_base = b13_ptr + expert * stride_be
        acc_g += tl.load(b_base + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_base + (offs_n + inter) * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return _activation(acc_g, acc_u, alpha, limit, ACT, HAS_LIMIT)


@triton.jit
def _direct_slot(ids_ptr, emap_ptr, pid, num_slots, num_global, num_local, HAS_MAP: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """DIRECT row block `pid` = slot pid alone: (its local expert, num_local when it has none;
    [BLOCK_M] slots with lane 0 = pid and the padding lanes = num_slots; lane 0 mask)."""
    e = tl.load(ids_ptr + pid).to(tl.int64)
    ok = (e >= 0) & (e < num_global)
    if HAS_MAP:
        e = tl.load(emap_ptr + tl.where(ok, e, 0)).to(tl.int64)
        ok = ok & (e >= 0) & (e < num_local)  # a map entry past the local experts: unvalidated input
    lanes = tl.arange(0, BLOCK_M)
    row_ok = lanes == 0
    return tl.where(ok, e, num_local), tl.where(row_ok, pid, num_slots), row_ok


@triton.jit
def _xq_scale(x_row_ptr, row_w_ptr, hidden, stride_xh, IS_INT: tl.constexpr, ROW_W: tl.constexpr,
              WIDTH: tl.constexpr):
    """FUSE_XQ: (the router weight x is scaled by, or 1; the row's scale) from one read of the
    row, as quantize_rows_kernel takes them."""
    offs = tl.arange(0, WIDTH)
    v = tl.load(x_row_ptr + offs * stride_xh, mask=offs < hidden, other=0.0).to(tl.float32)
    w = 1.0
    if ROW_W:
        w = tl.load(row_w_ptr).to(tl.float32)
        v = v * w
    return w, _scale_for(tl.reduce(tl.abs(v), 0, _max_nan), IS_INT)


@triton.jit
def _xq_codes(x_ptrs, k_ok, w, scale, row_ok, IS_INT: tl.constexpr, ROW_W: tl.constexpr,
              SOFT_FP8: tl.constexpr, CODE: tl.constexpr):
    """FUSE_XQ: one K step of the token row's codes (quant_kernels._quantize of x (* w) / scale)
    as the [BLOCK_M, BLOCK_K] operand, row 0 live, the padding rows 0."""
    v = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
    if ROW_W:
        v = v * w
    q = _quantize(v, scale, IS_INT, SOFT_FP8)
    return tl.where(row_ok[:, None], q[None, :], 0.0).to(CODE)


@triton.jit
def _gemm1_tile(
    pid_m, pid_n, pid_s, expert, rows, slot, row_ok,
    x_ptr, w13_ptr, b13_ptr, a_ptr, topk_w_ptr, hpart_ptr, top_k, hidden, inter, k_per_split,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn, stride_ar, stride_ai,
    stride_hs, stride_hr, alpha, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    xs_ptr, ws_ptr, aq_ptr, as_ptr, stride_xs0, stride_xs1, stride_ws0, stride_ws1, stride_ws2,
    stride_aqr, stride_aqi, stride_asr, stride_asg,
    QUANT: tl.constexpr, X_SORTED: tl.constexpr, ACC_INT: tl.constexpr, SOFT_FP8: tl.constexpr,
    FUSE_AQ: tl.constexpr, UP_UNIFORM: tl.constexpr, amax_ptr, A_AMAX: tl.constexpr,
    wgs_ptr, W4_FMT: tl.constexpr, W_GROUP: tl.constexpr, PTX_DECODE: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr, W_DESC: tl.constexpr, DIRECT: tl.constexpr, SWAP_AB: tl.constexpr,
    FP8_PROMOTE: tl.constexpr, FUSE_XQ: tl.constexpr, XQ_WIDTH: tl.constexpr, XQ_ROW_W: tl.constexpr,
    ONE_DOT: tl.constexpr, RS_SYNC: tl.constexpr, wz_ptr, W_ZERO: tl.constexpr,
):
    """One (row block, N tile, K share) of moe_gemm1_kernel (its docstring): the row block's
    expert, aligned rows, slots and live lanes come from the caller."""
    if X_SORTED:  # noqa: SIM108 (constexpr branch)
        x_row = rows.to(tl.int64)
    else:
        x_row = (slot // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, hidden)

    x_ptrs = x_ptr + x_row[:, None] * stride_xt + (k_start + offs_k)[None, :] * stride_xh
    if W_DESC:
        w_row = (expert * (2 * inter if GATED else inter) + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_base = w13_ptr + expert * stride_we
        wg_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None] * stride_wh
        wu_ptrs = wg_ptrs + inter * stride_wn
    FRAG: tl.constexpr = QUANT == Q_W4 and W4_FMT >= W4_MXFP4_FRAG  # fragment-layout 4-bit weights
    if ONE_DOT and FRAG:
        tl.static_assert(GATED, "ONE_DOT: a gated GEMM1")
        acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)  # swapped: weight rows first
    elif ONE_DOT:
        tl.static_assert(GATED and QUANT == Q_NONE, "ONE_DOT: the unquantized gated GEMM1")
        j = tl.arange(0, 2 * BLOCK_N) % BLOCK_N
        n_ok2 = pid_n * BLOCK_N + j < inter  # both halves' rows inside I
        if not W_DESC:  # gate rows n0 + j, then up rows I + n0 + j
            offs_w = tl.where(tl.arange(0, 2 * BLOCK_N) < BLOCK_N, 0, inter) + pid_n * BLOCK_N + j
            w_ptrs = w_base + offs_w[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None] * stride_wh
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    if QUANT != Q_NONE:
        ws_base = ws_ptr + expert * stride_ws0
    if FUSE_XQ:  # the slot's token row and its scale
        x_tok_ptr = x_ptr + (pid_m // top_k).to(tl.int64) * stride_xt
        xq_w, xs_tok = _xq_scale(x_tok_ptr, topk_w_ptr + pid_m, hidden, stride_xh, ACC_INT, XQ_ROW_W, XQ_WIDTH)
    SWAPPED: tl.constexpr = SWAP_AB or FRAG
    acc_g = _acc_zeros(BLOCK_M, BLOCK_N, ACC_INT, SWAPPED)
    acc_u = _acc_zeros(BLOCK_M, BLOCK_N, ACC_INT, SWAPPED)
    if QUANT == Q_W4:  # pointers of byte j (k = 2j, 2j + 1) and of its group scale, from k0
        offs_j = tl.arange(0, BLOCK_K // 2)
        x_rows = x_ptr + x_row[:, None] * stride_xt
        wq_cols = w_base + offs_n[None, :].to(tl.int64) * stride_wn
        sq_cols = ws_base + offs_n[None, :] * stride_ws1
        zq_cols = sq_cols
        if W_ZERO:  # the zero points, laid as the scales
            zq_cols = wz_ptr + expert * stride_ws0 + offs_n[None, :] * stride_ws1
    # FRAG_INC: the fragments' code and scale pointers made once, at k_start, and advanced by
    # constants per K step (no k // 64 or 64-bit offset arithmetic in the loop: Qwen3-30B mxfp4
    # 16 x 64 x 64, 277 -> 268 SASS instructions a step). Taken for K steps of 128 and more, whole
    # scale chunks each. GEMM1 alone, HEAD fb2ab66 -> this: H100, 128- and 256-wide steps -6% to
    # +3% on Qwen3-30B / DeepSeek-V3 / gpt-oss / Qwen3-235B (+6% once, a one-dot 16 x 32 x 128);
    # H200 DeepSeek-V3 M=64 16 x 64 x 256 -2% to -5%. 64-wide steps swung -33% to +11% by shape
    # (a 4-stage 16 x 64 x 64 tile: Qwen3-30B M=16 +10%, the H200 table's tile there), so they keep
    # the addresses computed per step (results/2026-11-27_h100_fb2ab66_frag_incremental_ab.txt).
    # GEMM2 keeps them too: incremental, its persistent 16 x 256 x 64 launch ran 118 -> 172 us.
    FRAG_GF: tl.constexpr = 64 if W_GROUP < 64 else W_GROUP  # k per scale chunk (_w4_frag_ptrs)
    FRAG_INC: tl.constexpr = FRAG and BLOCK_K >= 128 and BLOCK_K % FRAG_GF == 0
    FRAG_B_STEP: tl.constexpr = (BLOCK_K // 64) * 512  # bytes: a fragment is 16 x 64 codes
    FRAG_S_STEP: tl.constexpr = (BLOCK_K // FRAG_GF) * 16 * (FRAG_GF // W_GROUP)  # scales
    if FRAG_INC:
        gb, gs, gok, ub, us, uok = _w4_frag_gemm1_ptrs(w_base, ws_base, stride_ws1, pid_n, inter, k_start, hidden,
                                                       W4_FMT, W_GROUP, BLOCK_N, BLOCK_K, PTX_DECODE, ONE_DOT, GATED)
        gz, uz = gs, us
        if W_ZERO:  # the zero points' runs, laid as the scales'
            _, gz, _, _, uz, _ = _w4_frag_gemm1_ptrs(w_base, wz_ptr + expert * stride_ws0, stride_ws1, pid_n, inter,
                                                     k_start, hidden, W4_FMT, W_GROUP, BLOCK_N, BLOCK_K, PTX_DECODE,
                                                     ONE_DOT, GATED)
    for k0 in range(k_start, k_end, BLOCK_K):
        if FRAG:  # w tile @ x rows^T: the decoded tile is the dot's register operand
            # K masks kept on whole steps too (EVEN_K): dropping them here, as GEMM2 does, cut the
            # K step's SASS 277 -> 270 instructions but ran Qwen3-30B M=16 10% slower (H200,
            # results/2026-11-27_h200_c421706_frag_even_k_ab.txt)
            k_ok = offs_k < k_end - k0
            if FRAG_INC:  # the pointers the last step advanced
                xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                x_ptrs += BLOCK_K * stride_xh
            else:  # this step's addresses afresh (`_w4_frag_tile`'s)
                xa = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :],
                             other=0.0)
                gb, gs, gok, ub, us, uok = _w4_frag_gemm1_ptrs(w_base, ws_base, stride_ws1, pid_n, inter, k0,
                                                               hidden, W4_FMT, W_GROUP, BLOCK_N, BLOCK_K, PTX_DECODE,
                                                               ONE_DOT, GATED)
                gz, uz = gs, us
                if W_ZERO:
                    _, gz, _, _, uz, _ = _w4_frag_gemm1_ptrs(w_base, wz_ptr + expert * stride_ws0, stride_ws1, pid_n,
                                                             inter, k0, hidden, W4_FMT, W_GROUP, BLOCK_N, BLOCK_K,
                                                             PTX_DECODE, ONE_DOT, GATED)
            if ONE_DOT:  # gate and up rows as one fragment tile, one dot
                wt = _w4_frag_decode(gb, gs, _w4_frag_kmask(gok, k0, k_end, 2 * BLOCK_N, BLOCK_K, FRAG_INC), W4_FMT,
                                     W_GROUP, 2 * BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, PTX_DECODE, gz, W_ZERO)
                acc = _rs_sync(_dot(wt, tl.trans(xa), acc, IEEE, False), RS_SYNC)
            else:
                wt = _w4_frag_decode(gb, gs, _w4_frag_kmask(gok, k0, k_end, BLOCK_N, BLOCK_K, FRAG_INC), W4_FMT,
                                     W_GROUP, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, PTX_DECODE, gz, W_ZERO)
                acc_g = _rs_sync(_dot(wt, tl.trans(xa), acc_g, IEEE, False), RS_SYNC)
                if GATED:
                    wt = _w4_frag_decode(ub, us, _w4_frag_kmask(uok, k0, k_end, BLOCK_N, BLOCK_K, FRAG_INC), W4_FMT,
                                         W_GROUP, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, PTX_DECODE, uz, W_ZERO)
                    acc_u = _rs_sync(_dot(wt, tl.trans(xa), acc_u, IEEE, False), RS_SYNC)
                    if FRAG_INC:
                        ub += FRAG_B_STEP
                        us += FRAG_S_STEP
                        uz += FRAG_S_STEP
            if FRAG_INC:
                gb += FRAG_B_STEP
                gs += FRAG_S_STEP
                gz += FRAG_S_STEP
        elif QUANT == Q_W4:
            # x read contiguously and split into its even / odd columns in registers (two
            # stride-2 loads cost more than the whole decode: H200, benchmarks/bench_w4_decode.py)
            k_ok = offs_k < k_end - k0
            xa = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(xa, (BLOCK_M, BLOCK_K // 2, 2)))
            # whole K steps (EVEN_K) need no K mask; else the mask in byte indices (k_end is
            # even), constant over 8 bytes, so the loads still vectorize
            w_mask = n_ok[None, :] if EVEN_K else (offs_j < (k_end - k0) // 2)[:, None] & n_ok[None, :]
            j0 = tl.multiple_of(k0 // 2, BLOCK_K // 2)  # K shares start on BLOCK_K multiples: 16 B aligned
            w_off = (j0 + offs_j)[:, None] * stride_wh
            lo, hi = _w4_tiles(wq_cols + w_off, sq_cols, w_mask, n_ok, k0, k_end, stride_ws2, W4_FMT, W_GROUP,
                               BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty, PTX_DECODE, zq_cols, W_ZERO)
            acc_g = _dot(x_odd, hi, _dot(x_even, lo, acc_g, IEEE, False), IEEE, False)
            if GATED:
                lo, hi = _w4_tiles(wq_cols + inter * stride_wn + w_off, sq_cols + inter * stride_ws1, w_mask, n_ok,
                                   k0, k_end, stride_ws2, W4_FMT, W_GROUP, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty,
                                   PTX_DECODE, zq_cols + inter * stride_ws1, W_ZERO)
                acc_u = _dot(x_odd, hi, _dot(x_even, lo, acc_u, IEEE, False), IEEE, False)
        elif ONE_DOT:
            k_ok = offs_k < k_end - k0
            xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if W_DESC:
                w = w13_ptr.load([2 * expert.to(tl.int32), pid_n * BLOCK_N, k0])
                w = tl.reshape(w, (2 * BLOCK_N, BLOCK_K)).T
            else:
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok2[None, :], other=0.0)
                w_ptrs += BLOCK_K * stride_wh
            acc = _dot(xa, w, acc, IEEE, False)
            x_ptrs += BLOCK_K * stride_xh
        else:
            k_ok = offs_k < k_end - k0
            if FUSE_XQ:
                xa = _xq_codes(x_tok_ptr + (k0 + offs_k) * stride_xh, k_ok, xq_w, xs_tok, row_ok, ACC_INT,
                               XQ_ROW_W, SOFT_FP8, w13_ptr.dtype.element_ty)
            else:
                xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if W_DESC:
                wg = w13_ptr.load([w_row, k0]).T
            else:
                wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if QUANT == Q_W8:  # fp8 / int8 codes are exact in bf16 / fp16
                wg = _w8_codes(wg, x_ptr.dtype.element_ty, PTX_DECODE)
            if QUANT == Q_BLOCK:  # this K step lies in one 128-wide scale block (BLOCK_K divides 128)
                # and so does the N tile (BLOCK_N divides 128): one weight scale per step, a
                # scalar; the up half's too when I is a multiple of BLOCK_N (UP_UNIFORM)
                kb = k0 // 128
                sx = tl.load(xs_ptr + x_row * stride_xs0 + kb * stride_xs1, mask=row_ok, other=0.0)
                sg = tl.load(ws_base + (pid_n * BLOCK_N // 128) * stride_ws1 + kb * stride_ws2).to(tl.float32)
                acc_g += _mma(xa, wg, SWAP_AB) * _per_row(sx * sg, SWAP_AB)
            else:
                acc_g = _dot_acc(xa, wg, acc_g, IEEE, SWAP_AB, FP8_PROMOTE)
            if GATED:
                if W_DESC:
                    wu = w13_ptr.load([w_row + inter, k0]).T
                else:
                    wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if QUANT == Q_W8:
                    wu = _w8_codes(wu, x_ptr.dtype.element_ty, PTX_DECODE)
                if QUANT == Q_BLOCK:
                    if UP_UNIFORM:
                        su = tl.load(ws_base + ((pid_n * BLOCK_N + inter) // 128) * stride_ws1
                                     + kb * stride_ws2).to(tl.float32)
                        acc_u += _mma(xa, wu, SWAP_AB) * _per_row(sx * su, SWAP_AB)
                    else:  # the N tile straddles two scale blocks of the up rows
                        su = tl.load(ws_base + ((offs_n + inter) // 128) * stride_ws1 + kb * stride_ws2,
                                     mask=n_ok, other=0.0)
                        acc_u += _mma(xa, wu, SWAP_AB) * (_per_row(sx, SWAP_AB) * _per_col(su.to(tl.float32), SWAP_AB))
                else:
                    acc_u = _dot_acc(xa, wu, acc_u, IEEE, SWAP_AB, FP8_PROMOTE)
            x_ptrs += BLOCK_K * stride_xh
            if not W_DESC:
                wg_ptrs += BLOCK_K * stride_wh
                wu_ptrs += BLOCK_K * stride_wh
    _pdl_release(PDL)  # the K loop is done: the next kernel may launch
    if ONE_DOT and FRAG:  # rows [0, BLOCK_N) are gate, [BLOCK_N, 2 * BLOCK_N) up (swapped)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    elif ONE_DOT:  # columns [0, BLOCK_N) are gate, [BLOCK_N, 2 * BLOCK_N) up
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    if SWAPPED:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)

    if QUANT == Q_CHANNEL:
        if FUSE_XQ:
            sx = tl.where(row_ok, xs_tok, 0.0)[:, None]
        else:
            sx = tl.load(xs_ptr + x_row * stride_xs0, mask=row_ok, other=0.0)[:, None]
        sg = tl.load(ws_base + offs_n * stride_ws1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_g = acc_g.to(tl.float32) * sx * sg
        if GATED:
            su = tl.load(ws_base + (offs_n + inter) * stride_ws1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u = acc_u.to(tl.float32) * sx * su
        else:
            acc_u = acc_u.to(tl.float32)
    elif QUANT == Q_W8:
        acc_g = acc_g * tl.load(ws_base + offs_n * stride_ws1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u = acc_u * tl.load(ws_base + (offs_n + inter) * stride_ws1, mask=n_ok,
                                    other=0.0).to(tl.float32)[None, :]
    elif QUANT == Q_W4 and (W4_FMT == W4_NVFP4 or W4_FMT == W4_NVFP4_FRAG):  # noqa: SIM109 (constexprs)
        global_scale = _w4_global(tl.load(wgs_ptr + expert).to(tl.float32), W4_FMT)
        acc_g = acc_g * global_scale
        acc_u = acc_u * global_scale

    store_ok = n_ok[None, :] & row_ok[:, None] if DIRECT else n_ok[None, :]  # padding rows are rows of a
    if SPLIT_K > 1:
        h_ptrs = hpart_ptr + pid_s * stride_hs + rows.to(tl.int64)[:, None] * stride_hr + offs_n[None, :]
        tl.store(h_ptrs, acc_g, mask=store_ok)
        if GATED:
            tl.store(h_ptrs + inter, acc_u, mask=store_ok)
    else:
        act = _gemm1_epilogue(acc_g, acc_u, slot, row_ok, expert, offs_n, n_ok, b13_ptr, topk_w_ptr,
                              stride_be, stride_bn, inter, alpha, limit,
                              GATED, ACT, HAS_LIMIT, HAS_BIAS, SCALE_ROWS)
        if FUSE_AQ:  # BLOCK_N == 128: this tile holds whole 1x128 groups of the intermediate
            # quantized from the activation dtype a is stored in, as the unfused path reads it
            act = tl.where(n_ok[None, :], act.to(a_ptr.dtype.element_ty).to(tl.float32), 0.0)
            a_scale = _scale_of(tl.reduce(tl.abs(act), 1, _max_nan), FP8_MAX)
            q = _quantize(act, a_scale[:, None], False, SOFT_FP8)
            rows64 = rows.to(tl.int64)
            tl.store(aq_ptr + rows64[:, None] * stride_aqr + offs_n[None, :] * stride_aqi,
                     q.to(aq_ptr.dtype.element_ty), mask=store_ok)
            # DIRECT: the padding lanes point at row num_slots, past a: row 0 alone is stored
            tl.store(as_ptr + rows64 * stride_asr + pid_n * stride_asg, a_scale, mask=tl.sum(store_ok, 1) > 0)
        else:
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_n[None, :] * stride_ai
            stored = act.to(a_ptr.dtype.element_ty)
            tl.store(a_ptrs, stored, mask=store_ok)
            if A_AMAX:  # the amax of what is stored, which the quantization reads
                _amax_update(amax_ptr + expert, stored.to(tl.float32), row_ok, n_ok)


@triton.jit
def moe_gemm1_kernel(
    x_ptr, w13_ptr, b13_ptr, a_ptr, topk_w_ptr, hpart_ptr,
    sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, top_k, hidden, inter, k_per_split,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wh,
    stride_be, stride_bn,
    stride_ar, stride_ai,
    stride_hs, stride_hr,
    alpha, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    # W8A8: x scales (Q_CHANNEL [T], or [R] with X_SORTED; Q_BLOCK [T, H/128]), w13 scales
    # ([L, G], [L] at channel stride 0, [L, G/128, H/128]); FUSE_AQ also quantizes the output
    # per 1x128 (aq, a_s). X_SORTED: x is [R, H], read by sorted row instead of token.
    # Weight-only: Q_W8 ws [L, G]; Q_W4 ws [L, G, H / W_GROUP], w13 bytes [L, G, H / 2], nvfp4
    # global scales wgs [L].
    xs_ptr=None, ws_ptr=None, aq_ptr=None, as_ptr=None,
    stride_xs0=0, stride_xs1=0, stride_ws0=0, stride_ws1=0, stride_ws2=0,
    stride_aqr=0, stride_aqi=0, stride_asr=0, stride_asg=0,
    QUANT: tl.constexpr = 0, X_SORTED: tl.constexpr = False,
    ACC_INT: tl.constexpr = False, SOFT_FP8: tl.constexpr = False, FUSE_AQ: tl.constexpr = False,
    UP_UNIFORM: tl.constexpr = False,
    # A_AMAX (per-tensor fp8, dynamic): amax_ptr[e] = max(amax_ptr[e], |a| over this tile's live
    # rows), the intermediate's per-expert amax taken where it is finished (no pass over a)
    amax_ptr=None, A_AMAX: tl.constexpr = False,
    wgs_ptr=None, W4_FMT: tl.constexpr = 0, W_GROUP: tl.constexpr = 32, PTX_DECODE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
    PDL: tl.constexpr = False,
    W_DESC: tl.constexpr = False,
    # DIRECT (decode, no alignment): row block b is slot b alone (row 0 live), its expert read
    # from the top-k ids (ids_ptr, through emap_ptr when HAS_MAP); a / hpart rows are slots.
    ids_ptr=None, emap_ptr=None, num_global=0, num_local=0,
    DIRECT: tl.constexpr = False, HAS_MAP: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,
    FP8_PROMOTE: tl.constexpr = False,  # fp8 codes: add each K step's product in fp32 (_dot)
    # FUSE_XQ (DIRECT W8A8 with per-token activation codes, Q_CHANNEL): x_ptr is the float x,
    # quantized here as quantize_rows_kernel does (the same codes and scale): the slot's token
    # row, XQ_WIDTH >= H wide, is read once for its amax, then each K step's codes are made from
    # its x tile (times the slot's router weight first: XQ_ROW_W)
    FUSE_XQ: tl.constexpr = False, XQ_WIDTH: tl.constexpr = 128, XQ_ROW_W: tl.constexpr = False,
    ONE_DOT: tl.constexpr = False,
    RS_SYNC: tl.constexpr = False,  # _rs_sync: the fragment dots wait for their wgmma (GPU compiles)
    PERSISTENT: tl.constexpr = False,
    # W_ZERO (asymmetric int4, checkpoint layout): wz [L, G, H / W_GROUP] zero points with ws's strides
    wz_ptr=None, W_ZERO: tl.constexpr = False,
):
    """a[r, n] = act(sum_h x[token(r), h] * w13[e, n, h] (+ up half)) for one row block and N tile.

    SPLIT_K > 1 (few rows, e.g. decode): program (m, n, s) sums only its share of H and stores
    the raw fp32 gate/up partials in hpart[s, r, :]; moe_act_kernel finishes the rows.
    Quantized: the partials / outputs are dequantized (scales applied) before either path.
    W_DESC (unquantized, SPLIT_K == 1): w13_ptr is a TMA descriptor over w13 viewed [L*G, H] with
    [BLOCK_N, BLOCK_K] boxes: the gate tile at row e*G + n0, the up tile at e*G + I + n0. Tail
    tiles read the next rows (up rows, the next expert, or TMA's zero fill past L*G), masked at
    the store; past H the box is zero-filled.
    ONE_DOT (TileConfig.one_dot; unquantized, gated): the gate tile and the up tile are one
    [2*BLOCK_N, BLOCK_K] operand (gate rows over up rows) of one dot per K step, and the
    accumulator's two halves are gate and up. With W_DESC, w13_ptr is a 3D descriptor over w13
    viewed [2L, I, H] with [2, BLOCK_N, BLOCK_K] boxes at (2e, n0, k0), zero-filled past I and H.
    One wgmma of twice the width replaces two (H200, GEMM1 alone, 128 x 2*128 x 64, 8 warps:
    gpt-oss-120b M=4096 1624-1659 -> 1475 us, Mixtral M=4096 3474-3527 -> 3192 us;
    benchmarks/bench_interleaved_gemm1.py --forms library, results/2026-11-27_h200_bdb1fac_one_dot_gemm1.txt).
    PERSISTENT (TileConfig.persistent; unquantized, aligned, SPLIT_K == 1): the grid (one
    program per SM) strides over the real (row block, N tile) tiles in one flattened loop, so a
    tile's epilogue overlaps the next one's loads; each tile runs `_gemm1_tile`, the same body as
    a program per tile, so the output is the same bit for bit.
    """
    tl.static_assert(not SWAP_AB or QUANT == Q_CHANNEL or QUANT == Q_BLOCK, "SWAP_AB: W8A8 codes only")  # noqa: SIM109
    tl.static_assert(not FUSE_XQ or (DIRECT and QUANT == Q_CHANNEL), "FUSE_XQ: direct per-token W8A8")
    tl.static_assert(not PERSISTENT or (QUANT == Q_NONE and SPLIT_K == 1 and not DIRECT),
                     "PERSISTENT: the aligned path's unquantized GEMM1, K unsplit")
    _pdl_wait(PDL)
    num_n = tl.cdiv(inter, BLOCK_N)
    if PERSISTENT:  # the grid's programs stride over the real (row block, N tile) tiles, one loop
        # (flatten: the next tile's loads are issued during this one's epilogue)
        num_m = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
            pid_s = 0
            expert, rows, slot, row_ok = _row_block(pid_m, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
            _gemm1_tile(
                pid_m, pid_n, pid_s, expert, rows, slot, row_ok, x_ptr, w13_ptr, b13_ptr, a_ptr, topk_w_ptr, hpart_ptr,
                top_k, hidden, inter, k_per_split, stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be,
                stride_bn, stride_ar, stride_ai, stride_hs, stride_hr, alpha, limit, GATED, ACT, HAS_LIMIT, HAS_BIAS,
                SCALE_ROWS, IEEE, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, xs_ptr, ws_ptr, aq_ptr, as_ptr, stride_xs0,
                stride_xs1, stride_ws0, stride_ws1, stride_ws2, stride_aqr, stride_aqi, stride_asr, stride_asg, QUANT,
                X_SORTED, ACC_INT, SOFT_FP8, FUSE_AQ, UP_UNIFORM, amax_ptr, A_AMAX, wgs_ptr, W4_FMT, W_GROUP,
                PTX_DECODE, EVEN_K, PDL, W_DESC, DIRECT, SWAP_AB, FP8_PROMOTE, FUSE_XQ, XQ_WIDTH, XQ_ROW_W, ONE_DOT,
                RS_SYNC, wz_ptr, W_ZERO)
    else:
        pid_m, pid_n = _tile_ids(tl.num_programs(0) // num_n, num_n, GROUP_M)
        pid_s = tl.program_id(1)
        if DIRECT:
            expert, slot, row_ok = _direct_slot(ids_ptr, emap_ptr, pid_m, num_slots, num_global, num_local,
                                                HAS_MAP, BLOCK_M)
            if expert >= num_local:  # routed to no local expert: nothing reads this slot's row
                return
            rows = slot
        else:
            if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
                return
            expert, rows, slot, row_ok = _row_block(pid_m, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
        _gemm1_tile(
            pid_m, pid_n, pid_s, expert, rows, slot, row_ok, x_ptr, w13_ptr, b13_ptr, a_ptr, topk_w_ptr, hpart_ptr,
            top_k, hidden, inter, k_per_split, stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be,
            stride_bn, stride_ar, stride_ai, stride_hs, stride_hr, alpha, limit, GATED, ACT, HAS_LIMIT, HAS_BIAS,
            SCALE_ROWS, IEEE, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, xs_ptr, ws_ptr, aq_ptr, as_ptr, stride_xs0,
            stride_xs1, stride_ws0, stride_ws1, stride_ws2, stride_aqr, stride_aqi, stride_asr, stride_asg, QUANT,
            X_SORTED, ACC_INT, SOFT_FP8, FUSE_AQ, UP_UNIFORM, amax_ptr, A_AMAX, wgs_ptr, W4_FMT, W_GROUP,
            PTX_DECODE, EVEN_K, PDL, W_DESC, DIRECT, SWAP_AB, FP8_PROMOTE, FUSE_XQ, XQ_WIDTH, XQ_ROW_W, ONE_DOT,
            RS_SYNC, wz_ptr, W_ZERO)


@triton.jit
def moe_act_kernel(
    hpart_ptr, b13_ptr, a_ptr, topk_w_ptr,
    sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, inter,
    stride_be, stride_bn, stride_ar, stride_ai, stride_hs, stride_hr,
    alpha, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
    ids_ptr=None, emap_ptr=None, num_global=0, num_local=0,
    DIRECT: tl.constexpr = False, HAS_MAP: tl.constexpr = False,
    amax_ptr=None, A_AMAX: tl.constexpr = False,
):
    """a[r, n] = act(sum_s hpart[s, r, n] ...): the split-K GEMM1 partials, summed in split order.
    DIRECT: rows are slots, as in moe_gemm1_kernel; A_AMAX as there."""
    _pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DIRECT:
        expert, slot, row_ok = _direct_slot(ids_ptr, emap_ptr, pid_m, num_slots, num_global, num_local,
                                            HAS_MAP, BLOCK_M)
        if expert >= num_local:
            return
        rows = slot
    else:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
        expert, rows, slot, row_ok = _row_block(pid_m, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    ok = n_ok[None, :] & row_ok[:, None] if DIRECT else n_ok[None, :]  # padding rows are rows of a
    h_ptrs = hpart_ptr + rows.to(tl.int64)[:, None] * stride_hr + offs_n[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc_g += tl.load(h_ptrs + s * stride_hs, mask=ok, other=0.0)
        if GATED:
            acc_u += tl.load(h_ptrs + s * stride_hs + inter, mask=ok, other=0.0)
    act = _gemm1_epilogue(acc_g, acc_u, slot, row_ok, expert, offs_n, n_ok, b13_ptr, topk_w_ptr,
                          stride_be, stride_bn, inter, alpha, limit,
                          GATED, ACT, HAS_LIMIT, HAS_BIAS, SCALE_ROWS)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_n[None, :] * stride_ai
    stored = act.to(a_ptr.dtype.element_ty)
    tl.store(a_ptrs, stored, mask=ok)
    if A_AMAX:  # the amax of what is stored
        _amax_update(amax_ptr + expert, stored.to(tl.float32), row_ok, n_ok)


@triton.jit
def _gemm2_tile(pid_m, pid_n, a_ptr, w2_ptr, b2_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr, num_slots,
                hidden, inter, stride_ar, stride_ai, stride_we, stride_wh, stride_wi, stride_be, stride_bh, stride_ys,
                stride_yh, HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, as_ptr, ws_ptr, stride_as0,
                stride_as1, stride_ws0, stride_ws1, stride_ws2, QUANT: tl.constexpr, ACC_INT: tl.constexpr, wgs_ptr,
                W4_FMT: tl.constexpr, W_GROUP: tl.constexpr, PTX_DECODE: tl.constexpr, EVEN_K: tl.constexpr,
                PDL: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, SWAP_AB: tl.constexpr,
                FP8_PROMOTE: tl.constexpr, RS_SYNC: tl.constexpr, wz_ptr, W_ZERO: tl.constexpr):
    """One (row block, N tile) of moe_gemm2_kernel (its docstring)."""
    expert, rows, slot, row_ok = _row_block(pid_m, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)

    if not A_DESC:
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_k[None, :] * stride_ai
    if W_DESC:
        w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = (w2_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wh
                  + offs_k[:, None] * stride_wi)
    if QUANT != Q_NONE:
        ws_base = ws_ptr + expert * stride_ws0
    FRAG: tl.constexpr = QUANT == Q_W4 and W4_FMT >= W4_MXFP4_FRAG  # as in moe_gemm1_kernel
    SWAPPED: tl.constexpr = SWAP_AB or FRAG
    acc = _acc_zeros(BLOCK_M, BLOCK_N, ACC_INT, SWAPPED)
    if QUANT == Q_W4:  # as in moe_gemm1_kernel
        offs_j = tl.arange(0, BLOCK_K // 2)
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_ar
        wq_cols = w2_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wh
        sq_cols = ws_base + offs_n[None, :] * stride_ws1
        zq_cols = sq_cols
        if W_ZERO:
            zq_cols = wz_ptr + expert * stride_ws0 + offs_n[None, :] * stride_ws1
    for k0 in range(0, inter, BLOCK_K):
        if FRAG:  # as in moe_gemm1_kernel, but whole K steps (EVEN_K) load unmasked along K: H200,
            # GEMM2 alone, 0 to -4.5% (DeepSeek-V3 M=16 76.5 -> 73.3 us; c421706_frag_even_k_ab.txt)
            if EVEN_K:  # noqa: SIM108 (constexpr branch)
                a_mask = row_ok[:, None]
            else:
                a_mask = row_ok[:, None] & (offs_k < inter - k0)[None, :]
            aa = tl.load(a_rows + (k0 + offs_k)[None, :] * stride_ai, mask=a_mask, other=0.0)
            zb = ws_base
            if W_ZERO:  # the zero points, laid as the scales
                zb = wz_ptr + expert * stride_ws0
            wt = _w4_frag_tile(w2_ptr + expert * stride_we, ws_base, stride_ws1, pid_n * (BLOCK_N // 16),
                               hidden // 16, k0, inter, inter, W4_FMT, W_GROUP, BLOCK_N, BLOCK_K,
                               a_ptr.dtype.element_ty, PTX_DECODE, EVEN_K, z_ptr=zb, W_ZERO=W_ZERO)
            acc = _rs_sync(_dot(wt, tl.trans(aa), acc, IEEE, False), RS_SYNC)
        elif QUANT == Q_W4:  # as in moe_gemm1_kernel
            k_ok = offs_k < inter - k0
            aa = tl.load(a_rows + (k0 + offs_k)[None, :] * stride_ai, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_even, a_odd = tl.split(tl.reshape(aa, (BLOCK_M, BLOCK_K // 2, 2)))
            w_mask = n_ok[None, :] if EVEN_K else (offs_j < (inter - k0) // 2)[:, None] & n_ok[None, :]
            j0 = tl.multiple_of(k0 // 2, BLOCK_K // 2)
            lo, hi = _w4_tiles(wq_cols + (j0 + offs_j)[:, None] * stride_wi, sq_cols, w_mask,
                               n_ok, k0, inter, stride_ws2, W4_FMT, W_GROUP, BLOCK_K, BLOCK_N, a_ptr.dtype.element_ty,
                               PTX_DECODE, zq_cols, W_ZERO)
            acc = _dot(a_odd, hi, _dot(a_even, lo, acc, IEEE, False), IEEE, False)
        else:
            k_ok = offs_k < inter - k0
            if A_DESC:
                aa = a_ptr.load([pid_m * BLOCK_M, k0])
            else:
                aa = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if W_DESC:
                ww = w2_ptr.load([w_row, k0]).T
            else:
                ww = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if QUANT == Q_W8:  # fp8 / int8 codes are exact in bf16 / fp16
                ww = _w8_codes(ww, a_ptr.dtype.element_ty, PTX_DECODE)
            if QUANT == Q_BLOCK:  # this K step lies in one 128-wide scale block (BLOCK_K divides 128)
                kb = k0 // 128
                sa = tl.load(as_ptr + rows.to(tl.int64) * stride_as0 + kb * stride_as1, mask=row_ok, other=0.0)
                sw = tl.load(ws_base + (pid_n * BLOCK_N // 128) * stride_ws1 + kb * stride_ws2).to(tl.float32)
                acc += _mma(aa, ww, SWAP_AB) * _per_row(sa * sw, SWAP_AB)  # one scale block per N tile (as gemm1)
            else:
                acc = _dot_acc(aa, ww, acc, IEEE, SWAP_AB, FP8_PROMOTE)
            if not A_DESC:
                a_ptrs += BLOCK_K * stride_ai
            if not W_DESC:
                w_ptrs += BLOCK_K * stride_wi
    _pdl_release(PDL)
    if SWAPPED:
        acc = tl.trans(acc)

    if QUANT == Q_CHANNEL:
        sa = tl.load(as_ptr + rows.to(tl.int64) * stride_as0, mask=row_ok, other=0.0)
        sw = tl.load(ws_base + offs_n * stride_ws1, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc.to(tl.float32) * sa[:, None] * sw[None, :]
    elif QUANT == Q_W8:
        acc = acc * tl.load(ws_base + offs_n * stride_ws1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    elif QUANT == Q_W4 and (W4_FMT == W4_NVFP4 or W4_FMT == W4_NVFP4_FRAG):  # noqa: SIM109 (constexprs)
        acc = acc * _w4_global(tl.load(wgs_ptr + expert).to(tl.float32), W4_FMT)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * stride_be + offs_n * stride_bh, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SCALE_ROWS:  # the routed weight, unless it was applied to the input (or by a combine)
        w = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    y_ptrs = y_ptr + slot.to(tl.int64)[:, None] * stride_ys + offs_n[None, :] * stride_yh
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_gemm2_kernel(
    a_ptr, w2_ptr, b2_ptr, y_ptr, topk_w_ptr,
    sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, hidden, inter,
    stride_ar, stride_ai,
    stride_we, stride_wh, stride_wi,
    stride_be, stride_bh,
    stride_ys, stride_yh,
    HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr, IEEE: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    # W8A8: a scales (Q_CHANNEL [R], Q_BLOCK [R, I/128]; R = sorted rows), w2 scales ([L, H], [L]
    # at channel stride 0, [L, H/128, I/128]).
    # Weight-only: as in moe_gemm1_kernel (ws [L, H] or [L, H, I / W_GROUP], w2 bytes [L, H, I / 2]).
    as_ptr=None, ws_ptr=None,
    stride_as0=0, stride_as1=0, stride_ws0=0, stride_ws1=0, stride_ws2=0,
    QUANT: tl.constexpr = 0, ACC_INT: tl.constexpr = False,
    wgs_ptr=None, W4_FMT: tl.constexpr = 0, W_GROUP: tl.constexpr = 32, PTX_DECODE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
    PDL: tl.constexpr = False,
    A_DESC: tl.constexpr = False, W_DESC: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,
    FP8_PROMOTE: tl.constexpr = False,  # fp8 codes: add each K step's product in fp32 (_dot)
    PERSISTENT: tl.constexpr = False,
    RS_SYNC: tl.constexpr = False,  # as in moe_gemm1_kernel
    wz_ptr=None, W_ZERO: tl.constexpr = False,  # as in moe_gemm1_kernel (wz [L, H, I / W_GROUP])
):
    """y[slot(r), n] = (sum_i a[r, i] * w2[e, n, i] + b2[e, n]) * w[slot(r)] for one row block.

    Unquantized, TMA descriptors instead of pointers: A_DESC a_ptr over a [R, I] with
    [BLOCK_M, BLOCK_K] boxes (the block's rows pid_m*BLOCK_M..; padding rows hold gemm1's output
    for no slot and are masked at the store), W_DESC w2_ptr over w2 viewed [L*H, I] with
    [BLOCK_N, BLOCK_K] boxes at row e*H + n0 (a tail tile reads the next expert's rows or zero
    fill, masked at the store). Past I both are zero-filled.

    PERSISTENT (TileConfig.persistent): the grid (a few programs per SM) strides over the real
    tiles; each tile runs `_gemm2_tile`, the same body as a program per tile, so the output is
    the same bit for bit.
    """
    tl.static_assert(not SWAP_AB or QUANT == Q_CHANNEL or QUANT == Q_BLOCK, "SWAP_AB: W8A8 codes only")  # noqa: SIM109
    _pdl_wait(PDL)
    num_n = tl.cdiv(hidden, BLOCK_N)
    if PERSISTENT:  # the grid's programs stride over the real (row block, N tile) tiles, one loop
        # (flatten: the next tile's loads are issued during this one's epilogue)
        num_m = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
            _gemm2_tile(pid_m, pid_n, a_ptr, w2_ptr, b2_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr,
                        num_slots, hidden, inter, stride_ar, stride_ai, stride_we, stride_wh, stride_wi,
                        stride_be, stride_bh, stride_ys, stride_yh, HAS_BIAS, SCALE_ROWS, IEEE, BLOCK_M,
                        BLOCK_N, BLOCK_K, as_ptr, ws_ptr, stride_as0, stride_as1, stride_ws0, stride_ws1,
                        stride_ws2, QUANT, ACC_INT, wgs_ptr, W4_FMT, W_GROUP, PTX_DECODE, EVEN_K, PDL,
                        A_DESC, W_DESC, SWAP_AB, FP8_PROMOTE, RS_SYNC, wz_ptr, W_ZERO)
    else:
        pid_m, pid_n = _tile_ids(tl.num_programs(0) // num_n, num_n, GROUP_M)
        if pid_m * BLOCK_M < tl.load(num_rows_ptr):
            _gemm2_tile(pid_m, pid_n, a_ptr, w2_ptr, b2_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr,
                        num_slots, hidden, inter, stride_ar, stride_ai, stride_we, stride_wh, stride_wi,
                        stride_be, stride_bh, stride_ys, stride_yh, HAS_BIAS, SCALE_ROWS, IEEE, BLOCK_M,
                        BLOCK_N, BLOCK_K, as_ptr, ws_ptr, stride_as0, stride_as1, stride_ws0, stride_ws1,
                        stride_ws2, QUANT, ACC_INT, wgs_ptr, W4_FMT, W_GROUP, PTX_DECODE, EVEN_K, PDL,
                        A_DESC, W_DESC, SWAP_AB, FP8_PROMOTE, RS_SYNC, wz_ptr, W_ZERO)


@triton.jit
def moe_gemm2_rows_kernel(
    a_ptr, w2_ptr, b2_ptr, y_ptr, topk_w_ptr,
    sorted_slot_ptr, block_expert_ptr, num_rows_ptr, as_ptr, ws_ptr,
    num_slots, hidden, inter,
    stride_ar, stride_ai,
    stride_we, stride_wh, stride_wi,
    stride_be, stride_bh,
    stride_ys, stride_yh,
    stride_as0, stride_as1, stride_ws0, stride_ws1, stride_ws2,
    QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr, SPLIT_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, NUM_STAGES: tl.constexpr,
    ACC_INT: tl.constexpr = True,
    PDL: tl.constexpr = False,
    TAIL_I: tl.constexpr = 0,
):
    """moe_gemm2_kernel's y for W8A8 codes where the whole I fits one tile (BLOCK_I >= inter), or
    a head tile and a tail tile (TAIL_I > 0: columns [0, BLOCK_I) and [BLOCK_I, BLOCK_I + TAIL_I),
    I = 384 as 256 + 128 rather than a 512-wide tile a quarter masked):
    program (row block, share) loads the block's [BLOCK_M, I] codes and scales once, then streams
    the expert's w2 tiles [I, BLOCK_N] over its share of the N tiles, one whole-K product and one
    store per tile, so a tile's store overlaps the next tiles' loads (tl.range's pipeline).

    Q_CHANNEL: a scale per aligned row, w2 scales [L, H] (or [L] at channel stride 0); one dot,
    int32 for int8 codes (ACC_INT: exact, so y is moe_gemm2_kernel's bit for bit), fp32 for fp8
    codes (one chained accumulator over the whole K: on sm90 the same wgmma chain as the tiled
    kernel's chained K steps). Q_BLOCK (fp8 1x128 groups,
    128x128 weight blocks; BLOCK_I = 256, BLOCK_N dividing 128): the codes split into their two
    128-wide groups, one dot per group scaled by its group and block scales, as moe_gemm2_kernel
    steps through K with BLOCK_K = 128 (the same sums in the same order).

    Where I is short (DeepSeek-V3 TP8, I = 256) the (row block, N tile) programs of
    moe_gemm2_kernel each run 1-4 K steps, paying pipeline fill and the block's activation loads
    per N tile. The epilogue multiplies in moe_gemm2_kernel's order. quant.gemm2_rows decides
    where it runs."""
    tl.static_assert(QUANT == Q_CHANNEL or (QUANT == Q_BLOCK and BLOCK_I == 256 and (TAIL_I == 0 or TAIL_I == 128)
                                            and 128 % BLOCK_N == 0),
                     "moe_gemm2_rows_kernel: per-row scaled codes, or fp8 block codes with I in (128, 384]")
    _pdl_wait(PDL)
    pid_m = tl.program_id(0) // SPLIT_N
    share = tl.program_id(0) % SPLIT_N
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert, rows, slot, row_ok = _row_block(pid_m, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
    offs_i = tl.arange(0, BLOCK_I)
    i_ok = offs_i < inter
    a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_i[None, :] * stride_ai,
                mask=row_ok[:, None] & i_ok[None, :], other=0.0)
    sa = tl.load(as_ptr + rows.to(tl.int64) * stride_as0, mask=row_ok, other=0.0)
    if QUANT == Q_BLOCK:  # the two 128-wide groups of the row block's codes and their scales
        a_lo, a_hi = tl.split(tl.permute(tl.reshape(a, (BLOCK_M, 2, 128)), (0, 2, 1)))
        sa_hi = tl.load(as_ptr + rows.to(tl.int64) * stride_as0 + stride_as1, mask=row_ok, other=0.0)
        offs_k = tl.arange(0, 128)
    if TAIL_I > 0:  # the tail's codes (fp8 block: the third group, its scale)
        offs_t = BLOCK_I + tl.arange(0, TAIL_I)
        t_ok = offs_t < inter
        a_t = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_t[None, :] * stride_ai,
                      mask=row_ok[:, None] & t_ok[None, :], other=0.0)
        if QUANT == Q_BLOCK:
            sa_t = tl.load(as_ptr + rows.to(tl.int64) * stride_as0 + 2 * stride_as1, mask=row_ok, other=0.0)
    if SCALE_ROWS:
        w = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    num_n = tl.cdiv(hidden, BLOCK_N)
    per = tl.cdiv(num_n, SPLIT_N)
    n_lo = share * per
    n_hi = tl.minimum(n_lo + per, num_n)
    w_base = w2_ptr + expert * stride_we
    ws_base = ws_ptr + expert * stride_ws0
    y_rows = y_ptr + slot.to(tl.int64)[:, None] * stride_ys
    for t in tl.range(n_lo, n_hi, num_stages=NUM_STAGES):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        w_cols = w_base + offs_n.to(tl.int64)[None, :] * stride_wh
        if TAIL_I > 0:
            w_t = tl.load(w_cols + offs_t[:, None] * stride_wi, mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        if QUANT == Q_BLOCK:
            w_lo = tl.load(w_cols + offs_k[:, None] * stride_wi, mask=n_ok[None, :], other=0.0)
            w_hi = tl.load(w_cols + (128 + offs_k)[:, None] * stride_wi,
                           mask=(128 + offs_k < inter)[:, None] & n_ok[None, :], other=0.0)
            sw_cols = ws_base + (t * BLOCK_N // 128) * stride_ws1
            sw_lo = tl.load(sw_cols).to(tl.float32)
            sw_hi = tl.load(sw_cols + stride_ws2).to(tl.float32)
            out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            out += tl.dot(a_lo, w_lo) * (sa * sw_lo)[:, None]
            out += tl.dot(a_hi, w_hi) * (sa_hi * sw_hi)[:, None]
            if TAIL_I > 0:
                out += tl.dot(a_t, w_t) * (sa_t * tl.load(sw_cols + 2 * stride_ws2).to(tl.float32))[:, None]
        else:
            ww = tl.load(w_cols + offs_i[:, None] * stride_wi, mask=i_ok[:, None] & n_ok[None, :], other=0.0)
            if ACC_INT:  # noqa: SIM108 (constexpr branch)
                acc = tl.dot(a, ww, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, ww, out_dtype=tl.float32)
            if TAIL_I > 0:  # the tail's K steps chained after the head's, as the tiled kernel's
                acc = tl.dot(a_t, w_t, acc, out_dtype=acc.dtype)
            sw = tl.load(ws_base + offs_n * stride_ws1, mask=n_ok, other=0.0).to(tl.float32)
            out = acc.to(tl.float32) * sa[:, None] * sw[None, :]
        if HAS_BIAS:
            out += tl.load(b2_ptr + expert * stride_be + offs_n * stride_bh, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SCALE_ROWS:
            out = out * w[:, None]
        tl.store(y_rows + offs_n[None, :] * stride_yh, out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    _pdl_release(PDL)


@triton.jit
def moe_gemm2_direct_kernel(
    a_ptr, w2_ptr, b2_ptr, out_ptr, topk_w_ptr, ids_ptr, emap_ptr,
    num_global, num_local, hidden, inter,
    stride_ar, stride_ai,
    stride_we, stride_wh, stride_wi,
    stride_be, stride_bh,
    stride_ot, stride_oh,
    TOP_K: tl.constexpr, TOP_K_P: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    # weight-only, as in moe_gemm2_kernel (Q_W8, Q_W4); W8A8 Q_CHANNEL / Q_BLOCK: a holds the
    # slots' codes with scales as [T*K, 1 or I/128], w2 scales [L, H] or [L, H/128, I/128]
    ws_ptr=None, stride_ws0=0, stride_ws1=0, stride_ws2=0,
    QUANT: tl.constexpr = 0,
    as_ptr=None, stride_as0=0, stride_as1=0,
    wgs_ptr=None, W4_FMT: tl.constexpr = 0, W_GROUP: tl.constexpr = 32, PTX_DECODE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
    PDL: tl.constexpr = False,
    # SPLIT > 1: program (t, n, s) sums slots s*PER .. s*PER + PER - 1 and writes its fp32 row to
    # part[t*SPLIT + s]; moe_reduce_kernel (FLAGS=False) adds a token's SPLIT rows in order.
    part_ptr=None, SPLIT: tl.constexpr = 1, PER: tl.constexpr = 1,
    SWAP_AB: tl.constexpr = False,
    FP8_PROMOTE: tl.constexpr = False,  # fp8 codes: add each K step's product in fp32 (_dot)
    # FUSE_AQ (Q_CHANNEL, per-token codes): a_ptr is GEMM1's a (activation dtype), quantized here as
    # quantize_rows_kernel does (the same codes and scales): each of the share's slot rows, AQ_WIDTH
    # >= I wide, is read once for its scale before the K loop, each K step's codes made from its
    # a tile (AQ_INT: int8 codes, else fp8)
    FUSE_AQ: tl.constexpr = False, AQ_WIDTH: tl.constexpr = 128, AQ_INT: tl.constexpr = False,
    SOFT_FP8: tl.constexpr = False,
    RS_SYNC: tl.constexpr = False,  # unused: each step's dot starts from a fresh accumulator and is waited for (_rs_sync)
    wz_ptr=None, W_ZERO: tl.constexpr = False,  # as in moe_gemm2_kernel
):
    """out[t, n] = sum_k w[t, k] * (sum_i a[t*K + k, i] * w2[e_k, n, i] + b2[e_k, n]): GEMM2, the
    routed weight and the top-k sum of one token and N tile, in fp32, in slot order (DIRECT decode).

    One loop over (slot k, K step) so the weight loads of consecutive slots pipeline; a's row of
    slot k is row 0 of a [BLOCK_M, BLOCK_K] tl.dot operand (the other rows masked to 0). Slots
    routed to no local expert (ids out of range, mapped away) add nothing. SPLIT == 1: no
    intermediate y and no reduce launch, each output element is written once; SPLIT > 1 (too few
    (token, N tile) programs for the SMs, or long per-program K loops): a token's slots spread
    over SPLIT programs whose fp32 partials are summed in a fixed order. Deterministic either way.
    """
    tl.static_assert(not SWAP_AB or QUANT == Q_CHANNEL or QUANT == Q_BLOCK, "SWAP_AB: W8A8 codes only")  # noqa: SIM109
    tl.static_assert(not FUSE_AQ or QUANT == Q_CHANNEL, "FUSE_AQ: per-token W8A8")
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, BLOCK_M)[:, None]
    lane0 = lanes == 0
    row0 = lanes * 0  # [BLOCK_M, 1] zeros: every operand row points at the slot's row (row 0 live)
    kk = tl.arange(0, TOP_K_P)
    k_in = kk < TOP_K
    ids = tl.load(ids_ptr + t * TOP_K + kk, mask=k_in, other=-1).to(tl.int64)
    ok = k_in & (ids >= 0) & (ids < num_global)
    local = tl.where(ok, ids, 0)
    if HAS_MAP:
        local = tl.load(emap_ptr + local, mask=ok, other=-1).to(tl.int64)
        ok = ok & (local >= 0) & (local < num_local)
    local = tl.where(ok, local, 0)
    if SCALE_ROWS:  # the routed weight, unless it was applied to the input
        wk = tl.load(topk_w_ptr + t * TOP_K + kk, mask=ok, other=0.0).to(tl.float32)
    else:
        wk = tl.full((TOP_K_P,), 1.0, tl.float32)
    wk = tl.where(ok, wk, 0.0)
    okk = ok.to(tl.int32)
    if QUANT == Q_W4 and (W4_FMT == W4_NVFP4 or W4_FMT == W4_NVFP4_FRAG):  # noqa: SIM109 (constexprs)
        gsk = _w4_global(tl.load(wgs_ptr + local, mask=ok, other=1.0).to(tl.float32), W4_FMT)

    if HAS_BIAS:  # sum_k w_k * b2[e_k] of this share, loaded before the K loop (consumed after it)
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for jj in tl.static_range(PER):
            sel = kk == s * PER + jj
            live = tl.sum(tl.where(sel, okk, 0), 0)
            b = tl.load(b2_ptr + tl.sum(tl.where(sel, local, 0), 0) * stride_be + offs_n * stride_bh,
                        mask=offs_n < live * hidden, other=0.0).to(tl.float32)
            bias += b * tl.sum(tl.where(sel, wk, 0.0), 0)
    if FUSE_AQ:  # the share's slots' scales, one read of each row (a slot past TOP_K: row TOP_K - 1)
        sk = tl.full((TOP_K_P,), 1.0, tl.float32)
        for jj in tl.static_range(PER):
            jrow = tl.minimum(s * PER + jj, TOP_K - 1)
            _, sc = _xq_scale(a_ptr + (t * TOP_K + jrow) * stride_ar, a_ptr, inter, stride_ai, AQ_INT, False,
                              AQ_WIDTH)
            sk = tl.where(kk == s * PER + jj, sc, sk)
        # a slot with no local expert: its row was never written (a NaN scale would make NaN codes
        # of its zero-masked tile); scale 1, and its product is dropped as below
        sk = tl.where(ok, sk, 1.0)
    k_steps = tl.cdiv(inter, BLOCK_K)
    FRAG: tl.constexpr = QUANT == Q_W4 and W4_FMT >= W4_MXFP4_FRAG  # as in moe_gemm1_kernel
    SWAPPED: tl.constexpr = SWAP_AB or FRAG
    total = _acc_zeros(BLOCK_M, BLOCK_N, False, SWAPPED)
    if QUANT == Q_W4:
        offs_j = tl.arange(0, BLOCK_K // 2)
    for it in range(0, PER * k_steps):
        j = s * PER + it // k_steps  # j >= TOP_K (the last share's tail): no slot selected, adds 0
        k0 = (it - (j - s * PER) * k_steps) * BLOCK_K
        # the slot's expert, weight and liveness picked from registers: the weight loads' addresses
        # depend on no load in the loop, so they pipeline across slots (per-slot scalar loads
        # measured 5-40% slower on an H200: benchmarks/results/2026-11-23_h200_direct-*.txt)
        sel = kk == j
        e = tl.sum(tl.where(sel, local, 0), 0)
        w_j = tl.sum(tl.where(sel, wk, 0.0), 0)
        # a slot with no local expert masks every load through zero bounds (integer arithmetic:
        # scalar booleans in masks trip the interpreter): it adds 0
        live = tl.sum(tl.where(sel, okk, 0), 0)
        k_ok = offs_k < live * (inter - k0)
        n_e = offs_n < live * hidden
        slot = t * TOP_K + j
        if FUSE_AQ:
            sa_j = tl.sum(tl.where(sel, sk, 0.0), 0)
            aa = _xq_codes(a_ptr + slot * stride_ar + (k0 + offs_k) * stride_ai, k_ok, 1.0, sa_j,
                           tl.arange(0, BLOCK_M) == 0, AQ_INT, False, SOFT_FP8, w2_ptr.dtype.element_ty)
        else:
            aa = tl.load(a_ptr + slot * stride_ar + row0 + (k0 + offs_k)[None, :] * stride_ai,
                         mask=lane0 & k_ok[None, :], other=0.0)
        acc = _acc_zeros(BLOCK_M, BLOCK_N, False, SWAPPED)
        if FRAG:  # a slot with no local expert: every fragment masked (bounds times live)
            zb = ws_ptr + e * stride_ws0
            if W_ZERO:
                zb = wz_ptr + e * stride_ws0
            wt = _w4_frag_tile(w2_ptr + e * stride_we, ws_ptr + e * stride_ws0, stride_ws1,
                               tl.program_id(1) * (BLOCK_N // 16),
                               live * (hidden // 16), k0, live * inter, inter, W4_FMT, W_GROUP, BLOCK_N, BLOCK_K,
                               a_ptr.dtype.element_ty, PTX_DECODE, z_ptr=zb, W_ZERO=W_ZERO)
            acc = _dot(wt, tl.trans(aa), acc, IEEE, False)  # a fresh accumulator: used in the loop, synchronous
            if W4_FMT == W4_NVFP4_FRAG:
                acc = acc * tl.sum(tl.where(sel, gsk, 0.0), 0)
        elif QUANT == Q_W4:
            a_even, a_odd = tl.split(tl.reshape(aa, (BLOCK_M, BLOCK_K // 2, 2)))
            w_mask = n_e[None, :] if EVEN_K else (offs_j < live * ((inter - k0) // 2))[:, None] & n_e[None, :]
            j0 = tl.multiple_of(k0 // 2, BLOCK_K // 2)
            wq_cols = w2_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wh
            sq_cols = ws_ptr + e * stride_ws0 + offs_n[None, :] * stride_ws1
            zq_cols = sq_cols
            if W_ZERO:
                zq_cols = wz_ptr + e * stride_ws0 + offs_n[None, :] * stride_ws1
            lo, hi = _w4_tiles(wq_cols + (j0 + offs_j)[:, None] * stride_wi, sq_cols, w_mask,
                               n_e, k0, inter, stride_ws2, W4_FMT, W_GROUP, BLOCK_K, BLOCK_N,
                               a_ptr.dtype.element_ty, PTX_DECODE, zq_cols, W_ZERO)
            acc = _dot(a_odd, hi, _dot(a_even, lo, acc, IEEE, False), IEEE, False)
            if W4_FMT == W4_NVFP4:
                acc = acc * tl.sum(tl.where(sel, gsk, 0.0), 0)
        else:
            ww = tl.load(w2_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wh
                         + (k0 + offs_k)[:, None] * stride_wi,
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if QUANT == Q_W8:  # fp8 / int8 codes are exact in bf16 / fp16
                ww = _w8_codes(ww, a_ptr.dtype.element_ty, PTX_DECODE)
            # W8A8: the slot's scale row (clamped into a: the last share's tail selects no slot);
            # rows of slots with no local expert were never written, their scale is dropped
            if QUANT == Q_CHANNEL:  # 8-bit codes: fp32 (fp8) or int32 (int8) products, then scales
                if FUSE_AQ:
                    sa = tl.where(live > 0, sa_j, 0.0)
                else:
                    a_srow = as_ptr + (t * TOP_K + tl.minimum(j, TOP_K - 1)) * stride_as0
                    sa = tl.where(live > 0, tl.load(a_srow), 0.0)
                sw = tl.load(ws_ptr + e * stride_ws0 + offs_n * stride_ws1, mask=n_e, other=0.0).to(tl.float32)
                acc = _mma(aa, ww, SWAP_AB).to(tl.float32) * _per_col(sa * sw, SWAP_AB)
            elif QUANT == Q_BLOCK:  # this K step lies in one 128-wide scale block, the N tile too
                kb = k0 // 128
                a_srow = as_ptr + (t * TOP_K + tl.minimum(j, TOP_K - 1)) * stride_as0
                sa = tl.where(live > 0, tl.load(a_srow + kb * stride_as1), 0.0)
                sw = tl.load(ws_ptr + e * stride_ws0 + (tl.program_id(1) * BLOCK_N // 128) * stride_ws1
                             + kb * stride_ws2).to(tl.float32)
                acc = _mma(aa, ww, SWAP_AB) * (sa * sw)
            else:
                acc = _dot_acc(aa, ww, acc, IEEE, SWAP_AB, FP8_PROMOTE)
            if QUANT == Q_W8:
                acc = acc * tl.load(ws_ptr + e * stride_ws0 + offs_n * stride_ws1, mask=n_e,
                                    other=0.0).to(tl.float32)[None, :]
        total += acc * w_j
    _pdl_release(PDL)
    if SWAPPED:
        total = tl.trans(total)
    if HAS_BIAS:
        total += bias[None, :]
    if SPLIT == 1:
        o_ptrs = out_ptr + t * stride_ot + row0 + offs_n[None, :] * stride_oh
        tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=lane0 & n_ok[None, :])
    else:  # part [T*SPLIT, hidden] fp32, contiguous
        p_ptrs = part_ptr + (t * SPLIT + s) * hidden + row0 + offs_n[None, :]
        tl.store(p_ptrs, total, mask=lane0 & n_ok[None, :])


@triton.jit
def moe_reduce_kernel(
    y_ptr, out_ptr, slot_ok_ptr, rows_ptr, w_ptr,
    hidden,
    stride_ys, stride_yh, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False, FLAGS: tl.constexpr = True, GATHER: tl.constexpr = False,
    SCALE: tl.constexpr = False,
):
    """out[t, h] = sum over valid k of y[t*K + k, h], accumulated in fp32 in slot order.
    FLAGS=False: every row is valid (slot_ok_ptr unread): the direct GEMM2's split partials.
    GATHER: slot t*K + k's row of y is rows[t*K + k] (int64; -1: adds nothing, not read), the
    batched layout's buffer rows (backends/triton/batched.py). SCALE: each row times w[t*K + k]."""
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = t * TOP_K + k
        ok = h_ok
        if FLAGS:
            ok = ok & (tl.load(slot_ok_ptr + slot + offs_h * 0) != 0)  # the slot's flag, as a [BLOCK_H] mask
        row = slot
        if GATHER:
            row = tl.load(rows_ptr + slot + offs_h * 0)  # the slot's row, as a [BLOCK_H] vector
            ok = ok & (row >= 0)
        y = tl.load(y_ptr + row * stride_ys + offs_h * stride_yh, mask=ok, other=0.0).to(tl.float32)
        if SCALE:
            y = y * tl.load(w_ptr + slot + offs_h * 0, mask=ok, other=0.0).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * stride_ot + offs_h * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _local_expert(ids_ptr, expert_map_ptr, offs, in_range, num_global, num_local, HAS_MAP: tl.constexpr):
    """Local expert of each slot (int32; invalid, mapped away and out-of-range lanes -> bucket L), valid."""
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_global)
    local = tl.where(valid, ids, 0)
    if HAS_MAP:
        local = tl.load(expert_map_ptr + local, mask=valid, other=-1)
        valid = valid & (local >= 0) & (local < num_local)
    return tl.where(valid, local, num_local).to(tl.int32), valid


@triton.jit
def _fill_unowned(sorted_slot_ptr, block_expert_ptr, row_lo, row_hi, block_lo, block_hi, num_slots, num_local,
                  BLOCK_R: tl.constexpr):
    """sorted_slot[row_lo:row_hi] = N (padding), block_expert[block_lo:block_hi] = L (unused block)."""
    for r0 in range(row_lo, row_hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        tl.store(sorted_slot_ptr + rows, tl.full((BLOCK_R,), 0, tl.int32) + num_slots, mask=rows < row_hi)
    for b0 in range(block_lo, block_hi, BLOCK_R):
        blocks = b0 + tl.arange(0, BLOCK_R)
        tl.store(block_expert_ptr + blocks, tl.full((BLOCK_R,), 0, tl.int32) + num_local, mask=blocks < block_hi)


@triton.jit
def moe_align_small_kernel(
    ids_ptr, expert_map_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr, slot_ok_ptr, scratch_ptr,
    num_slots, num_global, num_local, total_rows,
    HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The whole alignment in one program, for few slots (decode): same result as the torch path.

    rank(i) = #{j < i : expert(j) == expert(i)} (stable); dest(i) = padded_start[expert(i)] + rank(i)
    """
    _pdl_enter(PDL)
    offs = tl.arange(0, BLOCK_N)
    in_range = offs < num_slots
    local, valid = _local_expert(ids_ptr, expert_map_ptr, offs, in_range, num_global, num_local, HAS_MAP)
    tl.store(slot_ok_ptr + offs, valid.to(tl.int8), mask=in_range)

    counts = tl.histogram(local, BLOCK_E)
    experts = tl.arange(0, BLOCK_E)
    padded = tl.where(experts < num_local, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_end = tl.cumsum(padded, 0)
    tl.store(scratch_ptr + experts, padded_end - padded)
    tl.store(num_rows_ptr, tl.sum(padded, 0))
    _fill_unowned(sorted_slot_ptr, block_expert_ptr, 0, total_rows, 0, total_rows // BLOCK_M, num_slots, num_local,
                  BLOCK_R)
    tl.debug_barrier()

    same = (local[:, None] == local[None, :]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(same.to(tl.int32), 1)
    dest = tl.load(scratch_ptr + local, mask=valid, other=0) + rank
    tl.store(sorted_slot_ptr + dest, offs.to(tl.int32), mask=valid)
    tl.store(block_expert_ptr + dest // BLOCK_M, local.to(tl.int32), mask=valid)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sorted_runs(local, key_ptr, CHUNK: tl.constexpr):
    """Stable sort of one chunk by expert: key = expert*CHUNK + lane, sorted and stored at key_ptr[:CHUNK].

    Returns the sorted keys, their experts, each one's position in its expert's run, and run ends.
    """
    lanes = tl.arange(0, CHUNK)
    key = tl.sort(local * CHUNK + lanes)
    expert = key // CHUNK
    tl.store(key_ptr + lanes, key)
    tl.debug_barrier()  # neighbours' keys are visible from here
    prev_expert = tl.load(key_ptr + lanes - 1, mask=lanes > 0, other=0) // CHUNK
    next_expert = tl.load(key_ptr + lanes + 1, mask=lanes < CHUNK - 1, other=0) // CHUNK
    run_start = tl.associative_scan(tl.where((lanes == 0) | (prev_expert != expert), lanes, 0), 0, _max)
    return key, expert, lanes - run_start, (lanes == CHUNK - 1) | (next_expert != expert)


@triton.jit
def moe_align_kernel(
    ids_ptr, expert_map_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr, slot_ok_ptr,
    count_ptr, start_ptr, key_ptr, rank_ptr,
    num_slots, num_global, num_local, total_rows,
    HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The whole alignment in one program, CHUNK slots at a time (any count): same result as torch.

    pass 1, per chunk: key = expert*CHUNK + offset, sorted (stable: offsets are unique);
        rank(i) = count[expert(i)] (earlier chunks) + position of i in its expert's run; count += run
    start = exclusive cumsum of count padded to BLOCK_M;  pass 2: dest(i) = start[expert(i)] + rank(i)
    """
    _pdl_enter(PDL)
    _fill_unowned(sorted_slot_ptr, block_expert_ptr, 0, total_rows, 0, total_rows // BLOCK_M, num_slots, num_local,
                  BLOCK_R)
    for e0 in range(0, num_local + 1, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        tl.store(count_ptr + experts, tl.zeros((BLOCK_E,), tl.int32), mask=experts <= num_local)
    tl.debug_barrier()

    lanes = tl.arange(0, CHUNK)
    for c0 in range(0, num_slots, CHUNK):
        offs = c0 + lanes
        in_range = offs < num_slots
        local, valid = _local_expert(ids_ptr, expert_map_ptr, offs, in_range, num_global, num_local, HAS_MAP)
        tl.store(slot_ok_ptr + offs, valid.to(tl.int8), mask=in_range)
        # its barrier also makes the previous chunk's counts visible
        key, expert, in_run, run_end = _sorted_runs(local, key_ptr + c0, CHUNK)
        rank = tl.load(count_ptr + expert) + in_run
        tl.store(rank_ptr + offs, rank)
        tl.debug_barrier()  # a run spans warps: all of it reads count[expert] before its end writes
        tl.store(count_ptr + expert, rank + 1, mask=run_end)
    tl.debug_barrier()

    rows_used = 0
    for e0 in range(0, num_local, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        counts = tl.load(count_ptr + experts, mask=experts < num_local, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(start_ptr + experts, rows_used + tl.cumsum(padded, 0) - padded, mask=experts < num_local)
        rows_used += tl.sum(padded, 0)
    tl.store(num_rows_ptr, rows_used)
    tl.debug_barrier()

    for c0 in range(0, num_slots, CHUNK):
        offs = c0 + lanes
        key = tl.load(key_ptr + offs)
        expert = key // CHUNK
        mine = expert < num_local
        dest = tl.load(start_ptr + expert, mask=mine, other=0) + tl.load(rank_ptr + offs, mask=mine, other=0)
        tl.store(sorted_slot_ptr + dest, c0 + key % CHUNK, mask=mine)
        tl.store(block_expert_ptr + dest // BLOCK_M, expert, mask=mine)


# Multi-program alignment: three launches, one program per CHUNK slots in the first and last.
#     count:   stable sort of chunk c by expert; in_run(i) = position of i in its expert's run;
#              count[c, e] = run length (0 when e is absent); fill this program's share of the padding
#     offsets: base[c, e] = sum_{c' < c} count[c', e] (in place); start[e] = exclusive cumsum over
#              experts of sum_c count[c, e] padded to BLOCK_M; num_rows = the padded total
#     scatter: dest(i) = start[e] + base[c, e] + in_run(i)
@triton.jit
def moe_align_count_kernel(
    ids_ptr, expert_map_ptr, sorted_slot_ptr, block_expert_ptr, slot_ok_ptr, count_ptr, key_ptr, in_run_ptr,
    num_slots, num_global, num_local, total_rows, rows_per_program, blocks_per_program,
    HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program c: slot_ok, sorted keys, in_run and count[c, :] of slots [c*CHUNK, (c+1)*CHUNK), and
    rows [c*rows_per_program, ...) / blocks [c*blocks_per_program, ...) set to padding / unowned."""
    _pdl_enter(PDL)
    c = tl.program_id(0).to(tl.int64)
    row_lo = c * rows_per_program
    block_lo = c * blocks_per_program
    _fill_unowned(sorted_slot_ptr, block_expert_ptr, row_lo, tl.minimum(row_lo + rows_per_program, total_rows),
                  block_lo, tl.minimum(block_lo + blocks_per_program, total_rows // BLOCK_M), num_slots, num_local,
                  BLOCK_R)
    count_row = count_ptr + c * num_local
    for e0 in range(0, num_local, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        tl.store(count_row + experts, tl.zeros((BLOCK_E,), tl.int32), mask=experts < num_local)

    c0 = c * CHUNK
    offs = c0 + tl.arange(0, CHUNK)
    in_range = offs < num_slots
    local, valid = _local_expert(ids_ptr, expert_map_ptr, offs, in_range, num_global, num_local, HAS_MAP)
    tl.store(slot_ok_ptr + offs, valid.to(tl.int8), mask=in_range)
    # its barrier also orders the zeroed counts before the run lengths below
    key, expert, in_run, run_end = _sorted_runs(local, key_ptr + c0, CHUNK)
    tl.store(in_run_ptr + offs, in_run)
    tl.store(count_row + expert, in_run + 1, mask=run_end & (expert < num_local))


@triton.jit
def moe_align_offsets_kernel(
    count_ptr, start_ptr, num_rows_ptr, num_chunks, num_local,
    BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: count [chunks, L] -> base (exclusive cumsum over chunks, in place), start [L], num_rows."""
    _pdl_enter(PDL)
    rows_used = 0
    for e0 in range(0, num_local, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        e_ok = experts < num_local
        total = tl.zeros((BLOCK_E,), tl.int32)
        for c0 in range(0, num_chunks, BLOCK_C):
            chunks = c0 + tl.arange(0, BLOCK_C)
            ptrs = count_ptr + chunks.to(tl.int64)[:, None] * num_local + experts[None, :]
            ok = (chunks < num_chunks)[:, None] & e_ok[None, :]
            counts = tl.load(ptrs, mask=ok, other=0)
            tl.store(ptrs, total[None, :] + tl.cumsum(counts, 0) - counts, mask=ok)
            total += tl.sum(counts, 0)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(start_ptr + experts, rows_used + tl.cumsum(padded, 0) - padded, mask=e_ok)
        rows_used += tl.sum(padded, 0)
    tl.store(num_rows_ptr, rows_used)


@triton.jit
def moe_align_scatter_kernel(
    sorted_slot_ptr, block_expert_ptr, count_ptr, start_ptr, key_ptr, in_run_ptr, num_local,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program c: sorted_slot[dest(i)] = i and block_expert[dest(i) // BLOCK_M] = e for chunk c's slots."""
    _pdl_enter(PDL)
    c = tl.program_id(0).to(tl.int64)
    c0 = c * CHUNK
    offs = c0 + tl.arange(0, CHUNK)
    key = tl.load(key_ptr + offs)
    expert = key // CHUNK
    mine = expert < num_local
    dest = (tl.load(start_ptr + expert, mask=mine, other=0) + tl.load(count_ptr + c * num_local + expert, mask=mine,
            other=0) + tl.load(in_run_ptr + offs, mask=mine, other=0))
    tl.store(sorted_slot_ptr + dest, (c0 + key % CHUNK).to(tl.int32), mask=mine)
    tl.store(block_expert_ptr + dest // BLOCK_M, expert, mask=mine)


@triton.jit
def moe_batched_rows_kernel(
    counts_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr, num_local, max_tokens, num_blocks,
    BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The batched layout's buffers [L, M, H] as aligned rows, from the counts in one launch.

    Expert e's rows j < count[e] (clamped to [0, M]) fill cdiv(count, BLOCK_M) row blocks,
    packed in expert order; row r of block b holds slot e*M + j, padding rows slot L*M, blocks
    past the live ones expert L. Program p: blocks [p*BLOCK_B, (p+1)*BLOCK_B); each program sums
    the counts itself (L <= BLOCK_L), program 0 writes num_rows = live blocks * BLOCK_M.
    """
    pid = tl.program_id(0)
    offs_l = tl.arange(0, BLOCK_L)
    counts = tl.load(counts_ptr + offs_l, mask=offs_l < num_local, other=0).to(tl.int64)
    counts = tl.minimum(tl.maximum(counts, 0), max_tokens)
    live = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(live, 0)  # padding lanes: live 0, end = the total
    starts = ends - live
    total = tl.sum(live, 0)
    if pid == 0:
        tl.store(num_rows_ptr, (total * BLOCK_M).to(tl.int32))
    blocks = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    # a live block's expert: the experts ending at or before it (padding lanes end at the total)
    expert = tl.sum((ends[None, :] <= blocks[:, None]).to(tl.int64), axis=1)
    pick = offs_l[None, :] == expert[:, None]
    first = tl.sum(tl.where(pick, starts[None, :], 0), axis=1)
    count = tl.sum(tl.where(pick, counts[None, :], 0), axis=1)
    is_live = blocks < total
    j = (blocks - first)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    valid = is_live[:, None] & (j < count[:, None])
    slot = tl.where(valid, expert[:, None] * max_tokens + j, num_local * max_tokens)
    in_grid = blocks < num_blocks
    rows = blocks.to(tl.int64)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_slot_ptr + rows, slot.to(tl.int32), mask=in_grid[:, None])
    tl.store(block_expert_ptr + blocks, tl.where(is_live, expert, num_local).to(tl.int32), mask=in_grid)


@triton.jit
def moe_batched_scatter_kernel(
    x_ptr, xb_ptr, w_ptr, sorted_slot_ptr, pos_expert_ptr, num_used_ptr, dest_ptr, counts_ptr, raw_ptr,
    num_pos, top_k, max_tokens, num_local, hidden, search_steps,
    stride_xt, stride_xh, stride_br, stride_bh,
    SCALE_IN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The local batched dispatch from the slots sorted by expert (an `align` with BLOCK_M = 1).

    Sorted position p holds slot n = sorted_slot[p] of expert e = pos_expert[p] (non-decreasing
    over the used positions); its row within the expert is j = p - first(e), first(e) found by a
    binary search. j < M: xb[e*M + j] = x[n // top_k] (* w[n] rounded to x's dtype, as the torch
    dispatch), dest[n] = e*M + j; else (past the buffer) dest[n] = -1. The last position of each
    run writes raw[e] = its length and counts[e] = min(length, M) (both start at 0).
    """
    pid = tl.program_id(0)
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    used = tl.minimum(tl.load(num_used_ptr), num_pos)
    live = p < used
    e = tl.load(pos_expert_ptr + p, mask=live, other=num_local)
    slot = tl.load(sorted_slot_ptr + p, mask=live, other=0)
    lo = tl.zeros((BLOCK_P,), dtype=tl.int32)
    hi = tl.zeros((BLOCK_P,), dtype=tl.int32) + used
    for _ in range(search_steps):  # first position of e: lower bound in pos_expert[0:used]
        open_ = live & (lo < hi)
        mid = (lo + hi) // 2
        v = tl.load(pos_expert_ptr + mid, mask=open_, other=num_local)
        right = v < e
        lo = tl.where(open_ & right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    j = p - lo
    ok = live & (j < max_tokens)
    row = e.to(tl.int64) * max_tokens + j
    tl.store(dest_ptr + slot, tl.where(ok, row, -1), mask=live)
    nxt = tl.load(pos_expert_ptr + p + 1, mask=live & (p + 1 < used), other=num_local)
    last = live & (nxt != e)
    tl.store(raw_ptr + e, j + 1, mask=last)
    tl.store(counts_ptr + e, tl.minimum(j + 1, max_tokens), mask=last)
    token = (slot // top_k).to(tl.int64)
    if SCALE_IN:
        w = tl.load(w_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        m = ok[:, None] & (offs_h < hidden)[None, :]
        v = tl.load(x_ptr + token[:, None] * stride_xt + offs_h[None, :] * stride_xh, mask=m, other=0.0)
        if SCALE_IN:
            v = (v.to(tl.float32) * w[:, None]).to(xb_ptr.dtype.element_ty)
        tl.store(xb_ptr + row[:, None] * stride_br + offs_h[None, :] * stride_bh, v, mask=m)

