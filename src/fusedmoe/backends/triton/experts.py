"""Host side of the `triton` backend: align slots by expert, pick tiles, launch the kernels.

    sorted_slot, block_expert, num_rows = align(topk_ids, expert_map)   # stable sort, no host sync
        (N <= 256: one program ranks all slots; N <= ALIGN_CHUNKED_MAX_SLOTS: one program sorts chunks;
         beyond: count / offsets / scatter launches, one program per chunk; L > 4096: torch)
    a = gemm1(x, w13)  ->  y = gemm2(a, w2)  ->  out = reduce(y)
    few slots (`choose_plan`): a = gemm1 by slot  ->  out = gemm2 with the top-k sum (no align, no reduce)

On sm90+ the large-M unquantized and W8A8 GEMMs load their weights (and gemm2 its sorted rows a,
or their codes) through TMA descriptors built here per call (`tma_reasons` decides;
FUSEDMOE_TRITON_TMA=0 turns it off).

The whole computation is the custom op `fusedmoe::triton_experts` (with a fake implementation),
so layers using it compile with `torch.compile(fullgraph=True)` and capture in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusedmoe.activations import ACTIVATIONS, is_gated
from fusedmoe.backends.triton import replay
from fusedmoe.backends.triton.launcher import launch
from fusedmoe.backends.triton.tiles import (
    DIRECT_BLOCK_M,
    DIRECT_REFUSED,
    PERSISTENT_PROGRAMS,
    W4_FRAG_FORMATS,
    W4_MXFP4_FRAG,
    W4_PERSISTENT_PROGRAMS,
    TileConfig,
    fragment_tile,
    heuristic,
    require_plan,
    tile_mode,
)
from fusedmoe.modular import BatchedExperts, Experts, ExpertWeights, call_op, experts_ops
from fusedmoe.validation import should_validate

ACT_CODES = {name: i for i, name in enumerate(
    ("silu", "gelu", "gelu_tanh", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul")
)}
assert set(ACT_CODES) == set(ACTIVATIONS)


# W8A8 scale modes of the GEMM kernels, keyed by the weight granularity: keep in sync with kernels.Q_*.
# Per-tensor runs the per-channel mode: its codes carry a scale per aligned row (the expert's),
# its weight scale is read at channel stride 0.
W8A8_QUANT_CODES = {"tensor": 2, "channel": 2, "block": 3}
# Which alignment, from benchmarks/bench_align.py on an H200 (us per call, CUDA graph, E = 8..256):
#   N      small      chunked    multi      torch
#   256    9.3-14.8   8.0-9.5    -          69-72
#   1024   -          8.3-9.9    10.6-11.6  77-80
#   2048   -          13.5-15.6  10.3-11.7  79-82
#   32768  -          173-183    10.7-16.1  99-104
#   131072 -          -          11.5-31.1  119-136
# The small kernel's [N, N] compare grows with N^2: it wins at 64 (3.5-6 vs ~9 on an H100) and
# loses at 256, so it keeps N <= 128.
ALIGN_SMALL_MAX_SLOTS = 128  # one-program alignment up to here: a [N, N] rank compare in registers
ALIGN_CHUNKED_MAX_SLOTS = 1024  # one program sorting ALIGN_CHUNK slots at a time up to here
ALIGN_MAX_LOCAL_EXPERTS = 4096  # the Triton alignments; sort keys expert*chunk stay far below 2^31
ALIGN_CHUNK = 1024  # slots sorted at once by the chunked alignment
ALIGN_MULTI_CHUNK = 1024  # slots per program of the multi-program alignment
ALIGN_OFFSETS_TILE = 8192  # counts [chunks, L] summed per step by the one-program offsets kernel


def align(
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None,
    num_global_experts: int,
    num_local_experts: int,
    block_m: int,
    launch_kw: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the N = T*K slots by local expert, each expert's run padded to a multiple of block_m.

    Returns sorted_slot [R] int32 (slot index t*K+k, or N for padding), block_expert [R/block_m]
    int32 (L for blocks past num_rows), num_rows [1] int32 (padded rows in use) and slot_ok [N]
    int8 (1 = the slot runs here).
    R = N + min(L, N)*(block_m - 1) rounded up to block_m: the worst case, known on the host, so
    nothing waits on the device. The sort is stable: the same ids give the same order, bit for bit.
    Four paths, one result: N <= 128 (decode) one Triton program ranking all slots at once;
    N <= ALIGN_CHUNKED_MAX_SLOTS one Triton program sorting ALIGN_CHUNK slots at a time; beyond, three
    launches with one program per ALIGN_MULTI_CHUNK slots; more than 4096 local experts, torch ops.
    """
    topk_ids_TK = topk_ids_TK.contiguous()  # the kernels read ids[t*K + k]; a column slice is strided
    n = topk_ids_TK.numel()
    args = (topk_ids_TK, expert_map_E, num_global_experts, num_local_experts, block_m)
    if num_local_experts > ALIGN_MAX_LOCAL_EXPERTS:
        return align_torch(*args)
    launch_kw = pdl(topk_ids_TK.device) if launch_kw is None else launch_kw
    if n <= ALIGN_SMALL_MAX_SLOTS and num_local_experts < ALIGN_MAX_LOCAL_EXPERTS:
        return _align_small(*args, launch_kw)
    if n <= ALIGN_CHUNKED_MAX_SLOTS:
        return _align_chunked(*args, launch_kw)
    return _align_multi(*args, launch_kw)


def _rows(n: int, num_local: int, block_m: int) -> int:
    rows = n + min(num_local, n) * (block_m - 1)
    return (rows + block_m - 1) // block_m * block_m


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    import triton.language as tl

    return (device_capability(device_index) >= (9, 0)
            and hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents"))


def pdl(device: torch.device) -> dict:
    """Launch keywords for programmatic dependent launch (kernels._pdl_enter) on this device:
    sm90+ GPUs whose Triton has grid dependency control, unless FUSEDMOE_PDL=0. The interpreter
    (CPU tensors) launches plainly; the knob is read (and a bad value refused) on every device."""
    from fusedmoe import knobs

    if knobs.get("PDL") is False or device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return dict(PDL=True, launch_pdl=True) if _pdl_supported(index) else {}


def _align_outputs(n: int, num_local: int, block_m: int, device: torch.device):
    rows = _rows(n, num_local, block_m)
    return (torch.empty(rows, dtype=torch.int32, device=device),
            torch.empty(rows // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
            torch.empty(n, dtype=torch.int8, device=device))


def _align_small(topk_ids_TK, expert_map_E, num_global_experts, num_local_experts, block_m, launch_kw=None):
    from fusedmoe.backends.triton import kernels

    device = topk_ids_TK.device
    launch_kw = pdl(device) if launch_kw is None else launch_kw
    n = topk_ids_TK.numel()
    sorted_slot, block_expert, num_rows, slot_ok = _align_outputs(n, num_local_experts, block_m, device)
    rows = sorted_slot.numel()
    block_e = triton_next_pow2(num_local_experts + 1)
    scratch = torch.empty(block_e, dtype=torch.int32, device=device)
    ids = topk_ids_TK.reshape(-1)
    launch(kernels.moe_align_small_kernel, (1,),
        ids, expert_map_E if expert_map_E is not None else ids, sorted_slot, block_expert, num_rows,
        slot_ok, scratch, n, num_global_experts, num_local_experts, rows,
        HAS_MAP=expert_map_E is not None, BLOCK_N=max(16, triton_next_pow2(n)), BLOCK_E=block_e,
        BLOCK_M=block_m, BLOCK_R=1024, num_warps=4, **launch_kw,
    )
    return sorted_slot, block_expert, num_rows, slot_ok


def _align_chunked(topk_ids_TK, expert_map_E, num_global_experts, num_local_experts, block_m,
                   launch_kw=None, chunk=ALIGN_CHUNK):
    """`align` in one Triton program for any N: stable sort of `chunk` slots at a time (a power of 2)."""
    from fusedmoe.backends.triton import kernels

    device = topk_ids_TK.device
    launch_kw = pdl(device) if launch_kw is None else launch_kw
    n = topk_ids_TK.numel()
    num_local = num_local_experts
    sorted_slot, block_expert, num_rows, slot_ok = _align_outputs(n, num_local, block_m, device)
    padded_n = triton_cdiv(n, chunk) * chunk
    scratch = torch.empty(2 * num_local + 1 + 2 * padded_n, dtype=torch.int32, device=device)
    count, start, key, rank = scratch.split([num_local + 1, num_local, padded_n, padded_n])
    ids = topk_ids_TK.reshape(-1)
    launch(kernels.moe_align_kernel, (1,),
        ids, expert_map_E if expert_map_E is not None else ids, sorted_slot, block_expert, num_rows,
        slot_ok, count, start, key, rank, n, num_global_experts, num_local, sorted_slot.numel(),
        HAS_MAP=expert_map_E is not None, CHUNK=chunk, BLOCK_E=min(1024, triton_next_pow2(num_local + 1)),
        BLOCK_M=block_m, BLOCK_R=1024, num_warps=16, **launch_kw,
    )
    return sorted_slot, block_expert, num_rows, slot_ok


def _align_multi(topk_ids_TK, expert_map_E, num_global_experts, num_local_experts, block_m,
                 launch_kw=None, chunk=ALIGN_MULTI_CHUNK, offsets_tile=ALIGN_OFFSETS_TILE):
    """`align` in three launches: count (one program per `chunk` slots, a power of 2), offsets (one
    program, `offsets_tile` counts at a time), scatter (one program per chunk)."""
    from fusedmoe.backends.triton import kernels

    device = topk_ids_TK.device
    launch_kw = pdl(device) if launch_kw is None else launch_kw
    n = topk_ids_TK.numel()
    num_local = num_local_experts
    sorted_slot, block_expert, num_rows, slot_ok = _align_outputs(n, num_local, block_m, device)
    rows = sorted_slot.numel()
    num_chunks = max(1, triton_cdiv(n, chunk))
    padded_n = num_chunks * chunk
    # count [chunks, L]: at N = 1M slots and L = 512, 1024 x 512 ints (2 MiB)
    scratch = torch.empty(num_local + 2 * padded_n + num_chunks * num_local, dtype=torch.int32, device=device)
    start, key, in_run, count = scratch.split([num_local, padded_n, padded_n, num_chunks * num_local])
    ids = topk_ids_TK.reshape(-1)
    has_map = expert_map_E is not None
    block_e = min(1024, triton_next_pow2(max(num_local, 1)))
    num_warps = min(16, max(4, chunk // 64))
    launch(kernels.moe_align_count_kernel, (num_chunks,),
        ids, expert_map_E if has_map else ids, sorted_slot, block_expert, slot_ok, count, key, in_run,
        n, num_global_experts, num_local, rows, triton_cdiv(rows, num_chunks),
        triton_cdiv(rows // block_m, num_chunks),
        HAS_MAP=has_map, CHUNK=chunk, BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_R=1024, num_warps=num_warps,
        **launch_kw,
    )
    block_e = min(block_e, triton_next_pow2(offsets_tile))
    block_c = max(2, min(triton_next_pow2(num_chunks), offsets_tile // block_e))
    launch(kernels.moe_align_offsets_kernel, (1,),
        count, start, num_rows, num_chunks, num_local, BLOCK_C=block_c, BLOCK_E=block_e, BLOCK_M=block_m,
        num_warps=16, **launch_kw,
    )
    launch(kernels.moe_align_scatter_kernel, (num_chunks,),
        sorted_slot, block_expert, count, start, key, in_run, num_local, CHUNK=chunk, BLOCK_M=block_m,
        num_warps=num_warps, **launch_kw,
    )
    return sorted_slot, block_expert, num_rows, slot_ok


def align_torch(
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None,
    num_global_experts: int,
    num_local_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align` with torch ops (stable sort, scatter_add counts, cumsum, searchsorted): any size."""
    device = topk_ids_TK.device
    n = topk_ids_TK.numel()
    num_local = num_local_experts
    ids = topk_ids_TK.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_global_experts)
    local = torch.where(valid, ids, torch.zeros_like(ids))
    if expert_map_E is not None:
        local = expert_map_E.long()[local]
        valid &= local >= 0
    local = torch.where(valid, local, torch.full_like(local, num_local))  # invalid -> bucket L

    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    # Narrow keys sort in fewer radix passes (2 bytes instead of 8 for up to 32k experts).
    key_dtype = torch.int16 if num_local < 2**15 - 1 else torch.int32
    sorted_key, order = torch.sort(local.to(key_dtype), stable=True)
    sorted_local = sorted_key.long()
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    unpadded_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=device) - unpadded_start[sorted_local]

    rows = _rows(n, num_local, block_m)
    is_local = sorted_local < num_local
    dest = torch.where(
        is_local, padded_start[sorted_local.clamp(max=num_local - 1)] + rank,
        torch.full_like(rank, rows),  # invalid slots land in a dump row past the end
    )
    sorted_slot = torch.full((rows + 1,), n, dtype=torch.int32, device=device)
    sorted_slot.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    num_rows = padded_end[-1:].to(torch.int32) if num_local else torch.zeros(1, dtype=torch.int32, device=device)
    return sorted_slot[:rows], block_expert, num_rows, valid.to(torch.int8)


@dataclass(frozen=True)
class GemmProblem:
    """What tile selection keys on: sizes, flags and dtype of one experts call."""

    num_slots: int
    num_local_experts: int
    hidden: int
    inter: int
    top_k: int
    gated: bool
    dtype: torch.dtype
    # 4-bit weights in the fragment layout (True) or the checkpoint's (False), where the caller
    # holds the weights; None: as `process_weights` would lay them now (weight_only.w4_layout)
    fragments: bool | None = None


def memoized_tiles(choose: Callable[..., tuple[TileConfig, TileConfig]]):
    """`choose(problem, [scheme,] device)` remembered per arguments and the knobs it reads
    (TUNED_DIR, TUNED_PACKAGED, TUNED_SIBLINGS, TRITON_TMA, TRITON_DIRECT, TRITON_W4_FRAGMENTS: the
    layout a problem without `fragments` plans for): the tuned-table lookup (file stats) and the heuristic cost ~20-40 us
    of host time per eager call otherwise. Tables written by `fusedmoe tune` in this process
    clear it (`clear_tile_caches`); a table file rewritten by another process is read by the next
    process, as tuned configs are read once at startup elsewhere (vLLM)."""
    from fusedmoe import knobs

    @functools.lru_cache(maxsize=4096)
    def cached(args: tuple, tuned_dir, packaged, siblings, tma, direct, w4_fragments):
        del tuned_dir, packaged, siblings, tma, direct, w4_fragments  # part of the key only
        return choose(*args)

    @functools.wraps(choose)
    def wrapper(*args):
        if torch.compiler.is_compiling():
            return choose(*args)
        return cached(args, knobs.get("TUNED_DIR"), knobs.get("TUNED_PACKAGED"), knobs.get("TUNED_SIBLINGS"),
                      knobs.get("TRITON_TMA"), knobs.get("TRITON_DIRECT"), knobs.get("TRITON_W4_FRAGMENTS"))

    _TILE_CACHES.append(cached)
    return wrapper


_TILE_CACHES: list = []


def clear_tile_caches() -> None:
    for cache in _TILE_CACHES:
        cache.cache_clear()
    replay.clear()  # recorded launches carry the tiles chosen then


@memoized_tiles
def choose_tiles(problem: GemmProblem, device: torch.device) -> tuple[TileConfig, TileConfig]:
    """A tuned entry for this device and shape when one exists, else the heuristic."""
    from fusedmoe.backends.triton.tuning import lookup

    tuned = lookup(problem, device)
    if tuned is not None:
        return tuned
    sms = _num_sms(device)
    p = problem
    tma1, tma2 = tma_planned(problem, device)
    t1 = heuristic(p.num_slots, p.num_local_experts, p.inter, p.hidden, p.dtype, gated=p.gated, num_sms=sms,
                   tma=tma1)
    t2 = heuristic(p.num_slots, p.num_local_experts, p.hidden, p.inter, p.dtype, gated=False, num_sms=sms,
                   tma=tma2)
    return t1, t2


# Direct decode ---------------------------------------------------------------------------------
# Few slots: GEMM1 takes each slot's expert from the top-k ids (one 16-row block per slot, row 0
# live) and GEMM2 sums a token's slots itself (kernels.moe_gemm2_direct_kernel): no alignment and
# no reduce launch, two kernels (three with split-K) instead of four (five). GEMM2 then runs one
# program per (token, N tile), each streaming its N rows of all K experts: it needs enough N
# tiles to fill the SMs and short per-slot K loops to beat the aligned GEMM2, whose programs are
# (slot, N tile). H200 (benchmarks/bench_direct.py, 2026-11-23_h200_direct-vector.txt), us:
#                        aligned -> direct           programs at 32 wide   I
#   DeepSeek-V3 M=1      37.5 -> 29.9               224                   256
#   DeepSeek-V3 M=4      90.0 -> 85.4               896                   256
#   Llama-4 M=1          20.7 -> 15.8               160                   1024
#   Qwen3-30B M=4        77.4 -> 73.1               256                   768
#   Qwen3-30B M=1        29.2 -> 31.3 (lost)        64                    768
#   gpt-oss M=1 / M=4    63.3 -> 74.0 / 202 -> 213  90 / 360              2880
#   Mixtral M=1          170 -> 187                 128                   14336
# GEMM2 now also splits a token's slots over up to K programs (their fp32 partials summed in
# order by moe_reduce_kernel) when its (token, N tile) programs are too few or too long
# (tiles.direct_gemm2_heuristic): at M=1 the three losses above became wins (H200,
# benchmarks/bench_direct_split.py, 2026-11-23_h200_split.txt: Qwen3-30B 29.8 aligned -> 27.9,
# gpt-oss 62.3 -> 59.5, Mixtral 191.8 -> 170.3), so one token always takes the direct path;
# M > 1 keeps the rule measured without shares.
# An expert routed twice is streamed twice (a slot is its own block): auto also wants experts
# rarely repeated among the slots under uniform routing.
DIRECT_MAX_TOP_K = 16  # the GEMM2 kernel holds a token's K ids and weights in registers
DIRECT_MAX_SLOTS = 64
DIRECT_MAX_REPEAT = 1.15  # slots / expected distinct experts under uniform routing
DIRECT_MAX_INTER = 1024  # per-slot K loop of GEMM2
DIRECT_MIN_PROGRAMS = 1.2  # GEMM2 programs at 32-wide N tiles per SM


def direct_reason(problem: GemmProblem) -> str | None:
    """Why the direct decode path cannot run this problem, or None."""
    if problem.top_k > DIRECT_MAX_TOP_K:
        return f"top_k={problem.top_k} > {DIRECT_MAX_TOP_K}"
    if problem.num_slots == 0:
        return "no slots"
    return None


def direct_scheme_reason(scheme) -> str | None:
    """Why the direct decode path cannot run this scheme (a QuantScheme or None), or None."""
    if scheme is not None and not scheme.weight_only and scheme.weight.granularity in DIRECT_REFUSED:
        return f"{scheme.name} quantizes with {DIRECT_REFUSED[scheme.weight.granularity]}"
    return None


def direct_auto_reason(problem: GemmProblem, num_sms: int = 132) -> str | None:
    """Why the auto rule keeps the aligned path, or None when it takes the direct one (measured,
    above): one token, or few slots with experts rarely repeated among them, a short
    intermediate, and enough GEMM2 programs to fill the SMs."""
    n, L = problem.num_slots, max(1, problem.num_local_experts)
    distinct = L * (1.0 - (1.0 - 1.0 / L) ** n)
    programs = (n // problem.top_k) * -(-problem.hidden // 32)
    if n > DIRECT_MAX_SLOTS:
        return f"{n} slots > {DIRECT_MAX_SLOTS}"
    if n == problem.top_k:  # distinct experts; GEMM2's slot shares fill the SMs, bound K loops
        return None
    if n > DIRECT_MAX_REPEAT * distinct:
        return (f"{n} slots over ~{distinct:.1f} distinct experts (uniform routing): each repeat "
                "streams an expert again")
    if problem.inter > DIRECT_MAX_INTER:
        return f"I={problem.inter} > {DIRECT_MAX_INTER}: long per-slot K loops in the direct GEMM2"
    if programs < DIRECT_MIN_PROGRAMS * num_sms:
        return (f"{programs} direct GEMM2 programs at 32-wide tiles < {DIRECT_MIN_PROGRAMS} x {num_sms} SMs")
    return None


def direct_auto(problem: GemmProblem, num_sms: int = 132) -> bool:
    """The auto rule: `direct_auto_reason` finds nothing against the direct path."""
    return direct_auto_reason(problem, num_sms) is None


def direct_wanted(problem: GemmProblem, num_sms: int = 132) -> bool:
    """FUSEDMOE_TRITON_DIRECT: unset/1 = `direct_auto`, 0 = never, force = wherever it can run.

    Unquantized and weight-only calls share the rule. Weight-only on an H200 with the 4-bit
    split-K GEMM1 and 64-wide GEMM2 tiles (`tiles.heuristic`, `tiles.direct_gemm2_heuristic`;
    benchmarks/bench_wo_decode.py, 2026-11-23_h200_f7c3ac4_wo_verify.txt), aligned -> direct in
    us, int4 g32: M=1 Llama-4 18.8 -> 14.0, Qwen3-30B 26.9 -> 21.4, DeepSeek-V3 28.4 -> 23.4,
    Qwen3-235B 23.9 -> 22.8, gpt-oss 65.5 -> 53.7, Mixtral 138.9 -> 132.0 (mxfp4 alike); M=4
    direct where the rule takes it (Llama-4 32.7 -> 29.6, DeepSeek-V3 69.4 -> 59.1, Qwen3-30B
    50.7 -> 50.2, Qwen3-235B 57.5 -> 57.9) and lost where it does not (gpt-oss 153.9 -> 163.2,
    Mixtral 307.4 -> 390.4); M=16 Llama-4, which the rule takes direct, 76.1 -> 81.3 (int4;
    mxfp4 93.8 -> 92.5): the one cell it loses.
    """
    from fusedmoe import knobs

    mode = knobs.get("TRITON_DIRECT")
    if mode is False or direct_reason(problem) is not None:
        return False
    if mode == "force":
        return True
    return direct_auto(problem, num_sms)


def direct_heuristic(problem: GemmProblem, scheme, num_sms: int) -> tuple[TileConfig, TileConfig]:
    """The direct path's (gemm1, gemm2) tiles without a table: GEMM1 the heuristic with one block
    per slot, GEMM2 `direct_gemm2_heuristic`."""
    from fusedmoe.backends.triton.tiles import direct_gemm2_heuristic

    p = problem
    quant, group = tile_mode(scheme)
    t1 = heuristic(p.num_slots, p.num_slots, p.inter, p.hidden, p.dtype, gated=p.gated, num_sms=num_sms,
                   quant=quant, group=group)
    t2 = direct_gemm2_heuristic(p.num_slots // p.top_k, p.hidden, p.inter, p.dtype, num_sms=num_sms,
                                quant=quant, group=group, top_k=p.top_k)
    return t1, t2


@memoized_tiles
def direct_tiles(problem: GemmProblem, scheme, device: torch.device) -> tuple[TileConfig, TileConfig]:
    """(gemm1, direct gemm2) tiles of the direct path: a tuned direct entry's when the table has
    one; else `direct_heuristic`, whose GEMM1 gives way to an aligned entry's 16-row tile (its
    blocks are one expert's slot either way). Whether the path runs is `choose_plan`'s question."""
    from fusedmoe.backends.triton.tuning import lookup

    tuned = lookup(problem, device, scheme, path="direct")
    if tuned is not None:
        return tuned
    t1, t2 = direct_heuristic(problem, scheme, _num_sms(device))
    aligned = lookup(problem, device, scheme)
    if aligned is not None and aligned[0].block_m == DIRECT_BLOCK_M:
        t1 = aligned[0]
    return t1, t2


def tuned_plan(problem: GemmProblem, scheme, device: torch.device):
    """The tuned entry that decides this call's path (`tuning.lookup_plan`: it timed both), or
    None: FUSEDMOE_TRITON_DIRECT 0 or force, a call the direct path cannot run, or no such entry."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton.tuning import lookup_plan

    if (knobs.get("TRITON_DIRECT") in (False, "force") or direct_reason(problem) is not None
            or direct_scheme_reason(scheme) is not None):
        return None
    return lookup_plan(problem, device, scheme)


@memoized_tiles
def choose_plan(problem: GemmProblem, scheme, device: torch.device) -> tuple[bool, TileConfig, TileConfig]:
    """(direct?, gemm1 tile, gemm2 tile) of a call (scheme: a QuantScheme or None) that names no
    tiles and no path, one memoized lookup per eager call. The path: `tuned_plan`'s, else
    `direct_wanted` (never direct for a scheme `direct_scheme_reason` refuses)."""
    tuned = tuned_plan(problem, scheme, device)
    if tuned is not None:
        return tuned.direct, tuned.gemm1, tuned.gemm2
    if direct_scheme_reason(scheme) is None and direct_wanted(problem, _num_sms(device)):
        return (True, *direct_tiles(problem, scheme, device))
    return (False, *_aligned_tiles(problem, scheme, device))


def _aligned_tiles(problem: GemmProblem, scheme, device: torch.device) -> tuple[TileConfig, TileConfig]:
    if scheme is None:
        return choose_tiles(problem, device)
    if not scheme.weight_only:
        from fusedmoe.backends.triton.quant import choose_quant_tiles

        return choose_quant_tiles(problem, scheme, device)
    from fusedmoe.backends.triton.weight_only import choose_weight_only_tiles

    return choose_weight_only_tiles(problem, scheme, device)


FIT_K_MIN_BLOCK_K = 32  # fit_k never goes below this (8-bit and 4-bit dots need >= 32)


def fit_k(t1: TileConfig, t2: TileConfig, problem: GemmProblem) -> tuple[TileConfig, TileConfig]:
    """The tiles with block_k at most each GEMM's K (hidden for GEMM1, inter for GEMM2) rounded up
    to a power of two, and at least FIT_K_MIN_BLOCK_K. Wider K steps only load masked lanes, and
    Triton 3.6 miscompiles one of them: the 16 x 128 x 128 GEMM1 tile with 4 warps, at any stage
    count, read shared memory out of bounds (an illegal memory access) wherever H was not a
    multiple of 16 (H = 8, 11, 13, 24 on an H200; 16 x 128 x 16 / 32 / 64 ran correctly; fuzz seed
    90064, H = 11: docs/reliability.md). The same tile failed at H = 136, 200 and 2888 too, where K
    is wide: so where K is not a multiple of 16, a 16-row, 128-wide tile at 4 warps also steps K by
    at most 64 (correct at H = 11, 136, 200 and 2888 on an H200, clean under memcheck:
    scripts/sanitize_driver.py cases 50-53; 64-row tiles were not seen to fail and keep their
    steps)."""
    def fit(tile: TileConfig, k: int) -> TileConfig:
        cap = max(FIT_K_MIN_BLOCK_K, triton_next_pow2(max(k, 1)))
        if k % 16 and tile.block_m == 16 and tile.block_n >= 128 and tile.num_warps == 4:
            cap = min(cap, 64)
        return tile if tile.block_k <= cap else dataclasses.replace(tile, block_k=cap)

    return fit(t1, problem.hidden), fit(t2, problem.inter)


BATCH_INVARIANT_TOKENS = 1024  # the token count whose heuristic tiles a batch-invariant call runs at every M


@memoized_tiles
def batch_invariant_tiles(problem: GemmProblem, scheme, device: torch.device,
                          per_count: bool = True) -> tuple[TileConfig, TileConfig]:
    """The aligned path's (gemm1, gemm2) tiles of a batch-invariant call
    (`MoEConfig.batch_invariant`, FUSEDMOE_BATCH_INVARIANT); never the direct path, whose GEMM2
    sums a token's slots in another order.

    bf16 on a Hopper GPU, unquantized or mxfp4 / nvfp4 weight-only held as fragments
    (`per_count_tiles`): the aligned plan of this token count (tuned entry or heuristic) with
    GEMM1 in one K pass (split_k 1). Whatever its block sizes, warps, stages, program order,
    persistence or one-dot gate/up, each output element takes the same chain of k16 tensor-core
    steps into one fp32 accumulator (`tl.dot(a, b, acc)`), so its bits do not depend on the tile:
    H200, Triton 3.6, every such plan of Qwen3-30B and DeepSeek-V3 at M = 1-4096 gave bitwise the
    rows of the fixed plan below, as did one-parameter sweeps of each GEMM's tile, while split_k 2
    and the direct path did not (benchmarks/probe_batch_invariance.py,
    results/2026-11-29_h200_53c34c2_batch_invariance_probe.txt). The two 4-bit formats as
    fragments: every count's plan of Qwen3-30B, DeepSeek-V3, gpt-oss-120b and Mixtral agreed
    too, but for one 8-warp mxfp4 GEMM2 (128 x 256 x 64 at Qwen3-30B M=4096), and at 8 warps a
    narrower N tile alone changed rows (GPU fuzz seed 500199); so a 4-bit plan by count runs only
    where both its tiles are 4-warp, its N tiles narrowed at decode (`_narrowed`: the split GEMM1
    it gives up was its programs), and otherwise the narrowed fixed plan below
    (results/2026-11-29_h200_8372f17_layouts_invariance.txt).

    Otherwise one fixed plan's rows and K steps at every token count: the heuristic's tiles for
    BATCH_INVARIANT_TOKENS tokens of this shape, split_k 1, not persistent, gate and up as two
    dots, no tuned table. Every row then takes the same instructions in both GEMMs whatever the
    other rows are (the alignment only moves rows between tiles; the top-k sum adds each token's
    slots in one order). 4-bit weight-only in bf16 on a Hopper GPU (`narrow_invariant`) narrows its N
    tiles at few tokens (`_narrowed`), as the heuristic does at decode: int4's own per-count plans
    do not keep the bits in either layout (checkpoint: 16- and 32-row tiles against 64- and
    128-row ones; fragments: 128 rows at 4 warps and 64 at 8 against the rest), narrower N tiles
    did. Other GPUs (not measured), fp16 / fp32, the interpreter (whose dot adds each K block's
    numpy product), the 8-bit weight-only schemes, mxfp4 / nvfp4 in the checkpoint layout (not
    measured) and the batched layout (per_count False, `batched_invariant_tiles`) keep the fixed
    plan as it is. Decode pays in rows of the tile computed for nothing (a 64-row tile for one
    token)."""
    by_count = per_count_tiles(problem, scheme, device) if per_count else None
    if by_count is not None:
        return by_count
    fixed = _fixed_invariant_tiles(problem, scheme, device)
    if per_count and narrow_invariant(problem, scheme, device):
        return _narrowed(fixed[0], problem, problem.inter, device), _narrowed(fixed[1], problem, problem.hidden, device)
    return fixed


def _fixed_invariant_tiles(problem: GemmProblem, scheme, device: torch.device) -> tuple[TileConfig, TileConfig]:
    """`batch_invariant_tiles`' one plan for every token count of the shape."""
    p = dataclasses.replace(problem, num_slots=BATCH_INVARIANT_TOKENS * problem.top_k)
    sms, (quant, group) = _num_sms(device), tile_mode(scheme)
    codes = None if scheme is None or scheme.weight_only else scheme.weight.dtype
    tma1, tma2 = tma_planned(p, device) if scheme is None else (None, None)
    fixed = dict(split_k=1, persistent=False, one_dot=False)
    frag = _w4_fragments_of(problem, scheme)
    t1 = heuristic(p.num_slots, p.num_local_experts, p.inter, p.hidden, p.dtype, gated=p.gated, num_sms=sms,
                   quant=quant, group=group, tma=tma1, codes=codes, fragments=frag)
    t2 = heuristic(p.num_slots, p.num_local_experts, p.hidden, p.inter, p.dtype, gated=False, num_sms=sms,
                   quant=quant, group=group, tma=tma2, codes=codes, fragments=frag)
    return dataclasses.replace(t1, **fixed), dataclasses.replace(t2, **fixed)


def _w4_fragments_of(problem: GemmProblem, scheme) -> bool:
    """Whether the problem's 4-bit weights are fragments (weight_only.w4_layout; imported here:
    weight_only imports this module)."""
    from fusedmoe.backends.triton.weight_only import w4_layout

    return w4_layout(problem, scheme) == "fragments"


NARROW_MIN_BLOCK_N = 64  # the narrowest N tile `_narrowed` takes (the fragment layout's narrowest, tiles.fragment_tile)
# the warps of the tiles `_narrowed` narrows: at 8 warps (128-row blocks) narrower N tiles changed rows
# (H200, GPU fuzz seed 500199: mxfp4, gelu_no_mul, E=46 H=64 I=640, GEMM1 128 x 128 -> 128 x 64 at 8 warps)
NARROW_WARPS = 4


def _hopper(device: torch.device) -> bool:
    """An NVIDIA Hopper GPU (sm90; not ROCm): where the batch-invariant plans by token count were
    measured (`batch_invariant_tiles`)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9


def _narrow_scheme(problem: GemmProblem, scheme) -> bool:
    """A 4-bit weight-only scheme on bf16 activations: what `narrow_invariant` asks of the call."""
    return (scheme is not None and scheme.weight_only and scheme.weight.dtype in W4_FRAG_FORMATS
            and problem.dtype == torch.bfloat16)


def narrow_invariant(problem: GemmProblem, scheme, device: torch.device) -> bool:
    """Whether a batch-invariant call of a 4-bit weight-only scheme may narrow the fixed plan's N
    tiles for its token count (`_narrowed`): bf16 on a Hopper GPU, the case measured."""
    return _narrow_scheme(problem, scheme) and _hopper(device)


def _narrowed(tile: TileConfig, problem: GemmProblem, n: int, device: torch.device) -> TileConfig:
    """tile with block_n halved (down to NARROW_MIN_BLOCK_N) until the GEMM over n columns has
    two programs per SM at this token count, as the heuristic sizes decode tiles. block_m, block_k
    and warps stay the fixed plan's: narrower N tiles of the same rows, K steps and warps gave
    bitwise the fixed plan's rows on an H200 (mxfp4 and bf16, block_n 16-256, either GEMM, 4 warps;
    results/2026-11-29_h200_53c34c2_batch_invariance_probe.txt), while changing block_m (int4) or
    block_n with block_k and warps together (one mxfp4 tile) did not. Tiles at other than
    NARROW_WARPS warps stay as they are: at 8 warps a narrower N tile alone changed rows (the GPU
    fuzz, docs/reliability.md#batch-invariance)."""
    if tile.num_warps != NARROW_WARPS:
        return tile
    sms = _num_sms(device)
    blocks = min(problem.num_local_experts, problem.num_slots) + problem.num_slots // tile.block_m
    block_n = tile.block_n
    while block_n > NARROW_MIN_BLOCK_N and blocks * triton_cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    return dataclasses.replace(tile, block_n=block_n)


PER_COUNT_W4 = ("mxfp4", "nvfp4")  # 4-bit formats whose fragment-layout plans by count keep a row's bits


def _per_count_scheme(problem: GemmProblem, scheme) -> bool:
    """bf16 activations, unquantized or mxfp4 / nvfp4 weight-only held as fragments: what
    `per_count_invariant` asks of the call."""
    if problem.dtype != torch.bfloat16:
        return False
    return scheme is None or (scheme.weight_only and scheme.weight.dtype in PER_COUNT_W4
                              and _w4_fragments_of(problem, scheme))


def per_count_invariant(problem: GemmProblem, scheme, device: torch.device) -> bool:
    """Whether a batch-invariant call may run the aligned plan of its own token count
    (`batch_invariant_tiles`, where for 4-bit both tiles must be 4-warp too): bf16 on a Hopper GPU,
    unquantized or mxfp4 / nvfp4 as fragments, the cases measured."""
    return _per_count_scheme(problem, scheme) and _hopper(device)


def per_count_tiles(problem: GemmProblem, scheme, device: torch.device) -> tuple[TileConfig, TileConfig] | None:
    """The batch-invariant plan of this token count (`batch_invariant_tiles`), or None where the
    fixed plan runs: the aligned plan, GEMM1 unsplit; for the 4-bit formats only where both tiles
    run NARROW_WARPS warps, their N tiles narrowed at decode."""
    if not per_count_invariant(problem, scheme, device):
        return None
    t1, t2 = _aligned_tiles(problem, scheme, device)
    t1 = dataclasses.replace(t1, split_k=1)
    if scheme is None:
        return t1, t2
    if t1.num_warps != NARROW_WARPS or t2.num_warps != NARROW_WARPS:
        return None
    return _narrowed(t1, problem, problem.inter, device), _narrowed(t2, problem, problem.hidden, device)


def plan_tiles(problem: GemmProblem, scheme, device: torch.device,
               tiles: tuple[TileConfig, TileConfig] | None, direct: bool | None,
               batch_invariant: bool = False) -> tuple[bool, TileConfig, TileConfig]:
    """`_plan_tiles`, its block_k fitted to the K dimensions (`fit_k`). batch_invariant (no
    tiles given): `batch_invariant_tiles` on the aligned path; with direct=True a ValueError."""
    if batch_invariant and tiles is None:
        if direct:
            raise ValueError("batch_invariant: the direct decode path is not batch-invariant (its plan "
                             "depends on the token count); run the aligned path (direct=None or False)")
        return (False, *fit_k(*batch_invariant_tiles(problem, scheme, device), problem))
    is_direct, t1, t2 = _plan_tiles(problem, scheme, device, tiles, direct)
    return (is_direct, *fit_k(t1, t2, problem))


def _plan_tiles(problem: GemmProblem, scheme, device: torch.device,
                tiles: tuple[TileConfig, TileConfig] | None, direct: bool | None) -> tuple[bool, TileConfig, TileConfig]:
    """(direct?, gemm1 tile, gemm2 tile) for a call. direct None: `choose_plan`, or the aligned
    path when `tiles` are given; False: aligned; True: the direct path (`tiles`, when given, are
    its (gemm1, direct gemm2) tiles), a ValueError when it cannot run. Given tiles are held to
    `tiles.check_plan` (a ValueError naming the reason)."""
    if tiles is None:
        if direct is None:
            return choose_plan(problem, scheme, device)
        if not direct:
            return (False, *_aligned_tiles(problem, scheme, device))
    is_direct = bool(direct)
    if is_direct:
        reason = direct_reason(problem) or direct_scheme_reason(scheme)
        if reason is not None:
            raise ValueError(f"the direct decode path cannot run this call: {reason}")
        if tiles is None:
            return (True, *direct_tiles(problem, scheme, device))
    quant, group = tile_mode(scheme)
    require_plan(*tiles, direct=is_direct, dtype=problem.dtype, gated=problem.gated, quant=quant, group=group,
                 running=None if scheme is None else scheme.name)
    return (is_direct, *tiles)


def _scale_runs(problem: GemmProblem, scheme) -> str:
    """`describe_plan`'s words on the fragment scales' row-block runs (`fragments.scale_run`):
    their bytes in w13 / w2 and the padding after them; '' for int4 (its scales' dtype is the
    checkpoint's, unknown here)."""
    from fusedmoe.backends.triton.weight_only import scale_pad
    from fusedmoe.quant.fragments import scale_run_bytes

    if scheme.weight.dtype == "int4":
        return ""
    pad = scale_pad()
    runs = [scale_run_bytes(k, scheme.weight.group, 1, pad) for k in (problem.hidden, problem.inter)]
    words = " / ".join(f"{run} B" + (f" + {stride - run} B padding" if stride > run else "") for run, stride in runs)
    return f"; scale runs per 16 rows, w13 / w2: {words} (FUSEDMOE_TRITON_W4_SCALE_PAD)"


def describe_plan(problem: GemmProblem, scheme, device: torch.device, batch_invariant: bool = False) -> dict:
    """What the contiguous-layout `triton` path runs for this problem on `device`, and why:
    {path, why, launches, gemm1, gemm2 (tile, source, tma, swap_ab: W8A8's SWAP_AB; gemm2's rows:
    the row-stationary W8A8 kernel's description where quant.gemm2_rows picks it)}, and
    fp8_accumulate for fp8 W8A8 with per-tensor / per-channel weight scales (quant.fp8_accumulation),
    w4_layout for the 4-bit formats (the fragment layout and the tiles it runs: tiles.fragment_tile),
    for `fusedmoe explain --tokens`.
    `scheme`: a QuantScheme or None (unquantized); batch_invariant: the call asks for it
    (`batch_invariant_tiles`)."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton.tuning import entry

    mode = knobs.get("TRITON_DIRECT")
    aligned, plan = entry(problem, device, scheme), None  # the aligned path's entry
    src1 = src2 = aligned.source if aligned is not None else "heuristic"
    is_direct, t1, t2 = plan_tiles(problem, scheme, device, None, None, batch_invariant)  # as the call runs them
    why = direct_scheme_reason(scheme)
    if batch_invariant and per_count_tiles(problem, scheme, device) is not None:
        narrowed = "" if scheme is None else ", N narrowed for this M"
        src1, src2 = (f"batch-invariant: the aligned path's ({src1}), in one K pass{narrowed}",
                      f"batch-invariant: the aligned path's ({src2}){narrowed}")
        why = ("batch_invariant: the aligned plan of this token count, GEMM1 unsplit: a row's bits do not "
               "depend on the tile here" + ("" if scheme is None else f" (at {NARROW_WARPS} warps)")
               + " (experts.batch_invariant_tiles)")
    elif batch_invariant and narrow_invariant(problem, scheme, device):
        src1 = src2 = (f"batch-invariant: the heuristic's for {BATCH_INVARIANT_TOKENS} tokens, its N tiles "
                       "narrowed for this M")
        why = ("batch_invariant: one aligned plan's rows, K steps and warps at every token count, its N tiles "
               f"narrowed at decode where they run {NARROW_WARPS} warps (experts.batch_invariant_tiles)")
    elif batch_invariant:
        src1 = src2 = f"batch-invariant: the heuristic's for {BATCH_INVARIANT_TOKENS} tokens, at every M"
        why = "batch_invariant: one aligned plan at every token count (experts.batch_invariant_tiles)"
        if device.type != "cuda":  # explain without the GPU: what a Hopper GPU runs instead
            if _per_count_scheme(problem, scheme):
                why += "; on a Hopper GPU: the aligned plan of each token count, GEMM1 unsplit" + (
                    "" if scheme is None else f" (where both tiles run {NARROW_WARPS} warps; else its N tiles "
                    "narrowed at decode)")
            elif _narrow_scheme(problem, scheme):
                why += "; on a Hopper GPU: its N tiles narrowed at decode"
    elif why is None:
        plan = tuned_plan(problem, scheme, device)
        if plan is not None:
            why = f"{plan.source}: fusedmoe tune timed both paths at M={plan.tokens}, {plan.path} was faster"
        elif is_direct:
            why = ("FUSEDMOE_TRITON_DIRECT=force" if mode == "force"
                   else "one token: always direct, GEMM2's slot shares fill the SMs (experts.direct_auto)"
                   if problem.num_slots == problem.top_k
                   else "few slots, experts rarely repeated, enough GEMM2 programs (experts.direct_auto)")
        elif mode is False:
            why = "FUSEDMOE_TRITON_DIRECT=0"
        else:
            why = direct_reason(problem) or direct_auto_reason(problem, _num_sms(device))
        direct = entry(problem, device, scheme, "direct") if plan is None and is_direct else None
        if plan is not None or direct is not None and (direct.gemm1, direct.gemm2) == (t1, t2):
            src1 = src2 = (plan or direct).source
        elif is_direct:  # direct_tiles: a 16-row aligned entry's GEMM1, else the heuristic's
            src1 = aligned.source if aligned is not None and aligned.gemm1 == t1 else "heuristic"
            src2 = "direct heuristic"
    split = " + act" if t1.split_k > 1 else ""
    qx = qa = ""
    swap1 = swap2 = False
    extra = {}
    if scheme is not None and scheme.weight.dtype in W4_FRAG_FORMATS:  # process_weights' fragment layout
        f1, f2 = fragment_tile(t1), fragment_tile(t2)
        widened = "" if (f1, f2) == (t1, t2) else f", these tiles run as gemm1 {f1.as_list()}, gemm2 {f2.as_list()}"
        from fusedmoe.backends.triton.weight_only import INT4_FRAGMENTS_MIN_INTER, lays_fragments

        fmt, group = scheme.weight.dtype, scheme.weight.group
        bound = ", e8m0 scales <= 2" if fmt == "mxfp4" else ""
        least = INT4_FRAGMENTS_MIN_INTER.get(group)
        measured = {32: "1.03-1.27x the checkpoint layout's speed at Qwen3-30B, 1.07-1.20x at DeepSeek-V3 TP8 "
                        "(M=1-4096) since its scales are loaded once a row group as 32-bit words "
                        "(kernels._w4_group_values); Mixtral M=1 / 16 / 256 86 / 236 / 661 us against the "
                        "checkpoint layout's 105 / 318 / 830",
                    64: "0.97-2.3x the checkpoint layout's speed over five presets at M=1-4096 (slower only at "
                        "M <= 16, by <= 3%); since its scales are loaded as words Mixtral M=1 / 16 / 256 84 / "
                        "232 / 598 us",
                    128: "1.1-2.1x the checkpoint layout's speed at Mixtral, Qwen3-30B and DeepSeek-V3 TP8 "
                         "(M=1-4096) since its scales are loaded once a row group as 32-bit words "
                         "(kernels._w4_group_values); Mixtral M=1 / 16 / 256 83 / 233 / 601 us against "
                         "142 / 393 / 1070"}
        where = f"where I >= {least}" if least else "at every I"
        int4 = (f"; int4 g{group} by default {where}, on an H200 {measured[group]}"
                if fmt == "int4" and knobs.get("TRITON_W4_FRAGMENTS") in (None, True) else "")
        if lays_fragments(fmt, group, problem.inter):
            waits = ("; each dot waits for its wgmma (kernels._rs_sync)" if knobs.get("TRITON_RS_SYNC") is not False
                     else "; FUSEDMOE_TRITON_RS_SYNC=0: the dots' wgmmas in flight, a race that computed wrong rows "
                          "on an H200 under Triton 3.6")
            extra["w4_layout"] = ("fragments where the backend's process_weights re-laid the weights (H and I "
                                  f"multiples of 64{bound}{int4}; FUSEDMOE_TRITON_W4_FRAGMENTS=0 keeps the checkpoint "
                                  f"layout){widened}{_scale_runs(problem, scheme)}{waits}")
        elif knobs.get("TRITON_W4_FRAGMENTS") is False:
            extra["w4_layout"] = "checkpoint layout (FUSEDMOE_TRITON_W4_FRAGMENTS=0)"
        else:  # int4 below its group's INT4_FRAGMENTS_MIN_INTER, or a group without one
            at = f"where I >= {least}" if least is not None else "for this group nowhere"
            extra["w4_layout"] = (f"checkpoint layout (int4 g{group} is laid as fragments by default {at}; "
                                  "FUSEDMOE_TRITON_W4_FRAGMENTS=all lays it so)")
        if aligned is None:  # an entry on the other layout would not serve: say so
            frag = _w4_fragments_of(problem, scheme)
            other = entry(dataclasses.replace(problem, fragments=not frag), device, scheme)
            if other is not None:
                extra["w4_layout"] += (f"; the {other.source} has an entry for this shape timed on the "
                                       f"{'checkpoint' if frag else 'fragment'} layout, which serves that layout only")
    if scheme is not None and not scheme.weight_only:  # W8A8: the activations' quantizers, SWAP_AB
        from fusedmoe.backends.triton.quant import fp8_accumulation, swap_ab

        swap1, swap2 = (swap_ab(t, scheme.activation, device, direct=is_direct) for t in (t1, t2))
        accumulate = fp8_accumulation(scheme)
        if accumulate is not None:
            extra["fp8_accumulate"] = {
                "promoted": "promoted: each K step's product added in fp32 (FUSEDMOE_FP8_ACCUMULATE=promoted)",
                "chained": "chained: one accumulator across K (FUSEDMOE_FP8_ACCUMULATE=promoted adds each K step "
                           "in fp32)"}[accumulate]
        tensor = scheme.weight.granularity == "tensor"
        qx = "amax x + quantize x + " if tensor and scheme.activation.dynamic else "quantize x + "
        fused = scheme.weight.granularity == "block" and t1.block_n == 128 and t1.split_k == 1
        qa = "" if fused else " + quantize a"
    if is_direct:
        shares = " + combine" if t2.split_k > 1 else ""
        gemm2 = "gemm2"
        if qx:  # per-token codes: GEMM1 may quantize x itself, GEMM2 a (kernels.py FUSE_XQ, FUSE_AQ)
            from fusedmoe.backends.triton.quant import fuse_a_quantization, fuse_x_quantization

            p = problem
            if fuse_x_quantization(scheme.activation, p.hidden, p.inter, p.gated, p.num_slots, p.num_local_experts):
                qx, split = "", f" (quantizes x){split}"
            if fuse_a_quantization(scheme.activation, p.inter):
                qa, gemm2 = "", "gemm2 (quantizes a)"
        return dict(path="direct", why=why, launches=f"{qx}gemm1{split}{qa} + {gemm2}{shares}",
                    gemm1=dict(tile=t1, source=src1, tma=None, swap_ab=swap1),
                    gemm2=dict(tile=t2, source=src2, tma=None, swap_ab=swap2), **extra)
    tma1, tma2 = tma_planned(problem, device, scheme)
    tma1 = tma1 if _tma_tile_reason(t1, None) is None else None
    tma2 = tma2 if _tma_tile_reason(t2, None) is None else None
    rows = None
    if scheme is not None and not scheme.weight_only:
        from fusedmoe.backends.triton.quant import gemm2_rows

        if gemm2_rows(scheme.activation, problem.inter, t2.block_m, problem.num_slots, device, swapped=swap2,
                      promoted=extra.get("fp8_accumulate", "").startswith("promoted")):
            cfg = gemm2_rows_config(W8A8_QUANT_CODES[scheme.weight.granularity], problem.inter, t2.block_m)
            head, tail = gemm2_rows_split(problem.inter)
            rows = (f"row-stationary (FUSEDMOE_TRITON_GEMM2_ROWS): each row block's codes loaded once "
                    f"(I as {head}{f' + {tail}' if tail else ''}), {cfg['BLOCK_N']}-wide N tiles over "
                    f"{cfg['SPLIT_N']} shares; the tile's block_m only")
            tma2 = None  # its own pointer loads
    return dict(path="aligned", why=why, launches=f"align + {qx}gemm1{split}{qa} + gemm2 + reduce",
                gemm1=dict(tile=t1, source=src1, tma=tma1, swap_ab=swap1),
                gemm2=dict(tile=t2, source=src2, tma=tma2, swap_ab=swap2, rows=rows), **extra)


# TMA descriptors ------------------------------------------------------------------------------
TMA_DTYPES = (torch.bfloat16, torch.float16)
# W8A8 codes (kernels.Q_CHANNEL / Q_BLOCK: int8 or e4m3 weights and activation codes) load through
# descriptors too (H200, the packaged tiles, pointers / descriptors alternating: M=1024-4096 0 to
# -11%, benchmarks/results/2026-11-24_h200_263251b_w8a8_tma_ab.txt); weight-only codes, decoded
# in registers from pointer loads, keep them.
TMA_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
TMA_OPERAND_DTYPES = TMA_DTYPES + TMA_CODE_DTYPES
TMA_W8A8 = frozenset(W8A8_QUANT_CODES.values())  # kernels.Q_CHANNEL, kernels.Q_BLOCK
# The descriptor loads were measured at M=4096 (benchmarks/bench_tma_gemm.py: tiles of 64 and 128
# rows); the decode tiles (16-32 rows: weight streams, split-K GEMM1) keep pointer loads.
TMA_MIN_BLOCK_M = 64
TMA_MAX_BOX = 256  # elements per box dimension (cuTensorMapEncodeTiled)
TMA_ALIGN = 16  # bytes: the base address and every stride but the last


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """torch.cuda.get_device_capability, read once per device (the launch rules ask per call)."""
    return torch.cuda.get_device_capability(device_index)


def _sm90(device_index: int) -> bool:
    return device_capability(device_index) >= (9, 0)


def _tma_device_reason(device: torch.device) -> str | None:
    """Why FUSEDMOE_TRITON_TMA or the device rules descriptors out, or None."""
    from fusedmoe import knobs

    mode = knobs.get("TRITON_TMA")
    if mode is False:
        return "FUSEDMOE_TRITON_TMA=0"
    if mode == "force":
        return None
    if device.type != "cuda":
        return f"{device.type} tensors: TMA is a CUDA sm90+ unit (FUSEDMOE_TRITON_TMA=force: descriptors anyway)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _sm90(index):
        return f"compute capability {device_capability(index)} < (9, 0)"
    return None


def _row_stride_reason(row_stride: int, dtype: torch.dtype) -> str | None:
    es = dtype.itemsize
    if row_stride * es % TMA_ALIGN:
        return f"row stride {row_stride} x {es} B = {row_stride * es} B is not a multiple of {TMA_ALIGN} B"
    return None


def _rows_view(t: torch.Tensor) -> torch.Tensor | str:
    """t [..., K] as one [rows, K] view (no copy), or why it is not one."""
    if t.numel() == 0:
        return f"empty {tuple(t.shape)}"
    if t.stride(-1) != 1:
        return f"last dim not contiguous (strides {t.stride()})"
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return f"shape {tuple(t.shape)} with strides {t.stride()} is not one evenly strided run of rows"


def _view_reason(v: torch.Tensor, block: tuple[int, int]) -> str | None:
    """Why TMA cannot load `block` boxes from the 2D tensor v, or None."""
    es = v.element_size()
    if v.dtype not in TMA_OPERAND_DTYPES:
        return f"dtype {v.dtype} (descriptors serve {', '.join(map(str, TMA_OPERAND_DTYPES))})"
    if v.stride(1) != 1:
        return f"last dim not contiguous (strides {v.stride()})"
    if v.data_ptr() % TMA_ALIGN:
        return f"base address {v.data_ptr():#x} not {TMA_ALIGN}-byte aligned"
    reason = _row_stride_reason(v.stride(0), v.dtype)
    if reason:
        return reason
    if v.shape[0] >= 2**31:
        return f"{v.shape[0]} rows: box coordinates are int32"
    if max(block) > TMA_MAX_BOX or block[1] * es < 16:
        return f"box {list(block)} outside TMA's limits (each dim <= {TMA_MAX_BOX}, inner >= 16 B)"
    return None


def _tma_tile_reason(tile: TileConfig, quant_args: dict | None) -> str | None:
    """Why the kernel or the tile keeps pointer loads, or None (the device and tensors decide)."""
    quant = (quant_args or {}).get("QUANT", 0)
    if quant and quant not in TMA_W8A8:
        return f"weight-only kernels (QUANT={quant}) decode their codes from pointer loads"
    if tile.split_k > 1:
        return f"split_k={tile.split_k}"
    if tile.block_m < TMA_MIN_BLOCK_M:
        return f"block_m={tile.block_m} < {TMA_MIN_BLOCK_M} (decode tiles keep pointer loads)"
    return None


def tma_reasons(tile: TileConfig, w: torch.Tensor, w_rows: int, a: torch.Tensor | None,
                quant_args: dict | None) -> tuple[str | None, str | None]:
    """Why a GEMM's A rows and its weights stay on pointer loads: (A, W), None = through a TMA
    descriptor. The one eligibility predicate of the descriptor loads.

    w [L, w_rows, K]: the weights, their rows per expert as the kernel indexes them; a [R, K]:
    gemm2's sorted rows (None for gemm1, whose x rows are gathered by token). Descriptors need:
    FUSEDMOE_TRITON_TMA not 0 and a CUDA sm90+ device (or =force), the unquantized (bf16 / fp16)
    or W8A8 (int8 / e4m3 codes) kernels, no split-K, BLOCK_M >= 64, and TMA's rules: last dim
    contiguous, base and row stride 16-byte aligned, box dims <= 256 and >= 16 B inner.
    """
    # The kernel and tile rules first: a decode launch (every eager decode step) then reads no knob.
    reason = _tma_tile_reason(tile, quant_args) or _tma_device_reason(w.device)
    if reason is not None:
        return reason, reason
    w_reason = None
    if w.dim() != 3 or w.shape[1] != w_rows:
        w_reason = f"weights {tuple(w.shape)} are not [L, {w_rows}, K]"
    else:
        view = _rows_view(w)
        w_reason = view if isinstance(view, str) else _view_reason(view, (tile.block_n, tile.block_k))
    if a is None:
        return "rows gathered by token", w_reason
    return _view_reason(a, (tile.block_m, tile.block_k)), w_reason


def tma_planned(problem: GemmProblem, device: torch.device, scheme=None) -> tuple[str | None, str | None]:
    """The heuristic's `tma` for (gemm1, gemm2): what `tma_reasons` will say for this problem's
    operands when they are contiguous (x / w13 rows of H elements, a / w2 rows of I). scheme (a
    `QuantScheme`, None = unquantized): W8A8 GEMMs read one-byte codes; weight-only ones keep
    pointer loads (as `_tma_tile_reason` says of their QUANT codes)."""
    weight_only = scheme is not None and scheme.weight_only
    if weight_only or _tma_device_reason(device) is not None or problem.dtype not in TMA_DTYPES:
        return None, None
    dtype = problem.dtype if scheme is None else torch.int8  # int8 and e4m3 codes: one byte each
    return (None if _row_stride_reason(problem.hidden, dtype) else "w",
            None if _row_stride_reason(problem.inter, dtype) else "a+w")


def _descriptor(t: torch.Tensor, block: tuple[int, ...], rows: int | None = None):
    """A host TMA descriptor over the 2D view of t (validated by `tma_reasons`), or with rows,
    over its 3D view [-1, rows, K] (the 2D view's rows in runs of `rows`; a 3D block)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    view = t.view(-1, t.shape[-1]) if rows is None else t.view(-1, rows, t.shape[-1])
    return TensorDescriptor(view, list(view.shape), list(view.stride()), list(block))


@dataclass
class Launch:
    """Everything the kernels share for one call (buffers, aligned slots, flags).

    Direct (decode, `prepare_direct_launch`): no alignment; sorted_slot / block_expert / num_rows
    / slot_ok / y are None, `ids` holds the flat top-k ids, a's rows are slots, and GEMM2 writes
    the output itself (`launch_gemm2_direct`). Batched (`prepare_batched_launch`): y is the
    output and slot_ok None (no top-k reduce reads it).
    """

    x: torch.Tensor
    weights_N: torch.Tensor
    sorted_slot: torch.Tensor | None
    block_expert: torch.Tensor | None
    num_rows: torch.Tensor | None
    slot_ok: torch.Tensor | None
    a: torch.Tensor
    y: torch.Tensor | None
    top_k: int
    activation: str
    scale_input: bool  # gemm1 multiplies rows by the routed weight (router weight on input)
    scale_output: bool  # gemm2 multiplies rows by the routed weight (the usual case)
    swiglu_alpha: float
    swiglu_limit: float | None
    block_m: int
    ids: torch.Tensor | None = None  # direct: topk_ids [T*K]
    expert_map: torch.Tensor | None = None  # direct: global -> local expert (-1: not here)
    num_global: int = 0
    num_local: int = 0
    launch_kw: dict | None = None  # pdl(device): the kernels' launch keywords, read once per call

    def __post_init__(self) -> None:
        if self.launch_kw is None:
            self.launch_kw = pdl(self.x.device)

    @property
    def direct(self) -> bool:
        return self.ids is not None

    @property
    def num_slots(self) -> int:
        return self.ids.numel() if self.direct else self.y.shape[0]

    @property
    def blocks(self) -> int:
        """Row blocks of the GEMM grids: one per slot (direct) or per BLOCK_M aligned rows."""
        return self.ids.numel() if self.direct else self.sorted_slot.numel() // self.block_m

    def row_args(self) -> tuple:
        """The kernels' (sorted_slot, block_expert, num_rows) arguments; direct: placeholders
        never read (DIRECT reads `direct_kwargs`)."""
        if self.direct:
            return self.ids, self.ids, self.ids
        return self.sorted_slot, self.block_expert, self.num_rows

    def direct_kwargs(self) -> dict:
        if not self.direct:
            return {}
        emap = self.expert_map
        return dict(ids_ptr=self.ids, emap_ptr=emap if emap is not None else self.ids,
                    num_global=self.num_global, num_local=self.num_local, DIRECT=True,
                    HAS_MAP=emap is not None)


def prepare_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts, num_local,
                   inter, activation, apply_router_weight_on_input, swiglu_alpha, swiglu_limit,
                   block_m) -> Launch:
    launch_kw = pdl(x_TH.device)
    sorted_slot, block_expert, num_rows, slot_ok = align(
        topk_ids_TK, expert_map, num_global_experts, num_local, block_m, launch_kw
    )
    weights_N = topk_weights_TK.reshape(-1).contiguous()  # contiguous(): no copy when it already is
    n_slots = topk_ids_TK.numel()
    a = torch.empty(sorted_slot.numel(), inter, dtype=x_TH.dtype, device=x_TH.device)
    y = torch.empty(n_slots, x_TH.shape[1], dtype=x_TH.dtype, device=x_TH.device)
    return Launch(x_TH, weights_N, sorted_slot, block_expert, num_rows, slot_ok, a, y,
                  topk_ids_TK.shape[1], activation, apply_router_weight_on_input,
                  not apply_router_weight_on_input, swiglu_alpha, swiglu_limit, block_m, launch_kw=launch_kw)


def prepare_direct_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts, num_local,
                          inter, activation, apply_router_weight_on_input, swiglu_alpha,
                          swiglu_limit, *, a_dtype: torch.dtype | None = None, prescaled: bool = False) -> Launch:
    """The direct decode path's launch: no alignment, a [T*K, I] indexed by slot (a_dtype: its
    dtype, x's by default; W8A8 keeps it in fp32). prescaled: x already carries the router
    weight on input (W8A8 quantizes w * x), so GEMM1 does not apply it."""
    weights_N = topk_weights_TK.reshape(-1).contiguous()  # contiguous(): no copy when it already is
    ids = topk_ids_TK.reshape(-1).contiguous()
    expert_map = expert_map.contiguous() if expert_map is not None else None
    a = torch.empty(ids.numel(), inter, dtype=a_dtype or x_TH.dtype, device=x_TH.device)
    return Launch(x_TH, weights_N, None, None, None, None, a, None, topk_ids_TK.shape[1], activation,
                  apply_router_weight_on_input and not prescaled, not apply_router_weight_on_input, swiglu_alpha,
                  swiglu_limit, DIRECT_BLOCK_M, ids, expert_map, num_global_experts, num_local)


def _fitted(tile: TileConfig, quant_args: dict | None) -> TileConfig:
    """The tile a launch runs: `tiles.fragment_tile` of it over fragment-layout 4-bit weights
    (weight_only._kernel_args sets W4_FMT to a fragment format); over 4-bit weights in the
    checkpoint layout one_dot off (its GEMM1 has no one-dot form; a table entry is keyed by
    scheme, not layout); else the tile as chosen."""
    if quant_args and quant_args.get("W4_FMT", 0) >= W4_MXFP4_FRAG:
        return fragment_tile(tile)
    if quant_args and "W4_FMT" in quant_args and tile.one_dot:
        return dataclasses.replace(tile, one_dot=False)
    return tile


def launch_gemm1(L: Launch, w13: torch.Tensor, w13_bias: torch.Tensor | None, tile: TileConfig,
                 quant_args: dict | None = None, *, x: torch.Tensor | None = None) -> None:
    """GEMM1 (+ the split-K finish). quant_args: the kernel's quantization arguments (W8A8 in
    quant.py, weight-only in weight_only.py; the intermediate's amax, A_AMAX, goes to whichever
    kernel finishes a); x: GEMM1's input when it is not L.x (W8A8 codes)."""
    from fusedmoe.backends.triton import kernels

    tile = _fitted(tile, quant_args)
    x, a = (L.x if x is None else x), L.a
    inter, hidden = a.shape[1], x.shape[1]
    gated = is_gated(L.activation)
    bias = w13_bias if w13_bias is not None else x  # never read without HAS_BIAS
    limit = L.swiglu_limit if L.swiglu_limit is not None else (7.0 if L.activation == "swigluoai" else 0.0)
    blocks = L.blocks
    k_per_split = triton_cdiv(triton_cdiv(hidden, tile.split_k), tile.block_k) * tile.block_k
    splits = triton_cdiv(hidden, k_per_split)
    hpart = x  # never written unless SPLIT_K > 1
    if splits > 1:
        hpart = torch.empty(splits, a.shape[0], w13.shape[1], dtype=torch.float32, device=x.device)
    flags = dict(GATED=gated, ACT=ACT_CODES[L.activation],
                 HAS_LIMIT=L.swiglu_limit is not None and L.activation != "swigluoai",
                 HAS_BIAS=w13_bias is not None, SCALE_ROWS=L.scale_input)
    b_strides = (bias.stride(0), bias.stride(1)) if w13_bias is not None else (0, 0)
    h_strides = (hpart.stride(0), hpart.stride(1)) if splits > 1 else (0, 0)
    w_desc = tma_reasons(tile, w13, (2 if gated else 1) * inter, None, quant_args)[1] is None
    if w_desc and tile.one_dot:  # [2L, I, H]: a gate box over an up box (kernels ONE_DOT)
        w_arg = _descriptor(w13, (2, tile.block_n, tile.block_k), rows=inter)
    else:
        w_arg = _descriptor(w13, (tile.block_n, tile.block_k)) if w_desc else w13
    direct = L.direct_kwargs()
    amax_args = {}
    if quant_args and "A_AMAX" in quant_args:  # for the kernel that finishes a (split-K: the act kernel)
        quant_args = dict(quant_args)
        amax_args = {k: quant_args.pop(k) for k in ("amax_ptr", "A_AMAX")}
    programs = blocks * triton_cdiv(inter, tile.block_n)  # at most: the programs past the real rows exit
    if tile.persistent:  # the programs stride over the real tiles (read on the device)
        programs = min(programs, PERSISTENT_PROGRAMS * _num_sms(x.device))
    launch(kernels.moe_gemm1_kernel, (programs, splits),
        x, w_arg, bias, a, L.weights_N, hpart, *L.row_args(),
        L.num_slots, L.top_k, hidden, inter, k_per_split,
        x.stride(0), x.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2),
        *b_strides, a.stride(0), a.stride(1), *h_strides,
        float(L.swiglu_alpha), float(limit),
        IEEE=_ieee(x, quant_args), SPLIT_K=splits, GROUP_M=tile.group_m, EVEN_K=hidden % tile.block_k == 0,
        W_DESC=w_desc, ONE_DOT=tile.one_dot, PERSISTENT=tile.persistent, **flags, **tile.as_kwargs(),
        **(quant_args or {}), **(amax_args if splits == 1 else {}), **direct, **L.launch_kw,
    )
    if splits > 1:
        block_n = min(128, triton_next_pow2(inter))
        launch(kernels.moe_act_kernel, (blocks, triton_cdiv(inter, block_n)),
            hpart, bias, a, L.weights_N, *L.row_args(),
            L.num_slots, inter, *b_strides, a.stride(0), a.stride(1), *h_strides,
            float(L.swiglu_alpha), float(limit),
            SPLIT_K=splits, BLOCK_M=L.block_m, BLOCK_N=block_n, num_warps=4, **flags, **direct,
            **amax_args, **L.launch_kw,
        )


def launch_gemm2(L: Launch, w2: torch.Tensor, w2_bias: torch.Tensor | None, tile: TileConfig,
                 quant_args: dict | None = None, *, a: torch.Tensor | None = None) -> None:
    """GEMM2; a: its input when it is not L.a (the W8A8 intermediate's codes)."""
    from fusedmoe.backends.triton import kernels

    tile = _fitted(tile, quant_args)
    a, y = (L.a if a is None else a), L.y
    hidden, inter = y.shape[1], a.shape[1]
    bias = w2_bias if w2_bias is not None else y
    blocks = L.sorted_slot.numel() // L.block_m
    a_reason, w_reason = tma_reasons(tile, w2, hidden, a, quant_args)
    a_arg = _descriptor(a, (tile.block_m, tile.block_k)) if a_reason is None else a
    w_arg = _descriptor(w2, (tile.block_n, tile.block_k)) if w_reason is None else w2
    tiles = blocks * triton_cdiv(hidden, tile.block_n)  # at most: the programs past the real rows exit
    if tile.persistent:  # the programs stride over the real tiles (read on the device)
        per_sm = W4_PERSISTENT_PROGRAMS if quant_args and "W4_FMT" in quant_args else PERSISTENT_PROGRAMS
        tiles = min(tiles, per_sm * _num_sms(y.device))
    launch(kernels.moe_gemm2_kernel, (tiles,),
        a_arg, w_arg, bias, y, L.weights_N, L.sorted_slot, L.block_expert, L.num_rows,
        y.shape[0], hidden, inter,
        a.stride(0), a.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        bias.stride(0) if w2_bias is not None else 0, bias.stride(1) if w2_bias is not None else 0,
        y.stride(0), y.stride(1),
        HAS_BIAS=w2_bias is not None, SCALE_ROWS=L.scale_output,
        IEEE=_ieee(a, quant_args), GROUP_M=tile.group_m, EVEN_K=inter % tile.block_k == 0,
        A_DESC=a_reason is None, W_DESC=w_reason is None, PERSISTENT=tile.persistent, **tile.as_kwargs(),
        **(quant_args or {}), **L.launch_kw,
    )


# The row-stationary W8A8 GEMM2 (kernels.moe_gemm2_rows_kernel): one launch config per code
# type, measured on the H200 at DeepSeek-V3 TP8 (I = 256, 64-row blocks;
# benchmarks/bench_row_stationary.py --quant, results/2026-11-24_h200_4f412f2_row_stationary_w8a8.txt;
# the library's GEMM2 alone): int8 64-wide N tiles over two shares of a row block's N tiles, 4 warps,
# 4 stages: M=1024 197.0 -> 154.1 us, M=4096 457.0 -> 315.7 (the best variants 152.6 and 311.8);
# fp8 block 128-wide N tiles over two shares, 4 warps, 3 stages: M=1024 219.9 -> 151.0, M=4096
# 524.6 -> 281.0. Qwen3-235B TP4 (I = 384) gained 0-7% as one 512-wide tile, and 8-35% as a 256-wide
# head and a 128-wide tail (gemm2_rows_split; results/2026-11-24_h200_eafeb8b_rows_tail.txt, the
# best configs below): 64-row blocks (M=1024) int8 103.1 -> 84.8 us, fp8 per channel 103.2 -> 87.9
# (64-wide N tiles over four shares), fp8 block 114.6 -> 82.6 (32-wide over four, 4 stages);
# 128-row blocks (M=4096) int8 276.7 -> 221.1 (128-wide over two), fp8 block 305.2 -> 199.8 (64-row).
# I = 768 (Qwen3-30B) does not fit shared memory in these tiles: GEMM2_ROWS_MAX_I.
GEMM2_ROWS_MAX_I = 384
GEMM2_ROWS_CONFIG = {  # by (the kernels' QUANT code, a tail tile[, the row block]); per row: int8's
    # measurement, fp8 per token / tensor take it too
    (W8A8_QUANT_CODES["channel"], False): dict(BLOCK_N=64, SPLIT_N=2, num_warps=4, NUM_STAGES=4),
    (W8A8_QUANT_CODES["block"], False): dict(BLOCK_N=128, SPLIT_N=2, num_warps=4, NUM_STAGES=3),
    (W8A8_QUANT_CODES["channel"], True): dict(BLOCK_N=64, SPLIT_N=4, num_warps=4, NUM_STAGES=3),
    (W8A8_QUANT_CODES["channel"], True, 128): dict(BLOCK_N=128, SPLIT_N=2, num_warps=4, NUM_STAGES=3),
    (W8A8_QUANT_CODES["block"], True): dict(BLOCK_N=32, SPLIT_N=4, num_warps=4, NUM_STAGES=4),
}


def gemm2_rows_config(quant: int, inter: int, block_m: int) -> dict:
    """moe_gemm2_rows_kernel's launch config (GEMM2_ROWS_CONFIG) for codes of this QUANT, I and
    row block: the entry for the block's rows where there is one, else the code's."""
    key = (quant, gemm2_rows_split(inter)[1] > 0)
    return GEMM2_ROWS_CONFIG.get((*key, block_m), GEMM2_ROWS_CONFIG[key])


def gemm2_rows_split(inter: int) -> tuple[int, int]:
    """(BLOCK_I, TAIL_I) of kernels.moe_gemm2_rows_kernel for I = inter: one power-of-two tile, or a
    head and a tail tile where those cover I with less of it masked (384 = 256 + 128, 768 = 512 + 256)."""
    size = max(32, triton_next_pow2(inter))  # 8-bit tl.dot needs K >= 32 (I = 4 did not compile)
    if size >= 512 and inter <= size // 2 + size // 4:
        return size // 2, size // 4
    return size, 0


def launch_gemm2_rows(L: Launch, w2: torch.Tensor, w2_bias: torch.Tensor | None, a: torch.Tensor,
                      a_scales: torch.Tensor, w2_scale: torch.Tensor, quant: int, ws_strides: dict) -> None:
    """GEMM2 of W8A8 codes a [R, I] (int8 or fp8 with a scale per aligned row, quant Q_CHANNEL, or
    fp8 with a scale per 128-wide group, Q_BLOCK) as row-stationary programs
    (kernels.moe_gemm2_rows_kernel): y as launch_gemm2's."""
    from fusedmoe.backends.triton import kernels

    y = L.y
    hidden, inter = y.shape[1], a.shape[1]
    bias = w2_bias if w2_bias is not None else y
    blocks = L.sorted_slot.numel() // L.block_m
    cfg = gemm2_rows_config(quant, inter, L.block_m)
    head, tail = gemm2_rows_split(inter)
    launch(kernels.moe_gemm2_rows_kernel, (blocks * cfg["SPLIT_N"],),
        a, w2, bias, y, L.weights_N, L.sorted_slot, L.block_expert, L.num_rows, a_scales, w2_scale,
        y.shape[0], hidden, inter,
        a.stride(0), a.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        bias.stride(0) if w2_bias is not None else 0, bias.stride(1) if w2_bias is not None else 0,
        y.stride(0), y.stride(1),
        a_scales.stride(0), a_scales.stride(1) if a_scales.dim() > 1 else 0, ws_strides["stride_ws0"],
        ws_strides["stride_ws1"], ws_strides["stride_ws2"],
        QUANT=quant, ACC_INT=a.dtype == torch.int8, HAS_BIAS=w2_bias is not None, SCALE_ROWS=L.scale_output,
        BLOCK_M=L.block_m, BLOCK_I=head, TAIL_I=tail, **cfg, **L.launch_kw,
    )


def launch_gemm2_direct(L: Launch, w2: torch.Tensor, w2_bias: torch.Tensor | None, tile: TileConfig,
                        out: torch.Tensor, quant_args: dict | None = None, *, a: torch.Tensor | None = None) -> None:
    """GEMM2 with the routed weight and the top-k sum (direct path): out [T, H] written once.
    a: its input when it is not L.a (the W8A8 intermediate's codes)."""
    from fusedmoe.backends.triton import kernels

    tile = _fitted(tile, quant_args)
    a = L.a if a is None else a
    hidden, inter = out.shape[1], a.shape[1]
    bias = w2_bias if w2_bias is not None else out
    emap = L.expert_map if L.expert_map is not None else L.ids
    per = triton_cdiv(L.top_k, tile.split_k)  # slots per share
    split = triton_cdiv(L.top_k, per)
    part = out  # never written unless split > 1
    if split > 1:
        part = torch.empty(out.shape[0] * split, hidden, dtype=torch.float32, device=out.device)
    launch(kernels.moe_gemm2_direct_kernel, (out.shape[0], triton_cdiv(hidden, tile.block_n), split),
        a, w2, bias, out, L.weights_N, L.ids, emap,
        L.num_global, L.num_local, hidden, inter,
        a.stride(0), a.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        bias.stride(0) if w2_bias is not None else 0, bias.stride(1) if w2_bias is not None else 0,
        out.stride(0), out.stride(1),
        TOP_K=L.top_k, TOP_K_P=triton_next_pow2(L.top_k),
        HAS_MAP=L.expert_map is not None, HAS_BIAS=w2_bias is not None, SCALE_ROWS=L.scale_output,
        IEEE=_ieee(a, quant_args), EVEN_K=inter % tile.block_k == 0, part_ptr=part, SPLIT=split, PER=per,
        **tile.as_kwargs(), **(quant_args or {}), **L.launch_kw,
    )
    if split > 1:  # a token's shares, summed in order (every row valid)
        _reduce(part, out, None, split, L.launch_kw)


def _ieee(operand: torch.Tensor, quant_args: dict | None) -> bool:
    """fp32 operands take exact fp32 products (not TF32), unless a W8A8 mode feeds 8-bit codes to
    tl.dot."""
    return operand.dtype == torch.float32 and (quant_args or {}).get("QUANT", 0) not in W8A8_QUANT_CODES.values()


def launch_reduce(L: Launch, out: torch.Tensor) -> None:
    _reduce(L.y, out, L.slot_ok, L.top_k, L.launch_kw)


def _reduce(y: torch.Tensor, out: torch.Tensor, slot_ok: torch.Tensor | None, rows_per_token: int,
            launch_kw: dict, rows: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
    """out[t] = the fp32 sum of y's rows t*rows_per_token .. in order, skipping rows whose
    slot_ok flag is 0 (None: every row counts). rows: slot n's row of y is rows[n] (int64, -1:
    skipped); weights: each row times weights[n] (both flat and contiguous)."""
    from fusedmoe.backends.triton import kernels

    hidden = y.shape[1]
    block_h = min(1024, triton_next_pow2(hidden))
    launch(kernels.moe_reduce_kernel, (out.shape[0], triton_cdiv(hidden, block_h)),
        y, out, y if slot_ok is None else slot_ok, y if rows is None else rows, y if weights is None else weights,
        hidden, y.stride(0), y.stride(1), out.stride(0), out.stride(1),
        TOP_K=rows_per_token, BLOCK_H=block_h, FLAGS=slot_ok is not None, GATHER=rows is not None,
        SCALE=weights is not None, num_warps=4, **launch_kw,
    )


@replay.replayable
def triton_experts(
    x_TH: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    num_global_experts: int,
    activation: str,
    apply_router_weight_on_input: bool,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    tiles: tuple[TileConfig, TileConfig] | None = None,
    out: torch.Tensor | None = None,
    direct: bool | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """out [T, H] = sum_k w * (w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]) with Triton kernels.

    `out` may be x itself: x is read only by gemm1, out written only by the last kernel.
    direct: the decode path without alignment (None: FUSEDMOE_TRITON_DIRECT and the auto rule
    when no tiles are given; True: with `tiles` as (gemm1, direct gemm2) tiles when given).
    batch_invariant: each token's output bitwise independent of the other tokens in the call
    (`batch_invariant_tiles`: the aligned path, GEMM1 unsplit, with tiles that keep a row's bits).
    Eager calls of a signature seen twice replay the recorded launches (`replay.replayable`).
    """
    num_tokens, hidden = x_TH.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    out = torch.empty_like(x_TH) if out is None else out
    if num_tokens == 0:
        return out
    problem = GemmProblem(topk_ids_TK.numel(), num_local, hidden, inter, topk_ids_TK.shape[1],
                          is_gated(activation), x_TH.dtype)
    is_direct, t1, t2 = plan_tiles(problem, None, x_TH.device, tiles, direct, batch_invariant)
    if is_direct:
        launch = prepare_direct_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                                       num_local, inter, activation, apply_router_weight_on_input,
                                       swiglu_alpha, swiglu_limit)
        launch_gemm1(launch, w13, w13_bias, t1)
        launch_gemm2_direct(launch, w2, w2_bias, t2, out)
        return out
    if t1.block_m != t2.block_m:
        raise ValueError(f"both GEMMs need the same block_m, got {t1.block_m} and {t2.block_m}")
    launch = prepare_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                            num_local, inter, activation, apply_router_weight_on_input, swiglu_alpha,
                            swiglu_limit, t1.block_m)
    launch_gemm1(launch, w13, w13_bias, t1)
    launch_gemm2(launch, w2, w2_bias, t2)
    launch_reduce(launch, out)
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _triton_experts_op_impl(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    num_global_experts: int,
    activation: str,
    apply_router_weight_on_input: bool,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    return triton_experts(
        x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, num_global_experts,
        activation, apply_router_weight_on_input, swiglu_alpha, swiglu_limit, out=out,
        batch_invariant=batch_invariant,
    )


# Custom ops (torch.compile(fullgraph=True), CUDA graphs): fusedmoe::triton_experts(_out)
triton_experts_op, triton_experts_out_op = experts_ops("triton_experts", _triton_experts_op_impl)


def wants_batch_invariance(config) -> bool:
    """Whether the experts run batch-invariant plans (`batch_invariant_tiles`): as the oracle chose
    them, for the config's request or FUSEDMOE_BATCH_INVARIANT=1."""
    from fusedmoe import knobs

    return config.batch_invariant or knobs.get("BATCH_INVARIANT") is True


class TritonExperts(Experts):
    """Experts on fusedmoe's Triton kernels (contiguous layout): unquantized, and the W8A8 and
    weight-only schemes through quant.py. Payloads are read as stored (the 4-bit kernels take the
    checkpoints' packing, even k in the low nibble); process_weights re-lays the 4-bit formats'
    codes and scales into wgmma fragment order where the shapes allow (`fusedmoe.quant.fragments`),
    else int4's and nvfp4's group scales group-major (`weight_only.kernel_scale_layout`)."""

    def __init__(self, config):
        super().__init__(config)
        self.batch_invariant = wants_batch_invariance(config)

    def process_weights(self, weights: ExpertWeights) -> ExpertWeights:
        from fusedmoe.backends.triton.weight_only import prepare_weights

        return prepare_weights(weights)

    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None) -> torch.Tensor:
        c = self.config
        if weights.quant is not None:
            from fusedmoe.backends.triton.quant import apply_quant

            return apply_quant(c, x_TH, weights, topk_weights_TK, topk_ids_TK, expert_map_E, out_TH,
                               batch_invariant=self.batch_invariant)
        args = (x_TH, weights.w13, weights.w2, topk_weights_TK, topk_ids_TK, weights.w13_bias,
                weights.w2_bias, expert_map_E, c.num_experts, c.activation,
                c.apply_router_weight_on_input, c.swiglu_alpha, c.swiglu_limit)
        if out_TH is not None:
            call_op(triton_experts_out_op, _triton_experts_op_impl, *args, out=out_TH,
                    batch_invariant=self.batch_invariant)
            return out_TH
        return call_op(triton_experts_op, _triton_experts_op_impl, *args, batch_invariant=self.batch_invariant)


# Batched layout ---------------------------------------------------------------------------------
@replay.replayable
def triton_batched_experts(
    x_LMH: torch.Tensor,
    num_tokens_L: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    num_slots: int = 0,
    top_k: int = 1,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """y[e, j] = w2[e] @ act(w13[e] @ x[e, j] + b13[e]) + b2[e] for j < num_tokens[e]; rows past
    the count are not computed (zero). No routed weight: the combine applies it.

    The same kernels as the contiguous layout: buffer rows are the "slots" (top_k = 1), each
    expert's max_tokens rows are padded to whole BLOCK_M blocks, rows past the count masked.
    num_slots / top_k: the dispatch's slot count and top-k, for the tiles (`batched_problem`).
    batch_invariant: one plan whatever the counts (`batched_invariant_tiles`).
    Eager calls of a signature seen twice replay the recorded launches (`replay.replayable`).
    """
    def gemms(launch: Launch, t1: TileConfig, t2: TileConfig) -> None:
        launch_gemm1(launch, w13, w13_bias, t1)
        launch_gemm2(launch, w2, w2_bias, t2)

    if batch_invariant:
        tiles = functools.partial(batched_invariant_tiles, scheme=None, device=x_LMH.device, top_k=top_k)
    else:
        tiles = lambda problem: choose_tiles(problem, x_LMH.device)  # noqa: E731
    return run_batched(x_LMH, num_tokens_L, w2.shape[2], activation, swiglu_alpha, swiglu_limit, tiles, gemms,
                       num_slots=num_slots, top_k=top_k)


def batched_invariant_tiles(problem: GemmProblem, *, scheme, device: torch.device,
                            top_k: int) -> tuple[TileConfig, TileConfig]:
    """`batch_invariant_tiles`' fixed plan for the batched layout's problem, at the routing's
    top_k (`batched_problem` counts buffer rows as slots of top_k 1 when the dispatch's count is
    unknown or covers every row, which depends on the batch; per-count plans are not measured in
    this layout)."""
    return batch_invariant_tiles(dataclasses.replace(problem, top_k=max(1, top_k)), scheme, device, False)


def batched_problem(x_LMH: torch.Tensor, inter: int, gated: bool, num_slots: int = 0, top_k: int = 1,
                    fragments: bool | None = None) -> GemmProblem:
    """What the batched layout's tiles are chosen for: the live rows, not the buffer.

    A buffer sized for the worst case (the local dispatch's max_tokens = T, an expert-parallel
    capacity) holds L * max_tokens rows of which the dispatch filled at most `num_slots` (its
    (token, k) slots, or the rows an all-to-all received). Tiles picked for every buffer row are
    prefill tiles at decode (Qwen3-30B T=1024: 131072 rows for 8192 slots). With the count, the
    problem is the standard layout's for the same slots and `top_k`, so its tuned entries and
    heuristic serve; num_slots = 0 (unknown) keeps every buffer row. `fragments`: as
    `GemmProblem.fragments` (the 4-bit weights' layout).
    """
    num_local, max_tokens, hidden = x_LMH.shape
    rows = num_local * max_tokens
    if num_slots <= 0 or num_slots >= rows:
        num_slots, top_k = rows, 1
    elif top_k < 1 or num_slots % top_k:
        top_k = 1
    return GemmProblem(max(1, num_slots), num_local, hidden, inter, top_k, gated, x_LMH.dtype, fragments)


def run_batched(x_LMH, num_tokens_L, inter, activation, swiglu_alpha, swiglu_limit,
                tiles: Callable[[GemmProblem], tuple[TileConfig, TileConfig]],
                gemms: Callable[[Launch, TileConfig, TileConfig], None],
                a_dtype: torch.dtype | None = None, num_slots: int = 0, top_k: int = 1,
                fragments: bool | None = None) -> torch.Tensor:
    """The batched layout on the contiguous path's kernels, for every scheme: the buffers as
    aligned rows (`prepare_batched_launch`), `gemms(launch, t1, t2)` with the tiles that
    `tiles(problem)` picks for the live rows (`batched_problem`), then y [L, max_tokens, H] (zero
    past each count). `a_dtype`: the intermediate's dtype (default x's); `fragments`: the 4-bit
    weights' layout (`GemmProblem.fragments`)."""
    num_local, max_tokens, hidden = x_LMH.shape
    if tuple(num_tokens_L.shape) != (num_local,) or num_tokens_L.dtype.is_floating_point \
            or num_tokens_L.dtype == torch.bool or num_tokens_L.device != x_LMH.device:
        # checked before any launch: the row packing indexes the counts by expert on the device
        raise ValueError(
            f"num_tokens must be one integer count per local expert on {x_LMH.device}: shape ({num_local},), "
            f"got shape {tuple(num_tokens_L.shape)} {num_tokens_L.dtype} on {num_tokens_L.device}"
        )
    if num_slots > 0 and should_validate(None, x_LMH, num_tokens_L):
        live = int(num_tokens_L.to(torch.int64).clamp(0, max_tokens).sum())
        if live > num_slots:  # the grid is sized by num_slots: rows past it would be dropped
            raise ValueError(f"num_slots={num_slots} must bound the live rows, but num_tokens counts {live}")
    if num_local == 0 or max_tokens == 0:
        return torch.zeros_like(x_LMH)
    problem = batched_problem(x_LMH, inter, is_gated(activation), num_slots, top_k, fragments)
    t1, t2 = fit_k(*tiles(problem), problem)
    launch = prepare_batched_launch(x_LMH, num_tokens_L, inter, a_dtype or x_LMH.dtype, activation,
                                    swiglu_alpha, swiglu_limit, t1.block_m, num_slots)
    gemms(launch, t1, t2)
    return batched_output(launch, num_local, max_tokens)


def prepare_batched_launch(x_LMH, num_tokens_L, inter, a_dtype, activation, swiglu_alpha, swiglu_limit,
                           block_m, num_slots: int = 0) -> Launch:
    """The batched buffers as aligned rows: a Launch with top_k = 1 and no routed weight.

    Buffer row (e, j) is slot e*M + j of x viewed [L*M, H] (no copy when x is contiguous) and of
    y [L*M, H]; it is live when j < num_tokens[e]. Expert e's live rows fill cdiv(count, BLOCK_M)
    row blocks of the aligned rows (a, the GEMMs' grid), packed first in expert order, so
    `num_rows` ends at the last of them and every program past it exits before loading a weight;
    within a block, rows past the count are padding (slot L*M), skipped. A dispatch buffer sized
    for the worst case (EP: max_tokens much larger than the typical count) streams each expert's
    weights once per live block, not once per buffer block. All on the device: no host sync,
    graph-capturable.

    `num_slots` = S > 0 bounds the live rows (the dispatch's slots): an expert with c > 0 rows
    fills (c - 1) // BLOCK_M + 1 blocks, so at most min(L, S) + S // BLOCK_M (and at most S)
    blocks are live. That sizes the grid and the intermediate instead of every buffer block
    (Qwen3-30B T=1024 at 16-row blocks: 640 blocks, not 8192; one token: top_k blocks).
    """
    num_local, max_tokens, hidden = x_LMH.shape
    device = x_LMH.device
    blocks = num_local * triton_cdiv(max_tokens, block_m)  # every buffer row live
    if num_slots > 0:
        blocks = min(blocks, num_slots, min(num_local, num_slots) + num_slots // block_m)
    num_slots = num_local * max_tokens  # from here: the buffer rows, as slots (sentinel: one past)
    if num_slots >= 2**31:
        raise ValueError(f"batched buffers of {num_local} x {max_tokens} rows: slots index them in int32 (< 2^31)")
    rows = blocks * block_m  # aligned rows, worst case
    sorted_slot, block_expert, num_rows = _batched_rows(num_tokens_L, num_local, max_tokens, blocks, block_m)
    # Zeros: gemm2 writes live rows only, so the rows past each count stay 0 without a masking
    # pass over y (and nothing reads memory no kernel wrote; compute-sanitizer initcheck).
    y = torch.zeros(num_slots, hidden, dtype=x_LMH.dtype, device=device)
    launch = Launch(
        x_LMH.reshape(num_slots, hidden), torch.empty(0, device=device), sorted_slot, block_expert,
        num_rows, None, torch.empty(rows, inter, dtype=a_dtype, device=device), y,  # no top-k reduce: no slot flags
        1, activation, False, False, swiglu_alpha, swiglu_limit, block_m,
    )
    return launch


def _batched_rows(num_tokens_L: torch.Tensor, num_local: int, max_tokens: int, blocks: int, block_m: int):
    """(sorted_slot [blocks*BLOCK_M], block_expert [blocks], num_rows [1]), int32, from the counts
    in one launch (`kernels.moe_batched_rows_kernel`; a dozen torch ops before)."""
    from fusedmoe.backends.triton import kernels

    device = num_tokens_L.device
    sorted_slot = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)
    block_l = triton_next_pow2(num_local)
    block_b = max(2, min(64, 8192 // block_l))
    launch(kernels.moe_batched_rows_kernel, (triton_cdiv(blocks, block_b),),
        num_tokens_L.contiguous(), sorted_slot, block_expert, num_rows, num_local, max_tokens, blocks,
        BLOCK_L=block_l, BLOCK_B=block_b, BLOCK_M=block_m, num_warps=4,
    )
    return sorted_slot, block_expert, num_rows


def batched_output(launch: Launch, num_local: int, max_tokens: int) -> torch.Tensor:
    """y [L, max_tokens, H], zero past each expert's count (y starts zeroed)."""
    return launch.y.view(num_local, max_tokens, launch.y.shape[1])


def _triton_batched_experts_op_impl(
    x: torch.Tensor,
    num_tokens: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    num_slots: int = 0,
    top_k: int = 1,
    batch_invariant: bool = False,
) -> torch.Tensor:
    return triton_batched_experts(x, num_tokens, w13, w2, w13_bias, w2_bias, activation,
                                  swiglu_alpha, swiglu_limit, num_slots, top_k, batch_invariant).contiguous()


# Custom op (torch.compile(fullgraph=True), CUDA graphs); plain eager calls run the impl (call_op).
triton_batched_experts_op = torch.library.custom_op("fusedmoe::triton_batched_experts",
                                                    _triton_batched_experts_op_impl, mutates_args=())


@triton_batched_experts_op.register_fake
def _(x, num_tokens, w13, w2, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, num_slots=0, top_k=1,
      batch_invariant=False):
    return torch.empty_like(x)


class BatchedTritonExperts(BatchedExperts):
    """Experts on per-expert buffers [L, max_tokens, H] (expert-parallel dispatch): unquantized,
    and the quantized schemes (W8A8 and weight-only) through quant.py."""

    def __init__(self, config):
        super().__init__(config)
        self.batch_invariant = wants_batch_invariance(config)

    process_weights = TritonExperts.process_weights  # the same weights as the contiguous layout

    def apply_batched(self, x_LMH, num_tokens_L, weights: ExpertWeights, *, num_slots: int = 0,
                      top_k: int = 1) -> torch.Tensor:
        c = self.config
        if weights.quant is not None:
            from fusedmoe.backends.triton.quant import apply_batched_quant

            return apply_batched_quant(c, x_LMH, num_tokens_L, weights, num_slots, top_k, self.batch_invariant)
        return call_op(triton_batched_experts_op, _triton_batched_experts_op_impl, x_LMH, num_tokens_L,
                       weights.w13, weights.w2, weights.w13_bias, weights.w2_bias, c.activation,
                       c.swiglu_alpha, c.swiglu_limit, num_slots, top_k, self.batch_invariant)


# The W8A8 path (TritonExperts.apply with weights.quant) registers its custom ops on import,
# before any torch.compile trace reaches apply.
from fusedmoe.backends.triton import quant as _quant  # noqa: E402,F401
