"""Would a GEMM1 over w13 with gate and up rows interleaved beat the library's gated GEMM1? (H100/H200)

    python benchmarks/bench_interleaved_gemm1.py [--presets a,b] [--tokens 64,1024,4096] [--forms library] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_interleaved_gemm1.py --smoke

The library's gated GEMM1 (`kernels.moe_gemm1_kernel`) loads a gate tile and an up tile per K step
(w13 rows n and I + n) into two accumulators of BLOCK_N columns. OpenAI's triton_kernels
(`matmul_ogs`, which leads our GEMM1 by 7-13% at gpt-oss-120b M=4096 and Mixtral M=1024 on the
H200, `results/2026-11-25_h200_eb0ebd3_triton_kernels_profile.txt`) stores gate and up columns
interleaved and runs one 2*BLOCK_N-wide dot per K step, splitting the accumulator into gate and
up for the activation (`tl.reshape` + `tl.split`). This prototype runs that form on the library's
alignment: w13 rows permuted to gate 0, up 0, gate 1, up 1, ... (what `process_weights` would do
once at load), one [2*BLOCK_N, BLOCK_K] weight tile per K step (a TMA descriptor box on sm90,
2*BLOCK_N <= 256), the activation on the split halves, the [rows, I] intermediate stored as the
library stores it. Each variant's output is checked against the library's GEMM1 output on the
same alignment (relative error), then timed over rotated w13 copies (CUDA-graph replay, median).

Forms (--forms): `interleaved` (the permuted w13 above) and `library` (the library's own GEMM1
launch with `TileConfig.one_dot`: w13 as stored, the gate tile over the up tile as one
[2, BLOCK_N, BLOCK_K] box of its [2E, I, H] view, so no layout change). The plan's
two-dot tile is timed first and again last, to show the drift over a case. H200, library form
(results/2026-11-27_h200_bdb1fac_one_dot_gemm1.txt): gpt-oss-120b M=4096 1624-1659 -> 1475 us,
Mixtral M=4096 3474-3527 -> 3192, Mixtral M=1024 985-1094 -> 938, Qwen3-30B M=4096 457-501 -> 438;
level at the other M=1024 cells, behind at DeepSeek-V3 M=4096 (I = 256).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import triton
import triton.language as tl

from fusedmoe.activations import interleave_gate_up
from fusedmoe.backends.triton.kernels import _activation, _row_block, _tile_ids


@triton.jit
def interleaved_gemm1_kernel(
    x_ptr, w_ptr, a_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, top_k, hidden, inter, alpha, limit,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ar, stride_ai,
    ACT: tl.constexpr, GROUP_M: tl.constexpr, W_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """a[r, n] = act(gate, up) of x[token(r)] @ w13i[e]^T for one row block and BLOCK_N outputs:
    w13i rows 2n and 2n + 1 are gate and up row n (unbiased, router weight on the output)."""
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m, pid_n = _tile_ids(tl.num_programs(0) // num_n, num_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert, rows, slot, row_ok = _row_block(pid_m, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
    x_row = (slot // top_k).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # this tile's interleaved rows
    x_ptrs = x_ptr + x_row[:, None] * stride_xt + offs_k[None, :] * stride_xh
    if W_DESC:
        w_row = (expert * 2 * inter + pid_n * 2 * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_w[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wh
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            ww = w_ptr.load([w_row, k0]).T
        else:
            ww = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_w < 2 * inter)[None, :], other=0.0)
            w_ptrs += BLOCK_K * stride_wh
        acc = tl.dot(xa, ww, acc)
        x_ptrs += BLOCK_K * stride_xh
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    act = _activation(gate, up, alpha, limit, ACT, False)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_n[None, :] * stride_ai
    tl.store(a_ptrs, act.to(a_ptr.dtype.element_ty), mask=(offs_n < inter)[None, :])  # padding rows are rows of a


def interleaved_call(L, w13i: torch.Tensor, tile, *, tma: bool):
    from fusedmoe.activations import SWIGLUOAI_LIMIT
    from fusedmoe.backends.triton.experts import ACT_CODES, _descriptor

    x, a = L.x, L.a
    inter, hidden = a.shape[1], x.shape[1]
    w_arg = _descriptor(w13i, (2 * tile.block_n, tile.block_k)) if tma else w13i
    limit = SWIGLUOAI_LIMIT if L.activation == "swigluoai" else 0.0
    blocks = L.sorted_slot.numel() // tile.block_m
    interleaved_gemm1_kernel[(blocks * triton.cdiv(inter, tile.block_n),)](
        x, w_arg, a, L.sorted_slot, L.block_expert, L.num_rows, L.num_slots, L.top_k, hidden, inter,
        float(L.swiglu_alpha), float(limit),
        x.stride(0), x.stride(1), w13i.stride(0), w13i.stride(1), w13i.stride(2), a.stride(0), a.stride(1),
        ACT=ACT_CODES[L.activation], GROUP_M=tile.group_m, W_DESC=tma, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def variants(block_m: int) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, warps, stages) per row block: 2*block_n weight rows a K step."""
    if block_m >= 64:
        return [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4)]
    return [(32, 128, 4, 4), (64, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4)]


def case_rows(name: str, L, t1, w13s: list, tiles: list, *, tma: bool, timed: bool, flops: int,
              forms: tuple[str, ...] = ("interleaved", "library")) -> list[dict]:
    """The library's GEMM1 (its output the reference) and each interleaved tile on one alignment L,
    checked and (timed) over the rotated w13 copies."""
    from fusedmoe.backends.triton.experts import launch_gemm1
    from fusedmoe.bench import check_and_time, check_variants

    launch_gemm1(L, w13s[0], None, t1)
    live = int(L.num_rows.item())  # the aligned rows the GEMMs write (blocks past them exit)
    ref = L.a[:live].clone()
    w13is = [interleave_gate_up(w13, 1) for w13 in w13s]

    def calls(fn, ws):
        return [lambda w=w: (fn(w), L.a[:live])[1] for w in ws]

    plan = ("plan " + str(t1.as_list()), calls(lambda w: launch_gemm1(L, w, None, t1), w13s))
    cells = [plan]
    for form in forms:
        for tile in tiles:
            label = f"{form} {tile.block_m}x{2 * tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"
            if form == "library":  # the library's own launch of the tile with one_dot set
                one = dataclasses.replace(tile, one_dot=True)
                fn = lambda w, t=one: launch_gemm1(L, w, None, t)  # noqa: E731
            else:
                fn = lambda w, tile=tile: interleaved_call(L, w, tile, tma=tma)  # noqa: E731
            cells.append((label, calls(fn, w13s if form == "library" else w13is)))
    cells.append(("plan again", plan[1]))  # drift over the case
    poison = lambda first: L.a.fill_(float("nan")) if first else None  # noqa: E731 (before the checked calls)
    return check_variants(f"{name:16s} M={L.x.shape[0]:<5d}", cells,
                          lambda c: check_and_time(c, ref, timed=timed, poison=poison),
                          flops, row=dict(preset=name, tokens=L.x.shape[0]), width=40)


def main() -> int:
    from fusedmoe.activations import SWIGLUOAI_ALPHA, is_gated
    from fusedmoe.backends.triton.experts import GemmProblem, choose_tiles, prepare_launch
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import _routed_problems, finish_variants, preset_shapes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="gpt-oss-120b,mixtral-8x7b,qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--tokens", default="64,1024,4096")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--forms", default="interleaved,library",
                        help="which one-dot forms to run (library: the library's GEMM1 with TileConfig.one_dot)")
    parser.add_argument("--wide", action="store_true", help="only the 2*BLOCK_N = 256 tiles at >= 64 rows")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float16 if smoke else torch.bfloat16
    if smoke:  # odd I (a tail N tile), a K tail; swigluoai and silu
        shapes, tokens = {"smoke": (6, 2, 72, 40, "swigluoai", 1), "smoke-silu": (5, 2, 64, 48, "silu", 1)}, [40]
    else:
        shapes = {name: (*shape, args.copies) for name, shape in preset_shapes(args.presets).items()}
        tokens = [int(t) for t in args.tokens.split(",")]
    tma = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    rows = []
    for name, (E, K, H, inter, act, _), weights, x, topk_w, ids in _routed_problems(shapes, tokens, device, dtype):
        if not is_gated(act):
            continue
        t = x.shape[0]
        t1 = (TileConfig(16, 16, 32, 4, 1) if smoke else
              choose_tiles(GemmProblem(t * K, E, H, inter, K, True, dtype), device)[0])
        L = prepare_launch(x, topk_w, ids, None, E, E, inter, act, False, SWIGLUOAI_ALPHA, None, t1.block_m)
        tiles = ([TileConfig(16, 16, 32, 4, 1), TileConfig(16, 32, 16, 4, 2)] if smoke else
                 [TileConfig(t1.block_m, *v) for v in variants(t1.block_m) if not args.wide or v[0] == 128])
        rows += case_rows(name, L, t1, [w13 for w13, _ in weights], tiles, tma=tma, timed=not smoke,
                          flops=2 * t * K * H * 2 * inter, forms=tuple(args.forms.split(",")))
    return finish_variants(rows, args.json, device)


if __name__ == "__main__":
    raise SystemExit(main())
