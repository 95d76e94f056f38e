"""The Triton backend's weight-only schemes on the CPU, through the Triton interpreter: what is
theirs alone (the experts class, group-size refusals, the tile predicate, opcheck). The experts
against emulation and the reference over the kernels' K-loop and routing edges run with the
W8A8 schemes in tests/test_triton_quant.py.
Tiles are given explicitly where the heuristic's would make many small programs: the
interpreter's cost is per program and op.
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if torch.cuda.is_available():  # these build CPU tensors for the interpreter; GPUs run test_gpu_wo.py
    pytest.skip("interpreter tests (CPU); on a GPU see tests/test_gpu_wo.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = triton.language

from fusedmoe import MoEConfig  # noqa: E402
from fusedmoe.backends.emulation import EmulationExperts  # noqa: E402
from fusedmoe.backends.triton.experts import TritonExperts  # noqa: E402
from fusedmoe.backends.triton.quant import triton_quant_experts, triton_quant_experts_op  # noqa: E402
from fusedmoe.backends.triton.tiles import TileConfig, check_tile, heuristic  # noqa: E402
from fusedmoe.modular import ExpertWeights  # noqa: E402
from fusedmoe.quant import QuantParams  # noqa: E402
from fusedmoe.quant.weights import quantize_weights  # noqa: E402
from quant_problems import Case, int4_fragment_minimum, problem, rel_err, run  # noqa: E402

TOL = {torch.float32: 1e-5}  # the same float math as emulation: only the summation order differs


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Small tensors on 2 busy cores: intra-op threading only adds overhead (see test_quant.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_experts_class_heuristic_tiles_in_place_and_errors():
    config, x, w, weights, ids, _ = problem(Case("class", T=3, H=64, I=32), "nvfp4_w4a16", torch.float32)
    experts = TritonExperts(config)
    assert experts.process_weights(w).w13 is w.w13  # the kernels read the checkpoint packing as stored
    out = experts.apply(x, w, weights, ids, expert_map_E=None)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert rel_err(out, emulated) < TOL[torch.float32]
    into = x.clone()
    assert experts.apply(into, w, weights, ids, expert_map_E=None, out_TH=into) is into
    assert torch.equal(into, out)
    # NVFP4 W4A4 fake-quantizes activations: not the weight-only kernel's math
    q13, q2, p = quantize_weights(torch.randn(4, 64, 64), torch.randn(4, 64, 32), "nvfp4")
    with pytest.raises(NotImplementedError, match=r"weight-only schemes \[.*\], not nvfp4"):
        TritonExperts(MoEConfig(4, 2, 64, 32, dtype=torch.float32)).apply(
            x, ExpertWeights(q13, q2, quant=p), weights, ids, expert_map_E=None)
    with pytest.raises(ValueError, match="nvfp4_w4a16 is weight-only: a13_scale / a2_scale must be None"):
        triton_quant_experts(x, w.w13, w.w2, weights, ids, None, None, None, 4, "silu", False, 1.702, None,
                             "nvfp4_w4a16", w.quant.w13_scale, w.quant.w2_scale, torch.ones(1))
    with pytest.raises(ValueError, match=r"gemm1 tile .* cannot run int4_w4a16_g32: block_k=16: 4-bit weights"):
        run(*problem(Case("bad-tile"), "int4_w4a16_g32", torch.float32),
             tiles=((16, 64, 16, 4, 1), (16, 64, 64, 4, 1)))


@pytest.mark.parametrize("scheme", ["int4_w4a16_g32", "fp8_w8a8_block"])
def test_bad_scales_raise_inside_the_replayed_function_before_any_launch(monkeypatch, scheme):
    """apply_quant leaves the payload and scale checks to triton_quant_experts (whose replays skip
    them: their signature fixes every input of the check); both entries still raise before any
    kernel launches."""
    from fusedmoe.backends.triton import experts as experts_module
    from fusedmoe.backends.triton import quant as quant_module

    dtype = torch.float32
    config, x, w, weights, ids, _ = problem(Case("bad-scale", T=3, H=64, I=32), scheme, dtype)
    w = TritonExperts(config).process_weights(w)
    bad = dataclasses.replace(w.quant, w2_scale=w.quant.w2_scale[:-1])  # one expert short
    launched = []
    for module in (experts_module, quant_module):
        monkeypatch.setattr(module, "launch", lambda *a, **k: launched.append(a[0]))
    with pytest.raises(ValueError, match="w2_scale"):
        TritonExperts(config).apply(x, dataclasses.replace(w, quant=bad), weights, ids, expert_map_E=None)
    with pytest.raises(ValueError, match="w2_scale"):
        triton_quant_experts(x, w.w13, w.w2, weights, ids, None, None, None, 4, "silu", False, 1.702, None,
                             scheme, bad.w13_scale, bad.w2_scale, bad.a13_scale, bad.a2_scale)
    assert launched == []


@pytest.mark.parametrize("scheme", ["int4_w4a16_g32", "int4_w4a16_g64", "nvfp4_w4a16", "int8_w8a16"])
def test_process_weights_lays_int4_scales_group_major(scheme):
    """int4's and nvfp4's group scales come back group-major (same values, strides
    (N * K/g, 1, N)), per-channel 8-bit scales as stored; the kernels give the same output bit
    for bit from either layout, on both the aligned path and the direct one. (With the fragment
    layout off: H and I multiples of 64 take it by default, tests below.)"""
    from fusedmoe import knobs
    from fusedmoe.backends.triton.weight_only import kernel_scale_layout

    for T in (1, 5):
        config, x, w, weights, ids, _ = problem(Case("layout", T=T, H=64, I=64), scheme, torch.float32)
        with knobs.override(TRITON_W4_FRAGMENTS=False):
            processed = TritonExperts(config).process_weights(w)
        if not scheme.startswith(("int4", "nvfp4")):
            assert processed is w
            continue
        for name in ("w13_scale", "w2_scale"):
            before, after = getattr(w.quant, name), getattr(processed.quant, name)
            E, N, G = before.shape
            bits = (lambda t: t.view(torch.uint8)) if before.element_size() == 1 else (lambda t: t)  # e4m3: no CPU equal
            assert torch.equal(bits(before), bits(after)) and kernel_scale_layout(after) is after
            assert after.stride() == (N * G, 1, N) if G > 1 else after is before  # one group: as stored
        assert processed.w13 is w.w13 and processed.w2 is w.w2
        experts = TritonExperts(config)
        out = experts.apply(x, w, weights, ids, expert_map_E=None)
        assert torch.equal(experts.apply(x, processed, weights, ids, expert_map_E=None), out)


def test_asymmetric_int4_zero_points_are_laid_as_their_scales():
    """`*_zp`: process_weights lays the zero points exactly as their scales, group-major in the
    checkpoint layout and as fragments where symmetric int4's rule lays fragments (g64 at every I,
    every int4 group at every I since the sixty-sixth session; the fragment decode runs them faster
    than the checkpoint layout at Mixtral M=1-256 on an H200):
    the same shape, dtype and strides (the kernels index both with
    the scales'), the weights they dequantize to unchanged, and each layout's output that of the
    unprocessed weights (bitwise in the checkpoint layout) and of emulation."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton.weight_only import w4_fragments_planned
    from fusedmoe.quant import get_scheme
    from fusedmoe.quant.fragments import is_fragments
    from fusedmoe.quant.weights import dequantize_weights

    config, x, w, weights, ids, _ = problem(Case("zp-layout", T=5, H=128, I=128), "int4_w4a16_g32_zp", torch.float32)
    experts = TritonExperts(config)
    out = experts.apply(x, w, weights, ids, expert_map_E=None)
    want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert w4_fragments_planned(get_scheme("int4_w4a16_g64"), 128, 128)
    assert w4_fragments_planned(get_scheme("int4_w4a16_g64_zp"), 128, 128)
    assert w4_fragments_planned(get_scheme("int4_w4a16_g32_zp"), 128, 128)  # every group at every I
    with int4_fragment_minimum({32: 2048}):  # a minimum binds the zp twin too
        assert not w4_fragments_planned(get_scheme("int4_w4a16_g32_zp"), 128, 128)
    for mode, frag in ((None, True), (False, False), ("all", True)):
        with knobs.override(TRITON_W4_FRAGMENTS=mode):
            processed = TritonExperts(config).process_weights(w)
            assert w4_fragments_planned(get_scheme("int4_w4a16_g32_zp"), 128, 128) == frag
        q = processed.quant
        assert is_fragments(q.w13_scale) == frag and (processed.w13 is w.w13) != frag
        for name in ("w13", "w2"):
            scale, zero = getattr(q, f"{name}_scale"), getattr(q, f"{name}_zero")
            assert zero.shape == scale.shape and zero.dtype == scale.dtype and zero.stride() == scale.stride(), mode
            if not frag:
                E, N, G = zero.shape
                assert zero.stride() == (N * G, 1, N) and torch.equal(zero, getattr(w.quant, f"{name}_zero"))
        before, after = dequantize_weights(w.w13, w.w2, w.quant), dequantize_weights(processed.w13, processed.w2, q)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), mode
        got = experts.apply(x, processed, weights, ids, expert_map_E=None)
        assert torch.equal(got, out) if not frag else rel_err(got, want) < TOL[torch.float32], mode


# mxfp4 in the fragment layout (fusedmoe.quant.fragments, kernels._w4_frag_tile) ----------------
@triton.jit
def _lane_tile_kernel(v_ptr, out_ptr, F: tl.constexpr, JG: tl.constexpr):
    from fusedmoe.backends.triton.kernels import _w4_lane_tile

    f = tl.arange(0, F)[:, None, None]
    g = tl.arange(0, 8)[None, :, None]
    e = tl.arange(0, 2 * JG)[None, None, :]
    t = _w4_lane_tile(tl.load(v_ptr + (f * 8 + g) * (2 * JG) + e), F, JG)
    tl.store(out_ptr + tl.arange(0, F)[:, None] * 512 + tl.arange(0, 512)[None, :], t)


@pytest.mark.parametrize("jg", [1, 2, 4])
def test_lane_tile_gives_each_lane_its_row_groups_values(jg):
    """kernels._w4_lane_tile, the PTX decode's scale (and zero point) operand from values loaded
    once a row group: element 16 * lane + 4j + 2rh + pair of a fragment's operand is row group
    g = lane // 4's value for (rh, jg = j // (4 / JG))."""
    F = 4
    v = torch.randn(F, 8, 2 * jg)
    out = torch.full((F, 512), float("nan"))
    _lane_tile_kernel[(1,)](v, out, F, jg)
    idx = torch.arange(512)
    lane, j, rh = idx // 16, (idx // 4) % 4, (idx // 2) % 2
    want = v.view(F, 8, 2, jg)[:, lane // 4, rh, j // (4 // jg)]
    assert torch.equal(out, want)


@triton.jit
def _group_values_kernel(v_ptr, out_ptr, F: tl.constexpr, N: tl.constexpr, PER: tl.constexpr):
    from fusedmoe.backends.triton.kernels import _w4_group_values

    f = tl.arange(0, F)
    ptrs = v_ptr + (f[:, None, None] * 8 + tl.arange(0, 8)[None, :, None]) * N + (tl.arange(0, N // PER) * PER)[None, None, :]
    v = _w4_group_values(ptrs, f < F - 1, N)
    tl.store(out_ptr + (f[:, None, None] * 8 + tl.arange(0, 8)[None, :, None]) * N + tl.arange(0, N)[None, None, :], v)


@pytest.mark.parametrize(("dtype", "n"), [(torch.bfloat16, 2), (torch.bfloat16, 4), (torch.bfloat16, 8),
                                          (torch.uint8, 4), (torch.uint8, 8), (torch.float32, 2)])
def test_group_values_split_words_in_address_order(dtype, n):
    """kernels._w4_group_values, a row group's N scales (or zero points) loaded as 32-bit words
    where they fill words (int4's bf16 pairs and quads, mxfp4 / nvfp4's byte quads) and split in
    registers: each value at its place, lowest address first; a masked row reads 0. fp32 values
    load as they are."""
    F = 4
    gen = torch.Generator().manual_seed(n)
    if dtype == torch.uint8:
        v = torch.randint(1, 256, (F, 8, n), dtype=dtype, generator=gen)
    else:  # no zeros: a masked row must read 0, not keep the poison
        v = (torch.rand(F, 8, n, generator=gen) + 0.5).to(dtype)
    out = torch.full_like(v, 7)
    per = 32 // (8 * v.element_size()) if v.element_size() < 4 else 1
    _group_values_kernel[(1,)](v, out, F, n, per)
    want = v.clone()
    want[F - 1] = 0
    assert torch.equal(out, want)


def test_fragment_layout_round_trips_and_decodes():
    """to_fragments / from_fragments are inverse on random codes and scales; each fragment byte
    holds the codes the layout's docstring places there, so the bit-placed decode (torch
    emulation of kernels.W4_PTX_FRAG's masks and shifts) gives every weight at its (n, k)."""
    from fusedmoe.quant.formats import e2m1_decode, unpack_nibbles
    from fusedmoe.quant.fragments import from_fragments, is_fragments, to_fragments

    gen = torch.Generator().manual_seed(7)
    E, N, K = 3, 48, 192
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 129, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    frag, fs = to_fragments(codes, scales)
    assert frag.shape == codes.shape and fs.shape == (E, N // 16, K // 64, 32) and is_fragments(fs)
    back = from_fragments(frag, fs)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    # the decode: word j of lane 4g + c holds registers (rh, kh) of rows 8rh + g, k 16j + 8kh + 2c + u
    w = frag.view(E, N // 16, K // 64, 32, 4, 4).view(torch.int32)[..., 0].to(torch.int64) & 0xFFFFFFFF
    m = 0x81C081C0
    regs = [w & m, (w << 3) & m, (w << 6) & m,
            ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000)]
    halves = torch.stack([torch.stack(((r & 0xFFFF), (r >> 16) & 0xFFFF), -1) for r in regs], -2)  # ... reg u
    values = (halves.to(torch.int32) << 16).view(torch.float32).double() * 2.0**126  # e2m1 * 2^-126 -> e2m1
    values = values.view(E, N // 16, K // 64, 8, 4, 4, 2, 2, 2)  # e n16 k64 g c j rh kh u
    values = values.permute(0, 1, 6, 3, 2, 5, 7, 4, 8).reshape(E, N, K)  # n16 rh g | k64 j kh c u
    want = e2m1_decode(unpack_nibbles(codes)).double()
    assert torch.equal(values, want) and torch.equal(values.signbit(), want.signbit())


def test_nvfp4_scale_codes_give_exact_multipliers():
    """fragments.nv_scale_codes: every e4m3 scale s in [0, 448] (the 127 non-negative, non-NaN
    bytes, subnormals included) has a byte code c whose (c << 4) + 0x7600, as the kernels compute
    it (kernels._frag_multiplier), is the bf16 of s * 2^118 exactly and -0 for s = 0, at most
    0x8000 (two codes' multipliers share one 32-bit add: no carry between the halves); the codes
    are distinct and decode back. Negative and NaN scales keep the checkpoint
    layout (fragments_reason), and the kernels refuse nvfp4 fragment scales not in codes."""
    from fusedmoe.quant.fragments import (
        NV_CODE_BASE,
        fragments_reason,
        from_fragments,
        nv_scale_codes,
        to_fragments,
    )

    code, back = nv_scale_codes()
    byte = torch.arange(127, dtype=torch.uint8)
    s = byte.view(torch.float8_e4m3fn).double()
    bits = (code[:127].int() << 4) + NV_CODE_BASE
    assert int(bits.max()) == 0x8000 and int(bits.min()) == 0x7600
    got = bits.to(torch.int16).view(torch.bfloat16).double()
    assert torch.equal(got, torch.where(s == 0, 0.0, s * 2.0**118)) and bool(got[0].signbit())
    assert len(set(code[:127].tolist())) == 127 and torch.equal(back[code[:127].long()], byte)
    assert code[:8].tolist() == [160, 0, 8, 12, 16, 18, 20, 22] and code[126] == 142
    codes = torch.zeros(1, 16, 32, dtype=torch.uint8)
    for bad in (0x7F, 0x80 | 0x38):  # NaN, -1.0
        scales = torch.full((1, 16, 4), 0x38, dtype=torch.uint8)
        scales[0, 3, 1] = bad
        assert "negative or NaN e4m3 scale" in fragments_reason(codes, scales.view(torch.float8_e4m3fn), "nvfp4")
    frag, fs = to_fragments(codes, torch.full((1, 16, 4), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn), "nvfp4")
    with pytest.raises(ValueError, match="multiplier codes"):
        from_fragments(frag, fs.view(torch.float8_e4m3fn), "nvfp4")


@pytest.mark.parametrize("fmt,group,dtype", [("nvfp4", 16, torch.float8_e4m3fn), ("int4", 32, torch.float32),
                                             ("int4", 64, torch.float16), ("int4", 128, torch.bfloat16)])
def test_fragment_layout_nvfp4_and_int4_round_trip_and_decode(fmt, group, dtype):
    """nvfp4 and int4 in the fragment layout: the round trip from any scale strides, the scale
    shape per group ([E, N/16, K/GF, 16 GF / group], GF = max(group, 64)), every scale at the place
    the kernels read it for (n, k), and (int4) each code at its register's bits 4r + 16u, so
    kernels.W4_PTX_I4FRAG's lop3 under the 0x4308 magic gives 136 + q."""
    from fusedmoe.quant.formats import unpack_nibbles
    from fusedmoe.quant.fragments import (
        fragment_group,
        from_fragments,
        nv_scale_codes,
        to_fragments,
    )

    gen = torch.Generator().manual_seed(group)
    E, N, K = 2, 32, 256
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    if dtype == torch.float8_e4m3fn:
        scales = torch.randint(0, 0x7F, (E, N, K // group), dtype=torch.uint8, generator=gen).view(dtype)
    else:
        scales = torch.rand(E, N, K // group, generator=gen).to(dtype)
    strided = scales.transpose(1, 2).contiguous().transpose(1, 2)  # kernel_scale_layout's group-major
    frag, fs = to_fragments(codes, strided, fmt)
    gf = max(group, 64)
    assert fs.shape == (E, N // 16, K // gf, 16 * gf // group)
    assert fs.dtype == (torch.uint8 if fmt == "nvfp4" else dtype)  # nvfp4: multiplier codes
    assert fragment_group(frag, fs) == group
    back, back_s = from_fragments(frag, fs, fmt)
    u8 = (lambda t: t.view(torch.uint8)) if dtype == torch.float8_e4m3fn else (lambda t: t)
    assert torch.equal(back, codes) and torch.equal(u8(back_s), u8(scales))
    # the scale the kernels read for (n, k): chunk k // GF, entry (g, rh, jg) of row block n // 16
    n, k = torch.meshgrid(torch.arange(N), torch.arange(K), indexing="ij")
    g, rh, jg = n % 8, (n % 16) // 8, (k % gf) // group
    picked = u8(fs)[:, n // 16, k // gf, g * 2 * (gf // group) + rh * (gf // group) + jg]
    stored = nv_scale_codes()[0][u8(scales).long()] if fmt == "nvfp4" else u8(scales)
    assert torch.equal(picked, stored.repeat_interleave(group, dim=2))
    if fmt == "int4":  # word j of lane 4g + c: register r = 2rh + kh's code u at bits 4r + 16u
        w = frag.view(E, N // 16, K // 64, 32, 4, 4).view(torch.int32)[..., 0].to(torch.int64) & 0xFFFFFFFF
        regs = torch.stack([(w >> (4 * r)) & 0x000F000F ^ 0x43084308 for r in range(4)], -1)  # ... j r
        halves = torch.stack((regs & 0xFFFF, regs >> 16), -1).to(torch.int32)  # ... j r u
        values = (halves << 16).view(torch.float32) - 136.0  # bf16 136 + q, minus 136
        values = values.view(E, N // 16, K // 64, 8, 4, 4, 2, 2, 2)  # e n16 k64 g c j rh kh u
        values = values.permute(0, 1, 6, 3, 2, 5, 7, 4, 8).reshape(E, N, K)  # n16 rh g | k64 j kh c u
        q = unpack_nibbles(codes).to(torch.int32)
        assert torch.equal(values, ((q ^ 8) - 8).float())


def test_fragment_scale_runs_are_padded_off_large_powers_of_two():
    """fragments.scale_run: a row block's scale run of a power of two bytes >= 1 KB gets one line
    of padding (the runs then lie an odd number of lines apart); to_fragments stores it so, as a
    view the round trip reads through."""
    from fusedmoe.quant.fragments import from_fragments, scale_run, to_fragments

    assert scale_run(64, 64) == 66  # nvfp4, H = 4096: 4 KB, 32 lines -> 33
    assert scale_run(32, 32) == 36  # mxfp4, H = 2048: 1 KB
    assert scale_run(112, 64) == 112  # nvfp4, H = 7168: 7 KB, not a power of two (padded: slower)
    assert scale_run(112, 32) == 112  # mxfp4, H = 7168: 3.5 KB
    assert scale_run(224, 64) == 224  # nvfp4, I = 14336 (Mixtral's w2): 14 KB
    assert scale_run(128, 64) == 130  # nvfp4, H = 8192: 8 KB
    assert scale_run(12, 64) == 12  # nvfp4 w2, I = 768: 768 B, short
    assert scale_run(4, 64) == 4  # DeepSeek-V3's w2 (I = 256): short
    assert scale_run(45, 32) == 45  # gpt-oss, H = 2880: not whole lines
    assert scale_run(18, 64) == 18  # 1152 B: 9 lines, odd already
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (2, 32, 1024), dtype=torch.uint8, generator=gen)  # K = 2048
    scales = torch.randint(0, 129, (2, 32, 64), dtype=torch.uint8, generator=gen)
    frag, fs = to_fragments(codes, scales, "mxfp4")
    assert fs.shape == (2, 2, 32, 32) and fs.stride() == (2 * 36 * 32, 36 * 32, 32, 1)
    back = from_fragments(frag, fs, "mxfp4")
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    assert torch.equal(from_fragments(frag, fs.contiguous(), "mxfp4")[1], scales)
    assert to_fragments(codes, scales, "mxfp4", scale_pad=0)[1].is_contiguous()
    assert to_fragments(codes, scales, "mxfp4", scale_pad=256)[1].stride(1) == 40 * 32
    with pytest.raises(ValueError, match="scale run padding 100 bytes: expected a non-negative multiple of 32"):
        scale_run(64, 64, 100)
    assert scale_run(64, 64, 32) == 65 and scale_run(32, 128, 64) == 33  # rounded up to whole chunks


def test_fragment_layout_conditions():
    """process_weights re-lays mxfp4 where both weights are whole 16 x 64 fragments and every
    e8m0 scale code is <= 128, unless FUSEDMOE_TRITON_W4_FRAGMENTS=0; otherwise the checkpoint
    layout stays, and the reason names what stops it. Scales in the fragment shape pass the
    weight checks; dequantization reads either layout the same."""
    from fusedmoe import knobs
    from fusedmoe.quant.fragments import fragments_reason, is_fragments
    from fusedmoe.quant.weights import check_quant_weights, dequantize_weights

    config, x, w, weights, ids, _ = problem(Case("cond", T=3, H=128, I=64), "mxfp4_w4a16", torch.float32)
    experts = TritonExperts(config)
    laid = experts.process_weights(w)
    assert is_fragments(laid.quant.w13_scale) and is_fragments(laid.quant.w2_scale)
    assert laid.w13.shape == w.w13.shape and laid.quant.w13_scale.shape == (4, 8, 2, 32)
    check_quant_weights(laid.w13, laid.w2, laid.quant, 128, 128)
    before, after = dequantize_weights(w.w13, w.w2, w.quant), dequantize_weights(laid.w13, laid.w2, laid.quant)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert experts.process_weights(laid) is laid  # already laid
    with knobs.override(TRITON_W4_FRAGMENTS=False):
        assert experts.process_weights(w) is w
    big = w.quant.w2_scale.clone()
    big[1, 2, 0] = 129  # a scale of 4: 2^126 * 4 overflows bf16
    assert "above 128" in fragments_reason(w.w2, big)
    assert experts.process_weights(w.replace(quant=dataclasses.replace(w.quant, w2_scale=big))).w13 is w.w13
    # marlin's MXFP4 W4A8 checkpoints: the same weights, re-laid by the same process_weights
    from fusedmoe.backends.triton.marlin import MarlinExperts

    config, x, w, weights, ids, _ = problem(Case("cond-w4a8", T=3, H=128, I=64), "mxfp4_w4a8", torch.float32)
    laid = MarlinExperts(config).process_weights(w)
    assert is_fragments(laid.quant.w13_scale)
    twin = w.replace(quant=QuantParams("mxfp4_w4a16", w.quant.w13_scale, w.quant.w2_scale))
    want = EmulationExperts(config.replace(quant="mxfp4_w4a16")).apply(x, twin, weights, ids, expert_map_E=None)
    assert rel_err(MarlinExperts(config).apply(x, laid, weights, ids, expert_map_E=None), want) < TOL[torch.float32]
    # fragments are addressed as contiguous runs per expert: other strides are refused, named
    config, x, w, weights, ids, _ = problem(Case("cond-strides", T=3, H=128, I=64), "mxfp4_w4a16", torch.float32)
    laid = TritonExperts(config).process_weights(w)
    wide = torch.zeros(4, 128, 2 * 64, dtype=torch.uint8)[:, :, :64]
    wide.copy_(laid.w13)
    with pytest.raises(ValueError, match=r"w13 holds 4-bit fragments .* each expert's \[N, K/2\] bytes must be contiguous"):
        run(config, x, laid.replace(w13=wide), weights, ids, None)
    scale_t = torch.zeros(*laid.quant.w2_scale.shape[:3], 64, dtype=torch.uint8)[..., :32]
    scale_t.copy_(laid.quant.w2_scale)
    with pytest.raises(ValueError, match=r"w2_scale holds fragment scales with strides .* row block's \[1, 32\] must be contiguous"):
        run(config, x, laid.replace(quant=dataclasses.replace(laid.quant, w2_scale=scale_t)), weights, ids, None)
    # the kernels take the scales' row-block stride (fragments.scale_run pads long runs): scales in a
    # padded store, the padding NaN codes, give the output of the dense ones
    s13 = laid.quant.w13_scale
    store = torch.full((*s13.shape[:2], s13.shape[2] + 3, s13.shape[3]), 255, dtype=s13.dtype)
    store[:, :, :s13.shape[2]] = s13
    padded = laid.replace(quant=dataclasses.replace(laid.quant, w13_scale=store[:, :, :s13.shape[2]]))
    assert torch.equal(run(config, x, padded, weights, ids, None), run(config, x, laid, weights, ids, None))
    config, x, w, weights, ids, _ = problem(Case("cond-odd", T=3, H=96, I=64), "mxfp4_w4a16", torch.float32)
    assert "whole 16 x 64 fragments" in fragments_reason(w.w13, w.quant.w13_scale)  # K = H = 96
    assert TritonExperts(config).process_weights(w) is w
    # nvfp4 and int4 take the layout on the same shapes (no scale bound), else their scales go group-major
    for scheme, shape in (("nvfp4_w4a16", (4, 8, 2, 64)), ("int4_w4a16_g32", (4, 8, 2, 32)),
                          ("int4_w4a16_g64", (4, 8, 2, 16)), ("int4_w4a16_g128", (4, 16, 1, 16))):
        inter = 128 if scheme.endswith("g128") else 64
        config, x, w, weights, ids, _ = problem(Case("cond-" + scheme, T=3, H=128, I=inter), scheme, torch.float32)
        with knobs.override(TRITON_W4_FRAGMENTS="all"):  # int4 at every group and size
            laid = TritonExperts(config).process_weights(w)
        # by default at I = 64-128 too: nvfp4 and every int4 group (INT4_FRAGMENTS_MIN_INTER)
        assert is_fragments(TritonExperts(config).process_weights(w).quant.w13_scale), scheme
        assert laid.quant.w13_scale.shape == shape and is_fragments(laid.quant.w2_scale), scheme
        check_quant_weights(laid.w13, laid.w2, laid.quant, 128, 2 * inter)
        before, after = dequantize_weights(w.w13, w.w2, w.quant), dequantize_weights(laid.w13, laid.w2, laid.quant)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), scheme
        with knobs.override(TRITON_W4_FRAGMENTS=False):
            assert not is_fragments(TritonExperts(config).process_weights(w).quant.w13_scale)
        if scheme.endswith(("g64", "g128")):  # H, I multiples of the group (>= 64): always whole fragments
            continue
        config, x, w, weights, ids, _ = problem(Case("cond-odd" + scheme, T=3, H=96, I=64), scheme, torch.float32)
        assert "whole 16 x 64 fragments" in fragments_reason(w.w13, w.quant.w13_scale, scheme.split("_")[0])
        with knobs.override(TRITON_W4_FRAGMENTS="all"):
            assert not is_fragments(TritonExperts(config).process_weights(w).quant.w13_scale), scheme
    # marlin's NVFP4 W4A4 checkpoints: laid the same way, run weight-only
    config, x, w, weights, ids, _ = problem(Case("cond-w4a4", T=3, H=128, I=64), "nvfp4", torch.float32)
    laid = MarlinExperts(config).process_weights(w)
    assert is_fragments(laid.quant.w13_scale) and is_fragments(laid.quant.w2_scale)
    twin = w.replace(quant=QuantParams("nvfp4_w4a16", w.quant.w13_scale, w.quant.w2_scale,
                                       w13_global_scale=w.quant.w13_global_scale,
                                       w2_global_scale=w.quant.w2_global_scale))
    want = EmulationExperts(config.replace(quant="nvfp4_w4a16")).apply(x, twin, weights, ids, expert_map_E=None)
    assert rel_err(MarlinExperts(config).apply(x, laid, weights, ids, expert_map_E=None), want) < TOL[torch.float32]
    with pytest.raises(ValueError, match="holds .*'mxfp4', 'nvfp4', 'int4'.* not 'int8'"):
        fragments_reason(w.w13, w.quant.w13_scale, "int8")


FRAG_SCHEMES = ["mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g32", "int4_w4a16_g128", "int4_w4a16_g32_zp",
                "int4_w4a16_g128_zp"]


@pytest.mark.parametrize("scheme", FRAG_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fragment_layout_kernels_match_emulation(dtype, scheme, monkeypatch):
    """The GEMMs over fragment-layout 4-bit weights (kernels._w4_frag_tile, the interpreter's integer
    decode) against emulation on the checkpoint layout: the aligned path with a bias and a K
    tail under the tile (H = 192, BLOCK_K 128), the direct path (one token, slot shares), a
    non-gated activation, an expert_map with ids routed elsewhere, narrow tiles (widened to 64 by
    tiles.fragment_tile), and the batched layout. Both layouts' tiles are planned for the weights
    held (`GemmProblem.fragments`), whatever FUSEDMOE_TRITON_W4_FRAGMENTS says at the call."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton import weight_only as wo
    from fusedmoe.backends.triton.experts import BatchedTritonExperts
    from fusedmoe.modular import BatchedLocalPrepareFinalize, make_modular

    held = []  # the layout each call's tile choice was told

    def told(choose):
        return lambda problem, *a: held.append(problem.fragments) or choose(problem, *a)

    for name in ("plan_tiles", "_tiles"):
        monkeypatch.setattr(wo, name, told(getattr(wo, name)))

    tol = TOL.get(dtype, 2e-3)
    cases = [Case("frag-aligned", T=9, H=192, I=64, bias=True, tiles=((16, 64, 128, 4, 1), (16, 64, 64, 4, 1))),
             Case("frag-direct", T=1, E=6, K=4, H=128, I=128, tiles=None),
             Case("frag-nomul", T=5, H=128, I=64, activation="relu2_no_mul", on_input=True, K=1),
             Case("frag-map", T=7, E=8, H=128, I=64, expert_map=True, tiles=((32, 32, 32, 4, 1), (32, 32, 32, 4, 1)))]
    if "_g128" in scheme:  # H and I multiples of the group (no K tail: g32 and mxfp4 cover it)
        cases = [dataclasses.replace(c, H=128 * -(-c.H // 128), I=128) for c in cases]
    for case in cases:
        config, x, w, weights, ids, emap = problem(case, scheme, dtype)
        with knobs.override(TRITON_W4_FRAGMENTS="all"):  # int4 at every group and size
            laid = TritonExperts(config).process_weights(w)
        assert laid.w13 is not w.w13, case.id
        out = run(config, x, laid, weights, ids, emap, tiles=case.tiles)
        want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=emap)
        assert rel_err(out, want) < tol, case.id
    config, x, w, weights, ids, _ = problem(Case("frag-batched", T=6, H=128, I=cases[-1].I), scheme, dtype)
    batched_config = config.replace(activation_format="batched")
    batched = make_modular(batched_config, BatchedTritonExperts(batched_config))
    assert isinstance(batched.prepare_finalize, BatchedLocalPrepareFinalize)
    with knobs.override(TRITON_W4_FRAGMENTS="all"):
        laid = TritonExperts(config).process_weights(w)
    want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert rel_err(batched(x, laid, weights, ids), want) < tol
    assert len(held) == len(cases) + 1 and all(f is True for f in held), held  # the knob is unset here


def _padded(scale: torch.Tensor, extra: int) -> torch.Tensor:
    """Fragment scales as a view of a store with `extra` chunks after each row block's run, the
    padding filled with 0xFF (an e8m0 NaN; a large e4m3 / float) so any read of it shows."""
    store = torch.full((*scale.shape[:2], scale.shape[2] + extra, scale.shape[3]), 255, dtype=torch.uint8)
    store[:, :, :scale.shape[2]] = scale.view(torch.uint8)
    return store[:, :, :scale.shape[2]].view(scale.dtype)


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16", "nvfp4_w4a16"])
def test_padded_fragment_scale_runs_in_every_gemm(scheme):
    """Every fragment GEMM addresses a row block's scales by the scales' stride(1)
    (`kernels._w4_frag_ptrs` s_rows): scales of w13 and w2 in padded stores give bitwise the
    dense layout's output on the aligned path (64- and 128-wide K steps, the latter FRAG_INC's
    pointer increments), the direct path and the batched layout; and a shape whose runs
    `to_fragments` pads itself (nvfp4 H = 1024: 1 KB runs) matches emulation."""
    from fusedmoe.backends.triton.experts import BatchedTritonExperts
    from fusedmoe.modular import make_modular

    config, x, w, weights, ids, _ = problem(Case("pad-all", T=5, E=4, H=256, I=128), scheme, torch.float32)
    laid = TritonExperts(config).process_weights(w)
    q = laid.quant
    padded = laid.replace(quant=dataclasses.replace(q, w13_scale=_padded(q.w13_scale, 3),
                                                    w2_scale=_padded(q.w2_scale, 1)))
    assert padded.quant.w13_scale.stride(1) > q.w13_scale.stride(1)
    for tiles in (((16, 64, 64, 4, 1), (16, 64, 64, 4, 1)), ((16, 64, 128, 4, 1), (16, 64, 128, 4, 1))):
        assert torch.equal(run(config, x, padded, weights, ids, None, tiles=tiles),
                           run(config, x, laid, weights, ids, None, tiles=tiles)), tiles
    one = slice(0, 1)
    assert torch.equal(run(config, x[one], padded, weights[one], ids[one], None, direct=True),
                       run(config, x[one], laid, weights[one], ids[one], None, direct=True))
    batched_config = config.replace(activation_format="batched")
    batched = make_modular(batched_config, BatchedTritonExperts(batched_config))
    assert torch.equal(batched(x, padded, weights, ids), batched(x, laid, weights, ids))
    if scheme == "nvfp4_w4a16":
        config, x, w, weights, ids, _ = problem(Case("pad-real", T=3, E=2, K=1, H=1024, I=64), scheme, torch.float32)
        laid = TritonExperts(config).process_weights(w)
        assert laid.quant.w13_scale.stride(1) == (16 + 2) * 64  # 16 chunks of 64 B + a line
        want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
        assert rel_err(run(config, x, laid, weights, ids, None), want) < TOL[torch.float32]


@pytest.mark.parametrize("scheme,programs", [("mxfp4_w4a16", 1), ("nvfp4_w4a16", 3), ("int4_w4a16_g32", 5)])
def test_persistent_w4_gemm2_matches_the_tile_per_program_launch(monkeypatch, scheme, programs):
    """The weight-only 4-bit GEMM2 as a persistent launch (`programs` programs stride over its 8
    real (row block, N tile) tiles in one loop): the output is bitwise the tile-per-program
    launch's, on the fragment layout (mxfp4, nvfp4) and the checkpoint one (int4 by default),
    with biases, an expert with no tokens and a K tail under the tile (I = 192, BLOCK_K 128),
    and within tolerance of emulation."""
    from fusedmoe.backends.triton import experts as experts_mod

    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: programs)
    monkeypatch.setattr(experts_mod, "W4_PERSISTENT_PROGRAMS", 1)  # programs per SM (4 on a GPU)
    config, x, w, weights, _, _ = problem(Case("w4-persistent", T=7, E=5, H=128, I=192, bias=True), scheme,
                                          torch.float32)
    ids = torch.tensor([[0, 1], [1, 2], [2, 4], [4, 0], [0, 2], [1, 4], [2, 0]], dtype=torch.int32)  # none to 3
    laid = TritonExperts(config).process_weights(w)
    g1 = (16, 64, 128, 4, 1)
    tiles = {p: (g1, (16, 64, 128, 4, 1, 1, None, 8, p)) for p in (False, True)}
    assert check_tile(TileConfig(*tiles[True][1]), dtype=torch.float32, quant="w4", group=32) is None
    outs = {p: run(config, x, laid, weights, ids, None, tiles=t, out=torch.full_like(x, float("nan")))
            for p, t in tiles.items()}
    assert torch.equal(outs[False], outs[True])
    want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert rel_err(outs[True], want) < TOL[torch.float32]


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g32", "int4_w4a16_g32:checkpoint"])
def test_one_dot_fragment_gemm1(scheme):
    """GEMM1 over fragment-layout weights with one_dot: the gate and up rows as one fragment tile
    and one dot (kernels._w4_frag_tile TWO_HALVES), against the two-tile GEMM1 and emulation; a
    tail N tile (I = 192 under 128-row halves: the gate half's last row blocks and the up half's
    masked), 32-row halves, and a K tail (H = 192, BLOCK_K 128). In the checkpoint layout (int4 by default) the
    tile runs as two (`experts._fitted`): the same output."""
    from fusedmoe import knobs

    name = scheme.removesuffix(":checkpoint")
    config, x, w, weights, ids, _ = problem(Case("w4-one-dot", T=9, E=4, H=192, I=192, bias=True), name,
                                            torch.float32)
    with knobs.override(TRITON_W4_FRAGMENTS=False if scheme.endswith(":checkpoint") else "all"):
        laid = TritonExperts(config).process_weights(w)
    g2 = (16, 64, 64, 4, 1)
    want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    for block_n in (128, 32):  # 32: halves of two row blocks (fragment_tile keeps them under one_dot)
        outs = [run(config, x, laid, weights, ids, None, tiles=((16, block_n, 128, 4, 1, 1, None, 8, False, od), g2),
                    out=torch.full_like(x, float("nan"))) for od in (False, True)]
        assert rel_err(outs[1], outs[0]) < 1e-6, block_n
        assert rel_err(outs[1], want) < TOL[torch.float32], block_n


@pytest.mark.parametrize("seed", range(12))
def test_random_4bit_plans_match_emulation(monkeypatch, seed):
    """A random valid plan over the 4-bit GEMMs' tile options (split-K, one_dot, 32-row one-dot
    halves, a persistent GEMM2 striding over few programs, K and N tails, an expert_map) on a
    random small problem, fragment or checkpoint layout, against emulation."""
    import random

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton.tiles import check_plan, tile_mode
    from fusedmoe.quant.scheme import get_scheme

    rng = random.Random(seed)
    scheme, layout = rng.choice([("mxfp4_w4a16", True), ("nvfp4_w4a16", True), ("int4_w4a16_g32", "all"),
                                 ("int4_w4a16_g32", None), ("nvfp4_w4a16", False)])
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: rng.randint(1, 3))
    monkeypatch.setattr(experts_mod, "W4_PERSISTENT_PROGRAMS", 1)
    E = rng.choice([3, 5, 6])
    case = Case(f"w4-plan-{seed}", T=rng.randint(1, 12), E=E, K=rng.randint(1, min(3, E)), H=rng.choice([128, 192]),
                I=rng.choice([64, 128, 192]), bias=rng.random() < 0.5, expert_map=rng.random() < 0.3,
                activation=rng.choice(["silu", "swigluoai"]))
    mode, group = tile_mode(get_scheme(scheme))
    while True:  # a plan the predicate accepts (one block_m for both GEMMs)
        block_m = rng.choice([16, 32])
        t1 = TileConfig(block_m, rng.choice([32, 64, 128]), rng.choice([64, 128]), 4, 1, rng.choice([1, 2]),
                        one_dot=rng.random() < 0.5)
        t2 = TileConfig(block_m, rng.choice([64, 128]), rng.choice([64, 128]), 4, 1, persistent=rng.random() < 0.5)
        if check_plan(t1, t2, direct=False, dtype=torch.float32, gated=True, quant=mode, group=group) is None:
            break
    config, x, w, weights, ids, emap = problem(case, scheme, torch.float32)
    with knobs.override(TRITON_W4_FRAGMENTS=layout):
        laid = TritonExperts(config).process_weights(w)
    out = run(config, x, laid, weights, ids, emap, tiles=(dataclasses.astuple(t1), dataclasses.astuple(t2)),
              out=torch.full_like(x, float("nan")))
    want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=emap)
    assert rel_err(out, want) < TOL[torch.float32], (case, t1, t2, layout)


@pytest.mark.parametrize("scheme", ["nvfp4_w4a16", "int4_w4a16_g128"])
def test_fragment_gemm1_pointer_increments_over_wide_k_steps(scheme):
    """The fragment GEMM1 with 128- and 256-wide K steps advances its code and scale pointers per
    step (kernels.moe_gemm1_kernel FRAG_INC; int4 group 128: one scale chunk per 128 k, two per
    256): against emulation with a K tail inside the last step (H = 384 = 256 + 128), split-K 2
    (H = 640: shares of 512 + 128 at 256-wide steps, 384 + 256 at 128-wide ones), one_dot and two
    tiles."""
    from fusedmoe import knobs

    for H, split in ((384, 1), (640, 2)):
        config, x, w, weights, ids, _ = problem(Case(f"frag-inc-{H}-{split}", T=5, E=3, K=2, H=H, I=128, bias=True),
                                                scheme, torch.float32)
        with knobs.override(TRITON_W4_FRAGMENTS="all"):
            laid = TritonExperts(config).process_weights(w)
        want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
        for block_k in (128, 256):
            for one_dot in (False, True):
                t1 = (16, 64 if not one_dot else 32, block_k, 4, 1, split, None, 8, False, one_dot)
                out = run(config, x, laid, weights, ids, None, tiles=(t1, (16, 64, 64, 4, 1)),
                          out=torch.full_like(x, float("nan")))
                assert rel_err(out, want) < TOL[torch.float32], (H, split, block_k, one_dot)


def test_fragment_layout_edge_cases():
    """The fragment path at the edges: no tokens, E not a power of two with top_k = E, top_k = 1,
    every token on one expert (the others empty), against emulation on the checkpoint layout."""
    for case, one_expert in ((Case("frag-empty", T=0, E=3, K=3, H=64, I=64), False),
                             (Case("frag-topk-e", T=5, E=3, K=3, H=64, I=128, bias=True), False),
                             (Case("frag-top1", T=6, E=5, K=1, H=128, I=64, on_input=True), False),
                             (Case("frag-one-expert", T=11, E=5, K=2, H=64, I=64), True)):
        config, x, w, weights, ids, _ = problem(case, "mxfp4_w4a16", torch.float32)
        if one_expert:
            ids = torch.full_like(ids, 3)
            ids[:, 1] = 4  # two slots of a token must name two experts: 3 and 4 take every token
        laid = TritonExperts(config).process_weights(w)
        out = run(config, x, laid, weights, ids, None)
        assert out.shape == (case.T, case.H), case.id
        if case.T:
            want = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
            assert rel_err(out, want) < TOL[torch.float32], case.id


def test_fragment_dots_wait_on_gpu_compiles(monkeypatch):
    """weight_only.rs_sync / _kernel_args: the fragment GEMMs' RS_SYNC (kernels._rs_sync) is set
    for CUDA activations unless FUSEDMOE_TRITON_RS_SYNC=0, never for CPU ones (the interpreter
    cannot run the PTX copy), and the checkpoint layout's launches do not take it."""
    from types import SimpleNamespace

    from fusedmoe.backends.triton.weight_only import _kernel_args, rs_sync
    from fusedmoe.quant.scheme import get_scheme

    gpu, cpu = SimpleNamespace(is_cuda=True), torch.zeros(1)
    assert rs_sync(gpu) and not rs_sync(cpu)
    monkeypatch.setenv("FUSEDMOE_TRITON_RS_SYNC", "0")
    assert not rs_sync(gpu)
    monkeypatch.delenv("FUSEDMOE_TRITON_RS_SYNC")
    config, x, w, weights, ids, _ = problem(Case("rs", T=3, H=128, I=64), "mxfp4_w4a16", torch.float32)
    laid = TritonExperts(config).process_weights(w)
    assert _kernel_args(get_scheme("mxfp4_w4a16"), laid.quant.w13_scale, None, x)["RS_SYNC"] is False
    assert "RS_SYNC" not in _kernel_args(get_scheme("mxfp4_w4a16"), w.quant.w13_scale, None, x)  # checkpoint layout
    from fusedmoe.backends.triton import kernel_report

    monkeypatch.setenv("FUSEDMOE_TRITON_RS_SYNC", "maybe")  # a bad value: named before any kernel is launched
    with kernel_report.recording() as launched, pytest.raises(ValueError, match="FUSEDMOE_TRITON_RS_SYNC='maybe'"):
        run(config, x, laid, weights, ids, None)
    assert launched == []


def test_fragment_formats_knob(monkeypatch):
    """FUSEDMOE_TRITON_W4_FRAGMENTS: unset / 1 = mxfp4, nvfp4 and int4 g32 / g64 / g128 at every
    size (a group without an INT4_FRAGMENTS_MIN_INTER entry keeps the checkpoint layout); all =
    every int4 group too; 0 = none; other values are refused, naming the choices."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton.weight_only import INT4_FRAGMENTS_MIN_INTER, lays_fragments

    formats = (("mxfp4", 32), ("nvfp4", 16), ("int4", 32), ("int4", 64), ("int4", 128), ("int4", 256))
    sizes = (256, 768, 1984, 2048, 14336)

    def laid():
        return {(fmt, group, inter) for fmt, group in formats for inter in sizes if lays_fragments(fmt, group, inter)}

    every = {(fmt, group, inter) for fmt, group in formats for inter in sizes}
    default = {c for c in every if c[0] != "int4" or c[1] in (32, 64, 128)}
    assert INT4_FRAGMENTS_MIN_INTER == {32: 0, 64: 0, 128: 0} and laid() == default
    assert ("int4", 32, 256) in default and ("int4", 128, 1984) in default
    assert ("int4", 256, 14336) not in default  # a group not named keeps the checkpoint layout
    for raw, want in (("1", default), ("all", every), ("0", set())):
        monkeypatch.setenv("FUSEDMOE_TRITON_W4_FRAGMENTS", raw)
        assert laid() == want, raw
    assert not lays_fragments("fp8", None, 4096)
    monkeypatch.setenv("FUSEDMOE_TRITON_W4_FRAGMENTS", "int4")
    with pytest.raises(ValueError, match=r"FUSEDMOE_TRITON_W4_FRAGMENTS='int4': expected one of .*'all'"):
        knobs.get("TRITON_W4_FRAGMENTS")


def test_int4_laid_as_fragments_by_group_and_intermediate():
    """process_weights lays int4 as fragments by its group's INT4_FRAGMENTS_MIN_INTER (every group at
    every size now; a minimum of 2048 for g32 / g128 keeps smaller I in the checkpoint layout, as
    it did before the scales were loaded as words); the planned layout is the one held (the
    heuristic's K steps follow it), and the laid call matches emulation."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton.experts import GemmProblem
    from fusedmoe.backends.triton.weight_only import w4_layout
    from fusedmoe.quant.fragments import is_fragments
    from fusedmoe.quant.scheme import get_scheme

    def check(scheme, inter, want):
        case = Case(f"i4-{inter}", T=3, E=2, K=1, H=128, I=inter, tiles=None)
        config, x, w, weights, ids, _ = problem(case, scheme, torch.float32)
        laid = TritonExperts(config).process_weights(w)
        assert is_fragments(laid.quant.w13_scale) == is_fragments(laid.quant.w2_scale) == want, (scheme, inter)
        planned = w4_layout(GemmProblem(3, 2, 128, inter, 1, True, torch.float32), get_scheme(scheme))
        assert planned == ("fragments" if want else "checkpoint"), (scheme, inter)
        if want:  # the default's path, end to end
            out = run(config, x, laid, weights, ids, None)
            want_out = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
            assert rel_err(out, want_out) < TOL[torch.float32], (scheme, inter)

    for scheme, inter in (("int4_w4a16_g32", 192), ("int4_w4a16_g32", 2048), ("int4_w4a16_g128", 1920),
                          ("int4_w4a16_g64", 192)):
        check(scheme, inter, True)
    with int4_fragment_minimum({32: 2048, 128: 2048}):  # the former rule
        for scheme, inter, want in (("int4_w4a16_g32", 1984, False), ("int4_w4a16_g128", 1920, False),
                                    ("int4_w4a16_g128", 2048, True), ("int4_w4a16_g64", 192, True)):
            check(scheme, inter, want)
    with knobs.override(TRITON_W4_FRAGMENTS="all"):  # every group
        for scheme, want in (("int4_w4a16_g64", True), ("int4_w4a16_g128", True)):
            config, x, w, weights, ids, _ = problem(Case("i4-all", T=3, E=2, K=1, H=128, I=128), scheme, torch.float32)
            assert is_fragments(TritonExperts(config).process_weights(w).quant.w13_scale) == want, scheme
            assert w4_layout(GemmProblem(3, 2, 128, 128, 1, True, torch.float32), get_scheme(scheme)) == (
                "fragments" if want else "checkpoint"), scheme


def test_fragment_scale_pad_knob(monkeypatch):
    """FUSEDMOE_TRITON_W4_SCALE_PAD: the bytes process_weights pads a long fragment scale run by
    (unset = 128, 0 = contiguous scales); a value not a non-negative multiple of 32 is refused,
    named, before anything is laid."""
    from fusedmoe import knobs

    config, x, w, weights, ids, _ = problem(Case("pad", T=2, E=2, H=2048, I=64), "mxfp4_w4a16", torch.float32)
    experts = TritonExperts(config)
    run_chunks = 2048 // 64  # mxfp4: 32 B a chunk, a 1 KB run
    assert experts.process_weights(w).quant.w13_scale.stride(1) == (run_chunks + 4) * 32  # one line
    for raw, chunks in (("0", run_chunks), ("512", run_chunks + 16)):
        monkeypatch.setenv("FUSEDMOE_TRITON_W4_SCALE_PAD", raw)
        laid = experts.process_weights(w)
        assert laid.quant.w13_scale.stride(1) == chunks * 32, raw
        assert laid.quant.w2_scale.is_contiguous()  # w2: K = I = 64, one chunk, never padded
    monkeypatch.setenv("FUSEDMOE_TRITON_W4_SCALE_PAD", "64")  # two 32-byte mxfp4 chunks
    assert experts.process_weights(w).quant.w13_scale.stride(1) == (run_chunks + 2) * 32
    for raw in ("48", "-128", "line"):
        monkeypatch.setenv("FUSEDMOE_TRITON_W4_SCALE_PAD", raw)
        with pytest.raises(ValueError, match=rf"FUSEDMOE_TRITON_W4_SCALE_PAD='{raw}': expected a non-negative multiple of 32"):
            experts.process_weights(w)
    monkeypatch.delenv("FUSEDMOE_TRITON_W4_SCALE_PAD")
    with knobs.override(TRITON_W4_SCALE_PAD=0):
        assert experts.process_weights(w).quant.w13_scale.is_contiguous()


def test_fragment_tile_widens_narrow_tiles():
    from fusedmoe.backends.triton.tiles import fragment_tile

    assert fragment_tile(TileConfig(16, 32, 32, 4, 3, 2)) == TileConfig(16, 64, 64, 4, 3, 2)
    # one_dot: gate and up halves of one tile, 32 rows each at least
    assert fragment_tile(TileConfig(16, 16, 64, 4, 3, one_dot=True)) == TileConfig(16, 32, 64, 4, 3, one_dot=True)
    assert fragment_tile(TileConfig(16, 32, 64, 4, 3, one_dot=True)).block_n == 32
    wide = TileConfig(64, 128, 128, 4, 3)
    assert fragment_tile(wide) is wide
    # `fusedmoe explain --tokens` says so for mxfp4, and names the tiles that run when they widen
    from fusedmoe.backends.triton.experts import GemmProblem, describe_plan
    from fusedmoe.backends.triton.tiles import DIRECT_BLOCK_M
    from fusedmoe.quant.scheme import get_scheme

    problem = GemmProblem(4, 8, 128, 64, 4, True, torch.bfloat16)
    plan = describe_plan(problem, get_scheme("mxfp4_w4a16"), torch.device("cpu"))
    assert plan["w4_layout"].startswith("fragments where") and plan["gemm1"]["tile"].block_m == DIRECT_BLOCK_M
    assert ("run as gemm1" in plan["w4_layout"]) == (fragment_tile(plan["gemm2"]["tile"]) != plan["gemm2"]["tile"]
                                                     or fragment_tile(plan["gemm1"]["tile"]) != plan["gemm1"]["tile"])
    from fusedmoe import knobs

    for group in (32, 128):  # every int4 group at every I; a group's minimum I still names itself
        assert describe_plan(problem, get_scheme(f"int4_w4a16_g{group}"), torch.device("cpu"))["w4_layout"].startswith(
            "fragments where"), group
        with int4_fragment_minimum({group: 2048}):
            assert describe_plan(problem, get_scheme(f"int4_w4a16_g{group}"), torch.device("cpu"))[
                "w4_layout"].startswith(f"checkpoint layout (int4 g{group} is laid as fragments by default where "
                                        "I >= 2048; FUSEDMOE_TRITON_W4_FRAGMENTS=all lays it so)"), group
    for mode, want in ((None, "fragments where"), ("all", "fragments where"),
                       (False, "checkpoint layout (FUSEDMOE_TRITON_W4_FRAGMENTS=0)")):  # g64: fragments at every I
        with knobs.override(TRITON_W4_FRAGMENTS=mode):
            assert describe_plan(problem, get_scheme("int4_w4a16_g64"), torch.device("cpu"))["w4_layout"].startswith(
                want), mode
    with knobs.override(TRITON_W4_FRAGMENTS=None):
        assert "int4 g64 by default at every I, on an H200" in describe_plan(
            problem, get_scheme("int4_w4a16_g64"), torch.device("cpu"))["w4_layout"]
    big_i = GemmProblem(4, 8, 128, 2048, 4, True, torch.bfloat16)  # int4's default: fragments, and why
    for mode in (None, True):  # unset or 1: the default, said as such
        with knobs.override(TRITON_W4_FRAGMENTS=mode):
            for group in (32, 128):
                assert f"int4 g{group} by default at every I, on an H200" in describe_plan(
                    big_i, get_scheme(f"int4_w4a16_g{group}"), torch.device("cpu"))["w4_layout"], group
    with knobs.override(TRITON_W4_FRAGMENTS="all"):
        assert "by default" not in describe_plan(big_i, get_scheme("int4_w4a16_g32"), torch.device("cpu"))["w4_layout"]
    with knobs.override(TRITON_W4_FRAGMENTS="all"):
        assert describe_plan(problem, get_scheme("int4_w4a16_g32"), torch.device("cpu"))["w4_layout"].startswith(
            "fragments")
    with knobs.override(TRITON_W4_FRAGMENTS=False):
        assert describe_plan(problem, get_scheme("mxfp4_w4a16"), torch.device("cpu"))["w4_layout"] == (
            "checkpoint layout (FUSEDMOE_TRITON_W4_FRAGMENTS=0)")
    assert "e8m0" not in describe_plan(problem, get_scheme("nvfp4_w4a16"), torch.device("cpu"))["w4_layout"]
    # and the scale runs' padding (fragments.scale_run): nvfp4 at H = 2048 is 2 KB + a line, I = 64 not padded
    wide_h = GemmProblem(4, 8, 2048, 64, 4, True, torch.bfloat16)
    assert describe_plan(wide_h, get_scheme("nvfp4_w4a16"), torch.device("cpu"))["w4_layout"].endswith(
        "; scale runs per 16 rows, w13 / w2: 2048 B + 128 B padding / 64 B (FUSEDMOE_TRITON_W4_SCALE_PAD); "
        "each dot waits for its wgmma (kernels._rs_sync)")
    with knobs.override(TRITON_RS_SYNC=False):  # and says when they do not
        assert describe_plan(wide_h, get_scheme("nvfp4_w4a16"), torch.device("cpu"))["w4_layout"].endswith(
            "; FUSEDMOE_TRITON_RS_SYNC=0: the dots' wgmmas in flight, a race that computed wrong rows on an H200 "
            "under Triton 3.6")
    assert "1024 B + 128 B padding / 32 B" in describe_plan(wide_h, get_scheme("mxfp4_w4a16"),
                                                               torch.device("cpu"))["w4_layout"]
    with knobs.override(TRITON_W4_SCALE_PAD=0):
        assert "w13 / w2: 2048 B / 64 B" in describe_plan(wide_h, get_scheme("nvfp4_w4a16"),
                                                          torch.device("cpu"))["w4_layout"]
    assert "w4_layout" not in describe_plan(problem, get_scheme("int8_w8a16"), torch.device("cpu"))
    # the explain lines: the 4-bit layout named as such, a persistent GEMM2 and a one-dot GEMM1 spelled out
    from fusedmoe.cli import format_plans

    plan = describe_plan(GemmProblem(64, 8, 128, 64, 4, True, torch.bfloat16), get_scheme("nvfp4_w4a16"),
                         torch.device("cpu"))
    plan["gemm1"]["tile"] = dataclasses.replace(plan["gemm1"]["tile"], one_dot=True)
    plan["gemm2"]["tile"] = dataclasses.replace(plan["gemm2"]["tile"], persistent=True)
    shown = {k: ({**v, "tile": v["tile"].as_list()} if isinstance(v, dict) else v) for k, v in plan.items()}
    text = format_plans([dict(tokens=16, device="cpu", **shown)])
    assert "4-bit weights: fragments" in text and "mxfp4 weights" not in text
    assert "gate and up in one dot" in text.split("; gemm2 ")[0] and "persistent: programs stride" in text


def test_fp8_nan_codes_are_refused_at_load():
    """The GPU's fp8 decode has no NaN (kernels.W8_PTX_E4M3): process_weights refuses e4m3 NaN
    codes (0x7F, 0xFF) in either weight, naming the weight and the count; finite codes pass."""
    from fusedmoe.backends.triton.weight_only import check_fp8_codes

    config, x, w, weights, ids, _ = problem(Case("nan", T=3, H=64, I=32), "fp8_w8a16", torch.float32)
    experts = TritonExperts(config)
    assert experts.process_weights(w) is w
    check_fp8_codes(w.w13, "w13")
    for name, nan_codes in (("w13", (0x7F,)), ("w2", (0xFF, 0x7F, 0xFF))):
        bad = getattr(w, name).clone()
        bad.view(torch.uint8).view(-1)[torch.randperm(bad.numel())[:len(nan_codes)]] = torch.tensor(
            nan_codes, dtype=torch.uint8)
        with pytest.raises(ValueError, match=rf"{name} holds {len(nan_codes)} fp8 NaN codes"):
            experts.process_weights(w.replace(**{name: bad}))


def test_layer_keeps_the_scales_its_backend_re_lays():
    """FusedMoE adopts the scales process_weights returns: buffers and QuantParams alike."""
    from fusedmoe import FusedMoE, Platform, select_experts

    E, K, H, I = 4, 2, 64, 32
    layer = FusedMoE(E, K, H, I, params_dtype=torch.float32, quant="int4_w4a16_g32", backend="triton",
                     platform=Platform("cuda", (9, 0)))  # CPU tensors, the interpreter runs the kernels
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(E, 2 * I, H) / H**0.5)
        layer.w2_weight.copy_(torch.randn(E, H, I) / I**0.5)
    layer.process_weights_after_loading()
    assert layer.w13_scale.stride(1) == 1 and layer.w2_scale.stride(1) == 1
    assert layer.quant_params.w13_scale is layer.w13_scale and layer.quant_params.w2_scale is layer.w2_scale
    x, logits = torch.randn(3, H), torch.randn(3, E)
    w, ids = select_experts(x, logits, K, renormalize=True)
    emulated = EmulationExperts(layer.config).apply(x, layer._expert_weights(), w, ids, expert_map_E=None)
    assert rel_err(layer(x, logits), emulated) < TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["int4_g32_compressed_tensors", "int4_g64_gptq", "mxfp4_compressed_tensors"])
def test_w4_checkpoint_through_the_triton_layer(fmt):
    """A 4-bit checkpoint (tests/test_checkpoint.py's: int4 compressed-tensors pack-quantized or
    GPTQ, re-packed to nibble bytes at load; mxfp4 pack-quantized) through the triton layer (the
    interpreter: int4 in the checkpoint layout at this size, mxfp4 laid as fragments; group-major
    scales) gives the emulation layer's output on it."""
    from fusedmoe import FusedMoE, Platform
    from test_checkpoint import TOP_K, batch, load, make_checkpoint
    from test_checkpoint import E as CE
    from test_checkpoint import H as CH
    from test_checkpoint import I as CI

    ckpt = make_checkpoint(fmt)
    layers = {}
    for backend, platform in (("triton", Platform("cuda", (9, 0))), ("emulation", None)):
        layers[backend] = FusedMoE(CE, TOP_K, CH, CI, params_dtype=torch.float32, quant=ckpt.scheme,
                                   prequantized=True, backend=backend, platform=platform)
        load(layers[backend], ckpt, "load_expert_weight")
    assert layers["triton"].selection.name == "triton"
    x, logits = batch()
    x = x[:3]  # the interpreter's cost is per program
    assert rel_err(layers["triton"](x, logits[:3]), layers["emulation"](x, logits[:3])) < TOL[torch.float32]


@pytest.mark.parametrize("scheme", ["int4_w4a16_g32", "fp8_w8a16"])
def test_one_token_direct_path_with_slot_shares(scheme):
    """Weight-only at one token on the direct path: GEMM2 spreads the slots over programs whose
    partials are combined (the heuristic's split_k), as emulation. Auto takes it, as for
    unquantized calls: every one-token call goes direct."""
    from fusedmoe.backends.triton.experts import GemmProblem, choose_plan, direct_tiles
    from fusedmoe.quant.scheme import get_scheme

    config, x, w, weights, ids, _ = problem(Case("one", T=1, E=6, K=4, H=64, I=32), scheme, torch.float32)
    p = GemmProblem(4, 6, 64, 32, 4, True, torch.float32)
    assert choose_plan(p, get_scheme(scheme), x.device)[0] and choose_plan(p, None, x.device)[0]
    assert direct_tiles(p, get_scheme(scheme), x.device)[1].split_k == 4
    out = run(config, x, w, weights, ids, None)
    assert rel_err(out, EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)) < TOL[torch.float32]


def test_k_not_a_multiple_of_the_group_is_refused():
    """Group scales need whole groups: H = 96 under g128 fails validation, before any kernel."""
    E, G, H, I = 4, 64, 96, 32
    params = QuantParams("int4_w4a16_g128", torch.ones(E, G, 0), torch.ones(E, H, 0))
    w = ExpertWeights(torch.zeros(E, G, H // 2, dtype=torch.uint8),
                      torch.zeros(E, H, I // 2, dtype=torch.uint8), quant=params)
    x, weights, ids = torch.randn(2, H), torch.ones(2, 2) / 2, torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"int4_w4a16_g128 has one scale per 128 inputs, but w13's K = 96"):
        TritonExperts(MoEConfig(E, 2, H, I, dtype=torch.float32, quant="int4_w4a16_g128")).apply(
            x, w, weights, ids, expert_map_E=None)


def test_opcheck():
    # int4 (float scales): the schema check multiplies inputs, which CPU torch lacks for float8
    config, x, w, weights, ids, _ = problem(Case("opcheck", T=3, H=64, I=32), "int4_w4a16_g32", torch.float32)
    p = w.quant
    args = (x, w.w13, w.w2, weights, ids, None, None, None, 4, "silu", False, 1.702, None,
            "int4_w4a16_g32", p.w13_scale, p.w2_scale, None, None)
    torch.library.opcheck(triton_quant_experts_op, args, test_utils=("test_schema", "test_faketensor"))


# Tiles ---------------------------------------------------------------------------------------
def test_check_tile_weight_only_reasons():
    bf16 = torch.bfloat16
    assert "block_k=16: 4-bit weights run two dots" in check_tile(TileConfig(16, 64, 16), dtype=bf16, quant="w4",
                                                                 group=32)
    assert "needs its scale group size" in check_tile(TileConfig(16, 64, 64), dtype=bf16, quant="w4")
    assert "multiple or a divisor of the scale group 48" in check_tile(TileConfig(16, 64, 64), dtype=bf16,
                                                                       quant="w4", group=48)
    assert check_tile(TileConfig(16, 64, 256, 4, 4, 8), dtype=bf16, quant="w4", group=16, allow_split=True) is None
    assert check_tile(TileConfig(16, 64, 16), dtype=bf16, quant="w8") is None  # 16-bit dots
    assert "must be one of" in check_tile(TileConfig(16, 64, 64), dtype=bf16, quant="w2")


@pytest.mark.parametrize("mode,group", [("w8", None), ("w4", 16), ("w4", 32), ("w4", 128)])
def test_heuristic_weight_only_tiles_are_valid(mode, group):
    for dtype in (torch.bfloat16, torch.float32):
        for slots in (1, 7, 64, 1000, 32768):
            for experts in (1, 8, 128):
                for n, k, gated in ((2880, 2880, True), (4096, 1792, False), (256, 7168, True), (48, 128, False)):
                    for fragments in (False, True) if mode == "w4" else (False,):
                        tile = heuristic(slots, experts, n, k, dtype, gated=gated, quant=mode, group=group,
                                         fragments=fragments)
                        assert check_tile(tile, dtype=dtype, operands=2 if gated else 1, allow_split=gated,
                                          quant=mode, group=group) is None, tile


@pytest.mark.parametrize("scheme,twin", [("nvfp4", "nvfp4_w4a16"), ("mxfp4_w4a8", "mxfp4_w4a16")])
def test_marlin_runs_activation_quantized_schemes_weight_only(scheme, twin):
    """marlin / batched_marlin: the scheme's weights through the weight-only kernels, activations
    not rounded (the seeds' Marlin on Hopper): equal to the twin scheme's emulation, and not to
    the W4A4 / W4A8 emulation."""
    from fusedmoe.backends.triton.marlin import BatchedMarlinExperts, MarlinExperts
    from fusedmoe.modular import BatchedLocalPrepareFinalize, make_modular

    config, x, w, weights, ids, _ = problem(Case("marlin", T=5, H=64, I=32, bias=True), scheme, torch.float32)
    q = w.quant
    if scheme == "nvfp4":  # calibrated input global scales: the weight-only execution ignores them
        q.a13_scale, q.a2_scale = torch.full((4,), 0.05), torch.full((4,), 0.05)
    wo = w.replace(quant=QuantParams(twin, q.w13_scale, q.w2_scale, w13_global_scale=q.w13_global_scale,
                                     w2_global_scale=q.w2_global_scale))
    want = EmulationExperts(config.replace(quant=twin)).apply(x, wo, weights, ids, expert_map_E=None)
    out = MarlinExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert rel_err(out, want) < TOL[torch.float32]
    rounded = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert rel_err(out, rounded) > 1e-3  # the activation rounding really is skipped
    batched_config = config.replace(activation_format="batched")
    batched = make_modular(batched_config, BatchedMarlinExperts(batched_config))
    assert isinstance(batched.prepare_finalize, BatchedLocalPrepareFinalize)
    assert rel_err(batched(x, w, weights, ids), want) < TOL[torch.float32]
    with pytest.raises(ValueError, match=r"marlin backend runs \['mxfp4_w4a8', 'nvfp4'\] .*not int4_w4a16_g32"):
        MarlinExperts(config.replace(quant="int4_w4a16_g32"))
    other = problem(Case("marlin-other", H=64, I=32), "int4_w4a16_g32", torch.float32)[2]
    with pytest.raises(ValueError, match=f"weights.quant has scheme int4_w4a16_g32, which the marlin backend "
                                         f"does not run as {twin}"):
        MarlinExperts(config).apply(x, other, weights, ids, expert_map_E=None)


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g32"])
def test_bench_copies_are_laid_out_as_the_layer_runs_them(scheme):
    """bench._quantized_copy(prepare=True) (a GPU's default; the tuner's always) gives the codes
    and the scales process_weights leaves (4-bit fragments, group-major int4 scales), both of
    them: the triton experts on the copy match emulation on the checkpoint-layout weights. (The
    codes once stayed in the checkpoint order beside fragment-layout scales.)"""
    from fusedmoe.backends.triton.weight_only import prepare_weights
    from fusedmoe.bench import _quantized_copy
    from fusedmoe.modular import ExpertWeights
    from fusedmoe.routing import select_experts

    gen = torch.Generator().manual_seed(5)
    E, H, I, T = 3, 128, 64, 4  # noqa: E741
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / 8, torch.randn(E, H, I, generator=gen) / 8
    plain = _quantized_copy(w13, w2, None, None, scheme, prepare=False)
    laid = _quantized_copy(w13, w2, None, None, scheme, prepare=True)
    want = prepare_weights(ExpertWeights(plain[0], plain[1], None, None, plain[4]))
    assert torch.equal(laid[0], want.w13) and torch.equal(laid[1], want.w2)
    assert torch.equal(laid[4].w13_scale.float(), want.quant.w13_scale.float())
    x = torch.randn(T, H, generator=gen)
    topk_w, ids = select_experts(x, torch.randn(T, E, generator=gen), 2)
    from fusedmoe import fused_experts

    ref = fused_experts(x, plain[0], plain[1], topk_w, ids, quant=plain[4], backend="emulation")
    p = laid[4]
    out = triton_quant_experts(x, laid[0], laid[1], topk_w, ids, None, None, None, E, "silu", False, 1.702, None,
                               scheme, p.w13_scale, p.w2_scale, w13_global_scale=p.w13_global_scale,
                               w2_global_scale=p.w2_global_scale)
    assert rel_err(out, ref) < 1e-5
