"""The Triton backend's weight-only schemes on the CPU, through the Triton interpreter (fp32/fp16).

The experts against the `emulation` backend and the reference on dequantized weights (the same
math here: weight-only schemes leave activations unquantized), on the edge cases of the kernels'
K loop (partial K steps, odd N, split-K), the routing edges, and the tile predicate.
Tiles are given explicitly where the heuristic's would make many small programs: the
interpreter's cost is per program and op.
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import pytest
import torch

if torch.cuda.is_available():  # these build CPU tensors for the interpreter; GPUs run test_gpu_wo.py
    pytest.skip("interpreter tests (CPU); on a GPU see tests/test_gpu_wo.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fusedmoe import MoEConfig, fused_experts_ref, select_experts  # noqa: E402
from fusedmoe.backends.emulation import EmulationExperts  # noqa: E402
from fusedmoe.backends.triton.experts import TritonExperts  # noqa: E402
from fusedmoe.backends.triton.quant import triton_quant_experts, triton_quant_experts_op  # noqa: E402
from fusedmoe.backends.triton.tiles import TileConfig, check_tile, heuristic  # noqa: E402
from fusedmoe.modular import ExpertWeights  # noqa: E402
from fusedmoe.quant import QuantParams  # noqa: E402
from fusedmoe.quant.weights import dequantize_weights, quantize_weights  # noqa: E402

WEIGHT_ONLY = ["fp8_w8a16", "int8_w8a16", "int4_w4a16_g32", "int4_w4a16_g64", "int4_w4a16_g128",
               "mxfp4_w4a16", "nvfp4_w4a16"]
# Triton vs emulation / the reference on dequantized weights: the same float math. fp32: only the
# summation order differs (ieee dots). fp16: the dequantized weights are rounded to fp16 (exact
# for 8-bit codes and e2m1 * 2^s; 2^-11 relative for scaled int4 / nvfp4), and so are the
# intermediate and y per slot (the reference keeps fp32): measured 3.9e-4 to 5.7e-4.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Small tensors on 2 busy cores: intra-op threading only adds overhead (see test_quant.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(out, ref):
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@dataclass(frozen=True)
class Case:
    id: str
    T: int = 6
    E: int = 4
    K: int = 2
    H: int = 128
    I: int = 128
    activation: str = "silu"
    bias: bool = False
    on_input: bool = False
    expert_map: bool = False
    tiles: tuple[tuple, tuple] | None = ((16, 64, 64, 4, 1), (16, 128, 64, 4, 1))


CASES = [  # (case, schemes): the paths each case exercises differently
    (Case("basic"), WEIGHT_ONLY),
    (Case("gelu-bias", activation="gelu", bias=True), ["int8_w8a16", "int4_w4a16_g32", "nvfp4_w4a16"]),
    (Case("swigluoai-bias", activation="swigluoai", bias=True), ["mxfp4_w4a16", "fp8_w8a16"]),
    (Case("top1-weight-on-input", K=1, T=8, bias=True, on_input=True), ["int4_w4a16_g64", "nvfp4_w4a16"]),
    (Case("expert-map", T=7, E=6, K=3, bias=True, expert_map=True), ["fp8_w8a16", "int4_w4a16_g32", "mxfp4_w4a16"]),
    # N not a multiple of BLOCK_N, K not of BLOCK_K (partial K steps of whole groups)
    (Case("relu2-partial-tiles", activation="relu2_no_mul", H=80, I=48), ["nvfp4_w4a16"]),
    (Case("partial-tiles", H=96, I=160), ["int4_w4a16_g32", "mxfp4_w4a16"]),
    (Case("odd-n", H=100, I=37, tiles=((16, 32, 32, 4, 1), (16, 64, 32, 4, 1))), ["int8_w8a16", "fp8_w8a16"]),
    # a K step inside one group (BLOCK_K 32 < 128) and a split that starts mid-group
    (Case("split-k", H=256, tiles=((16, 64, 32, 4, 1, 4), (16, 128, 32, 4, 1))),
     ["int4_w4a16_g128", "nvfp4_w4a16", "fp8_w8a16"]),
]


def _problem(case: Case, scheme: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.id}{scheme}".encode()))
    rows = case.I if case.activation.endswith("no_mul") else 2 * case.I
    num_local, expert_map = case.E, None
    if case.expert_map:  # this rank holds experts 0, 2, 4, ...; others contribute zero
        local = list(range(0, case.E, 2))
        num_local = len(local)
        expert_map = torch.full((case.E,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(num_local, dtype=torch.int32)
    x = torch.randn(case.T, case.H, generator=gen).to(dtype)
    w13 = torch.randn(num_local, rows, case.H, generator=gen) / case.H**0.5
    w2 = torch.randn(num_local, case.H, case.I, generator=gen) / case.I**0.5
    b13 = torch.randn(num_local, rows, generator=gen).to(dtype) * 0.1 if case.bias else None
    b2 = torch.randn(num_local, case.H, generator=gen).to(dtype) * 0.1 if case.bias else None
    weights, ids = select_experts(x, torch.randn(case.T, case.E, generator=gen), case.K,
                                  renormalize=not case.on_input)
    q13, q2, params = quantize_weights(w13, w2, scheme)
    config = MoEConfig(case.E, case.K, case.H, case.I, dtype=dtype, activation=case.activation,
                       has_bias=case.bias, quant=scheme, apply_router_weight_on_input=case.on_input,
                       has_expert_map=case.expert_map)
    return config, x, ExpertWeights(q13, q2, b13, b2, params), weights, ids, expert_map


def _run(config, x, w, weights, ids, expert_map, tiles=None, out=None):
    p = w.quant
    return triton_quant_experts(
        x, w.w13, w.w2, weights, ids, w.w13_bias, w.w2_bias, expert_map, config.num_experts,
        config.activation, config.apply_router_weight_on_input, config.swiglu_alpha,
        config.swiglu_limit, p.scheme.name, p.w13_scale, p.w2_scale,
        tiles=None if tiles is None else tuple(TileConfig(*t) for t in tiles), out=out,
        w13_global_scale=p.w13_global_scale, w2_global_scale=p.w2_global_scale,
    )


def _dequantized_reference(config, x, w, weights, ids, expert_map):
    d13, d2 = dequantize_weights(w.w13, w.w2, w.quant)
    return fused_experts_ref(
        x.double(), d13.double(), d2.double(), weights, ids, activation=config.activation,
        apply_router_weight_on_input=config.apply_router_weight_on_input, expert_map_E=expert_map,
        global_num_experts=config.num_experts, swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        w13_bias_LG=None if w.w13_bias is None else w.w13_bias.double(),
        w2_bias_LH=None if w.w2_bias is None else w.w2_bias.double(),
    )


@pytest.mark.parametrize("case,scheme", [(c, s) for c, schemes in CASES for s in schemes],
                         ids=[f"{c.id}-{s}" for c, schemes in CASES for s in schemes])
def test_schemes_match_emulation_and_reference(case, scheme):
    config, x, w, weights, ids, expert_map = _problem(case, scheme, torch.float32)
    out = _run(config, x, w, weights, ids, expert_map, case.tiles)
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert rel_err(out, emulated) < TOL[torch.float32]
    assert rel_err(out, _dequantized_reference(config, x, w, weights, ids, expert_map)) < TOL[torch.float32]
    if expert_map is not None:  # tokens whose slots are all remote get exactly zero
        remote = (expert_map[ids.long()] < 0).all(-1)
        assert (out[remote] == 0).all()


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_fp16_matches_emulation(scheme):
    config, x, w, weights, ids, expert_map = _problem(Case("fp16", bias=True), scheme, torch.float16)
    out = _run(config, x, w, weights, ids, expert_map, Case.tiles)
    assert out.dtype == torch.float16
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert rel_err(out, emulated) < TOL[torch.float16]


@pytest.mark.parametrize("scheme", ["int4_w4a16_g32", "mxfp4_w4a16"])
def test_empty_experts_out_of_range_ids_and_determinism(scheme):
    case = Case("edges", T=5)
    config, x, w, weights, _, _ = _problem(case, scheme, torch.float32)
    # expert 3 gets nothing, expert 1 most; -1 and E are out of range and contribute zero
    ids = torch.tensor([[1, 0], [1, -1], [1, 4], [2, 1], [7, -5]], dtype=torch.int32)
    out = _run(config, x, w, weights, ids, None, case.tiles)
    keep = (ids >= 0) & (ids < 4)
    emulated = EmulationExperts(config).apply(x, w, weights * keep, ids.clamp(0, 3), expert_map_E=None)
    assert rel_err(out, emulated) < TOL[torch.float32]
    assert (out[4] == 0).all()
    assert torch.equal(out, _run(config, x, w, weights, ids, None, case.tiles))
    empty = _run(config, x[:0], w, weights[:0], ids[:0], None)
    assert empty.shape == (0, case.H)


def test_experts_class_heuristic_tiles_in_place_and_errors():
    config, x, w, weights, ids, _ = _problem(Case("class", T=3, H=64, I=32), "nvfp4_w4a16", torch.float32)
    experts = TritonExperts(config)
    assert experts.process_weights(w) is w  # the kernels read the checkpoint packing as stored
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
        _run(*_problem(Case("bad-tile"), "int4_w4a16_g32", torch.float32),
             tiles=((16, 64, 16, 4, 1), (16, 64, 64, 4, 1)))


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
    config, x, w, weights, ids, _ = _problem(Case("opcheck", T=3, H=64, I=32), "int4_w4a16_g32", torch.float32)
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
                    tile = heuristic(slots, experts, n, k, dtype, gated=gated, quant=mode, group=group)
                    assert check_tile(tile, dtype=dtype, operands=2 if gated else 1, allow_split=gated,
                                      quant=mode, group=group) is None, tile
