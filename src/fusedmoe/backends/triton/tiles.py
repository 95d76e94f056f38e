"""Tile configurations for the Triton MoE GEMMs: one validity predicate, a heuristic first.

    tile = heuristic(problem)           # always valid (asserted by tests over many shapes)
    tile = direct_gemm2_heuristic(...)  # the decode path's GEMM2 + top-k sum (no alignment)
    check_tile(tile, ...) -> reason     # the one predicate; tuned tables are held to it too
    check_plan(t1, t2, direct=...)      # a (gemm1, gemm2) pair of the aligned or the direct path
    tile_mode(scheme) -> (quant, group) # what the predicate and the heuristic take for a scheme
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

SMEM_BYTES = 227 * 1024  # per-block shared memory on H100/H200 (sm_90)
QUANT_GRANULARITIES = ("tensor", "channel", "block")  # W8A8 weight scale layouts
# Weight-only modes: "w8" fp8 / int8 codes with per-channel scales, "w4" 4-bit codes packed two
# per byte along K with a scale per `group` inputs (activations stay 16/32-bit).
WEIGHT_ONLY_MODES = ("w8", "w4")
# split_k values: GEMM1's K shares, or the direct GEMM2's slot shares per token
SPLIT_KS = (1, 2, 4, 8, 16)
# Operands a GEMM loads through TMA descriptors: the weights, or the sorted rows and the weights.
TMA_LOADS = ("w", "a+w")
# 8-bit modes whose GEMM1 takes the 4-bit decode rule where the bf16 rule's tile is 16 wide
NARROW_8BIT = ("block", "w8")
NARROW_SPLIT_PROGRAMS = 3  # GEMM1 programs per SM the K shares of a 4- or 8-bit decode aim for
GROUP_M = 8  # the default row blocks per group of the aligned GEMMs' program order (TileConfig.group_m)
PERSISTENT_PROGRAMS = 1  # programs per SM of a persistent GEMM launch (TileConfig.persistent)
# ... of the weight-only 4-bit GEMM2's persistent launch, whose tiles are small enough for several
# per SM. H200, mxfp4 fragments, GEMM2 alone, 16 x 128 x 128, 4 warps, 3 stages, at 1 / 2 / 4
# programs per SM against one program per tile (results/2026-11-27_h200_0092668_w4_persistent_gemm2.txt):
# DeepSeek-V3 (I = 256: four K steps a tile) M=16 121 / 73 / 57 us against 78 (69 on the best
# tile), M=64 274 / 161 / 123 against 166 (146); Qwen3-30B and gpt-oss (I = 768, 2880) lost.
W4_PERSISTENT_PROGRAMS = 4
MAX_GROUP_M = 64
# K (the intermediate, GEMM2's depth) past which the 4-bit fragment GEMM2 at 16- and 32-row blocks
# steps 128 deep at any group (heuristic): Mixtral's 14336 is past it, Llama-4's 8192 is not
W4_LONG_K = 8192


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # GEMM1 only: programs per row block and N tile along K (decode)
    # W8A8 only: whether the GEMM runs kernels.py's SWAP_AB (w^T @ a^T), as a tuned entry found
    # it; None: quant.swap_ab's rule decides
    swap_ab: bool | None = None
    # the aligned GEMMs' program order: row blocks that sweep the N tiles together
    # (kernels._grouped_tile). 1 walks every N tile of one row block before the next: gpt-oss-120b
    # bf16 on an H100, M=1024, 64 x 128 x 64 tiles: GEMM1 1563 -> 1515 us, GEMM2 801 -> 774 us
    # (benchmarks/results/2026-11-25_h100_3589f2c_group_m_probe.txt)
    group_m: int = GROUP_M
    # the aligned path's GEMMs, unquantized (GEMM1 with K unsplit), and its weight-only 4-bit GEMM2
    # (W4_PERSISTENT_PROGRAMS per SM, above): a persistent launch
    # (PERSISTENT_PROGRAMS per SM, each striding over the real (row block, N tile) tiles in one
    # flattened loop, so the next tile's loads overlap this one's epilogue; kernels.moe_gemm1_kernel
    # / moe_gemm2_kernel). H200, GEMM2 alone at M=4096, 128 x 256 x 64, 8 warps
    # (benchmarks/bench_persistent_gemm.py, results/2026-11-25_h200_eb0ebd3_persistent_flatten_gemm2.txt):
    # DeepSeek-V3 489 -> 417 us (3 stages), gpt-oss-120b 784 -> 735, Qwen3-30B 232 -> 215 (4 stages).
    # GEMM1 with one_dot, 128 x 2*128 x 64, 8 warps, 4 stages (benchmarks/bench_persistent_gemm1.py,
    # results/2026-11-27_h200_67424e3_persistent_gemm1.txt): DeepSeek-V3 M=4096 628-668 -> 554 us,
    # gpt-oss-120b 1437-1452 -> 1381. On an H100 the same entries ran the whole call 10-11% slower
    # at those two cells (results/2026-11-27_h100_fb9a963_persistent_gemm1_ab.txt; 15-20% more
    # DRAM bytes: the programs drift apart and an expert's row blocks stop sharing its weight
    # tiles in L2, results/2026-11-27_h100_8da3dc2_ncu_persistent_gemm1.txt): its table keeps one
    # program per tile there
    persistent: bool = False
    # GEMM1, unquantized and gated: gate and up in one [2 * block_n]-wide dot per K step
    # (kernels.moe_gemm1_kernel ONE_DOT): one wgmma of twice the width instead of two. H200,
    # GEMM1 alone, 128 x 2*128 x 64, 8 warps: gpt-oss-120b M=4096 1624-1659 -> 1475 us
    # (results/2026-11-27_h200_bdb1fac_one_dot_gemm1.txt). Weight-only 4-bit in the fragment
    # layout: gate and up rows as one fragment tile (one load, one decode call, one dot); its K
    # step 6-11% fewer SASS instructions (benchmarks/kernel_report.py --loop). H100, GEMM1 alone:
    # -7% to +12% against the best two-tile tile by cell (results/2026-11-27_h100_fb2ab66_one_dot_w4.txt),
    # so `fusedmoe tune` toggles it (aligned and direct) and no rule picks it; the checkpoint
    # layout runs it as two (`experts._fitted`).
    one_dot: bool = False

    def as_kwargs(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                    num_warps=self.num_warps, num_stages=self.num_stages)

    def as_list(self) -> list:
        """The tuned-table form: [block_m, block_n, block_k, num_warps, num_stages, split_k], with
        swap_ab appended when it is set, swap_ab (true / false / null) then group_m when group_m
        is not the default GROUP_M, swap_ab, group_m, persistent when the tile is persistent, and
        swap_ab, group_m, persistent, true when it runs one dot (one_dot)."""
        values = [self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages, self.split_k]
        if self.one_dot:
            return [*values, self.swap_ab, self.group_m, self.persistent, True]
        if self.persistent:
            return [*values, self.swap_ab, self.group_m, True]
        if self.group_m != GROUP_M:
            return [*values, self.swap_ab, self.group_m]
        return values if self.swap_ab is None else [*values, self.swap_ab]


def tile_mode(scheme) -> tuple[str | None, int | None]:
    """(quant, group) of check_tile / heuristic for a scheme (a `QuantScheme` or None).

    W8A8 fp8 / int8: the weight granularity; weight-only: "w8" (fp8, int8 codes) or "w4" with
    its scale group; None: unquantized. Raises ValueError for a scheme no Triton GEMM runs.
    """
    if scheme is None:
        return None, None
    key = scheme.weight
    if scheme.weight_only:
        return ("w8", None) if key.dtype in ("fp8", "int8") else ("w4", key.group)
    if key.dtype in ("fp8", "int8") and key.granularity in QUANT_GRANULARITIES:
        return key.granularity, None
    raise ValueError(
        f"no Triton tiles for {scheme.name}: the triton GEMMs run W8A8 fp8 / int8 (tensor, channel "
        "or block weight scales) and weight-only schemes"
    )


# The weight-only GEMMs' codes of 4-bit weights in the fragment layout (fusedmoe.quant.fragments):
# kernels.W4_MXFP4_FRAG / W4_NVFP4_FRAG / W4_INT4_FRAG, keep in sync. A fragment is 16 rows x 64 k:
# the GEMMs over it take BLOCK_N and BLOCK_K of at least 64 (`fragment_tile`).
W4_MXFP4_FRAG, W4_NVFP4_FRAG, W4_INT4_FRAG = 3, 4, 5
W4_FRAG_FORMATS = {"mxfp4": W4_MXFP4_FRAG, "nvfp4": W4_NVFP4_FRAG, "int4": W4_INT4_FRAG}
FRAGMENT_MIN_TILE = 64


def fragment_tile(tile: TileConfig) -> TileConfig:
    """The tile a GEMM over fragment-layout 4-bit weights runs for `tile`: BLOCK_N and BLOCK_K
    raised to FRAGMENT_MIN_TILE (whole fragments per tile, four warps' worth of 16-row A operand
    rows; with one_dot the gate and up halves are one tile, so each half needs half of it), the
    rest as given. The tables and the heuristic's "w4" tiles are chosen for the checkpoint layout;
    most already are this wide (64 x 128 at decode, 128 x 128 past 16 rows)."""
    min_n = FRAGMENT_MIN_TILE // 2 if tile.one_dot else FRAGMENT_MIN_TILE
    if tile.block_n >= min_n and tile.block_k >= FRAGMENT_MIN_TILE:
        return tile
    return replace(tile, block_n=max(tile.block_n, min_n), block_k=max(tile.block_k, FRAGMENT_MIN_TILE))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_tile(tile: TileConfig, *, dtype: torch.dtype, operands: int = 1, allow_split: bool = False,
               quant: str | None = None, group: int | None = None) -> str | None:
    """The reason `tile` cannot run, or None. `operands` = B tiles per K step (2 for gate+up);
    split-K exists for GEMM1 only (its partials are finished by the activation kernel).

    quant = the W8A8 weight granularity ("tensor", "channel", "block"), a weight-only mode
    ("w8", "w4" with its scale `group`) or None. 8-bit operands take K >= 32 per MMA; block
    scales need BLOCK_K and BLOCK_N to divide 128 (one scale block per K step and N tile). "w4"
    feeds the even and odd columns of a K step to two dots of BLOCK_K / 2 >= 16, and a K step
    covers whole groups or lies in one (BLOCK_K a multiple or a divisor of the group), so a split
    K share starts on a group. Shared memory counts weights at their stored width (1 byte, 1/2
    for "w4") and activations at 1 byte for W8A8. Persistent launches: the unquantized GEMMs and
    the "w4" GEMM2 (GEMM2 tiles are checked with allow_split False).
    """
    if tile.split_k not in SPLIT_KS:
        return f"split_k={tile.split_k} must be one of {', '.join(map(str, SPLIT_KS))}"
    if tile.split_k > 1 and not allow_split:
        return f"split_k={tile.split_k}: only GEMM1 splits K"
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(tile, name)
        if not _pow2(value) or not 16 <= value <= 256:
            return f"{name}={value} must be a power of two in [16, 256] (tl.dot needs >= 16)"
    if tile.swap_ab is not None:
        if not isinstance(tile.swap_ab, bool):
            return f"swap_ab={tile.swap_ab!r} must be true, false or unset"
        if quant not in QUANT_GRANULARITIES:
            return f"swap_ab={tile.swap_ab}: only the W8A8 GEMMs swap their operands (kernels.py SWAP_AB)"
    if not isinstance(tile.persistent, bool):
        return f"persistent={tile.persistent!r} must be true or false"
    if tile.persistent and (tile.split_k > 1 or quant is not None and (quant != "w4" or allow_split)):
        return ("persistent=True: only the aligned path's unquantized GEMMs and its weight-only 4-bit "
                "GEMM2 run a persistent launch, K unsplit (kernels.moe_gemm1_kernel / moe_gemm2_kernel "
                "PERSISTENT)")
    if not isinstance(tile.one_dot, bool):
        return f"one_dot={tile.one_dot!r} must be true or false"
    if tile.one_dot and (quant not in (None, "w4") or operands != 2):
        return ("one_dot=True: only the unquantized and the weight-only 4-bit gated GEMM1 run gate and up "
                "as one dot (kernels.moe_gemm1_kernel ONE_DOT)")
    if tile.one_dot and 2 * tile.block_n > 256:
        return f"one_dot=True: block_n={tile.block_n} makes a {2 * tile.block_n}-row weight tile (at most 256)"
    if not _pow2(tile.group_m) or tile.group_m > MAX_GROUP_M:
        return f"group_m={tile.group_m} must be a power of two in [1, {MAX_GROUP_M}]"
    if tile.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={tile.num_warps} must be one of 1, 2, 4, 8, 16"
    if not 1 <= tile.num_stages <= 7:
        return f"num_stages={tile.num_stages} must be in [1, 7]"
    if quant in WEIGHT_ONLY_MODES:
        if quant == "w4":
            if group is None or group <= 0 or group % 2:
                return f"quant='w4' needs its scale group size (even: whole bytes), got group={group}"
            if tile.block_k < 32:
                return (f"block_k={tile.block_k}: 4-bit weights run two dots of block_k / 2 columns "
                        "(even and odd k), which need block_k >= 32")
            if tile.block_k % group and group % tile.block_k:
                return f"block_k={tile.block_k} must be a multiple or a divisor of the scale group {group}"
    elif quant is not None:
        if quant not in QUANT_GRANULARITIES:
            return f"quant={quant!r} must be one of {QUANT_GRANULARITIES + WEIGHT_ONLY_MODES}"
        if tile.block_k < 32:
            return f"block_k={tile.block_k}: 8-bit tl.dot needs block_k >= 32"
        if quant == "block" and (tile.block_k > 128 or tile.block_n > 128):
            return (
                f"block_k={tile.block_k}, block_n={tile.block_n}: 128x128 block scales need both "
                "to divide 128"
            )
    size = dtype.itemsize
    a_size, b_size = size, size
    if quant in WEIGHT_ONLY_MODES:
        b_size = 1 if quant == "w8" else 0.5
    elif quant is not None:
        a_size, b_size = 1, 1
    per_stage = int(tile.block_m * tile.block_k * a_size + operands * tile.block_k * tile.block_n * b_size)
    if per_stage * tile.num_stages > SMEM_BYTES:
        return (
            f"{tile.num_stages} stages x {per_stage} B = {per_stage * tile.num_stages} B of shared "
            f"memory exceeds {SMEM_BYTES} B"
        )
    return None


DIRECT_BLOCK_M = 16  # the direct path: one 16-row tl.dot block per slot, row 0 live
# W8A8 weight granularities the direct path cannot run, and why: per-tensor activation scales are
# one per expert, over its aligned rows (experts.direct_scheme_reason words it per scheme)
DIRECT_REFUSED = {"tensor": "one scale per expert, over its aligned rows"}


def check_plan(t1: TileConfig, t2: TileConfig, *, direct: bool, dtype: torch.dtype, gated: bool,
               quant: str | None = None, group: int | None = None, running: str | None = None) -> str | None:
    """The reason a (gemm1, gemm2) tile pair cannot run, or None: each tile held to `check_tile`
    (GEMM1 may split K), both with one block_m. direct: the decode path's pair (GEMM1 by slot,
    `kernels.moe_gemm2_direct_kernel`): block_m DIRECT_BLOCK_M, GEMM2's split_k its slot shares
    per token; per-tensor W8A8 has no direct path. running: what the tiles were meant to run (a
    scheme's name), named in a tile's reason."""
    if direct and quant in DIRECT_REFUSED:
        return f"per-tensor W8A8 has no direct path ({DIRECT_REFUSED[quant]})"
    if direct and (t1.persistent or t2.persistent):
        return "persistent=True: the direct path runs one program per slot (GEMM1) and per token (GEMM2)"
    for name, tile, operands, split in (("gemm1", t1, 2 if gated else 1, True), ("gemm2", t2, 1, direct)):
        reason = check_tile(tile, dtype=dtype, operands=operands, allow_split=split, quant=quant, group=group)
        if reason:
            return f"{name} tile {tile}{f' cannot run {running}' if running else ''}: {reason}"
    if direct and (t1.block_m, t2.block_m) != (DIRECT_BLOCK_M, DIRECT_BLOCK_M):
        return f"the direct path's tiles need block_m={DIRECT_BLOCK_M}, got {t1.block_m} and {t2.block_m}"
    if t1.block_m != t2.block_m:
        return f"both GEMMs need the same block_m, got {t1.block_m} and {t2.block_m}"
    return None


def require_plan(t1: TileConfig, t2: TileConfig, **kw) -> None:
    """`check_plan`, raising ValueError with its reason."""
    reason = check_plan(t1, t2, **kw)
    if reason:
        raise ValueError(reason)


def block_m_for(num_slots: int, num_local_experts: int, dtype: torch.dtype) -> int:
    """Rows per block: about the tokens an expert receives, so padding stays small."""
    per_expert = num_slots / max(1, min(num_local_experts, num_slots))
    for bm in (16, 32, 64):
        if per_expert <= bm:
            return bm
    return 64 if dtype == torch.float32 else 128


def heuristic(
    num_slots: int, num_local_experts: int, n: int, k: int, dtype: torch.dtype, *, gated: bool,
    num_sms: int = 132, quant: str | None = None, group: int | None = None, tma: str | None = None,
    codes: str | None = None, block_m: int | None = None, fragments: bool = False,
) -> TileConfig:
    """A valid tile for one grouped GEMM with N output columns and K reduction.

    Few rows per expert (decode) make the GEMM a weight stream: narrow N tiles give enough
    programs to keep every SM busy (>= 2 per SM) and long K tiles keep bytes in flight.
    quant (W8A8 weight granularity): 1-byte operands take BLOCK_K 128 (the bytes of bf16's 64);
    block scales cap BLOCK_K and BLOCK_N at 128. codes ("int8" / "fp8", W8A8 only): int8's larger
    blocks take their own rows, stages and GEMM2 width (below). Weight-only ("w8", "w4"): the
    bf16 tiles, with BLOCK_K >= 32 for "w4" (powers of two are multiples or divisors of any group).
    tma: the operands the GEMM will load through TMA descriptors (experts.tma_reasons): None,
    "w" (the weights; gemm1, whose rows are gathered by token) or "a+w" (gemm2's sorted rows too).
    block_m: the rows per block to pick the rest for (`fusedmoe tune` starts its other block sizes
    there); None: the heuristic's own. fragments ("w4"): the weights will be in the fragment
    layout (weight_only.w4_fragments_planned), not the checkpoint's; at 16- and 32-row blocks
    up to 32 rows an expert (32-row blocks from 13) they take the fine-grained tuned plans: one-dot GEMM1,
    GEMM2 128 wide (below).
    """
    if tma is not None and tma not in TMA_LOADS:
        raise ValueError(f"tma={tma!r} must be None or one of {TMA_LOADS}")
    if block_m is not None and (block_m < 16 or not _pow2(block_m)):
        raise ValueError(f"block_m={block_m} must be a power of two >= 16")
    touched = min(num_local_experts, num_slots)  # experts with rows, at most (num_slots / touched: rows an expert)
    if block_m is None:
        block_m = block_m_for(num_slots, num_local_experts, dtype)
        if quant == "block":
            # fp8 block scales: the K loop waits on each step's wgmma to scale it, so smaller
            # programs (two or three per SM) hide each other's waits: `fusedmoe tune --quant
            # fp8_w8a8_block` chose 64-row blocks at 256 rows per expert (H200: Qwen3-30B M=4096
            # 736 -> 660 us, DeepSeek-V3 M=1024 702 -> 518 with gemm2 128 wide)
            block_m = min(block_m, 64)
        elif codes == "int8" and block_m == 32:
            # int8 W8A8 at 17-32 rows per expert: `fusedmoe tune` chose 64-row blocks (H200,
            # M=1024: DeepSeek-V3 589 -> 478 us, gpt-oss 1120 -> 968); the rule alone, old / new
            # alternating (`2026-11-24_h200_2416cbc_int8_heuristic_ab.txt`): DeepSeek-V3 M=1024
            # -5%, gpt-oss -8%, Llama-4 M=4096 -4%
            block_m = 64
        elif quant == "w4" and fragments and block_m == 16 and num_slots > 12 * touched:
            # 4-bit fragments at 13-16 rows per expert: uniform routing takes many experts past
            # one 16-row block (a second, mostly empty block streams the weights again);
            # `fusedmoe tune` picked 32-row blocks there (int4 Qwen3-30B / Qwen3-235B M=256,
            # mxfp4 Mixtral M=64) and kept 16 at 8 rows per expert (DeepSeek-V3 M=256)
            block_m = 32
    operands = 2 if gated else 1
    blocks = -(-num_slots // block_m) + touched
    split = 1
    num_stages = 4
    if block_m == 16:
        want = max(16, n * blocks // (2 * num_sms))
        block_n = min(128, 1 << (want.bit_length() - 1))
        block_k = 128 if dtype == torch.float32 else 256
        num_warps = 4
        programs = blocks * -(-n // block_n)
        if gated and programs < 2 * num_sms:  # GEMM1 with too few programs: split H (decode)
            while split < 8 and programs * split < 2 * num_sms and k // (2 * split) >= 2 * block_k:
                split *= 2
    else:
        block_k = 32 if dtype == torch.float32 else 64
        block_n = 64 if (block_m >= 128 and gated) or n <= 64 else 128
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        if tma is not None and quant is None and block_m == 128:
            # H200, Triton 3.6, the grouped GEMM over sorted rows at M=4096 with descriptor loads
            # (benchmarks/bench_tma_gemm.py; gemm1's 128 w13 rows per program = our gate + up
            # tiles of 64): 8 warps, 3 stages won every weights-only cell (Mixtral / Qwen3-30B /
            # DeepSeek gemm1 3629 / 508 / 776 us against 3829 / 526 / 807 with 4 warps, 4 stages)
            # and the A + weights cells at 128-256 rows per expert (Qwen3 gemm2 256 vs 289 us,
            # DeepSeek 517 vs 739); at 1024 rows per expert (Mixtral) 4 warps, 4 stages won with
            # both operands on descriptors (gemm2 1619 vs 1753 us, the gemm1 shape 3363 vs 3471).
            # Between 256 and 1024 rows per expert: not measured, 8 warps kept.
            num_warps, num_stages = 8, 3
            if tma == "a+w" and num_slots >= 1024 * touched:
                num_warps, num_stages = 4, 4
    if quant in QUANT_GRANULARITIES:
        if block_m > 16:
            # H200, fp8 block at 1024 tokens (benchmarks/bench_quant_tiles.py): BLOCK_N 64 with
            # BLOCK_K 128 (8 warps at BLOCK_M 128) ran Mixtral in 1960 us against 4868 us for the
            # bf16-shaped tile (BLOCK_N 128, 4 warps) and Qwen3-30B in 308 us against 686 us.
            block_k, block_n = 128, 64
            num_warps = 8 if block_m >= 128 else 4
            # gemm2: the tuners' 64 x 128 x 128. Per-tensor / per-channel fp8 too since its
            # accumulator is chained (quant.fp8_promoted; 64 wide before): H200, old / new, two
            # alternating rounds at M=256-2048 (`2026-11-24_h200_7d03635_fp8_chain.txt`): M=1024
            # -1 to -5% on the fine-grained presets, the rest within 2%
            if not gated and (quant == "block" or codes in ("int8", "fp8")):
                block_n = 128
            if block_m >= 128 and codes == "int8":
                # int8 at 128 rows: 3 stages take two programs per SM (99 KB of shared memory each,
                # 119-123 registers a thread without biases). With gemm2 128 wide, old / new
                # alternating (same file): M=4096 Qwen3-30B 777 -> 632 us, Qwen3-235B 855 -> 702,
                # DeepSeek-V3 1332 -> 1042, Mixtral 3968 -> 3280, M=2048 -4 to -16%; gpt-oss M=4096
                # 1907 -> 2226: its biases take the epilogue to 140 / 160 registers, one program
                # per SM (tuned entry instead). fp8 channel lost with the same tiles (+4 to +12%
                # at M=2048-4096) and keeps the old ones.
                num_stages = 3
        if quant == "block":
            block_k, block_n = min(block_k, 128), min(block_n, 128)
    elif quant == "w4":
        # 4-bit decode in registers (H200 grid, benchmarks/bench_quant_tiles.py at 28f7f8f, int4 g32
        # and mxfp4 on Mixtral / Qwen3-30B / DeepSeek-V3): at 16-row blocks BLOCK_K 256 on long K
        # at decode (Mixtral M=1 119 us against 159 with 128), 128 past ~2 slots per expert;
        # larger blocks BLOCK_N 64-128 x BLOCK_K 128 (Mixtral M=256 918 us against 1184 for the
        # bf16 tile 128 x 64). 16-row blocks: `_narrow_decode`. With int4's scales group-major
        # (weight_only.kernel_scale_layout) BLOCK_N 128, 3 stages took the larger blocks (H200,
        # int4 g32, `2026-11-23_h200_73de619_w4_tiles_large.txt`): Qwen3-30B M=1024 484 -> 388
        # us, M=4096 1765 -> 1110 (at 64 rows), Mixtral M=1024 3946 -> 2381, M=4096 12312 ->
        # 7634. Old / new over six presets (`_94f7184_w4_tiles_ab.txt`): int4 -7 to -39% at
        # M=1024-4096; mxfp4 / nvfp4 (row-major byte scales) -3 to -26% at M=4096 but Mixtral
        # M=256 +10 / +14% and gpt-oss M=1024 +4%.
        split = 1
        if block_m == 16:
            block_k = 256 if num_slots <= 2 * num_local_experts and k >= 4096 else 128
        else:
            block_n, block_k, num_stages = 128, 128, 3
            num_warps = 8 if block_m >= 128 else 4
            # 64-deep K steps at 4 warps. A 128 x 128 tile at 4 warps compiled (sm90) with wgmma
            # serialized one MMA at a time over fragments and with spills in the K loop over int4's
            # checkpoint layout (kernel_report --loop, results/2026-11-29_cpu_sm90_triton3.9_w4_kernel_hazards.txt);
            # timed on an H200 (packaged tables off, 5 presets x M=256-2048, 128 -> 64 per GEMM,
            # results/2026-11-29_h200_efb440d_w4_block_k_ab.txt): GEMM2 64 deep won at 32- and
            # 64-row blocks (-2 to -8%; mxfp4 at 32 rows +2.6% once); GEMM1 won over fragments at 64 rows
            # (mxfp4 Qwen3-30B M=1024 461 -> 336 us, Mixtral M=256 898 -> 688, DeepSeek-V3 M=2048
            # 1168 -> 929) but lost at 32 (+8-9%); over int4's checkpoint layout the other way round
            # (32 rows -5 to -22%, 64 rows +6-10%); and where K is not a multiple of 128 (gpt-oss,
            # H = 2880: M=2048 mxfp4 2146 -> 1502, int4 -14%). 8 warps (128-row blocks) kept 128:
            # GEMM2 64 deep lost 6-23% there.
            if num_warps == 4 and (not gated or k % 128 or block_m == (64 if fragments else 32)):
                block_k = 64
    if block_m == 16 and (quant == "w4" or (gated and quant in NARROW_8BIT and block_n == 16)):
        block_n, split, block_k = _narrow_decode(num_slots, num_local_experts, n, k, gated, num_sms, block_k)
    one_dot = False
    if quant == "w4" and fragments and block_m <= 32 and split == 1 and num_slots <= 32 * touched:
        # 4-bit fragments at 16- and 32-row blocks: the tiles `fusedmoe tune` picked over int4
        # g32 / g64 / g128 at Qwen3-30B, Qwen3-235B TP4 and DeepSeek-V3 TP8, M = 16-256 (H200,
        # sixty-seventh session, 2026-11-30_h200_78a2a19_int4_fragment_tunes.txt, whole call
        # -5 to -24% against this rule's two-dot plans): GEMM1 one dot over gate and up
        # (2 x 64 weight rows a program at 16 rows, 2 x 128 at 32), GEMM2 128 wide, 64 deep
        # where a K step then holds two or more scale groups (group <= 32), else 128 deep.
        # Measured as a rule (packaged tables off, alternating with the two-dot rule, two rounds,
        # 2026-11-30_h200_e0dfc84_w4_fragment_heuristic_ab.txt): int4 g32 / g128, mxfp4, nvfp4
        # over six presets x M = 16, 64, 256 (69 cells): 58 faster by 1-24%, 8 within 1%, and
        # Mixtral M=16 with groups <= 32 slower by 3-5% (int4 g32, mxfp4, nvfp4; the tuner's
        # Mixtral mxfp4 best there kept a two-dot GEMM1 and a 128-deep GEMM2: not special-cased
        # until measured as a rule; since W4_LONG_K, below). 17-32 rows an expert (Qwen3-30B,
        # Qwen3-235B, GLM-4.5-Air M=512, gpt-oss-120b M=1024) measured against the 3-stage two-dot
        # tiles the larger blocks keep (2026-11-30_h200_b61cabc_w4_long_k_rows32_ab.txt, tables off,
        # two rounds): -3 to -11% over int4 g32, mxfp4, nvfp4 (g32 -9 to -11%). Not past 32 rows.
        if gated:
            one_dot, block_n = True, 64 if block_m == 16 else 128
            block_k = 128 if block_m == 16 else 64
        else:
            # past W4_LONG_K (Mixtral's I = 14336) 128 deep at any group: the tuner's Mixtral mxfp4
            # bests at M=16 and 64 ran GEMM2 x 128 x 128 (the 64-deep rule lost 3-5% at Mixtral
            # M=16, groups <= 32), where 112 K steps of 128 each program are already many. As a rule
            # (A/B against the 64-deep step, two rounds, 2026-11-30_h200_b61cabc_w4_long_k_rows32_ab.txt):
            # Mixtral M=16 -6 to -9% (int4 g32 252 -> 230 us), M=64 -1 to -3% but mxfp4 with tables
            # off +3% (296 -> 306; -3% with them on)
            block_n = 128
            short = (block_m == 32 or (group or 32) <= 32) and k <= W4_LONG_K
            block_k = 64 if short else 128
        num_warps, num_stages = 4, 4
    tile = TileConfig(block_m, block_n, block_k, num_warps, num_stages, split, one_dot=one_dot)
    while check_tile(tile, dtype=dtype, operands=operands, allow_split=True, quant=quant, group=group):
        if tile.num_stages > 2:
            tile = replace(tile, num_stages=tile.num_stages - 1)
        elif tile.block_k > 32:
            tile = replace(tile, block_k=tile.block_k // 2, num_stages=4)
        else:
            tile = replace(tile, num_stages=1)
            break
    return tile


def _narrow_decode(num_slots: int, num_local_experts: int, n: int, k: int, gated: bool, num_sms: int,
                   block_k: int) -> tuple[int, int, int]:
    """(BLOCK_N, split_k, BLOCK_K) of a 16-row block over 4-bit weights, or of a 16-wide GEMM1
    over 8-bit ones (`NARROW_8BIT`; decode).

    GEMM1 (gated: GEMM2 cannot split) splits K while the working programs (one block per expert
    in use x 64-wide N tiles) stay within NARROW_SPLIT_PROGRAMS per SM, in 64 x 128 tiles (H200, int4
    g32, M=1 and 4 over six presets, benchmarks/bench_wo_decode.py,
    2026-11-23_h200_a8899f1_wo_decode.txt; the rule picks the best split of that grid in all 12
    cells): Llama-4 M=1 GEMM1 unsplit 35.6 -> 13.8 us in 8 shares (16 programs -> 128),
    DeepSeek-V3 M=1 62.1 -> 25.1 (8), Qwen3-30B M=1 26.3 -> 23.9 (4; 8 shares, 768 programs:
    26.3), gpt-oss M=1 60.6 -> 50.7 (2), Llama-4 M=4 46.7 -> 30.0 (4; 8: 33.1), Mixtral
    unsplit (448 programs). The same rule for GEMM1 over 8-bit weights (W8A8, "w8") was mixed
    (H200, one process, `2026-11-23_h200_506a87c_narrow8_ab.txt`): M=1 fp8 block DeepSeek-V3
    43.5 -> 36.5 us, Qwen3-235B 36.0 -> 32.8, fp8_w8a16 Qwen3-30B 49.5 -> 29.0, but fp8 block
    gpt-oss 50.2 -> 53.9, Mixtral 133.2 -> 141.4, DeepSeek-V3 M=16 179.6 -> 195.7, fp8_w8a16
    gpt-oss M=1 51.6 -> 58.7. The wins were the cells whose bf16-rule GEMM1 tile is 16 wide (16
    one-byte columns: small loads), the losses 32 wide or more; int8 W8A8 moved -2 to +4%: GEMM1
    of fp8 block and of the "w8" weight-only schemes takes this rule in place of 16-wide tiles
    (the same A/B, `2026-11-23_h200_02c8a46_narrow8_16wide_ab.txt`: M=1 fp8 block DeepSeek-V3
    43.0 -> 36.6, Qwen3-235B 35.9 -> 32.4, Qwen3-30B 32.9 -> 30.9; fp8_w8a16 DeepSeek-V3 56.0 ->
    29.6, Qwen3-30B 49.7 -> 29.9; int8_w8a16 Qwen3-30B 33.2 -> 24.5; Llama-4 M=4 fp8_w8a16 82.2
    -> 45.3; every other cell within 1%).
    """
    split = 1
    working = min(num_local_experts, num_slots) * -(-n // 64)
    while gated and split < 8 and working * 2 * split <= NARROW_SPLIT_PROGRAMS * num_sms and k // (2 * split) >= 256:
        split *= 2
    return 64, split, 128 if split > 1 else block_k


DIRECT_SPLIT_WORK = 8192  # K elements (slots x I) one direct GEMM2 program streams before splitting
DIRECT_SPLIT_PROGRAMS = 1.5  # direct GEMM2 programs per SM the slot shares aim for


def direct_gemm2_heuristic(
    num_tokens: int, hidden: int, inter: int, dtype: torch.dtype, *, num_sms: int = 132,
    quant: str | None = None, group: int | None = None, top_k: int = 1,
) -> TileConfig:
    """A valid tile for the direct decode GEMM2 (`kernels.moe_gemm2_direct_kernel`): one program
    per (token, N tile, slot share) streams its N rows of its slots' w2. N tiles narrow (to 32)
    until the tokens' tiles cover the SMs; then `split_k` (here: the slot shares) doubles while
    the programs are fewer than DIRECT_SPLIT_PROGRAMS per SM or one program would stream more
    than DIRECT_SPLIT_WORK K elements. H200, M=1 (benchmarks/bench_direct_split.py,
    2026-11-23_h200_split.txt), us: Qwen3-30B 30.4 -> 27.9 (32 wide, 4 shares: 256 programs;
    8 shares 32.0), gpt-oss 73.6 -> 58.0 (32, 4: 360; 2 shares 59.5), Mixtral 202.7 -> 170.3
    (32, 2); 16-wide tiles were the slowest. Qwen3-30B M=4 (256 programs of 8 x 768) ran 72 us
    unsplit and 81 in 2 shares. 4-bit weights ("w4") stream a quarter of bf16's bytes per tile:
    their tiles stop at 64 wide and the shares make up the programs (H200, int4 g32, M=1,
    benchmarks/bench_wo_decode.py: DeepSeek-V3 32 wide 25.1 us, 64 wide in 2 shares 23.5; Qwen3-
    235B 27.2 -> 23.0; Llama-4 and Qwen3-30B 64 wide was the grid's best).
    BLOCK_M is the 16 rows of a tl.dot operand whose row 0 is the slot's activation row; the
    launch runs cdiv(top_k, cdiv(top_k, split_k)) shares (none without slots).
    """
    block_n, narrowest = 128, 64 if quant == "w4" else 32
    while block_n > narrowest and num_tokens * -(-hidden // block_n) < num_sms:
        block_n //= 2
    block_k = 128 if dtype == torch.float32 else 256
    while block_k > 32 and block_k >= 2 * inter:
        block_k //= 2
    if quant == "w4":
        block_k = max(block_k, 32)
    tile = TileConfig(16, block_n, block_k, 4, 4)
    while check_tile(tile, dtype=dtype, quant=quant, group=group):
        if tile.num_stages > 2:
            tile = TileConfig(16, block_n, block_k, 4, tile.num_stages - 1)
        elif tile.block_k > 32:
            block_k //= 2
            tile = TileConfig(16, block_n, block_k, 4, 4)
        else:
            break
    programs = num_tokens * -(-hidden // block_n)
    split = 1
    while split < top_k and (programs * split < DIRECT_SPLIT_PROGRAMS * num_sms
                             or -(-top_k // split) * inter > DIRECT_SPLIT_WORK):
        split *= 2
    return replace(tile, split_k=split)
