"""The Triton backend's logic on the CPU, through the Triton interpreter (fp32/fp16, small sizes).

bf16 is not tested here: the interpreter's bf16 tl.dot multiplies raw bit patterns
(triton-lang/triton#11584); bf16 runs in tests/test_gpu.py on a GPU.
"""

from __future__ import annotations

import functools
import os
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

if torch.cuda.is_available():  # these build CPU tensors for the interpreter; GPUs run test_gpu.py
    pytest.skip("interpreter tests (CPU); on a GPU see tests/test_gpu.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fusedmoe import MoEConfig, fused_experts_ref, knobs, select_experts  # noqa: E402
from fusedmoe.activations import is_gated  # noqa: E402
from fusedmoe.backends.triton import experts as experts_mod  # noqa: E402
from fusedmoe.backends.triton.experts import (  # noqa: E402
    ALIGN_CHUNKED_MAX_SLOTS,
    ALIGN_SMALL_MAX_SLOTS,
    _align_chunked,
    _align_multi,
    _align_small,
    align_torch,
    triton_experts,
    triton_experts_op,
    triton_experts_out_op,
)
from fusedmoe.backends.triton.tiles import TileConfig, check_tile, heuristic  # noqa: E402
from fusedmoe.modular import ExpertWeights  # noqa: E402

DEVICE = "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: ~2^-11 per rounding, a few roundings deep


def rel_err(out, ref):
    assert out.shape == ref.shape and not torch.isnan(out).any()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# Alignment -----------------------------------------------------------------------------------------
# Chunks of 16 slots: the interpreter sorts ~1024 slots a second, so multi-chunk cases stay small.
# The multi-program offsets sum 32 counts a step: 2 chunks x 16 experts, so both loops run.
ALIGNS = {"torch": align_torch, "one-program": _align_small,
          "chunked": functools.partial(_align_chunked, chunk=16),
          "multi": functools.partial(_align_multi, chunk=16, offsets_tile=32)}


@pytest.mark.parametrize("align", ALIGNS.values(), ids=ALIGNS.keys())
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("use_map", [False, True])
def test_align_sorts_pads_and_drops(block_m, use_map, align):
    gen = torch.Generator().manual_seed(block_m + use_map)
    num_global, top_k, tokens = 9, 3, 23
    ids = torch.stack([torch.randperm(num_global, generator=gen)[:top_k] for _ in range(tokens)]).int()
    ids[0, 0], ids[1, 1] = -1, num_global  # out of range: must be dropped, never indexed
    expert_map = None
    num_local = num_global
    if use_map:
        expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, -1, 5], dtype=torch.int32)
        num_local = 6
    sorted_slot, block_expert, num_rows, slot_ok = align(ids, expert_map, num_global, num_local, block_m)
    n = ids.numel()
    assert sorted_slot.numel() % block_m == 0 and block_expert.numel() == sorted_slot.numel() // block_m
    rows = int(num_rows)
    # every valid slot appears exactly once, in a block of its own expert, in increasing slot order
    flat = ids.flatten().long()
    valid = (flat >= 0) & (flat < num_global)
    local = torch.where(valid, flat, torch.zeros_like(flat))
    if expert_map is not None:
        local = expert_map.long()[local]
        valid &= local >= 0
    assert torch.equal(slot_ok.bool(), valid)
    seen = sorted_slot[:rows][sorted_slot[:rows] < n].long()
    assert sorted(seen.tolist()) == torch.nonzero(valid).flatten().tolist()
    assert (sorted_slot[rows:] == n).all()
    for b in range(rows // block_m):
        blk = sorted_slot[b * block_m:(b + 1) * block_m].long()
        real = blk[blk < n]
        assert real.numel() > 0, "a block in use holds at least one slot"
        assert (local[real] == block_expert[b]).all()
        assert torch.equal(real, real.sort().values), "stable: slots keep their order"
    counts = torch.bincount(local[valid], minlength=num_local)
    assert rows == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize("align", ["torch", "chunked", "multi"])
def test_align_is_deterministic(align):
    align = ALIGNS[align]
    ids = torch.randint(0, 16, (30, 4), generator=torch.Generator().manual_seed(1)).int()
    first = align(ids, None, 16, 16, 16)
    for _ in range(2):
        again = align(ids, None, 16, 16, 16)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("n,num_local,path", [
    (ALIGN_SMALL_MAX_SLOTS, 8, "small"), (ALIGN_SMALL_MAX_SLOTS + 1, 8, "chunked"),
    (ALIGN_CHUNKED_MAX_SLOTS, 4095, "chunked"),
    (ALIGN_CHUNKED_MAX_SLOTS + 1, 8, "multi"), (2**20, 4096, "multi"), (100, 4096, "chunked"),
    (100, 4097, "torch"), (2**20, 4097, "torch"),
])
def test_align_routes_by_slots_and_experts(monkeypatch, n, num_local, path):
    from fusedmoe.backends.triton import experts

    for name, fn in (("small", "_align_small"), ("chunked", "_align_chunked"), ("multi", "_align_multi"),
                     ("torch", "align_torch")):
        monkeypatch.setattr(experts, fn, lambda *args, name=name: name)
    assert experts.align(torch.zeros(n, 1, dtype=torch.int32), None, num_local, num_local, 64) == path


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 8, 128), (16, 8, 256), (13, 6, 7), (32, 8, 60), (3, 4, 4)])
def test_one_program_align_equals_torch_align(tokens, top_k, experts):
    gen = torch.Generator().manual_seed(tokens * experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    expert_map = torch.randperm(experts, generator=gen).int()
    expert_map[::3] = -1
    for emap, num_local in ((None, experts), (expert_map, experts)):
        for block_m in (16, 64):
            got = _align_small(ids, emap, experts, num_local, block_m)
            want = align_torch(ids, emap, experts, num_local, block_m)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@dataclass(frozen=True)
class AlignCase:
    name: str
    tokens: int
    top_k: int
    num_global: int
    block_m: int
    chunk: int
    ids: str = "random"  # random | one-expert | few-experts
    bad_ids: bool = False  # -1 and num_global among the ids: dropped, never indexed


ALIGN_CASES = [
    AlignCase("n-not-multiple-of-chunk", 37, 3, 9, 16, 16, bad_ids=True),
    AlignCase("n-below-chunk", 5, 2, 100, 64, 64),  # E > N: most experts empty
    AlignCase("several-chunks-e13", 24, 4, 13, 128, 16, bad_ids=True),
    AlignCase("one-expert", 40, 1, 6, 16, 16, ids="one-expert"),  # one run across every chunk
    AlignCase("empty-experts", 20, 2, 64, 64, 8, ids="few-experts"),
    AlignCase("e1", 50, 1, 1, 64, 16, bad_ids=True),  # 4 chunks, one expert; the map keeps it
    AlignCase("e-above-n-chunks", 20, 2, 300, 16, 8, bad_ids=True),  # 5 chunks, 300 (200) experts
]


def align_ids(case: AlignCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    shape = (case.tokens, case.top_k)
    if case.ids == "one-expert":
        ids = torch.full(shape, case.num_global // 2, dtype=torch.int32)
    elif case.ids == "few-experts":
        ids = torch.tensor([3, 17, 40], dtype=torch.int32)[torch.randint(0, 3, shape, generator=gen)]
    else:
        ids = torch.randint(0, case.num_global, shape, generator=gen).int()
    if case.bad_ids:
        ids.view(-1)[torch.randperm(ids.numel(), generator=gen)[:6]] = torch.tensor(
            [-1, case.num_global, -1, case.num_global + 5, -7, case.num_global], dtype=torch.int32)
    return ids


@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("use_map", [False, True], ids=["no-map", "map"])
@pytest.mark.parametrize("path", ["chunked", "multi"])
def test_chunk_aligns_equal_torch_align(case, use_map, path):
    ids = align_ids(case)
    expert_map, num_local = None, case.num_global
    if use_map:  # every third expert lives on another rank; the rest are renumbered
        owned = torch.arange(case.num_global) % 3 != 1
        expert_map = torch.where(owned, owned.cumsum(0) - 1, -1).int()
        num_local = int(owned.sum())
    align = {"chunked": functools.partial(_align_chunked, chunk=case.chunk),
             "multi": functools.partial(_align_multi, chunk=case.chunk, offsets_tile=32)}[path]
    got = align(ids, expert_map, case.num_global, num_local, case.block_m)
    want = align_torch(ids, expert_map, case.num_global, num_local, case.block_m)
    for name, a, b in zip(("sorted_slot", "block_expert", "num_rows", "slot_ok"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


# Tiles -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_heuristic_tiles_are_valid(dtype):
    for slots in (1, 7, 64, 1000, 32768, 10**6):
        for experts in (1, 8, 128, 512):
            for n, k, gated in ((256, 7168, True), (14336, 4096, True), (4096, 14336, False), (37, 65, False)):
                tile = heuristic(slots, experts, n, k, dtype, gated=gated)
                assert check_tile(tile, dtype=dtype, operands=2 if gated else 1, allow_split=gated) is None, tile


def test_heuristic_for_a_given_block_m():
    """`fusedmoe tune` starts other block sizes from heuristic(block_m=): that block size, the rest
    picked for it, a valid tile; None keeps the heuristic's own."""
    for block_m in (16, 32, 64, 128):
        for quant in (None, "channel", "block"):
            if quant == "block" and block_m > 64:
                continue
            for n, k, gated in ((14336, 4096, True), (4096, 14336, False)):
                tile = heuristic(128, 8, n, k, torch.bfloat16, gated=gated, quant=quant, block_m=block_m)
                assert tile.block_m == block_m
                assert check_tile(tile, dtype=torch.bfloat16, operands=2 if gated else 1, allow_split=gated,
                                  quant=quant) is None, tile
    assert heuristic(128, 8, 14336, 4096, torch.bfloat16, gated=True, block_m=None) == \
        heuristic(128, 8, 14336, 4096, torch.bfloat16, gated=True)
    # Mixtral M=64 (16 rows per expert): 16-row tiles by default, 32-row ones picked for 32 rows
    assert heuristic(128, 8, 14336, 4096, torch.bfloat16, gated=True).block_m == 16
    assert heuristic(128, 8, 14336, 4096, torch.bfloat16, gated=True, block_m=32).block_k == 64
    for bad in (8, 24):
        with pytest.raises(ValueError, match=f"block_m={bad} must be a power of two >= 16"):
            heuristic(128, 8, 14336, 4096, torch.bfloat16, gated=True, block_m=bad)


def test_w4_heuristic_k_steps():
    """4-bit weight-only tiles past 16 rows (H200 A/B, tiles.heuristic): 64-deep K steps at 4 warps
    for GEMM2, for GEMM1 over fragments at 64 rows, over the checkpoint layout at 32, and where K
    is not a multiple of 128; 128 otherwise, and at 8 warps (128-row blocks)."""
    def k_step(block_m, k, gated, fragments):
        tile = heuristic(4096, 128, 1536, k, torch.bfloat16, gated=gated, quant="w4", group=32, block_m=block_m,
                         fragments=fragments)
        assert check_tile(tile, dtype=torch.bfloat16, operands=2 if gated else 1, allow_split=gated, quant="w4",
                          group=32) is None, tile
        return tile.block_k

    assert [k_step(m, 2048, True, True) for m in (32, 64, 128)] == [64, 64, 128]  # 32: the one-dot rule (below)
    assert [k_step(m, 2048, True, False) for m in (32, 64, 128)] == [64, 128, 128]
    assert [k_step(m, 2880, True, f) for m in (32, 64) for f in (True, False)] == [64] * 4  # gpt-oss H
    assert [k_step(m, 768, False, f) for m in (32, 64, 128) for f in (True, False)] == [64] * 4 + [128] * 2


def test_w4_fragment_heuristic_runs_the_tuners_decode_plans():
    """Over 4-bit fragments at 16- and 32-row blocks the heuristic gives the plans `fusedmoe tune`
    picked at Qwen3-30B / DeepSeek-V3 (sixty-seventh session): GEMM1 one dot over gate and up,
    GEMM2 128 wide, 64 deep where a K step holds two scale groups; 32-row blocks from 13 rows per
    expert, up to 32 rows an expert. Not over the checkpoint layout, not where GEMM1 splits K, not
    past 32-row blocks."""
    bf16 = torch.bfloat16

    def plan(slots, experts, inter, hidden, group=32, fragments=True):
        kw = dict(num_sms=132, quant="w4", group=group, fragments=fragments)
        t1 = heuristic(slots, experts, inter, hidden, bf16, gated=True, **kw)
        t2 = heuristic(slots, experts, hidden, inter, bf16, gated=False, **kw)
        assert check_tile(t1, dtype=bf16, operands=2, allow_split=True, quant="w4", group=group) is None, t1
        assert check_tile(t2, dtype=bf16, operands=1, quant="w4", group=group) is None, t2
        return t1, t2

    # Qwen3-30B M=16 (1 row an expert): 16 x 2*64 x 128 one-dot GEMM1, 16 x 128 x 64 GEMM2 (g32)
    assert plan(128, 128, 768, 2048) == (TileConfig(16, 64, 128, 4, 4, one_dot=True), TileConfig(16, 128, 64, 4, 4))
    assert plan(128, 128, 768, 2048, group=128)[1] == TileConfig(16, 128, 128, 4, 4)  # one group a K step
    # past W4_LONG_K (Mixtral I = 14336) GEMM2 steps 128 deep at any group and block; Llama-4's 8192 is not past it
    assert plan(32, 8, 14336, 4096)[1] == TileConfig(16, 128, 128, 4, 4)
    assert plan(128, 8, 14336, 4096)[1] == TileConfig(32, 128, 128, 4, 4)
    assert plan(16, 128, 8192, 5120)[1] == TileConfig(16, 128, 64, 4, 4)
    # Qwen3-30B M=256: 16 rows an expert -> 32-row blocks; DeepSeek-V3 TP8 M=256 (8 rows) keeps 16
    assert plan(2048, 128, 768, 2048) == (TileConfig(32, 128, 64, 4, 4, one_dot=True), TileConfig(32, 128, 64, 4, 4))
    assert plan(2048, 256, 256, 7168)[0] == TileConfig(16, 64, 128, 4, 4, one_dot=True)
    # the checkpoint layout keeps two dots and 16-row blocks at 16 rows an expert
    t1, t2 = plan(2048, 128, 768, 2048, fragments=False)
    assert t1.block_m == 16 and not t1.one_dot and t2.block_n == 64
    # decode with few programs splits GEMM1's K instead (DeepSeek-V3 M=1: 8 slots)
    t1, _ = plan(8, 256, 256, 7168)
    assert t1.split_k > 1 and not t1.one_dot
    # 17-32 rows an expert (Qwen3-30B M=512: 32) too; the checkpoint layout keeps two-dot 3-stage tiles
    assert plan(4096, 128, 768, 2048) == (TileConfig(32, 128, 64, 4, 4, one_dot=True), TileConfig(32, 128, 64, 4, 4))
    t1, t2 = plan(4096, 128, 768, 2048, fragments=False)
    assert t1.block_m == 32 and not t1.one_dot and (t1.num_stages, t2.num_stages) == (3, 3)
    # an explicit 32-row block past 32 rows an expert (the tuner's descent) keeps the larger tiles' rule
    t1 = heuristic(8192, 128, 768, 2048, bf16, gated=True, quant="w4", group=32, fragments=True, block_m=32)
    assert not t1.one_dot and t1.num_stages == 3
    # 64-row blocks and up: the larger tiles' rule
    t1, _ = plan(4096 * 8, 128, 768, 2048)
    assert t1.block_m >= 64 and not t1.one_dot


def test_w4_fragments_planned():
    from fusedmoe.backends.triton.weight_only import w4_fragments_planned
    from fusedmoe.quant.scheme import get_scheme

    mxfp4, nvfp4, int4 = (get_scheme(q) for q in ("mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g32"))
    assert w4_fragments_planned(mxfp4, 2048, 768) and w4_fragments_planned(nvfp4, 2880, 2880)
    assert w4_fragments_planned(int4, 2048, 768)  # every int4 group at every size by default
    with knobs.override(TRITON_W4_FRAGMENTS=False):
        assert not w4_fragments_planned(int4, 2048, 768)
    assert not w4_fragments_planned(mxfp4, 2048, 776) and not w4_fragments_planned(mxfp4, 2056, 768)
    assert not w4_fragments_planned(mxfp4, 64, 40, gated=False)  # w2 [64, 40]: K not whole 64-wide fragments
    assert w4_fragments_planned(mxfp4, 64, 640, gated=False)
    assert not w4_fragments_planned(None, 2048, 768) and not w4_fragments_planned(get_scheme("fp8_w8a16"), 2048, 768)
    with knobs.override(TRITON_W4_FRAGMENTS="all"):
        assert w4_fragments_planned(int4, 2048, 768)
    with knobs.override(TRITON_W4_FRAGMENTS=False):
        assert not w4_fragments_planned(mxfp4, 2048, 768)


def test_check_tile_reasons():
    assert "power of two" in check_tile(TileConfig(24, 64, 64), dtype=torch.float16)
    assert ">= 16" in check_tile(TileConfig(8, 64, 64), dtype=torch.float16)
    assert "shared memory" in check_tile(TileConfig(256, 256, 256, 8, 4), dtype=torch.float32, operands=2)
    assert "num_warps" in check_tile(TileConfig(64, 64, 64, 3), dtype=torch.float16)
    assert "only GEMM1 splits K" in check_tile(TileConfig(16, 64, 64, 4, 3, 2), dtype=torch.float16)
    assert check_tile(TileConfig(16, 64, 64, 4, 3, 2), dtype=torch.float16, allow_split=True) is None
    assert "split_k=3" in check_tile(TileConfig(16, 64, 64, 4, 3, 3), dtype=torch.float16, allow_split=True)


def test_heuristic_splits_decode_gemm1():
    tile = heuristic(8, 256, 256, 7168, torch.bfloat16, gated=True, num_sms=132)  # DeepSeek TP8, M=1
    assert tile.block_m == 16 and tile.split_k > 1
    assert heuristic(8, 256, 7168, 256, torch.bfloat16, gated=False).split_k == 1
    assert heuristic(32768, 128, 768, 2048, torch.bfloat16, gated=True).split_k == 1


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("act,bias,on_input", [("silu", True, False), ("swigluoai", True, False),
                                               ("relu2_no_mul", False, False), ("silu", False, True)])
def test_split_k_gemm1_matches_reference(split, act, bias, on_input):
    gen = torch.Generator().manual_seed(50 + split)
    T, E, H, I = 5, 6, 200, 40
    K = 1 if on_input else 2
    rows = I if act.endswith("no_mul") else 2 * I
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, rows, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    b13 = torch.randn(E, rows, generator=gen) if bias else None
    b2 = torch.randn(E, H, generator=gen) if bias else None
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K, renormalize=not on_input)
    tiles = (TileConfig(16, 16, 32, 4, 2, split), TileConfig(16, 32, 32, 4, 2))
    out = triton_experts(x, w13, w2, weights, ids, b13, b2, None, E, act, on_input, 1.702, None, tiles=tiles)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids, activation=act,
                            apply_router_weight_on_input=on_input,
                            w13_bias_LG=None if b13 is None else b13.double(),
                            w2_bias_LH=None if b2 is None else b2.double())
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("direct", [False, True], ids=["aligned", "direct"])
def test_expert_map_entry_past_the_local_experts_contributes_zero(direct):
    """Without validation (the GPU default) an expert_map entry past the local experts drops the
    slots routed to it, in the alignment and in the direct path, instead of indexing past w13."""
    gen = torch.Generator().manual_seed(61)
    T, E, L, H, I = 6, 8, 4, 64, 32
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(L, 2 * I, H, generator=gen) / H**0.5, torch.randn(L, H, I, generator=gen) / I**0.5
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, L + 5, -1], dtype=torch.int32)
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), 2)
    ids[:, 0] = 6  # every token sends one slot to the bad entry
    out = triton_experts(x, w13, w2, weights, ids, None, None, expert_map, E, "silu", False, 1.702, None,
                         direct=direct)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids,
                            expert_map_E=torch.where(expert_map >= L, -1, expert_map), global_num_experts=E)
    assert rel_err(out, ref) < 1e-5


# Kernels vs the reference --------------------------------------------------------------------------
CASES = [
    # id, T, E, K, H, I, activation, bias, weight_on_input, expert_map
    ("basic", 9, 6, 2, 64, 32, "silu", False, False, False),
    ("odd-sizes", 5, 7, 3, 65, 37, "silu", True, False, False),
    ("gelu-bias", 6, 4, 2, 48, 40, "gelu", True, False, False),
    ("gelu-tanh", 4, 5, 2, 32, 48, "gelu_tanh", False, False, False),
    ("swigluoai", 6, 4, 2, 48, 40, "swigluoai", True, False, False),
    ("silu-no-mul", 5, 5, 2, 32, 24, "silu_no_mul", False, False, False),
    ("gelu-no-mul", 5, 5, 2, 32, 24, "gelu_no_mul", True, False, False),
    ("relu2", 7, 6, 3, 40, 24, "relu2_no_mul", False, False, False),
    ("top1-weight-on-input", 8, 5, 1, 32, 32, "silu", True, True, False),
    ("topk-equals-e", 3, 4, 4, 32, 16, "silu", False, False, False),
    ("m1", 1, 8, 2, 64, 32, "silu", False, False, False),
    ("expert-map", 9, 8, 3, 32, 32, "silu", True, False, True),
    ("many-tokens", 70, 3, 2, 32, 16, "silu", False, False, False),
]


def case_problem(case, dtype, seed_offset=0):
    """(triton_experts' positional arguments, the float64 reference) for one of CASES; with an
    expert_map this rank holds experts 0, 2, 4, ... and the others contribute zero."""
    _, T, E, K, H, I, act, bias, on_input, use_map = case
    gen = torch.Generator().manual_seed(zlib.crc32(case[0].encode()) + seed_offset)
    rows = 2 * I if act in ("silu", "gelu", "gelu_tanh", "swigluoai") else I
    num_local, expert_map = E, None
    if use_map:
        num_local = len(range(0, E, 2))
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[0::2] = torch.arange(num_local, dtype=torch.int32)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13 = (torch.randn(num_local, rows, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(num_local, H, I, generator=gen) / I**0.5).to(dtype)
    b13 = torch.randn(num_local, rows, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(num_local, H, generator=gen).to(dtype) if bias else None
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K, renormalize=not on_input)
    alpha, limit = (1.5, 6.0) if act == "swigluoai" else (1.702, None)
    ref = fused_experts_ref(
        x.double(), w13.double(), w2.double(), weights, ids, activation=act,
        apply_router_weight_on_input=on_input, expert_map_E=expert_map, global_num_experts=E,
        w13_bias_LG=None if b13 is None else b13.double(), w2_bias_LH=None if b2 is None else b2.double(),
        swiglu_alpha=alpha, swiglu_limit=limit,
    )
    return (x, w13, w2, weights, ids, b13, b2, expert_map, E, act, on_input, alpha, limit), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernels_match_reference(case, dtype):
    args, ref = case_problem(case, dtype)
    out = triton_experts(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
    assert rel_err(out.cpu(), ref) < TOL[dtype]


# The direct decode path: GEMM1 by slot, GEMM2 with the routed weight and the top-k sum -------------
DIRECT_TILES = (TileConfig(16, 16, 32, 4, 2), TileConfig(16, 16, 32, 4, 2, 2))  # gemm2: a token's slots in 2 shares


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "many-tokens"],
                         ids=[c[0] for c in CASES if c[0] != "many-tokens"])
def test_direct_decode_matches_reference(case, dtype, monkeypatch):
    args, ref = case_problem(case, dtype, seed_offset=1)
    monkeypatch.setattr(experts_mod, "align", None)  # the direct path aligns nothing
    out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    triton_experts(*args, tiles=DIRECT_TILES, out=out, direct=True)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("split, shares", [(2, 1), (4, 4)])  # gemm1 split-K, gemm2 slot shares (3 of 1 slot)
def test_direct_decode_split_k_out_of_range_ids_and_in_place(split, shares):
    gen = torch.Generator().manual_seed(60 + split)
    T, E, K, H, I = 4, 6, 3, 128, 40
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    ids = torch.tensor([[1, 0, 5], [1, -1, 2], [3, E, 1], [E + 7, -5, 99]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=gen)
    weights[1, 1] = float("nan")  # the weight of a dropped slot is never read
    tiles = (TileConfig(16, 16, 32, 4, 2, split), TileConfig(16, 32, 32, 4, 2, shares))
    into = x.clone()
    out = triton_experts(into, w13, w2, weights, ids, b13, b2, None, E, "silu", False, 1.702, None,
                         tiles=tiles, out=into, direct=True)
    keep = (ids >= 0) & (ids < E)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), torch.where(keep, weights, 0), ids.clamp(0, E - 1),
                            w13_bias_LG=b13.double(), w2_bias_LH=b2.double())
    assert out is into and rel_err(out, ref) < 1e-5
    assert (out[3] == 0).all()  # every slot dropped: exactly zero, not the poisoned input
    again = triton_experts(x, w13, w2, weights, ids, b13, b2, None, E, "silu", False, 1.702, None,
                           tiles=tiles, direct=True)
    assert torch.equal(again, out)  # deterministic: each output element written once, slots in order


def test_direct_decode_rule_knob_and_errors(monkeypatch):
    from fusedmoe import knobs
    from fusedmoe.backends.triton.experts import (
        GemmProblem,
        choose_plan,
        direct_auto,
        direct_wanted,
        plan_tiles,
    )

    def problem(tokens, experts, top_k, hidden=7168, inter=256):
        return GemmProblem(tokens * top_k, experts, hidden, inter, top_k, True, torch.bfloat16)

    # the measured wins: DeepSeek-V3 M=1 and 4, Llama-4 M=1, Qwen3-30B M=4; every preset at M=1
    # once GEMM2 splits a token's slots (Qwen3-30B, gpt-oss, Mixtral)
    assert direct_auto(problem(1, 256, 8)) and direct_auto(problem(4, 256, 8))
    assert direct_auto(problem(1, 128, 1, 5120, 1024)) and direct_auto(problem(4, 128, 8, 2048, 768))
    assert direct_auto(problem(1, 128, 8, 2048, 768)) and direct_auto(problem(1, 128, 4, 2880, 2880))
    assert direct_auto(problem(1, 8, 2, 4096, 14336)) and direct_auto(problem(1, 256, 8), num_sms=200)
    # and losses (measured without shares): too few GEMM2 programs, long intermediates (gpt-oss
    # M=4), experts repeated (Mixtral M=4: 8 slots over 8 experts), many slots
    assert not direct_auto(problem(2, 128, 8, 2048, 768)) and not direct_auto(problem(4, 128, 4, 2880, 2880))
    assert not direct_auto(problem(4, 8, 2, 4096, 1024)) and not direct_auto(problem(16, 256, 8))
    assert not direct_auto(problem(2, 256, 8), num_sms=400)
    assert direct_wanted(problem(1, 128, 8, 2048, 768)) and direct_wanted(problem(4, 256, 8))
    dev = torch.device("cpu")
    # weight-only calls take the same rule (measured with 4-bit weights: every preset at M=1,
    # DeepSeek-V3 / Qwen3 / Llama-4 at M=4 direct, gpt-oss and Mixtral at M=4 aligned)
    from fusedmoe.quant.scheme import get_scheme

    int4 = get_scheme("int4_w4a16_g32")
    for prob, want in ((problem(1, 128, 8, 2048, 768), True), (problem(1, 8, 2, 4096, 14336), True),
                       (problem(4, 256, 8), True), (problem(4, 128, 1, 5120, 1024), True),
                       (problem(4, 128, 4, 2880, 2880), False), (problem(4, 8, 2, 4096, 14336), False)):
        assert choose_plan(prob, int4, dev)[0] is want and choose_plan(prob, None, dev)[0] is want
    is_direct, t1, t2 = choose_plan(problem(1, 256, 8), None, dev)
    assert is_direct and t1.block_m == t2.block_m == 16 and check_tile(t2, dtype=torch.bfloat16) is None
    with knobs.override(TRITON_DIRECT=False):
        assert not choose_plan(problem(1, 256, 8), None, dev)[0]
    with knobs.override(TRITON_DIRECT="force"):
        assert choose_plan(problem(16, 128, 8, 2048, 768), None, dev)[0]
    aligned = (DIRECT_TILES[0], replace(DIRECT_TILES[1], split_k=1))
    assert plan_tiles(problem(1, 256, 8), None, dev, aligned, None) == (False, *aligned)  # explicit tiles: aligned
    with pytest.raises(ValueError, match=r"gemm2 tile .*: split_k=2: only GEMM1 splits K"):  # slot shares: direct only
        plan_tiles(problem(1, 256, 8), None, dev, DIRECT_TILES, None)
    with pytest.raises(ValueError, match=r"gemm1 tile .*: block_n=24 must be a power of two"):
        plan_tiles(problem(64, 256, 8), None, dev, (TileConfig(64, 24, 64), TileConfig(64, 64, 64)), False)
    assert not plan_tiles(problem(1, 256, 8), None, dev, None, False)[0]
    with pytest.raises(ValueError, match="top_k=17 > 16"):
        plan_tiles(problem(1, 128, 17), None, dev, None, True)
    with pytest.raises(ValueError, match="direct path's tiles need block_m=16"):
        plan_tiles(problem(1, 128, 8), None, dev, (TileConfig(32, 16, 32), DIRECT_TILES[1]), True)
    monkeypatch.setenv("FUSEDMOE_TRITON_DIRECT", "sometimes")
    with pytest.raises(ValueError, match="FUSEDMOE_TRITON_DIRECT='sometimes'.*'force'"):
        choose_plan(problem(1, 256, 8), None, dev)


def test_direct_gemm2_heuristic_tiles_are_valid():
    from fusedmoe.backends.triton.tiles import (
        DIRECT_SPLIT_PROGRAMS,
        DIRECT_SPLIT_WORK,
        direct_gemm2_heuristic,
    )

    for tokens in (1, 2, 7, 64):
        for hidden, inter in ((2048, 768), (7168, 256), (5120, 1024), (2880, 2880), (65, 37), (4096, 14336)):
            for dtype in (torch.bfloat16, torch.float32):
                for quant, group in ((None, None), ("w8", None), ("w4", 32), ("w4", 128)):
                    for top_k in (1, 2, 6, 8, 16):
                        tile = direct_gemm2_heuristic(tokens, hidden, inter, dtype, quant=quant, group=group,
                                                      top_k=top_k)
                        assert tile.block_m == 16
                        assert check_tile(tile, dtype=dtype, quant=quant, group=group, allow_split=True) is None
                        per = -(-top_k // tile.split_k)
                        assert tile.split_k < 2 * top_k and (per - 1) * tile.split_k < top_k, tile
                        half = tile.split_k // 2  # split only where it was wanted
                        assert tile.split_k == 1 or tokens * -(-hidden // tile.block_n) * half < \
                            DIRECT_SPLIT_PROGRAMS * 132 or -(-top_k // half) * inter > DIRECT_SPLIT_WORK, tile
    # measured at M=1 (tiles.direct_gemm2_heuristic): 32-wide tiles, the slots in 4 / 4 / 2 shares
    for (hidden, inter, top_k), split in (((2048, 768, 8), 4), ((2880, 2880, 4), 4), ((4096, 14336, 2), 2),
                                          ((7168, 256, 8), 1), ((5120, 1024, 1), 1)):
        tile = direct_gemm2_heuristic(1, hidden, inter, torch.bfloat16, top_k=top_k)
        assert (tile.block_n, tile.split_k) == (32, split), (hidden, tile)
    assert direct_gemm2_heuristic(64, 2048, 768, torch.bfloat16, top_k=8).block_n == 128
    assert direct_gemm2_heuristic(4, 2048, 768, torch.bfloat16, top_k=8).split_k == 1  # Qwen3 M=4: 81 us split


def test_swiglu_clamp_applied():
    gen = torch.Generator().manual_seed(3)
    T, E, K, H, I = 6, 4, 2, 32, 16
    x = torch.randn(T, H, generator=gen) * 4  # large activations so the clamp bites
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen) / I**0.5
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K)
    out = triton_experts(x, w13, w2, weights, ids, None, None, None, E, "silu", False, 1.702, 1.0)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids, swiglu_limit=1.0)
    unclamped = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids)
    assert rel_err(out, ref) < 1e-5 and rel_err(out, unclamped) > 0.1


def test_empty_experts_and_all_to_one():
    T, E, H, I = 12, 6, 32, 16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / 6, torch.randn(E, H, I, generator=gen) / 4
    ids = torch.full((T, 1), 4, dtype=torch.int32)  # every token to expert 4; the others get nothing
    weights = torch.rand(T, 1, generator=gen)
    out = triton_experts(x, w13, w2, weights, ids, None, None, None, E, "silu", False, 1.702, None)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids)
    assert rel_err(out, ref) < 1e-5


def test_out_of_range_ids_contribute_zero():
    T, E, K, H, I = 5, 4, 2, 32, 16
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / 6, torch.randn(E, H, I, generator=gen) / 4
    ids = torch.tensor([[0, 1], [-1, 2], [3, E], [E + 7, -5], [2, 3]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=gen)
    out = triton_experts(x, w13, w2, weights, ids, None, None, None, E, "silu", False, 1.702, None)
    keep = (ids >= 0) & (ids < E)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights * keep, ids.clamp(0, E - 1))
    assert rel_err(out, ref) < 1e-5
    assert out[3].abs().max() == 0


def test_zero_tokens():
    x = torch.randn(0, 32)
    out = triton_experts(x, torch.randn(4, 32, 32), torch.randn(4, 32, 16), torch.rand(0, 2),
                         torch.zeros(0, 2, dtype=torch.int32), None, None, None, 4, "silu", False, 1.702, None)
    assert out.shape == (0, 32)


def test_deterministic():
    gen = torch.Generator().manual_seed(8)
    T, E, K, H, I = 20, 5, 2, 32, 16
    x = torch.randn(T, H, generator=gen).half()
    w13, w2 = (torch.randn(E, 2 * I, H, generator=gen) / 6).half(), (torch.randn(E, H, I, generator=gen) / 4).half()
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K)
    a = triton_experts(x, w13, w2, weights, ids, None, None, None, E, "silu", False, 1.702, None)
    b = triton_experts(x, w13, w2, weights, ids, None, None, None, E, "silu", False, 1.702, None)
    assert torch.equal(a, b)


def test_experts_class_and_custom_op_fake():
    from fusedmoe.backends.triton.experts import TritonExperts

    config = MoEConfig(4, 2, 32, 16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 32, generator=gen)
    w = ExpertWeights(torch.randn(4, 32, 32, generator=gen) / 6, torch.randn(4, 32, 16, generator=gen) / 4)
    weights, ids = select_experts(x, torch.randn(3, 4, generator=gen), 2)
    out = TritonExperts(config).apply(x, w, weights, ids, expert_map_E=None)
    ref = fused_experts_ref(x.double(), w.w13.double(), w.w2.double(), weights, ids)
    assert rel_err(out, ref) < 1e-5
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx = torch.empty(7, 32)
        fake = triton_experts_op(fx, torch.empty(4, 32, 32), torch.empty(4, 32, 16), torch.empty(7, 2),
                                 torch.empty(7, 2, dtype=torch.int32), None, None, None, 4, "silu", False,
                                 1.702, None)
        assert fake.shape == (7, 32) and fake.dtype == torch.float32


def test_eager_calls_skip_the_custom_op_dispatch_only_where_nothing_needs_it(monkeypatch):
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton.experts import TritonExperts

    gen = torch.Generator().manual_seed(11)
    config = MoEConfig(4, 2, 32, 16, dtype=torch.float32)
    x = torch.randn(3, 32, generator=gen)
    w = ExpertWeights(torch.randn(4, 32, 32, generator=gen) / 6, torch.randn(4, 32, 16, generator=gen) / 4)
    weights, ids = select_experts(x, torch.randn(3, 4, generator=gen), 2)
    used = []
    for name in ("triton_experts_op", "triton_experts_out_op"):
        op = getattr(experts_mod, name)
        monkeypatch.setattr(experts_mod, name, lambda *a, _op=op, _n=name, **k: used.append(_n) or _op(*a, **k))
    apply = lambda weights_: TritonExperts(config).apply(x, weights_, weights, ids, expert_map_E=None)  # noqa: E731
    eager = apply(w)
    assert used == []  # plain tensors, eager: the implementation directly
    TritonExperts(config).apply(x, w, weights, ids, expert_map_E=None, out_TH=torch.empty_like(x))
    assert used == []
    trainable = ExpertWeights(w.w13.clone().requires_grad_(), w.w2)
    with torch.no_grad():
        apply(trainable)
    assert used == []  # no autograd: nothing to refuse
    out = apply(trainable)  # autograd would need the op: it runs, and refuses backward
    assert used == ["triton_experts_op"]
    with pytest.raises(RuntimeError, match="autograd"):
        out.sum().backward()
    torch.testing.assert_close(out.detach(), eager, rtol=0, atol=0)
    from torch._subclasses.fake_tensor import FakeTensorMode

    used.clear()
    with FakeTensorMode() as mode:
        fake_w = ExpertWeights(mode.from_tensor(w.w13), mode.from_tensor(w.w2))
        fake = TritonExperts(config).apply(mode.from_tensor(x), fake_w, mode.from_tensor(weights),
                                           mode.from_tensor(ids), expert_map_E=None)
    assert used == ["triton_experts_op"] and fake.shape == x.shape
    used.clear()  # under torch.compile the graph holds the op (fullgraph: no break around it)
    compiled = torch.compile(lambda x_, out_: TritonExperts(config).apply(x_, w, weights, ids, expert_map_E=None,
                                                                        out_TH=out_),
                             fullgraph=True, backend="aot_eager")
    out = torch.empty_like(x)
    compiled(x, out)
    assert "triton_experts_out_op" in used
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_opcheck():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(3, 32, generator=gen)
    w13, w2 = torch.randn(4, 32, 32, generator=gen) / 6, torch.randn(4, 32, 16, generator=gen) / 4
    weights, ids = select_experts(x, torch.randn(3, 4, generator=gen), 2)
    args = (x, w13, w2, weights, ids, None, None, None, 4, "silu", False, 1.702, None)
    torch.library.opcheck(triton_experts_op, args, test_utils=("test_schema", "test_faketensor"))
    # the out variant: same schema plus `Tensor(a!) out`, writing exactly the functional result
    out = torch.full_like(x, float("nan"))
    torch.library.opcheck(triton_experts_out_op, (*args, out), test_utils=("test_schema", "test_faketensor"))
    triton_experts_out_op(*args, out)
    torch.testing.assert_close(out, triton_experts_op(*args), rtol=0, atol=0)
    in_place = x.clone()
    triton_experts_out_op(in_place, *args[1:], in_place)  # out aliasing x: the in-place mode
    torch.testing.assert_close(in_place, out, rtol=0, atol=0)


# Tuned tables --------------------------------------------------------------------------------------
def _table(entries, triton_version=None):
    from fusedmoe.backends.triton.tuning import FORMAT, _triton_version

    return {"format": FORMAT, "device": "NVIDIA H200", "triton": triton_version or _triton_version(),
            "entries": entries}


def _entry(tokens, g1=(16, 32, 128, 4, 4), g2=(16, 64, 64, 4, 4), **kw):
    e = {"dtype": "bfloat16", "experts": 128, "hidden": 2048, "inter": 768, "top_k": 8, "gated": True,
         "tokens": tokens, "gemm1": list(g1), "gemm2": list(g2)}
    e.update(kw)
    return e


def test_w4_tuned_entries_serve_the_layout_they_were_timed_on(tmp_path, monkeypatch):
    """A 4-bit entry serves weights in its "layout" only (absent: the layout tables were tuned on
    before entries named one, int4's checkpoint layout at every shape): the problem's `fragments` where the caller holds the weights, else the layout
    process_weights would give them now (FUSEDMOE_TRITON_W4_FRAGMENTS, part of the memo key).
    Elsewhere the heuristic plans for the weights' own layout. `write_table` keeps one entry per
    layout."""
    import json

    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton import weight_only as wo_mod
    from fusedmoe.backends.triton.experts import GemmProblem
    from fusedmoe.backends.triton.weight_only import (
        choose_weight_only_tiles,
        unnamed_entry_layout,
        w4_layout,
    )
    from fusedmoe.quant.scheme import get_scheme
    from fusedmoe.tune import write_table
    from quant_problems import int4_fragment_minimum

    int4, mxfp4 = get_scheme("int4_w4a16_g32"), get_scheme("mxfp4_w4a16")
    checkpoint = (TileConfig(16, 128, 128, 4, 3), TileConfig(16, 128, 128, 4, 3))
    fragments = (TileConfig(16, 64, 128, 4, 4), TileConfig(16, 128, 64, 4, 3))
    as_entry = lambda tiles, **kw: _entry(16, g1=tuple(tiles[0].as_list()), g2=tuple(tiles[1].as_list()), **kw)  # noqa: E731
    entries = [as_entry(checkpoint, quant="int4_w4a16_g32"),  # no layout: int4's checkpoint layout
               as_entry(fragments, quant="int4_w4a16_g32", layout="fragments"),
               as_entry(fragments, quant="mxfp4_w4a16"),  # no layout: mxfp4's fragments here
               # I = 2048: int4 g32 is laid as fragments by default, but an entry naming no layout
               # was timed on the checkpoint layout all the same
               as_entry(checkpoint, quant="int4_w4a16_g32", inter=2048)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    path = write_table(entries, tmp_path)  # same shape and tokens, two layouts: both kept
    assert [e.get("layout") for e in json.loads(path.read_text())["entries"]] == [None, "fragments", None, None]
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU")
    for mod in (experts_mod, wo_mod):
        monkeypatch.setattr(mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here
    problem = GemmProblem(16 * 8, 128, 2048, 768, 8, True, torch.bfloat16)
    held = lambda frag: replace(problem, fragments=frag)  # noqa: E731
    assert unnamed_entry_layout(int4, 2048, 768) == "checkpoint" and unnamed_entry_layout(mxfp4, 2048, 768) == "fragments"
    assert unnamed_entry_layout(mxfp4, 2048, 776) == "checkpoint"  # not whole fragments
    assert unnamed_entry_layout(int4, 2048, 2048) == "checkpoint"  # whatever int4's default is now
    assert w4_layout(problem, None) is None and w4_layout(problem, get_scheme("fp8_w8a16")) is None
    with knobs.override(TUNED_DIR=str(tmp_path), TUNED_PACKAGED=False):  # int4's default: fragments at every I
        assert w4_layout(problem, int4) == "fragments" and choose_weight_only_tiles(problem, int4, cuda) == fragments
    # the former rule: int4 below I = 2048 planned as stored
    with int4_fragment_minimum({32: 2048, 128: 2048}), knobs.override(TUNED_DIR=str(tmp_path), TUNED_PACKAGED=False):
        assert choose_weight_only_tiles(held(False), int4, cuda) == checkpoint
        assert choose_weight_only_tiles(held(True), int4, cuda) == fragments
        assert choose_weight_only_tiles(problem, int4, cuda) == checkpoint  # planned: int4 stays as stored
        with knobs.override(TRITON_W4_FRAGMENTS="all"):  # planned: int4 laid as fragments
            assert w4_layout(problem, int4) == "fragments"
            assert choose_weight_only_tiles(problem, int4, cuda) == fragments
        assert choose_weight_only_tiles(held(True), mxfp4, cuda) == fragments
        # mxfp4 weights kept in the checkpoint layout (a scale above 2): not the fragments' entry,
        # the heuristic for the checkpoint layout
        own = choose_weight_only_tiles(held(False), mxfp4, cuda)
        with knobs.override(TUNED_DIR=None):
            assert own == choose_weight_only_tiles(held(False), mxfp4, cuda) != fragments
            at64 = GemmProblem(1024 * 8, 128, 2048, 768, 8, True, torch.bfloat16)  # 64-row blocks (M=1024)
            k_steps = [choose_weight_only_tiles(replace(at64, fragments=f), mxfp4, cuda)[0].block_k for f in (True, False)]
            assert k_steps == [64, 128], k_steps  # the heuristic's K step follows the layout held
        # explain says why the table's entry does not serve mxfp4 kept in the checkpoint layout
        monkeypatch.setattr(experts_mod, "device_capability", lambda index: (9, 0))
        plan = experts_mod.describe_plan(held(False), mxfp4, cuda)
        assert plan["gemm1"]["source"] == "heuristic", plan
        assert "has an entry for this shape timed on the fragment layout" in plan["w4_layout"], plan
        plan = experts_mod.describe_plan(problem, int4, cuda)  # int4 as stored: its entry, no note
        assert plan["gemm1"]["source"] == "tuned table" and "timed on the" not in plan["w4_layout"], plan
        # I = 2048: int4 g32 planned as fragments, so its unnamed (checkpoint) entry serves only
        # weights held in the checkpoint layout (FUSEDMOE_TRITON_W4_FRAGMENTS=0, or not whole)
        wide = replace(problem, inter=2048)
        assert w4_layout(wide, int4) == "fragments" and w4_layout(wide, get_scheme("int4_w4a16_g128")) == "fragments"
        assert w4_layout(replace(wide, inter=1920), get_scheme("int4_w4a16_g128")) == "checkpoint"
        assert choose_weight_only_tiles(replace(wide, fragments=False), int4, cuda) == checkpoint
        assert choose_weight_only_tiles(wide, int4, cuda) != checkpoint
        with knobs.override(TRITON_W4_FRAGMENTS=False):
            assert w4_layout(wide, int4) == "checkpoint" and choose_weight_only_tiles(wide, int4, cuda) == checkpoint


@pytest.mark.parametrize("bad,match", [
    (_entry(1, layout="fragments"), "layout='fragments', which only 4-bit weight-only entries name"),
    (_entry(1, quant="fp8_w8a16", layout="checkpoint"), "only 4-bit weight-only entries"),
    (_entry(1, quant="int4_w4a16_g32", layout="rows"), "layout='rows' .*fragments, checkpoint"),
], ids=["bf16", "fp8-weight-only", "unknown"])
def test_tuned_entry_layout_is_checked(bad, match):
    from fusedmoe.backends.triton.tuning import parse_table

    with pytest.raises(ValueError, match=match):
        parse_table(_table([bad]), "t.json")


def test_tuned_table_parse_and_nearest():
    from fusedmoe.backends.triton.tuning import nearest, parse_table

    table = parse_table(_table([_entry(1), _entry(16, g1=(32, 64, 64, 4, 3), g2=(32, 64, 64, 4, 3)),
                                _entry(256, g1=(64, 64, 64, 4, 3), g2=(64, 128, 64, 8, 3))]), "t.json")
    key = ("bfloat16", 128, 2048, 768, 8, True, None)
    assert nearest(table, key, 1)[0].block_m == 16
    assert nearest(table, key, 2)[0].block_m == 16
    assert nearest(table, key, 12)[0].block_m == 32   # log2 distance: 16 is nearer than 1
    assert nearest(table, key, 200)[1].block_n == 128
    assert nearest(table, key, 4) is None              # two octaves from 1 and 16: the heuristic
    assert nearest(table, key, 100) is None
    assert nearest(table, key, 10**6) is None
    assert nearest(table, ("bfloat16", 64, 2048, 768, 8, True, None), 16) is None


@pytest.mark.parametrize("bad,match", [
    (_entry(1, g1=(16, 24, 64, 4, 4)), "power of two"),
    (_entry(1, g1=(16, 256, 256, 8, 6)), "shared memory"),
    (_entry(1, g2=(32, 64, 64, 4, 4)), "the same block_m"),
    ({"dtype": "bfloat16"}, "malformed"),
    (_entry(1, dtype="float99"), "malformed|unknown dtype"),
    (_entry(0), "tokens=0"),
    (_entry(1, quant="fp9"), "quant='fp9': .* not a known quantization scheme"),
    (_entry(1, quant=8), "quant=8 .*a scheme name"),
    (_entry(1, quant="nvfp4"), "no Triton tiles for nvfp4"),
    # the predicates of the schemes (tiles.check_tile with the scheme's tile_mode)
    (_entry(1, g1=(16, 64, 256, 4, 3), quant="fp8_w8a8_block"),
     r"is invalid: gemm1 tile .* cannot run fp8_w8a8_block: block_k=256, block_n=64: 128x128 block scales"),
    (_entry(1, g2=(16, 64, 16, 4, 3), quant="int8_w8a8"), "gemm2 .* cannot run int8_w8a8: block_k=16: 8-bit tl.dot"),
    (_entry(1, g1=(16, 64, 16, 4, 3), quant="mxfp4_w4a16"), "cannot run mxfp4_w4a16: block_k=16: 4-bit weights"),
    # swap_ab, a tile's optional 7th value: W8A8 only, true / false
    (_entry(1, g1=(16, 32, 128, 4, 4, 1, True)), "gemm1 .*: swap_ab=True: only the W8A8 GEMMs swap"),
    (_entry(1, g2=(16, 64, 64, 4, 4, 1, 1), quant="fp8_w8a8_block"), "malformed.*swap_ab=1 is not true/false"),
    (_entry(1, g2=(16, 64, 64, 4, 4, 1, True, 8, False, False, 0)), "malformed.*not a tile list"),
    # group_m, the optional 8th value (after swap_ab, null for the rule's): a power of two <= 64
    (_entry(1, g2=(16, 64, 64, 4, 4, 1, None, 0)), "gemm2 .*: group_m=0 must be a power of two in \\[1, 64\\]"),
    (_entry(1, g1=(16, 64, 64, 4, 4, 1, None, 128)), "gemm1 .*: group_m=128 must be a power of two"),
    (_entry(1, g1=(16, 64, 64, 4, 4, 1, None, 2.0)), "malformed.*2.0 is not an integer"),
])
def test_tuned_table_rejects_invalid(bad, match):
    from fusedmoe.backends.triton.tuning import parse_table

    with pytest.raises(ValueError, match=match):
        parse_table(_table([bad]), "t.json")
    with pytest.raises(ValueError, match="not a fusedmoe tuned table"):
        parse_table({"entries": []}, "t.json")


def test_tuned_table_swap_ab_round_trip():
    """A W8A8 entry may set swap_ab per GEMM (what `fusedmoe tune` found); unset, the rule
    decides. as_list writes the 7th value only when it is set, and the parser reads it back."""
    from fusedmoe.backends.triton.tuning import nearest, parse_table

    swapped, plain = TileConfig(16, 128, 128, 4, 3, 1, swap_ab=True), TileConfig(16, 64, 128, 4, 3)
    assert swapped.as_list() == [16, 128, 128, 4, 3, 1, True] and plain.as_list() == [16, 64, 128, 4, 3, 1]
    entry = _entry(16, g1=tuple(swapped.as_list()), g2=tuple(plain.as_list()), quant="fp8_w8a8_block")
    table = parse_table(_table([entry]), "t.json")
    t1, t2 = nearest(table, ("bfloat16", 128, 2048, 768, 8, True, "fp8_w8a8_block"), 16)
    assert (t1, t2) == (swapped, plain) and t2.swap_ab is None


def test_tuned_table_group_m_round_trip():
    """group_m (the aligned GEMMs' program order) is written only when it is not the default,
    after swap_ab (null where the rule decides), and read back; the launch takes it."""
    from fusedmoe.backends.triton.tiles import GROUP_M
    from fusedmoe.backends.triton.tuning import nearest, parse_table

    rows = TileConfig(64, 128, 64, 4, 4, group_m=1)
    swapped = TileConfig(16, 128, 128, 4, 3, 1, swap_ab=True, group_m=32)
    assert TileConfig(64, 128, 64, 4, 4).group_m == GROUP_M == 8
    assert rows.as_list() == [64, 128, 64, 4, 4, 1, None, 1]
    assert swapped.as_list() == [16, 128, 128, 4, 3, 1, True, 32]
    assert TileConfig(64, 128, 64, 4, 4, group_m=GROUP_M).as_list() == [64, 128, 64, 4, 4, 1]
    entry = _entry(1024, g1=tuple(rows.as_list()), g2=(64, 128, 64, 4, 3))
    t1, t2 = nearest(parse_table(_table([entry]), "t.json"), ("bfloat16", 128, 2048, 768, 8, True, None), 1024)
    assert (t1, t2.group_m) == (rows, GROUP_M)
    entry = _entry(16, g1=tuple(swapped.as_list()), g2=(16, 64, 128, 4, 3), quant="fp8_w8a8_block")
    t1, _ = nearest(parse_table(_table([entry]), "t.json"), ("bfloat16", 128, 2048, 768, 8, True, "fp8_w8a8_block"), 16)
    assert t1 == swapped


def test_tuned_table_quant_entries_serve_their_scheme_only():
    from fusedmoe.backends.triton.tuning import nearest, parse_table

    block = dict(g1=(16, 128, 128, 4, 3), g2=(16, 64, 128, 4, 3))
    table = parse_table(_table([
        _entry(1), _entry(1, quant="fp8_w8a8_block", **block), _entry(64, quant="fp8_w8a8_block",
                                                                      g1=(32, 64, 128, 4, 3), g2=(32, 64, 128, 4, 3)),
        _entry(1, quant="int4_w4a16_g32", g1=(16, 64, 64, 4, 3), g2=(16, 32, 128, 4, 3)),
        _entry(1, quant=None, g1=(16, 64, 64, 4, 3)),  # "quant": null = unquantized, as absent
    ]), "t.json")
    shape = ("bfloat16", 128, 2048, 768, 8, True)
    assert nearest(table, (*shape, None), 1)[0].block_k in (128, 64)
    assert len(table[(*shape, None)]) == 2
    assert nearest(table, (*shape, "fp8_w8a8_block"), 1) == (TileConfig(16, 128, 128, 4, 3), TileConfig(16, 64, 128, 4, 3))
    assert nearest(table, (*shape, "fp8_w8a8_block"), 48)[0].block_m == 32  # nearest token count
    assert nearest(table, (*shape, "fp8_w8a8_block"), 8) is None
    assert nearest(table, (*shape, "int4_w4a16_g32"), 2)[1].block_n == 32
    assert nearest(table, (*shape, "fp8_w8a8_channel"), 1) is None  # no entry of its own
    assert nearest(table, (*shape, None), 64) is None  # fp8's M=64 entry never serves bf16


def test_tuned_table_lookup_by_scheme(tmp_path, monkeypatch, caplog):
    """choose_tiles / choose_quant_tiles / choose_weight_only_tiles each read their scheme's
    entries, else fall back to the heuristic; invalid entries are skipped, the rest serve."""
    import json
    import logging

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import quant as quant_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton import weight_only as wo_mod
    from fusedmoe.backends.triton.experts import GemmProblem, choose_tiles
    from fusedmoe.backends.triton.quant import choose_quant_tiles
    from fusedmoe.backends.triton.weight_only import choose_weight_only_tiles
    from fusedmoe.quant.scheme import SCHEMES

    bf16 = (TileConfig(16, 32, 128, 4, 4), TileConfig(16, 64, 64, 4, 4))
    fp8 = (TileConfig(16, 128, 128, 4, 3), TileConfig(16, 64, 128, 4, 3))
    entries = [_entry(16, g1=tuple(bf16[0].as_list()), g2=tuple(bf16[1].as_list())),
               _entry(16, g1=tuple(fp8[0].as_list()), g2=tuple(fp8[1].as_list()),
                      quant="fp8_w8a8_block"),
               _entry(16, g1=(16, 64, 256, 4, 3), quant="int8_w8a8"),  # valid for int8 ...
               _entry(32, g1=(16, 64, 256, 4, 3), quant="fp8_w8a8_block")]  # ... not block
    (tmp_path / "Fake_GPU.json").write_text(json.dumps(_table(entries)))
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU")
    for mod in (experts_mod, quant_mod, wo_mod):
        monkeypatch.setattr(mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here
    problem = GemmProblem(16 * 8, 128, 2048, 768, 8, True, torch.bfloat16)
    with knobs.override(TUNED_DIR=str(tmp_path)), caplog.at_level(logging.WARNING, logger="fusedmoe"):
        assert choose_tiles(problem, cuda) == bf16
        assert choose_quant_tiles(problem, SCHEMES["fp8_w8a8_block"], cuda) == fp8
        assert choose_quant_tiles(problem, SCHEMES["int8_w8a8"], cuda)[0].block_k == 256
        heuristic_fp8 = choose_quant_tiles(problem, SCHEMES["fp8_w8a8_channel"], cuda)
        assert heuristic_fp8 != fp8 and heuristic_fp8 != bf16
        assert choose_weight_only_tiles(problem, SCHEMES["mxfp4_w4a16"], cuda) not in (bf16, fp8)
        at32 = GemmProblem(32 * 8, 128, 2048, 768, 8, True, torch.bfloat16)
        assert choose_quant_tiles(at32, SCHEMES["fp8_w8a8_block"], cuda) == fp8  # the invalid M=32 entry: skipped
        assert choose_quant_tiles(problem, SCHEMES["fp8_w8a8_block"], torch.device("cpu")) != fp8
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 1 and "ignoring entry 3" in reports[0], reports  # once, with the reason
    assert "cannot run fp8_w8a8_block: block_k=256" in reports[0]


@pytest.mark.parametrize("bad,match", [
    (_entry(1, path="sideways"), "path='sideways' .*aligned, direct"),
    (_entry(1, path="direct", g1=(32, 32, 128, 4, 4), g2=(32, 64, 64, 4, 4)), "direct path's tiles need block_m=16"),
    (_entry(1, path="direct", quant="fp8_w8a8_tensor", g1=(16, 128, 128, 4, 3), g2=(16, 64, 128, 4, 3)),
     "per-tensor W8A8 has no direct path"),
    (_entry(1, path="direct", quant="fp8_w8a8_block", g1=(16, 128, 128, 4, 3), g2=(16, 64, 256, 4, 3)),
     "gemm2 tile .*block_k=256, block_n=64: 128x128 block scales need both to divide 128"),
    (_entry(1, path="direct", g2=(16, 64, 64, 4, 4, 3)), "gemm2 tile .*: split_k=3 must be one of"),
    (_entry(1, path="aligned", g2=(16, 64, 64, 4, 4, 2)), "gemm2 tile .*: split_k=2: only GEMM1 splits K"),
])
def test_tuned_table_rejects_invalid_paths(bad, match):
    from fusedmoe.backends.triton.tuning import parse_table

    with pytest.raises(ValueError, match=match):
        parse_table(_table([bad]), "t.json")


def test_tuned_table_paths_nearest_and_plan():
    """Entries of format 3 name their path; undecided ones (formats 1-2) serve the aligned path's
    tiles only; a direct entry decides no larger token count than its own."""
    from fusedmoe.backends.triton.tuning import Tuned, nearest, nearest_entry, parse_table

    direct = dict(path="direct", g1=(16, 32, 256, 4, 3, 2), g2=(16, 32, 128, 4, 4, 4))
    table = parse_table(_table([_entry(1, **direct), _entry(4, path="aligned"), _entry(16),
                                _entry(64, path="direct", g2=(16, 64, 64, 4, 4, 1))]), "t.json")
    key = ("bfloat16", 128, 2048, 768, 8, True, None)
    assert nearest_entry(table, key, 1) == Tuned(1, TileConfig(16, 32, 256, 4, 3, 2), TileConfig(16, 32, 128, 4, 4, 4), "direct")
    assert nearest_entry(table, key, 1).direct and not nearest_entry(table, key, 4).direct
    assert nearest_entry(table, key, 1, ("aligned", None)) is None  # M=4 is 2 octaves off
    assert nearest_entry(table, key, 2, ("aligned", None)).tokens == 4
    assert nearest(table, key, 2) == (TileConfig(16, 32, 128, 4, 4), TileConfig(16, 64, 64, 4, 4))
    assert nearest(table, key, 32)[0] == TileConfig(16, 32, 128, 4, 4)  # the M=16 entry, not the direct M=64
    assert nearest_entry(table, key, 32, ("aligned", "direct")).tokens == 64  # M=16 decides no path
    assert nearest_entry(table, key, 2, ("direct",)).tokens == 1


def test_tuned_dir_entry_without_a_path_is_not_passed_over(tmp_path, monkeypatch):
    """FUSEDMOE_TUNED_DIR is searched before the packaged table: its entry without a path (formats
    1-2: aligned tiles, path left to the rule) serves over a packaged entry naming a path for the
    same shape, as its named entries do; the packaged table serves shapes (or token counts more
    than an octave off) the folder has nothing for."""
    import json

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton.experts import GemmProblem, choose_plan

    mine, packaged = (TileConfig(16, 32, 128, 4, 4), TileConfig(16, 64, 64, 4, 4)), \
        (TileConfig(16, 128, 128, 4, 3), TileConfig(16, 128, 64, 4, 3))
    tiles = lambda t: dict(g1=tuple(t[0].as_list()), g2=tuple(t[1].as_list()))  # noqa: E731
    (tmp_path / "user").mkdir(), (tmp_path / "packaged").mkdir()
    (tmp_path / "user" / "Fake_GPU.json").write_text(json.dumps(_table([_entry(16, **tiles(mine))])))
    (tmp_path / "packaged" / "Fake_GPU.json").write_text(json.dumps(_table(
        [_entry(16, path="aligned", **tiles(packaged)), _entry(128, path="aligned", **tiles(packaged))])))
    monkeypatch.setattr(tuning, "PACKAGED", tmp_path / "packaged")
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here

    def problem(tokens):
        return GemmProblem(tokens * 8, 128, 2048, 768, 8, True, torch.bfloat16)

    with knobs.override(TRITON_TMA=False):
        assert choose_plan(problem(16), None, cuda) == (False, *packaged)
        with knobs.override(TUNED_DIR=str(tmp_path / "user")):
            assert tuning.lookup_plan(problem(16), cuda) is None  # the rule decides the path ...
            assert choose_plan(problem(16), None, cuda) == (False, *mine)  # ... on the folder's tiles
            assert choose_plan(problem(128), None, cuda) == (False, *packaged)  # 3 octaves from M=16


def test_tuned_paths_decide_the_plan(tmp_path, monkeypatch):
    """choose_plan takes the path of a tuned entry that timed both (over the rule, both ways);
    FUSEDMOE_TRITON_DIRECT=0 / force still decide; explain says where tiles and path came from."""
    import json

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton.experts import (
        GemmProblem,
        choose_plan,
        describe_plan,
        direct_auto,
        direct_heuristic,
    )
    from fusedmoe.quant.scheme import SCHEMES

    int4 = SCHEMES["int4_w4a16_g32"]
    d1, d2 = TileConfig(16, 64, 128, 4, 3, 4), TileConfig(16, 64, 64, 4, 4, 2)
    a1, a2 = TileConfig(16, 64, 128, 4, 3), TileConfig(16, 128, 64, 4, 3)
    tiles = lambda t1, t2: dict(g1=tuple(t1.as_list()), g2=tuple(t2.as_list()))  # noqa: E731
    ds = dict(hidden=7168, inter=256, experts=256)
    entries = [_entry(1, path="aligned", **tiles(a1, a2)),  # Qwen3-30B: the rule says direct at M=1 ...
               _entry(2, path="direct", **tiles(d1, d2)),  # ... and aligned at M=2
               _entry(16, **tiles(a1, a2)),  # format 2: the aligned path's tiles, no path decided
               _entry(8, path="direct", **tiles(d1, d2), **ds),
               _entry(1, path="direct", **tiles(d1, d2), quant=int4.name, layout="fragments")]  # int4's default
    (tmp_path / "Fake_GPU.json").write_text(json.dumps(_table(entries)))
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here

    def problem(tokens, experts=128, hidden=2048, inter=768):
        return GemmProblem(tokens * 8, experts, hidden, inter, 8, True, torch.bfloat16)

    qwen1, qwen2, ds16 = problem(1), problem(2), problem(16, 256, 7168, 256)
    assert direct_auto(qwen1) and not direct_auto(qwen2) and not direct_auto(ds16)
    with knobs.override(TUNED_DIR=str(tmp_path), TRITON_TMA=False):
        assert choose_plan(qwen1, None, cuda) == (False, a1, a2)  # tuned aligned over the rule's direct
        assert choose_plan(qwen2, None, cuda) == (True, d1, d2)  # tuned direct over the rule's aligned
        assert choose_plan(problem(16), None, cuda) == (False, a1, a2)  # no path decided: the rule's
        assert choose_plan(problem(4, 256, 7168, 256), None, cuda) == (True, d1, d2)  # fewer tokens: served
        # a direct entry decides no larger M: at M=16 the rule does (aligned, heuristic tiles)
        assert choose_plan(ds16, None, cuda)[0] is False and choose_plan(ds16, None, cuda)[1] != d1
        assert choose_plan(qwen1, int4, cuda) == (True, d1, d2)  # its scheme's entry
        assert choose_plan(problem(4), int4, cuda)[1:] != (d1, d2)  # 2 octaves: the rule, heuristic tiles
        plan = describe_plan(qwen1, None, cuda)
        assert plan["path"] == "aligned" and "timed both paths at M=1, aligned was faster" in plan["why"]
        assert plan["gemm1"]["source"] == plan["gemm2"]["source"] == "tuned table"
        plan = describe_plan(qwen2, None, cuda)
        assert plan["path"] == "direct" and plan["gemm2"] == dict(tile=d2, source="tuned table", tma=None,
                                                                   swap_ab=False)
        with knobs.override(TRITON_DIRECT=False):
            assert choose_plan(qwen2, None, cuda)[0] is False
        with knobs.override(TRITON_DIRECT="force"):
            assert choose_plan(qwen1, None, cuda) == (True, d1, d2)  # the direct entry's tiles (M=2)
            plan = describe_plan(problem(64), None, cuda)  # no entry within an octave
            assert plan["why"] == "FUSEDMOE_TRITON_DIRECT=force" and plan["path"] == "direct"
            assert plan["gemm2"] == dict(tile=direct_heuristic(problem(64), None, 132)[1], source="direct heuristic",
                                         tma=None, swap_ab=False)
            assert plan["gemm1"]["source"] == "heuristic"
    with knobs.override(TRITON_TMA=False):  # the heuristic asks no CUDA device about TMA (none here)
        assert choose_plan(qwen2, None, cuda)[0] is False  # no table: the rule


def test_tile_choice_is_memoized_per_knobs_and_cleared_by_tune(tmp_path, monkeypatch):
    import json

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton.experts import GemmProblem, choose_tiles
    from fusedmoe.tune import write_table

    calls = []
    lookup = tuning.lookup
    monkeypatch.setattr(tuning, "lookup", lambda *a: calls.append(a) or lookup(*a))
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here
    problem = GemmProblem(16 * 8, 128, 2048, 768, 8, True, torch.bfloat16)
    # TRITON_TMA=0: the heuristic asks no CUDA device about TMA (none here)
    with knobs.override(TUNED_DIR=str(tmp_path), TRITON_TMA=False):
        first = choose_tiles(problem, cuda)
        assert choose_tiles(problem, cuda) is first and len(calls) == 1  # memoized
        with knobs.override(TRITON_TMA="force"):  # a knob it reads: chosen again
            choose_tiles(problem, cuda)
        assert len(calls) == 2
        tuned = (TileConfig(16, 32, 128, 4, 4), TileConfig(16, 64, 64, 4, 4))
        entry = _entry(16, g1=tuple(tuned[0].as_list()), g2=tuple(tuned[1].as_list()))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
        path = write_table([entry], tmp_path)  # what `fusedmoe tune` writes
        assert path.name == "Fake_GPU.json" and json.loads(path.read_text())["entries"]
        assert choose_tiles(problem, cuda) == tuned != first  # the cache was cleared
    with knobs.override(TRITON_TMA=False):
        assert choose_tiles(problem, cuda) == first  # TUNED_DIR unset: the heuristic's again


def test_tuned_table_files_corrupt_or_stale_are_ignored(tmp_path, caplog):
    import json
    import logging

    from fusedmoe.backends.triton.tuning import _load

    corrupt = tmp_path / "a.json"
    corrupt.write_text("{not json")
    stale = tmp_path / "b.json"
    stale.write_text(json.dumps(_table([_entry(1)], triton_version="2.0.0")))
    good = tmp_path / "c.json"
    good.write_text(json.dumps(_table([_entry(1)])))
    with caplog.at_level(logging.INFO, logger="fusedmoe"):
        assert _load(str(corrupt), 1.0) == {}
        assert _load(str(stale), 1.0) == {}
        assert len(_load(str(good), 1.0)) == 1
    assert "ignoring tuned table" in caplog.text and "tuned with Triton 2.0.0" in caplog.text


# In place and the batched layout ------------------------------------------------------------------
def _problem(seed, T=11, E=6, K=2, H=48, I=32, dtype=torch.float32, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    b13 = torch.randn(E, 2 * I, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K)
    return x, w13, w2, b13, b2, weights, ids


@pytest.mark.parametrize("direct", [False, "force"], ids=["aligned", "direct"])
def test_column_slices_of_ids_and_weights(direct):
    """topk ids / weights that are strided views (columns of a wider top-k, as a caller keeping
    only some slots passes them): the aligned path read ids[t*K + k] through the view's storage
    and returned garbage (rel. err 1.3), the direct path copied them; both copy now."""
    from fusedmoe.backends.triton.experts import TritonExperts

    x, w13, w2, b13, b2, weights, ids = _problem(47, K=4)
    for cols in (slice(1, 2), slice(0, 4, 2)):
        w, i = weights[:, cols], ids[:, cols]
        assert not i.is_contiguous() and not w.is_contiguous()
        ref = fused_experts_ref(x.double(), w13.double(), w2.double(), w, i, w13_bias_LG=b13.double(),
                                w2_bias_LH=b2.double())
        config = MoEConfig(6, i.shape[1], 48, 32, dtype=torch.float32, has_bias=True)
        with knobs.override(TRITON_DIRECT=direct):
            out = TritonExperts(config).apply(x, ExpertWeights(w13, w2, b13, b2), w, i, expert_map_E=None)
        assert rel_err(out, ref) < 1e-5, cols


def test_in_place_writes_into_hidden_states():
    from fusedmoe.backends.triton.experts import TritonExperts

    x, w13, w2, b13, b2, weights, ids = _problem(40)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids,
                            w13_bias_LG=b13.double(), w2_bias_LH=b2.double())
    config = MoEConfig(6, 2, 48, 32, dtype=torch.float32, has_bias=True)
    out = TritonExperts(config).apply(x, ExpertWeights(w13, w2, b13, b2), weights, ids, expert_map_E=None,
                                      out_TH=x)
    assert out is x and rel_err(x, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("act", ["silu", "swigluoai"])
def test_batched_kernels_match_reference(dtype, act):
    from fusedmoe.backends.triton.experts import triton_batched_experts

    gen = torch.Generator().manual_seed(41)
    L, M, H, I = 5, 20, 48, 32
    x = torch.randn(L, M, H, generator=gen).to(dtype)
    counts = torch.tensor([0, 20, 3, 17, 1], dtype=torch.int32)  # an empty expert and a full one
    w13 = (torch.randn(L, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(L, H, I, generator=gen) / I**0.5).to(dtype)
    b13, b2 = torch.randn(L, 2 * I, generator=gen).to(dtype), torch.randn(L, H, generator=gen).to(dtype)
    y = triton_batched_experts(x, counts, w13, w2, b13, b2, act, 1.702, None)
    from fusedmoe.activations import apply_activation

    for e in range(L):
        n = int(counts[e])
        h = x[e, :n].double() @ w13[e].double().T + b13[e].double()
        want = apply_activation(h, act) @ w2[e].double().T + b2[e].double()
        if n:
            assert rel_err(y[e, :n], want) < TOL[dtype]
        assert (y[e, n:] == 0).all()


def test_batched_launch_packs_live_blocks():
    """Only blocks holding counted rows are work (packed first, expert order); the rest lie past
    num_rows, so their programs exit before loading weights. Counts past max_tokens are clamped;
    slots index x and y as [L*M, H] views, no padded copies."""
    from fusedmoe.backends.triton.experts import prepare_batched_launch

    L, M, H, bm = 4, 40, 8, 16  # 3 blocks of 16 per expert in the worst case
    x = torch.randn(L, M, H)
    counts = torch.tensor([17, 0, 99, 1], dtype=torch.int32)  # 2, 0, 3 (clamped to 40), 1 live blocks
    launch = prepare_batched_launch(x, counts, 6, x.dtype, "silu", 1.702, None, bm)
    assert int(launch.num_rows) == 6 * bm and launch.a.shape == (L * 48, 6)
    assert launch.x.data_ptr() == x.data_ptr() and launch.y.shape == (L * M, H)
    assert launch.block_expert.tolist() == [0, 0, 2, 2, 2, 3] + [L] * 6  # blocks past the live ones: expert L
    slots = launch.sorted_slot.view(-1, bm)
    sentinel = L * M
    assert slots[0].tolist() == list(range(16))
    assert slots[1].tolist() == [16] + [sentinel] * 15
    assert slots[2:5].flatten().tolist() == list(range(80, 120)) + [sentinel] * 8
    assert slots[5].tolist() == [120] + [sentinel] * 15
    assert (slots[6:] == sentinel).all()
    assert launch.slot_ok is None  # the batched layout has no top-k reduce to read slot flags
    # the dispatch's slot count bounds the live blocks: min(L, 58) + 58 // 16 = 7 of the 12 buffer blocks
    bounded = prepare_batched_launch(x, counts, 6, x.dtype, "silu", 1.702, None, bm, num_slots=58)
    assert bounded.a.shape == (7 * bm, 6) and bounded.sorted_slot.numel() == 7 * bm
    assert torch.equal(bounded.sorted_slot, launch.sorted_slot[: 7 * bm]) and int(bounded.num_rows) == 6 * bm
    # 3 slots, one per expert: 3 blocks, all live (one token's top-3); 40 on one expert: 3 of 6
    for live, slots, bound in (([1, 1, 1, 0], 3, 3), ([0, 40, 0, 0], 40, 6)):
        bounded = prepare_batched_launch(x, torch.tensor(live), 6, x.dtype, "silu", 1.702, None, bm, num_slots=slots)
        assert bounded.sorted_slot.numel() == bound * bm and int(bounded.num_rows) == 3 * bm
    gen = torch.Generator().manual_seed(46)  # any counts with sum <= num_slots: the live blocks fit
    for _ in range(300):
        L, M, bm = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen)), \
            (1, 2, 16, 32)[int(torch.randint(0, 4, (1,), generator=gen))]
        live = torch.randint(0, M + 1, (L,), generator=gen) * (torch.rand(L, generator=gen) < 0.6)
        slots = int(live.sum()) + int(torch.randint(0, 3, (1,), generator=gen))
        bounded = prepare_batched_launch(torch.empty(L, M, 2), live, 6, torch.float32, "silu", 1.702, None, bm,
                                         num_slots=slots)
        assert int(bounded.num_rows) <= bounded.sorted_slot.numel(), (L, M, bm, live.tolist(), slots)
        want = _batched_rows_reference(live, L, M, bounded.block_expert.numel(), bm)
        got = (bounded.sorted_slot, bounded.block_expert, bounded.num_rows)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (L, M, bm, live.tolist(), slots)
    # many experts (16 blocks per program), one long expert (64 per program), int64 counts
    for L, M, bm in ((300, 5, 16), (1, 1000, 1), (129, 33, 32)):
        live = torch.randint(0, M + 1, (L,), generator=gen) * (torch.rand(L, generator=gen) < 0.5)
        launch = prepare_batched_launch(torch.empty(L, M, 2), live, 6, torch.float32, "silu", 1.702, None, bm)
        want = _batched_rows_reference(live, L, M, launch.block_expert.numel(), bm)
        assert all(torch.equal(g, w) for g, w in zip((launch.sorted_slot, launch.block_expert, launch.num_rows), want, strict=True))


def _batched_rows_reference(counts, num_local, max_tokens, blocks, block_m):
    """The batched rows in torch ops (the kernel's specification; it replaced them)."""
    counts = counts.to(torch.int64).clamp(0, max_tokens)
    live = (counts + block_m - 1) // block_m
    ends = torch.cumsum(live, 0)
    b = torch.arange(blocks)
    expert = torch.searchsorted(ends, b, right=True)
    is_live = b < ends[-1]
    e = expert.clamp(max=num_local - 1)
    j = (b - (ends - live)[e])[:, None] * block_m + torch.arange(block_m)
    valid = is_live[:, None] & (j < counts[e][:, None])
    slot = torch.where(valid, e[:, None] * max_tokens + j, num_local * max_tokens).flatten().to(torch.int32)
    return slot, torch.where(is_live, e, num_local).to(torch.int32), (ends[-1:] * block_m).to(torch.int32)


def test_batched_slot_count_must_bound_the_live_rows():
    """num_slots sizes the grid: a count it does not cover raises (validation) before any launch."""
    from fusedmoe.backends.triton.experts import triton_batched_experts

    x, w13, w2 = torch.randn(3, 8, 32), torch.randn(3, 32, 32), torch.randn(3, 32, 16)
    counts = torch.tensor([8, 20, 1], dtype=torch.int32)  # 8 + 8 (clamped) + 1 live rows
    with pytest.raises(ValueError, match="num_slots=16 must bound the live rows, but num_tokens counts 17"):
        triton_batched_experts(x, counts, w13, w2, None, None, "silu", 1.702, None, 16)
    y = triton_batched_experts(x, counts, w13, w2, None, None, "silu", 1.702, None, 17)
    torch.testing.assert_close(y, triton_batched_experts(x, counts, w13, w2, None, None, "silu", 1.702, None),
                               rtol=0, atol=0)


@pytest.mark.parametrize("counts", [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1., 2, 3, 4]),
                                    torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)])
def test_batched_counts_are_checked_before_any_launch(counts):
    from fusedmoe.backends.triton.experts import triton_batched_experts

    x, w13, w2 = torch.randn(4, 8, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    with pytest.raises(ValueError, match=r"one integer count per local expert on cpu: shape \(4,\)"):
        triton_batched_experts(x, counts, w13, w2, None, None, "silu", 1.702, None)


def test_batched_end_to_end_through_modular():
    """dispatch -> batched kernels -> combine equals the contiguous result (expert_map included)."""
    from fusedmoe.backends.triton.experts import BatchedTritonExperts
    from fusedmoe.modular import make_modular

    x, w13, w2, b13, b2, weights, ids = _problem(42, T=13, E=7, K=3)
    config = MoEConfig(7, 3, 48, 32, dtype=torch.float32, has_bias=True, activation_format="batched")
    kernel = make_modular(config, BatchedTritonExperts(config))
    out = kernel(x, ExpertWeights(w13, w2, b13, b2), weights, ids)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids,
                            w13_bias_LG=b13.double(), w2_bias_LH=b2.double())
    assert rel_err(out, ref) < 1e-5
    # weight on input (top_k = 1)
    x, w13, w2, _, _, weights, ids = _problem(43, K=1, bias=False)
    config = MoEConfig(6, 1, 48, 32, dtype=torch.float32, apply_router_weight_on_input=True,
                       activation_format="batched")
    out = make_modular(config, BatchedTritonExperts(config))(x, ExpertWeights(w13, w2), weights, ids)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids, apply_router_weight_on_input=True)
    assert rel_err(out, ref) < 1e-5


def test_batched_tiles_are_chosen_for_the_dispatched_slots():
    """The buffer holds L * max_tokens rows, the dispatch filled at most num_slots of them: the
    tiles are the standard layout's for those slots and that top_k (its tuned entries serve)."""
    from fusedmoe.backends.triton.experts import GemmProblem, batched_problem

    x = torch.empty(8, 1024, 64, dtype=torch.bfloat16)
    want = GemmProblem(4096, 8, 64, 32, 2, True, torch.bfloat16)  # T = 2048 tokens, top-2
    assert batched_problem(x, 32, True, 4096, 2) == want
    every_row = GemmProblem(8 * 1024, 8, 64, 32, 1, True, torch.bfloat16)
    assert batched_problem(x, 32, True) == every_row  # unknown: every buffer row may be live
    assert batched_problem(x, 32, True, 10**6, 2) == every_row  # never past the buffer
    assert batched_problem(x, 32, True, 4095, 2).top_k == 1  # slots not whole tokens: top-1 rows
    assert batched_problem(x, 32, True, 4096, 0).top_k == 1


def test_batched_dispatch_hands_its_slot_count_to_the_tiles(monkeypatch):
    """ModularMoE passes the local dispatch's T*K slots and top_k through the custom op's body to
    the tile choice (W8A8: test_triton_quant; the expert-parallel dispatch hands its received
    rows as top-1 rows: test_distributed)."""
    from fusedmoe.backends.triton.experts import BatchedTritonExperts
    from fusedmoe.modular import make_modular

    seen = []
    real = experts_mod.batched_problem
    monkeypatch.setattr(experts_mod, "batched_problem", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    x, w13, w2, _, _, weights, ids = _problem(45, T=13, E=7, K=3, bias=False)
    config = MoEConfig(7, 3, 48, 32, dtype=torch.float32, activation_format="batched")
    out = make_modular(config, BatchedTritonExperts(config))(x, ExpertWeights(w13, w2), weights, ids)
    assert [(p.num_slots, p.top_k, p.num_local_experts) for p in seen] == [(39, 3, 7)]
    assert rel_err(out, fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids)) < 1e-5


@pytest.mark.parametrize("case", [
    dict(T=13, E=7, K=3, M=13),  # max_tokens = T: nothing dropped
    dict(T=40, E=5, K=2, M=9, on_input=True),  # experts past max_tokens: slots dropped (dest -1)
    dict(T=29, E=9, K=3, M=29, local=5, bad_ids=True),  # expert_map with unmapped experts, ids -1 / >= E
    dict(T=1, E=128, K=8, M=1),  # decode
    dict(T=0, E=4, K=2, M=3),
    dict(T=300, E=6, K=4, M=300, H=37),  # 1200 slots: the chunked alignment; odd H
    dict(T=17, E=6, K=2, M=17, strided=True),  # ids / weights: every other column of a top-4
], ids=["plain", "dropped-on-input", "expert-map", "decode", "empty", "chunked-odd-h", "strided"])
def test_batched_dispatch_and_combine_kernels_match_the_torch_ops(case):
    """The GPU dispatch / combine (backends.triton.batched) against the torch ops CPU tensors take:
    the same counts, rows, buffer rows and (up to fp32 summation order) sums; rows past a count
    are neither written by the dispatch nor read by the combine (poisoned here)."""
    from fusedmoe.backends.triton.batched import batched_combine, batched_dispatch
    from fusedmoe.modular import BatchedHandle, BatchedLocalPrepareFinalize

    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    T, E, K, M, H = case["T"], case["E"], case["K"], case["M"], case.get("H", 48)
    L = case.get("local", E)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)] or [torch.empty(0, K)])
    ids = ids.to(torch.int32).reshape(T, K)
    if case.get("bad_ids") and T:
        ids[0, 0], ids[1, 1] = -1, E + 3
    emap = None
    if L < E:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[torch.randperm(E, generator=gen)[:L]] = torch.arange(L, dtype=torch.int32)
    w = torch.rand(T, K, generator=gen)
    if case.get("strided"):  # the same values as column views of wider tensors
        ids = torch.stack([ids, torch.zeros_like(ids)], 2).reshape(T, 2 * K)[:, ::2]
        w = torch.stack([w, torch.zeros_like(w)], 2).reshape(T, 2 * K)[:, ::2]
        assert not ids.is_contiguous() and not w.is_contiguous()
    on_input = case.get("on_input", False)
    pf = BatchedLocalPrepareFinalize(E, weight_on_input=on_input, max_tokens=M)
    pf.num_local = L
    want_b, want_counts, want_dest, want_raw = pf._dispatch_torch(x, w, ids, emap, M)
    x_b, counts, dest, raw = batched_dispatch(x, w, ids, emap, E, L, M, on_input)
    assert torch.equal(counts, want_counts) and torch.equal(dest, want_dest)
    assert torch.equal(raw.long(), want_raw.long())
    for e in range(L):
        assert torch.equal(x_b[e, : int(counts[e])], want_b[e, : int(counts[e])])
    y = torch.randn(L, M, H, generator=gen)
    for e in range(L):
        y[e, int(counts[e]):] = float("nan")  # past the count: never read
    out = batched_combine(y, dest, w, on_input)
    want = pf.combine(y, BatchedHandle(want_dest, w))
    assert out.shape == (T, H) and not out.isnan().any()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_batched_eager_calls_skip_the_custom_op_dispatch(monkeypatch):
    """Plain eager batched calls run the op's body (modular.call_op); autograd inputs take the op."""
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton.experts import BatchedTritonExperts

    gen = torch.Generator().manual_seed(12)
    config = MoEConfig(4, 1, 32, 16, dtype=torch.float32, activation_format="batched")
    x = torch.randn(4, 3, 32, generator=gen)
    counts = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    w = ExpertWeights(torch.randn(4, 32, 32, generator=gen) / 6, torch.randn(4, 32, 16, generator=gen) / 4)
    used = []
    op = experts_mod.triton_batched_experts_op
    monkeypatch.setattr(experts_mod, "triton_batched_experts_op", lambda *a, **k: used.append(1) or op(*a, **k))
    eager = BatchedTritonExperts(config).apply_batched(x, counts, w)
    assert used == [] and eager.shape == x.shape
    trainable = ExpertWeights(w.w13.clone().requires_grad_(), w.w2)
    out = BatchedTritonExperts(config).apply_batched(x, counts, trainable)
    assert used == [1]
    torch.testing.assert_close(out.detach(), eager, rtol=0, atol=0)


def test_batched_overflow_is_reported_when_validating():
    from fusedmoe.modular import BatchedLocalPrepareFinalize

    x = torch.randn(4, 8)
    ids = torch.tensor([[1, 1], [1, 1], [0, 2], [2, 0]], dtype=torch.int32)  # expert 1 gets 4 slots
    pf = BatchedLocalPrepareFinalize(3, weight_on_input=False, validate=True)
    with pytest.raises(ValueError, match="an expert receives 4 slots but the batched buffers hold max_tokens=3"):
        BatchedLocalPrepareFinalize(3, weight_on_input=False, max_tokens=3, validate=True).dispatch(
            x, torch.rand(4, 2), ids, None, 3)
    x_b, counts, _ = pf.dispatch(x, torch.rand(4, 2), ids, None, 3)
    assert counts.tolist() == [2, 4, 2] and x_b.shape == (3, 4, 8)


def test_batched_opcheck():
    from fusedmoe.backends.triton.experts import triton_batched_experts_op

    gen = torch.Generator().manual_seed(44)
    x = torch.randn(3, 16, 32, generator=gen)
    counts = torch.tensor([16, 0, 5], dtype=torch.int32)
    torch.library.opcheck(
        triton_batched_experts_op,
        (x, counts, torch.randn(3, 32, 32, generator=gen) / 6, torch.randn(3, 32, 16, generator=gen) / 4,
         None, None, "silu", 1.702, None),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("group_m", [1, 4, 8, 32])
def test_grouped_program_order_covers_every_tile(group_m):
    """12+ row blocks (a partial last group of group_m) x 5-6 N tiles: every output written once,
    in each program order (group_m 1: row-major; 32: one group over every row block)."""
    gen = torch.Generator().manual_seed(60 + group_m)
    T, E, K, H, I = 60, 5, 2, 96, 80
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K)
    tiles = (TileConfig(16, 16, 32, 4, 2, group_m=group_m), TileConfig(16, 16, 32, 4, 2, group_m=group_m))
    out = triton_experts(x, w13, w2, weights, ids, None, None, None, E, "silu", False, 1.702, None, tiles=tiles)
    ref = fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids)
    assert rel_err(out, ref) < 1e-5


def _seven_experts(seed: int, T: int, bias: bool) -> tuple:
    """x, w13, w2, b13, b2, weights, ids on E = 7 experts (expert 3 gets no token), K = 2, with
    tail N and K tiles for 16-32 wide tiles (H = 72, I = 40); biases when `bias`."""
    gen = torch.Generator().manual_seed(seed)
    E, K, H, I = 7, 2, 72, 40
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    b13, b2 = (torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)) if bias else (None, None)
    logits = torch.randn(T, E, generator=gen)
    logits[:, 3] = -1e9  # expert 3 gets no token
    weights, ids = select_experts(x, logits, K)
    return x, w13, w2, b13, b2, weights, ids


def _ref_f64(x, w13, w2, b13, b2, weights, ids, act: str, on_input: bool) -> torch.Tensor:
    """fused_experts_ref in float64 (biases when given)."""
    return fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids, activation=act,
                             w13_bias_LG=None if b13 is None else b13.double(),
                             w2_bias_LH=None if b2 is None else b2.double(), apply_router_weight_on_input=on_input)


def _off_and_on(problem, act: str, on_input: bool, tiles_of, **kw) -> list[torch.Tensor]:
    """triton_experts' outputs (NaN-poisoned first) with tiles_of(False) and tiles_of(True): a tile
    flag off, then on."""
    x, w13, w2, b13, b2, weights, ids = problem
    outs = []
    for flag in (False, True):
        out = torch.full_like(x, float("nan"))
        triton_experts(x, w13, w2, weights, ids, b13, b2, None, w13.shape[0], act, on_input, 1.702, None,
                       tiles=tiles_of(flag), out=out, **kw)
        outs.append(out)
    return outs


@pytest.mark.parametrize("bias,on_input,programs", [(False, False, 1), (True, False, 3), (True, True, 5)],
                         ids=["plain-1", "bias-3", "bias-on-input-5"])
def test_persistent_gemm2_matches_the_tile_per_program_launch(monkeypatch, bias, on_input, programs):
    """The persistent GEMM2 (TileConfig.persistent): `programs` programs stride over every real
    (row block, N tile) tile in one loop; the output is bitwise the tile-per-program launch's (the
    same tiles, the same K order), on E = 7 experts (one with no tokens, padded row blocks, tail
    N and K tiles: H = 72, I = 40), with biases and the routed weight on the input or the output."""
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: programs)
    problem = _seven_experts(70 + programs, 37, bias)
    t1 = TileConfig(16, 16, 32, 4, 2)
    outs = _off_and_on(problem, "silu", on_input, lambda p: (t1, TileConfig(16, 32, 16, 4, 2, persistent=p)))
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], _ref_f64(*problem, "silu", on_input)) < 1e-5


@pytest.mark.parametrize("act,one_dot,bias,on_input,programs", [
    ("silu", True, False, False, 1), ("swigluoai", True, True, False, 3), ("silu", True, True, True, 5),
    ("silu", False, True, False, 2), ("gelu_no_mul", False, True, False, 4),
], ids=["one-dot-1", "one-dot-swigluoai-bias-3", "one-dot-bias-on-input-5", "two-dots-bias-2", "ungated-4"])
def test_persistent_gemm1_matches_the_tile_per_program_launch(monkeypatch, act, one_dot, bias, on_input, programs):
    """The persistent GEMM1 (TileConfig.persistent on GEMM1): `programs` programs stride over
    every real (row block, N tile) tile in one loop, each running the tile-per-program body, so
    the output is bitwise that launch's: one dot or two, gated or not, on E = 7 experts (one with
    no tokens, padded row blocks, a tail N tile: I = 40 over 16-wide tiles, a K tail: H = 72),
    with biases and the routed weight on the input."""
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: programs)
    x, w13, w2, b13, b2, weights, ids = problem = _seven_experts(90 + programs, 37, bias)
    if not is_gated(act):  # an ungated layer's w13 (and bias) is [E, I, H]
        w13, b13 = w13[:, :40].contiguous(), None if b13 is None else b13[:, :40].contiguous()
        problem = (x, w13, w2, b13, b2, weights, ids)
    t2 = TileConfig(16, 32, 16, 4, 2)
    outs = _off_and_on(problem, act, on_input,
                       lambda p: (TileConfig(16, 16, 32, 4, 2, one_dot=one_dot, persistent=p), t2))
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], _ref_f64(*problem, act, on_input)) < 1e-5


def test_persistent_tile_predicate_and_table_round_trip():
    """persistent runs on the aligned path's unquantized GEMMs, GEMM1 with its K unsplit, and its
    weight-only 4-bit GEMM2 (the predicate says so for split-K, W8A8, the other weight-only GEMMs
    and the direct path); a table writes it as
    the 9th value, after swap_ab and group_m, and reads it back for either GEMM."""
    from fusedmoe.backends.triton.tiles import check_plan
    from fusedmoe.backends.triton.tuning import nearest, parse_table

    p = TileConfig(128, 256, 64, 8, 3, persistent=True)
    assert check_tile(p, dtype=torch.bfloat16) is None
    assert check_tile(replace(p, block_n=128), dtype=torch.bfloat16, operands=2, allow_split=True) is None
    only = "only the aligned path's unquantized GEMMs"
    assert only in check_tile(replace(p, block_n=64, split_k=2), dtype=torch.bfloat16, operands=2, allow_split=True)
    assert only in check_tile(replace(p, block_n=128), dtype=torch.bfloat16, quant="channel")
    # the weight-only 4-bit GEMM2 runs one too; its GEMM1 and the 8-bit weight-only GEMMs do not
    w4 = TileConfig(16, 128, 128, 4, 3, persistent=True)
    assert check_tile(w4, dtype=torch.bfloat16, quant="w4", group=32) is None
    assert only in check_tile(w4, dtype=torch.bfloat16, operands=2, allow_split=True, quant="w4", group=32)
    assert only in check_tile(w4, dtype=torch.bfloat16, quant="w8")
    for t1, t2 in ((TileConfig(16, 64, 128), TileConfig(16, 64, 128, persistent=True)),
                   (TileConfig(16, 64, 128, persistent=True), TileConfig(16, 64, 128))):
        assert "the direct path runs one program per slot" in check_plan(t1, t2, direct=True, dtype=torch.bfloat16,
                                                                          gated=True)
    assert "must be true or false" in check_tile(replace(p, persistent=1), dtype=torch.bfloat16)
    assert p.as_list() == [128, 256, 64, 8, 3, 1, None, 8, True]
    assert TileConfig(128, 256, 64, 8, 3).as_list() == [128, 256, 64, 8, 3, 1]
    g1 = TileConfig(128, 128, 64, 8, 4, persistent=True, one_dot=True)
    entry = _entry(4096, g1=tuple(g1.as_list()), g2=tuple(p.as_list()))
    t1, t2 = nearest(parse_table(_table([entry]), "t.json"), ("bfloat16", 128, 2048, 768, 8, True, None), 4096)
    assert (t1, t2) == (g1, p)
    with pytest.raises(ValueError, match="gemm1 .*only the aligned path's unquantized GEMMs"):
        parse_table(_table([_entry(4096, g1=(128, 64, 64, 8, 3, 2, None, 8, True), g2=(128, 64, 64, 8, 3))]), "t")
    with pytest.raises(ValueError, match="malformed.*persistent=1 is not true/false"):
        parse_table(_table([_entry(4096, g2=(128, 64, 64, 8, 3, 1, None, 8, 1))]), "t")


@pytest.mark.parametrize("act,bias,on_input,split,direct", [
    ("silu", False, False, 1, False), ("swigluoai", True, False, 1, False), ("silu", True, True, 1, False),
    ("gelu", True, False, 2, False), ("silu", True, False, 1, True),
], ids=["silu", "swigluoai-bias", "bias-on-input", "split-k", "direct"])
def test_one_dot_gemm1_matches_two_dots(act, bias, on_input, split, direct):
    """The one-dot GEMM1 (TileConfig.one_dot: gate over up as one [2 * block_n]-wide operand, the
    accumulator split after the K loop) against the two-dot launch and the reference: E = 7 (one
    expert with no tokens), a tail N tile (I = 40 over 16-wide tiles) and a K tail (H = 72), with
    biases, the routed weight on the input, split-K partials and the direct decode path."""
    problem = _seven_experts(80 + split + 2 * direct, 3 if direct else 37, bias)
    t2 = TileConfig(16, 32, 16, 4, 2)
    outs = _off_and_on(problem, act, on_input, lambda o: (TileConfig(16, 16, 32, 4, 2, split_k=split, one_dot=o), t2),
                       direct=direct)
    assert rel_err(outs[1], outs[0]) < 1e-6
    assert rel_err(outs[1], _ref_f64(*problem, act, on_input)) < 1e-5


def test_one_dot_tile_predicate_and_table_round_trip():
    """one_dot runs on the unquantized and the weight-only 4-bit gated GEMM1 only, with at most 256
    weight rows a step (the predicate says so for GEMM2, ungated GEMM1 and the other quantized
    GEMMs); a table writes it as
    the 10th value, after swap_ab, group_m and persistent, and reads it back."""
    from fusedmoe.backends.triton.tiles import check_plan
    from fusedmoe.backends.triton.tuning import nearest, parse_table

    o = TileConfig(128, 128, 64, 8, 4, one_dot=True)
    assert check_tile(o, dtype=torch.bfloat16, operands=2, allow_split=True) is None
    only = "only the unquantized and the weight-only 4-bit gated GEMM1"
    assert only in check_tile(o, dtype=torch.bfloat16)
    assert only in check_tile(o, dtype=torch.bfloat16, operands=2, quant="channel")
    assert only in check_tile(o, dtype=torch.bfloat16, operands=2, quant="w8")
    assert check_tile(replace(o, block_m=16), dtype=torch.bfloat16, operands=2, allow_split=True, quant="w4",
                      group=32) is None
    assert only in check_plan(o, TileConfig(128, 128, 64, 8, 4), direct=False, dtype=torch.bfloat16, gated=False)
    assert "makes a 512-row weight tile" in check_tile(replace(o, block_n=256), dtype=torch.bfloat16, operands=2)
    assert "must be true or false" in check_tile(replace(o, one_dot=1), dtype=torch.bfloat16, operands=2)
    assert o.as_list() == [128, 128, 64, 8, 4, 1, None, 8, False, True]
    entry = _entry(4096, g1=tuple(o.as_list()), g2=(128, 64, 64, 8, 3))
    t1, _ = nearest(parse_table(_table([entry]), "t.json"), ("bfloat16", 128, 2048, 768, 8, True, None), 4096)
    assert t1 == o
    with pytest.raises(ValueError, match="gemm2 .*only the unquantized and the weight-only 4-bit gated GEMM1"):
        parse_table(_table([_entry(4096, g1=(128, 64, 64, 8, 3), g2=(128, 64, 64, 8, 3, 1, None, 8, False, True))]),
                    "t")
    with pytest.raises(ValueError, match="malformed.*one_dot=1 is not true/false"):
        parse_table(_table([_entry(4096, g1=(128, 64, 64, 8, 3, 1, None, 8, False, 1))]), "t")


def test_pdl_launch_keywords(monkeypatch):
    """Programmatic dependent launch only on CUDA devices, and FUSEDMOE_PDL=0 turns it off
    before the device is even looked at (the interpreter launches plainly)."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton.experts import pdl

    assert pdl(torch.device("cpu")) == {}
    with knobs.override(PDL=False):
        assert pdl(torch.device("cuda", 0)) == {}
    monkeypatch.setenv("FUSEDMOE_PDL", "maybe")
    for device in (torch.device("cuda", 0), torch.device("cpu")):  # refused on CPU tensors too
        with pytest.raises(ValueError, match="FUSEDMOE_PDL='maybe'"):
            pdl(device)


@pytest.mark.parametrize("direct", [None, False], ids=["auto", "aligned"])
@pytest.mark.parametrize("knob", ["TRITON_TMA", "TRITON_DIRECT", "TUNED_SIBLINGS", "TUNED_PACKAGED"])
def test_bad_knob_raises_before_any_launch_unquantized(direct, knob, monkeypatch):
    """The unquantized path reads its plan's knobs (memoized_tiles: TRITON_TMA, TRITON_DIRECT with
    TUNED_DIR, TUNED_PACKAGED and TUNED_SIBLINGS) before the alignment launches, so a bad value raises with nothing launched (W8A8
    reads its own in quant._call_knobs: test_triton_quant.py)."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel launched before the knob was read")

    monkeypatch.setattr(experts_mod, "align", launched)
    monkeypatch.setattr(experts_mod, "prepare_direct_launch", launched)
    monkeypatch.setenv(f"FUSEDMOE_{knob}", "fast")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 64, generator=gen)
    w, ids = select_experts(x, torch.randn(40, 4, generator=gen), 2)
    with pytest.raises(ValueError, match=f"FUSEDMOE_{knob}='fast'"):
        triton_experts(x, torch.randn(4, 64, 64, generator=gen), torch.randn(4, 64, 32, generator=gen), w, ids,
                       None, None, None, 4, "silu", False, 1.702, None, direct=direct)


def test_tuned_tables_of_a_sibling_gpu_serve_missing_shapes(tmp_path, monkeypatch):
    """A GPU whose tables have no entry for a shape borrows a sibling GPU's (tuning.SIBLINGS: the
    same architecture, SM count, shared memory and L2); its own entries win where it has them;
    FUSEDMOE_TUNED_SIBLINGS=0 reads its own tables only; explain names the table."""
    import json

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton.experts import GemmProblem, choose_tiles, describe_plan

    assert tuning.SIBLINGS["NVIDIA H100 80GB HBM3"] == ("NVIDIA H200",)  # measured (docs/perf-notes.md)
    own = (TileConfig(16, 32, 128, 4, 4), TileConfig(16, 64, 64, 4, 4))
    theirs = (TileConfig(16, 128, 128, 4, 3), TileConfig(16, 64, 128, 4, 3))
    (tmp_path / "Fake_GPU_A.json").write_text(json.dumps(_table([
        _entry(16, g1=tuple(own[0].as_list()), g2=tuple(own[1].as_list()))])))
    (tmp_path / "Fake_GPU_B.json").write_text(json.dumps(_table([
        _entry(16, g1=tuple(theirs[0].as_list()), g2=tuple(theirs[1].as_list()), path="aligned"),
        _entry(256, g1=tuple(theirs[0].as_list()), g2=tuple(theirs[1].as_list()), path="aligned")])))
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU A")
    monkeypatch.setattr(tuning, "SIBLINGS", {"Fake GPU A": ("Fake GPU B",)})
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here
    at16 = GemmProblem(16 * 8, 128, 2048, 768, 8, True, torch.bfloat16)
    at256 = GemmProblem(256 * 8, 128, 2048, 768, 8, True, torch.bfloat16)
    with knobs.override(TUNED_DIR=str(tmp_path), TRITON_TMA=False):
        assert choose_tiles(at16, cuda) == own  # its own entry
        assert choose_tiles(at256, cuda) == theirs  # none of its own: the sibling's
        assert describe_plan(at256, None, cuda)["gemm1"]["source"] == "tuned table of Fake GPU B"
        assert describe_plan(at16, None, cuda)["gemm1"]["source"] == "tuned table"
        with knobs.override(TUNED_SIBLINGS=False):
            assert choose_tiles(at256, cuda) not in (own, theirs)  # the heuristic
            assert describe_plan(at256, None, cuda)["gemm1"]["source"] == "heuristic"
        # a shape with an entry of its own on any path borrows nothing: the sibling's timed plan
        # (path "aligned") does not override this GPU's path-less entry
        assert tuning.lookup_plan(at16, cuda) is None and tuning.lookup_plan(at256, cuda).borrowed == "Fake GPU B"


def test_tuned_packaged_off_reads_the_tuned_dir_only(tmp_path, monkeypatch):
    """FUSEDMOE_TUNED_PACKAGED=0 leaves the packaged tables out: a shape they cover runs the
    heuristic unless FUSEDMOE_TUNED_DIR has an entry (an A/B of the heuristic where the packaged
    tables have entries); the memoized plans follow the knob."""
    import json

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton.experts import GemmProblem, choose_tiles, describe_plan, heuristic

    packaged_dir, user_dir = tmp_path / "packaged", tmp_path / "user"
    packaged_dir.mkdir(), user_dir.mkdir()
    theirs = (TileConfig(16, 64, 128, 4, 4), TileConfig(16, 32, 128, 4, 3))
    own = (TileConfig(16, 32, 128, 4, 4), TileConfig(16, 64, 64, 4, 4))
    (packaged_dir / "Fake_GPU.json").write_text(json.dumps(_table([
        _entry(m, g1=tuple(theirs[0].as_list()), g2=tuple(theirs[1].as_list())) for m in (16, 256)])))
    (user_dir / "Fake_GPU.json").write_text(json.dumps(_table([
        _entry(16, g1=tuple(own[0].as_list()), g2=tuple(own[1].as_list()))])))
    monkeypatch.setattr(tuning, "PACKAGED", packaged_dir)
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: 132)
    experts_mod.clear_tile_caches()
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here
    at16, at256 = (GemmProblem(m * 8, 128, 2048, 768, 8, True, torch.bfloat16) for m in (16, 256))
    with knobs.override(TUNED_DIR=str(user_dir), TRITON_TMA=False):
        assert choose_tiles(at16, cuda) == own and choose_tiles(at256, cuda) == theirs  # folder first, then packaged
        with knobs.override(TUNED_PACKAGED=False):
            assert choose_tiles(at16, cuda) == own  # the folder's entry still serves
            assert tuning.lookup(at256, cuda) is None
            t1 = heuristic(at256.num_slots, 128, 768, 2048, torch.bfloat16, gated=True, num_sms=132)
            assert choose_tiles(at256, cuda)[0] == t1 != theirs[0]
            assert describe_plan(at256, None, cuda)["gemm1"]["source"] == "heuristic"
        assert choose_tiles(at256, cuda) == theirs  # memoized per knob value
    monkeypatch.setenv("FUSEDMOE_TUNED_PACKAGED", "0")
    assert tuning.table_paths("Fake GPU") == []
    experts_mod.clear_tile_caches()


def test_per_tensor_fp8_takes_per_channel_entries(tmp_path, monkeypatch):
    """Per-tensor fp8 W8A8 runs per-channel fp8's kernels (a per-row scale): where it has no entry
    of its own, fp8_w8a8_channel's aligned entries serve it (tuning.SCHEME_SIBLINGS), never its
    direct ones (per-tensor has no direct path); its own entries win; FUSEDMOE_TUNED_SIBLINGS=0
    turns it off; explain names the table and scheme."""
    import json

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import quant as quant_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton.experts import GemmProblem, describe_plan
    from fusedmoe.backends.triton.quant import choose_quant_tiles
    from fusedmoe.quant.scheme import SCHEMES

    chan = (TileConfig(64, 128, 128, 4, 3), TileConfig(64, 128, 128, 4, 3, swap_ab=False))
    own = (TileConfig(32, 64, 128, 4, 3), TileConfig(32, 64, 128, 4, 3))
    (tmp_path / "Fake_GPU_A.json").write_text(json.dumps(_table([
        _entry(64, g1=tuple(chan[0].as_list()), g2=(64, 128, 128, 4, 3, 1, False), quant="fp8_w8a8_channel",
               path="aligned"),
        _entry(1, g1=(16, 64, 128, 4, 3), g2=(16, 64, 128, 4, 3, 2), quant="fp8_w8a8_channel", path="direct"),
        _entry(1024, g1=tuple(own[0].as_list()), g2=tuple(own[1].as_list()), quant="fp8_w8a8_tensor_static")])))
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU A")
    monkeypatch.setattr(tuning, "SIBLINGS", {})
    for mod in (experts_mod, quant_mod):
        monkeypatch.setattr(mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here
    shape = lambda m: GemmProblem(m * 8, 128, 2048, 768, 8, True, torch.bfloat16)  # noqa: E731
    tensor, static = SCHEMES["fp8_w8a8_tensor"], SCHEMES["fp8_w8a8_tensor_static"]
    with knobs.override(TUNED_DIR=str(tmp_path), TRITON_TMA=False):
        for scheme in (tensor, static):
            assert choose_quant_tiles(shape(64), scheme, cuda) == chan
            assert tuning.lookup(shape(1), cuda, scheme, path="direct") is None  # not the direct entry
            assert tuning.lookup_plan(shape(64), cuda, scheme).borrowed == "Fake GPU A (fp8_w8a8_channel)"
        src = describe_plan(shape(64), tensor, cuda)["gemm1"]["source"]
        assert src == "tuned table of Fake GPU A (fp8_w8a8_channel)"
        assert choose_quant_tiles(shape(1024), static, cuda) == own  # its own entry
        assert choose_quant_tiles(shape(1024), tensor, cuda) not in (own, chan)  # none: the heuristic
        with knobs.override(TUNED_SIBLINGS=False):
            assert choose_quant_tiles(shape(64), tensor, cuda) != chan


def test_asymmetric_int4_takes_symmetric_entries_of_both_paths(tmp_path, monkeypatch):
    """Asymmetric int4 runs symmetric int4's kernels with a zero-point load (W_ZERO) on both paths:
    where it has no entry of its own, the symmetric twin's aligned *and* direct entries serve it
    (tuning.SCHEME_SIBLINGS; per-tensor fp8 borrows aligned ones only), each in its own layout,
    named in the entry's source; its own entries win; FUSEDMOE_TUNED_SIBLINGS=0 turns it off."""
    import dataclasses
    import json

    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts as experts_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton.experts import GemmProblem
    from fusedmoe.quant.scheme import SCHEMES

    direct = (TileConfig(16, 64, 128, 4, 3), TileConfig(16, 64, 256, 4, 4, split_k=2))
    aligned = (TileConfig(16, 64, 128, 4, 4), TileConfig(16, 64, 128, 4, 4))
    own = (TileConfig(32, 64, 128, 4, 3), TileConfig(32, 64, 128, 4, 3))
    twin = "int4_w4a16_g32"
    (tmp_path / "Fake_GPU_A.json").write_text(json.dumps(_table([
        _entry(1, g1=tuple(direct[0].as_list()), g2=tuple(direct[1].as_list()), quant=twin, path="direct",
               layout="checkpoint"),
        _entry(64, g1=tuple(aligned[0].as_list()), g2=tuple(aligned[1].as_list()), quant=twin, path="aligned",
               layout="checkpoint"),
        _entry(64, g1=(64, 64, 64, 4, 3), g2=(64, 64, 64, 4, 3), quant=twin, path="aligned", layout="fragments"),
        _entry(1024, g1=tuple(own[0].as_list()), g2=tuple(own[1].as_list()), quant="int4_w4a16_g32_zp",
               path="aligned", layout="checkpoint")])))
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Fake GPU A")
    monkeypatch.setattr(tuning, "SIBLINGS", {})
    monkeypatch.setattr(experts_mod, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # lookup reads tables for CUDA devices only; nothing runs here
    shape = lambda m: GemmProblem(m * 8, 128, 2048, 768, 8, True, torch.bfloat16, fragments=False)  # noqa: E731
    zp = SCHEMES["int4_w4a16_g32_zp"]
    with knobs.override(TUNED_DIR=str(tmp_path), TRITON_TMA=False):
        assert tuning.lookup(shape(1), cuda, zp, path="direct") == direct
        plan = tuning.lookup_plan(shape(1), cuda, zp)
        assert plan.direct and plan.borrowed == f"Fake GPU A ({twin})"
        assert tuning.lookup(shape(64), cuda, zp) == aligned  # the checkpoint layout's, not the fragments'
        laid = dataclasses.replace(shape(64), fragments=True)
        assert tuning.lookup(laid, cuda, zp) == (TileConfig(64, 64, 64, 4, 3), TileConfig(64, 64, 64, 4, 3))
        assert tuning.lookup(shape(1024), cuda, zp) == own
        fp8 = SCHEMES["fp8_w8a8_tensor"]  # its twin's direct entries never serve it
        assert tuning.SCHEME_SIBLINGS[fp8.name][1] == ("aligned", None)
        with knobs.override(TUNED_SIBLINGS=False):
            assert tuning.lookup(shape(1), cuda, zp, path="direct") is None
            assert tuning.lookup(shape(64), cuda, zp) is None


def test_fit_k_caps_block_k_at_the_k_dimension():
    """K steps no wider than K rounded up to a power of two (at least 32), and no wider than 64 for
    a 16-row, 128-wide tile at 4 warps where K is not a multiple of 16: Triton 3.6 compiled the GEMM1
    tile 16 x 128 x 128 at 4 warps to out-of-bounds shared-memory reads there (an illegal memory
    access on an H200 at H = 8, 11, 13, 24, 136, 200, 2888; GPU fuzz seed 90064)."""
    from fusedmoe.backends.triton.experts import GemmProblem, fit_k, plan_tiles

    tile = TileConfig(16, 128, 128, 4, 3)
    small = TileConfig(16, 16, 256, 4, 4)

    def fitted(hidden, inter, t1=tile, t2=small):
        return fit_k(t1, t2, GemmProblem(1152, 257, hidden, inter, 6, True, torch.bfloat16))

    assert fitted(11, 688) == (TileConfig(16, 128, 32, 4, 3), small)
    assert fitted(8, 688)[0].block_k == 32 and fitted(24, 688)[0].block_k == 32
    assert fitted(136, 688)[0].block_k == 64 and fitted(2888, 688)[0].block_k == 64
    assert fitted(2880, 688) == (tile, small)  # a multiple of 16: as planned
    assert fitted(2880, 20)[1].block_k == 32  # GEMM2's K is I
    assert fitted(2888, 688, t1=TileConfig(16, 128, 128, 8, 3))[0].block_k == 128  # 8 warps ran
    assert fitted(2888, 688, t1=TileConfig(16, 64, 128, 4, 3))[0].block_k == 128  # 64 wide ran
    assert fitted(2888, 688, t1=TileConfig(64, 128, 128, 4, 3))[0].block_k == 128  # 64 rows: not seen to fail
    # every call's tiles pass through it, given ones too
    problem = GemmProblem(1152, 257, 11, 688, 6, True, torch.bfloat16)
    _, t1, _ = plan_tiles(problem, None, torch.device("cpu"), (tile, small), direct=False)
    assert t1.block_k == 32
