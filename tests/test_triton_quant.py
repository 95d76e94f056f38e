"""The Triton backend's quantized schemes on the CPU, through the Triton interpreter (fp32/fp16).

Activation quantization kernels against their torch reference (bit-exact codes and scales);
the W8A8 and weight-only experts against the `emulation` backend (the same quantized math) and
the reference on dequantized weights (tests/test_triton_wo.py: what is weight-only's alone). Tiles are given explicitly where the heuristic's would make many small
programs: the interpreter's cost is per program and op.
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

if torch.cuda.is_available():  # these build CPU tensors for the interpreter; GPUs run test_gpu_quant.py
    pytest.skip("interpreter tests (CPU); on a GPU see tests/test_gpu_quant.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fusedmoe import MoEConfig, knobs  # noqa: E402
from fusedmoe.backends.emulation import EmulationExperts  # noqa: E402
from fusedmoe.backends.triton.experts import BatchedTritonExperts, TritonExperts  # noqa: E402
from fusedmoe.backends.triton.quant import (  # noqa: E402
    ONE_PASS_MAX,
    quantize_activation,
    quantize_activation_ref,
    triton_batched_quant_experts,
    triton_batched_quant_experts_op,
    triton_quant_experts_op,
    triton_quant_experts_out_op,
)
from fusedmoe.backends.triton.tiles import TileConfig, check_tile, heuristic  # noqa: E402
from fusedmoe.modular import BatchedLocalPrepareFinalize, ExpertWeights, make_modular  # noqa: E402
from fusedmoe.quant import SCHEMES, QuantKey, fake_quantize_activation  # noqa: E402
from fusedmoe.quant.scheme import get_scheme  # noqa: E402
from fusedmoe.quant.weights import quantize_weights  # noqa: E402
from quant_problems import (  # noqa: E402
    Case,
    assert_close_up_to_code_flips,
    dequantized_reference,
    problem,
    rel_err,
    run,
)

W8A8 = ["fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "fp8_w8a8_block", "int8_w8a8"]
WEIGHT_ONLY = ["fp8_w8a16", "int8_w8a16", "int4_w4a16_g32", "int4_w4a16_g64", "int4_w4a16_g128",
               "int4_w4a16_g32_zp", "mxfp4_w4a16", "nvfp4_w4a16"]
# Triton vs emulation: the same quantized operands; only the summation order differs (and, for
# fp16, the per-slot rounding of y before the fp32 top-k sum: ~2^-11 relative, measured 3.5e-4).
# An intermediate value within an fp32 rounding of a code boundary may still flip one code: a
# scheme that quantizes activations is held to emulation in fp32 up to such flips
# (assert_matches_emulation); in fp16 TOL's 2e-3 is above one flip's ~1e-3.
# Weight-only in fp16: the dequantized weights are rounded to fp16 (exact for 8-bit codes and
# e2m1 * 2^s; 2^-11 relative for scaled int4 / nvfp4): measured 3.9e-4 to 5.7e-4.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# Triton vs the reference on dequantized weights without activation quantization: the
# activations' round trip, through silu(g) * u and GEMM2: RMS <= sqrt(3) * r_a. fp8: r_a = 0.036
# (tests/test_quant.py). int8: s / sqrt(12) relative to sigma with s = amax / 127; the
# intermediate silu(g) * u is heavy-tailed, amax up to ~7 sigma over 160 values, so
# r_a = 7 / (127 sqrt(12)) = 0.016 (measured 0.020 / sqrt(3) = 0.012).
ACT_RMS = {"fp8": 0.036, "int8": 0.016}


def exact_tol(scheme: str) -> float:
    """Against the reference on dequantized weights: W8A8 adds its activations' round trip;
    weight-only is the same float math (fp32: only the summation order differs)."""
    activation = SCHEMES[scheme].activation
    return TOL[torch.float32] if activation is None else math.sqrt(3) * ACT_RMS[activation.dtype]


def assert_matches_emulation(out, emulated, scheme: str, dtype: torch.dtype = torch.float32) -> None:
    """Triton against emulation: within TOL[dtype], except a scheme that quantizes activations in
    fp32, held up to a code flip (assert_close_up_to_code_flips), as the intermediate's codes come
    from GEMM1 sums in numpy's order here and torch's there (which order depends on the CPU's
    vector units); fp16's TOL is above one flip's error."""
    if SCHEMES[scheme].activation is None or dtype != torch.float32:
        assert rel_err(out, emulated) < TOL[dtype]
    else:
        assert_close_up_to_code_flips(out, emulated)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Small tensors on 2 busy cores: intra-op threading only adds overhead (see test_quant.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Activation quantization ---------------------------------------------------------------------
KEYS = {
    "fp8-token": QuantKey("fp8", "token", dynamic=True),
    "int8-token": QuantKey("int8", "token", dynamic=True),
    "fp8-group128": QuantKey("fp8", "group", 128, dynamic=True),
    "fp8-tensor": QuantKey("fp8", "tensor", dynamic=True),
    "fp8-tensor-static": QuantKey("fp8", "tensor"),
}


def _activation_rows(k: int, seed: int) -> torch.Tensor:
    """Gaussian rows plus the hard ones: all zeros, exact rounding ties, fp8 binade carries."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, k, generator=gen) * torch.tensor([1, 3, 0.01, 100, 1, 1, 1]).unsqueeze(1)
    x[4] = 0.0
    x[5, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 126.5, 1.5, -127.0])  # int8 scale 1: ties
    x[6, :6] = torch.tensor([448.0, 127.8, -31.9, 7.95, 0.0019, -240.0])  # fp8 scale 1: carries
    return x


@pytest.mark.parametrize("k", [200, 256])
@pytest.mark.parametrize("name", list(KEYS))
def test_quantize_activation_matches_torch_reference(name, k):
    key = KEYS[name]
    x = _activation_rows(k, zlib.crc32(name.encode()) + k)
    static = torch.tensor([0.05]) if not key.dynamic else None
    for row_weight in (None, torch.rand(x.shape[0], generator=torch.Generator().manual_seed(k))):
        codes, scales = quantize_activation(x, key, static, row_weight_M=row_weight)
        want_codes, want_scales = quantize_activation_ref(x, key, static, row_weight_M=row_weight)
        assert codes.dtype == want_codes.dtype and scales.shape == want_scales.shape
        assert torch.equal(scales, want_scales)
        assert torch.equal(codes.float(), want_codes.float()), (codes.float() - want_codes.float()).abs().max()
    # the reference is the emulation's fake quantization, split into codes and scales
    codes, scales = quantize_activation_ref(x, key, static)
    group = k if key.granularity == "token" else (key.group or k)
    expanded = scales.reshape(-1, 1) if key.granularity == "tensor" else scales.repeat_interleave(group, -1)[:, :k]
    assert torch.equal(codes.float() * expanded, fake_quantize_activation(x, key, static))



@pytest.mark.parametrize("k", [200, 3000])
@pytest.mark.parametrize("name", ["fp8-token", "int8-token", "fp8-group128"])
def test_quantize_only_the_listed_rows(name, k):
    """live_rows = (row_map, count): the rows row_map[:count] (those < M) get the reference's codes
    and scales; every other row is neither read nor written (the batched layout's dead rows)."""
    from fusedmoe.backends.triton.quant import _CODE_DTYPE, _launch_rows

    key = KEYS[name]
    x = _activation_rows(k, k + 5)
    x[1] = float("nan")  # never listed: reading it would change nothing here, but it is not read either
    row_map = torch.tensor([6, 0, 7, 3, 7, 4, 2, 7], dtype=torch.int32)  # 7 = M: padding
    count = torch.tensor([6], dtype=torch.int32)  # row_map[6:] past the count: row 2 stays unset
    group = k if key.granularity == "token" else key.group
    codes = torch.full((7, k), 99, dtype=torch.int8).view(_CODE_DTYPE[key.dtype])
    scales = torch.full((7, math.ceil(k / group)), -1.0)
    _launch_rows(x, codes, scales, None, group, key, live_rows=(row_map, count))
    want_codes, want_scales = quantize_activation_ref(x, key)
    for r in range(7):
        if r in (0, 3, 4, 6):
            assert torch.equal(scales[r], want_scales[r]) and torch.equal(codes[r].float(), want_codes[r].float())
        else:
            assert (scales[r] == -1).all() and (codes[r].view(torch.int8) == 99).all(), r


@pytest.mark.parametrize("k", [3000, ONE_PASS_MAX, ONE_PASS_MAX + 600])
@pytest.mark.parametrize("name", ["fp8-token", "int8-token"])
def test_quantize_wide_rows(name, k):
    """Per-token rows past 1024: read once by one program up to ONE_PASS_MAX (8 and 16 warps),
    in two 1024-wide passes beyond; the same codes and scales as the reference either way. The
    extreme value sits in the row's last columns, where a short read would miss it."""
    key = KEYS[name]
    x = _activation_rows(k, k)[:3]
    x[0, -1] = 1000.0
    x[1, -3] = -77.0
    codes, scales = quantize_activation(x, key)
    want_codes, want_scales = quantize_activation_ref(x, key)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.float(), want_codes.float())

@pytest.mark.parametrize("name", ["fp8-token", "int8-token", "fp8-group128"])
def test_quantize_division_at_ties_and_extreme_scales(name):
    """Codes within an ulp of every rounding tie, at scales from 2^-100 to 2^100: bit for bit the
    reference's true division, whether the kernel divides by the scale's reciprocal (scales in
    [2^-64, 2^64]) or falls back to div.rn (quant_kernels._div_scale)."""
    from quant_problems import division_rows

    key = KEYS[name]
    x = division_rows(384, key.dtype, key.group, seed=zlib.crc32(name.encode()))
    codes, scales = quantize_activation(x, key)
    want_codes, want_scales = quantize_activation_ref(x, key)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (
        (codes.view(torch.uint8) != want_codes.view(torch.uint8)).sum())
    if key.dtype == "fp8":  # an Inf amax: scale Inf, the finite values code to +-0 (sign kept)
        special = x[:1].clone()
        special[0, 3] = float("inf")
        codes, scales = quantize_activation(special, key)
        want_codes, want_scales = quantize_activation_ref(special, key)
        assert torch.equal(scales, want_scales) and scales.isinf().any()
        finite = special.isfinite()
        assert torch.equal(codes.view(torch.uint8)[finite], want_codes.view(torch.uint8)[finite])


def test_quantize_activation_errors():
    with pytest.raises(ValueError, match="no Triton activation quantization for fp8/group64"):
        quantize_activation(torch.randn(2, 128), QuantKey("fp8", "group", 64, dynamic=True))
    with pytest.raises(ValueError, match="one value"):
        quantize_activation(torch.randn(2, 128), KEYS["fp8-tensor-static"], torch.ones(3))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_per_tensor_codes_per_aligned_row_match_torch(static):
    """fp8_w8a8_tensor's x codes: one row per aligned slot, quantized with its expert's scale
    (the amax over the expert's tokens, router weight applied, / 448; or the static scale), bit
    for bit as torch computes them; padding rows hold code 0 and scale 0."""
    from fusedmoe.backends.triton.quant import prepare_quant_launch
    from fusedmoe.quant.formats import absmax_scale, fp8_quantize

    gen = torch.Generator().manual_seed(5)
    T, H, E = 7, 200, 5
    x = _activation_rows(H, 11)
    ids = torch.tensor([[0, 3], [3, 2], [0, 3], [4, 3], [3, 0], [2, 4], [0, 2]], dtype=torch.int32)
    weights = torch.rand(T, 1, generator=gen).expand(T, 1)  # K = 1 for router weight on input
    ids, weights = ids[:, :1].contiguous(), weights.contiguous()
    static_scale = torch.rand(E, generator=gen) + 0.1 if static else None
    q = prepare_quant_launch(x, weights, ids, None, E, E, 32, "silu", True, 1.0, None,
                             SCHEMES["fp8_w8a8_tensor_static" if static else "fp8_w8a8_tensor"], static_scale, 16)
    L = q.L
    rows = int(L.num_rows)
    slots = L.sorted_slot[:rows].long()
    experts = L.block_expert[torch.arange(rows) // L.block_m].long()
    live = slots < T
    xw = x * weights.reshape(-1, 1)
    if static:
        scale_e = static_scale
    else:
        amax = torch.stack([xw[ids[:, 0] == e].abs().amax() if (ids == e).any() else torch.tensor(0.0)
                            for e in range(E)])
        scale_e = absmax_scale(amax, 448.0)
    want_scales = torch.where(live, scale_e[experts], torch.zeros(()))
    assert torch.equal(q.x_scales[:rows, 0], want_scales)
    want = fp8_quantize(xw[slots[live]], want_scales[live].unsqueeze(1)).float()
    assert torch.equal(q.x_in[:rows][live].float(), want)
    assert (q.x_in[:rows][~live].float() == 0).all()


@pytest.mark.parametrize("split_k", [1, 2])
def test_per_tensor_intermediate_amax_skips_padding_rows(split_k):
    """Dynamic per-tensor fp8: the intermediate's per-expert amax is taken where a is finished
    (GEMM1's epilogue, or the split-K act kernel) over live rows only. Here the padding rows'
    act(bias) exceeds every live row's (x > 0, w13 < 0, bias > 0), so counting them would show."""
    from fusedmoe.backends.triton.quant import launch_quant_gemm1, prepare_quant_launch
    from fusedmoe.quant.formats import FP8_DTYPE

    gen = torch.Generator().manual_seed(9)
    T, H, I, E, K = 5, 128, 64, 4, 2
    x = torch.rand(T, H, generator=gen) + 0.5
    w13 = (-torch.rand(E, 2 * I, H, generator=gen) * 0.5).to(FP8_DTYPE)
    w13_scale = torch.full((E,), 0.05)
    bias = torch.full((E, 2 * I), 3.0)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [1, 0], [0, 3]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=gen)
    q = prepare_quant_launch(x, weights, ids, None, E, E, I, "silu", False, 1.0, None,
                             SCHEMES["fp8_w8a8_tensor"], None, 16)
    launch_quant_gemm1(q, w13, bias, w13_scale, TileConfig(16, 32, 64, 4, 1, split_k))
    L = q.L
    rows = int(L.num_rows)
    live = L.sorted_slot[:rows].long() < T * K
    experts = L.block_expert[torch.arange(rows) // L.block_m].long()
    a = L.a[:rows].abs()
    assert a[~live].max() > a[live].max()  # the case is what it claims
    want = torch.stack([a[live & (experts == e)].max() if (live & (experts == e)).any() else torch.tensor(0.0)
                        for e in range(E)])
    assert torch.equal(q.a_amax, want)


# The experts ---------------------------------------------------------------------------------
MODES = ["fp8_w8a8_tensor", "fp8_w8a8_channel", "fp8_w8a8_block"]  # one scheme per scale mode
CASES = [  # (case, schemes): the paths each case exercises differently
    (Case("basic"), W8A8),
    (Case("gelu-bias"), W8A8),
    (Case("top1-weight-on-input", K=1, T=8, bias=True, on_input=True), W8A8),
    (Case("expert-map", T=7, E=6, K=3, bias=True, expert_map=True), W8A8),
    (Case("relu2-no-mul", activation="relu2_no_mul", I=48), ["fp8_w8a8_tensor", "fp8_w8a8_block", "int8_w8a8"]),
    (Case("k-not-multiple-of-128", H=200, I=96, tiles=((16, 64, 32, 4, 1), (16, 128, 32, 4, 1))), MODES),
    (Case("fused-group-epilogue", I=160, tiles=((16, 128, 64, 4, 1), (16, 128, 64, 4, 1))), ["fp8_w8a8_block"]),
    # 2I = 384 rows in three scale blocks, H = 256 in two: gate, up and down N tiles each read
    # another block (the up tiles' from I on; 64-wide tiles lie in one block each)
    (Case("scale-block-per-n-tile", H=256, I=192, tiles=((16, 64, 64, 4, 1), (16, 64, 64, 4, 1))),
     ["fp8_w8a8_block"]),
    (Case("split-k", H=256, tiles=((16, 64, 64, 4, 1, 2), (16, 128, 64, 4, 1))), MODES + ["int8_w8a8"]),
    # weight-only: 4-bit groups across and inside K steps, 8-bit codes cast in registers
    (Case("wo-basic", I=128), WEIGHT_ONLY),
    (Case("wo-gelu-bias", activation="gelu", bias=True, I=128), ["int8_w8a16", "int4_w4a16_g32", "nvfp4_w4a16"]),
    (Case("wo-swigluoai-bias", activation="swigluoai", bias=True, I=128), ["mxfp4_w4a16", "fp8_w8a16"]),
    (Case("wo-top1-weight-on-input", K=1, T=8, bias=True, on_input=True, I=128), ["int4_w4a16_g64", "nvfp4_w4a16"]),
    (Case("wo-expert-map", T=7, E=6, K=3, bias=True, expert_map=True, I=128),
     ["fp8_w8a16", "int4_w4a16_g32", "mxfp4_w4a16"]),
    # N not a multiple of BLOCK_N, K not of BLOCK_K (partial K steps of whole groups)
    (Case("wo-relu2-partial-tiles", activation="relu2_no_mul", H=80, I=48), ["nvfp4_w4a16"]),
    (Case("wo-partial-tiles", H=96, I=160), ["int4_w4a16_g32", "mxfp4_w4a16"]),
    (Case("wo-odd-n", H=100, I=37, tiles=((16, 32, 32, 4, 1), (16, 64, 32, 4, 1))), ["int8_w8a16", "fp8_w8a16"]),
    # H and I both odd (1-byte code rows of 65 and 37 bytes: no stride is a multiple of 16)
    (Case("odd-h-and-i", T=5, E=6, K=3, H=65, I=37), ["fp8_w8a8_block", "int8_w8a8", "int8_w8a16"]),
    # a K step inside one group (BLOCK_K 32 < 128) and a split that starts mid-group
    (Case("wo-split-k", H=256, I=128, tiles=((16, 64, 32, 4, 1, 4), (16, 128, 32, 4, 1))),
     ["int4_w4a16_g128", "nvfp4_w4a16", "fp8_w8a16"]),
    # asymmetric int4 (zero points read with the scales' strides): partial N and K tiles, biases,
    # expert_map; a K step inside one group and a split starting mid-group
    (Case("wo-zp-partial-expert-map", T=7, E=6, K=3, bias=True, expert_map=True, H=96, I=160),
     ["int4_w4a16_g32_zp"]),
    (Case("wo-zp-split-k", H=256, I=128, tiles=((16, 64, 32, 4, 1, 4), (16, 128, 32, 4, 1))), ["int4_w4a16_g128_zp"]),
]


@pytest.mark.parametrize("case,scheme", [(c, s) for c, schemes in CASES for s in schemes],
                         ids=[f"{c.id}-{s}" for c, schemes in CASES for s in schemes])
def test_schemes_match_emulation_and_reference(case, scheme):
    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    out = run(config, x, w, weights, ids, expert_map, case.tiles)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert_matches_emulation(out, emulated, scheme)
    exact = dequantized_reference(config, x, w, weights, ids, expert_map)
    assert rel_err(out, exact) < exact_tol(scheme)
    if expert_map is not None:  # tokens whose slots are all remote get exactly zero
        remote = (expert_map[ids.long()] < 0).all(-1)
        assert (out[remote] == 0).all()


WO_DIRECT = [(c, s) for c, schemes in CASES if c.id.startswith("wo-") for s in schemes[:1]]


@pytest.mark.parametrize("case,scheme", WO_DIRECT, ids=[f"{c.id}-{s}" for c, s in WO_DIRECT])
def test_weight_only_direct_decode_matches_emulation(case, scheme):
    """The direct decode path (GEMM1 by slot, GEMM2 with the top-k sum; no alignment) on the
    weight-only cases: every decode (8-bit, int4 / e2m1 groups, nvfp4's global scale), split-K,
    biases, router weight on input, expert_map, partial tiles."""
    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    out = run(config, x, w, weights, ids, expert_map, case.tiles, direct=True)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert rel_err(out, emulated) < TOL[torch.float32]
    assert torch.equal(out, run(config, x, w, weights, ids, expert_map, case.tiles, direct=True))


W8A8_DIRECT = [  # (case, schemes): the direct decode path of the W8A8 schemes it runs
    (Case("d-basic", T=3), ["fp8_w8a8_channel", "fp8_w8a8_block", "int8_w8a8"]),
    (Case("d-top1-weight-on-input", K=1, T=4, bias=True, on_input=True), ["fp8_w8a8_channel", "int8_w8a8"]),
    (Case("d-expert-map", T=3, E=6, K=3, bias=True, expert_map=True), ["fp8_w8a8_block", "int8_w8a8"]),
    # GEMM1 split over H (the act kernel finishes a), GEMM2 over slot shares (+ combine)
    (Case("d-splits", T=2, H=256, K=3, tiles=((16, 64, 64, 4, 1, 2), (16, 64, 64, 4, 1, 2))),
     ["fp8_w8a8_channel", "fp8_w8a8_block", "int8_w8a8"]),
    # block: GEMM1's 128-wide N tile quantizes a in its epilogue (row 0 of each slot block only)
    (Case("d-fused-group", T=2, I=160, tiles=((16, 128, 64, 4, 1), (16, 128, 64, 4, 1))), ["fp8_w8a8_block"]),
    (Case("d-partial-k", T=2, H=200, I=96, tiles=((16, 64, 32, 4, 1), (16, 128, 32, 4, 1))),
     ["fp8_w8a8_channel", "int8_w8a8"]),
    (Case("d-relu2-no-mul", T=2, activation="relu2_no_mul", I=48), ["fp8_w8a8_block", "int8_w8a8"]),
    (Case("d-swigluoai-bias", T=2, activation="swigluoai", bias=True), ["fp8_w8a8_channel"]),
]


@pytest.mark.parametrize("case,scheme", [(c, s) for c, schemes in W8A8_DIRECT for s in schemes],
                         ids=[f"{c.id}-{s}" for c, schemes in W8A8_DIRECT for s in schemes])
def test_w8a8_direct_decode_matches_emulation(case, scheme):
    """The W8A8 direct decode path (x per token, GEMM1 by slot, the intermediate per slot, GEMM2
    with the top-k sum; no alignment) against emulation, and deterministic."""
    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    out = run(config, x, w, weights, ids, expert_map, case.tiles, direct=True)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert_close_up_to_code_flips(out, emulated)
    assert torch.equal(out, run(config, x, w, weights, ids, expert_map, case.tiles, direct=True))
    if expert_map is not None:  # tokens whose slots are all remote get exactly zero
        assert (out[(expert_map[ids.long()] < 0).all(-1)] == 0).all()


XQ_CASES = [(c, s) for c, schemes in W8A8_DIRECT for s in schemes if s != "fp8_w8a8_block"] + [
    (Case("x-swap", T=3, H=256, tiles=((16, 64, 64, 4, 1, 1, True), (16, 64, 64, 4, 1))), "int8_w8a8"),
    (Case("x-odd-h", T=2, H=100, I=37, tiles=((16, 32, 32, 4, 1), (16, 64, 32, 4, 1))), "fp8_w8a8_channel"),
]


@pytest.mark.parametrize("case,scheme", XQ_CASES, ids=[f"{c.id}-{s}" for c, s in XQ_CASES])
def test_direct_gemm1_quantizes_x_bitwise(case, scheme, monkeypatch):
    """The direct GEMM1 that quantizes x itself (FUSE_XQ, per-token codes) makes the codes and
    scales the launch before it made: the same output, bitwise, as with that launch
    (FUSE_XQ_MAX_H = 0); 1x128 groups keep the launch."""
    from fusedmoe.backends.triton import quant as tq

    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    key, sizes = get_scheme(scheme).activation, (x.shape[1], case.I, True, ids.numel(), w.w13.shape[0])
    assert tq.fuse_x_quantization(key, *sizes)
    fused = run(config, x, w, weights, ids, expert_map, case.tiles, direct=True)
    monkeypatch.setattr(tq, "FUSE_XQ_MAX_H", 0)
    assert not tq.fuse_x_quantization(key, *sizes)
    assert torch.equal(fused, run(config, x, w, weights, ids, expert_map, case.tiles, direct=True))


AQ_CASES = XQ_CASES + [  # the direct GEMM2's slot shares (PER > 1, a last share past TOP_K)
    (Case("a-shares", T=2, K=3, H=100, I=96, bias=True, expert_map=True,
          tiles=((16, 32, 32, 4, 1), (16, 64, 32, 4, 1, 2))), "int8_w8a8"),
    (Case("a-odd-i", T=3, I=37, tiles=((16, 32, 32, 4, 1), (16, 64, 32, 4, 1, 2))), "fp8_w8a8_channel"),
    *((Case("a-swap", T=2, I=96, tiles=((16, 32, 32, 4, 1), (16, 64, 32, 4, 1, 2, True))), s)  # w^T @ a^T
      for s in ("int8_w8a8", "fp8_w8a8_channel")),
]


@pytest.mark.parametrize("case,scheme", AQ_CASES, ids=[f"{c.id}-{s}" for c, s in AQ_CASES])
def test_direct_gemm2_quantizes_a_bitwise(case, scheme, monkeypatch):
    """The direct GEMM2 that quantizes GEMM1's fp32 intermediate itself (FUSE_AQ, per-token
    codes: each slot row's scale read once, each K step's codes from its tile) gives the output of
    the quantization launch between the GEMMs, bitwise (FUSE_AQ_MAX_I = 0); slots mapped away or
    past TOP_K add nothing (their rows were never written)."""
    from fusedmoe.backends.triton import quant as tq

    monkeypatch.setattr(tq, "FUSE_AQ_MIN_I", 0)  # the interpreter's small rows
    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    assert tq.fuse_a_quantization(get_scheme(scheme).activation, case.I)
    fused = run(config, x, w, weights, ids, expert_map, case.tiles, direct=True)
    monkeypatch.setattr(tq, "FUSE_AQ_MAX_I", 0)
    assert not tq.fuse_a_quantization(get_scheme(scheme).activation, case.I)
    assert torch.equal(fused, run(config, x, w, weights, ids, expert_map, case.tiles, direct=True))
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert_close_up_to_code_flips(fused, emulated)


def test_fuse_a_quantization_rule():
    """Per-token codes only, intermediate rows from FUSE_AQ_MIN_I to FUSE_AQ_MAX_I (DeepSeek-V3's
    256 and Mixtral's 14336 keep the launch); 1x128 groups and per-tensor scales keep theirs."""
    from fusedmoe.backends.triton.quant import fuse_a_quantization

    assert fuse_a_quantization(get_scheme("int8_w8a8").activation, 768)
    assert fuse_a_quantization(get_scheme("int8_w8a8").activation, 384)  # Qwen3-235B TP4
    assert fuse_a_quantization(get_scheme("fp8_w8a8_channel").activation, 2880)
    assert not fuse_a_quantization(get_scheme("int8_w8a8").activation, 256)
    assert not fuse_a_quantization(get_scheme("int8_w8a8").activation, 14336)
    assert not fuse_a_quantization(get_scheme("fp8_w8a8_block").activation, 768)
    assert not fuse_a_quantization(get_scheme("fp8_w8a8_tensor").activation, 768)


def test_fuse_x_quantization_rule():
    """Per-token codes only, rows up to FUSE_XQ_MAX_H, GEMM1 reading up to FUSE_XQ_MAX_WEIGHTS
    (the H200's measured split: the fine-grained presets' decode fused, Mixtral's not)."""
    from fusedmoe.backends.triton.quant import fuse_x_quantization

    token, group = get_scheme("int8_w8a8").activation, get_scheme("fp8_w8a8_block").activation
    assert fuse_x_quantization(token, 2048, 768, True, 8, 128)  # Qwen3-30B M=1: 8 experts' [2I, H]
    assert fuse_x_quantization(get_scheme("fp8_w8a8_channel").activation, 2880, 2880, True, 4, 128)  # gpt-oss
    assert not fuse_x_quantization(token, 4096, 14336, True, 2, 8)  # Mixtral M=1
    assert fuse_x_quantization(token, 4096, 14336, False, 2, 1)  # ... one local expert, no gate: 59M
    assert not fuse_x_quantization(token, 16384, 8, True, 1, 1)  # a row past FUSE_XQ_MAX_H
    assert not fuse_x_quantization(group, 2048, 768, True, 8, 128)  # 1x128 groups keep their launch


FP8_ACC_SCHEMES = ["fp8_w8a8_channel", "fp8_w8a8_tensor", "fp8_w8a8_block", "int8_w8a8"]


@pytest.mark.parametrize("direct", [False, True], ids=["aligned", "direct"])
@pytest.mark.parametrize("scheme", FP8_ACC_SCHEMES)
def test_fp8_accumulate_reaches_the_gemms(scheme, direct, monkeypatch):
    """FUSEDMOE_FP8_ACCUMULATE: chained (unset) or promoted fp8 accumulation reaches every W8A8
    GEMM launch as FP8_PROMOTE for per-tensor / per-channel fp8 only (block scales promote
    anyway, int8 sums exactly), and both compile and match emulation (the interpreter's dot is
    exact either way; the difference is Hopper's, measured in quant.fp8_promoted)."""
    from fusedmoe.backends.triton import kernels

    if direct and scheme == "fp8_w8a8_tensor":
        pytest.skip("per-tensor W8A8 has no direct path")
    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw.get("FP8_PROMOTE"))
                return self.kernel[grid](*args, **kw)
            return launch

    names = ["moe_gemm1_kernel", "moe_gemm2_direct_kernel" if direct else "moe_gemm2_kernel"]
    for name in names:
        monkeypatch.setattr(kernels, name, Spy(getattr(kernels, name)))
    case = Case("acc", T=3, H=200, I=96, bias=True)
    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    promotes = scheme in ("fp8_w8a8_channel", "fp8_w8a8_tensor")
    for mode, want in ((None, False), ("chained", False), ("promoted", promotes)):
        seen.clear()
        with knobs.override(FP8_ACCUMULATE=mode):
            out = run(config, x, w, weights, ids, expert_map, direct=direct)
        assert seen == [want, want], (mode, seen)
        assert_close_up_to_code_flips(out, emulated)


@pytest.mark.parametrize("direct", [False, True], ids=["aligned", "direct"])
@pytest.mark.parametrize("knob", ["FP8_ACCUMULATE", "TRITON_SWAP_AB", "TRITON_GEMM2_ROWS", "TUNED_SIBLINGS"])
def test_bad_knob_raises_before_any_launch(direct, knob, monkeypatch):
    """A bad FUSEDMOE_FP8_ACCUMULATE, FUSEDMOE_TRITON_SWAP_AB or FUSEDMOE_TRITON_GEMM2_ROWS is read
    once per call (quant._call_knobs), and FUSEDMOE_TUNED_SIBLINGS with the plan (memoized_tiles),
    before the alignment and x's quantization launch."""
    from fusedmoe.backends.triton import quant as tq

    def launched(*args, **kwargs):
        raise AssertionError("a kernel launched before the knob was read")

    config, x, w, weights, ids, expert_map = problem(Case("bad-knob"), "fp8_w8a8_channel", torch.float32)
    monkeypatch.setattr(tq, "align", launched)
    monkeypatch.setattr(tq, "quantize_activation", launched)
    monkeypatch.setenv(f"FUSEDMOE_{knob}", "fast")
    with pytest.raises(ValueError, match=f"FUSEDMOE_{knob}='fast'"):
        run(config, x, w, weights, ids, expert_map, direct=direct)


def test_fp8_accumulate_knob(monkeypatch):
    monkeypatch.setenv("FUSEDMOE_FP8_ACCUMULATE", "Promoted")
    assert knobs.get("FP8_ACCUMULATE") == "promoted"
    monkeypatch.setenv("FUSEDMOE_FP8_ACCUMULATE", "fast")
    with pytest.raises(ValueError, match="FUSEDMOE_FP8_ACCUMULATE='fast'.*chained"):
        knobs.get("FP8_ACCUMULATE")


@pytest.mark.parametrize("scheme", ["fp8_w8a8_block", "int8_w8a8"])
def test_w8a8_direct_decode_fp16(scheme):
    config, x, w, weights, ids, expert_map = problem(Case("d-fp16", T=2, bias=True), scheme, torch.float16)
    out = run(config, x, w, weights, ids, expert_map, Case.tiles, direct=True)
    assert out.dtype == torch.float16
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert rel_err(out, emulated) < TOL[torch.float16]


SWAP_CASES = [  # (case, schemes): the W8A8 GEMMs with SWAP_AB forced, aligned and direct
    (Case("s-basic"), W8A8),
    # block: the up tiles straddle scale blocks (I % BLOCK_N != 0) and GEMM1 quantizes its output
    (Case("s-straddle-fused", I=160, tiles=((16, 128, 64, 4, 1), (16, 128, 64, 4, 1))), ["fp8_w8a8_block"]),
    (Case("s-split-k", H=256, K=3, tiles=((16, 64, 64, 4, 1, 2), (16, 64, 64, 4, 1, 2))),
     ["fp8_w8a8_channel", "fp8_w8a8_block", "int8_w8a8"]),
    (Case("s-partial-bias-map", H=200, I=96, E=6, K=3, bias=True, expert_map=True,
          tiles=((16, 64, 32, 4, 1), (16, 128, 32, 4, 1))), ["fp8_w8a8_tensor", "fp8_w8a8_channel", "int8_w8a8"]),
    (Case("s-top1-weight-on-input", K=1, T=5, on_input=True), ["fp8_w8a8_block", "fp8_w8a8_tensor_static"]),
]


@pytest.mark.parametrize("direct", [False, True], ids=["aligned", "direct"])
@pytest.mark.parametrize("case,scheme", [(c, s) for c, schemes in SWAP_CASES for s in schemes],
                         ids=[f"{c.id}-{s}" for c, schemes in SWAP_CASES for s in schemes])
def test_swap_ab_matches_unswapped(case, scheme, direct):
    """SWAP_AB (w^T @ a^T with transposed accumulators: scales per row become per column, the
    block step's straddling up scales, split-K partials, the fused group epilogue, the direct
    GEMM2's slot loop) gives the unswapped result, up to a flipped activation code."""
    if direct and scheme.startswith("fp8_w8a8_tensor"):
        pytest.skip("per-tensor W8A8 has no direct path")
    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    tiles = case.tiles if direct else (case.tiles[0], case.tiles[1][:5])  # slot shares: direct GEMM2 only
    with knobs.override(TRITON_SWAP_AB=False):
        plain = run(config, x, w, weights, ids, expert_map, tiles, direct=direct)
    with knobs.override(TRITON_SWAP_AB="force"):
        swapped = run(config, x, w, weights, ids, expert_map, tiles, direct=direct)
    assert_close_up_to_code_flips(swapped, plain)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert_close_up_to_code_flips(swapped, emulated)


BLOCK_TILES = ((64, 128, 128, 4, 1), (64, 128, 128, 4, 1))  # the tiled GEMM2 steps K by 128, as the groups
ROWS_CASES = [  # the row-stationary W8A8 GEMM2 (kernels.moe_gemm2_rows_kernel) forced on
    (Case("r-basic"), "int8_w8a8"),
    # E not a power of 2, H not a multiple of the 64-wide N tiles, I under its 64-wide tile, biases
    (Case("r-odd-bias", T=37, E=5, K=3, H=100, I=48, bias=True), "int8_w8a8"),
    # I at GEMM2_ROWS_MAX_I, router weight on the input (no row scale), half the experts elsewhere,
    # 64-row blocks
    (Case("r-maxi-input-map", T=9, E=6, K=1, H=64, I=256, on_input=True, expert_map=True,
          tiles=((64, 64, 64, 4, 1), (64, 64, 64, 4, 1))), "int8_w8a8"),
    (Case("r-one-expert", T=20, K=1), "int8_w8a8"),  # every token to expert 2: the others get no rows
    # I past 256: a 256-wide head tile and a 128-wide tail (experts.gemm2_rows_split), the tail
    # 64 wide live (I = 320), odd H, biases; I = 384 in 64-row blocks (the row block's config)
    (Case("r-tail-bias", T=37, E=5, K=3, H=72, I=320, bias=True), "int8_w8a8"),
    (Case("r-tail-384", T=40, E=6, K=2, H=64, I=384, tiles=((64, 64, 64, 4, 1), (64, 64, 64, 4, 1))), "int8_w8a8"),
    # fp8 block: two full 128-wide groups; H past the last whole weight block, the second group
    # 32 wide, biases, E = 5; weight on input with an expert map
    (Case("rb-basic", T=20, H=256, I=256, tiles=BLOCK_TILES), "fp8_w8a8_block"),
    (Case("rb-odd-bias", T=37, E=5, K=3, H=200, I=160, bias=True, tiles=BLOCK_TILES), "fp8_w8a8_block"),
    (Case("rb-input-map", T=9, E=6, K=1, H=128, I=256, on_input=True, expert_map=True, tiles=BLOCK_TILES),
     "fp8_w8a8_block"),
    # a third group in the tail tile: whole (I = 384), 44 wide with biases (I = 300)
    (Case("rb-tail-384", T=20, E=5, K=2, H=128, I=384, tiles=BLOCK_TILES), "fp8_w8a8_block"),
    (Case("rb-tail-odd-bias", T=30, E=5, K=3, H=200, I=300, bias=True, tiles=BLOCK_TILES), "fp8_w8a8_block"),
    # fp8 per token / per tensor codes, chained accumulation (the interpreter sums a whole-K dot in
    # another order than K steps: close, not bitwise; the H200 test checks bits)
    (Case("rc-odd-bias", T=37, E=5, K=3, H=100, I=48, bias=True), "fp8_w8a8_channel"),
    (Case("rt-map", T=9, E=6, K=2, H=64, I=200, expert_map=True, tiles=((64, 64, 64, 4, 1), (64, 64, 64, 4, 1))),
     "fp8_w8a8_tensor"),
    (Case("rt-static", T=20, K=1), "fp8_w8a8_tensor_static"),
    (Case("rc-tail", T=30, E=5, K=2, H=64, I=352), "fp8_w8a8_channel"),
]


@pytest.mark.parametrize("case,scheme", ROWS_CASES, ids=[f"{c.id}-{s}" for c, s in ROWS_CASES])
def test_gemm2_rows_matches_tiled(case, scheme, monkeypatch):
    """FUSEDMOE_TRITON_GEMM2_ROWS=force gives moe_gemm2_kernel's output bit for bit (int8: exact
    int32 sums; fp8 block: the tiled kernel's 128-deep K steps; the same epilogue order; fp8 per
    row: within rounding here), and it did run (a spy on the launch)."""
    from fusedmoe.backends.triton import quant as tq

    config, x, w, weights, ids, expert_map = problem(case, scheme, torch.float32)
    if case.id == "r-one-expert":
        ids = torch.full_like(ids, 2)
    if scheme == "fp8_w8a8_block":  # the tiled kernel's N tile: numpy's fp32 dot sums in an order of its shapes
        from fusedmoe.backends.triton import experts

        for key in [k for k in experts.GEMM2_ROWS_CONFIG if k[0] == experts.W8A8_QUANT_CODES["block"]]:
            monkeypatch.setitem(experts.GEMM2_ROWS_CONFIG, key, dict(experts.GEMM2_ROWS_CONFIG[key], BLOCK_N=128))
    launches = []
    real = tq.launch_gemm2_rows
    monkeypatch.setattr(tq, "launch_gemm2_rows", lambda *a, **k: (launches.append(1), real(*a, **k)))
    with knobs.override(TRITON_GEMM2_ROWS=False):
        tiled = run(config, x, w, weights, ids, expert_map, case.tiles, direct=False)
    assert not launches
    with knobs.override(TRITON_GEMM2_ROWS="force"):
        rows = run(config, x, w, weights, ids, expert_map, case.tiles, direct=False)
    assert launches == [1]
    if scheme in ("int8_w8a8", "fp8_w8a8_block"):
        assert torch.equal(rows, tiled)
    else:
        assert rel_err(rows, tiled) < 1e-6
    # against emulation up to a code flip: the intermediate's dynamic int8 / fp8 codes come from GEMM1
    # sums in numpy's order here and torch's there, and which order a CPU's matmul takes depends on
    # its vector units (r-maxi-input-map flipped one code on one CI machine and none on others)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert_close_up_to_code_flips(rows, emulated)


def test_gemm2_rows_rule(monkeypatch):
    """Row-stationary where it was measured to win: int8 and fp8 per-row codes (chained) with
    I <= 384, fp8 block codes with I in (128, 384], the contiguous aligned path's 64+ row blocks
    over 4096+ slots, sm90; force lifts all but the codes, I and the path; 0 never."""
    from fusedmoe.backends.triton import quant

    int8, fp8 = QuantKey("int8", "token", dynamic=True), QuantKey("fp8", "token", dynamic=True)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(quant, "_sm90_gpu", lambda device: device.type == "cuda")
    rule = quant.gemm2_rows
    assert rule(int8, 256, 64, 8192, cuda) and rule(int8, 200, 128, 4096, cuda)
    assert rule(int8, 384, 64, 8192, cuda) and rule(int8, 257, 128, 8192, cuda)  # a head and a tail tile
    assert not rule(int8, 385, 64, 8192, cuda)  # past 256 + 128
    group = QuantKey("fp8", "group", 128, dynamic=True)
    assert rule(group, 256, 64, 8192, cuda) and rule(group, 129, 64, 8192, cuda)  # two 128-wide groups
    assert rule(group, 384, 64, 8192, cuda) and rule(group, 320, 64, 8192, cuda)  # a third in the tail
    assert not rule(group, 128, 64, 8192, cuda) and not rule(group, 385, 64, 8192, cuda)
    assert rule(fp8, 256, 64, 8192, cuda) and rule(QuantKey("fp8", "tensor"), 48, 64, 8192, cuda)
    assert not rule(fp8, 256, 64, 8192, cuda, promoted=True)  # K steps added in fp32: not one dot
    assert rule(fp8, 384, 64, 8192, cuda) and not rule(fp8, 400, 64, 8192, cuda)
    assert rule(QuantKey("fp8", "tensor", dynamic=True), 256, 64, 8192, cuda)
    assert not rule(int8, 256, 32, 8192, cuda) and not rule(int8, 256, 64, 4095, cuda)  # unmeasured
    assert not rule(int8, 256, 64, 8192, cpu)
    for flag in ("direct", "batched", "swapped"):
        assert not rule(int8, 256, 64, 8192, cuda, **{flag: True})
    with knobs.override(TRITON_GEMM2_ROWS=False):
        assert not rule(int8, 256, 64, 8192, cuda)
    with knobs.override(TRITON_GEMM2_ROWS="force"):
        assert rule(int8, 48, 16, 10, cpu) and rule(int8, 48, 16, 10, cpu, batched=True)
        assert not rule(int8, 768, 64, 8192, cpu) and not rule(int8, 48, 16, 10, cpu, direct=True)
        assert rule(fp8, 48, 16, 10, cpu) and not rule(int8, 48, 16, 10, cpu, swapped=True)
        assert not rule(fp8, 48, 16, 10, cpu, promoted=True)
    # the tiles it runs: one power-of-two tile, or a head and a tail; a config per row block
    from fusedmoe.backends.triton.experts import (
        W8A8_QUANT_CODES,
        gemm2_rows_config,
        gemm2_rows_split,
    )

    Q_CHANNEL, Q_BLOCK = W8A8_QUANT_CODES["channel"], W8A8_QUANT_CODES["block"]

    assert [gemm2_rows_split(i) for i in (4, 17, 48, 256, 257, 320, 384, 385, 768)] == [
        (32, 0), (32, 0), (64, 0), (256, 0), (256, 128), (256, 128), (256, 128), (512, 0), (512, 256)]
    # I = 4 ran a 4-deep 8-bit tl.dot, which Triton refuses to compile (K >= 32; GPU fuzz seed 90185)
    assert gemm2_rows_config(Q_CHANNEL, 384, 128) != gemm2_rows_config(Q_CHANNEL, 384, 64)
    assert gemm2_rows_config(Q_CHANNEL, 256, 128) == gemm2_rows_config(Q_CHANNEL, 256, 64)
    assert gemm2_rows_config(Q_BLOCK, 384, 64)["BLOCK_N"] <= 128  # within one weight scale block
    # `fusedmoe explain --tokens` says so (its tiles: the heuristic's, no table on the CPU host)
    from fusedmoe.backends.triton.experts import GemmProblem, describe_plan

    with knobs.override(TRITON_GEMM2_ROWS="force"):
        plan = describe_plan(GemmProblem(8192, 256, 7168, 256, 8, True, torch.bfloat16), get_scheme("int8_w8a8"), cpu)
    assert plan["path"] == "aligned" and "row-stationary" in plan["gemm2"]["rows"]
    with knobs.override(TRITON_GEMM2_ROWS="force"):  # Qwen3-235B TP4: a head and a tail tile
        plan = describe_plan(GemmProblem(8192, 128, 4096, 384, 8, True, torch.bfloat16), get_scheme("int8_w8a8"), cpu)
    assert "I as 256 + 128" in plan["gemm2"]["rows"]
    from fusedmoe.cli import format_plans

    shown = {k: ({**v, "tile": v["tile"].as_list()} if isinstance(v, dict) else v) for k, v in plan.items()}
    assert "row-stationary" in format_plans([dict(tokens=1024, device="cpu", **shown)])  # the explain line
    plan = describe_plan(GemmProblem(8192, 256, 7168, 256, 8, True, torch.bfloat16), get_scheme("int8_w8a8"), cpu)
    assert plan["gemm2"]["rows"] is None  # auto: not on a CPU


def test_swap_ab_rule(monkeypatch):
    """Swapped where it was measured to win: fp8 1x128 groups, the aligned path, row blocks under
    64 rows, N tiles >= 64, sm90."""
    from fusedmoe.backends.triton import quant

    group = QuantKey("fp8", "group", 128, dynamic=True)
    token, int8 = QuantKey("fp8", "token", dynamic=True), QuantKey("int8", "token", dynamic=True)
    cuda, tile = torch.device("cuda", 0), TileConfig(16, 128, 128, 4, 3)
    monkeypatch.setattr(quant, "_sm90_gpu", lambda device: device.type == "cuda")
    assert quant.swap_ab(tile, group, cuda)
    assert quant.swap_ab(TileConfig(32, 64, 128, 4, 3), group, cuda)
    assert not quant.swap_ab(tile, group, cuda, direct=True)
    assert not quant.swap_ab(TileConfig(64, 128, 128, 4, 3), group, cuda)  # wgmma runs it as is
    assert not quant.swap_ab(TileConfig(16, 32, 128, 4, 3), group, cuda)  # too few weight rows
    assert not quant.swap_ab(tile, token, cuda) and not quant.swap_ab(tile, int8, cuda)
    assert not quant.swap_ab(tile, group, torch.device("cpu"))
    with knobs.override(TRITON_SWAP_AB=False):
        assert not quant.swap_ab(tile, group, cuda)
    with knobs.override(TRITON_SWAP_AB="force"):
        assert quant.swap_ab(TileConfig(64, 32, 128, 4, 3), int8, torch.device("cpu"), direct=True)
    # a tuned tile's own swap_ab wins over the rule (not over the knob)
    assert quant.swap_ab(TileConfig(16, 128, 128, 4, 3, swap_ab=True), group, cuda, direct=True)
    assert not quant.swap_ab(TileConfig(16, 128, 128, 4, 3, swap_ab=False), group, cuda)
    with knobs.override(TRITON_SWAP_AB=False):
        assert not quant.swap_ab(TileConfig(16, 128, 128, 4, 3, swap_ab=True), group, cuda)
    monkeypatch.setattr(quant, "_sm90_gpu", lambda device: False)  # sm80 / sm100: as is
    assert not quant.swap_ab(tile, group, cuda)


@pytest.mark.parametrize("capability,hip,want", [((9, 0), None, True), ((8, 0), None, False),
                                                   ((10, 0), None, False), ((9, 4), "6.2", False)])
def test_swap_ab_device_predicate(monkeypatch, capability, hip, want):
    """SWAP_AB's device test: an NVIDIA sm90 GPU (its capability read once per device); not
    Ampere, Blackwell, ROCm (whose MI300 reports 9.4) or the CPU."""
    from fusedmoe.backends.triton import experts, quant

    experts.device_capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    try:
        assert quant._sm90_gpu(torch.device("cuda", 0)) is want
        assert quant._sm90_gpu(torch.device("cpu")) is False
    finally:
        experts.device_capability.cache_clear()


def test_activation_scales_checked_before_launch():
    """The experts op's own entry (below the layer's validation) checks the activation scales
    against the scheme before any kernel: static needs both, dynamic takes none."""
    import dataclasses

    config, x, w, weights, ids, _ = problem(Case("scales", T=2), "fp8_w8a8_tensor_static", torch.float32)
    no_a2 = dataclasses.replace(w, quant=dataclasses.replace(w.quant, a2_scale=None))
    with pytest.raises(ValueError, match="a2_scale is None but fp8_w8a8_tensor_static quantizes activations "
                                         "with a static scale"):
        run(config, x, no_a2, weights, ids, None)
    config, x, w, weights, ids, _ = problem(Case("scales", T=2), "fp8_w8a8_tensor", torch.float32)
    extra = dataclasses.replace(w, quant=dataclasses.replace(w.quant, a13_scale=torch.ones(1)))
    with pytest.raises(ValueError, match="a13_scale is set but fp8_w8a8_tensor has dynamic activation scales"):
        run(config, x, extra, weights, ids, None)


def test_direct_decode_refuses_per_tensor_w8a8():
    config, x, w, weights, ids, _ = problem(Case("direct-w8a8", T=2), "fp8_w8a8_tensor", torch.float32)
    with pytest.raises(ValueError, match="direct decode path cannot run this call: fp8_w8a8_tensor quantizes "
                                         "with one scale per expert"):
        run(config, x, w, weights, ids, None, None, direct=True)
    from fusedmoe.backends.triton.tiles import check_plan

    t = TileConfig(16, 64, 64, 4, 1)
    assert "per-tensor W8A8 has no direct path" in check_plan(t, t, direct=True, dtype=torch.float32, gated=True,
                                                              quant="tensor")
    assert check_plan(t, t, direct=True, dtype=torch.float32, gated=True, quant="block") is None


@pytest.mark.parametrize("scheme", W8A8 + WEIGHT_ONLY)
def test_fp16_matches_emulation(scheme):
    config, x, w, weights, ids, expert_map = problem(Case("fp16", bias=True, I=128 if scheme in WEIGHT_ONLY else 64), scheme, torch.float16)
    out = run(config, x, w, weights, ids, expert_map, Case.tiles)
    assert out.dtype == torch.float16
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert rel_err(out, emulated) < TOL[torch.float16]


@pytest.mark.parametrize("scheme", ["fp8_w8a8_tensor", "fp8_w8a8_block", "int4_w4a16_g32", "mxfp4_w4a16"])
def test_empty_experts_out_of_range_ids_and_determinism(scheme):
    case = Case("edges", T=5)
    config, x, w, weights, _, _ = problem(case, scheme, torch.float32)
    # expert 3 gets nothing, expert 1 most; -1 and E are out of range and contribute zero
    ids = torch.tensor([[1, 0], [1, -1], [1, 4], [2, 1], [7, -5]], dtype=torch.int32)
    out = run(config, x, w, weights, ids, None, case.tiles)
    keep = (ids >= 0) & (ids < 4)
    emulated = EmulationExperts(config).apply(x, w, weights * keep, ids.clamp(0, 3), expert_map_E=None)
    assert_matches_emulation(out, emulated, scheme)
    assert (out[4] == 0).all()
    assert torch.equal(out, run(config, x, w, weights, ids, None, case.tiles))
    empty = run(config, x[:0], w, weights[:0], ids[:0], None)
    assert empty.shape == (0, case.H)


def test_experts_class_heuristic_tiles_in_place_and_errors():
    config, x, w, weights, ids, _ = problem(Case("class", T=3, H=64, I=32), "int8_w8a8", torch.float32)
    experts = TritonExperts(config)
    out = experts.apply(x, w, weights, ids, expert_map_E=None)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert_close_up_to_code_flips(out, emulated)
    into = x.clone()
    assert experts.apply(into, w, weights, ids, expert_map_E=None, out_TH=into) is into
    assert torch.equal(into, out)
    other = TritonExperts(MoEConfig(4, 2, 64, 32, dtype=torch.float32, quant="fp8_w8a8_channel"))
    with pytest.raises(ValueError, match="weights.quant has scheme int8_w8a8 but the config says fp8_w8a8_channel"):
        other.apply(x, w, weights, ids, expert_map_E=None)
    q13, q2, p = quantize_weights(torch.randn(4, 64, 64), torch.randn(4, 64, 32), "mxfp4_w4a8")
    with pytest.raises(NotImplementedError, match="runs the W8A8 schemes .* not mxfp4_w4a8"):
        TritonExperts(MoEConfig(4, 2, 64, 32, dtype=torch.float32)).apply(
            x, ExpertWeights(q13, q2, quant=p), weights, ids, expert_map_E=None)
    with pytest.raises(ValueError, match=r"gemm1 tile .* cannot run fp8_w8a8_block: block_k=256"):
        run(*problem(Case("bad-tile"), "fp8_w8a8_block", torch.float32),
             tiles=((16, 64, 256, 4, 1), (16, 64, 64, 4, 1)))


def test_opcheck():
    # int8: the schema check multiplies inputs, which CPU torch lacks for float8
    config, x, w, weights, ids, _ = problem(Case("opcheck", T=3, H=64, I=32), "int8_w8a8", torch.float32)
    p = w.quant
    args = (x, w.w13, w.w2, weights, ids, None, None, None, 4, "silu", False, 1.702, None,
            "int8_w8a8", p.w13_scale, p.w2_scale, None, None)
    torch.library.opcheck(triton_quant_experts_op, args, test_utils=("test_schema", "test_faketensor"))
    out = torch.full_like(x, float("nan"))
    torch.library.opcheck(triton_quant_experts_out_op, (*args, out), test_utils=("test_schema", "test_faketensor"))
    triton_quant_experts_out_op(*args, out)
    torch.testing.assert_close(out, triton_quant_experts_op(*args), rtol=0, atol=0)


# The batched layout [L, max_tokens, H] ------------------------------------------------------
def _run_batched(config, x_LMH, counts, w, tiles=Case.tiles):
    p = w.quant
    return triton_batched_quant_experts(
        x_LMH, counts, w.w13, w.w2, w.w13_bias, w.w2_bias, config.activation, config.swiglu_alpha,
        config.swiglu_limit, p.scheme.name, p.w13_scale, p.w2_scale, p.a13_scale, p.a2_scale,
        tiles=None if tiles is None else tuple(TileConfig(*t) for t in tiles),
        w13_global_scale=p.w13_global_scale, w2_global_scale=p.w2_global_scale, w13_zero=p.w13_zero,
        w2_zero=p.w2_zero,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("scheme", W8A8 + ["int8_w8a16", "int4_w4a16_g32", "int4_w4a16_g32_zp", "mxfp4_w4a16",
                                    "nvfp4_w4a16"])
def test_batched_matches_contiguous_and_emulation(scheme, dtype):
    """dispatch -> batched W8A8 / weight-only -> combine equals the contiguous Triton path on the
    same tokens: the same codes and scales per expert (max_tokens 7: one partial BLOCK_M block per
    expert)."""
    case = Case("batched", T=7, E=4, K=2, bias=True)
    config, x, w, weights, ids, _ = problem(case, scheme, dtype)
    pf = BatchedLocalPrepareFinalize(case.E, weight_on_input=False)
    x_b, counts, handle = pf.dispatch(x, weights, ids, None, case.E)
    out = pf.combine(_run_batched(config, x_b, counts, w), handle)
    contiguous = run(config, x, w, weights, ids, None, case.tiles)
    assert rel_err(out, contiguous) < TOL[dtype]
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert_matches_emulation(out, emulated, scheme, dtype)


@pytest.mark.parametrize("scheme", W8A8 + ["fp8_w8a16", "int4_w4a16_g64", "nvfp4_w4a16"])
def test_batched_counts_and_rows_past_the_count(scheme):
    """Per expert: an empty one, a full one (max_tokens 20, not a multiple of BLOCK_M 16), and
    rows past each count holding huge values and NaN that must change nothing (dynamic per-tensor
    scales included): y[e, :n] equals emulation on the expert's n rows, y[e, n:] is zero."""
    gen = torch.Generator().manual_seed(zlib.crc32(scheme.encode()))
    L, M, H, I = 4, 20, 128, 64
    counts = torch.tensor([0, M, 3, 17], dtype=torch.int32)
    x = torch.randn(L, M, H, generator=gen)
    for e, n in enumerate(counts.tolist()):
        x[e, n:] = 1e4
        x[e, n + 1:n + 2] = float("nan")
    amax = (torch.tensor(4.0), torch.full((L,), 2.0)) if scheme.endswith("static") else None
    q13, q2, params = quantize_weights(torch.randn(L, 2 * I, H, generator=gen) / H**0.5,
                                       torch.randn(L, H, I, generator=gen) / I**0.5, scheme,
                                       activation_amax=amax)
    w = ExpertWeights(q13, q2, None, None, params)
    config = MoEConfig(L, 1, H, I, dtype=torch.float32, quant=scheme)
    y = _run_batched(config, x, counts, w)
    assert y.shape == (L, M, H)
    for e, n in enumerate(counts.tolist()):
        assert (y[e, n:] == 0).all()
        if n:
            ids = torch.full((n, 1), e, dtype=torch.int32)
            want = EmulationExperts(config).apply(x[e, :n], w, torch.ones(n, 1), ids, expert_map_E=None)
            assert_matches_emulation(y[e, :n], want, scheme)
    assert torch.equal(y, _run_batched(config, x, counts, w))  # deterministic
    assert _run_batched(config, x[:, :0], counts * 0, w).shape == (L, 0, H)


def test_batched_experts_class_through_modular_and_errors(monkeypatch):
    from fusedmoe.backends.triton import experts as experts_mod

    seen = []  # the tiles are chosen for the dispatch's T*K slots (experts.batched_problem)
    real = experts_mod.batched_problem
    monkeypatch.setattr(experts_mod, "batched_problem", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    # heuristic tiles, router weight on input (top-1): the dispatch scales x before quantization
    case = Case("batched-class", T=5, H=64, I=32, K=1, on_input=True)
    config, x, w, weights, ids, _ = problem(case, "int8_w8a8", torch.float32)
    config = MoEConfig(case.E, 1, case.H, case.I, dtype=torch.float32, quant="int8_w8a8",
                       apply_router_weight_on_input=True, activation_format="batched")
    out = make_modular(config, BatchedTritonExperts(config))(x, w, weights, ids)
    assert [(p.num_slots, p.top_k) for p in seen] == [(5, 1)]
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert_close_up_to_code_flips(out, emulated)
    x_b = torch.randn(case.E, 3, case.H)
    counts = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    other = BatchedTritonExperts(MoEConfig(4, 1, 64, 32, dtype=torch.float32, quant="fp8_w8a8_channel",
                                           activation_format="batched"))
    with pytest.raises(ValueError, match="weights.quant has scheme int8_w8a8 but the config says fp8_w8a8_channel"):
        other.apply_batched(x_b, counts, w)
    q13, q2, p = quantize_weights(torch.randn(4, 64, 64), torch.randn(4, 64, 32), "nvfp4")
    with pytest.raises(NotImplementedError, match=r"weight-only schemes \[.*\], not nvfp4"):
        BatchedTritonExperts(config).apply_batched(x_b, counts, ExpertWeights(q13, q2, quant=p))
    # weight-only through the experts class and the modular kernel (nvfp4: global scales)
    case = Case("batched-class-wo", T=5, H=64, I=32, K=2)
    config, x, w, weights, ids, _ = problem(case, "nvfp4_w4a16", torch.float32)
    config = MoEConfig(case.E, case.K, case.H, case.I, dtype=torch.float32, quant="nvfp4_w4a16",
                       activation_format="batched")
    out = make_modular(config, BatchedTritonExperts(config))(x, w, weights, ids)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    assert rel_err(out, emulated) < TOL[torch.float32]
    assert [(p.num_slots, p.top_k) for p in seen[-1:]] == [(10, 2)]


def test_batched_traces_fullgraph():
    """The dispatch, the custom op (its fake) and the combine trace without graph breaks."""
    case = Case("batched-compile", T=5, H=128, I=64)
    config, x, w, weights, ids, _ = problem(case, "fp8_w8a8_block", torch.float32)
    config = MoEConfig(case.E, case.K, case.H, case.I, dtype=torch.float32, quant="fp8_w8a8_block",
                       activation_format="batched")
    kernel = make_modular(config, BatchedTritonExperts(config))
    eager = kernel(x, w, weights, ids)
    compiled = torch.compile(lambda x, weights, ids: kernel(x, w, weights, ids), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, weights, ids), eager)


def test_batched_opcheck():
    # int8: the schema check multiplies inputs, which CPU torch lacks for float8
    gen = torch.Generator().manual_seed(45)
    q13, q2, p = quantize_weights(torch.randn(3, 64, 64, generator=gen) / 8, torch.randn(3, 64, 32, generator=gen) / 6,
                                  "int8_w8a8")
    args = (torch.randn(3, 5, 64, generator=gen), torch.tensor([5, 0, 2], dtype=torch.int32), q13, q2, None,
            None, "silu", 1.702, None, "int8_w8a8", p.w13_scale, p.w2_scale, None, None)
    torch.library.opcheck(triton_batched_quant_experts_op, args, test_utils=("test_schema", "test_faketensor"))


# Tiles ---------------------------------------------------------------------------------------
def test_check_tile_quant_reasons():
    assert "block_k=16: 8-bit tl.dot needs block_k >= 32" in check_tile(
        TileConfig(16, 64, 16), dtype=torch.bfloat16, quant="channel")
    assert "need both to divide 128" in check_tile(TileConfig(16, 256, 64), dtype=torch.bfloat16, quant="block")
    assert "need both to divide 128" in check_tile(TileConfig(16, 64, 256), dtype=torch.bfloat16, quant="block")
    assert check_tile(TileConfig(16, 64, 256), dtype=torch.bfloat16, quant="channel") is None
    assert check_tile(TileConfig(16, 128, 128, 4, 3, 4), dtype=torch.bfloat16, quant="block", allow_split=True) is None
    assert "quant='group'" in check_tile(TileConfig(16, 64, 64), dtype=torch.bfloat16, quant="group")


@pytest.mark.parametrize("quant,codes", [("tensor", "fp8"), ("channel", "fp8"), ("channel", "int8"), ("block", "fp8")])
def test_heuristic_quant_tiles_are_valid(quant, codes):
    for slots in (1, 7, 64, 1000, 32768, 10**6):
        for experts in (1, 8, 128, 256):
            for n, k, gated in ((256, 7168, True), (7168, 256, False), (1792, 4096, True), (37, 200, False)):
                tile = heuristic(slots, experts, n, k, torch.bfloat16, gated=gated, quant=quant, codes=codes)
                assert check_tile(tile, dtype=torch.bfloat16, operands=2 if gated else 1,
                                  allow_split=gated, quant=quant) is None, tile


def test_int8_heuristic_for_larger_blocks():
    """int8 W8A8 past 16-row blocks (H200 A/B in tiles.heuristic): 64-row blocks at 17-32 rows
    per expert, GEMM2 128 wide, 3 stages at 128 rows; fp8 channel: GEMM2 128 wide (its chained
    accumulator), 4 stages and 32-row blocks kept."""
    def tiles(codes, tokens, experts, top_k, hidden, inter):
        return (heuristic(tokens * top_k, experts, 2 * inter, hidden, torch.bfloat16, gated=True, quant="channel",
                          codes=codes),
                heuristic(tokens * top_k, experts, hidden, inter, torch.bfloat16, gated=False, quant="channel",
                          codes=codes))

    ds, qwen = (256, 8, 7168, 256), (128, 8, 2048, 768)
    g1, g2 = tiles("int8", 1024, *ds)  # 32 rows per expert
    assert (g1.block_m, g2.block_m, g2.block_n) == (64, 64, 128)
    g1, g2 = tiles("int8", 4096, *qwen)  # 256 rows per expert
    assert (g1.as_list(), g2.as_list()) == ([128, 64, 128, 8, 3, 1], [128, 128, 128, 8, 3, 1])
    g1, g2 = tiles("fp8", 4096, *qwen)
    assert (g1.as_list(), g2.as_list()) == ([128, 64, 128, 8, 4, 1], [128, 128, 128, 8, 4, 1])
    assert tiles("fp8", 1024, *ds)[0].block_m == 32
    assert tiles("int8", 16, *qwen) == tiles("fp8", 16, *qwen)  # 16-row blocks: one rule


def test_decode_gemm1_rule_for_narrow_weights():
    """16-row GEMM1 over 4-bit weights, and over fp8 block / w8 weights where the bf16 rule would
    take 16-wide tiles, runs 64-wide tiles with K split until ~3 working programs per SM (H200
    measurements in tiles._narrow_decode); other 8-bit tiles keep the bf16 rule."""
    def tile(quant, tokens, experts, top_k, hidden, inter):
        return heuristic(tokens * top_k, experts, inter, hidden, torch.bfloat16, gated=True, quant=quant,
                         group=32 if quant == "w4" else None)

    ds, qwen, gpt_oss = (256, 8, 7168, 256), (128, 8, 2048, 768), (128, 4, 2880, 2880)
    for quant in ("w4", "block", "w8"):
        t = tile(quant, 1, *ds)  # 8 experts x 4 tiles = 32 working programs -> 8 shares
        assert (t.block_n, t.block_k, t.split_k) == (64, 128, 8), (quant, t)
        t = tile(quant, 1, *qwen)  # 96 programs -> 4 shares (768 would be past 3 per SM)
        assert (t.block_n, t.split_k) == (64, 4), (quant, t)
    assert tile("w4", 1, *gpt_oss).split_k == 2
    for quant in ("block", "w8", "channel"):  # 32 wide by the bf16 rule: unchanged
        assert tile(quant, 1, *gpt_oss).block_n == 32
    assert tile("channel", 1, *ds).block_n == 16  # int8 W8A8 (and fp8 channel): the bf16 rule
    assert tile("w4", 1, 8, 2, 4096, 14336).split_k == 1  # Mixtral: 448 programs unsplit


def test_four_bit_tiles_past_16_row_blocks():
    """4-bit GEMMs over 32-row and larger blocks take 128-wide tiles in 3 stages, 8 warps from 128
    rows (H200 grid and old / new A/B in tiles.heuristic), 128 deep but where the K-step rule takes
    64 (4 warps: GEMM2; GEMM1 over fragments at 64 rows, over the checkpoint layout at 32, K not a
    multiple of 128); 16-row blocks keep the narrow decode rule. Over fragments 32-row blocks up to
    32 rows an expert take the fragment rule instead (test_triton.py)."""
    for tokens, experts, top_k, hidden, inter, block_m, warps, k_steps in (
            (256, 8, 2, 4096, 14336, 64, 4, {False: (128, 64), True: (64, 64)}),  # Mixtral M=256: 64 rows per expert
            (1024, 128, 8, 2048, 768, 64, 4, {False: (128, 64), True: (64, 64)}),  # Qwen3-30B M=1024
            (1024, 128, 4, 2880, 2880, 32, 4, {False: (64, 64)}),  # gpt-oss M=1024 (H % 128)
            (512, 128, 8, 2048, 768, 32, 4, {False: (64, 64)}),   # Qwen3-30B M=512
            (4096, 128, 8, 2048, 768, 128, 8, {False: (128, 128), True: (128, 128)})):  # Qwen3-30B M=4096
        for fragments, (k1, k2) in k_steps.items():
            for n, k, gated, block_k in ((inter, hidden, True, k1), (hidden, inter, False, k2)):
                t = heuristic(tokens * top_k, experts, n, k, torch.bfloat16, gated=gated, quant="w4", group=32,
                              fragments=fragments)
                assert (t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, t.split_k) == \
                    (block_m, 128, block_k, warps, 3, 1), (tokens, experts, gated, fragments, t)
    assert heuristic(256 * 8, 128, 768, 2048, torch.bfloat16, gated=True, quant="w4", group=32).block_n == 64


def test_recording_runs_the_named_kernels():
    """kernel_report.recording(run=True, only=...) records the named launches and still runs them
    (benchmarks/bench_row_stationary.py times a recorded GEMM2 on its tensors): the call's output
    is unchanged; run=True without `only` is refused (helpers replaced by recorders could not run)."""
    from fusedmoe.backends.triton import kernel_report

    config, x, w, weights, ids, expert_map = problem(Case("rec", T=20), "int8_w8a8", torch.float32)
    plain = run(config, x, w, weights, ids, expert_map, Case.tiles, direct=False)
    with kernel_report.recording(run=True, only=("moe_gemm2_kernel",)) as calls:
        recorded = run(config, x, w, weights, ids, expert_map, Case.tiles, direct=False)
    assert [c.name for c in calls] == ["moe_gemm2_kernel"]
    assert torch.equal(recorded, plain)
    with pytest.raises(ValueError, match="needs `only`"), kernel_report.recording(run=True):
        pass
