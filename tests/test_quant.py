"""Quantization: number formats, weight quantize/dequantize, activation fake-quant, emulation.

Legend: T tokens, H hidden, I intermediate, G = 2I (gated) or I, E global / L local experts,
K top-k (for one GEMM: N output rows, K input columns).
"""

from __future__ import annotations

import gc
import math
import weakref
from dataclasses import dataclass

import pytest
import torch

from fusedmoe.backends import emulation
from fusedmoe.backends.emulation import EmulationExperts
from fusedmoe.config import MoEConfig
from fusedmoe.modular import ExpertWeights
from fusedmoe.quant import SCHEMES, QuantKey
from fusedmoe.quant.activations import fake_quantize_activation
from fusedmoe.quant.formats import (
    E2M1_VALUES,
    FP8_DTYPE,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_scale,
    fp8_dequantize,
    fp8_quantize,
    int4_pack,
    int4_unpack,
    int_dequantize,
    int_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)
from fusedmoe.quant.weights import (
    check_quant_weights,
    dequantize_weight,
    dequantize_weights,
    quantize_weights,
)
from fusedmoe.reference import fused_experts_ref


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These tensors are small (<= 300k elements): on 2 busy cores intra-op threading made each
    # elementwise op ~100x slower (8 ms vs 0.08 ms measured), so the module runs on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Tolerances -----------------------------------------------------------------------------------
# RMS relative error of one quantize -> dequantize round trip of N(0, 1)-like data, per format:
#   fp8 e4m3  3 mantissa bits: round to nearest errs by <= half an ulp <= 2^-4 |x|; spread
#             uniformly that is an RMS <= 2^-4 / sqrt(3) = 0.036 (measured 0.026).
#   int8      |err| <= s / 2, uniform: RMS s / sqrt(12) with s = amax / 127 and amax <= 4.5 sigma
#             for rows of >= 128 -> 4.5 / (127 sqrt(12)) = 0.0102 (measured 0.007).
#   int4      s = amax_g / 7, amax_g <= 4 sigma for groups of <= 128 -> 4 / (7 sqrt(12)) = 0.165
#             (measured 0.10-0.12).
#   e2m1      1 mantissa bit: half a step is <= |x| / 4 above 1 and a fixed 0.25 below, where
#             mxfp4's power-of-two scale leaves up to half the range unused -> 0.15 (measured
#             0.095 nvfp4, 0.118 mxfp4).
ROUND_TRIP_RMS = {"fp8": 0.036, "mxfp8": 0.036, "int8": 0.0102, "int4": 0.165, "nvfp4": 0.15,
                  "mxfp4": 0.15}
# Emulation vs the unquantized silu MoE: GEMM1's output carries the input's and w13's errors;
# silu(g) * u multiplies two such values (twice the error variance), then the intermediate's and
# w2's errors add: RMS <= sqrt(3 r_w^2 + 3 r_a^2) (r_a = 0 weight-only). Measured: 0.63-0.81x.


def out_tolerance(scheme_name: str) -> float:
    scheme = SCHEMES[scheme_name]
    r_w = ROUND_TRIP_RMS[scheme.weight.dtype]
    r_a = 0.0 if scheme.activation is None else ROUND_TRIP_RMS[scheme.activation.dtype]
    return math.sqrt(3 * r_w**2 + 3 * r_a**2)


# Emulation vs the reference on dequantized weights with the same hooks: the same float32 ops.
SAME_MATH_RTOL = 1e-6


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def make_weights(num_experts: int, rows: int, hidden: int, inter: int, seed: int = 0):
    """w13 [L, G, H], w2 [L, H, I] scaled so that GEMM outputs are O(1)."""
    return (randn(num_experts, rows, hidden, seed=seed, scale=hidden**-0.5),
            randn(num_experts, hidden, inter, seed=seed + 1, scale=inter**-0.5))


# E2M1, packing, E8M0 ---------------------------------------------------------------------------
def test_e2m1_code_table():
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = magnitudes + [-m for m in magnitudes]
    decoded = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert decoded.tolist() == expected
    assert torch.signbit(decoded[8]) and list(E2M1_VALUES) == expected
    values = torch.tensor(magnitudes[1:] + [-m for m in magnitudes[1:]])
    assert e2m1_encode(values).tolist() == [*range(1, 8), *range(9, 16)]


def test_e2m1_rounding_ties_to_even_code_and_saturates():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_encode(midpoints).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert e2m1_encode(-midpoints).tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert e2m1_encode(torch.tensor([0.26, 0.74, 5.01, 7.0, 1e30, -7.0, -0.1])).tolist() == [
        1, 1, 7, 7, 7, 15, 8,
    ]


def test_e2m1_encode_is_nearest_grid_value():
    x = randn(4096, seed=3, scale=3.0)
    target = x.abs().clamp(max=6.0)  # saturating
    nearest = (target.unsqueeze(-1) - torch.tensor(E2M1_VALUES[:8])).abs().min(-1).values
    decoded = e2m1_decode(e2m1_encode(x))
    assert torch.equal((decoded.abs() - target).abs(), nearest)
    assert torch.equal(torch.signbit(decoded), x < 0)


def test_nibble_packing_low_nibble_is_even_element():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0], [0x7, 0x8, 0x3, 0xC]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]
    assert torch.equal(unpack_nibbles(packed), codes)
    # e2m1: [0.5, -6, 3, 1] -> codes [1, 15, 5, 2] -> bytes [0xF1, 0x25]
    fp4 = pack_nibbles(e2m1_encode(torch.tensor([0.5, -6.0, 3.0, 1.0])))
    assert fp4.tolist() == [0xF1, 0x25]


def test_int4_pack_twos_complement():
    q = torch.tensor([-1, 7, -8, 0, 3, -3], dtype=torch.int8)
    packed = int4_pack(q)
    assert packed.tolist() == [0x7F, 0x08, 0xD3]
    assert torch.equal(int4_unpack(packed), q)
    everything = torch.arange(-8, 8, dtype=torch.int8)
    assert torch.equal(int4_unpack(int4_pack(everything)), everything)


def test_packing_needs_even_k():
    with pytest.raises(ValueError, match=r"cannot pack 5 4-bit values two per byte"):
        pack_nibbles(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"cannot pack 3 4-bit values"):
        int4_pack(torch.zeros(3, dtype=torch.int8))


def test_e8m0_decode():
    s = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    decoded = e8m0_decode(s)
    assert decoded[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(decoded[6])
    every = torch.arange(255, dtype=torch.uint8)
    assert e8m0_decode(every).tolist() == [math.ldexp(1.0, i - 127) for i in range(255)]


def test_e8m0_scale_is_smallest_power_of_two_in_range():
    amax = torch.tensor([6.0, 6.0001, 12.0, 3.0, 3.0001, 0.75, 448.0, 1e-30, 1e30])
    scale = e8m0_decode(e8m0_scale(amax, 6.0))
    assert scale.tolist() == [1.0, 2.0, 2.0, 0.5, 1.0, 0.125, 128.0,
                              2.0 ** math.ceil(math.log2(1e-30 / 6)),
                              2.0 ** math.ceil(math.log2(1e30 / 6))]
    wide = torch.exp(randn(10_000, seed=4, scale=12.0))  # ~e^+-50: no clamp to [2^-127, 2^127]
    for fmt_max in (6.0, 448.0):
        ratio = wide / e8m0_decode(e8m0_scale(wide, fmt_max))
        assert (ratio <= fmt_max).all() and (ratio > fmt_max / 2).all()
    zero = e8m0_scale(torch.zeros(3), 6.0)
    assert zero.tolist() == [0, 0, 0]


# Scalar formats --------------------------------------------------------------------------------
def test_fp8_round_trip_within_half_ulp():
    x = randn(64, 512, seed=5)
    scale = x.abs().amax() / 448
    q = fp8_quantize(x, scale)
    assert q.dtype == FP8_DTYPE
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 |x/s| in the normal range; the subnormal step
    # (below 2^-6) is 2^-9, so at most 2^-10 s there.
    err = (fp8_dequantize(q, scale) - x).abs()
    assert (err <= 2**-4 * x.abs() + 2**-10 * scale).all()
    assert fp8_quantize(torch.tensor([1e6, -1e6]), 1.0).float().tolist() == [448.0, -448.0]


def test_int_quantize_rounds_half_to_even_and_clamps():
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5])
    assert int_quantize(halves, 1.0, 8).tolist() == [0, 2, 2, 0, -2]
    assert int_quantize(torch.tensor([200.0, -200.0]), 1.0, 8).tolist() == [127, -128]
    assert int_quantize(torch.tensor([7.6, -9.0, -8.4]), 1.0, 4).tolist() == [7, -8, -8]
    x = randn(32, 256, seed=6)
    scale = x.abs().amax(-1, keepdim=True) / 127
    err = (int_dequantize(int_quantize(x, scale, 8), scale) - x).abs()
    assert (err <= scale / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_block_round_trip_bound(fmt):
    x = randn(64, 256, seed=7, scale=3.0)
    if fmt == "nvfp4":
        global_scale = nvfp4_global_scale(x.abs().amax())
        packed, block_scale = nvfp4_quantize(x, global_scale)
        assert block_scale.dtype == FP8_DTYPE and block_scale.shape == (64, 16)
        y = nvfp4_dequantize(packed, block_scale, global_scale)
        scale = (block_scale.float() * global_scale).repeat_interleave(16, -1)
    else:
        packed, e8m0 = mxfp4_quantize(x)
        assert e8m0.dtype == torch.uint8 and e8m0.shape == (64, 8)
        y = mxfp4_dequantize(packed, e8m0)
        scale = e8m0_decode(e8m0).repeat_interleave(32, -1)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128)
    # Half a grid step in units of s: 0.25 below 2, 0.5 below 4, 1 up to 6, i.e. <= max(s, |x|)/4;
    # nvfp4's e4m3-rounded block scale can push |x/s| to 6 * (1 + 2^-4) -> saturation <= 0.4 s.
    assert ((y - x).abs() <= torch.maximum(scale, x.abs()) / 4).all()


def test_nvfp4_zero_blocks_and_tensors_give_zeros():
    x = randn(4, 64, seed=8)
    x[1] = 0
    x[2, 16:32] = 0
    y = nvfp4_dequantize(*nvfp4_quantize(x, nvfp4_global_scale(x.abs().amax())),
                         nvfp4_global_scale(x.abs().amax()))
    assert torch.isfinite(y).all() and (y[1] == 0).all() and (y[2, 16:32] == 0).all()
    zeros = torch.zeros(3, 32)
    global_scale = nvfp4_global_scale(zeros.abs().amax())
    assert global_scale.item() == 1.0
    assert (nvfp4_dequantize(*nvfp4_quantize(zeros, global_scale), global_scale) == 0).all()


# Weights ---------------------------------------------------------------------------------------
NUM_EXPERTS, HIDDEN, INTER = 3, 256, 128


def payload_layout(scheme_name: str, n: int, k: int):
    """(payload dtype, payload shape, scale dtype, scale shape) for one [E, N, K] weight."""
    key = SCHEMES[scheme_name].weight
    e = NUM_EXPERTS
    if key.dtype in ("int4", "nvfp4", "mxfp4"):
        payload = (torch.uint8, (e, n, k // 2))
    else:
        payload = ({"fp8": FP8_DTYPE, "int8": torch.int8}[key.dtype], (e, n, k))
    scale_dtype = {"nvfp4": FP8_DTYPE, "mxfp4": torch.uint8}.get(key.dtype, torch.float32)
    if key.granularity == "tensor":
        scale_shape = (e,)
    elif key.granularity == "channel":
        scale_shape = (e, n)
    elif key.granularity == "block":
        scale_shape = (e, math.ceil(n / 128), math.ceil(k / 128))
    else:
        scale_shape = (e, n, k // key.group)
    return (*payload, scale_dtype, scale_shape)


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_weight_round_trip_and_layout(scheme_name):
    w13, w2 = make_weights(NUM_EXPERTS, 2 * INTER, HIDDEN, INTER, seed=10)
    scheme = SCHEMES[scheme_name]
    static = scheme.activation is not None and not scheme.activation.dynamic
    q13, q2, params = quantize_weights(w13, w2, scheme_name,
                                       activation_amax=(4.0, 2.0) if static else None)
    for name, q, scale, (n, k) in (("w13", q13, params.w13_scale, (2 * INTER, HIDDEN)),
                                   ("w2", q2, params.w2_scale, (HIDDEN, INTER))):
        dtype, shape, scale_dtype, scale_shape = payload_layout(scheme_name, n, k)
        assert (q.dtype, tuple(q.shape)) == (dtype, shape), name
        assert (scale.dtype, tuple(scale.shape)) == (scale_dtype, scale_shape), name
    if scheme.weight.dtype == "nvfp4":
        for g in (params.w13_global_scale, params.w2_global_scale):
            assert g.dtype == torch.float32 and tuple(g.shape) == (NUM_EXPERTS,)
    else:
        assert params.w13_global_scale is None and params.w2_global_scale is None
    check_quant_weights(q13, q2, params, HIDDEN, 2 * INTER)
    d13, d2 = dequantize_weights(q13, q2, params)
    assert d13.dtype == torch.float32 and d13.shape == w13.shape and d2.shape == w2.shape
    bound = ROUND_TRIP_RMS[scheme.weight.dtype]
    assert rel_error(d13, w13) < bound and rel_error(d2, w2) < bound


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_weights_are_quantized_a_chunk_of_experts_at_a_time_bit_for_bit(scheme_name, monkeypatch):
    """quantize_weight / dequantize_weight work through QUANTIZE_CHUNK_ELEMENTS weights at a time
    (their temporaries bounded, not growing with E): the same bits as one pass over every expert,
    at 5 experts in chunks of 2 (the last one short), fp32 and bf16 weights, 4-bit payloads also in
    the fragment layout; and a chunk is never less than one expert."""
    from fusedmoe.quant import weights
    from fusedmoe.quant.fragments import to_fragments

    scheme = SCHEMES[scheme_name]
    seen = []
    real = weights._quantize_experts
    monkeypatch.setattr(weights, "_quantize_experts", lambda w, s: (seen.append(w.shape[0]), real(w, s))[1])
    for dtype in (torch.float32, torch.bfloat16):
        w13, w2 = (w.to(dtype) for w in make_weights(5, 2 * 128, 128, 128, seed=14))
        monkeypatch.setattr(weights, "QUANTIZE_CHUNK_ELEMENTS", 1 << 40)
        whole = weights.quantize_weights(w13, w2, scheme_name)
        assert seen == [5, 5]
        seen.clear()
        monkeypatch.setattr(weights, "QUANTIZE_CHUNK_ELEMENTS", 2 * 256 * 128)  # two of w13's experts
        chunked = weights.quantize_weights(w13, w2, scheme_name)
        assert seen == [2, 2, 1, 4, 1], seen  # w2's experts are half w13's: 4 at a time
        seen.clear()
        assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
        for name in ("w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale", "w13_zero", "w2_zero"):
            a, b = getattr(chunked[2], name), getattr(whole[2], name)
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        q13, params = whole[0], whole[2]
        layouts = [(q13, params.w13_scale, params.w13_zero)]
        if scheme.weight.dtype == "mxfp4":
            layouts.append((*to_fragments(q13, params.w13_scale, "mxfp4"), None))
        for q, scale, zero in layouts:
            monkeypatch.setattr(weights, "QUANTIZE_CHUNK_ELEMENTS", 1 << 40)
            one = weights.dequantize_weight(q, scale, scheme_name, params.w13_global_scale, zero=zero)
            monkeypatch.setattr(weights, "QUANTIZE_CHUNK_ELEMENTS", 2 * 256 * 128)
            assert torch.equal(weights.dequantize_weight(q, scale, scheme_name, params.w13_global_scale, zero=zero),
                               one)
    monkeypatch.setattr(weights, "QUANTIZE_CHUNK_ELEMENTS", 1)
    assert weights._expert_chunks(3, 64, 128) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert weights._expert_chunks(0, 64, 128) == [slice(0, 0)]


def test_dequantize_weight_refuses_a_missing_or_stray_global_scale():
    """nvfp4 needs its per-expert global scale; any other scheme given one is refused, by name,
    before any dequantization (checked ahead of the chunked work)."""
    w13, w2 = make_weights(2, 64, 128, 64, seed=15)
    q13, _, params = quantize_weights(w13, w2, "nvfp4_w4a16")
    with pytest.raises(ValueError, match="nvfp4_w4a16 weights need global_scale"):
        dequantize_weight(q13, params.w13_scale, "nvfp4_w4a16")
    m13, _, mx = quantize_weights(w13, w2, "mxfp4_w4a16")
    with pytest.raises(ValueError, match="global_scale is set but mxfp4_w4a16 has none"):
        dequantize_weight(m13, mx.w13_scale, "mxfp4_w4a16", params.w13_global_scale)


@pytest.mark.parametrize("scheme_name", ["int4_w4a16_g32", "int4_w4a16_g128"])
def test_int4_scales_of_bf16_weights_are_bf16(scheme_name):
    """int4 group scales of bf16 weights are stored in bf16 (as GPTQ / AWQ checkpoints and the
    benchmarks keep them: half the scale bytes of fp32) and the codes are rounded against the
    stored scale: bitwise int_quantize(w / bf16(amax / 7)); the round trip stays within half a
    step (plus the clamp of a group whose bf16 scale rounded down). fp16 and fp32 weights keep
    fp32 scales."""
    from fusedmoe.quant.formats import absmax_scale, int4_unpack, int_quantize

    w13, w2 = make_weights(NUM_EXPERTS, 2 * INTER, HIDDEN, INTER, seed=12)
    group = SCHEMES[scheme_name].weight.group
    q13, q2, params = quantize_weights(w13.bfloat16(), w2.bfloat16(), scheme_name)
    assert params.w13_scale.dtype == torch.bfloat16 and params.w2_scale.dtype == torch.bfloat16
    w = w13.bfloat16().float()
    grouped = w.view(NUM_EXPERTS, 2 * INTER, HIDDEN // group, group)
    want_scale = absmax_scale(grouped.abs().amax(-1), 7).to(torch.bfloat16)
    assert torch.equal(params.w13_scale, want_scale)
    codes = int_quantize(grouped, want_scale.float()[..., None], 4).view(w.shape)
    assert torch.equal(int4_unpack(q13), codes)
    step = want_scale.float().repeat_interleave(group, -1)
    d13, _ = dequantize_weights(q13, q2, params)
    assert ((d13 - w).abs() <= 0.5 * step + 7 * step * 2.0**-8).all()
    for dtype in (torch.float16, torch.float32):
        assert quantize_weights(w13.to(dtype), w2.to(dtype), scheme_name)[2].w13_scale.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_asymmetric_quantization(dtype):
    """`*_zp`: per group s = (max(w, 0) - min(w, 0)) / 15 in the scale dtype (bf16 for bf16
    weights), zero = round(-min / s) - 8 and codes round(w / s) + zero within [-8, 7]; w = s *
    (code - zero) within half a step, 0 exact; on a group of one sign the 16 levels span only its
    range, so it rounds twice as finely as symmetric int4 (whose 8 levels of that sign are used)."""
    from fusedmoe.quant.formats import int4_unpack

    w13, w2 = make_weights(NUM_EXPERTS, 2 * INTER, HIDDEN, INTER, seed=13)
    w13[:, :4] = w13[:, :4].abs()  # four rows of one sign
    w13[:, 4, :32] = 0  # a zero group
    w13, w2 = w13.to(dtype), w2.to(dtype)
    q13, q2, params = quantize_weights(w13, w2, "int4_w4a16_g32_zp")
    scale, zero = params.w13_scale, params.w13_zero
    assert scale.dtype == zero.dtype == dtype and zero.shape == scale.shape == (NUM_EXPERTS, 2 * INTER, HIDDEN // 32)
    assert torch.equal(zero, zero.round()) and zero.min() >= -8 and zero.max() <= 7
    grouped = w13.float().view(NUM_EXPERTS, 2 * INTER, HIDDEN // 32, 32)
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    want = torch.where(hi == lo, 1.0, (hi - lo) / 15).to(dtype)
    assert torch.equal(scale, want)
    codes = int4_unpack(q13).view(grouped.shape).float()
    assert torch.equal(codes, (torch.round(grouped / scale.float()[..., None]) + zero.float()[..., None] + 8)
                       .clamp(0, 15) - 8)
    d13, d2 = dequantize_weights(q13, q2, params)
    step = scale.float().repeat_interleave(32, -1)
    # plus the clamp at a group's end where the stored (bf16) scale rounded down: 15 steps short by 2^-8 each
    assert ((d13 - w13.float()).abs() <= 0.5 * step + 16 * step * 2.0**-8).all()
    assert (d13[:, 4, :32] == 0).all() and (d13[w13 == 0] == 0).all()
    sym = dequantize_weights(*quantize_weights(w13, w2, "int4_w4a16_g32"))[0]
    assert rel_error(d13[:, :4], w13[:, :4].float()) < 0.6 * rel_error(sym[:, :4], w13[:, :4].float())


def test_nvfp4_scale_layout_and_math():
    w13, w2 = make_weights(2, 64, 96, 32, seed=11)
    q13, q2, params = quantize_weights(w13, w2, "nvfp4")
    assert tuple(q13.shape) == (2, 64, 48) and tuple(q2.shape) == (2, 96, 16)
    assert params.w13_scale.dtype == FP8_DTYPE and tuple(params.w13_scale.shape) == (2, 64, 6)
    assert tuple(params.w2_scale.shape) == (2, 96, 2)
    assert torch.equal(params.w13_global_scale, w13.abs().amax(dim=(1, 2)) / (448 * 6))
    # The largest block of each expert gets the largest e4m3 scale, 448.
    assert params.w13_scale.float().amax(dim=(1, 2)).tolist() == [448.0, 448.0]
    assert params.a13_scale is None and params.a2_scale is None


def test_block_scales_with_edges_not_multiple_of_128():
    w = randn(2, 200, 300, seed=12)
    q, _, params = quantize_weights(w, randn(2, 300, 200, seed=13), "fp8_w8a8_block")
    assert tuple(params.w13_scale.shape) == (2, 2, 3) and tuple(params.w2_scale.shape) == (2, 3, 2)
    corner = w[:, 128:200, 256:300].abs().amax(dim=(1, 2)) / 448
    assert torch.equal(params.w13_scale[:, 1, 2], corner)
    d = dequantize_weight(q, params.w13_scale, "fp8_w8a8_block", shape_NK=(200, 300))
    assert rel_error(d, w) < ROUND_TRIP_RMS["fp8"]
    message = r"holds \[E, 200, 300\] fp8_w8a8_block weights, expected \[E, 200, 256\]"
    with pytest.raises(ValueError, match=message):
        dequantize_weight(q, params.w13_scale, "fp8_w8a8_block", shape_NK=(200, 256))


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_zero_weights_dequantize_to_zeros(scheme_name):
    w13, w2 = torch.zeros(2, 64, 128), torch.zeros(2, 128, 128)
    w13[1, 3, :] = randn(128, seed=14)  # one live row: the rest of expert 1 stays exactly zero
    q13, q2, params = quantize_weights(w13, w2, scheme_name)
    d13, d2 = dequantize_weights(q13, q2, params)
    assert torch.isfinite(d13).all() and torch.isfinite(d2).all()
    assert (d2 == 0).all() and (d13[0] == 0).all()
    assert (d13[1, :3] == 0).all() and (d13[1, 4:] == 0).all()


def test_quantize_weights_errors():
    w13, w2 = make_weights(2, 64, 200, 32)
    message = (r"int4_w4a16_g128 has one scale per 128 inputs, but w13's K = 200 is not a "
               r"multiple of 128 \(200 % 128 = 72\)")
    with pytest.raises(ValueError, match=message):
        quantize_weights(w13, w2, "int4_w4a16_g128")
    w13, w2 = make_weights(2, 64, 128, 32)
    message = (r"activation_amax sets static activation scales, but fp8_w8a8_channel has dynamic "
               r"ones \(fp8/token/dynamic\)")
    with pytest.raises(ValueError, match=message):
        quantize_weights(w13, w2, "fp8_w8a8_channel", activation_amax=(1.0, 1.0))
    message = r"activation_amax for GEMM2 has 3 values, expected 1 or 2"
    with pytest.raises(ValueError, match=message):
        quantize_weights(w13, w2, "fp8_w8a8_tensor_static", activation_amax=(1.0, torch.ones(3)))
    with pytest.raises(ValueError, match=r"'fp9' is not a known quantization scheme"):
        quantize_weights(w13, w2, "fp9")
    with pytest.raises(ValueError, match=r"w2 must be a floating-point \[E, N, K\] tensor, got "
                                         r"torch.int8 \(2, 128, 32\)"):
        quantize_weights(w13, w2.to(torch.int8), "fp8_w8a16")


# check_quant_weights: (scheme, change to the valid quantized weights, expected message) -----------
@dataclass(frozen=True)
class BadQuant:
    scheme: str
    field: str
    value: object
    message: str


E8, G, H = 8, 256, 128
BAD_QUANT = [
    BadQuant("fp8_w8a8_channel", "w13_scale", torch.ones(E8, 3),
             r"w13_scale has shape \(8, 3\), expected \(8, 256\) for fp8_w8a8_channel"),
    BadQuant("fp8_w8a8_block", "w2_scale", torch.ones(E8, 1, 2),
             r"w2_scale has shape \(8, 1, 2\), expected \(8, 1, 1\) for fp8_w8a8_block"),
    BadQuant("fp8_w8a8_channel", "w13", torch.zeros(E8, G, H, dtype=torch.bfloat16),
             r"w13 has dtype torch.bfloat16, expected torch.float8_e4m3fn for fp8_w8a8_channel"),
    BadQuant("int4_w4a16_g32", "w13", torch.zeros(E8, G, H, dtype=torch.uint8),
             r"w13 has shape \(8, 256, 128\), expected \(8, 256, 64\) for int4_w4a16_g32 with "
             r"G = 256, H = 128 \(int4 packs two codes per byte along K\)"),
    BadQuant("int8_w8a8", "w2", torch.zeros(E8, H, 100, dtype=torch.int8),
             r"w2 has shape \(8, 128, 100\), expected \(8, 128, 128\) or \(8, 128, 256\) "
             r"\(I = G / 2 gated, I = G non-gated\) for int8_w8a8"),
    BadQuant("nvfp4", "w13_scale", torch.ones(E8, G, H // 16),
             r"w13_scale has dtype torch.float32, expected torch.float8_e4m3fn for nvfp4"),
    BadQuant("nvfp4", "w2_global_scale", None,
             r"w2_global_scale is None, expected a tensor of shape \(8,\) for nvfp4"),
    BadQuant("mxfp4_w4a16", "w13_global_scale", torch.ones(E8),
             r"w13_global_scale is set but mxfp4_w4a16 has no global scale \(only nvfp4 does\)"),
    BadQuant("fp8_w8a8_tensor_static", "a13_scale", None,
             r"a13_scale is None but fp8_w8a8_tensor_static quantizes activations with a static "
             r"scale \(fp8/tensor/static\): set QuantParams.a13_scale"),
    BadQuant("fp8_w8a8_tensor_static", "a2_scale", torch.ones(3),
             r"a2_scale has shape \(3,\), expected \(\) or \(1,\) or \(8,\) for "
             r"fp8_w8a8_tensor_static"),
    BadQuant("int8_w8a16", "a13_scale", torch.ones(1),
             r"a13_scale is set but int8_w8a16 has no activation quantization; leave it None"),
    BadQuant("fp8_w8a8_tensor", "a2_scale", torch.ones(1),
             r"a2_scale is set but fp8_w8a8_tensor has dynamic activation scales"),
    BadQuant("int4_w4a16_g32_zp", "w13_zero", None,
             r"w13_zero is None but int4_w4a16_g32_zp is asymmetric: it needs zero points \(the scales' "
             r"shape \(8, 256, 4\) and dtype torch.float32, each z - 8\)"),
    BadQuant("int4_w4a16_g32_zp", "w2_zero", torch.zeros(E8, H, G // 64, dtype=torch.bfloat16),
             r"w2_zero has dtype torch.bfloat16, expected its scale's torch.float32 for int4_w4a16_g32_zp"),
    BadQuant("int4_w4a16_g32_zp", "w2_zero", torch.zeros(E8, H, G // 32),
             r"w2_zero has shape \(8, 128, 8\), expected its scale's \(8, 128, 4\) for int4_w4a16_g32_zp"),
    BadQuant("int4_w4a16_g32_zp", "w13_zero", torch.zeros(E8, H // 32, G).transpose(1, 2),
             r"w13_zero has strides \(1024, 1, 256\), expected its scale's \(1024, 4, 1\)"),
    BadQuant("int4_w4a16_g32", "w13_zero", torch.zeros(E8, G, H // 32),
             r"w13_zero is set but int4_w4a16_g32 is symmetric \(zero points belong to the \*_zp schemes, "
             r"e.g. int4_w4a16_g32_zp\)"),
    BadQuant("mxfp4_w4a16", "w2_zero", torch.zeros(E8, H, G // 64),
             r"w2_zero is set but mxfp4_w4a16 has no zero points"),
]


@pytest.mark.parametrize("bad", BAD_QUANT, ids=lambda b: f"{b.scheme}-{b.field}")
def test_check_quant_weights_errors(bad):
    w13, w2 = make_weights(E8, G, H, G // 2, seed=15)
    static = not SCHEMES[bad.scheme].weight_only and not SCHEMES[bad.scheme].activation.dynamic
    q13, q2, params = quantize_weights(w13, w2, bad.scheme,
                                       activation_amax=(1.0, 1.0) if static else None)
    check_quant_weights(q13, q2, params, H, G)
    tensors = {"w13": q13, "w2": q2}
    if bad.field in tensors:
        tensors[bad.field] = bad.value
    else:
        setattr(params, bad.field, bad.value)
    with pytest.raises(ValueError, match=bad.message):
        check_quant_weights(tensors["w13"], tensors["w2"], params, H, G)


def test_check_quant_weights_group_divisibility():
    w13, w2 = make_weights(2, 64, 128, 32)
    q13, q2, params = quantize_weights(w13, w2, "mxfp4_w4a16")
    with pytest.raises(ValueError, match=r"mxfp4_w4a16 has one scale per 32 inputs, but w13's "
                                         r"K = 100 is not a multiple of 32"):
        check_quant_weights(q13, q2, params, 100, 64)


# Activations -----------------------------------------------------------------------------------
ACTIVATION_KEYS = sorted({s.activation for s in SCHEMES.values() if s.activation}, key=str)


def static_scale_for(key: QuantKey, x: torch.Tensor) -> torch.Tensor | None:
    return None if key.dynamic else (x.abs().amax() / 448).reshape(1)


@pytest.mark.parametrize("key", ACTIVATION_KEYS, ids=str)
def test_fake_quant_activation_error_and_zero_rows(key):
    x = randn(33, 256, seed=20)
    x[5] = 0
    y = fake_quantize_activation(x, key, static_scale_for(key, x))
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.isfinite(y).all() and (y[5] == 0).all()
    assert rel_error(y, x) < ROUND_TRIP_RMS[key.dtype]
    zeros = torch.zeros(4, 256)
    assert (fake_quantize_activation(zeros, key, static_scale_for(key, x)) == 0).all()


def test_fake_quant_fp8_token_is_idempotent():
    key = SCHEMES["fp8_w8a8_channel"].activation
    once = fake_quantize_activation(randn(16, 512, seed=21, scale=7.0), key)
    # The row amax comes back as 448 * s up to an fp32 rounding, so s (hence values) move by ulps.
    assert ((fake_quantize_activation(once, key) - once).abs() <= 1e-6 * once.abs()).all()


def test_fake_quant_int8_token_on_grid():
    key = SCHEMES["int8_w8a8"].activation
    x = randn(16, 256, seed=22)
    y = fake_quantize_activation(x, key)
    steps = y / (x.abs().amax(-1, keepdim=True) / 127)
    assert (steps - steps.round()).abs().max() < 1e-4 and steps.abs().max() <= 127 + 1e-4
    assert ((fake_quantize_activation(y, key) - y).abs() <= 1e-6 * y.abs()).all()


def test_fake_quant_fp8_groups_with_short_last_group():
    key = SCHEMES["fp8_w8a8_block"].activation
    token = SCHEMES["fp8_w8a8_channel"].activation
    x = randn(8, 300, seed=23)  # groups of 128, 128, 44
    y = fake_quantize_activation(x, key)
    for lo, hi in ((0, 128), (128, 256), (256, 300)):
        assert torch.equal(y[:, lo:hi], fake_quantize_activation(x[:, lo:hi], token))


def test_fake_quant_mxfp8_values_on_grid():
    key = SCHEMES["mxfp4_w4a8"].activation
    x = randn(8, 128, seed=24, scale=100.0)
    y = fake_quantize_activation(x, key)
    _, scale = mxfp8_quantize(x)
    steps = y / e8m0_decode(scale).repeat_interleave(32, -1)  # exact: powers of two
    assert torch.equal(steps.to(FP8_DTYPE).float(), steps) and steps.abs().max() <= 448


def test_fake_quant_nvfp4_static_global_scale():
    key = SCHEMES["nvfp4"].activation
    x = randn(8, 128, seed=25)
    dynamic = fake_quantize_activation(x, key)
    static = fake_quantize_activation(x, key, (x.abs().amax() / (448 * 6)).reshape(1))
    assert torch.equal(dynamic, static)
    # A power-of-two change of the global scale would only shift the e4m3 block scales' exponents.
    coarser = fake_quantize_activation(x, key, (3 * x.abs().amax() / (448 * 6)).reshape(1))
    assert not torch.equal(coarser, dynamic) and rel_error(coarser, x) < ROUND_TRIP_RMS["nvfp4"]


def test_fake_quant_static_scale_errors():
    static, dynamic = SCHEMES["fp8_w8a8_tensor_static"].activation, SCHEMES["int8_w8a8"].activation
    x = randn(4, 128, seed=26)
    with pytest.raises(ValueError, match=r"fp8/tensor/static activations need a static scale"):
        fake_quantize_activation(x, static)
    with pytest.raises(ValueError, match=r"int8/token/dynamic activations compute their scales"):
        fake_quantize_activation(x, dynamic, torch.ones(1))
    with pytest.raises(ValueError, match=r"static_scale must hold one value"):
        fake_quantize_activation(x, static, torch.ones(3))
    with pytest.raises(ValueError, match=r"no activation fake-quantization for int8/tensor/dyn"):
        fake_quantize_activation(x, QuantKey("int8", "tensor", dynamic=True))
    with pytest.raises(ValueError, match=r"no activation fake-quantization for fp8/token/static: "
                                         r"only fp8 per-tensor scales are static"):
        fake_quantize_activation(x, QuantKey("fp8", "token"), torch.ones(1))


# Emulation backend -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    scheme: str
    activation: str = "silu"
    top_k: int = 2
    bias: bool = False
    weight_on_input: bool = False
    expert_map: bool = True  # global expert 2 is remote, local 3 (global 4) gets no tokens
    calibrate: str | None = None  # activation_amax: "tensor" (one value) or "expert" ([L])
    dtype: torch.dtype = torch.float32

    @property
    def id(self) -> str:
        extras = [f for f in ("bias", "weight_on_input") if getattr(self, f)]
        extras += [f"calibrate_{self.calibrate}"] if self.calibrate else []
        extras += [] if self.activation == "silu" else [self.activation]
        extras += [] if self.expert_map else ["no_map"]
        extras += [] if self.dtype == torch.float32 else [str(self.dtype).removeprefix("torch.")]
        return "-".join([self.scheme, *extras])


NUM_GLOBAL, T = 5, 48
EMULATION_CASES = [
    *(Case(s, calibrate="tensor" if s == "fp8_w8a8_tensor_static" else None)
      for s in sorted(SCHEMES)),
    Case("nvfp4", calibrate="tensor"),
    Case("fp8_w8a8_tensor_static", calibrate="expert"),
    Case("fp8_w8a8_block", activation="swigluoai", bias=True, dtype=torch.bfloat16),
    Case("int8_w8a8", top_k=1, weight_on_input=True, bias=True),
    Case("fp8_w8a8_tensor_static", top_k=1, weight_on_input=True, calibrate="tensor"),
    Case("int4_w4a16_g32", activation="relu2_no_mul", expert_map=False),
    Case("mxfp4_w4a8", activation="gelu", expert_map=False, dtype=torch.float16),
]


@dataclass
class Problem:
    case: Case
    config: MoEConfig
    x_TH: torch.Tensor
    w13_LGH: torch.Tensor
    w2_LHI: torch.Tensor
    w13_bias_LG: torch.Tensor | None
    w2_bias_LH: torch.Tensor | None
    topk_weights_TK: torch.Tensor
    topk_ids_TK: torch.Tensor
    expert_map_E: torch.Tensor | None

    @property
    def num_local(self) -> int:
        return self.w13_LGH.shape[0]

    def reference(self, w13_LGH, w2_LHI, **hooks) -> torch.Tensor:
        return fused_experts_ref(
            self.x_TH, w13_LGH, w2_LHI, self.topk_weights_TK, self.topk_ids_TK,
            activation=self.case.activation,
            apply_router_weight_on_input=self.case.weight_on_input,
            expert_map_E=self.expert_map_E, global_num_experts=NUM_GLOBAL,
            w13_bias_LG=self.w13_bias_LG, w2_bias_LH=self.w2_bias_LH, **hooks,
        )

    def emulate(self, experts, q13, q2, params, **kwargs) -> torch.Tensor:
        weights = ExpertWeights(q13, q2, self.w13_bias_LG, self.w2_bias_LH, params)
        return experts.apply(self.x_TH, weights, self.topk_weights_TK, self.topk_ids_TK,
                             expert_map_E=self.expert_map_E, **kwargs)


def make_problem(case: Case) -> Problem:
    config = MoEConfig(num_experts=NUM_GLOBAL, top_k=case.top_k, hidden_size=HIDDEN,
                       intermediate_size=INTER, dtype=case.dtype, activation=case.activation,
                       has_bias=case.bias, quant=case.scheme,
                       apply_router_weight_on_input=case.weight_on_input,
                       has_expert_map=case.expert_map)
    num_local = 4 if case.expert_map else NUM_GLOBAL
    w13, w2 = make_weights(num_local, (2 if config.gated else 1) * INTER, HIDDEN, INTER, seed=30)
    b13 = randn(num_local, w13.shape[1], seed=31, scale=0.1) if case.bias else None
    b2 = randn(num_local, HIDDEN, seed=32, scale=0.1) if case.bias else None
    g = torch.Generator().manual_seed(33)
    # Global ids 0-3 only: with the map, global 2 is remote and local 3 (global 4) gets no tokens.
    pool = 4 if case.expert_map else NUM_GLOBAL
    ids = torch.stack([torch.randperm(pool, generator=g)[: case.top_k] for _ in range(T)])
    expert_map = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32) if case.expert_map else None
    return Problem(case, config, randn(T, HIDDEN, seed=34).to(case.dtype), w13, w2, b13, b2,
                   torch.rand(T, case.top_k, generator=g), ids.int(), expert_map)


def calibrate(problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """activation_amax: the largest |input| of each GEMM in an unquantized run, per local expert
    ("expert"; 1.0 for an expert without tokens) or over all of them ("tensor")."""
    amax = {"a13": torch.ones(problem.num_local), "a2": torch.ones(problem.num_local)}
    seen = set()

    def record(name):
        def hook(a, local_expert):
            amax[name][local_expert] = a.abs().amax()
            seen.add(local_expert)
            return a

        return hook

    problem.reference(problem.w13_LGH, problem.w2_LHI,
                      input_transform=record("a13"), intermediate_transform=record("a2"))
    if problem.case.calibrate == "expert":
        return amax["a13"], amax["a2"]
    live = sorted(seen)
    return amax["a13"][live].max(), amax["a2"][live].max()


def fake_quant_hook(key: QuantKey | None, static: torch.Tensor | None, num_local: int):
    if key is None:
        return None
    static_L = None if static is None else static.reshape(-1).expand(num_local)
    return lambda a, e: fake_quantize_activation(a, key, None if static_L is None else static_L[e])


@pytest.mark.parametrize("case", EMULATION_CASES, ids=lambda c: c.id)
def test_emulation_matches_reference(case):
    problem = make_problem(case)
    amax = calibrate(problem) if case.calibrate else None
    q13, q2, params = quantize_weights(problem.w13_LGH, problem.w2_LHI, case.scheme,
                                       activation_amax=amax)
    experts = EmulationExperts(problem.config)
    out = problem.emulate(experts, q13, q2, params)
    assert out.dtype == case.dtype and out.shape == problem.x_TH.shape
    assert torch.isfinite(out).all()

    key, num_local = params.scheme.activation, problem.num_local
    same_math = problem.reference(
        *dequantize_weights(q13, q2, params),
        input_transform=fake_quant_hook(key, params.a13_scale, num_local),
        # the intermediate rounded to the activation dtype first, as the kernels store it
        intermediate_transform=None if key is None else lambda a, e: fake_quant_hook(
            key, params.a2_scale, num_local)(a.to(case.dtype).to(a.dtype), e),
    )
    assert rel_error(out, same_math) < SAME_MATH_RTOL

    if problem.expert_map_E is not None:  # slots on the remote expert (global 2) add nothing
        assert (out[(problem.topk_ids_TK == 2).all(-1)] == 0).all()
    if case.activation == "silu" and not case.bias and case.dtype == torch.float32:
        exact = problem.reference(problem.w13_LGH, problem.w2_LHI)
        assert rel_error(out, exact) < out_tolerance(case.scheme)

    into = torch.empty_like(problem.x_TH)
    assert problem.emulate(experts, q13, q2, params, out_TH=into) is into
    assert torch.equal(into, out)


def test_emulation_caches_dequantized_weights(monkeypatch):
    problem = make_problem(Case("int8_w8a16"))
    q13, q2, params = quantize_weights(problem.w13_LGH, problem.w2_LHI, "int8_w8a16")
    calls = []

    def counting(*args):
        calls.append(1)
        return dequantize_weights(*args)

    monkeypatch.setattr(emulation, "dequantize_weights", counting)
    experts = EmulationExperts(problem.config)
    first = problem.emulate(experts, q13, q2, params)
    assert torch.equal(problem.emulate(experts, q13, q2, params), first)
    assert len(calls) == 1
    q13[0].neg_()  # an in-place update bumps the version: the cache must notice
    changed = problem.emulate(experts, q13, q2, params)
    assert len(calls) == 2 and not torch.equal(changed, first)
    # the fp32 copies live no longer than their source weights (the API keeps one experts object
    # per config alive: a freed layer's copies must not stay pinned by it)
    copies = weakref.ref(experts._cache[2][0])
    del q13, q2, params
    gc.collect()
    assert experts._cache is None and copies() is None


def test_emulation_errors():
    problem = make_problem(Case("fp8_w8a8_tensor_static"))
    experts = EmulationExperts(problem.config)
    # Without calibration quantize_weights cannot know the static activation scales.
    q13, q2, params = quantize_weights(problem.w13_LGH, problem.w2_LHI, "fp8_w8a8_tensor_static")
    message = r"a13_scale is None but fp8_w8a8_tensor_static quantizes activations with a static"
    with pytest.raises(ValueError, match=message):
        problem.emulate(experts, q13, q2, params)
    with pytest.raises(ValueError, match=r"weights.quant is None"):
        problem.emulate(experts, problem.w13_LGH, problem.w2_LHI, None)
    q13, q2, params = quantize_weights(problem.w13_LGH, problem.w2_LHI, "fp8_w8a8_channel")
    message = r"weights.quant has scheme fp8_w8a8_channel but the config says fp8_w8a8_tensor_st"
    with pytest.raises(ValueError, match=message):
        problem.emulate(experts, q13, q2, params)


@pytest.mark.parametrize("scheme", ["fp8_w8a8_block", "int8_w8a8", "int4_w4a16_g32", "mxfp4_w4a16", "nvfp4"])
def test_fused_experts_runs_quantized_through_emulation_on_cpu(scheme):
    """The public entry: the oracle picks `emulation` on CPU and the result is the dequantized math."""
    import fusedmoe
    from fusedmoe.quant.weights import dequantize_weights, quantize_weights

    gen = torch.Generator().manual_seed(21)
    x = torch.randn(6, 256, generator=gen)
    w13, w2 = torch.randn(5, 256, 256, generator=gen) / 16, torch.randn(5, 256, 128, generator=gen) / 11
    q13, q2, params = quantize_weights(w13, w2, scheme)
    weights, ids = fusedmoe.select_experts(x, torch.randn(6, 5, generator=gen), 2)
    config = fusedmoe.MoEConfig(5, 2, 256, 128, dtype=torch.float32, quant=scheme)
    assert fusedmoe.select_backend(config, fusedmoe.Platform("cpu")).name == "emulation"
    out = fusedmoe.fused_experts(x, q13, q2, weights, ids, quant=params)
    d13, d2 = dequantize_weights(q13, q2, params)
    key = params.scheme.activation
    from fusedmoe.backends.emulation import activation_transform

    ref = fusedmoe.fused_experts_ref(x, d13, d2, weights, ids,
                                     input_transform=activation_transform(key, params.a13_scale),
                                     intermediate_transform=activation_transform(key, params.a2_scale))
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
