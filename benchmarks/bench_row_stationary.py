"""Would a row-stationary GEMM2 beat the library's where I is short? (H100/H200)

    python benchmarks/bench_row_stationary.py [--presets deepseek-v3] [--tokens 1024,4096] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_row_stationary.py --smoke

DeepSeek-V3's GEMM2 (K = I = 256) takes longer than its GEMM1 at M=4096 (profile, fourteenth
session: int8 435 against 392 us, for half the flops): each (row block, N tile) program of the
library runs 2-4 K steps, so its pipeline fill, epilogue and the row block's activation loads are
paid per 128-column tile of the 7168-wide output. Here a program owns a row block and a share of
the N tiles: it loads its [BLOCK_M, I] activations once, then streams the expert's w2 tiles
[I, BLOCK_N] through the loop's pipeline, one whole-K dot and one routed-weight store per tile, so
the stores of tile j overlap the loads of tile j+1.

The alignment, GEMM1 and the library's GEMM2 are the library's (`fusedmoe.bench.aligned_gemm2_cases`);
every variant's y is checked against the library's. Unquantized, no bias (prototype).

Result (H200, fourteenth session, results/2026-11-24_h200_3136eb5_row_stationary.txt), bf16
DeepSeek-V3 GEMM2: M=4096 499 -> 461 us (-8%, 64-wide N tiles, one or two shares, 3-4 stages;
bitwise the library's y), M=1024 254 -> 254 (no gain). The whole A tile and the w2 stages take
140-173 KB of shared memory (one program per SM); 128-wide N tiles lose. With y's 470 MB written
and w2's 940 MB read, 461 us is ~72% of the H200's stream: the GEMM is bound by bytes, and y is
half of them. About 3% of the call: not adopted yet (an int8 variant is not measured).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def row_stationary_gemm2_kernel(
    a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, hidden, inter, stride_ar, stride_we, stride_wh, stride_ys,
    SPLIT_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program (row block, part): y[slot(r), n] = w[slot(r)] * a[r, :] @ w2[e, n, :]^T for the
    part-th share of the N tiles; a's rows are loaded once (BLOCK_I >= inter, masked)."""
    pid_m = tl.program_id(0) // SPLIT_N
    part = tl.program_id(0) % SPLIT_N
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + rows)
    row_ok = slot < num_slots
    offs_i = tl.arange(0, BLOCK_I)
    i_ok = offs_i < inter
    a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_i[None, :], mask=i_ok[None, :], other=0.0)
    weight = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    num_n = tl.cdiv(hidden, BLOCK_N)
    per = tl.cdiv(num_n, SPLIT_N)
    lo = part * per
    hi = tl.minimum(lo + per, num_n)
    w_base = w_ptr + expert * stride_we + offs_i[:, None]
    y_rows = y_ptr + slot.to(tl.int64)[:, None] * stride_ys
    for t in tl.range(lo, hi, num_stages=NUM_STAGES):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        w = tl.load(w_base + offs_n.to(tl.int64)[None, :] * stride_wh, mask=i_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w)
        tl.store(y_rows + offs_n[None, :], (acc * weight[:, None]).to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


def row_stationary_call(L, w2, block_n: int, split_n: int, warps: int, stages: int) -> None:
    a, y = L.a, L.y
    hidden, inter = y.shape[1], a.shape[1]
    blocks = L.sorted_slot.numel() // L.block_m
    row_stationary_gemm2_kernel[(blocks * split_n,)](
        a, w2, y, L.weights_N, L.sorted_slot, L.block_expert, L.num_rows, y.shape[0], hidden, inter,
        a.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        SPLIT_N=split_n, BLOCK_M=L.block_m, BLOCK_N=block_n, BLOCK_I=triton.next_power_of_2(inter),
        NUM_STAGES=stages, num_warps=warps,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="deepseek-v3")
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--variants", default="64:1:4:3,64:2:4:3,128:1:8:3,128:2:8:3,64:4:4:4,128:4:8:2",
                        help="block_n:split_n:warps:stages,...")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import aligned_gemm2_cases, preset_shapes

    device = torch.device("cpu" if smoke else "cuda")
    variants = [tuple(int(v) for v in s.split(":")) for s in args.variants.split(",")]
    if smoke:
        shapes, tokens = {"smoke": (6, 2, 100, 48, "silu", 1)}, [40, 150]
        tiles = (TileConfig(32, 16, 32, 4, 1), TileConfig(32, 32, 16, 4, 1))
        variants = [(16, 1, 4, 1), (32, 3, 4, 1)]
    else:
        from fusedmoe.bench import measure_ceilings

        shapes = {name: (*shape, 4) for name, shape in preset_shapes(args.presets).items()}
        tokens, tiles = [int(t) for t in args.tokens.split(",")], None
        print(f"{measure_ceilings(device).device}", flush=True)
    rows = []
    for case in aligned_gemm2_cases(shapes, tokens, device, torch.float16 if smoke else torch.bfloat16, tiles=tiles):
        cells = [("library", case.library())]
        cells += [(f"rows {bn}x{split} w{warps} s{stages}",
                   case.calls(lambda L, w, v=(bn, split, warps, stages): row_stationary_call(L, w, *v)))
                  for bn, split, warps, stages in variants]
        for label, calls in cells:
            try:
                us, err, _ = case.check(calls, timed=not smoke)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is a row
                print(f"{case.preset} M={case.tokens} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            tflops = None if us is None else case.flops / (us * 1e-6) / 1e12
            rows.append(dict(preset=case.preset, tokens=case.tokens, variant=label, block_m=case.L.block_m,
                             tile=str(case.tile), us=us, tflops=tflops, rel_err=err))
            timing = "" if us is None else f"{us:8.1f} us {tflops:6.0f} TFLOP/s"
            print(f"{case.preset:16s} M={case.tokens:<5d} bm={case.L.block_m:<4d} {label:22s} {timing}  rel err {err:.1e}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)
    return 0 if all(r["rel_err"] < 1e-2 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
