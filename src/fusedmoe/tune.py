"""`fusedmoe tune`: search Triton tile configs for a shape on this GPU and write the table.

For each token count: draw uniform routing (the draws `fusedmoe bench` times at the same
`--seed`: `bench.cell_generator`), then for block_m in {heuristic/2, heuristic,
heuristic*2} descend coordinate-wise from the heuristic tile of each GEMM (block_n, block_k,
num_warps, num_stages, and split_k for GEMM1; one parameter at a time, keep what is faster), and
keep the block_m whose two GEMMs sum fastest. The aligned GEMMs' descent also moves group_m
(their program order, `TileConfig.group_m`) over GROUP_MS; the aligned unquantized GEMMs
toggle a persistent launch (`TileConfig.persistent`; GEMM1 with K unsplit) and, at 64-128 row
blocks, GEMM2 also starts from the persistent 128 x 256 x 64 family (WIDE_START_BLOCK_MS); the
weight-only 4-bit GEMM2 toggles it too and starts from a persistent 128 x 128 tile, its GEMM1
at row blocks of 128 and more also from a 128 x 128 tile in 8 warps. The
aligned GEMM1's descent toggles one dot over gate and up (`TileConfig.one_dot`, unquantized gated
only) and, at the same row blocks, also starts from the persistent one-dot 2*128 x 64 tile in 8
warps and 4 stages.

`search="grid"` (`fusedmoe tune --search grid`) first times every valid tile of GRID at each
block_m and descends from the grid's best as well: a descent moves one parameter at a time and
stops where no single move helps, which misses tiles several moves away (gpt-oss-120b bf16 on an
H100, M=16: the descent stayed at GEMM1 16 x 128 x 128 in 3 stages, 587 us; the grid found
16 x 32 x 256 in 5 stages, 568 us).

Where the direct decode path can run (unquantized and weight-only, at most
`experts.DIRECT_MAX_SLOTS` slots) its pair descends too (GEMM1 by slot; GEMM2 with the top-k sum,
its split_k the slot shares), from `experts.direct_heuristic`. The faster path's entry is
written, naming its path, only when it beats what runs without a table (the rule's path,
`experts.direct_auto`, on heuristic tiles) by more than `min_gain` (3% by default: tuned tables
age, and a tie goes to the heuristic). Kernels are timed on >= 4 rotated weight copies from a
CUDA graph (median), so decode shapes read HBM, not L2, and no launch overhead is tuned for;
each copy runs its own routing draw (`_rotate`), so a time is a mean over as many routings. With a
quantization scheme the same search runs that scheme's GEMMs on quantized copies, over the tiles
its predicate accepts, and the entries carry the scheme (W8A8's paths with their quantizers:
x's launch per token / 1x128 group timed once and added to each path that runs it, the direct
GEMM1 quantizing x itself where quant.fuse_x_quantization says so; the intermediate's in GEMM1's
timing). W8A8 with fp8 activations also descends over kernels.py's SWAP_AB, both ways per GEMM;
a tile that sets it writes it as its list's 7th value (`TileConfig.as_list`).

Compiling is most of a search's time (a 4-bit GEMM's kernel takes seconds; the timing of one tile
tens of milliseconds), and the tiles a descent step times are known before it times them:
`CompilePool` (`fusedmoe tune --jobs N`) runs each such batch once in N worker processes, on their
own copy of the problem, so the one-by-one timing here finds every kernel in Triton's cache. The
timings, and so the entries, are the same with or without it.

The search sums GEMMs timed apart, each in its own graph of back-to-back launches; the layer runs
them as a chain, GEMM2 waiting on GEMM1. The two can disagree: on an H200 the nvfp4 Mixtral M=1
direct pair the search timed at 107.8 us (heuristic 124.8) ran the whole call in 153.4 us
against 123.2 (benchmarks/results/2026-11-29_h200_71b8cf5_w4_padding_bisect_and_tune.txt), and
an earlier Mixtral M=1 entry was dropped for the same reason. So before an entry is written its
plan runs as whole calls of the experts op (`_whole_calls`: the alignment, both GEMMs and the
top-k sum as the layer launches them), next to the rule's heuristic plan and the plan the tables
give now, and it is written only if it beats there by `min_gain` too the plan that runs now;
the entry records those times (`call_us`, `heuristic_call_us`, `table_call_us`).

The bar, at both steps, is the plan that runs now: the tuned entry where one serves the shape,
else the rule's. An entry slower than the rule (tuned before a heuristic change: the mxfp4 /
nvfp4 fine-grained entries after the 4-bit fragment rule of 2026-11-30 lost 3-17% to it) is then
replaced by the search's best even where that best only ties the rule, or by the rule's own plan
where that runs the whole call faster than the best (`search_call_us` records the best's); a bar
of the faster of the two kept the stale entry serving.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from fusedmoe.backends.triton.experts import clear_tile_caches
from fusedmoe.backends.triton.tiles import TileConfig, check_plan, check_tile
from fusedmoe.backends.triton.tuning import FORMAT, READ_FORMATS, device_file_name

BLOCK_N = (16, 32, 64, 128, 256)
BLOCK_K = (32, 64, 128, 256)
WARPS = (4, 8)
STAGES = (2, 3, 4, 5)
SPLITS = (1, 2, 4, 8)
GROUP_MS = (1, 8, 32)  # the aligned GEMMs' program order (TileConfig.group_m; 8 the default)
# Row blocks at which the aligned GEMM2's descent also starts from the persistent BLOCK_M x 256 x 64
# tile in 8 warps, 3 stages (TileConfig.persistent: the best of its family at M=4096 on the H200,
# results/2026-11-25_h200_27daab3_persistent_gemm2_library.txt), and GEMM1's from the one-dot
# BLOCK_M x 2*128 x 64 tile in 8 warps, 4 stages, persistent (TileConfig.one_dot,
# results/2026-11-27_h200_bdb1fac_one_dot_gemm1.txt; persistent: the best of the one-dot variants
# at DeepSeek-V3, gpt-oss-120b M=4096 and Qwen3-30B M=1024 on the H200,
# results/2026-11-27_h200_67424e3_persistent_gemm1.txt); every descent may toggle either
WIDE_START_BLOCK_MS = (64, 128)
# The weight-only 4-bit GEMM2's descent also starts from this persistent tile (at every block_m):
# one step from the one-program-per-tile tiles it is slower, so a descent from them alone never
# reaches it (H200, mxfp4, DeepSeek-V3 M=16: 16 x 64 x 64 69 us, persistent 110; 16 x 128 x 128 78,
# persistent 57; tiles.W4_PERSISTENT_PROGRAMS)
W4_PERSISTENT_START = TileConfig(16, 128, 128, 4, 3, persistent=True)
# And its GEMM1's from this 8-warp tile at block_m >= 128 (the pair with GEMM2 128 x 128 x 64 in
# 4 warps, 4 stages, which the descent reaches): on an H200 at Mixtral M=256 (~64 rows an expert)
# int4 g32 / nvfp4 / mxfp4's tunes, descending from 4-warp starts, stopped 7-9% short of it (bench
# 702 -> 648 us, 709 -> 674, 683 -> 628 with the pair set by hand); from this start the g32 tune
# found it itself, 645 us as a whole call against the heuristic's 693
# (results/2026-11-29_h200_0a5c3b8_int4_groups_layouts_mixtral_m256.txt sections 7, 8). Those
# times ran the fragment dots' wgmmas in flight, before kernels._rs_sync (waited, int4 g32 ran
# 693-696 us on the pair: results/2026-11-29_h200_ad9161a_rs_wgmma_hazard.txt section 6).
W4_WIDE_GEMM1_START = TileConfig(128, 128, 128, 8, 3)
# search="grid": the tiles timed at each block_m before the descent (split_k 1; the descent from
# the best of them tries the values past these and split_k)
GRID = dict(block_n=(32, 64, 128, 256), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3, 4, 5))
SEARCHES = ("descent", "grid")
WEIGHT_SEED = 0  # the generator seed of the tuner's weight copies (the reference draws copy 0 again)
# timer(kind, tile, fn) -> us: one launch fn(i) on weight copy i, timed; kind is "gemm1", "gemm2",
# "direct gemm1", "direct gemm2", "align" (the aligned path's alignment at tile.block_m and its
# top-k sum), "quantize x", or "call" (the whole experts op; tile is then its WholePlan); the
# default ignores kind and tile, tests model them
Timer = Callable[[str, "TileConfig | WholePlan", Callable[[int], None]], float]


class WholePlan(NamedTuple):
    """A plan as the experts op takes it: the path (direct or aligned) and the two GEMMs' tiles."""

    direct: bool
    gemm1: TileConfig
    gemm2: TileConfig


class Draw(NamedTuple):
    """One routing of a token count: the tokens x [T, H] and their top-k weights and ids."""

    x: torch.Tensor
    topk_w: torch.Tensor
    topk_ids: torch.Tensor


def _rotate(fns: Sequence[Callable]) -> Callable:
    """fn(i, *args) running fns[i % len(fns)](i, *args): weight copy i with routing draw i, so a
    time over the copies is a mean over the draws. At ~64 slots an expert the draw alone moved
    int4 Mixtral M=256 by ~12% (64-row tiles per expert: 1 or 2; H200, 2026-11-29), as much as
    the gains a search keeps, so one draw could pick a block size for its own routing
    (`bench.cell_draws` rotates the bench's draws the same way)."""
    return lambda i, *args: fns[i % len(fns)](i, *args)


def _direct_pair(scheme, weights, draws: Sequence[Draw], problem, activation, fill: TileConfig):
    """(gemm1(i, tile), gemm2(i, tile)) of the direct path, weight copy i on draw i (`_direct_gemms`)."""
    built = [_direct_gemms(scheme, weights, *d, problem.num_local_experts, problem.inter, activation, fill)
             for d in draws]
    return _rotate([b[0] for b in built]), _rotate([b[1] for b in built])


def _median_us(fn: Callable[[int], None], copies: int, iters: int = 10) -> float:
    """Median us per call of fn(i) over the weight copies, replayed from a CUDA graph.

    A graph takes Python launch overhead (tens of us) out of the timing: at decode the kernels
    run for less than that, and eager timing would tune for the CPU.
    """
    for i in range(copies):  # compile outside capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def _neighbours(tile: TileConfig, allow_split: bool, allow_swap: bool = False,
                allow_group: bool = False, allow_persistent: bool = False,
                allow_one_dot: bool = False) -> list[TileConfig]:
    out = []
    if allow_swap:  # W8A8 fp8: SWAP_AB set either way (unset: quant.swap_ab's rule)
        out += [TileConfig(**{**tile.__dict__, "swap_ab": v}) for v in (False, True) if v != tile.swap_ab]
    if allow_persistent:  # the aligned GEMMs: a persistent launch or not (the predicate decides where)
        out.append(TileConfig(**{**tile.__dict__, "persistent": not tile.persistent}))
    if allow_one_dot:  # the aligned GEMM1: gate and up in one dot or two (the predicate decides where)
        out.append(TileConfig(**{**tile.__dict__, "one_dot": not tile.one_dot}))
    fields = [("block_n", BLOCK_N), ("block_k", BLOCK_K), ("num_warps", WARPS), ("num_stages", STAGES)]
    if allow_split:
        fields.append(("split_k", SPLITS))
    if allow_group:  # the aligned GEMMs' program order (the direct path has one block per slot)
        fields.append(("group_m", GROUP_MS))
    for field, values in fields:
        current = getattr(tile, field)
        i = values.index(current) if current in values else 0
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                out.append(TileConfig(**{**tile.__dict__, field: values[j]}))
    return out


class _once:
    """time_tile(tile) run once per tile: later calls return the first time (`known`). warm(tiles),
    where given, compiles a batch of tiles' kernels ahead of their timing (`CompilePool.warm`)."""

    def __init__(self, time_tile: Callable[[TileConfig], float],
                 warm: Callable[[list[TileConfig]], None] | None = None):
        self.time_tile, self.known, self.warm, self.warmed = time_tile, {}, warm, set()

    def __call__(self, tile: TileConfig) -> float:
        if tile not in self.known:
            self.known[tile] = self.time_tile(tile)
        return self.known[tile]

    def prepare(self, tiles: Iterable[TileConfig]) -> None:
        """Compile the kernels of the tiles not timed yet, in parallel, before they are timed."""
        if self.warm is None:
            return
        todo = list(dict.fromkeys(t for t in tiles if t not in self.known and t not in self.warmed))
        if todo:
            self.warm(todo)
            self.warmed.update(todo)


def _descend(time_tile: Callable[[TileConfig], float], start: TileConfig,
             reason: Callable[[TileConfig], str | None], rounds: int = 2,
             allow_split: bool = False, allow_swap: bool = False,
             allow_group: bool = False, allow_persistent: bool = False,
             allow_one_dot: bool = False) -> tuple[TileConfig, float]:
    """Coordinate descent from `start` over the tiles `reason` (the validity predicate) accepts;
    `time_tile` is a `_once`, so a tile timed already (the start, a revisit) costs nothing. A
    start Triton cannot compile here ends the descent at once, at infinite time."""
    best, best_t = _fastest(time_tile, [start], reason)
    if best is None:
        return start, float("inf")
    for _ in range(rounds):
        cand, t = _fastest(time_tile, _neighbours(best, allow_split, allow_swap, allow_group, allow_persistent,
                                                  allow_one_dot), reason)
        if t >= best_t:
            break
        best, best_t = cand, t
    return best, best_t


def _fastest(time_tile: Callable[[TileConfig], float], tiles: Iterable[TileConfig],
             reason: Callable[[TileConfig], str | None]) -> tuple[TileConfig | None, float]:
    """(tile, us) of the fastest of `tiles` that `reason` (the validity predicate) accepts and
    Triton compiles; (None, inf) when none does."""
    best, best_t = None, float("inf")
    tiles = [tile for tile in tiles if not reason(tile)]
    if isinstance(time_tile, _once):
        time_tile.prepare(tiles)
    for tile in tiles:
        try:
            t = time_tile(tile)
        except Exception:  # a config Triton cannot compile here (e.g. out of resources)
            continue
        if t < best_t:
            best, best_t = tile, t
    return best, best_t


def tune_shape(
    *, experts: int, hidden: int, inter: int, top_k: int, activation: str = "silu",
    tokens_list: Sequence[int], dtype: torch.dtype = torch.bfloat16, quant: str | None = None,
    copies: int = 4, progress: Callable[[str], None] | None = None, device: torch.device | None = None,
    timer: Timer | None = None, bias: bool = False, search: str = "descent", min_gain: float = 0.03,
    compile_pool: CompilePool | None = None, log: Callable[[str], None] | None = None, seed: int = 0,
) -> list[dict]:
    """Tuned entries (dicts for the JSON table) for one shape at each token count.

    quant: a scheme the triton backend runs (W8A8 or weight-only); its GEMMs run on the rotated
    copies quantized by `quantize_weights` (as `fusedmoe bench --quant` runs them), descending
    over the tiles the scheme's predicate accepts. None: the unquantized GEMMs in `dtype`.
    device / timer: a CUDA device and CUDA-graph timing (`_median_us`) unless given.
    bias: the GEMMs add biases (b13 [E, 2I], b2 [E, H]) as the model's layer does. Their epilogue
    loads can cost a tile its second program per SM (H200, int8 W8A8, gpt-oss M=4096: GEMM1
    128 x 64 x 128 in 3 stages compiles to 140 registers a thread instead of 119 and runs 2250 us
    against 1779 without biases), so a tile timed without them can lose with them.
    An entry's `us` is its path's launches without routing: for the aligned path the alignment
    and the top-k sum besides the GEMMs (the direct path's GEMM2 sums in place), and W8A8's
    launch quantizing x per token / group on either path (the direct GEMM1 may do it itself,
    `quant.fuse_x_quantization`: then it is in GEMM1's time), so the two paths compare as the
    layer runs them. An entry is written when it beats by `min_gain` (a fraction) the plan that
    runs now: the plan the tables give this shape (`table_us`, timed where an entry serves it),
    else the rule's plan on heuristic tiles (`heuristic_us`, recorded either way).
    search: "descent" (from the heuristic's tiles) or "grid" (every valid GRID tile at each
    block_m first, then the descent from the best of them too); the direct path descends either way.
    compile_pool: compiles each batch of tiles about to be timed in its worker processes first
    (`CompilePool`, made for this shape); None: each tile compiles when it is first timed.
    seed: each token count's routing draws come from `bench.cell_generator(seed, tokens)`, as
    `fusedmoe bench --seed` draws them: the tuner times the routings the bench times (the same
    ids: bench's default softmax-renormalize draws here, the ids of any monotonic scoring), and a
    count's draws do not depend on the other counts tuned with it.
    A search result that passes is then timed as whole calls of the experts op against the rule's
    plan and the table's (module docstring), and written only if it beats the plan that runs
    now there by `min_gain` as well; log(line) hears of a result the whole calls turned down.
    """
    if search not in SEARCHES:
        raise ValueError(f"search={search!r} must be one of {', '.join(SEARCHES)}")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain} must be a fraction in [0, 1) (0.03: 3% faster)")
    from fusedmoe.activations import is_gated
    from fusedmoe.backends.triton.experts import (
        DIRECT_MAX_SLOTS,
        GemmProblem,
        _num_sms,
        choose_plan,
        direct_auto,
        direct_heuristic,
        direct_reason,
        direct_scheme_reason,
        tma_planned,
    )
    from fusedmoe.backends.triton.quant import fuse_x_quantization
    from fusedmoe.backends.triton.tiles import heuristic, tile_mode
    from fusedmoe.backends.triton.weight_only import W4_LAYOUTS, is_w4_scheme
    from fusedmoe.bench import cell_generator, routing_draws
    from fusedmoe.quant.fragments import is_fragments
    from fusedmoe.quant.scheme import get_scheme

    scheme = get_scheme(quant)
    mode, group = tile_mode(scheme)
    device = device or torch.device("cuda")
    if compile_pool is not None:
        want = (experts, hidden, inter, top_k, activation, dtype, quant, bias, device.type)
        if compile_pool.spec != want:
            raise ValueError(f"compile_pool was made for {compile_pool.spec}, not this search's {want}")
    timer = timer or (lambda kind, tile, fn: _median_us(fn, copies))
    gated = is_gated(activation)
    gen = torch.Generator(device=device).manual_seed(WEIGHT_SEED)
    weights = [_weight_copy(experts, hidden, inter, gated, dtype, scheme, gen, bias) for _ in range(copies)]
    # the reference's copy: weights[0] drawn again (the same generator seed, drawn first), in the
    # checkpoint layout for a quantized scheme (emulation reads no fragments)
    reference = weights[0] if scheme is None else _weight_copy(
        experts, hidden, inter, gated, dtype, scheme, torch.Generator(device=device).manual_seed(WEIGHT_SEED), bias,
        prepare=False)
    if device.type == "cuda":  # the build's float32 temporaries back to the device, where the --jobs
        torch.cuda.synchronize(device)  # workers build their copies next: on an H200 the cached 18.8 GiB
        torch.cuda.empty_cache()  # of gpt-oss-120b's int4 build ran the tuner itself out of memory at --jobs 14
    # one_dot (gate and up as one dot): the unquantized GEMM1 and the 4-bit one over fragment-layout
    # weights, on either path (the checkpoint layout runs it as two tiles: not timed twice). H100,
    # GEMM1 alone, best one-dot tile against the best two-tile one: -7% to +12% by cell
    # (benchmarks/results/2026-11-27_h100_fb2ab66_one_dot_w4.txt), so it is the descent's to decide
    # the 4-bit weights' layout as process_weights laid the copies: the heuristic's plans and the
    # table's entries are those of it, and the entries written name it
    frag = is_fragments(weights[0][2].w13_scale) if is_w4_scheme(scheme) else None
    one_dot = mode is None or bool(frag)
    sms = _num_sms(device)
    operands = 2 if gated else 1
    ok1 = functools.partial(check_tile, dtype=dtype, operands=operands, allow_split=True, quant=mode, group=group)
    ok2 = functools.partial(check_tile, dtype=dtype, quant=mode, group=group)
    label = f"{scheme or str(dtype).replace('torch.', '')} E={experts} H={hidden} I={inter} k={top_k}"
    entries = []
    for tokens in tokens_list:
        def warm(kind: str, fill: TileConfig, tokens=tokens) -> Callable[[list[TileConfig]], None] | None:
            return None if compile_pool is None else functools.partial(compile_pool.warm, tokens, kind, fill)

        # one routing per weight copy: a time is the mean over `copies` routings (_rotate), drawn
        # as the bench draws this count's (the tuner's own generator gave it other routings, and
        # its whole calls read 40-58 us below bench's at Mixtral M=256 on an H200, 2026-11-30)
        cell = cell_generator(seed, tokens, device)
        draws = [Draw(x, w, ids) for x, _, w, ids in routing_draws(tokens, hidden, experts, top_k, copies, cell, dtype)]
        problem = GemmProblem(tokens * top_k, experts, hidden, inter, top_k, gated, dtype, frag)
        tma1, tma2 = tma_planned(problem, device) if scheme is None else (None, None)
        codes = None if scheme is None or scheme.weight_only else scheme.weight.dtype
        h1 = heuristic(problem.num_slots, experts, inter, hidden, dtype, gated=gated, num_sms=sms,
                       quant=mode, group=group, tma=tma1, codes=codes, fragments=bool(frag))
        h2 = heuristic(problem.num_slots, experts, hidden, inter, dtype, gated=False, num_sms=sms,
                       quant=mode, group=group, tma=tma2, codes=codes, fragments=bool(frag))

        def timers(fill: TileConfig, draws=draws):
            built = [_gemms(scheme, weights, *d, experts, inter, activation, fill) for d in draws]
            gemm1, gemm2 = _rotate([b[0] for b in built]), _rotate([b[1] for b in built])
            return (lambda tile: timer("gemm1", tile, lambda i: gemm1(i, tile)),
                    lambda tile: timer("gemm2", tile, lambda i: gemm2(i, tile)))

        # x's quantization where it is its own launch (W8A8 per token / group): a cost of the
        # aligned path, and of the direct one unless its GEMM1 quantizes x itself (timed inside
        # it then), so the two paths compare as the layer runs them
        xqs = [_x_quantization(scheme, d.x) for d in draws]
        xq = None if xqs[0] is None else _rotate(xqs)

        def align_us(block_m: int, draws=draws, h1=h1, xqs=xqs) -> float:
            # the aligned path's own launches (alignment, x's codes, top-k sum), which the direct
            # path does without: part of every aligned total, or the path comparison favours aligned
            run = _rotate([_aligned_overhead(*d, experts, inter, activation, block_m, q) for d, q in zip(draws, xqs, strict=True)])
            return timer("align", dataclasses.replace(h1, block_m=block_m), run)

        heuristic_timers = timers(h1)
        h_us = (heuristic_timers[0](h1), heuristic_timers[1](h2), align_us(h1.block_m))
        default = ("aligned", sum(h_us))
        found = []  # (us, path, gemm1 tile, gemm2 tile)
        swap = _swappable(scheme)
        for block_m in sorted({max(16, h1.block_m // 2), h1.block_m, min(256, h1.block_m * 2)}):
            if progress:
                progress(f"{label} M={tokens} block_m={block_m}")
            same = block_m == h1.block_m  # the heuristic's own: its launches and times serve
            if same:
                starts1, starts2 = [h1], [h2]
            else:  # the heuristic's tile moved to this block size, and the heuristic's pick for it
                pick = functools.partial(heuristic, problem.num_slots, experts, num_sms=sms, quant=mode,
                                         group=group, codes=codes, block_m=block_m, fragments=bool(frag))
                starts1 = [dataclasses.replace(h1, block_m=block_m), pick(inter, hidden, dtype, gated=gated, tma=tma1)]
                starts2 = [dataclasses.replace(h2, block_m=block_m), pick(hidden, inter, dtype, gated=False, tma=tma2)]
            if block_m in WIDE_START_BLOCK_MS:  # the wide starts (ok1 / ok2: unquantized only)
                starts2.append(TileConfig(block_m, 256, 64, 8, 3, persistent=True))
                starts1.append(TileConfig(block_m, 128, 64, 8, 4, persistent=True, one_dot=True))
            if mode == "w4":  # and the weight-only 4-bit starts (W4_PERSISTENT_START, W4_WIDE_GEMM1_START)
                starts2.append(dataclasses.replace(W4_PERSISTENT_START, block_m=block_m))
                if block_m >= W4_WIDE_GEMM1_START.block_m:
                    starts1.append(dataclasses.replace(W4_WIDE_GEMM1_START, block_m=block_m))
            starts1 = list(dict.fromkeys(_rule_swap(t, scheme, device, direct=False) for t in starts1 if not ok1(t)))
            starts2 = list(dict.fromkeys(_rule_swap(t, scheme, device, direct=False) for t in starts2 if not ok2(t)))
            if not starts1 or not starts2:
                continue
            # each tile timed once per block size, though the descents from two starts (and a
            # descent's second round) meet tiles already timed
            fill = h1 if same else starts1[0]  # the GEMM1 tile that makes GEMM2's input at this block size
            time1, time2 = (_once(f, warm(kind, fill)) for f, kind in
                            zip(heuristic_timers if same else timers(fill), ("gemm1", "gemm2"), strict=True))
            if same:
                time1.known[starts1[0]], time2.known[starts2[0]] = h_us[0], h_us[1]
            time1.prepare(starts1)  # every start's kernel at once (the descents then time them one by one)
            time2.prepare(starts2)
            if search == "grid":
                starts1 += [t for t in [_grid_best(time1, block_m, ok1, scheme, device)] if t is not None]
                starts2 += [t for t in [_grid_best(time2, block_m, ok2, scheme, device)] if t is not None]
            b1, u1 = min((_descend(time1, t, ok1, allow_split=True, allow_swap=swap, allow_group=True,
                                   allow_persistent=True, allow_one_dot=one_dot) for t in starts1),
                         key=lambda r: r[1])
            b2, u2 = min((_descend(time2, t, ok2, allow_swap=swap, allow_group=True, allow_persistent=True)
                          for t in starts2),
                         key=lambda r: r[1])
            found.append((u1 + u2 + (h_us[2] if same else align_us(block_m)), "aligned", b1, b2))
        direct_xq_us = 0.0
        if direct_reason(problem) is None and direct_scheme_reason(scheme) is None \
                and problem.num_slots <= DIRECT_MAX_SLOTS:
            if progress:
                progress(f"{label} M={tokens} direct")
            if xq is not None and not fuse_x_quantization(scheme.activation, hidden, inter, gated,
                                                          problem.num_slots, experts):
                direct_xq_us = timer("quantize x", h1, xq)
            heuristic_us, best = _search_direct(problem, scheme, sms, weights, draws,
                                                activation, timer, direct_xq_us, one_dot=one_dot and mode == "w4",
                                                warm=warm)
            if direct_auto(problem, sms):
                default = ("direct", heuristic_us)
            found.append(best)
        if not found:
            continue
        best = min(found, key=lambda f: f[0])
        # the plan the library runs today (a tuned entry, when one serves this shape) is timed
        # too: where one serves, it is the bar (an entry no better than it is not written)
        rule = (WholePlan(True, *direct_heuristic(problem, scheme, sms)) if default[0] == "direct"
                else WholePlan(False, h1, h2))
        now = WholePlan(*choose_plan(problem, scheme, device))
        table_us = None if now == rule else _table_plan_us(
            problem, now, timers, align_us, scheme, weights, draws, activation, timer, direct_xq_us)
        # the bar is the plan that runs now: a serving entry slower than the rule's plan (tuned
        # before a heuristic change) is replaced by the search's best even where that best only
        # ties the rule (kept, the stale entry would go on serving)
        if best[0] > (1 - min_gain) * (default[1] if table_us is None else table_us):
            continue
        # and so are they as whole calls, where GEMM2 waits on GEMM1 (module docstring)
        plans = {"call_us": WholePlan(best[1] == "direct", best[2], best[3]), "heuristic_call_us": rule}
        if table_us is not None:
            plans["table_call_us"] = now
        built = [_whole_calls(scheme, weights, *d, experts, activation) for d in draws]
        by_draw = [call for call, _ in built]
        # a plan is written only if it computes the reference's output (a kernel wrong at one
        # tile must not become the table's plan: the int4 g64 fragment tune of 2026-11-29 wrote one)
        err, why = _plan_disagreement(*built[0], plans["call_us"], draws[0], reference, scheme, activation, device)
        if why is not None:
            if log:
                log(f"M={tokens:>5}: the search's best, {best[1]} gemm1 {best[2].as_list()} gemm2 "
                    f"{best[3].as_list()}, gave another output than the reference or than its own "
                    f"first run (relative error {err:.1e}: {why}); nothing written")
            continue
        calls = {name: timer("call", plan, _rotate([call(plan) for call in by_draw])) for name, plan in plans.items()}
        bar = calls.get("table_call_us", calls["heuristic_call_us"])
        # over a stale entry the rule's plan is a candidate too: where it runs the whole call
        # faster than the search's best it is written in the entry's place (a tuner's table cannot
        # drop an entry from the packaged one it is merged into, and a tie goes to the heuristic)
        written = "call_us"
        if "table_call_us" in calls and calls["heuristic_call_us"] < calls["call_us"]:
            written = "heuristic_call_us"
        if calls[written] > (1 - min_gain) * bar:
            if log:
                log(f"M={tokens:>5}: the search's best, {best[1]} at {best[0]:.1f} us as GEMMs timed apart, ran "
                    f"the whole call in {calls['call_us']:.1f} us against {bar:.1f} for the plan that runs now "
                    f"({'the tuned entry' if 'table_call_us' in calls else 'the heuristic'}; "
                    f"heuristic {calls['heuristic_call_us']:.1f}); nothing written")
            continue
        if written == "heuristic_call_us":
            if log:
                log(f"M={tokens:>5}: the rule's plan ran the whole call in {calls['heuristic_call_us']:.1f} us, "
                    f"the search's best {calls['call_us']:.1f}, the tuned entry serving now "
                    f"{calls['table_call_us']:.1f}: the rule's plan is written in the entry's place")
            best = (default[1], default[0], rule.gemm1, rule.gemm2)
            calls = dict(calls, search_call_us=calls["call_us"], call_us=calls["heuristic_call_us"])
        entry = {"dtype": str(dtype).replace("torch.", ""), "experts": experts, "hidden": hidden,
                 "inter": inter, "top_k": top_k, "gated": gated, "tokens": tokens}
        if scheme is not None:
            entry["quant"] = scheme.name
        if frag is not None:
            entry["layout"] = W4_LAYOUTS[0] if frag else W4_LAYOUTS[1]
        entries.append({
            **entry, "path": best[1], "gemm1": best[2].as_list(),
            "gemm2": best[3].as_list(), "us": round(best[0], 2),
            "heuristic_path": default[0], "heuristic_us": round(default[1], 2),
            **({} if table_us is None else {"table_us": round(table_us, 2)}),
            **{name: round(us, 2) for name, us in calls.items()},
        })
    return entries


def _grid_best(time_tile: Callable[[TileConfig], float], block_m: int,
               reason: Callable[[TileConfig], str | None], scheme, device: torch.device) -> TileConfig | None:
    """The fastest of the GRID tiles at block_m that `reason` (the validity predicate) accepts and
    Triton compiles (None: none does), each timed through `time_tile` (a `_once`: the descents
    reuse the times)."""
    grid = (_rule_swap(TileConfig(block_m, **dict(zip(GRID, values, strict=True))), scheme, device, direct=False)
            for values in itertools.product(*GRID.values()))
    return _fastest(time_tile, grid, reason)[0]


def _table_plan_us(problem, plan: WholePlan, timers, align_us, scheme, weights, draws: Sequence[Draw],
                   activation, timer, direct_xq_us: float = 0.0) -> float:
    """us of `plan` (the one `experts.choose_plan` runs for this shape: a tuned table's entry),
    timed as the search times its candidates."""
    direct, t1, t2 = plan
    if direct:
        gemm1, gemm2 = _direct_pair(scheme, weights, draws, problem, activation, t1)
        return (timer("direct gemm1", t1, lambda i: gemm1(i, t1)) + timer("direct gemm2", t2, lambda i: gemm2(i, t2))
                + direct_xq_us)
    time1, time2 = timers(t1)
    return time1(t1) + time2(t2) + align_us(t1.block_m)


def _whole_calls(scheme, weights, x, topk_w, topk_ids, experts: int, activation: str
                 ) -> tuple[Callable[[WholePlan], Callable[[int], None]], torch.Tensor]:
    """(call, out): call(plan) -> fn(i) runs the experts op (`triton_experts`, or
    `triton_quant_experts` with the scheme's scales) on weight copy i with the plan's path and
    tiles, every launch the layer makes for it (routing apart), writing `out`."""
    from fusedmoe.backends.triton.experts import triton_experts
    from fusedmoe.backends.triton.quant import triton_quant_experts

    out = torch.empty_like(x)

    def call(plan: WholePlan) -> Callable[[int], None]:
        def run(i: int) -> None:
            w13, w2, params, b13, b2 = weights[i]
            args = (x, w13, w2, topk_w, topk_ids, b13, b2, None, experts, activation, False, 1.702, None)
            if params is None:
                triton_experts(*args, tiles=(plan.gemm1, plan.gemm2), out=out, direct=plan.direct)
            else:
                triton_quant_experts(*args, scheme, params.w13_scale, params.w2_scale, params.a13_scale,
                                     params.a2_scale, tiles=(plan.gemm1, plan.gemm2), out=out,
                                     w13_global_scale=params.w13_global_scale,
                                     w2_global_scale=params.w2_global_scale, direct=plan.direct,
                                     w13_zero=params.w13_zero, w2_zero=params.w2_zero)

        return run

    return call, out


def _plan_disagreement(call: Callable[[WholePlan], Callable[[int], None]], out: torch.Tensor, plan: WholePlan,
                       draw: Draw, reference: tuple, scheme, activation: str,
                       device: torch.device) -> tuple[float, str | None]:
    """(relative Frobenius error of `plan`'s output on weight copy 0 and its draw, why the plan is
    refused or None): `bench.check_cell` against `bench.reference_output` on the same weights
    (`reference`: the float32 reference, or emulation of the checkpoint-layout copy), as `fusedmoe
    bench --check` checks a cell; then `bench.repeat_mismatch`: bench.CHECK_RUNS - 1 more runs of
    the plan must give its first output bit for bit (the kernels are deterministic: runs that
    differ are a race, as the 4-bit fragment GEMMs' in-flight wgmma was). The output is poisoned
    (NaN) before each run of the plan, so rows it leaves unwritten count. (Until 2026-11-30 the
    bar was the heuristic plan's output: a fault both plans share passed it.)"""
    from fusedmoe.bench import check_cell, reference_output, repeat_mismatch

    def poisoned_run() -> torch.Tensor:
        out.fill_(float("nan"))
        call(plan)(0)
        return out

    w13, w2, params, b13, b2 = reference
    want = reference_output(draw.x, draw.topk_w, draw.topk_ids,
                            (w13, w2, b13, b2) if params is None else (w13, w2, b13, b2, params), activation)
    first = poisoned_run().clone()
    err, why = check_cell(first, want, None if scheme is None else scheme.name, device)
    return err, why if why is not None else repeat_mismatch(poisoned_run, first)


def _weight_copy(experts, hidden, inter, gated, dtype, scheme, gen, bias: bool = False, *,
                 prepare: bool = True) -> tuple:
    """(w13, w2, QuantParams or None, b13, b2): random weights, quantized as the bench quantizes
    them and laid out as the layer's process_weights leaves them (on the CPU too; prepare=False:
    the checkpoint layout, which the emulation reference reads); the biases None unless `bias`."""
    from fusedmoe.bench import _quantized_copy, scaled_randn

    rows = 2 * inter if gated else inter
    w13 = scaled_randn((experts, rows, hidden), hidden**-0.5, dtype=dtype, generator=gen)
    w2 = scaled_randn((experts, hidden, inter), inter**-0.5, dtype=dtype, generator=gen)
    b13, b2 = ((scaled_randn((experts, rows), 1.0, dtype=dtype, generator=gen),
                scaled_randn((experts, hidden), 1.0, dtype=dtype, generator=gen)) if bias else (None, None))
    if scheme is None:
        return w13, w2, None, b13, b2
    q13, q2, _, _, params = _quantized_copy(w13, w2, None, None, scheme.name, prepare=prepare)
    return q13, q2, params, b13, b2


def _gemms(scheme, weights, x, topk_w, topk_ids, experts, inter, activation, fill: TileConfig):
    """(gemm1(i, tile), gemm2(i, tile), the Launch) launching one GEMM of the scheme's path on
    weight copy i, at fill.block_m. GEMM1 runs once with `fill` on copy 0 to make the
    intermediate GEMM2 reads; timed GEMM1 calls write their own, so GEMM2's input stays that one.
    A W8A8 GEMM1 includes the intermediate's quantization (fused into it or not, by the tile)."""
    from fusedmoe.backends.triton.experts import launch_gemm1, launch_gemm2, prepare_launch

    if scheme is not None and not scheme.weight_only:
        from fusedmoe.backends.triton.quant import (
            launch_quant_gemm1,
            launch_quant_gemm2,
            prepare_quant_launch,
        )

        q = prepare_quant_launch(x, topk_w, topk_ids, None, experts, experts, inter, activation, False,
                                 1.702, None, scheme, weights[0][2].a13_scale, fill.block_m)
        timed = dataclasses.replace(q, L=dataclasses.replace(q.L, a=torch.empty_like(q.L.a)))

        def gemm1(i: int, tile: TileConfig, q=timed) -> None:
            params = weights[i][2]
            launch_quant_gemm1(q, weights[i][0], weights[i][3], params.w13_scale, tile, params.a2_scale)

        def gemm2(i: int, tile: TileConfig) -> None:
            launch_quant_gemm2(q, weights[i][1], weights[i][4], weights[i][2].w2_scale, tile)

        gemm1(0, fill, q)
        return gemm1, gemm2, q.L

    launch = prepare_launch(x, topk_w, topk_ids, None, experts, experts, inter, activation, False, 1.702,
                            None, fill.block_m)
    timed = dataclasses.replace(launch, a=torch.empty_like(launch.a))
    args13, args2 = _weight_only_args(scheme, weights, x)

    def gemm1(i: int, tile: TileConfig, launch=timed) -> None:
        launch_gemm1(launch, weights[i][0], weights[i][3], tile, args13[i])

    gemm1(0, fill, launch)
    return gemm1, lambda i, tile: launch_gemm2(launch, weights[i][1], weights[i][4], tile, args2[i]), launch


def _aligned_overhead(x, topk_w, topk_ids, experts, inter, activation, block_m,
                      xq: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """fn(i) running the aligned path's launches other than its GEMMs: the alignment at block_m,
    x's quantization (xq, where it is its own launch) and the top-k sum (the same for every
    weight copy i). The sum reads random rows made once (a fresh launch's y is uninitialised: its
    sums could be inf and NaN)."""
    from fusedmoe.backends.triton.experts import launch_reduce, prepare_launch

    out = torch.empty_like(x)
    y = torch.randn(topk_ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)

    def run(i: int) -> None:
        launch = prepare_launch(x, topk_w, topk_ids, None, experts, experts, inter, activation, False,
                                1.702, None, block_m)
        if xq is not None:
            xq(i)
        launch_reduce(dataclasses.replace(launch, y=y), out)

    return run


def _x_quantization(scheme, x) -> Callable[[int], None] | None:
    """fn(i) quantizing x as the W8A8 layer does before GEMM1 (per token / 1x128 group,
    quant.quantize_activation); None where the GEMMs take x as it is (unquantized, weight-only)
    or its codes are made per aligned row inside the timed GEMM launches' setup (per-tensor,
    which has no direct path to compare with)."""
    if scheme is None or scheme.weight_only or scheme.activation.granularity == "tensor":
        return None
    from fusedmoe.backends.triton.quant import quantize_activation

    return lambda i: quantize_activation(x, scheme.activation)


def _swappable(scheme, *, direct: bool = False) -> bool:
    """Whether the search tries SWAP_AB both ways: W8A8 with fp8 activation codes (the ones
    wgmma takes only swapped at 16-32-row blocks), and on the direct decode path int8 codes too
    (swapped, one live row's GEMMs run wgmma on the weight side instead of IMMA: the direct GEMM2
    at Qwen3-30B M=4 145 -> 104 registers, 17 ldmatrix -> 1 in the sm90 compile; forced on every
    decode cell it won at Llama-4 M=1 and lost elsewhere with tiles tuned unswapped, H200:
    benchmarks/results/2026-11-24_h200_1cbdac8_w8a8_decode_swap_probe.txt)."""
    if scheme is None or scheme.weight_only:
        return False
    return scheme.activation.dtype == "fp8" or (direct and scheme.activation.dtype == "int8")


def _rule_swap(tile: TileConfig, scheme, device: torch.device, *, direct: bool) -> TileConfig:
    """`tile` with the swap the rule (`quant.swap_ab`) gives it made explicit, where the search
    tries SWAP_AB: the descent then flips it once instead of timing the rule's own choice again,
    and an entry keeps the swap it was timed with if the rule changes."""
    if not _swappable(scheme, direct=direct) or tile.swap_ab is not None:
        return tile
    from fusedmoe.backends.triton.quant import swap_ab

    return dataclasses.replace(tile, swap_ab=swap_ab(tile, scheme.activation, device, direct=direct))


def _search_direct(problem, scheme, sms, weights, draws: Sequence[Draw], activation,
                   timer: Timer, xq_us: float = 0.0, one_dot: bool = False,
                   warm: Callable[[str, TileConfig], Callable[[list[TileConfig]], None] | None] = lambda kind, fill: None,
                   ) -> tuple[float, tuple]:
    """(us of `experts.direct_heuristic`'s pair, (best us, "direct", gemm1 tile, gemm2 tile)):
    each GEMM descends from the heuristic's tile over the pairs `tiles.check_plan` accepts as
    direct (GEMM2's split_k: slot shares, at most top_k). xq_us: x's quantization launch, added
    to both totals. one_dot: GEMM1's descent toggles it too (the 4-bit fragment GEMM1)."""
    from fusedmoe.backends.triton.experts import direct_heuristic
    from fusedmoe.backends.triton.tiles import tile_mode

    d1, d2 = direct_heuristic(problem, scheme, sms)
    gemm1, gemm2 = _direct_pair(scheme, weights, draws, problem, activation, d1)
    quant, group = tile_mode(scheme)
    plan = dict(direct=True, dtype=problem.dtype, gated=problem.gated, quant=quant, group=group)

    def time1(tile: TileConfig) -> float:
        return timer("direct gemm1", tile, lambda i: gemm1(i, tile))

    def time2(tile: TileConfig) -> float:
        return timer("direct gemm2", tile, lambda i: gemm2(i, tile))

    def ok2(tile: TileConfig) -> str | None:
        if tile.split_k > problem.top_k:
            return f"{tile.split_k} slot shares > top_k={problem.top_k}"
        return check_plan(d1, tile, **plan)

    us1, us2 = time1(d1), time2(d2)
    d1, d2 = (_rule_swap(t, scheme, draws[0].x.device, direct=True) for t in (d1, d2))
    time1, time2 = _once(time1, warm("direct gemm1", d1)), _once(time2, warm("direct gemm2", d1))
    time1.known[d1], time2.known[d2] = us1, us2
    swap = _swappable(scheme, direct=True)
    b1, u1 = _descend(time1, d1, lambda tile: check_plan(tile, d2, **plan), allow_split=True,
                      allow_swap=swap, allow_one_dot=one_dot)
    b2, u2 = _descend(time2, d2, ok2, allow_split=True, allow_swap=swap)
    return us1 + us2 + xq_us, (u1 + u2 + xq_us, "direct", b1, b2)


def _direct_gemms(scheme, weights, x, topk_w, topk_ids, experts, inter, activation, fill: TileConfig):
    """(gemm1(i, tile), gemm2(i, tile), the Launch, out) of the direct path on weight copy i.
    GEMM1 runs once with `fill` on copy 0 to make the intermediate GEMM2 reads; timed GEMM1 calls
    write their own. GEMM2 writes `out` [T, H] (with the top-k sum; its slot shares add the
    combine launch). W8A8: x quantized once here (its launch is timed apart, `_x_quantization`),
    or by GEMM1 itself (per token, quant.fuse_x_quantization); GEMM1 includes the intermediate's
    quantization launch, unless GEMM2 quantizes it itself (quant.fuse_a_quantization)."""
    from fusedmoe.backends.triton.experts import (
        launch_gemm1,
        launch_gemm2_direct,
        prepare_direct_launch,
    )

    out = torch.empty_like(x)
    if scheme is not None and not scheme.weight_only:
        from fusedmoe.backends.triton.quant import (
            launch_quant_gemm1,
            launch_quant_gemm2,
            prepare_direct_quant_launch,
        )

        q = prepare_direct_quant_launch(x, topk_w, topk_ids, None, experts, experts, inter, activation, False,
                                        1.702, None, scheme)
        timed = dataclasses.replace(q, L=dataclasses.replace(q.L, a=torch.empty_like(q.L.a)))

        def gemm1_q(i: int, tile: TileConfig, q=timed) -> None:
            params = weights[i][2]
            launch_quant_gemm1(q, weights[i][0], weights[i][3], params.w13_scale, tile, params.a2_scale)

        def gemm2_q(i: int, tile: TileConfig) -> None:
            launch_quant_gemm2(q, weights[i][1], weights[i][4], weights[i][2].w2_scale, tile, out=out)

        gemm1_q(0, fill, q)
        return gemm1_q, gemm2_q, q.L, out

    launch = prepare_direct_launch(x, topk_w, topk_ids, None, experts, experts, inter, activation, False,
                                   1.702, None)
    timed = dataclasses.replace(launch, a=torch.empty_like(launch.a))
    args13, args2 = _weight_only_args(scheme, weights, x)

    def gemm1(i: int, tile: TileConfig, launch=timed) -> None:
        launch_gemm1(launch, weights[i][0], weights[i][3], tile, args13[i])

    def gemm2(i: int, tile: TileConfig) -> None:
        launch_gemm2_direct(launch, weights[i][1], weights[i][4], tile, out, args2[i])

    gemm1(0, fill, launch)
    return gemm1, gemm2, launch, out


def _weight_only_args(scheme, weights, x) -> tuple[list, list]:
    """Per weight copy, the GEMMs' weight-only kernel arguments (None: unquantized)."""
    if scheme is None:
        return [None] * len(weights), [None] * len(weights)
    from fusedmoe.backends.triton.weight_only import _kernel_args

    return ([_kernel_args(scheme, w[2].w13_scale, w[2].w13_global_scale, x, w[2].w13_zero) for w in weights],
            [_kernel_args(scheme, w[2].w2_scale, w[2].w2_global_scale, x, w[2].w2_zero) for w in weights])


class CompilePool:
    """Worker processes that compile batches of tiles' kernels for one shape (`fusedmoe tune
    --jobs N`). Each worker builds its own copy of the problem on the same GPU (one weight copy,
    the scheme's layout, the same token count) and runs each tile's GEMM once: Triton writes the
    kernel to its cache, where the tuner's own launch of the tile then finds it. A tile whose
    kernel fails in a worker is left to the tuner, which compiles it itself and skips it as
    before. Spawned processes (CUDA cannot fork); use as a context manager."""

    def __init__(self, jobs: int, *, experts: int, hidden: int, inter: int, top_k: int, activation: str = "silu",
                 dtype: torch.dtype = torch.bfloat16, quant: str | None = None, bias: bool = False,
                 device: torch.device | None = None):
        if jobs < 2:
            raise ValueError(f"jobs={jobs}: a CompilePool needs at least 2 worker processes")
        device = torch.device(device or "cuda")
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
        else:  # CPU tensors: the kernels run under the Triton interpreter (the tests' case)
            index = None
        self.spec = (experts, hidden, inter, top_k, activation, dtype, quant, bias, device.type)
        self.errors: list[str] = []  # "kind tile: why" for each tile a worker could not run
        context = multiprocessing.get_context("spawn")
        # one worker at a time builds its weight copy: quantizing gpt-oss-size weights holds
        # several GB of full-precision temporaries, which N workers at once could run out of
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=jobs, mp_context=context, initializer=_worker_init, initargs=(index, context.Lock()))

    def warm(self, tokens: int, kind: str, fill: TileConfig, tiles: list[TileConfig]) -> None:
        """Run each tile's `kind` GEMM ("gemm1", "gemm2", "direct gemm1", "direct gemm2") once in
        the workers, all at once; returns when every one has finished. fill: the GEMM1 tile whose
        launch makes GEMM2's input (its row block size), as the tuner's own timers run it."""
        futures = [self._pool.submit(_worker_warm, self.spec, tokens, kind, fill, tile) for tile in tiles]
        for tile, future in zip(tiles, futures, strict=True):
            try:
                error = future.result()
            except Exception as exc:  # a worker that died (e.g. out of memory): the tuner compiles it itself
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                self.errors.append(f"{kind} {tile}: {error}")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_WORKER_LOCK = None  # a CompilePool worker's share of the pool's weight-building lock


def _worker_init(device_index: int | None, lock) -> None:
    global _WORKER_LOCK
    if device_index is not None:
        torch.cuda.set_device(device_index)
    _WORKER_LOCK = lock


@functools.lru_cache(maxsize=1)
def _worker_weights(spec: tuple) -> tuple:
    experts, hidden, inter, top_k, activation, dtype, quant, bias, device = spec
    from fusedmoe.activations import is_gated
    from fusedmoe.quant.scheme import get_scheme

    scheme = get_scheme(quant)
    gen = torch.Generator(device=device).manual_seed(1)
    with _WORKER_LOCK:
        weights = [_weight_copy(experts, hidden, inter, is_gated(activation), dtype, scheme, gen, bias)]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the temporaries back to the device before the lock passes on
    return scheme, weights


@functools.lru_cache(maxsize=4)
def _worker_tokens(spec: tuple, tokens: int) -> tuple:
    experts, hidden, _, top_k, _, dtype, _, _, device = spec
    from fusedmoe.bench import routing_draws

    x, _, topk_w, topk_ids = routing_draws(tokens, hidden, experts, top_k, 1,
                                           torch.Generator(device=device).manual_seed(2), dtype)[0]
    return x, topk_w, topk_ids


def _worker_warm(spec: tuple, tokens: int, kind: str, fill: TileConfig, tile: TileConfig) -> str | None:
    """One tile's GEMM run once in a CompilePool worker (compiling its kernel into Triton's
    cache); None, or why it failed."""
    try:
        experts, _, inter, _, activation, _, _, _, _ = spec
        scheme, weights = _worker_weights(spec)
        x, topk_w, topk_ids = _worker_tokens(spec, tokens)
        args = (scheme, weights, x, topk_w, topk_ids, experts, inter, activation)
        gemms = {"gemm1": _gemms, "gemm2": _gemms, "direct gemm1": _direct_gemms, "direct gemm2": _direct_gemms}
        if kind not in gemms:
            return f"unknown kind {kind!r}"
        if kind.endswith("gemm1"):
            gemms[kind](*args, tile)  # runs GEMM1 with its fill tile: this one
        else:
            gemms[kind](*args, fill)[1](0, tile)
        if x.is_cuda:
            torch.cuda.synchronize()
        return None
    except Exception as exc:  # the tuner meets the same failure and skips the tile
        return f"{type(exc).__name__}: {exc}"


def _layout_of(e: dict) -> str:
    """A table entry's 4-bit weight layout as `tuning` reads it (`tuning.entry_layout`; "" for
    the other schemes and for entries it would reject)."""
    from fusedmoe.backends.triton.tuning import entry_layout
    from fusedmoe.quant.scheme import get_scheme

    try:
        return entry_layout(e.get("layout"), get_scheme(e.get("quant")), e["hidden"], e["inter"], e["gated"]) or ""
    except ValueError:
        return ""


def entry_key(e: dict) -> tuple:
    """What one table entry serves: (scheme, dtype, shape, 4-bit weight layout, token count); two
    entries of one key cannot both be in a table."""
    return (e.get("quant") or "", e["dtype"], e["experts"], e["hidden"], e["inter"], e["top_k"], e["gated"],
            _layout_of(e), e["tokens"])


def merge_entries(old: list[dict], new: list[dict]) -> tuple[list[dict], list[tuple], list[tuple]]:
    """(old with new merged in, sorted by `entry_key`; the keys new replaced; the keys new added)."""
    merged = {entry_key(e): e for e in old}
    replaced = [entry_key(e) for e in new if entry_key(e) in merged]
    added = [entry_key(e) for e in new if entry_key(e) not in merged]
    merged.update({entry_key(e): e for e in new})
    return sorted(merged.values(), key=entry_key), replaced, added


def write_table(entries: list[dict], folder: str | Path) -> Path:
    """Merge `entries` into <folder>/<device>.json (same shape, weight layout and token count:
    replaced)."""
    import triton

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / device_file_name(torch.cuda.get_device_name())
    old = []
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("format") in READ_FORMATS and data.get("triton", "").split(".")[:2] == triton.__version__.split(".")[:2]:
                old = data["entries"]
        except (OSError, ValueError):
            pass
    data = {"format": FORMAT, "device": torch.cuda.get_device_name(), "triton": triton.__version__,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "entries": merge_entries(old, entries)[0]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    clear_tile_caches()  # this process's next calls see the new entries
    return path


def progress_printer(total: int) -> Callable[[str], None]:
    count = [0]

    def show(label: str) -> None:
        count[0] += 1
        print(f"\r[{count[0]:>3}/{total}] {label:<70}", end="", file=sys.stderr, flush=True)

    return show
