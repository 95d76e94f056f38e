"""Would a persistent (optionally warp-specialised) GEMM2 beat the library's at large M? (H100/H200)

    python benchmarks/bench_persistent_gemm.py [--presets a,b] [--tokens 4096] [--json out.json]
    TRITON_INTERPRET=1 FUSEDMOE_TRITON_TMA=force python benchmarks/bench_persistent_gemm.py --smoke

The M=4096 cells are compute-bound and run at 51-71% of the bf16 matmul rate (README). The
library's aligned GEMM2 (`kernels.moe_gemm2_kernel`, TMA descriptor loads at these sizes) launches
one program per (row block, N tile) of the *largest possible* aligned row count, and programs past
the real count exit at once. This prototype runs NUM_SMS programs that loop over the real
(row block, N tile) tiles in the library's grouped order (`tl.range` over tiles, optionally
`warp_specialize=True`: a producer warp group issuing the TMA loads while the others run the
MMAs and the epilogue), so one tile's epilogue (routed weight, scattered store) overlaps the next
tile's loads and no wave is left part-empty.

GEMM1 and the alignment are the library's (`experts.prepare_launch`, `launch_gemm1` with the
tiles it would choose); the timed calls are GEMM2 alone, the library's against each persistent
variant, each output checked against the library's (bitwise: the same tile order within a
program gives the same fp32 sums). First run (H200, results/2026-11-23_h200_persistent-gemm2.txt):
Qwen3-30B M=4096 GEMM2 library 234.4 us (440 TFLOP/s), persistent at best 236.3 (two programs
per SM), 251.6-313.8 otherwise; the warp_specialize=True variants compile (in ~1 s for sm90) but
hang on the GPU with Triton 3.6, as a plain dense GEMM does (`probe_warp_specialize.py`,
results/2026-11-25_h200_c7ed091_ws_probe.txt). Not adopted then.

`flat` variants flatten the tile loop (`tl.range(..., flatten=True)`: the next tile's loads are
issued during this tile's epilogue, as OpenAI's triton_kernels does). H200, M=4096
(results/2026-11-25_h200_eb0ebd3_persistent_flatten_gemm2.txt): 128 x 256 x 64 in 8 warps,
DeepSeek-V3 489 -> 417 us, gpt-oss-120b 784 -> 735, Qwen3-30B 232 -> 215; with
warp_specialize=True as well it ran (no hang) and gained nothing more. Adopted as
`TileConfig.persistent` (kernels.moe_gemm2_kernel PERSISTENT).
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.kernels import _grouped_tile


@triton.jit
def persistent_gemm2_kernel(
    a_desc, w_desc, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, hidden, inter, stride_ys,
    NUM_PROGRAMS: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[slot(r), n] = w[slot(r)] * sum_i a[r, i] * w2[e, n, i] over every real (row block,
    N tile), NUM_PROGRAMS programs striding over them. Unquantized, no bias (prototype)."""
    num_m = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
    num_n = tl.cdiv(hidden, BLOCK_N)
    k_tiles = tl.cdiv(inter, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            w = w_desc.load([w_row, kk * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_slot_ptr + rows)
        row_ok = slot < num_slots
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        weight = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        tl.store(y_ptr + slot.to(tl.int64)[:, None] * stride_ys + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_n < hidden)[None, :])


def persistent_call(L, w2, tile, programs, ws, warps, stages, flatten=False):
    from fusedmoe.backends.triton.experts import _descriptor
    from fusedmoe.backends.triton.tiles import GROUP_M

    a, y = L.a, L.y
    hidden, inter = y.shape[1], a.shape[1]
    persistent_gemm2_kernel[(programs,)](
        _descriptor(a, (tile.block_m, tile.block_k)), _descriptor(w2, (tile.block_n, tile.block_k)), y,
        L.weights_N, L.sorted_slot, L.block_expert, L.num_rows, y.shape[0], hidden, inter, y.stride(0),
        NUM_PROGRAMS=programs, GROUP_M=GROUP_M, WS=ws, FLATTEN=flatten, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, num_warps=warps, num_stages=stages,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,gpt-oss-120b")
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default=None, help="time only the variants whose label contains this (e.g. 'ws')")
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    from fusedmoe.backends.triton.experts import _num_sms
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import aligned_gemm2_cases, check_variants, finish_variants, preset_shapes

    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        shapes, tokens = {"smoke": (6, 2, 64, 48, "silu", 1)}, [40]
        tiles, sms = (TileConfig(16, 16, 32, 4, 1), TileConfig(16, 32, 16, 4, 1)), 4
    else:
        from fusedmoe.bench import measure_ceilings

        shapes = {name: (*shape, 4) for name, shape in preset_shapes(args.presets).items()}
        tokens, tiles, sms = [int(t) for t in args.tokens.split(",")], None, _num_sms(device)
        ceilings = measure_ceilings(device)
        print(f"{ceilings.device}: {ceilings.peak(None) / 1e12:.0f} bf16 TFLOP/s, {sms} SMs", flush=True)
    rows = []
    for case in aligned_gemm2_cases(shapes, tokens, device, torch.float16 if smoke else torch.bfloat16, tiles=tiles):
        t2 = case.tile
        variants = ([(t2, sms, False, 4, 1, False), (t2, 3, False, 4, 2, True)] if smoke else
                    [(TileConfig(t2.block_m, bn, 64, warps, stages), mult * sms, ws, warps, stages, flat)
                     for bn, warps, stages, mult, ws, flat in (
                         (128, 8, 3, 1, False, False), (256, 8, 3, 1, False, False), (128, 4, 4, 1, False, False),
                         (128, 8, 3, 2, False, False), (128, 4, 3, 1, True, False), (256, 4, 3, 1, True, False),
                         (256, 8, 3, 1, False, True), (128, 8, 3, 1, False, True), (256, 8, 4, 1, False, True),
                         (128, 8, 4, 1, False, True), (256, 8, 3, 1, True, True))])
        cells = [("library", case.library())]
        for tile, programs, ws, warps, stages, flat in variants:
            label = f"persistent {tile.block_m}x{tile.block_n}x{tile.block_k} w{warps} s{stages} " \
                    f"p{programs}{' flat' if flat else ''}{' ws' if ws else ''}"
            cells.append((label, case.calls(lambda L, w, v=(tile, programs, ws, warps, stages, flat):
                                            persistent_call(L, w, *v))))
        cells = [(label, calls) for label, calls in cells
                 if args.only is None or args.only in label or label == "library"]
        rows += check_variants(f"{case.preset:16s} M={case.tokens:<5d}", cells,
                               lambda calls, c=case: c.check(calls, timed=not smoke), case.flops,
                               row=dict(preset=case.preset, tokens=case.tokens), width=44)
    return finish_variants(rows, args.json, device)


if __name__ == "__main__":
    raise SystemExit(main())
