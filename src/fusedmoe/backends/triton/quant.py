"""Host side of the `triton` backend's quantized schemes: W8A8 here (quantize activations,
launch the 8-bit GEMMs), weight-only in weight_only.py; one pair of custom ops for both, and
one for the quantized schemes in the batched layout.

    codes, scales = quantize_activation(x, key)          # vs quantize_activation_ref (torch)
    x -> [quantize x] -> gemm1 (8-bit dot, scales) -> [quantize a] -> gemm2 -> reduce
    (prepare_quant_launch -> launch_quant_gemm1 -> launch_quant_gemm2: the tuner times them apart)
The activations are quantized exactly where and how the `emulation` backend fake-quantizes them:
    fp8_w8a8_tensor(_static)  one scale per local expert: amax of its rows (an atomic max over the
                              aligned rows) or the static a13/a2 scale; codes per aligned row
                              (quantize_expert_rows_kernel) with the expert's scale per row, so
                              the GEMMs run the per-channel path (weight scale at stride 0)
    fp8_w8a8_channel, int8    one scale per token (x) / per aligned row (a): quantize_rows_kernel
    fp8_w8a8_block            1x128 groups; GEMM1 quantizes its output in the epilogue when its
                              N tile is one group (BLOCK_N 128, no split-K), else a separate pass
Router weight on input scales x before quantization. The intermediate is stored in the
activation dtype between GEMM1 and its quantization (as vLLM's kernels keep it; emulation rounds it
the same way): half the bytes of fp32 for GEMM1 to write and the quantization to read. H200,
fp32 / bf16 alternating (benchmarks/results/2026-11-25_h200_1f23cc4_w8a8_intermediate_ab.txt):
int8 M=256-4096 -1 to -3.7% (Qwen3-30B M=4096 554 -> 537 us, Mixtral 3040 -> 2933), fp8 per
channel -1 to -4%; decode within +-2% but Qwen3-235B int8 M=1 +5%. No host sync: CUDA-graph safe.
Batched layout [L, max_tokens, H]: the same launches with buffer rows as slots (top_k 1, no
routed weight); an expert's rows are exactly its routed tokens, so the per-expert scales equal
the contiguous layout's (the dispatch has already applied a router weight on input).
Legend: T tokens, H hidden, I intermediate, G = 2I (gated) or I, L local experts, K top-k,
N = T*K slots, R aligned rows (N padded per expert to BLOCK_M).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fusedmoe.activations import is_gated
from fusedmoe.backends.triton.experts import (
    GEMM2_ROWS_MAX_I,
    W8A8_QUANT_CODES,
    GemmProblem,
    Launch,
    _num_sms,
    align,
    device_capability,
    launch_gemm1,
    launch_gemm2,
    launch_gemm2_direct,
    launch_gemm2_rows,
    launch_reduce,
    memoized_tiles,
    plan_tiles,
    prepare_direct_launch,
    triton_cdiv,
    triton_next_pow2,
)
from fusedmoe.backends.triton.launcher import launch
from fusedmoe.backends.triton.replay import replayable
from fusedmoe.backends.triton.tiles import TileConfig, heuristic, require_plan
from fusedmoe.modular import call_op, experts_ops
from fusedmoe.quant.formats import FP8_DTYPE
from fusedmoe.quant.params import QuantParams
from fusedmoe.quant.scheme import QuantKey, QuantScheme, get_scheme
from fusedmoe.quant.weights import check_activation_scales, check_quant_tensors

W8A8_SCHEMES = frozenset(
    ("fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "fp8_w8a8_block", "int8_w8a8")
)
SMALL_ROWS = 2048  # _launch_rows: up to this many rows, at most 8 per program
FUSE_XQ_MAX_H = 8192  # fuse_x_quantization: the widest x row the direct GEMM1 quantizes itself
# ... and the most w13 elements that GEMM1 reads (between gpt-oss M=1's 66M, fused 8% faster, and
# Mixtral M=1's 235M, 10% slower fused; gpt-oss M=4's 265M was within 3% either way)
FUSE_XQ_MAX_WEIGHTS = 128 * 2**20
FUSE_AQ_MAX_I = 8192  # fuse_a_quantization: the widest intermediate row the direct GEMM2 quantizes
FUSE_AQ_MIN_I = 384  # ... and the narrowest (DeepSeek-V3's 256, one K step per slot, ran slower)
ONE_PASS_MAX = 16384  # _launch_rows: groups up to this wide are read once, by one program
ACT_GROUP = 128  # fp8_w8a8_block: activation groups of 1x128 (and weight blocks of 128x128)
_CODE_DTYPE = {"fp8": FP8_DTYPE, "int8": torch.int8}
# kernels.py SWAP_AB: the aligned W8A8 GEMMs over row blocks under 64 rows multiply w^T @ a^T on
# sm90, the weight tile (BLOCK_N >= SWAP_AB_MIN_N rows) as the wgmma's M side, for the activation
# quantizations below. Unswapped, a 16-row block of fp8 codes runs HMMA on codes converted to f16
# (vLLM's fused_moe_kernel swaps fp8 the same way; benchmarks/bench_vllm.py). H200, the packaged
# tiles, swapped (one stage fewer) against not, two alternating rounds
# (benchmarks/results/2026-11-24_h200_ede68f9_swap_ab.txt): fp8 block (1x128 groups) at M=16-256
# -3 to -13% on Qwen3-30B, Qwen3-235B, DeepSeek-V3 and Mixtral M=16/64 (DeepSeek-V3 M=64 383 ->
# 337 us), gpt-oss within 1%; its direct decode path (M <= 4, tuned unswapped) +4 to +11% on three
# presets: left unswapped. fp8 per-token scales: -2 to -5% on the fine-grained presets, +2 to +7%
# on gpt-oss and Mixtral; int8: +1 to +13%. Neither is swapped.
SWAP_AB_ACTIVATIONS = (("fp8", "group"),)
SWAP_AB_MIN_N = 64


def _soft_fp8(device: torch.device) -> bool:
    # CPU tensors run under the Triton interpreter, whose fp32 -> fp8 cast mis-rounds at binade
    # carries (quant_kernels._fp8_grid); GPUs cast exactly in hardware.
    return device.type == "cpu"


# Activation quantization ---------------------------------------------------------------------
def quantize_activation(
    x_MK: torch.Tensor,
    key: QuantKey,
    static_scale: torch.Tensor | None = None,
    *,
    row_weight_M: torch.Tensor | None = None,
    live_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K], scales) of x (* row_weight per row) with Triton kernels, no host sync.

    Scales: fp8/int8 token [M, 1]; fp8 group g [M, ceil(K / g)]; fp8 tensor [1] (the static
    scale, or amax(x) / 448). Same values as `quantize_activation_ref`.
    live_rows = (row_map [R] int32, count [1] int32), token and group scales only: only rows
    row_map[i] < M for i < count are quantized; the other rows' codes and scales are left unset
    (the batched layout's buffer rows past each expert's count, which no GEMM reads).
    """
    _check_key(key)
    if x_MK.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x_MK.shape)}")
    m, k = x_MK.shape
    device = x_MK.device
    codes = torch.empty(m, k, dtype=_CODE_DTYPE[key.dtype], device=device)
    if key.granularity == "tensor":
        scale = _tensor_scale(x_MK, static_scale, row_weight_M)
        if m:
            _launch_rows(x_MK, codes, scale, row_weight_M, k, key, scale_in=1)
        return codes, scale
    group = k if key.granularity == "token" else key.group
    scales = torch.empty(m, max(1, triton_cdiv(k, group)), dtype=torch.float32, device=device)
    if m and k:
        _launch_rows(x_MK, codes, scales, row_weight_M, group, key, live_rows=live_rows)
    elif m:
        scales.fill_(1.0)
    return codes, scales


def quantize_activation_ref(
    x_MK: torch.Tensor,
    key: QuantKey,
    static_scale: torch.Tensor | None = None,
    *,
    row_weight_M: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation` in torch (`fusedmoe.quant.formats`): scale = amax / qmax per group
    (1 for all-zero groups), codes = fp8(clamp(x / scale, +-448)) or clamp(round(x / scale))."""
    from fusedmoe.quant.formats import (
        FP8_MAX,
        INT_RANGE,
        absmax_scale,
        fp8_quantize,
        int_quantize,
    )

    _check_key(key)
    x = x_MK.float()
    if row_weight_M is not None:
        x = x * row_weight_M.float().unsqueeze(-1)
    qmax = FP8_MAX if key.dtype == "fp8" else INT_RANGE[8][1]
    if key.granularity == "tensor":
        scale = static_scale.float().reshape(1) if static_scale is not None else (
            absmax_scale(x.abs().amax().reshape(1), FP8_MAX))
        return fp8_quantize(x, scale), scale
    k = x.shape[-1]
    group = max(k, 1) if key.granularity == "token" else key.group
    padded = torch.nn.functional.pad(x, (0, -k % group)).unflatten(-1, (-1, group))
    scales = absmax_scale(padded.abs().amax(-1), qmax)
    expanded = scales.repeat_interleave(group, -1)[:, :k]
    codes = fp8_quantize(x, expanded) if key.dtype == "fp8" else int_quantize(x, expanded, 8)
    return codes, scales


def _check_key(key: QuantKey) -> None:
    kind = (key.dtype, key.granularity)
    ok = kind in (("fp8", "tensor"), ("fp8", "token"), ("int8", "token")) or (
        kind == ("fp8", "group") and key.group == ACT_GROUP)
    if not ok:
        raise ValueError(f"no Triton activation quantization for {key} (fp8 tensor/token/group128, int8 token)")


def _tensor_scale(x_MK, static_scale, row_weight_M) -> torch.Tensor:
    """[1] fp32: the static scale, or amax(|x|) / 448 computed on the device."""
    from fusedmoe.backends.triton import quant_kernels

    device = x_MK.device
    if static_scale is not None:
        if static_scale.numel() != 1:
            raise ValueError(f"a per-tensor static scale holds one value, got shape {tuple(static_scale.shape)}")
        return static_scale.float().reshape(1).to(device)
    m, k = x_MK.shape
    amax = torch.zeros(1, dtype=torch.float32, device=device)
    if m and k:
        block_m = 16
        rows = triton_cdiv(m, block_m) * block_m
        sorted_slot = torch.arange(rows, dtype=torch.int32, device=device)  # rows >= m: padding
        one_expert = torch.zeros(rows // block_m, dtype=torch.int32, device=device)
        num_rows = torch.full((1,), rows, dtype=torch.int32, device=device)
        launch(quant_kernels.expert_amax_kernel, (rows // block_m,),
            x_MK, amax, row_weight_M if row_weight_M is not None else amax, sorted_slot, one_expert,
            num_rows, m, 1, k, x_MK.stride(0), x_MK.stride(1),
            GATHER=True, HAS_ROW_W=row_weight_M is not None, BLOCK_M=block_m,
            BLOCK_K=min(256, triton_next_pow2(k)), num_warps=4,
        )
    return torch.where(amax > 0, amax / torch.full((), 448.0, device=device), torch.ones_like(amax))


def _launch_rows(x, codes, scales, row_weight, group, key, *, scale_in=0, num_rows=None, live_rows=None):
    """quantize_rows_kernel over x's rows: scales [rows, groups] out (scale_in 0) or [1] in.
    live_rows = (row_map, count): the programs walk row_map's entries instead (ROW_MAP)."""
    from fusedmoe.backends.triton import quant_kernels

    m, k = x.shape
    row_map, map_end = None, 0
    if live_rows is not None:
        row_map, num_rows = live_rows
        m, map_end = row_map.numel(), x.shape[0]
    group = group if scale_in == 0 else k
    groups = triton_cdiv(k, group)
    # A group of up to ONE_PASS_MAX elements (a per-token row: x's H, the intermediate's I) is
    # loaded once, whole, by one program (ONE_PASS), ~32 elements a thread: 4 warps up to 4096,
    # then 8 and 16. Wider groups are read twice in 1024-wide steps (amax, then codes), as every
    # group over 1024 was: a chain of dependent loads in few programs. H200, per-token int8 /
    # fp8 (benchmarks/results/2026-11-24_h200_5af5224_onepass_rows.txt): Mixtral M=16's GEMM1 +
    # the intermediate's quantization (128 rows of 14336) 318 -> 235 us (vLLM's GEMM1 alone:
    # 214-255), the whole call -21%; M=1-256 -2 to -21% over five presets, M >= 1024 within 3%.
    one_pass = scale_in == 0 and group <= ONE_PASS_MAX
    block_k = triton_next_pow2(group) if one_pass else min(1024, triton_next_pow2(group))
    block_r = max(1, min(64, 4096 // block_k))  # ~4k elements per program
    num_warps = 4 if block_r * block_k <= 4096 else min(16, block_k // 1024)
    if one_pass and 512 <= block_k <= 1024:
        # rows of 257-1024 (the intermediate of fine-grained experts): 2 rows, 2 warps. H200,
        # int8 rows alone, 12288 live of [16256, 768]: 16.2 -> 14.9 us (4 rows / 4 warps before;
        # 1-8 rows by 2-8 warps swept); [49152, 768] 41.0 -> 40.5; [12288, 384] 8.6 -> 8.5; a
        # second sweep (the final _div_scale, another machine) 16.9 -> 16.5, 44.0 -> 43.2 and
        # 8.9 -> 9.0: a small gain at best (benchmarks/results/2026-11-24_h200_4d3cb53_quantize_rows.txt)
        block_r, num_warps = 2, 2
    if m <= SMALL_ROWS:
        # few rows (decode; the aligned rows of a decode's intermediate): <= 8 rows per program.
        # H200, fp8 1x128 groups (graph replay of 20 launches): x [1, 2048] 6.3 us at 32 rows
        # per program, 1.3 at 1; x [64, 2048] 2.9 -> 1.7 at 4; 1928 aligned rows, 64 live, of
        # [*, 768]: 3.7 -> 2.2 at 8 (7.9 at 1: programs that only exit)
        block_r = min(block_r, 8, triton_next_pow2(m))
    s_strides = (scales.stride(0), scales.stride(1)) if scale_in == 0 else (0, 0)
    launch(quant_kernels.quantize_rows_kernel, (triton_cdiv(m, block_r), groups),
        x, codes, scales, row_weight if row_weight is not None else x, scales,
        num_rows if num_rows is not None else scales, row_map if row_map is not None else scales,
        m, k, group, map_end,
        x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), *s_strides,
        IS_INT=key.dtype == "int8", SOFT_FP8=_soft_fp8(x.device), SCALE_IN=scale_in,
        HAS_ROW_W=row_weight is not None, HAS_NUM_ROWS=num_rows is not None,
        BLOCK_R=block_r, BLOCK_K=block_k, ONE_PASS=one_pass, num_warps=num_warps,
        ROW_MAP=row_map is not None,
    )


# Tiles ---------------------------------------------------------------------------------------
@memoized_tiles
def choose_quant_tiles(problem: GemmProblem, scheme: QuantScheme,
                       device: torch.device) -> tuple[TileConfig, TileConfig]:
    """The tuned entry for this W8A8 scheme, device and shape when one exists, else the
    heuristic with the scheme's constraints."""
    from fusedmoe.backends.triton.tuning import lookup

    tuned = lookup(problem, device, scheme)
    if tuned is not None:
        return tuned
    p, sms, gran, codes = problem, _num_sms(device), scheme.weight.granularity, scheme.weight.dtype
    t1 = heuristic(p.num_slots, p.num_local_experts, p.inter, p.hidden, p.dtype, gated=p.gated,
                   num_sms=sms, quant=gran, codes=codes)
    t2 = heuristic(p.num_slots, p.num_local_experts, p.hidden, p.inter, p.dtype, gated=False,
                   num_sms=sms, quant=gran, codes=codes)
    return t1, t2


def _check_tiles(t1: TileConfig, t2: TileConfig, gated: bool, granularity: str, dtype: torch.dtype) -> None:
    require_plan(t1, t2, direct=False, dtype=dtype, gated=gated, quant=granularity, running=f"{granularity} W8A8")


# The experts ---------------------------------------------------------------------------------
@replayable
def triton_quant_experts(
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
    scheme: str | QuantScheme,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    tiles: tuple[TileConfig, TileConfig] | None = None,
    out: torch.Tensor | None = None,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    direct: bool | None = None,
    batch_invariant: bool = False,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H] = sum_k w * (w2q[e] @ fq(act(w13q[e] @ fq(x) + b13[e])) + b2[e]) on 8-bit GEMMs.

    w13q / w2q: the fp8 / int8 payloads times their scales; fq: the scheme's activation
    quantization (module docstring). Weight-only schemes (fq = identity) run
    `weight_only.triton_weight_only_experts`, with NVFP4's global scales (and its direct decode
    path, `direct`) and asymmetric int4's zero points (w13_zero / w2_zero). `out` may be x itself. direct: as `experts.triton_experts` (channel, token
    and block scales; per-tensor scales are per expert over its aligned rows, so it aligns):
    x quantized per token, GEMM1 by slot, the intermediate quantized per slot, GEMM2 with the
    top-k sum. Eager calls of a signature seen twice replay the recorded launches
    (`replay.replayable`). batch_invariant: weight-only schemes only (`experts.triton_experts`);
    the W8A8 paths pick x's quantization launch and GEMM2's kernel by the token count.
    """
    scheme = _triton_scheme(scheme)
    _check_batch_invariance(scheme, batch_invariant)
    if scheme.weight_only and (a13_scale is not None or a2_scale is not None):
        raise ValueError(f"{scheme.name} is weight-only: a13_scale / a2_scale must be None")
    # payloads and scales against the scheme (metadata): here rather than in apply_quant, so a
    # replay, whose signature fixes every input of the check, skips it
    check_quant_tensors(w13, w2, scheme, w13_scale, w2_scale, a13_scale, a2_scale, w13_global_scale,
                        w2_global_scale, x_TH.shape[1], w13.shape[1], gated=is_gated(activation),
                        w13_zero=w13_zero, w2_zero=w2_zero)
    if scheme.weight_only:
        from fusedmoe.backends.triton.weight_only import triton_weight_only_experts

        return triton_weight_only_experts(
            x_TH, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, expert_map,
            num_global_experts, activation, apply_router_weight_on_input, swiglu_alpha,
            swiglu_limit, scheme, w13_scale, w2_scale, w13_global_scale, w2_global_scale,
            tiles=tiles, out=out, direct=direct, batch_invariant=batch_invariant, w13_zero=w13_zero, w2_zero=w2_zero,
        )
    num_tokens, hidden = x_TH.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    out = torch.empty_like(x_TH) if out is None else out
    if num_tokens == 0:
        return out
    gated = is_gated(activation)
    problem = GemmProblem(topk_ids_TK.numel(), num_local, hidden, inter, topk_ids_TK.shape[1], gated, x_TH.dtype)
    is_direct, t1, t2 = plan_tiles(problem, scheme, x_TH.device, tiles, direct)  # given tiles: checked
    if is_direct:
        q = prepare_direct_quant_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                                        num_local, inter, activation, apply_router_weight_on_input,
                                        swiglu_alpha, swiglu_limit, scheme)
        launch_quant_gemm1(q, w13, w13_bias, w13_scale, t1, a2_scale)
        launch_quant_gemm2(q, w2, w2_bias, w2_scale, t2, out=out)
        return out
    q = prepare_quant_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                             num_local, inter, activation, apply_router_weight_on_input, swiglu_alpha,
                             swiglu_limit, scheme, a13_scale, t1.block_m)
    launch_quant_gemm1(q, w13, w13_bias, w13_scale, t1, a2_scale)
    launch_quant_gemm2(q, w2, w2_bias, w2_scale, t2)
    launch_reduce(q.L, out)
    return out


@dataclass
class QuantLaunch:
    """A W8A8 call between its stages: the shared Launch (intermediate `a` in the activation dtype), x quantized,
    and (after GEMM1) the intermediate's codes and scales for GEMM2."""

    L: Launch
    scheme: QuantScheme
    num_local: int
    x_in: torch.Tensor  # codes per token, or (tensor) per aligned row; x itself when x_fused
    x_scales: torch.Tensor | None  # per token / group, or (tensor) per aligned row; None when x_fused
    a_amax: torch.Tensor | None = None  # (tensor, dynamic) [L]: filled by the kernel finishing a
    a_in: torch.Tensor | None = None
    a_scales: torch.Tensor | None = None
    fp8_promote: bool = False  # fp8_promoted(scheme), read once before the call's first launch
    swap_mode: bool | str | None = None  # FUSEDMOE_TRITON_SWAP_AB, read then too (swap_ab's mode)
    rows_mode: bool | str | None = None  # FUSEDMOE_TRITON_GEMM2_ROWS, read then too (gemm2_rows' mode)

    @property
    def x_fused(self) -> bool:
        """The direct GEMM1 quantizes x itself (kernels.py FUSE_XQ): no codes were made for it."""
        return self.x_scales is None

    @property
    def a_fused(self) -> bool:
        """(After GEMM1) the direct GEMM2 quantizes a itself (kernels.py FUSE_AQ in
        moe_gemm2_direct_kernel): a_in is a, no codes were made for it."""
        return self.a_in is not None and self.a_scales is None


def prepare_quant_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                         num_local, inter, activation, apply_router_weight_on_input, swiglu_alpha,
                         swiglu_limit, scheme: QuantScheme, a13_scale, block_m) -> QuantLaunch:
    """Align the slots and quantize x: per token / group, or (tensor) one scale per expert."""
    call_knobs = _call_knobs(scheme)  # before any launch: a bad knob raises here
    device = x_TH.device
    sorted_slot, block_expert, num_rows, slot_ok = align(topk_ids_TK, expert_map, num_global_experts,
                                                         num_local, block_m)
    weights_N = topk_weights_TK.reshape(-1)
    if not weights_N.is_contiguous():
        weights_N = weights_N.contiguous()
    n_slots, rows = topk_ids_TK.numel(), sorted_slot.numel()
    y = torch.empty(n_slots, x_TH.shape[1], dtype=x_TH.dtype, device=device)
    a = torch.empty(rows, inter, dtype=x_TH.dtype, device=device)
    L = Launch(x_TH, weights_N, sorted_slot, block_expert, num_rows, slot_ok, a, y,
               topk_ids_TK.shape[1], activation, False, not apply_router_weight_on_input,
               swiglu_alpha, swiglu_limit, block_m)
    row_w = weights_N if apply_router_weight_on_input else None  # K == 1: slot == token
    return _quantize_input(L, scheme, a13_scale, row_w, num_local, call_knobs)


def prepare_direct_quant_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                                num_local, inter, activation, apply_router_weight_on_input, swiglu_alpha,
                                swiglu_limit, scheme: QuantScheme) -> QuantLaunch:
    """The direct decode path's launch (no alignment, a [T*K, I] by slot in the activation dtype) with x quantized
    per token / group (router weight on input applied first: top_k 1, slot == token)."""
    call_knobs = _call_knobs(scheme)  # before any launch, as prepare_quant_launch
    L = prepare_direct_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts, num_local,
                              inter, activation, apply_router_weight_on_input, swiglu_alpha, swiglu_limit,
                              a_dtype=x_TH.dtype, prescaled=True)
    if fuse_x_quantization(scheme.activation, x_TH.shape[1], inter, is_gated(activation), topk_ids_TK.numel(),
                           num_local):
        return QuantLaunch(L, scheme, num_local, x_TH, None, **call_knobs)
    row_w = L.weights_N if apply_router_weight_on_input else None
    x_in, x_scales = quantize_activation(x_TH, scheme.activation, row_weight_M=row_w)
    return QuantLaunch(L, scheme, num_local, x_in, x_scales, **call_knobs)


def _call_knobs(scheme: QuantScheme) -> dict:
    """The knobs a W8A8 call's launches follow, read (and so checked) once, before its first
    launch: QuantLaunch's fp8_promote (FUSEDMOE_FP8_ACCUMULATE), swap_mode
    (FUSEDMOE_TRITON_SWAP_AB) and rows_mode (FUSEDMOE_TRITON_GEMM2_ROWS)."""
    from fusedmoe import knobs

    return dict(fp8_promote=fp8_promoted(scheme), swap_mode=knobs.get("TRITON_SWAP_AB"),
                rows_mode=knobs.get("TRITON_GEMM2_ROWS"))


def fuse_x_quantization(key: QuantKey, hidden: int, inter: int, gated: bool, num_slots: int,
                        num_local: int) -> bool:
    """Whether the direct path's GEMM1 quantizes x itself (kernels.py FUSE_XQ) instead of a launch
    before it: dynamic per-token codes (int8 / fp8 W8A8 per channel) of rows up to FUSE_XQ_MAX_H
    wide (each program holds its token's row in registers once, for the amax), where GEMM1 reads
    at most FUSE_XQ_MAX_WEIGHTS weights (the w13 of min(slots, local experts) experts).

    H200, whole call, FUSE_XQ_MAX_H 0 against 8192, two alternating rounds
    (benchmarks/results/2026-11-24_h200_d924b36_fuse_xq.txt): int8 and fp8 per channel at M=1
    -6 to -18% on five of six presets (Llama-4 19.0 against 22.5 us), M=4 -3 to -8% or within 1%;
    int8 Mixtral M=1 +10%: its GEMM1 (117 MB of codes at M=1) compiles to 136 registers a thread
    fused, 108 not (the token row's codes made in registers and stored to shared memory instead of
    a cp.async stage), 3 programs per SM instead of 4, and the lost occupancy outweighs the saved
    launch; re-tuned fused, no tile was 3% faster. fp8 1x128 groups the same way (each K step's
    group scale picked from the row's): within 3% at M=1 but DeepSeek-V3 M=4 +11%, so those keep
    the quantization launch."""
    weights = min(num_slots, num_local) * (2 if gated else 1) * inter * hidden
    return key.dynamic and key.granularity == "token" and hidden <= FUSE_XQ_MAX_H and weights <= FUSE_XQ_MAX_WEIGHTS


def fp8_accumulation(scheme: QuantScheme) -> str | None:
    """How the W8A8 GEMMs of fp8 codes with per-tensor / per-channel weight scales accumulate
    over K: "chained" (one accumulator) or, under FUSEDMOE_FP8_ACCUMULATE=promoted, "promoted"
    (each K step's product added into fp32, kernels._dot FP8_PROMOTE); None for other schemes
    (block scales scale each step's product, so those always promote; int8 sums exactly in
    int32)."""
    from fusedmoe import knobs

    if scheme.weight.dtype != "fp8" or scheme.weight.granularity == "block":
        return None
    return knobs.get("FP8_ACCUMULATE") or "chained"


def fp8_promoted(scheme: QuantScheme) -> bool:
    """Whether the W8A8 GEMMs add each K step's fp8 product into the fp32 accumulator instead of
    chaining one accumulator across K (fp8_accumulation).

    Chained by default. H200, old (promoted) / new (chained), two alternating rounds, fp8
    per channel on the packaged tiles (benchmarks/results/2026-11-24_h200_7d03635_fp8_chain.txt):
    Mixtral M=1024 / 4096 -12 / -16%, gpt-oss and Qwen3-30B M=4096 -6%, M=64-1024 elsewhere
    within 2%; re-tuned chained, Mixtral M=4096 3779 -> 2703 us. The error against the exact
    reference on dequantized weights moves 4.63% -> 4.65% (Mixtral M=512, 4096) and DeepGEMM's
    global difference 1.07e-3 -> 1.08e-3; against emulation 0.45% -> 1.5% (0.27% -> 0.27% on
    gpt-oss)."""
    return fp8_accumulation(scheme) == "promoted"


def fuse_a_quantization(key: QuantKey, inter: int) -> bool:
    """Whether the direct path's GEMM2 quantizes the intermediate itself (kernels.py FUSE_AQ of
    moe_gemm2_direct_kernel) instead of a launch between the GEMMs: dynamic per-token codes of
    rows FUSE_AQ_MIN_I to FUSE_AQ_MAX_I wide (each program reads its share's slot rows once for
    their scales, then makes each K step's codes from the fp32 a tile).

    H200, whole call, the launch (FUSE_AQ_MAX_I 0) against fused, two alternating rounds
    (benchmarks/results/2026-11-24_h200_1fd3539_fuse_aq.txt): M=1 Qwen3-30B int8 25.4 -> 20.2 us,
    fp8 per channel 26.4 -> 22.5, Qwen3-235B -16 / -19%, Llama-4 -8 / -10%, gpt-oss -5%; M=4 -1 to
    -11% but Qwen3-235B int8 +5%; M=16 and Mixtral (I = 14336: the launch) unchanged.
    DeepSeek-V3 (I = 256, one K step per slot: the scale pre-pass is as long as the loop) ran +2
    to +10% at M=1-4, hence FUSE_AQ_MIN_I."""
    return key.dynamic and key.granularity == "token" and FUSE_AQ_MIN_I <= inter <= FUSE_AQ_MAX_I


_READ = object()  # swap_ab's mode: read FUSEDMOE_TRITON_SWAP_AB now


def swap_ab(tile: TileConfig, key: QuantKey, device: torch.device, *, direct: bool = False, mode=_READ) -> bool:
    """Whether the W8A8 GEMMs of `tile` run SWAP_AB (kernels.py) for activation codes `key` on
    `device`: FUSEDMOE_TRITON_SWAP_AB (`mode`: its value as a call read it, else read here) =0
    never, force always, else the tile's swap_ab where a tuned entry set it, else the aligned
    path's row blocks under 64 rows with N tiles of at least SWAP_AB_MIN_N on an sm90 GPU, for
    SWAP_AB_ACTIVATIONS."""
    from fusedmoe import knobs

    if mode is _READ:
        mode = knobs.get("TRITON_SWAP_AB")
    if mode is False or mode == "force":
        return mode == "force"
    if tile.swap_ab is not None:  # a tuned entry's choice
        return tile.swap_ab
    return (not direct and tile.block_m < 64 and tile.block_n >= SWAP_AB_MIN_N
            and (key.dtype, key.granularity) in SWAP_AB_ACTIVATIONS and _sm90_gpu(device))


GEMM2_ROWS_MIN_SLOTS = 4096  # measured at 8192 and 32768 (DeepSeek-V3 M=1024 / 4096)


def gemm2_rows(key: QuantKey, inter: int, block_m: int, num_slots: int, device: torch.device, *,
               direct: bool = False, batched: bool = False, swapped: bool = False, promoted: bool = False,
               mode=_READ) -> bool:
    """Whether the aligned W8A8 GEMM2 runs as row-stationary programs
    (kernels.moe_gemm2_rows_kernel, experts.GEMM2_ROWS_CONFIG): int8 per-token codes with
    I <= GEMM2_ROWS_MAX_I (exact int32 sums: y is the tiled kernel's bit for bit), fp8 per-token or
    per-tensor codes with I <= GEMM2_ROWS_MAX_I and the chained accumulator (not `promoted`: the
    whole-K dot is the tiled kernel's chain of K steps), or fp8 1x128 group codes with I in (128,
    GEMM2_ROWS_MAX_I] (two or three groups: the sums of the tiled kernel's 128-deep K steps); I past
    256 as a head and a tail tile (experts.gemm2_rows_split); not swapped;
    FUSEDMOE_TRITON_GEMM2_ROWS (`mode`: its value as a call read it) =0 never, force wherever that
    holds, else the contiguous layout's 64+ row blocks over GEMM2_ROWS_MIN_SLOTS+ slots on sm90."""
    from fusedmoe import knobs

    if mode is _READ:
        mode = knobs.get("TRITON_GEMM2_ROWS")
    if key.granularity == "group":  # fp8 1x128 groups: the kernel splits the codes in two or three
        codes_fit = key.group == 128 and 128 < inter <= GEMM2_ROWS_MAX_I
    else:  # a scale per row: int8 per token, fp8 per token / tensor with one chained accumulator
        codes_fit = inter <= GEMM2_ROWS_MAX_I and (key.dtype == "int8" or not promoted)
    if mode is False or direct or swapped or not codes_fit:
        return False
    return mode == "force" or (not batched and block_m >= 64 and num_slots >= GEMM2_ROWS_MIN_SLOTS
                               and _sm90_gpu(device))


def _swap_launch(tile: TileConfig, key: QuantKey, q: QuantLaunch) -> tuple[TileConfig, dict]:
    """(the tile to launch, the SWAP_AB keyword): swapped, one pipeline stage fewer (at least 2).
    A swapped GEMM's wgmma pipeline keeps num_stages operand buffers in shared memory where the
    HMMA loop keeps num_stages - 1 (sm90 compile: DeepSeek-V3 fp8 channel GEMM2 16x128x256 in 4
    stages 111616 -> 148480 B, 2 -> 1 program per SM), so the tile's stages keep their footprint."""
    if not swap_ab(tile, key, q.L.a.device, direct=q.L.direct, mode=q.swap_mode):
        return tile, dict(SWAP_AB=False)
    return dataclasses.replace(tile, num_stages=max(2, tile.num_stages - 1)), dict(SWAP_AB=True)


def _sm90_gpu(device: torch.device) -> bool:
    """An NVIDIA sm90 (Hopper) GPU: wgmma, the unit SWAP_AB is for (benchmarks/kernel_report.py
    stands in for one with CPU tensors)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9


def _quantize_input(L: Launch, scheme: QuantScheme, a13_scale, row_w, num_local: int,
                    call_knobs: dict, batched: bool = False) -> QuantLaunch:
    """x's codes per token / group, or (tensor) per aligned row with its expert's scale.
    Shared by the contiguous and batched layouts (L.x: the tokens, or the batched rows; batched,
    only the live buffer rows, which the aligned rows list, are quantized)."""
    x_TH, a_amax = L.x, None
    if scheme.weight.granularity == "tensor" and a13_scale is not None:
        x_in, x_scales = _quantize_expert_rows(L, x_TH, _per_expert(a13_scale, num_local), True, row_w, gather=True)
    elif scheme.weight.granularity == "tensor":
        amax = torch.zeros(2, num_local, dtype=torch.float32, device=x_TH.device)  # x's and a's: one memset
        _expert_amax(L, x_TH, row_w, amax[0], gather=True)
        x_in, x_scales = _quantize_expert_rows(L, x_TH, amax[0], False, row_w, gather=True)
        a_amax = amax[1]
    else:
        live = (L.sorted_slot, L.num_rows) if batched else None
        x_in, x_scales = quantize_activation(x_TH, scheme.activation, row_weight_M=row_w, live_rows=live)
    return QuantLaunch(L, scheme, num_local, x_in, x_scales, a_amax=a_amax, **call_knobs)


def launch_quant_gemm1(q: QuantLaunch, w13, w13_bias, w13_scale, tile: TileConfig, a2_scale=None) -> None:
    """GEMM1 (-> fp32 a, or the 1x128 codes directly), then the intermediate's quantization:
    the same as x's, per aligned row (padding rows are harmless)."""

    L, gran, akey = q.L, q.scheme.weight.granularity, q.scheme.activation
    a, device = L.a, L.a.device
    rows, inter = a.shape
    tensor = gran == "tensor"
    x_scales = q.x_in if q.x_fused else q.x_scales  # never read when fused
    xs_strides = (x_scales.stride(0), 0 if tensor else x_scales.stride(1))
    fuse = gran == "block" and tile.block_n == ACT_GROUP and tile.split_k == 1
    later = L.direct and fuse_a_quantization(akey, inter)  # the direct GEMM2 quantizes a itself
    a_codes = a_scales = None
    if not tensor and not later:
        a_codes = torch.empty(rows, inter, dtype=_CODE_DTYPE[akey.dtype], device=device)
        groups = triton_cdiv(inter, ACT_GROUP) if gran == "block" else 1
        a_scales = torch.empty(rows, groups, dtype=torch.float32, device=device)
    tile, swap = _swap_launch(tile, akey, q)
    fused = dict(aq_ptr=a_codes, as_ptr=a_scales, stride_aqr=a_codes.stride(0), stride_aqi=a_codes.stride(1),
                 stride_asr=a_scales.stride(0), stride_asg=a_scales.stride(1)) if fuse else {}
    xq = dict(FUSE_XQ=True, XQ_WIDTH=triton_next_pow2(q.x_in.shape[1]),
              XQ_ROW_W=not L.scale_output) if q.x_fused else {}  # router weight on input: w * x
    launch_gemm1(L, w13, w13_bias, tile, dict(
        xs_ptr=x_scales, ws_ptr=w13_scale, stride_xs0=xs_strides[0], stride_xs1=xs_strides[1],
        **_weight_scale_strides(w13_scale, gran), QUANT=W8A8_QUANT_CODES[gran], X_SORTED=tensor,
        ACC_INT=q.scheme.weight.dtype == "int8", SOFT_FP8=_soft_fp8(device), FUSE_AQ=fuse, **fused,
        UP_UNIFORM=gran == "block" and inter % tile.block_n == 0,  # the up rows' tiles in one scale block
        FP8_PROMOTE=q.fp8_promote, **swap, **xq,
        **(dict(amax_ptr=q.a_amax, A_AMAX=True) if q.a_amax is not None and a2_scale is None else {}),
    ), x=q.x_in)
    if tensor:  # static: a2's scale (checked with a13's before any launch); dynamic: GEMM1's amax
        static = a2_scale is not None
        scale = _per_expert(a2_scale, q.num_local) if static else q.a_amax
        q.a_in, q.a_scales = _quantize_expert_rows(L, a, scale, static, None, gather=False)
        return
    if later:
        q.a_in, q.a_scales = a, None
        return
    if not fuse:
        group = inter if gran == "channel" else ACT_GROUP
        _launch_rows(a, a_codes, a_scales, None, group, akey, num_rows=L.num_rows)
    q.a_in, q.a_scales = a_codes, a_scales


def launch_quant_gemm2(q: QuantLaunch, w2, w2_bias, w2_scale, tile: TileConfig,
                       out: torch.Tensor | None = None, *, batched: bool = False) -> None:
    """GEMM2 on the intermediate's codes: per aligned row into y (row-stationary where
    `gemm2_rows` says), or (out given: the direct path) with the routed weight and the top-k sum
    into out."""
    gran = q.scheme.weight.granularity
    tile, swap = _swap_launch(tile, q.scheme.activation, q)
    if out is None and not q.a_fused and gemm2_rows(q.scheme.activation, q.a_in.shape[1], q.L.block_m, q.L.num_slots,
                                                    q.a_in.device, direct=q.L.direct, batched=batched,
                                                    swapped=swap["SWAP_AB"], promoted=q.fp8_promote,
                                                    mode=q.rows_mode):
        launch_gemm2_rows(q.L, w2, w2_bias, q.a_in, q.a_scales, w2_scale, W8A8_QUANT_CODES[gran],
                          _weight_scale_strides(w2_scale, gran))
        return
    args = dict(ws_ptr=w2_scale, **_weight_scale_strides(w2_scale, gran), QUANT=W8A8_QUANT_CODES[gran],
                FP8_PROMOTE=q.fp8_promote, **swap)
    if q.a_fused:  # the direct GEMM2 quantizes GEMM1's a itself (kernels.py FUSE_AQ)
        args.update(FUSE_AQ=True, AQ_WIDTH=triton_next_pow2(q.a_in.shape[1]),
                    AQ_INT=q.scheme.activation.dtype == "int8", SOFT_FP8=_soft_fp8(q.a_in.device))
    else:
        args.update(as_ptr=q.a_scales, stride_as0=q.a_scales.stride(0),
                    stride_as1=0 if gran == "tensor" else q.a_scales.stride(1))
    if out is not None:
        launch_gemm2_direct(q.L, w2, w2_bias, tile, out, args, a=q.a_in)
        return
    launch_gemm2(q.L, w2, w2_bias, tile, dict(args, ACC_INT=q.scheme.weight.dtype == "int8"), a=q.a_in)


@replayable
def triton_batched_quant_experts(
    x_LMH: torch.Tensor,
    num_tokens_L: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    scheme: str | QuantScheme,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    tiles: tuple[TileConfig, TileConfig] | None = None,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    num_slots: int = 0,
    top_k: int = 1,
    batch_invariant: bool = False,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[e, j] = w2q[e] @ fq(act(w13q[e] @ fq(x[e, j]) + b13[e])) + b2[e] for j < num_tokens[e],
    zero past the count. Weight-only schemes (fq = identity) run
    `weight_only.triton_batched_weight_only_experts`, with NVFP4's global scales (batch_invariant:
    weight-only schemes only, as `triton_quant_experts`).

    The contiguous path's stages on the batched rows (experts.prepare_batched_launch), so fq is
    the same: a dynamic per-tensor scale is the amax of expert e's first num_tokens[e] rows (the
    tokens routed to it, as `emulation` computes it per expert); rows past the count are never
    read by the amax, the GEMMs or the per-row quantization's consumers. Eager calls of a
    signature seen twice replay the recorded launches (`replay.replayable`), skipping the checks
    as `triton_quant_experts` does.
    """
    from fusedmoe.backends.triton.experts import run_batched

    scheme = _triton_scheme(scheme)
    _check_batch_invariance(scheme, batch_invariant)
    if scheme.weight_only and (a13_scale is not None or a2_scale is not None):
        raise ValueError(f"{scheme.name} is weight-only: a13_scale / a2_scale must be None")
    check_quant_tensors(w13, w2, scheme, w13_scale, w2_scale, a13_scale, a2_scale, w13_global_scale,
                        w2_global_scale, x_LMH.shape[-1], w13.shape[1], gated=is_gated(activation),
                        w13_zero=w13_zero, w2_zero=w2_zero)
    if scheme.weight_only:
        from fusedmoe.backends.triton.weight_only import triton_batched_weight_only_experts

        return triton_batched_weight_only_experts(
            x_LMH, num_tokens_L, w13, w2, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit,
            scheme, w13_scale, w2_scale, w13_global_scale, w2_global_scale, tiles=tiles,
            num_slots=num_slots, top_k=top_k, batch_invariant=batch_invariant, w13_zero=w13_zero, w2_zero=w2_zero,
        )
    check_activation_scales(scheme, a13_scale, a2_scale, w13.shape[0], w13.device)
    num_local = x_LMH.shape[0]
    call_knobs = _call_knobs(scheme)  # before any launch, as prepare_quant_launch

    def choose(problem):
        t1, t2 = tiles if tiles is not None else choose_quant_tiles(problem, scheme, x_LMH.device)
        _check_tiles(t1, t2, problem.gated, scheme.weight.granularity, x_LMH.dtype)
        return t1, t2

    def gemms(L, t1, t2):
        q = _quantize_input(L, scheme, a13_scale, None, num_local, call_knobs, batched=True)
        launch_quant_gemm1(q, w13, w13_bias, w13_scale, t1, a2_scale)
        launch_quant_gemm2(q, w2, w2_bias, w2_scale, t2, batched=True)

    return run_batched(x_LMH, num_tokens_L, w2.shape[2], activation, swiglu_alpha, swiglu_limit, choose, gemms,
                       num_slots=num_slots, top_k=top_k)


def _check_batch_invariance(scheme: QuantScheme, batch_invariant: bool) -> None:
    if batch_invariant and not scheme.weight_only:
        from fusedmoe.backends.table import W8A8_NOT_BATCH_INVARIANT

        raise ValueError(f"batch_invariant: the triton backend's {scheme.name} path is not batch-invariant "
                         f"({W8A8_NOT_BATCH_INVARIANT})")


def _triton_scheme(scheme: str | QuantScheme) -> QuantScheme:
    from fusedmoe.backends.triton.weight_only import WEIGHT_ONLY_SCHEMES

    resolved = get_scheme(scheme)
    if resolved is None or resolved.name not in W8A8_SCHEMES | WEIGHT_ONLY_SCHEMES:
        raise NotImplementedError(
            f"the triton backend runs the W8A8 schemes {sorted(W8A8_SCHEMES)} and the weight-only "
            f"schemes {sorted(WEIGHT_ONLY_SCHEMES)}, not {getattr(resolved, 'name', resolved)}"
        )
    return resolved


def _per_expert(scale: torch.Tensor, num_local: int) -> torch.Tensor:
    """A static activation scale ([], [1] or [L]) as a 1-D tensor the kernels index by expert
    (stride 0 when shared)."""
    flat = scale.reshape(-1)
    return flat.expand(num_local) if flat.numel() == 1 else flat


def _expert_amax(L: Launch, x: torch.Tensor, row_w: torch.Tensor | None, amax: torch.Tensor, *,
                 gather: bool) -> None:
    """amax [L] (zeros in) = the max over each local expert's rows of |x| (tokens when gather,
    else aligned rows)."""
    from fusedmoe.backends.triton import quant_kernels

    blocks = L.sorted_slot.numel() // L.block_m
    launch(quant_kernels.expert_amax_kernel, (blocks,),
        x, amax, row_w if row_w is not None else amax, L.sorted_slot, L.block_expert, L.num_rows,
        L.y.shape[0], L.top_k, x.shape[1], x.stride(0), x.stride(1),
        GATHER=gather, HAS_ROW_W=row_w is not None, BLOCK_M=L.block_m,
        BLOCK_K=min(256 if L.block_m <= 32 else 64, triton_next_pow2(x.shape[1])), num_warps=4,
    )


def _quantize_expert_rows(L: Launch, x: torch.Tensor, scale: torch.Tensor, static: bool,
                          row_w: torch.Tensor | None, *, gather: bool):
    """Per-tensor fp8 codes [R, K] of x's rows in aligned order (tokens when gather, else the
    aligned rows themselves) and their scales [R, 1]: scale [L] is the experts' static scales,
    or (not static) their amax, the scale amax / 448. Scales per row let the GEMMs run the
    per-channel path."""
    from fusedmoe.backends.triton import quant_kernels

    rows, width = L.sorted_slot.numel(), x.shape[1]
    codes = torch.empty(rows, width, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block_k = min(max(16, 8192 // L.block_m), triton_next_pow2(width))  # ~8k elements a program
    launch(quant_kernels.quantize_expert_rows_kernel, (rows // L.block_m, triton_cdiv(width, block_k)),
        x, codes, scales, scale, row_w if row_w is not None else scale, L.sorted_slot, L.block_expert,
        L.num_rows, L.y.shape[0], L.top_k, width, scale.stride(0), x.stride(0), x.stride(1),
        codes.stride(0), codes.stride(1),
        GATHER=gather, HAS_ROW_W=row_w is not None, STATIC=static, SOFT_FP8=_soft_fp8(x.device),
        BLOCK_M=L.block_m, BLOCK_K=block_k, num_warps=4,
    )
    return codes, scales


def _weight_scale_strides(scale: torch.Tensor, granularity: str) -> dict:
    """The kernels' (expert, row, column) strides of weight scales [L], [L, N] or [L, N/128, K/128]."""
    strides = tuple(scale.stride()) + (0,) * (3 - scale.dim())
    if granularity == "tensor":
        strides = (strides[0], 0, 0)
    return dict(zip(("stride_ws0", "stride_ws1", "stride_ws2"), strides, strict=True))


# Custom ops (torch.compile(fullgraph=True), CUDA graphs) -------------------------------------
def _triton_quant_experts_op_impl(
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
    scheme: str,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    return triton_quant_experts(
        x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, num_global_experts,
        activation, apply_router_weight_on_input, swiglu_alpha, swiglu_limit, scheme, w13_scale,
        w2_scale, a13_scale, a2_scale, out=out, w13_global_scale=w13_global_scale,
        w2_global_scale=w2_global_scale, batch_invariant=batch_invariant, w13_zero=w13_zero, w2_zero=w2_zero,
    )


# Custom ops (torch.compile(fullgraph=True), CUDA graphs): fusedmoe::triton_quant_experts(_out)
triton_quant_experts_op, triton_quant_experts_out_op = experts_ops("triton_quant_experts",
                                                                   _triton_quant_experts_op_impl)


def apply_quant(config, x_TH, weights, topk_weights_TK, topk_ids_TK, expert_map_E, out_TH,
                batch_invariant: bool = False):
    """`TritonExperts.apply` for quantized weights: the scheme checked, then the custom op (whose
    body, `triton_quant_experts`, checks the tensors against it)."""
    quant: QuantParams = weights.quant
    scheme = _triton_scheme(quant.scheme)
    if config.quant is not None and scheme != config.quant:
        raise ValueError(f"weights.quant has scheme {scheme.name} but the config says {config.quant.name}")
    if torch.compiler.is_compiling():  # eager calls check in triton_quant_experts (replays skip it)
        from fusedmoe.quant.weights import check_quant_weights

        check_quant_weights(weights.w13, weights.w2, quant, x_TH.shape[1], weights.w13.shape[1], gated=config.gated)
    args = (x_TH, weights.w13, weights.w2, topk_weights_TK, topk_ids_TK, weights.w13_bias,
            weights.w2_bias, expert_map_E, config.num_experts, config.activation,
            config.apply_router_weight_on_input, config.swiglu_alpha, config.swiglu_limit,
            scheme.name, quant.w13_scale, quant.w2_scale, quant.a13_scale, quant.a2_scale)
    keywords = dict(w13_global_scale=quant.w13_global_scale, w2_global_scale=quant.w2_global_scale,
                    batch_invariant=batch_invariant, w13_zero=quant.w13_zero, w2_zero=quant.w2_zero)
    if out_TH is not None:
        call_op(triton_quant_experts_out_op, _triton_quant_experts_op_impl, *args, **keywords, out=out_TH)
        return out_TH
    return call_op(triton_quant_experts_op, _triton_quant_experts_op_impl, *args, **keywords)


def _triton_batched_quant_experts_op_impl(
    x: torch.Tensor,
    num_tokens: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    scheme: str,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    num_slots: int = 0,
    top_k: int = 1,
    batch_invariant: bool = False,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    return triton_batched_quant_experts(
        x, num_tokens, w13, w2, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, scheme,
        w13_scale, w2_scale, a13_scale, a2_scale, w13_global_scale=w13_global_scale,
        w2_global_scale=w2_global_scale, num_slots=num_slots, top_k=top_k, batch_invariant=batch_invariant,
        w13_zero=w13_zero, w2_zero=w2_zero,
    ).contiguous()


# Custom op (torch.compile(fullgraph=True), CUDA graphs); plain eager calls run the impl (call_op).
triton_batched_quant_experts_op = torch.library.custom_op(
    "fusedmoe::triton_batched_quant_experts", _triton_batched_quant_experts_op_impl, mutates_args=())


@triton_batched_quant_experts_op.register_fake
def _(x, num_tokens, w13, w2, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, scheme,
      w13_scale, w2_scale, a13_scale, a2_scale, w13_global_scale=None, w2_global_scale=None, num_slots=0, top_k=1,
      batch_invariant=False, w13_zero=None, w2_zero=None):
    return torch.empty_like(x)


def apply_batched_quant(config, x_LMH, num_tokens_L, weights, num_slots: int = 0, top_k: int = 1,
                        batch_invariant: bool = False):
    """`BatchedTritonExperts.apply_batched` for quantized weights: the scheme checked, then the
    custom op (whose body, `triton_batched_quant_experts`, checks the tensors against it)."""
    quant: QuantParams = weights.quant
    scheme = _triton_scheme(quant.scheme)
    if config.quant is not None and scheme != config.quant:
        raise ValueError(f"weights.quant has scheme {scheme.name} but the config says {config.quant.name}")
    if torch.compiler.is_compiling():  # eager calls check in triton_batched_quant_experts (replays skip it)
        from fusedmoe.quant.weights import check_quant_weights

        check_quant_weights(weights.w13, weights.w2, quant, x_LMH.shape[-1], weights.w13.shape[1], gated=config.gated)
    return call_op(
        triton_batched_quant_experts_op, _triton_batched_quant_experts_op_impl,
        x_LMH, num_tokens_L, weights.w13, weights.w2, weights.w13_bias, weights.w2_bias,
        config.activation, config.swiglu_alpha, config.swiglu_limit, scheme.name, quant.w13_scale,
        quant.w2_scale, quant.a13_scale, quant.a2_scale, quant.w13_global_scale, quant.w2_global_scale,
        num_slots, top_k, batch_invariant, quant.w13_zero, quant.w2_zero,
    )
