"""Triton kernels and helpers quantizing activations for the W8A8 experts (jitted code only;
the host side is quant.py, the GEMMs that consume the codes are in kernels.py).

    rows:  s[r, g] = amax(|x[r, group g]| (* w[r])) / qmax;  q[r, k] = code(x[r, k] (* w[r]) / s[r, g])
           (per token: one group = the whole row; per group: 1x128, DeepSeek-V3) or a given scale
    amax:  amax[e] = max |x[row(r)] (* w[slot(r)])| over the sorted rows r of local expert e
    expert rows: q[r, k] = code(x[row(r), k] (* w[slot(r)]) / s[e]), s[e] = amax[e] / qmax or
           static (per-tensor fp8: one scale per local expert, codes per sorted row)
code(v): fp8 e4m3 = cast(clamp(v, +-448)), round to nearest even; int8 = round half to even,
clamp to [-128, 127]; scales of all-zero groups are 1. The same arithmetic as
`fusedmoe.quant.formats` (true division, as torch does), so the codes match it bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
INT8_MAX = tl.constexpr(127.0)


RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: fp32 sums this large have no fraction bits


@triton.jit
def _rint(v):
    """Round half to even, fp32 in and out, |v| <= 2^22: (v + 1.5 * 2^23) - 1.5 * 2^23, two adds
    each rounded to nearest even (libdevice's rint is not in the interpreter; floor-based
    rounding cost ~8 instructions an element). v must not be a product the compiler could fuse
    into the first add (callers pass clamped values or exact power-of-two scalings)."""
    return (v + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def _div_scale(v, scale):
    """v / scale rounded to nearest, bit for bit torch's true division (div.rn); scale (a scalar,
    or per row / group, broadcast against v) > 0, Inf or NaN.

    div.rn costs ~10 instructions an element and a branch (H200: quantize_rows_kernel was
    issue-bound at ~1.3 TB/s). Instead, once per scale: p = 2^-E, the power of two of its exponent
    (clamped so that p stays normal), the scale brought to s' = s * p in [2^-23, 4) exactly, and
    y = RN(1 / s'); then per element v' = v * p (exact unless it under- or overflows) and
    Markstein's correction of q0 = RN(v' * y): q = RN(q0 + RN(v' - s' * q0) * y), which with y
    correctly rounded and q0 within an ulp of v' / s' is v' / s' = v / s correctly rounded
    whenever the residual is exact (it is unless v' is tiny: quotients under ~2^-70, 0 as codes).
    A zero q0 is the quotient itself, with v's sign (an e4m3 code's sign bit): the correction
    would make it -0 + +0 = +0, however written (ptxas distributes negations over FMAs as if zeros
    had no sign: the H200 gave +0 for -0 / s); a q0 that underflowed to 0 is then off the
    division's result by at most the smallest subnormal. Where the residual is not finite (an
    Inf scale or v', or q0 overflowing) q0 itself is the quotient (0, Inf or NaN, as the
    division's). Checked bit for bit against the division over 2e8 quotients of scales 2^-149 to
    2^127 with ties, zeros, Inf and NaN (numpy, the interpreter's fp32 FMA), and as codes by
    test_triton_quant.py / test_gpu_quant.py::test_activation_codes_bitwise_on_gpu.
    """
    eb = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    eb = tl.minimum(tl.maximum(eb, 1), 253)
    p = ((254 - eb) << 23).to(tl.float32, bitcast=True)  # 2^(127 - eb), normal
    sn = scale * p
    y = tl.math.div_rn(tl.full(sn.shape, 1.0, tl.float32), sn)
    vn = v * p
    q0 = vn * y
    r = tl.fma(-sn, q0, vn)
    return tl.where((tl.abs(r) < float("inf")) & (q0 != 0.0), tl.fma(r, y, q0), q0)


@triton.jit
def _fp8_grid(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32.

    The interpreter's fp32 -> fp8 cast mis-rounds when rounding carries into the next binade
    (Triton 3.9: 127.8 -> 64, not 128); after this the cast is exact. GPUs (cvt.rn.satfinite)
    do not need it.
    """
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; below 2^-6 the subnormal step is 2^-9
    step = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    r = _rint(v * inv_step) * step
    return tl.where(r == 0.0, v * 0.0, r)  # -0 for negatives rounding to zero (e4m3 0x80), as the cast


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr):
    """s = amax / qmax (1 where amax == 0), correctly rounded like torch's division; a NaN/Inf
    amax stays NaN/Inf, so the group dequantizes to NaN (formats.absmax_scale)."""
    return tl.where(amax == 0, 1.0, tl.math.div_rn(amax, QMAX))


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN (tl.maximum's default, like fmaxf, returns the other operand)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_block(pid, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M: tl.constexpr):
    """Row block `pid` of the aligned rows: (its local expert as int64, its BLOCK_M rows, their
    slots, live = slot < num_slots; padding rows hold slot num_slots). Callers first skip the
    blocks at or past num_rows. Shared by every kernel over aligned rows (kernels.py too)."""
    expert = tl.load(block_expert_ptr + pid).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + rows)
    return expert, rows, slot, slot < num_slots


@triton.jit
def _source_rows(pid, sorted_slot_ptr, block_expert_ptr, num_slots, top_k, GATHER: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """`_row_block` plus each row's source row of x (int64): its token (GATHER: slot // top_k)
    or the aligned row itself."""
    expert, rows, slot, row_ok = _row_block(pid, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
    if GATHER:  # noqa: SIM108 (constexpr branch)
        src = (slot // top_k).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return expert, rows, slot, row_ok, src


@triton.jit
def _amax_update(ptr, v, row_ok, n_ok):
    """ptr[0] = max(ptr[0], |v|) over the live rows and columns of the tile v (fp32): an atomic
    max, order-free, so deterministic; NaN wins as in expert_amax_kernel."""
    m = tl.where(row_ok[:, None] & n_ok[None, :], tl.abs(v), 0.0)
    tl.atomic_max(ptr, tl.reduce(tl.reduce(m, 1, _max_nan), 0, _max_nan))


@triton.jit
def _scale_for(amax, IS_INT: tl.constexpr):
    """The scale of a group with this amax: amax / 127 (int8) or amax / 448 (fp8)."""
    if IS_INT:  # noqa: SIM108 (constexpr branch)
        scale = _scale_of(amax, INT8_MAX)
    else:
        scale = _scale_of(amax, FP8_MAX)
    return scale


@triton.jit
def _quantize(v, scale, IS_INT: tl.constexpr, SOFT_FP8: tl.constexpr):
    """The 8-bit code of fp32 v / scale, still as fp32 (exactly representable: cast it)."""
    v = _div_scale(v, scale)
    if IS_INT:
        q = _rint(tl.minimum(tl.maximum(v, -128.0), 127.0))
    else:
        q = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
        if SOFT_FP8:
            q = _fp8_grid(q)
    return q


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, row_w_ptr, scale_in_ptr, num_rows_ptr, row_map_ptr,
    num_rows, width, group, map_end,
    stride_xr, stride_xk, stride_qr, stride_qk, stride_sr, stride_sg,
    IS_INT: tl.constexpr, SOFT_FP8: tl.constexpr, SCALE_IN: tl.constexpr,
    HAS_ROW_W: tl.constexpr, HAS_NUM_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr = False, ROW_MAP: tl.constexpr = False,
):
    """q[r, k] = code(x[r, k] (* w[r]) / s[r, g]) for BLOCK_R rows and group g = program_id(1).

    SCALE_IN: 0 = s is the group's amax / qmax (written to s[r, g]); 1 = s = scale_in[0]
    (static); 2 = s = scale_in[0] / qmax with scale_in[0] an amax (dynamic per tensor).
    HAS_NUM_ROWS: rows at or past num_rows_ptr[0] are skipped (the unused tail of aligned rows).
    ROW_MAP (with HAS_NUM_ROWS): the programs walk aligned rows i and quantize row
    r = row_map[i] of x (the batched layout's live buffer rows); r >= map_end (padding) is skipped.
    ONE_PASS (SCALE_IN 0, group <= BLOCK_K): the group is loaded once and quantized from registers.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_NUM_ROWS:
        num_rows = tl.minimum(num_rows, tl.load(num_rows_ptr))
        if tl.program_id(0) * BLOCK_R >= num_rows:
            return
    row_ok = rows < num_rows
    if ROW_MAP:
        rows = tl.load(row_map_ptr + rows, mask=row_ok, other=map_end)
        row_ok = rows < map_end
    rows = rows.to(tl.int64)
    start = tl.program_id(1) * group
    end = tl.minimum(start + group, width)
    offs = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xr
    q_rows = q_ptr + rows[:, None] * stride_qr
    if HAS_ROW_W:  # router weight on input: quantize w * x, as the reference does
        w = tl.load(row_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if ONE_PASS:  # SCALE_IN == 0 and the group fits one tile: load it once, quantize from registers
        ok = row_ok[:, None] & (start + offs < end)[None, :]
        x = tl.load(x_rows + (start + offs)[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
        if HAS_ROW_W:
            x = x * w
        scale = _scale_for(tl.reduce(tl.abs(x), 1, _max_nan), IS_INT)[:, None]
        tl.store(s_ptr + rows[:, None] * stride_sr + tl.program_id(1) * stride_sg, scale, mask=row_ok[:, None])
        q = _quantize(x, scale, IS_INT, SOFT_FP8)
        tl.store(q_rows + (start + offs)[None, :] * stride_qk, q.to(q_ptr.dtype.element_ty), mask=ok)
        return
    if SCALE_IN == 0:
        amax = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):
            ok = row_ok[:, None] & (k0 + offs < end)[None, :]
            x = tl.load(x_rows + (k0 + offs)[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
            if HAS_ROW_W:
                x = x * w
            amax = _max_nan(amax, tl.abs(x))
        scale = _scale_for(tl.reduce(amax, 1, _max_nan), IS_INT)[:, None]
        tl.store(s_ptr + rows[:, None] * stride_sr + tl.program_id(1) * stride_sg, scale, mask=row_ok[:, None])
    elif SCALE_IN == 1:
        scale = tl.load(scale_in_ptr).to(tl.float32)
    else:
        scale = _scale_for(tl.load(scale_in_ptr).to(tl.float32), IS_INT)
    for k0 in range(start, end, BLOCK_K):
        ok = row_ok[:, None] & (k0 + offs < end)[None, :]
        x = tl.load(x_rows + (k0 + offs)[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
        if HAS_ROW_W:
            x = x * w
        q = _quantize(x, scale, IS_INT, SOFT_FP8)
        tl.store(q_rows + (k0 + offs)[None, :] * stride_qk, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def expert_amax_kernel(
    x_ptr, amax_ptr, row_w_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, top_k, width,
    stride_xr, stride_xk,
    GATHER: tl.constexpr, HAS_ROW_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """amax[e] = max(amax[e], |x[row(r), :] (* w[slot(r)])|) over the rows r of one row block.

    GATHER: x rows are tokens (row = slot // top_k), else sorted rows (row = r). amax starts at 0;
    the max is order-free, so the atomic update is deterministic.
    """
    pid = tl.program_id(0)
    if pid * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert, rows, slot, row_ok, src = _source_rows(pid, sorted_slot_ptr, block_expert_ptr, num_slots, top_k,
                                                   GATHER, BLOCK_M)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if HAS_ROW_W:
        w = tl.load(row_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k_ok = k0 + offs < width
        x = tl.load(x_ptr + src[:, None] * stride_xr + (k0 + offs)[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if HAS_ROW_W:
            x = x * w[:, None]
        amax = _max_nan(amax, tl.abs(x))
    tl.atomic_max(amax_ptr + expert, tl.reduce(tl.reduce(amax, 1, _max_nan), 0, _max_nan))


@triton.jit
def quantize_expert_rows_kernel(
    x_ptr, q_ptr, s_ptr, scale_ptr, row_w_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, top_k, width, stride_scale,
    stride_xr, stride_xk, stride_qr, stride_qk,
    GATHER: tl.constexpr, HAS_ROW_W: tl.constexpr, STATIC: tl.constexpr, SOFT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Per-tensor fp8 codes per sorted row: q[r, k] = code(x[row(r), k] (* w[slot(r)]) / s[e])
    and s_out[r] = s[e], for the rows r of row block program_id(0) (local expert e) and the
    BLOCK_K columns program_id(1).

    s[e] = scale[e] (STATIC) or amax[e] / 448 (expert_amax_kernel's output). GATHER: x rows are
    tokens (row = slot // top_k), else sorted rows. Padding rows get code 0 and scale 0; blocks
    past the aligned row count are skipped (no GEMM reads them).
    """
    pid = tl.program_id(0)
    if pid * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert, rows, slot, row_ok, src = _source_rows(pid, sorted_slot_ptr, block_expert_ptr, num_slots, top_k,
                                                   GATHER, BLOCK_M)
    scale = tl.load(scale_ptr + expert * stride_scale).to(tl.float32)
    if not STATIC:
        scale = _scale_of(scale, FP8_MAX)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs < width
    x = tl.load(x_ptr + src[:, None] * stride_xr + offs[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if HAS_ROW_W:  # router weight on input: quantize w * x, as the reference does
        x = x * tl.load(row_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    q = tl.where(row_ok[:, None], _quantize(x, scale, False, SOFT_FP8), 0.0)
    rows64 = rows.to(tl.int64)
    tl.store(q_ptr + rows64[:, None] * stride_qr + offs[None, :] * stride_qk, q.to(q_ptr.dtype.element_ty),
             mask=k_ok[None, :])
    if tl.program_id(1) == 0:
        tl.store(s_ptr + rows64, tl.where(row_ok, scale, 0.0))
