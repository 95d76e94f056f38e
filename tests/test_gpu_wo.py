"""GPU tests of the triton backend's weight-only schemes: against `emulation` and the reference on
dequantized weights, on preset-like shapes, edge cases, CUDA graphs, torch.compile and opcheck.

Skipped without CUDA. Run on the device machine: `pytest -m gpu tests/test_gpu_wo.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from fusedmoe import FusedMoE, fused_experts, fused_experts_ref, knobs, select_experts
from fusedmoe.backends.triton.weight_only import kernel_scale_layout, prepare_weights
from fusedmoe.modular import ExpertWeights
from fusedmoe.quant.fragments import is_fragments
from fusedmoe.quant.weights import dequantize_weights, quantize_weights
from gpu_checks import capture, close, poison_allocator, rel_err, replayed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# "<scheme>:fragments": 4-bit weights in the fragment layout the triton backend's process_weights
# gives (fusedmoe.quant.fragments, kernels._w4_frag_tile); the plain 4-bit schemes keep the
# checkpoint layout (the functional API does not process weights)
WEIGHT_ONLY = ["fp8_w8a16", "int8_w8a16", "int4_w4a16_g32", "int4_w4a16_g64", "int4_w4a16_g128",
               "mxfp4_w4a16", "mxfp4_w4a16:fragments", "nvfp4_w4a16", "nvfp4_w4a16:fragments",
               "int4_w4a16_g32:fragments", "int4_w4a16_g64:fragments", "int4_w4a16_g128:fragments",
               "int4_w4a16_g32_zp", "int4_w4a16_g64_zp", "int4_w4a16_g128_zp", "int4_w4a16_g32_zp:fragments",
               "int4_w4a16_g64_zp:fragments", "int4_w4a16_g128_zp:fragments"]
# Weight-only: emulation is the reference on dequantized weights (fp32). The kernels round the
# dequantized weights to bf16 (exact for 8-bit codes and e2m1 * 2^s, 2^-9 relative for scaled
# int4 / nvfp4), the intermediate and y per slot to bf16, and sum in another order: the bf16
# tolerance of the unquantized path (tests/test_gpu.py).
TOL = 2e-2
# E, K, H, I, activation, bias: Mixtral-like, and gpt-oss-120b (H = I = 2880, not a multiple of 128)
SHAPES = {"mixtral-like": (8, 2, 4096, 1792, "silu", False),
          # 32 of gpt-oss's 128 experts: all 128 ran out of memory in fp32 quantization temporaries
          # before quantize_weights chunked its experts (0dc9f58); 32 keeps the test short
          "gpt-oss-like": (32, 4, 2880, 2880, "swigluoai", True),
          "deepseek-v3-tp8-like": (64, 8, 7168, 256, "silu", False),  # 64 of its 256 experts, as test_gpu_quant
          "qwen3-235b-tp4-like": (128, 8, 4096, 384, "silu", False),
          # Qwen3-30B-A3B whole: M=512 is 32 rows an expert (the 4-bit fragment rule's 32-row blocks)
          "qwen3-30b": (128, 8, 2048, 768, "silu", False)}


def make_weights(E, H, I, scheme, *, seed=0, bias=False, gated=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(E, (2 if gated else 1) * I, H, device="cuda", generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5
    b13 = torch.randn(E, w13.shape[1], device="cuda", generator=gen).to(torch.bfloat16) * 0.1 if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.1 if bias else None
    if scheme.endswith("_zp"):  # asymmetric int4: rows off centre, so the zero points span their range
        w13 += torch.rand(E, w13.shape[1], 1, device="cuda", generator=gen) * 2 / H**0.5
        w2 -= torch.rand(E, H, 1, device="cuda", generator=gen) * 2 / I**0.5
    q13, q2, params = quantize_weights(w13, w2, scheme.removesuffix(":fragments"))
    del w13, w2
    if scheme.endswith(":fragments"):
        with knobs.override(TRITON_W4_FRAGMENTS="all"):  # int4 too, at every group and size
            laid = prepare_weights(ExpertWeights(q13, q2, quant=params))
        assert is_fragments(laid.quant.w13_scale) and is_fragments(laid.quant.w2_scale), (E, H, I)
        q13, q2, params = laid.w13, laid.w2, laid.quant
    return q13, q2, params, b13, b2


def make_tokens(T, E, K, H, *, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    w, ids = select_experts(x, torch.randn(T, E, device="cuda", generator=gen), K)
    return x, w, ids


def check(x, q13, q2, params, b13, b2, w, ids, **kw):
    poison_allocator()
    out = fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="triton", **kw)
    laid = dataclasses.replace(params, **{name: kernel_scale_layout(getattr(params, name))  # zero points as their scales
                                          for name in ("w13_scale", "w2_scale", "w13_zero", "w2_zero")
                                          if getattr(params, name) is not None})
    if laid.w13_scale is not params.w13_scale or laid.w2_scale is not params.w2_scale:
        # group-major scales (process_weights' storage for int4 / nvfp4): other strides, the same bits out
        again = fused_experts(x, q13, q2, w, ids, quant=laid, w13_bias=b13, w2_bias=b2, backend="triton", **kw)
        assert torch.equal(again, out)
    emulated = fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2,
                             backend="emulation", **kw)
    close(out, emulated, TOL)
    d13, d2 = dequantize_weights(q13, q2, params)
    if "expert_map" in kw:
        kw["expert_map_E"] = kw.pop("expert_map")
    exact = fused_experts_ref(x.float(), d13, d2, w, ids, w13_bias_LG=b13, w2_bias_LH=b2, **kw)
    assert rel_err(out, exact) < TOL
    return out


def run_triton(x, w, ids, weights, E, activation, **kw):
    """The triton experts on weights = make_weights(...)'s tuple, no expert_map; kw: the plan
    (`direct`, `tiles`)."""
    from fusedmoe.backends.triton.quant import triton_quant_experts

    q13, q2, params, b13, b2 = weights
    return triton_quant_experts(
        x, q13, q2, w, ids, b13, b2, None, E, activation, False, 1.702, None, params.scheme.name,
        params.w13_scale, params.w2_scale, w13_global_scale=params.w13_global_scale,
        w2_global_scale=params.w2_global_scale, w13_zero=params.w13_zero, w2_zero=params.w2_zero, **kw)


def test_fp8_ptx_decode_is_exact_on_every_code():
    """kernels._w8_codes with PTX: each of the 254 finite e4m3 codes (normals, subnormals, +-0)
    gives torch's own bf16 conversion bit for bit."""
    import triton
    import triton.language as tl

    from fusedmoe.backends.triton import kernels

    @triton.jit
    def decode(src, dst, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(dst + offs, kernels._w8_codes(tl.load(src + offs), tl.bfloat16, True))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(3)[:512].cuda()  # NaN codes are refused at load
    w = codes.view(torch.float8_e4m3fn)
    out = torch.full((512,), float("nan"), dtype=torch.bfloat16, device="cuda")
    decode[(1,)](w, out, N=512)
    assert torch.equal(out.view(torch.int16), w.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("fmt,group", [("mxfp4", 32), ("nvfp4", 16), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_fragment_tile_decode_is_exact(fmt, group):
    """kernels._w4_frag_tile on a GPU, PTX (bf16) and integer (fp32) branches, over every code
    and a spread of scales (nvfp4: all 127 finite non-negative e4m3 codes, subnormals and 448
    included; mxfp4: e8m0 codes 0-128): the tile is each weight's decoded value times its scale
    (nvfp4 times 2^-8), bit for bit in fp32 and rounded once to bf16. The tile goes through a dot
    with the identity, as in the GEMMs: the PTX decode takes each lane's 4 bytes of a word
    together, which holds in the layout the dot operand gives it (a plain store may re-lay it)."""
    import triton
    import triton.language as tl

    from fusedmoe.backends.triton import kernels
    from fusedmoe.backends.triton.tiles import W4_FRAG_FORMATS
    from fusedmoe.quant.formats import e2m1_decode, unpack_nibbles
    from fusedmoe.quant.fragments import to_fragments

    @triton.jit
    def decode(w, s, s_rows, eye, out, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, PTX: tl.constexpr):
        n16 = tl.program_id(0) * (BN // 16)
        k0 = tl.program_id(1) * BK
        t = kernels._w4_frag_tile(w, s, s_rows, n16, N // 16, k0, K, K, FMT, GROUP, BN, BK, eye.dtype.element_ty, PTX)
        t = tl.dot(t, tl.load(eye + tl.arange(0, BK)[:, None] * BK + tl.arange(0, BK)[None, :]), input_precision="ieee")
        rows = n16 * 16 + tl.arange(0, BN)
        tl.store(out + rows[:, None] * K + k0 + tl.arange(0, BK)[None, :], t)

    gen = torch.Generator().manual_seed(group)
    N, K = 128, 256
    codes = torch.randint(0, 256, (1, N, K // 2), dtype=torch.uint8, generator=gen)
    if fmt == "mxfp4":
        scales = torch.randint(0, 129, (1, N, K // group), dtype=torch.uint8, generator=gen)
        s_val = torch.exp2(scales.double() - 127)
    elif fmt == "nvfp4":
        scales = (torch.arange(N * K // group) % 127).to(torch.uint8).view(1, N, K // group).view(torch.float8_e4m3fn)
        s_val = scales.double() * 2.0**-8  # the tile holds value * s * 2^-8 (fragments.nv_scale_codes)
    else:
        scales = (torch.rand(1, N, K // group, generator=gen) * 0.1).to(torch.float16)
        s_val = scales.double()
    nib = unpack_nibbles(codes)
    value = ((nib.int() ^ 8) - 8).double() if fmt == "int4" else e2m1_decode(nib).double()
    want = value * s_val.repeat_interleave(group, dim=2)
    frag, fs = to_fragments(codes, scales, fmt)
    frag, fs = frag.cuda(), fs.cuda()
    for dtype, ptx in ((torch.bfloat16, True), (torch.float32, False)):
        out = torch.full((N, K), float("nan"), dtype=torch.float32, device="cuda")
        eye = torch.eye(128, dtype=dtype, device="cuda")
        decode[(N // 64, K // 128)](frag, fs, fs.stride(1), eye, out, N=N, K=K, FMT=W4_FRAG_FORMATS[fmt],
                                    GROUP=group, BN=64, BK=128, PTX=ptx, num_warps=4)
        expect = want[0].to(dtype) if not (ptx and fmt == "int4") else (value * s_val.bfloat16().double()
                                                                       .repeat_interleave(group, dim=2))[0].bfloat16()
        assert torch.equal(out.cpu(), expect.float()), (fmt, dtype, (out.cpu().double() - expect.double()).abs().max())


@pytest.mark.bigmem
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_presets(scheme, shape):
    E, K, H, I, activation, bias = SHAPES[shape]
    if scheme.startswith("int4_w4a16_g128") and H % 128:
        pytest.skip(f"H = {H} is not a multiple of the group 128 (quantize_weights refuses it)")
    q13, q2, params, b13, b2 = make_weights(E, H, I, scheme, seed=E, bias=bias)
    for tokens in (1, 33, 512):
        x, w, ids = make_tokens(tokens, E, K, H, seed=tokens)
        check(x, q13, q2, params, b13, b2, w, ids, activation=activation)


def _slice_params(params, n):
    sliced = dict(w13_scale=params.w13_scale[:n], w2_scale=params.w2_scale[:n])
    if params.w13_global_scale is not None:
        sliced.update(w13_global_scale=params.w13_global_scale[:n], w2_global_scale=params.w2_global_scale[:n])
    if params.w13_zero is not None:
        sliced.update(w13_zero=params.w13_zero[:n], w2_zero=params.w2_zero[:n])
    return dataclasses.replace(params, **sliced)


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_edge_cases(scheme):
    q13, q2, params, b13, b2 = make_weights(8, 256, 128, scheme, seed=1, bias=True)
    x, w, ids = make_tokens(0, 8, 2, 256)
    assert fused_experts(x, q13, q2, w, ids, quant=params, backend="triton").shape == (0, 256)
    check(*(lambda t: (t[0], q13, q2, params, b13, b2, t[1], t[2]))(make_tokens(1, 8, 2, 256, seed=1)))
    # all tokens to expert 5: the other experts are empty; one token per expert (decode-like)
    x, w, ids = make_tokens(300, 8, 1, 256, seed=2)
    check(x, q13, q2, params, None, None, w, torch.full_like(ids, 5))
    # odd sizes: N not a multiple of any tile, K a multiple of the group only
    q13o, q2o, po, b13o, b2o = make_weights(6, 384, 128 + 64 * ("g128" not in scheme), scheme, seed=3, bias=True)
    x, w, ids = make_tokens(37, 6, 3, 384, seed=3)
    check(x, q13o, q2o, po, b13o, b2o, w, ids)
    # expert_map: the odd global experts live here; ids out of range with validation off
    q13, q2, params, _, _ = make_weights(16, 256, 128, scheme, seed=4)
    x, w, ids = make_tokens(64, 16, 4, 256, seed=4)
    expert_map = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    expert_map[1::2] = torch.arange(8, dtype=torch.int32, device="cuda")
    check(x, q13[:8].contiguous(), q2[:8].contiguous(), _slice_params(params, 8), None, None, w, ids,
          expert_map=expert_map, global_num_experts=16)
    bad = ids.clone()
    bad[::3, 0] = 99
    out = fused_experts(x, q13, q2, w, bad, quant=params, backend="triton", validate=False)
    keep = (bad < 16).float()
    emulated = fused_experts(x, q13, q2, w * keep, bad.clamp(max=15), quant=params, backend="emulation")
    assert rel_err(out, emulated) < TOL
    # router weight on input (top-1), a non-gated activation
    q13, q2, params, _, _ = make_weights(8, 256, 128, scheme, seed=5, gated=False)
    x, w, ids = make_tokens(40, 8, 1, 256, seed=5)
    check(x, q13, q2, params, None, None, w, ids, activation="relu2_no_mul", apply_router_weight_on_input=True)


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_deterministic_and_cuda_graph(scheme):
    q13, q2, params, _, _ = make_weights(32, 1024, 512, scheme, seed=6)
    x, w, ids = make_tokens(200, 32, 4, 1024, seed=6)
    first = fused_experts(x, q13, q2, w, ids, quant=params, backend="triton")
    assert torch.equal(first, fused_experts(x, q13, q2, w, ids, quant=params, backend="triton"))
    graph, static_out = capture(lambda: fused_experts(x, q13, q2, w, ids, quant=params, backend="triton"))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, first)
    new_w, new_ids = select_experts(x, torch.randn(200, 32, device="cuda"), 4)
    w.copy_(new_w)
    ids.copy_(new_ids)
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    emulated = fused_experts(x, q13, q2, w, ids, quant=params, backend="emulation")
    assert rel_err(static_out, emulated) < TOL


@pytest.mark.parametrize("scheme,activation,bias", [("int4_w4a16_g32", "silu", False),
                                                    ("mxfp4_w4a16", "swigluoai", True),
                                                    ("nvfp4_w4a16", "silu", False),
                                                    ("int4_w4a16_g64", "silu", True),
                                                    ("int4_w4a16_g128", "gelu", False),
                                                    ("fp8_w8a16", "silu", False),
                                                    ("int8_w8a16", "swigluoai", True)])
def test_layer_selects_triton_and_compiles(scheme, activation, bias):
    E, K, H, I = 16, 4, 512, 256
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, device="cuda", quant=scheme,
                     activation=activation, has_bias=bias)
    with torch.no_grad():
        layer.w13_weight.normal_(0, H**-0.5)
        layer.w2_weight.normal_(0, I**-0.5)
        if bias:
            layer.w13_bias.normal_(0, 0.1)
            layer.w2_bias.normal_(0, 0.1)
    assert layer.process_weights_after_loading().name == "triton"
    x = torch.randn(37, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(37, E, device="cuda")
    eager = layer(x, logits)
    out = torch.compile(layer, fullgraph=True)(x, logits)
    assert rel_err(out, eager) < 1e-2
    w, ids = layer.route(x, logits)
    emulated = fused_experts(x, layer.w13_weight, layer.w2_weight, w, ids, quant=layer.quant_params,
                             w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, activation=activation,
                             backend="emulation")
    assert rel_err(eager, emulated) < TOL


def test_opcheck_on_gpu():
    from fusedmoe.backends.triton.quant import triton_quant_experts_op

    q13, q2, p, _, _ = make_weights(8, 256, 128, "nvfp4_w4a16", seed=8)
    x, w, ids = make_tokens(9, 8, 2, 256, seed=8)
    # nvfp4 group scales are float8_e4m3fn: test_schema's before/after comparison has no CUDA
    # float8 kernels in torch 2.11 ("mul_cuda" not implemented); the other checks run.
    torch.library.opcheck(triton_quant_experts_op, (x, q13, q2, w, ids, None, None, None, 8, "silu", False,
                                                    1.702, None, "nvfp4_w4a16", p.w13_scale, p.w2_scale,
                                                    None, None, p.w13_global_scale, p.w2_global_scale),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("scheme", ["int4_w4a16_g32", "mxfp4_w4a16", "mxfp4_w4a16:fragments", "nvfp4_w4a16",
                                    "fp8_w8a16", "nvfp4_w4a16:fragments", "int4_w4a16_g32:fragments",
                                    "int8_w8a16", "int4_w4a16_g64:fragments", "int4_w4a16_g128",
                                    "int4_w4a16_g128:fragments", "int4_w4a16_g32_zp", "int4_w4a16_g128_zp:fragments"])
def test_batched_layout_and_cuda_graph(scheme):
    """dispatch -> batched_triton (weight-only) -> combine: equal to the contiguous Triton path up
    to summation order and close to emulation, with an expert that gets every token and empty
    ones; captured and replayed in a CUDA graph."""
    E, K, H, I, activation, bias = SHAPES["mixtral-like"]
    q13, q2, params, b13, b2 = make_weights(E, H, I, scheme, seed=5)
    x, w, ids = make_tokens(40, E, K, H, seed=5)
    kw = dict(quant=params, backend="triton", activation_format="batched")
    poison_allocator()
    out = fused_experts(x, q13, q2, w, ids, **kw)
    assert rel_err(out, fused_experts(x, q13, q2, w, ids, quant=params, backend="triton")) < TOL
    assert rel_err(out, fused_experts(x, q13, q2, w, ids, quant=params, backend="emulation")) < TOL
    one = torch.full_like(ids[:, :1], 3)
    got = fused_experts(x, q13, q2, w[:, :1], one, **kw)
    assert rel_err(got, fused_experts(x, q13, q2, w[:, :1], one, quant=params, backend="emulation")) < TOL
    assert torch.equal(replayed(lambda: fused_experts(x, q13, q2, w, ids, **kw)), out)


@pytest.mark.parametrize("scheme,twin", [("nvfp4", "nvfp4_w4a16"), ("mxfp4_w4a8", "mxfp4_w4a16")])
def test_marlin_runs_w4a4_and_w4a8_weight_only(scheme, twin):
    """On Hopper the oracle sends NVFP4 W4A4 and MXFP4 W4A8 to marlin (weight-only execution,
    the seeds' Marlin): equal to the weight-only twin's emulation, in both layouts, each replayed
    in a CUDA graph bitwise."""
    from fusedmoe import MoEConfig, Platform, select_backend
    from fusedmoe.quant import QuantParams

    platform = Platform.for_device(torch.device("cuda"))
    E, K, H, I = 32, 4, 1024, 512
    config = MoEConfig(E, K, H, I, dtype=torch.bfloat16, quant=scheme)
    if platform.capability < (10, 0):
        assert select_backend(config, platform).name == "marlin"
        assert select_backend(config.replace(activation_format="batched"), platform).name == "batched_marlin"
    q13, q2, params, b13, b2 = make_weights(E, H, I, scheme, seed=7, bias=True)
    x, w, ids = make_tokens(77, E, K, H, seed=7)
    twin_params = QuantParams(twin, params.w13_scale, params.w2_scale, w13_global_scale=params.w13_global_scale,
                              w2_global_scale=params.w2_global_scale)
    want = fused_experts(x, q13, q2, w, ids, quant=twin_params, w13_bias=b13, w2_bias=b2, backend="emulation")
    for backend, layout in (("marlin", "standard"), ("batched_marlin", "batched")):
        poison_allocator()
        run = functools.partial(fused_experts, x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2,
                                backend=backend, activation_format=layout)
        out = run()
        assert rel_err(out, want) < TOL, backend
        assert torch.equal(replayed(run), out), backend


@pytest.mark.parametrize("scheme,twin", [("nvfp4", "nvfp4_w4a16"), ("mxfp4_w4a8", "mxfp4_w4a16")])
def test_layer_runs_w4a4_and_w4a8_on_marlin_and_compiles(scheme, twin):
    """FusedMoE with NVFP4 W4A4 / MXFP4 W4A8 on Hopper: the oracle picks marlin (weight-only
    execution), the layer compiles with fullgraph=True, and its output is the weight-only twin's
    emulation on the processed weights."""
    E, K, H, I = 16, 4, 512, 256
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, device="cuda", quant=scheme)
    with torch.no_grad():
        layer.w13_weight.normal_(0, H**-0.5)
        layer.w2_weight.normal_(0, I**-0.5)
    chosen = layer.process_weights_after_loading().name
    if torch.cuda.get_device_capability() < (10, 0):
        assert chosen == "marlin"
    x = torch.randn(37, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(37, E, device="cuda")
    poison_allocator()
    eager = layer(x, logits)
    out = torch.compile(layer, fullgraph=True)(x, logits)
    assert rel_err(out, eager) < 1e-2
    w, ids = layer.route(x, logits)
    twin_params = dataclasses.replace(layer.quant_params, scheme=twin)
    emulated = fused_experts(x, layer.w13_weight, layer.w2_weight, w, ids, quant=twin_params, backend="emulation")
    assert rel_err(eager, emulated) < TOL


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g32", "int4_w4a16_g128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fragments_in_fp16_and_fp32(dtype, scheme):
    """4-bit weights in the fragment layout with fp16 / fp32 activations: no inline PTX there,
    the fragments are decoded by Triton integer ops (kernels._w4_frag_tile's other branch) on the
    GPU; against emulation on the aligned and the direct path."""
    q13, q2, params, b13, b2 = make_weights(16, 512, 256, scheme + ":fragments", seed=9, bias=True)
    b13, b2 = b13.to(dtype), b2.to(dtype)
    for tokens in (1, 4, 70):
        x, w, ids = make_tokens(tokens, 16, 4, 512, seed=9 + tokens)
        x = x.to(dtype)
        poison_allocator()
        out = fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="triton")
        emulated = fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="emulation")
        assert out.dtype == dtype and rel_err(out, emulated) < (TOL if dtype == torch.float16 else 1e-4)


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_direct_decode(scheme):
    """The direct decode path (GEMM1 by slot, GEMM2 with the top-k sum; the bf16 inline-PTX
    decode in both) against emulation at decode sizes, and CUDA-graph replay."""
    E, K, H, I, activation, bias = SHAPES["mixtral-like" if scheme.startswith("int4_w4a16_g128") else "gpt-oss-like"]
    weights = q13, q2, params, b13, b2 = make_weights(E, H, I, scheme, seed=3, bias=bias)
    for tokens in (1, 4):
        x, w, ids = make_tokens(tokens, E, K, H, seed=tokens + 40)

        def run(direct, x=x, w=w, ids=ids):
            return run_triton(x, w, ids, weights, E, activation, direct=direct)

        poison_allocator()
        out = run(True)
        emulated = fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="emulation",
                                 activation=activation)
        assert rel_err(out, emulated) < TOL
        assert rel_err(out, run(False)) < TOL
        assert torch.equal(replayed(lambda: run(True)), out)  # noqa: B023


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16:fragments", "nvfp4_w4a16:fragments", "int4_w4a16_g32"])
def test_persistent_gemm2(scheme):
    """The weight-only 4-bit GEMM2 as a persistent launch (TileConfig.persistent,
    tiles.W4_PERSISTENT_PROGRAMS programs per SM striding over the real tiles) at DeepSeek-V3's
    I = 256: bitwise the tile-per-program launch's output, within tolerance of emulation, and
    the same after CUDA-graph replay."""
    from fusedmoe.backends.triton.tiles import TileConfig

    E, K, H, I, activation, bias = SHAPES["deepseek-v3-tp8-like"]
    weights = q13, q2, params, b13, b2 = make_weights(E, H, I, scheme, seed=21, bias=True)
    for tokens in (16, 300):
        x, w, ids = make_tokens(tokens, E, K, H, seed=tokens + 60)

        def run(persistent, x=x, w=w, ids=ids):
            tiles = (TileConfig(16, 64, 128, 4, 4), TileConfig(16, 128, 128, 4, 3, persistent=persistent))
            return run_triton(x, w, ids, weights, E, activation, tiles=tiles)

        poison_allocator()
        out = run(True)
        assert torch.equal(out, run(False))
        emulated = fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="emulation",
                                 activation=activation)
        assert rel_err(out, emulated) < TOL
        assert torch.equal(replayed(lambda: run(True)), out)  # noqa: B023


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16:fragments", "nvfp4_w4a16:fragments", "int4_w4a16_g32:fragments"])
def test_one_dot_fragment_gemm1(scheme):
    """GEMM1 over fragment-layout weights with one_dot (gate and up rows one fragment tile, one
    dot; TileConfig.one_dot) on the inline-PTX decode: within tolerance of the two-tile GEMM1
    and of emulation at a Qwen3-235B-like shape (I = 384: 32- and 64-row halves, 128-row halves with
    a tail), at decode and prefill sizes, and the same after CUDA-graph replay."""
    from fusedmoe.backends.triton.tiles import TileConfig

    E, K, H, I, activation, bias = SHAPES["qwen3-235b-tp4-like"]
    weights = q13, q2, params, b13, b2 = make_weights(E, H, I, scheme, seed=31, bias=True)
    for tokens, block_n in ((16, 32), (16, 64), (300, 128)):
        x, w, ids = make_tokens(tokens, E, K, H, seed=tokens + 80)

        def run(one_dot, x=x, w=w, ids=ids, block_n=block_n):
            tiles = (TileConfig(16, block_n, 128, 4, 3, one_dot=one_dot), TileConfig(16, 64, 64, 4, 4))
            return run_triton(x, w, ids, weights, E, activation, tiles=tiles)

        poison_allocator()
        out = run(True)
        assert rel_err(out, run(False)) < 1e-3
        emulated = fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="emulation",
                                 activation=activation)
        assert rel_err(out, emulated) < TOL
        assert torch.equal(replayed(lambda: run(True)), out)  # noqa: B023


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16:fragments", "nvfp4_w4a16:fragments", "int4_w4a16_g32:fragments",
                                    "int4_w4a16_g64:fragments", "int4_w4a16_g128:fragments"])
def test_wide_fragment_plan(scheme):
    """The 128-row plan with an 8-warp GEMM1 over fragment-layout weights (tune.W4_WIDE_GEMM1_START
    with GEMM2 128 x 128 x 64 in 4 warps, 4 stages: the packaged Mixtral M=256 plan of int4 g32,
    nvfp4 and mxfp4) at a Mixtral-like shape, ~64 rows an expert and a tail: within tolerance of
    emulation and of the heuristic's plan, the same bit for bit over 24 more runs, and after
    CUDA-graph replay. With the fragment dots in flight (FUSEDMOE_TRITON_RS_SYNC=0: the wgmma
    register hazard kernels._rs_sync closes) int4's GEMM2 under this plan computed wrong rows in
    3-11 of 40 runs at Mixtral M=256 on an H200 (benchmarks/probe_w4_fragments.py --repeat)."""
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.tune import W4_WIDE_GEMM1_START

    E, K, H, I, activation, bias = SHAPES["mixtral-like"]
    weights = q13, q2, params, b13, b2 = make_weights(E, H, I, scheme, seed=41)
    wide = (W4_WIDE_GEMM1_START, TileConfig(128, 128, 64, 4, 4))
    for tokens in (256, 300):
        x, w, ids = make_tokens(tokens, E, K, H, seed=tokens + 90)
        poison_allocator()
        out = run_triton(x, w, ids, weights, E, activation, tiles=wide)
        emulated = fused_experts(x, q13, q2, w, ids, quant=params, backend="emulation", activation=activation)
        assert rel_err(out, emulated) < TOL, tokens
        assert rel_err(out, run_triton(x, w, ids, weights, E, activation)) < TOL, tokens
        for run in range(24):  # a race shows as a run that differs
            assert torch.equal(run_triton(x, w, ids, weights, E, activation, tiles=wide), out), (tokens, run)
        assert torch.equal(replayed(lambda: run_triton(x, w, ids, weights, E, activation, tiles=wide)), out)  # noqa: B023
