"""`fusedmoe tune`'s launch glue on the CPU, through the Triton interpreter (fp32, small sizes).

The tuner times GEMM1 and GEMM2 of each path apart (tune._gemms); run once and reduced, they
give bitwise what the experts op gives with the same tiles. Timing itself needs a GPU.
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # these build CPU tensors for the interpreter
    pytest.skip("interpreter tests (CPU)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fusedmoe import knobs, select_experts  # noqa: E402
from fusedmoe.backends.triton.experts import launch_reduce, triton_experts  # noqa: E402
from fusedmoe.backends.triton.quant import triton_quant_experts  # noqa: E402
from fusedmoe.backends.triton.tiles import TileConfig  # noqa: E402
from fusedmoe.quant.scheme import get_scheme  # noqa: E402
from fusedmoe.quant.weights import quantize_weights  # noqa: E402
from fusedmoe.tune import _gemms  # noqa: E402

T, E, K, H, I = 5, 4, 2, 128, 64  # noqa: E741
# (GEMM1 tile the intermediate is made with, another GEMM1 tile, GEMM2 tile)
TILES = {
    None: ((16, 64, 32, 4, 1), (16, 32, 64, 4, 1, 2), (16, 64, 64, 4, 1)),
    "fp8_w8a8_block": ((16, 128, 64, 4, 1), (16, 64, 64, 4, 1, 2), (16, 64, 128, 4, 1)),  # fused 1x128 epilogue
    "fp8_w8a8_tensor": ((16, 64, 64, 4, 1), (16, 32, 64, 4, 1), (16, 64, 64, 4, 1)),
    "int4_w4a16_g32": ((16, 64, 32, 4, 1), (16, 32, 64, 4, 1), (16, 64, 64, 4, 1)),
}


def _copies(scheme, gen, bias: bool) -> list[tuple]:
    """Two weight copies as the tuner holds them: (w13, w2, QuantParams or None, b13, b2)."""
    copies = []
    for _ in range(2):
        w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
        b13, b2 = (torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)) if bias else (None, None)
        q13, q2, params = (w13, w2, None) if scheme is None else quantize_weights(w13, w2, scheme)
        copies.append((q13, q2, params, b13, b2))
    return copies


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("quant", list(TILES), ids=[str(q) for q in TILES])
def test_tuner_gemms_match_the_experts_op(quant, bias):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K)
    scheme = get_scheme(quant)
    copies = _copies(scheme, gen, bias)
    fill, other, tile2 = (TileConfig(*t) for t in TILES[quant])
    gemm1, gemm2, launch = _gemms(scheme, copies, x, weights, ids, E, I, "silu", fill)
    gemm1(1, other)  # a timed GEMM1: GEMM2 keeps reading the intermediate `fill` made
    gemm2(0, tile2)
    out = torch.empty_like(x)
    launch_reduce(launch, out)
    q13, q2, params, b13, b2 = copies[0]
    if scheme is None:
        ref = triton_experts(x, q13, q2, weights, ids, b13, b2, None, E, "silu", False, 1.702, None,
                             tiles=(fill, tile2))
    else:
        ref = triton_quant_experts(x, q13, q2, weights, ids, b13, b2, None, E, "silu", False, 1.702,
                                   None, scheme, params.w13_scale, params.w2_scale, params.a13_scale,
                                   params.a2_scale, tiles=(fill, tile2),
                                   w13_global_scale=params.w13_global_scale,
                                   w2_global_scale=params.w2_global_scale)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("quant", [None, "int4_w4a16_g32", "fp8_w8a8_block", "int8_w8a8"], ids=str)
def test_tuner_direct_gemms_match_the_direct_path(quant, bias):
    """The direct path's GEMMs as the tuner times them (a timed GEMM1 with split-K, GEMM2 in two
    slot shares) give bitwise what the experts op's direct path gives with the same tiles."""
    from fusedmoe.tune import _direct_gemms

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, H, generator=gen)
    weights, ids = select_experts(x, torch.randn(3, E, generator=gen), K)
    scheme = get_scheme(quant)
    copies = _copies(scheme, gen, bias)
    fill, other, tile2 = TileConfig(16, 64, 32, 4, 1), TileConfig(16, 32, 64, 4, 1, 2), TileConfig(16, 64, 64, 4, 1, 2)
    gemm1, gemm2, _, out = _direct_gemms(scheme, copies, x, weights, ids, E, I, "silu", fill)
    gemm1(1, other)  # timed: GEMM2 keeps reading the intermediate `fill` made
    out.fill_(float("nan"))
    gemm2(0, tile2)
    q13, q2, params, b13, b2 = copies[0]
    if scheme is None:
        ref = triton_experts(x, q13, q2, weights, ids, b13, b2, None, E, "silu", False, 1.702, None,
                             tiles=(fill, tile2), direct=True)
    else:
        ref = triton_quant_experts(x, q13, q2, weights, ids, b13, b2, None, E, "silu", False, 1.702,
                                   None, scheme, params.w13_scale, params.w2_scale, None, None,
                                   tiles=(fill, tile2), direct=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("quant", [None, "int4_w4a16_g32", "fp8_w8a8_block", "nvfp4_w4a16"], ids=str)
def test_tuner_whole_calls_are_the_experts_op(quant):
    """The whole calls the tuner confirms an entry with run the experts op with the plan's path
    and tiles on the weight copy asked for: bitwise its output (nvfp4: the global scales passed)."""
    from fusedmoe.tune import WholePlan, _whole_calls

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, H, generator=gen)
    weights, ids = select_experts(x, torch.randn(3, E, generator=gen), K)
    scheme = get_scheme(quant)
    copies = _copies(scheme, gen, bias=True)
    call, out = _whole_calls(scheme, copies, x, weights, ids, E, "silu")
    for direct in (False, True):
        if quant == "fp8_w8a8_block" and not direct:  # GEMM1's 1x128 epilogue
            tiles = (TileConfig(16, 128, 64, 4, 1), TileConfig(16, 64, 128, 4, 1))
        else:
            tiles = (TileConfig(16, 64, 32, 4, 1), TileConfig(16, 64, 64, 4, 1))
        out.fill_(float("nan"))
        call(WholePlan(direct, *tiles))(1)
        q13, q2, params, b13, b2 = copies[1]
        if scheme is None:
            ref = triton_experts(x, q13, q2, weights, ids, b13, b2, None, E, "silu", False, 1.702, None,
                                 tiles=tiles, direct=direct)
        else:
            ref = triton_quant_experts(x, q13, q2, weights, ids, b13, b2, None, E, "silu", False, 1.702,
                                       None, scheme, params.w13_scale, params.w2_scale, params.a13_scale,
                                       params.a2_scale, tiles=tiles, w13_global_scale=params.w13_global_scale,
                                       w2_global_scale=params.w2_global_scale, direct=direct)
        assert torch.equal(out, ref), (quant, direct)
        call(WholePlan(direct, *tiles))(0)  # another copy's weights, another output
        assert not torch.equal(out, ref)


def _model_timer(costs: dict, seen: list, calls: list | None = None):
    """A timer for tune_shape: costs[kind](tile) in us; runs each kind's launch once (it must
    run) and records every (kind, tile) timed. Whole calls (kind "call", tile a WholePlan) go to
    `calls` instead, at costs["call"](plan), or 0 where not modelled (so they confirm the search)."""
    ran = set()

    def timer(kind, tile, fn):
        if kind not in ran:
            ran.add(kind)
            fn(1)
        if kind == "call":
            if calls is not None:
                calls.append(tile)
            return costs["call"](tile) if "call" in costs else 0.0
        seen.append((kind, tile))
        return costs[kind](tile)

    return timer


def test_tune_shape_keeps_the_faster_path(tmp_path, monkeypatch):
    """tune_shape's search on a cost model (the kernels launch under the interpreter; only the
    timing is modelled): the faster path's entry is written, naming its path, when it beats the
    rule's path on heuristic tiles by > 3%; every pair it times is valid; the entry parses."""
    import dataclasses

    from fusedmoe.backends.triton.experts import GemmProblem, direct_auto, direct_heuristic
    from fusedmoe.backends.triton.tiles import check_plan, check_tile
    from fusedmoe.backends.triton.tuning import parse_table
    from fusedmoe.tune import tune_shape, write_table

    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, tokens_list=[1], dtype=torch.float32, copies=2, device=cpu)
    problem = GemmProblem(K, E, H, I, K, True, torch.float32)
    assert direct_auto(problem)  # one token: the rule runs the direct path
    d1, d2 = direct_heuristic(problem, None, 132)
    faster2 = dataclasses.replace(d2, num_stages=d2.num_stages - 1)  # one step from the heuristic
    flat = lambda us: lambda tile: us  # noqa: E731
    base = {"gemm1": flat(100.0), "gemm2": flat(100.0), "direct gemm1": flat(40.0), "direct gemm2": flat(40.0),
            "align": flat(5.0)}

    seen = []
    costs = dict(base, **{"direct gemm2": lambda tile: 30.0 if tile == faster2 else 40.0})
    [entry] = tune_shape(**shape, timer=_model_timer(costs, seen))
    assert entry["path"] == "direct" and entry["heuristic_path"] == "direct"
    assert (entry["us"], entry["heuristic_us"]) == (70.0, 80.0)
    assert entry["gemm1"] == d1.as_list() and entry["gemm2"] == faster2.as_list()
    aligned_rows = sorted({tile.block_m for kind, tile in seen if kind == "gemm1"})
    assert sorted(tile.block_m for kind, tile in seen if kind == "align") == aligned_rows  # once each
    for kind, tile in seen:  # every timed tile passes the predicates
        if kind == "align":
            continue
        if kind.startswith("direct"):
            t1, t2 = (tile, d2) if kind.endswith("gemm1") else (d1, tile)
            assert check_plan(t1, t2, direct=True, dtype=torch.float32, gated=True) is None, (kind, tile)
            assert t2.split_k <= K
        else:
            gemm1 = kind == "gemm1"
            assert check_tile(tile, dtype=torch.float32, operands=2 if gemm1 else 1, allow_split=gemm1) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    path = write_table([entry], tmp_path)
    import json

    assert len(parse_table(json.loads(path.read_text()), str(path))) == 1  # strict: every entry valid

    # the aligned path faster than the rule's direct one: an aligned entry
    costs = dict(base, gemm1=flat(30.0), gemm2=flat(30.0))
    [entry] = tune_shape(**shape, timer=_model_timer(costs, []))
    assert (entry["path"], entry["heuristic_path"], entry["us"], entry["heuristic_us"]) == ("aligned", "direct", 65.0, 80.0)
    # within 3% of the rule's path: nothing written
    assert tune_shape(**shape, timer=_model_timer(dict(base, gemm1=flat(37.0), gemm2=flat(37.0)), [])) == []
    # aligned GEMMs faster than the direct ones, but not with the alignment and the top-k sum
    # they need (the path comparison counts them): nothing written
    assert tune_shape(**shape, timer=_model_timer(dict(base, gemm1=flat(36.0), gemm2=flat(36.0),
                                                       align=flat(9.0)), [])) == []
    # too many slots for the direct path: only the aligned one is timed, and its entry names it
    seen = []
    tune_shape(**dict(shape, tokens_list=[40]), timer=_model_timer(base, seen))
    assert seen and all(not kind.startswith("direct") for kind, _ in seen)
    def other_rows(block_m):  # GEMMs at another block_m than the heuristic's twice as fast
        return lambda tile: 50.0 if tile.block_m != block_m else 100.0

    rows = other_rows(seen[0][1].block_m)
    [entry] = tune_shape(**dict(shape, tokens_list=[40]), timer=_model_timer(dict(base, gemm1=rows, gemm2=rows), []))
    assert entry["path"] == "aligned"
    # W8A8 times its direct path too (per-tensor cannot run it: only the aligned one); int8's
    # launches with the biases of a model that has them
    fast = lambda tile: 20.0 if tile.block_m != 16 else 100.0  # noqa: E731 (32-row aligned GEMMs win)
    for quant, timed_direct in (("int8_w8a8", True), ("fp8_w8a8_tensor", False)):
        seen = []
        [entry] = tune_shape(**shape, quant=quant, bias=quant == "int8_w8a8",
                             timer=_model_timer(dict(base, gemm1=fast, gemm2=fast), seen))
        assert any(kind.startswith("direct") for kind, _ in seen) == timed_direct
        # fp8 searches SWAP_AB from the rule's choice made explicit (False off sm90): the rule's
        # own tile is never timed a second time as its explicit twin (no tile improves here, so
        # no round revisits one either)
        runs = [(kind, dataclasses.replace(tile, swap_ab=bool(tile.swap_ab))) for kind, tile in seen]
        assert len(runs) == len(set(runs)), quant
        assert entry["path"] == "aligned" and entry["quant"] == quant
        assert len(parse_table({**json.loads(path.read_text()), "entries": [entry]}, "t.json")) == 1


def test_tune_shape_rotates_routings_over_the_weight_copies(monkeypatch):
    """Each weight copy runs its own routing draw (`tune._rotate`: copy i, draw i mod n), on every
    path's builders: the aligned GEMMs, the alignment overhead, the direct pair and the whole calls."""
    import fusedmoe.tune as tune

    order = []
    rot = tune._rotate([lambda i, t: order.append(("a", i, t)), lambda i, t: order.append(("b", i, t))])
    for i in range(3):
        rot(i, "tile")
    assert order == [("a", 0, "tile"), ("b", 1, "tile"), ("a", 2, "tile")]

    seen = {}
    for name in ("_gemms", "_direct_gemms", "_aligned_overhead", "_whole_calls"):
        real = getattr(tune, name)

        def spy(*args, real=real, name=name):
            ids = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype in (torch.int32, torch.int64))
            seen.setdefault(name, set()).add(tuple(ids.flatten().tolist()))
            return real(*args)

        monkeypatch.setattr(tune, name, spy)
    cpu = torch.device("cpu")
    stages = lambda tile: 20.0 + 10.0 * tile.num_stages  # noqa: E731 (fewer stages win: an entry, whole calls)
    costs = {"gemm1": stages, "gemm2": stages, "direct gemm1": stages, "direct gemm2": stages,
             "align": lambda tile: 5.0}
    [_] = tune.tune_shape(experts=E, hidden=H, inter=I, top_k=K, tokens_list=[3], dtype=torch.float32, copies=2,
                    device=cpu, timer=_model_timer(costs, []))
    assert {name: len(ids) for name, ids in seen.items()} == \
        {"_gemms": 2, "_direct_gemms": 2, "_aligned_overhead": 2, "_whole_calls": 2}


def test_tune_shape_times_the_bench_routings(monkeypatch):
    """Each token count's draws are `fusedmoe bench`'s at the same seed (`bench.cell_generator`:
    (seed, M) alone), so the tuner's whole calls time the routings the bench times, whatever
    other counts the same search tunes; another seed, other routings."""
    import fusedmoe.tune as tune
    from fusedmoe.bench import cell_generator, routing_draws

    cpu = torch.device("cpu")
    seen: dict = {}
    real = tune._whole_calls

    def spy(scheme, weights, x, topk_w, topk_ids, *rest):
        seen.setdefault(x.shape[0], []).append((x.clone(), topk_ids.clone()))
        return real(scheme, weights, x, topk_w, topk_ids, *rest)

    monkeypatch.setattr(tune, "_whole_calls", spy)
    stages = lambda tile: 20.0 + 10.0 * tile.num_stages  # noqa: E731 (an entry each: whole calls run)
    costs = {"gemm1": stages, "gemm2": stages, "direct gemm1": stages, "direct gemm2": stages,
             "align": lambda tile: 5.0}

    def drawn(tokens_list, seed=0):
        seen.clear()
        tune.tune_shape(experts=E, hidden=H, inter=I, top_k=K, tokens_list=tokens_list, dtype=torch.float32,
                        copies=2, device=cpu, timer=_model_timer(costs, []), seed=seed)
        return seen[3]

    bench = routing_draws(3, H, E, K, 2, cell_generator(0, 3, cpu), torch.float32)
    alone = drawn([3])
    assert len(alone) == 2
    for (x, ids), (bx, _, _, bids) in zip(alone, bench, strict=True):
        assert torch.equal(x, bx) and torch.equal(ids, bids)
    after = drawn([2, 3])  # another count first: the same draws of M=3
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) for a, b in zip(alone, after, strict=True))
    other = drawn([3], seed=1)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(alone, other, strict=True))


def test_tune_shape_counts_x_quantization_on_both_paths(monkeypatch):
    """W8A8 per token: x's quantization launch is part of the aligned path's overhead ("align"
    runs it) and of the direct path's total when its GEMM1 does not quantize x itself; timed once
    for the direct path, never where GEMM1 fuses it."""
    from fusedmoe.backends.triton import quant as tq
    from fusedmoe.backends.triton.quant import quantize_activation
    from fusedmoe.tune import tune_shape

    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, tokens_list=[1], dtype=torch.float32, copies=2, device=cpu,
                 quant="int8_w8a8")
    flat = lambda us: lambda tile: us  # noqa: E731
    calls = []
    monkeypatch.setattr(tq, "quantize_activation", lambda *a, **k: calls.append(1) or quantize_activation(*a, **k))
    # direct GEMMs 40 + 40 against aligned 38 + 38 + align 5: the rule's direct path wins with x fused
    base = {"gemm1": flat(38.0), "gemm2": flat(38.0), "direct gemm1": flat(40.0), "direct gemm2": flat(40.0),
            "align": flat(5.0), "quantize x": flat(6.0)}
    seen = []
    assert tune_shape(**shape, timer=_model_timer(base, seen)) == []
    assert not any(kind == "quantize x" for kind, _ in seen)  # fused into GEMM1
    # x's own launch (6 us) on the direct path: aligned (81) now beats direct (86): an aligned entry
    monkeypatch.setattr(tq, "FUSE_XQ_MAX_H", 0)
    seen, quantizes = [], {}

    def timer(kind, tile, fn):  # which timed launches quantize x (whole calls confirm: 0 us)
        before = len(calls)
        fn(1)
        quantizes[kind] = quantizes.get(kind, False) or len(calls) > before
        seen.append((kind, tile))
        return base[kind](tile) if kind != "call" else 0.0

    [entry] = tune_shape(**shape, timer=timer)
    assert [kind for kind, _ in seen].count("quantize x") == 1
    assert (entry["path"], entry["us"], entry["heuristic_us"]) == ("aligned", 81.0, 86.0)
    assert quantizes["align"] and quantizes["quantize x"] and not quantizes["gemm1"]


def test_tune_shape_measures_against_the_tables_plan(monkeypatch):
    """The plan the library runs today (a tuned entry; `experts.choose_plan`) is timed too: a
    search result no better than it is not written; a better one records its time (table_us)."""
    import dataclasses

    from fusedmoe.backends.triton import experts
    from fusedmoe.backends.triton.experts import GemmProblem
    from fusedmoe.tune import tune_shape

    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, tokens_list=[40], dtype=torch.float32, copies=2, device=cpu)
    direct, h1, h2 = experts.choose_plan(GemmProblem(40 * K, E, H, I, K, True, torch.float32), None, cpu)
    assert not direct and h1.block_m == 32  # past the direct path's slots: the aligned heuristic
    entry1 = dataclasses.replace(h1, num_warps=8)  # a tuned entry's GEMM1
    monkeypatch.setattr(experts, "choose_plan", lambda problem, scheme, device: (False, entry1, h2))
    flat = lambda us: lambda tile: us  # noqa: E731

    # the entry's GEMM1 is the best tile there is: the search finds it again (45 us against the
    # heuristic's 65) but the table runs it already, so nothing is written
    seen = []
    costs = {"gemm1": lambda tile: 10.0 if tile == entry1 else 30.0, "gemm2": flat(30.0), "align": flat(5.0)}
    assert tune_shape(**shape, timer=_model_timer(costs, seen)) == []
    assert ("gemm1", entry1) in seen
    # 64-row GEMM1 tiles beat both the heuristic and a slow entry: written, with the entry's time
    costs = dict(costs, gemm1=lambda tile: 50.0 if tile == entry1 else 10.0 if tile.block_m == 64 else 30.0)
    [entry] = tune_shape(**shape, timer=_model_timer(costs, []))
    assert (entry["us"], entry["heuristic_us"], entry["table_us"]) == (45.0, 65.0, 85.0)
    # an entry slower than the rule (tuned before a heuristic change) and a search that only ties
    # the rule: the bar is the plan that runs now, so the stale entry is replaced
    costs = dict(costs, gemm1=lambda tile: 50.0 if tile == entry1 else 30.0)
    [entry] = tune_shape(**shape, timer=_model_timer(costs, []))
    assert (entry["us"], entry["heuristic_us"], entry["table_us"]) == (65.0, 65.0, 85.0)


def test_tune_shape_confirms_entries_with_whole_calls(monkeypatch):
    """A search result that beats the rule's plan as GEMMs timed apart is timed again as whole
    calls of the experts op, next to the rule's plan (and the table's, where an entry serves the
    shape): written only if it wins there by min_gain too, with those times; else log hears why."""
    import dataclasses

    from fusedmoe.backends.triton import experts
    from fusedmoe.backends.triton.experts import GemmProblem, direct_heuristic
    from fusedmoe.tune import WholePlan, tune_shape

    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, tokens_list=[1], dtype=torch.float32, copies=2, device=cpu)
    d1, d2 = direct_heuristic(GemmProblem(K, E, H, I, K, True, torch.float32), None, 132)
    faster2 = dataclasses.replace(d2, num_stages=d2.num_stages - 1)
    flat = lambda us: lambda tile: us  # noqa: E731
    costs = {"gemm1": flat(100.0), "gemm2": flat(100.0), "direct gemm1": flat(40.0), "align": flat(5.0),
             "direct gemm2": lambda tile: 30.0 if tile == faster2 else 40.0}
    best, rule = WholePlan(True, d1, faster2), WholePlan(True, d1, d2)

    def whole(**us):  # the whole calls' costs by plan
        return lambda plan: us[next(name for name, p in (("best", best), ("rule", rule), ("table", table)) if p == plan)]

    table = None
    calls = []
    [entry] = tune_shape(**shape, timer=_model_timer(dict(costs, call=whole(best=60.0, rule=75.0)), [], calls))
    assert calls == [best, rule]
    assert (entry["us"], entry["call_us"], entry["heuristic_call_us"]) == (70.0, 60.0, 75.0)
    assert "table_call_us" not in entry
    # slower as a whole call (the nvfp4 Mixtral M=1 pair on an H200), or within min_gain: not written
    lines = []
    assert tune_shape(**shape, log=lines.append, timer=_model_timer(dict(costs, call=whole(best=90.0, rule=75.0)), [])) == []
    assert len(lines) == 1 and "direct at 70.0 us" in lines[0] and "90.0 us against 75.0" in lines[0], lines
    assert tune_shape(**shape, timer=_model_timer(dict(costs, call=whole(best=73.5, rule=75.0)), [])) == []
    # a tuned entry serving the shape (slower GEMMs, so the search passes): its whole call is a bar too
    table = WholePlan(True, dataclasses.replace(d1, num_warps=8), d2)
    monkeypatch.setattr(experts, "choose_plan", lambda problem, scheme, device: tuple(table))
    costs["direct gemm1"] = lambda tile: 45.0 if tile == table.gemm1 else 40.0
    calls = []
    [entry] = tune_shape(**shape, timer=_model_timer(dict(costs, call=whole(best=60.0, rule=75.0, table=70.0)), [],
                                                     calls))
    assert calls == [best, rule, table] and (entry["table_us"], entry["table_call_us"]) == (85.0, 70.0)
    assert tune_shape(**shape, timer=_model_timer(dict(costs, call=whole(best=60.0, rule=75.0, table=61.0)), [])) == []
    # a table entry slower as a whole call than the rule's plan: the bar is the entry (what runs
    # now), so a best that ties the rule is written in its place
    [entry] = tune_shape(**shape, timer=_model_timer(dict(costs, call=whole(best=60.0, rule=61.0, table=70.0)), []))
    assert (entry["gemm2"], entry["call_us"], entry["heuristic_call_us"], entry["table_call_us"]) == (
        faster2.as_list(), 60.0, 61.0, 70.0)
    # and where the rule's plan runs the whole call faster than the search's best, the rule's plan
    # is written in the entry's place (the best's time kept as search_call_us)
    lines = []
    [entry] = tune_shape(**shape, log=lines.append,
                         timer=_model_timer(dict(costs, call=whole(best=60.0, rule=59.0, table=70.0)), []))
    assert (entry["path"], entry["gemm1"], entry["gemm2"]) == ("direct", d1.as_list(), d2.as_list())
    assert (entry["call_us"], entry["search_call_us"], entry["table_call_us"]) == (59.0, 60.0, 70.0)
    assert entry["us"] == entry["heuristic_us"] and "written in the entry's place" in lines[0], lines
    # neither beats the entry by min_gain: nothing written
    assert tune_shape(**shape, timer=_model_timer(dict(costs, call=whole(best=69.0, rule=68.5, table=70.0)), [])) == []


def test_search_tries_swap_ab_for_w8a8_codes():
    """The descent's neighbours set SWAP_AB both ways for W8A8 with fp8 activations (written into
    the entry's tiles when it wins), for int8 codes on the direct decode path only, never for the
    float and weight-only GEMMs."""
    from fusedmoe.tune import _neighbours, _swappable

    tile = TileConfig(16, 64, 128, 4, 3)
    swaps = [t.swap_ab for t in _neighbours(tile, False, allow_swap=True) if t.swap_ab is not None]
    assert sorted(swaps) == [False, True]
    assert all(t.swap_ab is None for t in _neighbours(tile, True))
    flipped = [t.swap_ab for t in _neighbours(TileConfig(16, 64, 128, 4, 3, swap_ab=True), False, True)]
    assert flipped.count(False) == 1 and flipped.count(True) == len(flipped) - 1
    assert _swappable(get_scheme("fp8_w8a8_block")) and _swappable(get_scheme("fp8_w8a8_channel"))
    assert not any(_swappable(get_scheme(s)) for s in ("int8_w8a8", "fp8_w8a16", "int4_w4a16_g32"))
    assert _swappable(get_scheme("int8_w8a8"), direct=True)  # the direct decode path: int8 codes too
    assert not any(_swappable(get_scheme(s), direct=True) for s in ("fp8_w8a16", "int4_w4a16_g32"))
    assert not _swappable(None)


def test_grid_search_finds_tiles_the_descent_cannot_reach():
    """search="grid" times every valid GRID tile at each block_m and descends from the best: a
    GEMM1 tile two moves from the heuristic's (flat costs around it, so no single move helps) is
    found by the grid and not by the descent; min_gain sets how much faster an entry must be;
    bad arguments fail before any launch."""
    import itertools

    from fusedmoe.backends.triton.experts import GemmProblem, choose_plan
    from fusedmoe.backends.triton.tiles import check_tile
    from fusedmoe.tune import GRID, tune_shape

    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, tokens_list=[40], dtype=torch.float32, copies=2, device=cpu)
    _, h1, _ = choose_plan(GemmProblem(40 * K, E, H, I, K, True, torch.float32), None, cpu)
    fields = ("block_n", "block_k", "num_warps", "num_stages")
    far = next(t for t in (TileConfig(h1.block_m, *v) for v in itertools.product(*GRID.values()))
               if check_tile(t, dtype=torch.float32, operands=2, allow_split=True) is None
               and sum(getattr(t, f) != getattr(h1, f) for f in fields) >= 2)
    flat = lambda us: lambda tile: us  # noqa: E731

    def costs(fast: float):
        return {"gemm1": lambda tile: fast if tile == far else 30.0, "gemm2": flat(30.0), "align": flat(5.0)}

    assert tune_shape(**shape, timer=_model_timer(costs(10.0), [])) == []  # the descent never meets it
    seen = []
    [entry] = tune_shape(**shape, search="grid", timer=_model_timer(costs(10.0), seen))
    assert entry["gemm1"] == far.as_list() and (entry["us"], entry["heuristic_us"]) == (45.0, 65.0)
    timed = [tile for kind, tile in seen if kind == "gemm1"]
    assert len(timed) == len(set(timed))  # the descents reuse the grid's times
    for kind, tile in seen:  # every timed tile is valid
        if kind != "align":
            gemm1 = kind == "gemm1"
            assert check_tile(tile, dtype=torch.float32, operands=2 if gemm1 else 1, allow_split=gemm1) is None
    # 2% faster (63.7 us against 65): below the default 3%, written at min_gain=0.01
    assert tune_shape(**shape, search="grid", timer=_model_timer(costs(28.7), [])) == []
    [entry] = tune_shape(**shape, search="grid", min_gain=0.01, timer=_model_timer(costs(28.7), []))
    assert entry["gemm1"] == far.as_list()
    for bad, match in ((dict(search="random"), "search='random'"), (dict(min_gain=3.0), "min_gain=3.0")):
        with pytest.raises(ValueError, match=match):
            tune_shape(**shape, **bad, timer=_model_timer(costs(10.0), []))


def test_descent_moves_the_aligned_program_order():
    """The aligned GEMMs' descent tries group_m over GROUP_MS (the program order; written as the
    tile's 8th value when it wins); the direct path's never does (one block per slot)."""
    from fusedmoe.backends.triton.tiles import GROUP_M
    from fusedmoe.tune import _neighbours, tune_shape

    tile = TileConfig(64, 128, 64, 4, 4)
    assert sorted(t.group_m for t in _neighbours(tile, False, allow_group=True) if t.group_m != GROUP_M) == [1, 32]
    assert all(t.group_m == GROUP_M for t in _neighbours(tile, True))
    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float32, copies=2, device=cpu)
    flat = lambda us: lambda tile: us  # noqa: E731
    costs = {"gemm1": flat(30.0), "gemm2": lambda tile: 20.0 if tile.group_m == 1 else 30.0, "align": flat(5.0),
             "direct gemm1": flat(100.0), "direct gemm2": flat(100.0)}
    seen = []
    [entry] = tune_shape(**shape, tokens_list=[40], timer=_model_timer(costs, seen))
    assert entry["path"] == "aligned" and entry["gemm2"][7] == 1 and len(entry["gemm1"]) == 6
    seen = []
    tune_shape(**shape, tokens_list=[1], timer=_model_timer(costs, seen))
    assert any(kind.startswith("direct") for kind, _ in seen)
    assert all(tile.group_m == GROUP_M for kind, tile in seen if kind.startswith("direct"))


@pytest.mark.parametrize("field,gemm,index,allow,other_allow,refusers", [
    ("persistent", "gemm2", 8, dict(allow_split=False, allow_persistent=True),
     dict(allow_split=True, allow_group=True), (dict(quant="int8_w8a8"),)),
    ("persistent", "gemm1", 8, dict(allow_split=True, allow_persistent=True),
     dict(allow_split=True, allow_group=True), (dict(quant="int8_w8a8"),)),
    ("one_dot", "gemm1", 9, dict(allow_split=True, allow_one_dot=True),
     dict(allow_split=False, allow_persistent=True), (dict(quant="int8_w8a8"), dict(activation="gelu_no_mul"))),
], ids=["persistent-gemm2", "persistent-gemm1", "one-dot-gemm1"])
def test_descent_toggles_a_wide_tile(field, gemm, index, allow, other_allow, refusers):
    """The aligned unquantized GEMMs' descents toggle a persistent launch and the gated GEMM1's
    one dot over gate and up (written as the tile's 9th / 10th value when it wins); the direct
    path never times either, the other GEMM never times one dot, and the W8A8 GEMMs (the
    predicate refuses both) and, for one dot, an ungated GEMM1 time neither."""
    from fusedmoe.tune import _neighbours, tune_shape

    tile = TileConfig(64, 128, 64, 4, 4)
    assert [t for t in _neighbours(tile, **allow) if getattr(t, field)] == [
        TileConfig(64, 128, 64, 4, 4, **{field: True})]
    assert not any(getattr(t, field) for t in _neighbours(tile, **other_allow))
    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float32, copies=2, device=cpu)
    flat = lambda us: lambda tile: us  # noqa: E731
    costs = {"gemm1": flat(30.0), "gemm2": flat(30.0), "align": flat(5.0),
             "direct gemm1": flat(100.0), "direct gemm2": flat(100.0)}
    costs[gemm] = lambda tile: 20.0 if getattr(tile, field) else 30.0
    seen = []
    [entry] = tune_shape(**shape, tokens_list=[40], timer=_model_timer(costs, seen))
    assert entry["path"] == "aligned" and entry[gemm][index] is True
    other = "gemm1" if gemm == "gemm2" else "gemm2"
    assert len(entry[other]) == 6  # a tie keeps the other GEMM's plain tile
    untimed = ("direct gemm1", "direct gemm2") if field == "persistent" else ("direct gemm1", "direct gemm2", other)
    assert not any(getattr(tile, field) for kind, tile in seen if kind in untimed)
    for kw in refusers:
        seen = []
        tune_shape(**shape, tokens_list=[40], timer=_model_timer(costs, seen), **kw)
        assert not any(getattr(tile, field) for kind, tile in seen if kind != "align"), kw


def test_w4_gemm2_descent_starts_from_the_persistent_tile():
    """The weight-only 4-bit GEMM2's descent also starts from tune.W4_PERSISTENT_START (one move
    from the heuristic's tiles it is slower, so a descent from them alone would not reach it):
    where the model makes that tile fastest, the entry's GEMM2 is persistent; GEMM1 and the
    direct path never time a persistent tile, and no GEMM a one-dot one."""
    from fusedmoe.tune import W4_PERSISTENT_START, tune_shape

    flat = lambda us: lambda tile: us  # noqa: E731
    start = lambda tile: tile.persistent and (tile.block_n, tile.block_k) == (128, 128)  # noqa: E731
    costs = {"gemm1": flat(30.0), "align": flat(5.0), "direct gemm1": flat(100.0), "direct gemm2": flat(100.0),
             "gemm2": lambda tile: 10.0 if start(tile) else 40.0 if tile.persistent else 30.0}
    seen = []
    with knobs.override(TRITON_W4_FRAGMENTS=False):  # the checkpoint layout (int4's default is fragments)
        [entry] = tune_shape(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float32, copies=2,
                             device=torch.device("cpu"), tokens_list=[40], quant="int4_w4a16_g32",
                             timer=_model_timer(costs, seen))
    assert entry["gemm2"][1:5] == [128, 128, 4, 3] and entry["gemm2"][8] is True
    assert entry["gemm2"][0] == entry["gemm1"][0]
    assert W4_PERSISTENT_START.persistent and any(start(tile) for kind, tile in seen if kind == "gemm2")
    assert not any(tile.persistent for kind, tile in seen if kind != "gemm2")
    assert not any(tile.one_dot for _, tile in seen)  # int4 runs the checkpoint layout: no one-dot form
    assert entry["layout"] == "checkpoint"  # the layout the copies were timed on, named


def test_tune_shape_writes_no_plan_that_computes_another_output(monkeypatch):
    """The search's best plan is written only if its whole call computes the reference's output
    (`tune._plan_disagreement`: bench.check_cell's bound against bench.reference_output on weight
    copy 0, the output poisoned first) and gives that output bit for bit over bench.CHECK_RUNS
    runs: a plan whose kernels write wrong values, leave rows unwritten, or race (one run of eight
    off), is logged and dropped; so is one whose fault the heuristic's plan shares (the bar was
    the heuristic plan's output until 2026-11-30: "every" passed it)."""
    import dataclasses

    from fusedmoe import tune as tune_mod
    from fusedmoe.backends.triton.experts import GemmProblem, direct_heuristic
    from fusedmoe.tune import tune_shape

    problem = GemmProblem(K, E, H, I, K, True, torch.float32)
    d1, d2 = direct_heuristic(problem, None, 132)
    faster2 = dataclasses.replace(d2, num_stages=d2.num_stages - 1)
    flat = lambda us: lambda tile: us  # noqa: E731
    costs = {"gemm1": flat(100.0), "gemm2": flat(100.0), "direct gemm1": flat(40.0), "align": flat(5.0),
             "direct gemm2": lambda tile: 30.0 if tile == faster2 else 40.0}
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, tokens_list=[1], dtype=torch.float32, copies=2,
                 device=torch.device("cpu"))
    whole = tune_mod._whole_calls
    for harm in ("scaled", "unwritten", "racy", "every"):
        def broken(*args, harm=harm):
            call, out = whole(*args)
            runs = []

            def plan_call(plan):
                run = call(plan)
                if harm == "every":  # every plan's output off alike: the heuristic's too
                    return lambda i: (run(i), out.mul_(1.5))
                if plan.gemm2 != faster2:
                    return run
                if harm == "unwritten":  # the faster plan's kernel never writes the output
                    return lambda i: None
                if harm == "racy":  # or writes it right, but its fourth run wrong in one element (a race)
                    def racy(i):
                        run(i)
                        runs.append(i)
                        if len(runs) == 4:
                            out.view(-1)[0] += 1.0
                    return racy
                return lambda i: (run(i), out.mul_(3.0))  # or writes it at a wrong scale

            return plan_call, out

        monkeypatch.setattr(tune_mod, "_whole_calls", broken)
        logged, seen = [], []
        assert tune_shape(**shape, timer=_model_timer(costs, seen), log=logged.append) == [], harm
        assert any("gave another output than the reference" in line and "nothing written" in line
                   for line in logged), (harm, logged)
        assert any("run 4 of 8 gave another output bitwise" in line for line in logged) == (harm == "racy")
        assert any(tile == faster2 for kind, tile in seen if kind == "direct gemm2")  # it was the search's best
    monkeypatch.setattr(tune_mod, "_whole_calls", whole)  # the same search, kernels intact: written
    [entry] = tune_shape(**shape, timer=_model_timer(costs, []))
    assert entry["gemm2"] == faster2.as_list()


def test_w4_gemm1_descent_starts_from_the_wide_tile_at_128_row_blocks(monkeypatch):
    """At row blocks of 128 and more the weight-only 4-bit GEMM1's descent also starts from
    tune.W4_WIDE_GEMM1_START: from a 4-warp, 64-deep heuristic tile it is three moves away, each
    slower alone (the model below), so a descent from the heuristic's tiles stops short; with the
    start the entry's GEMM1 is it. At smaller row blocks it is no start."""
    import dataclasses

    from fusedmoe.backends.triton import tiles
    from fusedmoe.tune import W4_WIDE_GEMM1_START, tune_shape

    rule = tiles.heuristic
    narrow = lambda *a, **kw: dataclasses.replace(rule(*a, **kw), block_k=64, num_warps=4, num_stages=4)  # noqa: E731
    monkeypatch.setattr(tiles, "heuristic", narrow)
    wide = lambda tile: tile.as_list()[1:5] == W4_WIDE_GEMM1_START.as_list()[1:5]  # noqa: E731

    def gemm1(tile):
        if wide(tile):
            return 5.0 if tile.block_m >= 128 else 40.0
        return 40.0 if tile.num_warps == 8 or tile.block_k > 64 else 30.0

    flat = lambda us: lambda tile: us  # noqa: E731
    costs = {"gemm1": gemm1, "gemm2": flat(30.0), "align": flat(5.0), "direct gemm1": flat(100.0),
             "direct gemm2": flat(100.0)}
    seen = []
    # 100 tokens x top-2 over 4 experts: 50 rows an expert, blocks of 64, so 32 / 64 / 128 are searched
    [entry] = tune_shape(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float16, copies=2,
                         device=torch.device("cpu"), tokens_list=[100], quant="int4_w4a16_g32",
                         timer=_model_timer(costs, seen))
    assert entry["gemm1"][:5] == [128, *W4_WIDE_GEMM1_START.as_list()[1:5]] and entry["gemm2"][0] == 128
    assert {tile.block_m for kind, tile in seen if kind == "gemm1"} == {32, 64, 128}
    assert not any(wide(tile) for kind, tile in seen if kind == "gemm1" and tile.block_m < 128)


@pytest.mark.parametrize("fragments", [True, False], ids=["fragments", "checkpoint-layout"])
def test_w4_gemm1_descent_toggles_one_dot_over_fragments(fragments, monkeypatch):
    """Over fragment-layout 4-bit weights (mxfp4 by default) GEMM1's descents, aligned and
    direct, toggle one_dot both ways, and the entry's GEMM1 has it (the tile's 10th value) where
    the model makes it fastest: at 40 rows an expert the aligned heuristic's GEMM1 is two-dot (64-row
    blocks) and the model favours one dot; at 12 rows it is one-dot (the fragment rule up to 32 rows)
    and the model favours two; the direct one splits K, the model favours one dot. GEMM2 never times it.
    In the checkpoint layout (the fragments knob off) nothing times a one-dot tile: that layout
    runs it as two tiles."""
    from fusedmoe.tune import tune_shape

    if not fragments:
        monkeypatch.setenv("FUSEDMOE_TRITON_W4_FRAGMENTS", "0")
    flat = lambda us: lambda tile: us  # noqa: E731
    one = lambda fast, slow: lambda tile: fast if tile.one_dot else slow  # noqa: E731
    two = lambda fast, slow: lambda tile: slow if tile.one_dot else fast  # noqa: E731
    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float32, copies=2, device=cpu,
                 quant="mxfp4_w4a16")
    aligned = {"gemm2": flat(30.0), "align": flat(5.0), "direct gemm1": flat(100.0), "direct gemm2": flat(100.0)}
    for tokens, costs, gemm1, want in (
            (80, dict(aligned, gemm1=one(10.0, 30.0)), "gemm1", True),
            (24, dict(aligned, gemm1=two(10.0, 30.0)), "gemm1", False),
            (1, {"gemm1": flat(100.0), "gemm2": flat(100.0), "align": flat(5.0),
                 "direct gemm1": one(10.0, 30.0), "direct gemm2": flat(30.0)}, "direct gemm1", True)):
        seen = []
        entries = tune_shape(**shape, tokens_list=[tokens], timer=_model_timer(costs, seen))
        # "align" is timed under the GEMM1 tile that sets its block size (the heuristic's, one-dot at 12 rows)
        assert not any(tile.one_dot for kind, tile in seen if kind not in ("gemm1", "direct gemm1", "align"))
        if fragments:
            assert {tile.one_dot for kind, tile in seen if kind == gemm1} == {True, False}
            [entry] = entries
            assert entry["path"] == ("direct" if tokens == 1 else "aligned")
            one_dot = len(entry["gemm1"]) > 9 and entry["gemm1"][9] is True
            assert one_dot == want and len(entry["gemm2"]) <= 9, (tokens, entry)
            assert entry["layout"] == "fragments"
        else:
            assert entries == [] and not any(tile.one_dot for _, tile in seen)


class _RecordingPool:
    """A CompilePool stand-in: records each warm batch (tokens, kind, tiles) and, where a timer
    is handed the same list, when it came relative to the timings."""

    def __init__(self, events: list, spec: tuple = (E, H, I, K, "silu", torch.float32, None, False, "cpu")):
        self.events, self.spec = events, spec

    def warm(self, tokens, kind, fill, tiles):
        assert len(tiles) == len(set(tiles)), tiles
        assert fill.block_m == tiles[0].block_m or kind.startswith("direct"), (fill, tiles)
        self.events.append(("warm", kind, tuple(tiles)))


def test_compile_pool_warms_every_searched_tile_before_it_is_timed():
    """With a compile pool, each tile the search times on either path (the starts and every
    descent step; not the heuristic's own pair, timed first) was handed to the pool, in a batch,
    before its timing, and none twice; the entries are the same as without a pool. One token:
    both paths are searched."""
    from fusedmoe.tune import tune_shape

    flat = lambda us: lambda tile: us  # noqa: E731
    # costs with a slope, so the descents take steps
    costs = {"gemm1": lambda t: 30.0 - t.block_n / 16, "gemm2": lambda t: 30.0 - t.block_k / 16,
             "align": flat(5.0), "direct gemm1": lambda t: 20.0 - t.block_n / 16,
             "direct gemm2": lambda t: 20.0 - t.num_stages}
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float32, copies=2, device=torch.device("cpu"),
                 tokens_list=[1])
    plain = tune_shape(**shape, timer=_model_timer(costs, []))
    assert plain, "the model should give an entry"
    events = []
    model = _model_timer(costs, [])

    def timer(kind, tile, fn):
        events.append(("time", kind, tile))
        return model(kind, tile, fn)

    assert tune_shape(**shape, timer=timer, compile_pool=_RecordingPool(events)) == plain
    warmed, batches, unwarmed = set(), [], {}
    for event in events:
        if event[0] == "warm":
            batches.append(event[2])
            for tile in event[2]:
                assert (event[1], tile) not in warmed, ("warmed twice", event)
                warmed.add((event[1], tile))
        elif event[1] not in ("align", "call") and (event[1], event[2]) not in warmed:
            unwarmed.setdefault(event[1], set()).add(event[2])
    # timed without a batch first: per kind only the heuristic's tile (the aligned GEMMs' at
    # each of the three row blocks, whose timers the stage then reuses: one block size's pair)
    assert {kind: len(tiles) for kind, tiles in unwarmed.items()} == \
        {"gemm1": 1, "gemm2": 1, "direct gemm1": 1, "direct gemm2": 1}, unwarmed
    assert {kind for kind, _ in warmed} == {"gemm1", "gemm2", "direct gemm1", "direct gemm2"}
    assert max(len(b) for b in batches) > 1  # batches: the point is compiling them in parallel


def test_compile_pool_runs_each_tile_in_its_spawned_workers():
    """The real CompilePool on CPU tensors (its spawned workers inherit TRITON_INTERPRET=1): the
    workers build their own problem and run every tile the search hands them, GEMM1 and GEMM2
    of both paths, without an error; the search's entries are the ones it finds without them."""
    from fusedmoe.tune import CompilePool, tune_shape

    costs = {"gemm1": lambda t: 30.0 - t.block_n / 16, "gemm2": lambda t: 30.0 - t.block_k / 16,
             "align": lambda t: 5.0, "direct gemm1": lambda t: 20.0 - t.block_n / 16,
             "direct gemm2": lambda t: 20.0 - t.num_stages}
    cpu = torch.device("cpu")
    shape = dict(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float32)
    plain = tune_shape(**shape, copies=2, device=cpu, tokens_list=[1], timer=_model_timer(costs, []))
    with CompilePool(2, **shape, device=cpu) as pool:
        warmed = []
        warm = pool.warm
        pool.warm = lambda tokens, kind, fill, tiles: (warmed.append(kind), warm(tokens, kind, fill, tiles))
        assert tune_shape(**shape, copies=2, device=cpu, tokens_list=[1], timer=_model_timer(costs, []),
                          compile_pool=pool) == plain
    assert pool.errors == []
    assert set(warmed) == {"gemm1", "gemm2", "direct gemm1", "direct gemm2"}


def test_compile_pool_needs_two_jobs_and_the_search_s_shape():
    from fusedmoe.tune import CompilePool, tune_shape

    with pytest.raises(ValueError, match=r"jobs=1: a CompilePool needs at least 2 worker processes"):
        CompilePool(1, experts=E, hidden=H, inter=I, top_k=K)
    pool = _RecordingPool([])
    pool.spec = (E, H, 2 * I, K, "silu", torch.float32, None, False, "cpu")
    with pytest.raises(ValueError, match=r"compile_pool was made for \(4, 128, 128, .*not this search's \(4, 128, 64,"):
        tune_shape(experts=E, hidden=H, inter=I, top_k=K, dtype=torch.float32, copies=2, device=torch.device("cpu"),
                   tokens_list=[1], timer=lambda kind, tile, fn: 1.0, compile_pool=pool)


def test_descent_from_a_start_that_does_not_compile():
    """A start Triton cannot compile (the persistent start on a smaller GPU, say) ends its
    descent at infinite time instead of failing the tune; the other starts decide."""
    from fusedmoe.tune import _descend, _once

    def time_tile(tile):
        if tile.persistent:
            raise RuntimeError("out of resources")
        return 10.0

    start = TileConfig(128, 256, 64, 8, 3, persistent=True)
    assert _descend(_once(time_tile), start, lambda t: None) == (start, float("inf"))
    assert _descend(_once(time_tile), TileConfig(128, 128, 64, 8, 3), lambda t: None)[1] == 10.0


def test_bench_gemm_tiles_smoke():
    """benchmarks/bench_gemm_tiles.py on the CPU (the interpreter, shapes / 32): it launches each
    tile, checks a persistent GEMM2 bitwise against the per-tile launch and a one_dot GEMM1
    against the first tile, and prints a row per tile (its times mean nothing here); the same
    with --direct (the decode path's GEMMs)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "src")}
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_gemm_tiles.py"), "--device", "cpu", "--scale", "32",
         "--quant", "int4_w4a16_g32", "--cells", "qwen3-30b-a3b:2", "--gemm1", "16x64x64x4x1,16x32x64x4x1:one_dot",
         "--gemm2", "16x64x64x4x1,16x64x64x4x1:persistent", "--programs", "2", "--rounds", "1"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("qwen3-30b-a3b")]
    assert len(rows) == 4, proc.stdout
    assert "gemm2 16x64x64x4x1:persistent P=2" in rows[3] and rows[3].endswith("maxdiff 0.0e+00"), rows
    # the checkpoint layout runs one_dot as two tiles: the first tile's sums, but the interpreter's
    # tl.dot is numpy's matmul, whose BLAS may sum a 32-wide tile in another order than a 64-wide
    # one (numpy 2.4.6's does: 9e-8), so a round-off bound, not bitwise
    assert float(rows[1].rsplit("rel err", 1)[1]) < 1e-6, rows
    # --direct: the decode path's GEMMs (GEMM1 by slot with 32-row one-dot halves over mxfp4
    # fragments, GEMM2 by token with its slot shares), at an H other than the preset's
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_gemm_tiles.py"), "--device", "cpu", "--scale", "32",
         "--quant", "mxfp4_w4a16", "--cells", "qwen3-30b-a3b:1", "--direct", "--hidden", "4096", "--gemm1",
         "16x64x64x4x1x2,16x32x64x4x1x2:one_dot", "--gemm2", "16x64x64x4x1x2", "--rounds", "1"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("qwen3-30b-a3b")]
    assert len(rows) == 3 and "gemm1 16x32x64x4x1x2:one_dot" in rows[1], proc.stdout
    assert all("H=128 " in row for row in rows), rows  # --hidden 4096, scaled by 32
    bad = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_gemm_tiles.py"), "--device", "cpu",
                          "--cells", "qwen3-30b-a3b:1", "--hidden", "4000", "--gemm1", "16x64x64x4x1"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--hidden 4000: a multiple of 64" in bad.stderr, bad.stderr[-2000:]
    err = float(rows[1].rsplit(" ", 1)[1])
    assert err < 1e-5, rows  # one dot against two tiles on fragment-layout weights: the same sums


def test_ab_trees_alternates_old_and_new(tmp_path):
    """benchmarks/ab_trees.py: `prepare` unpacks a revision's src/ (HEAD here), `run` runs the
    command against it and this tree alternately, round by round, each with its own PYTHONPATH
    and AB_SIDE / AB_ROUND, and returns the worst return code."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    script = [sys.executable, str(root / "benchmarks" / "ab_trees.py")]
    src = subprocess.run([*script, "prepare", "--rev", "HEAD", "--dir", str(tmp_path / "old")],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Path(src, "fusedmoe", "__init__.py").is_file()
    probe = "import os, fusedmoe; print(os.environ['AB_SIDE'], os.environ['AB_ROUND'], fusedmoe.__file__)"
    proc = subprocess.run([*script, "run", "--old", src, "--rounds", "2", "--", sys.executable, "-c", probe],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("==")]
    assert [line.split()[:2] for line in lines] == [["old", "1"], ["new", "1"], ["old", "2"], ["new", "2"]]
    assert lines[0].split()[2].startswith(src) and lines[1].split()[2].startswith(str(root / "src"))
    failing = subprocess.run([*script, "run", "--old", src, "--rounds", "1", "--", sys.executable, "-c",
                              "import os, sys; sys.exit(3 if os.environ['AB_SIDE'] == 'new' else 0)"])
    assert failing.returncode == 3


def test_ab_trees_summarize_pairs_each_cell_across_rounds():
    """benchmarks/ab_trees.py summarize: per (scheme, cell), the best time of each side over its
    rounds, the change and the spreads, from `fusedmoe bench` rows and `bench_gemm_tiles.py` rows
    (their better timing), the scheme taken from each run's header line; a header glued after a
    line of other output still splits the runs, and cells of one side only are left out."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "ab_trees.py"
    spec = importlib.util.spec_from_file_location("ab_trees", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    bench = ("GPU: 3.0 TB/s; torch 2.11, triton 3.6, commit x; triton runs {q}\n"
             "preset             backend         M E_act        us  TFLOP/s    GB/s  %roof bound\n"
             "qwen3-30b-a3b      triton         16    85     {t:.1f}     11.3    2000   66.0 memory\n")
    tiles = ("NVIDIA H100 80GB HBM3; torch 2.11.0+cu130; nvfp4_w4a16\n"
             "deepseek-v3      M=16    H=7168  I=256   gemm2 16x128x128x4x3:persistent P=4  {a:.1f} /  {b:.1f} us"
             "   1.9 TB/s  reference\n")
    log = ("== old round 1 (.ab/x/src)\n" + bench.format(q="mxfp4_w4a16", t=110.0) + bench.format(q="nvfp4_w4a16", t=130.0)
           + tiles.format(a=60.0, b=58.0)
           + "...s..== new round 1 (src)\n" + bench.format(q="mxfp4_w4a16", t=100.0) + bench.format(q="nvfp4_w4a16", t=117.0)
           + tiles.format(a=57.0, b=59.0)
           + "== old round 2 (.ab/x/src)\n" + bench.format(q="mxfp4_w4a16", t=104.0)
           + "== new round 2 (src)\n" + bench.format(q="mxfp4_w4a16", t=103.0)
           + "qwen3-235b-a22b    triton         64   125     150.0     31.7    2057   67.9 memory\n")
    cells = ab.parse_log(log)
    assert cells[("mxfp4_w4a16", "qwen3-30b-a3b", "triton", 16)] == {"old": [110.0, 104.0], "new": [100.0, 103.0]}
    assert cells[("nvfp4_w4a16", "qwen3-30b-a3b", "triton", 16)] == {"old": [130.0], "new": [117.0]}
    assert cells[("nvfp4_w4a16", "deepseek-v3", 16, "gemm2", "16x128x128x4x3:persistent P=4")] == {
        "old": [58.0], "new": [57.0]}
    lines = ab.summarize(log).splitlines()
    assert len(lines) == 3  # qwen3-235b: new side only
    assert lines[0].startswith("mxfp4_w4a16 qwen3-30b-a3b triton 16") and "old    104.0 new    100.0   -3.8%" in lines[0]
    assert lines[0].endswith("spread   6.0 /   3.0")
    assert "-10.0%" in lines[1] and "-1.7%" in lines[2]


def test_aligned_overhead_sums_random_rows_not_an_uninitialised_buffer(monkeypatch):
    """The aligned path's overhead (alignment + top-k sum) is timed on a fresh launch, whose y
    GEMM2 never wrote: the sum reads random rows made once instead (y here poisoned with NaN, as
    uninitialised memory may be), so the timed launches never add inf or NaN."""
    import dataclasses

    from fusedmoe import tune
    from fusedmoe.backends.triton import experts

    made, summed = experts.prepare_launch, []
    monkeypatch.setattr(experts, "prepare_launch",
                        lambda *a, **kw: (lambda L: dataclasses.replace(L, y=L.y.fill_(float("nan"))))(made(*a, **kw)))
    monkeypatch.setattr(experts, "launch_reduce", lambda L, out: (summed.append(L.y), launch_reduce(L, out)))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    topk_w, topk_ids = select_experts(x, torch.randn(T, E, generator=gen), K)
    run = tune._aligned_overhead(x, topk_w, topk_ids, E, I, "silu", 16)
    run(0)
    run(1)
    assert len(summed) == 2 and summed[0] is summed[1] and torch.isfinite(summed[0]).all()
    assert summed[0].shape == (T * K, H) and summed[0].std() > 0.5  # random rows, not zeros
