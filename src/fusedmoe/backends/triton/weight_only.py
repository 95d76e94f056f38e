"""Host side of the `triton` backend's weight-only schemes: activations stay bf16 / fp16 / fp32.

    align -> gemm1 (dequantize w13 in registers, dot) -> gemm2 (the same for w2) -> reduce
    (decode: gemm1 by slot -> gemm2 with the top-k sum, no alignment: experts.choose_plan)
The payloads are read in their storage layout (`fusedmoe.quant.params`: fp8 / int8 [L, N, K],
4-bit codes uint8 [L, N, K / 2], low nibble = even k), once per (row block, N tile); int4's
and nvfp4's group scales are re-laid group-major by `process_weights` (`kernel_scale_layout`;
any strides run, that one fastest), and the 4-bit formats' codes and scales into wgmma fragment
order where the shapes allow (`fusedmoe.quant.fragments`; `_w4_fragments`), which runs faster
still. Nothing
dequantized is written to memory, so a decode step reads the quantized bytes only. The kernels
are the unquantized ones with QUANT = Q_W8 (per-channel scales on the accumulator) or Q_W4
(group scales per element inside the K loop, nvfp4's global scale on the accumulator): see
kernels.py. The intermediate is stored in the activation dtype, as the unquantized path does.
Results match the `emulation` backend (dequantize, then the reference) up to the rounding of the
dequantized weights to the activation dtype (exact for 8-bit codes and e2m1 * e8m0; 2^-9
relative in bf16 for scaled int4 / nvfp4) and the summation order.
Legend: T tokens, H hidden, I intermediate, G = 2I (gated) or I, L local experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fusedmoe.activations import is_gated
from fusedmoe.backends.triton.experts import (
    GemmProblem,
    _num_sms,
    launch_gemm1,
    launch_gemm2,
    launch_gemm2_direct,
    launch_reduce,
    memoized_tiles,
    plan_tiles,
    prepare_direct_launch,
    prepare_launch,
    run_batched,
)
from fusedmoe.backends.triton.tiles import (
    W4_FRAG_FORMATS,
    TileConfig,
    heuristic,
    require_plan,
    tile_mode,
)
from fusedmoe.modular import ExpertWeights
from fusedmoe.quant.fragments import (
    SCALE_LINE,
    fragments_reason,
    is_fragments,
    to_fragments,
    whole_fragments,
)
from fusedmoe.quant.params import LAID_AS_SCALES
from fusedmoe.quant.scheme import QuantScheme
from fusedmoe.validation import should_validate

WEIGHT_ONLY_SCHEMES = frozenset((
    "fp8_w8a16", "int8_w8a16", "int4_w4a16_g32", "int4_w4a16_g64", "int4_w4a16_g128",
    "int4_w4a16_g32_zp", "int4_w4a16_g64_zp", "int4_w4a16_g128_zp", "mxfp4_w4a16", "nvfp4_w4a16",
))
# Q_W4 weight formats: keep in sync with kernels.W4_*.
W4_FORMATS = {"int4": 0, "mxfp4": 1, "nvfp4": 2}
Q_W8, Q_W4 = 4, 5  # kernels.Q_W8 / Q_W4


# Weight formats whose group scales `prepare_weights` stores group-major (`kernel_scale_layout`).
# Measured on an H200, one process, the same scales either way: int4 g32 9-23% faster from M=1
# to 256 on six presets (benchmarks/results/2026-11-23_h200_f1f2acb_scale_layout.txt), nvfp4
# 9-30% at M=1-4096 on three (`_545f54a_scale_layout_bytes.txt`); mxfp4's e8m0 codes measured
# -21% to +19%, mostly slower, and stay row-major.
GROUP_MAJOR_SCALES = ("int4", "nvfp4")


def kernel_scale_layout(scale: torch.Tensor) -> torch.Tensor:
    """Group scales [L, N, K / group] stored group-major: the same values and shape, strides
    (N * K / group, 1, N), so a K step's scales are one contiguous run of N per group that the
    kernels load in wide vectors and pipeline with the weights. Row-major, a step's scales are
    a few bytes per column, loaded apart and waited on in every K step (ncu: ~45% of the gpt-oss
    int4 GEMM1's stall samples). The kernels run any strides; this one is fastest for the
    `GROUP_MAJOR_SCALES` formats. A per-tensor or per-channel scale (last dim 1) and one already
    group-major come back as they are.
    """
    if scale.dim() != 3 or scale.shape[2] == 1 or scale.stride(1) == 1:
        return scale
    return scale.transpose(1, 2).contiguous().transpose(1, 2)


def check_fp8_codes(w: torch.Tensor, name: str) -> None:
    """Refuse e4m3 NaN codes (0x7F, 0xFF) in fp8 weights: the kernels' inline-PTX decode
    (kernels.W8_PTX_E4M3) has no NaN and would read them as +-480. Reads every code, one
    device-to-host sync: at load time (`prepare_weights`) and in calls with validation on."""
    if w.dtype != torch.float8_e4m3fn or w.numel() == 0:
        return
    codes = w.view(torch.uint8)
    nan = sum(((chunk & 0x7F) == 0x7F).sum() for chunk in codes.split(16))  # bounded temporaries
    if int(nan):
        raise ValueError(f"{name} holds {int(nan)} fp8 NaN codes (0x7F / 0xFF): the triton fp8 weight-only "
                         f"kernels decode finite codes only")


def _check_fragments(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                     fmt: str) -> None:
    """Fragment-layout 4-bit weights (`fusedmoe.quant.fragments`): the kernels address an expert's
    fragments as one contiguous run and its scales as row-block runs stride(1) apart
    (`kernels._w4_frag_tile`), so each expert's payload and each row block's scales must be
    contiguous inside (experts may be strided); nvfp4's scales are its multiplier codes
    (uint8, `fragments.nv_scale_codes`). Metadata only, no sync."""
    for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if not is_fragments(scale):
            continue
        if w.stride(2) != 1 or w.stride(1) != w.shape[2]:
            raise ValueError(f"{name} holds 4-bit fragments (its scale is {tuple(scale.shape)}) but has strides "
                             f"{tuple(w.stride())}: each expert's [N, K/2] bytes must be contiguous")
        if fmt == "nvfp4" and scale.dtype != torch.uint8:
            raise ValueError(f"{name}_scale holds nvfp4 fragment scales of dtype {scale.dtype}: the fragment layout "
                             f"stores multiplier codes (uint8, fusedmoe.quant.fragments.to_fragments)")
        if scale.stride()[2:] != (scale.shape[3], 1) or scale.stride(1) < scale.shape[2] * scale.shape[3]:
            raise ValueError(f"{name}_scale holds fragment scales with strides {tuple(scale.stride())}: "
                             f"each row block's {list(scale.shape[2:])} must be contiguous, the row blocks "
                             f"apart by at least {scale.shape[2] * scale.shape[3]} (a padded run, "
                             f"fragments.scale_run, is fine)")


def _validate_codes(scheme: QuantScheme, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """fp8 NaN codes, in calls with validation on (they need a sync); layers check at load."""
    if scheme.weight.dtype == "fp8" and x.is_cuda and should_validate(None, x):
        check_fp8_codes(w13, "w13")
        check_fp8_codes(w2, "w2")


def prepare_weights(weights: ExpertWeights) -> ExpertWeights:
    """`process_weights` of the Triton experts: 4-bit codes and scales in the fragment layout
    where they can be (`_w4_fragments`), else the `GROUP_MAJOR_SCALES` formats' group scales in
    `kernel_scale_layout`; fp8 weight-only payloads checked for NaN codes (`check_fp8_codes`);
    everything else (8-bit payloads and scales, the unquantized weights) is read as stored."""
    q = weights.quant
    if q is not None and q.scheme.weight_only and q.scheme.weight.dtype == "fp8":
        check_fp8_codes(weights.w13, "w13")
        check_fp8_codes(weights.w2, "w2")
    if q is not None and q.scheme.weight.dtype in W4_FRAG_FORMATS:
        laid = _w4_fragments(weights)
        if laid is not weights or is_fragments(q.w13_scale):
            return laid
    if q is None or q.scheme.weight.dtype not in GROUP_MAJOR_SCALES:
        return weights
    laid = {name: kernel_scale_layout(getattr(q, name)) for name in LAID_AS_SCALES
            if getattr(q, name) is not None}  # zero points laid as their scales (the kernels share the strides)
    if all(t is getattr(q, name) for name, t in laid.items()):
        return weights
    return weights.replace(quant=dataclasses.replace(q, **laid))


# 4-bit formats process_weights lays as fragments by default (FUSEDMOE_TRITON_W4_FRAGMENTS unset
# or 1; "all" adds int4 at every shape, as the default now does: below). H200, fusedmoe bench,
# each layout with plans tuned for it: mxfp4 level to 1.9x faster at every M
# (results/2026-11-27_h200_fragments_ab.txt, then tuned entries); nvfp4 level to 1.5x faster at
# M >= 16, 0.77-1.09x at M = 1.
DEFAULT_FRAGMENT_FORMATS = ("mxfp4", "nvfp4")
# int4 by group and shape: the smallest per-GPU intermediate size at which each group is laid as
# fragments by default (a group not named keeps the checkpoint layout). The checkpoint layout
# (group-major scales, mma.sync at 16-row blocks) won at decode at small I until the fragment
# decode's scales were loaded once a row group; how far each reached followed the group and I.
# H200, fusedmoe bench (checkpoint time / fragments time):
#   g32, each layout with its own plans, nine presets, M = 1-4096
#   (results/2026-11-29_h200_69f18ef_check_int4_layout_fuzz.txt, 2026-11-29_h200_8372f17_layouts_invariance.txt):
#     I >= 2048 (Mixtral 14336, gpt-oss-120b and -20b 2880): M=1 0.86-0.91, M=16 0.91-1.04,
#       M=64 0.98-1.01, M=256 0.99-1.12 (Mixtral 733-803 -> 652-656 us, bf16 703-738), M=1024
#       1.03-1.52, M=4096 1.30-1.51; geometric mean over those six M 1.07-1.10;
#     I < 2048 (GLM-4.5-Air 1408, Qwen3-235B TP4 384, Llama-4 TP8 1024, Qwen3-30B 768, Kimi-K2 TP8
#       256, DeepSeek-V3 TP8 256): M <= 256 0.66-0.99, M >= 1024 0.83-1.31; geometric mean 0.82-0.99.
#   g64 and g128, each fragment dot waited for (kernels._rs_sync), M = 1, 16, 256, 1024, 4096, the
#   fragments checked by bench --check (reference + 8 runs bit for bit), tuned fragment entries at
#   Mixtral M=256 (results/2026-11-30_h200_09f8094_int4_g64_g128_fragments.txt sections 5, 6, 8):
#     g64: Mixtral 1.06-1.48 (M=256 916 -> 676-689 us, bf16 724-735), gpt-oss-120b 1.15-2.28;
#       Qwen3-30B 0.97-1.31, DeepSeek-V3 TP8 0.99-1.87, Qwen3-235B TP4 0.98-1.24 (slower only at
#       M <= 16, by <= 3%): laid as fragments at every I;
#     g128: Mixtral 1.11-1.47 (M=256 1070 -> 728-732 us, level with bf16); Qwen3-30B M <= 256
#       0.86-0.90, M >= 1024 1.26-1.28; DeepSeek-V3 TP8 0.92-1.60, Qwen3-235B TP4 0.93-1.23: g32's rule
#       (2048) until the sixty-sixth session.
#   Since the fragment decode loads each row group's scales once, as 32-bit words
#   (kernels._w4_group_values; results/2026-11-30_h200_4aecf95_w4_group_words.txt), fragments win at every
#   I measured, so every int4 group is laid as fragments at every size: g32 Qwen3-30B 1.03-1.27,
#   DeepSeek-V3 TP8 1.07-1.20; g128 Qwen3-30B 1.12-1.65, DeepSeek-V3 TP8 1.22-2.06 (M = 1, 16,
#   256, 1024, 4096); g64 was laid so already.
INT4_FRAGMENTS_MIN_INTER = {32: 0, 64: 0, 128: 0}


def scale_pad() -> int:
    """Bytes `to_fragments` pads a long scale run by now (FUSEDMOE_TRITON_W4_SCALE_PAD, default a line)."""
    from fusedmoe import knobs

    pad = knobs.get("TRITON_W4_SCALE_PAD")
    return SCALE_LINE if pad is None else pad


def lays_fragments(fmt: str, group: int | None, inter: int) -> bool:
    """Whether `process_weights` lays 4-bit weights of format `fmt` with scale `group` and a
    per-GPU intermediate size `inter` as fragments now (FUSEDMOE_TRITON_W4_FRAGMENTS): unset / 1
    mxfp4 and nvfp4, and int4 where inter >= INT4_FRAGMENTS_MIN_INTER[group] (a group not there: no);
    all every 4-bit format; 0 none. The shape must still be whole fragments (`_whole`)."""
    from fusedmoe import knobs

    mode = knobs.get("TRITON_W4_FRAGMENTS")
    if mode is False or fmt not in W4_FRAG_FORMATS:
        return False
    return (mode == "all" or fmt in DEFAULT_FRAGMENT_FORMATS
            or fmt == "int4" and inter >= INT4_FRAGMENTS_MIN_INTER.get(group, float("inf")))


def w4_fragments_planned(scheme: QuantScheme | None, hidden: int, inter: int, gated: bool = True) -> bool:
    """Whether `process_weights` will lay this scheme's weights of this shape as fragments
    (`_w4_fragments`), as far as the shape tells: `lays_fragments` (False for None and every
    other scheme; asymmetric int4 by symmetric int4's rule) and both
    weights whole fragments. The heuristic sizes its K steps by it; the scales' values (an mxfp4
    scale above 2) can still keep the checkpoint layout."""
    return (scheme is not None and lays_fragments(scheme.weight.dtype, scheme.weight.group, inter)
            and _whole(hidden, inter, gated))


def _whole(hidden: int, inter: int, gated: bool) -> bool:
    """Both weights of the shape made of whole fragments (w13 [2I or I, H], w2 [H, I])."""
    return whole_fragments(2 * inter if gated else inter, hidden) and whole_fragments(hidden, inter)


W4_LAYOUTS = ("fragments", "checkpoint")  # the two layouts of 4-bit weights (`fusedmoe.quant.fragments`)


def is_w4_scheme(scheme: QuantScheme | None) -> bool:
    """A 4-bit weight-only scheme (mxfp4, nvfp4, int4 W4A16): its weights have a layout."""
    return scheme is not None and scheme.weight_only and scheme.weight.dtype in W4_FRAG_FORMATS


def w4_layout(problem: GemmProblem, scheme: QuantScheme | None) -> str | None:
    """The layout of the problem's 4-bit weights, "fragments" or "checkpoint" (None: not a 4-bit
    weight-only scheme): `problem.fragments` where the caller holds the weights, else as
    `process_weights` would lay them now (`w4_fragments_planned`). Tiles are planned for it (the
    heuristic's K steps) and tuned entries serve only the layout they were timed on
    (`tuning`'s entries' "layout")."""
    if not is_w4_scheme(scheme):
        return None
    frag = problem.fragments
    if frag is None:
        frag = w4_fragments_planned(scheme, problem.hidden, problem.inter, problem.gated)
    return W4_LAYOUTS[0] if frag else W4_LAYOUTS[1]


def unnamed_entry_layout(scheme: QuantScheme, hidden: int, inter: int, gated: bool = True) -> str:
    """The layout a tuned entry that names none was timed on: tables before entries named their
    layout (8d334ef) were tuned with mxfp4 and nvfp4 as fragments where whole and int4 in the
    checkpoint layout, whatever int4's default is now (`tuning.entry_layout`)."""
    frag = scheme.weight.dtype in DEFAULT_FRAGMENT_FORMATS and _whole(hidden, inter, gated)
    return W4_LAYOUTS[0] if frag else W4_LAYOUTS[1]


def _w4_fragments(weights: ExpertWeights) -> ExpertWeights:
    """4-bit payloads and scales in the fragment layout (`fusedmoe.quant.fragments`) where the
    format and shape are laid so now (`lays_fragments`) and both weights allow it; else as given. H200, one
    grouped GEMM at 16 rows per expert (benchmarks/bench_w4_fragments.py,
    results/2026-11-27_h200_02ae7ec_w4_fragments*.txt): mxfp4 2.1-2.7 TB/s of 4-bit weights
    against 1.3-1.6 in the checkpoint layout (gpt-oss down 112 -> 57 us, Mixtral gate-up 157 ->
    94); nvfp4 and int4 g32 2.0-2.3 (`_cb3bb98_fragments_nvfp4_int4_proto.txt`)."""
    q = weights.quant
    fmt = q.scheme.weight.dtype
    if is_fragments(q.w13_scale) or is_fragments(q.w2_scale) \
            or not lays_fragments(fmt, q.scheme.weight.group, _inter(weights.w2, q.scheme)):
        return weights
    if fragments_reason(weights.w13, q.w13_scale, fmt) or fragments_reason(weights.w2, q.w2_scale, fmt):
        return weights
    pad = scale_pad()
    w13, s13 = to_fragments(weights.w13, q.w13_scale, fmt, pad)
    w2, s2 = to_fragments(weights.w2, q.w2_scale, fmt, pad)
    laid = dict(w13_scale=s13, w2_scale=s2)
    if q.w13_zero is not None:  # asymmetric int4: the zero points in the scales' runs (same dtype, same padding)
        laid.update(w13_zero=to_fragments(weights.w13, q.w13_zero, fmt, pad)[1],
                    w2_zero=to_fragments(weights.w2, q.w2_zero, fmt, pad)[1])
    return weights.replace(w13=w13, w2=w2, quant=dataclasses.replace(q, **laid))


def weight_only_mode(scheme: QuantScheme) -> tuple[str, int | None]:
    """(tile mode "w8" | "w4", scale group size or None) of a weight-only scheme."""
    return tile_mode(scheme)


@memoized_tiles
def choose_weight_only_tiles(problem: GemmProblem, scheme: QuantScheme,
                             device: torch.device) -> tuple[TileConfig, TileConfig]:
    """The tuned entry for this scheme, device and shape when one exists, else the heuristic
    with the weight-only constraints."""
    from fusedmoe.backends.triton.tuning import lookup

    tuned = lookup(problem, device, scheme)
    if tuned is not None:
        return tuned
    p, sms = problem, _num_sms(device)
    mode, group = weight_only_mode(scheme)
    frag = w4_layout(p, scheme) == "fragments"
    t1 = heuristic(p.num_slots, p.num_local_experts, p.inter, p.hidden, p.dtype, gated=p.gated,
                   num_sms=sms, quant=mode, group=group, fragments=frag)
    t2 = heuristic(p.num_slots, p.num_local_experts, p.hidden, p.inter, p.dtype, gated=False,
                   num_sms=sms, quant=mode, group=group, fragments=frag)
    return t1, t2


def triton_weight_only_experts(
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
    scheme: QuantScheme,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    tiles: tuple[TileConfig, TileConfig] | None = None,
    out: torch.Tensor | None = None,
    direct: bool | None = None,
    batch_invariant: bool = False,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H] = sum_k w * (deq(w2)[e] @ act(deq(w13)[e] @ x + b13[e]) + b2[e]), x unquantized.

    deq(w) = decode(payload) * scale (expanded over its channel or group) [* global, nvfp4]
    [(decode(payload) - zero) * scale, asymmetric int4], computed in registers. `out` may be x
    itself. direct, batch_invariant: as
    `experts.triton_experts` (direct: the decode path without alignment, GEMM1 by slot, GEMM2 with
    the top-k sum; batch_invariant: `batch_invariant_tiles`, one plan's rows and K steps at every count).
    """
    _require_weight_only(scheme)
    _validate_codes(scheme, x_TH, w13, w2)
    _check_fragments(w13, w2, w13_scale, w2_scale, scheme.weight.dtype)
    num_tokens, hidden = x_TH.shape
    num_local, inter = w13.shape[0], _inter(w2, scheme)
    out = torch.empty_like(x_TH) if out is None else out
    if num_tokens == 0:
        return out
    gated = is_gated(activation)
    problem = GemmProblem(topk_ids_TK.numel(), num_local, hidden, inter, topk_ids_TK.shape[1], gated,
                          x_TH.dtype, _fragments_flag(scheme, w13_scale))
    is_direct, t1, t2 = plan_tiles(problem, scheme, x_TH.device, tiles, direct, batch_invariant)  # given tiles: checked
    args13, args2 = _weight_args(scheme, w13_scale, w2_scale, w13_global_scale, w2_global_scale, x_TH, w13_zero,
                                 w2_zero)
    if is_direct:
        launch = prepare_direct_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                                       num_local, inter, activation, apply_router_weight_on_input,
                                       swiglu_alpha, swiglu_limit)
        launch_gemm1(launch, w13, w13_bias, t1, args13)
        launch_gemm2_direct(launch, w2, w2_bias, t2, out, args2)
        return out
    launch = prepare_launch(x_TH, topk_weights_TK, topk_ids_TK, expert_map, num_global_experts,
                            num_local, inter, activation, apply_router_weight_on_input, swiglu_alpha,
                            swiglu_limit, t1.block_m)
    _launch_gemms(launch, w13, w2, w13_bias, w2_bias, t1, t2, args13, args2)
    launch_reduce(launch, out)
    return out


def triton_batched_weight_only_experts(
    x_LMH: torch.Tensor,
    num_tokens_L: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    scheme: QuantScheme,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    tiles: tuple[TileConfig, TileConfig] | None = None,
    num_slots: int = 0,
    top_k: int = 1,
    batch_invariant: bool = False,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[e, j] = deq(w2)[e] @ act(deq(w13)[e] @ x[e, j] + b13[e]) + b2[e] for j < num_tokens[e],
    zero past the count: the batched layout's buffer rows as the slots (top_k = 1, no routed
    weight), through the same kernels as `triton_weight_only_experts` (batch_invariant, no tiles
    given: `experts.batched_invariant_tiles`)."""
    _require_weight_only(scheme)
    _validate_codes(scheme, x_LMH, w13, w2)
    _check_fragments(w13, w2, w13_scale, w2_scale, scheme.weight.dtype)
    args13, args2 = _weight_args(scheme, w13_scale, w2_scale, w13_global_scale, w2_global_scale, x_LMH, w13_zero,
                                 w2_zero)

    def gemms(launch, t1, t2):
        _launch_gemms(launch, w13, w2, w13_bias, w2_bias, t1, t2, args13, args2)

    if batch_invariant and tiles is None:
        from fusedmoe.backends.triton.experts import batched_invariant_tiles

        choose = functools.partial(batched_invariant_tiles, scheme=scheme, device=x_LMH.device, top_k=top_k)
    else:
        choose = lambda problem: _tiles(problem, scheme, tiles, x_LMH.device)  # noqa: E731
    return run_batched(x_LMH, num_tokens_L, _inter(w2, scheme), activation, swiglu_alpha, swiglu_limit,
                       choose, gemms, num_slots=num_slots, top_k=top_k, fragments=_fragments_flag(scheme, w13_scale))


def _fragments_flag(scheme: QuantScheme, w13_scale: torch.Tensor) -> bool | None:
    """`GemmProblem.fragments` of a call on these weights: their layout, for a 4-bit scheme."""
    return is_fragments(w13_scale) if is_w4_scheme(scheme) else None


def _require_weight_only(scheme: QuantScheme) -> None:
    if scheme.name not in WEIGHT_ONLY_SCHEMES:
        raise NotImplementedError(
            f"the triton weight-only path runs {sorted(WEIGHT_ONLY_SCHEMES)}, not {scheme.name}"
        )


def _inter(w2: torch.Tensor, scheme: QuantScheme) -> int:
    """The intermediate size from w2 [L, H, I] (4-bit: [L, H, I / 2] bytes)."""
    return w2.shape[2] * (2 if scheme.weight.dtype in W4_FORMATS else 1)


def _tiles(problem: GemmProblem, scheme: QuantScheme, tiles: tuple[TileConfig, TileConfig] | None,
           device: torch.device) -> tuple[TileConfig, TileConfig]:
    """The given tiles or the chosen ones, held to the weight-only tile predicate."""
    t1, t2 = tiles if tiles is not None else choose_weight_only_tiles(problem, scheme, device)
    _check_tiles(t1, t2, problem.gated, scheme, problem.dtype)
    return t1, t2


def _launch_gemms(launch, w13, w2, w13_bias, w2_bias, t1, t2, args13: dict, args2: dict) -> None:
    """GEMM1 and GEMM2 on the prepared rows (contiguous or batched) with the scheme's decode
    (`_weight_args`)."""
    launch_gemm1(launch, w13, w13_bias, t1, args13)
    launch_gemm2(launch, w2, w2_bias, t2, args2)


def _weight_args(scheme, w13_scale, w2_scale, w13_global_scale, w2_global_scale, x, w13_zero=None,
                 w2_zero=None) -> tuple[dict, dict]:
    """(GEMM1's, GEMM2's) `_kernel_args`, made before a call's first launch: a bad knob they read
    (FUSEDMOE_TRITON_RS_SYNC) raises before any kernel runs."""
    return (_kernel_args(scheme, w13_scale, w13_global_scale, x, w13_zero),
            _kernel_args(scheme, w2_scale, w2_global_scale, x, w2_zero))


def _check_tiles(t1: TileConfig, t2: TileConfig, gated: bool, scheme: QuantScheme, dtype: torch.dtype) -> None:
    mode, group = weight_only_mode(scheme)
    require_plan(t1, t2, direct=False, dtype=dtype, gated=gated, quant=mode, group=group, running=scheme.name)


def ptx_decode(x: torch.Tensor) -> bool:
    """Whether the weight decode takes the inline PTX (bf16 activations on a GPU)."""
    return x.is_cuda and x.dtype == torch.bfloat16


def _kernel_args(scheme: QuantScheme, scale: torch.Tensor, global_scale: torch.Tensor | None,
                 x: torch.Tensor, zero: torch.Tensor | None = None) -> dict:
    """The GEMM kernels' weight-only keyword arguments for one weight's scales (and asymmetric
    int4's zero points, read with the scales' strides: `check_zero` holds them equal); 4-bit and
    fp8 codes are decoded by inline PTX for bf16 activations `x` on a GPU (the interpreter cannot
    run it)."""
    key = scheme.weight
    ptx = ptx_decode(x)
    strides = tuple(scale.stride()) + (0,) * (3 - scale.dim())
    args = dict(ws_ptr=scale, stride_ws0=strides[0], stride_ws1=strides[1], stride_ws2=strides[2])
    if key.dtype in ("fp8", "int8"):  # e4m3 codes decoded by PTX (kernels.W8_PTX_E4M3), int8 cast
        return dict(args, QUANT=Q_W8, PTX_DECODE=ptx and key.dtype == "fp8")
    args.update(QUANT=Q_W4, W_GROUP=key.group, PTX_DECODE=ptx, wgs_ptr=global_scale if global_scale is not None else scale)
    if zero is not None:
        args.update(wz_ptr=zero, W_ZERO=True)
    if not is_fragments(scale):
        return dict(args, W4_FMT=W4_FORMATS[key.dtype])
    return dict(args, W4_FMT=W4_FRAG_FORMATS[key.dtype], RS_SYNC=rs_sync(x))  # the dot's wgmma waited for on a GPU


def rs_sync(x: torch.Tensor) -> bool:
    """Whether the fragment GEMMs' dots, whose weight operand is the decoded register tile, wait for
    their wgmma each K step (kernels._rs_sync): every GPU compile, unless FUSEDMOE_TRITON_RS_SYNC=0."""
    from fusedmoe import knobs

    return knobs.get("TRITON_RS_SYNC") is not False and x.is_cuda  # the knob read (checked) on any device
