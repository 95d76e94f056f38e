"""Would splitting the direct decode GEMM2 over a token's slots win where it lost? (H100/H200)

    python benchmarks/bench_direct_split.py [--presets a,b] [--tokens 1,4] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_direct_split.py --smoke      # logic check on the CPU

The direct path (`kernels.moe_gemm2_direct_kernel`) runs one program per (token, H tile) over all
K slots: on Qwen3-30B at M=1 that is 64 programs of 32 columns (it lost to the aligned path,
30.6 vs 28.1 us) and on gpt-oss each program streams K x 2880 columns per row (75 vs 63 us). This
prototype gives each (token, H tile) SPLIT programs, each summing K / SPLIT slots in fp32, and
combines the SPLIT partials in a fixed order (deterministic) in one of two ways:
    last   each program stores its partial, then bumps a per-tile counter (atomic, acq_rel); the
           program that sees SPLIT - 1 sums the partials 0..SPLIT-1 and writes the output, and
           resets the counter for the next call (no extra launch)
    pass   a second kernel sums the partials (one extra launch, no atomics)
GEMM1 is the library's (the direct path's, `experts.launch_gemm1` on `prepare_direct_launch`), so
times compare whole calls: aligned, direct (library), and direct GEMM1 + this GEMM2 per variant;
each output is checked against the library's direct output. Decided (H200,
results/2026-11-23_h200_split.txt): the library's `moe_gemm2_direct_kernel` now splits a token's
slots (`split_k` of its tile) with the second-kernel combine; this file's "direct" row is that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def split_gemm2_kernel(
    a_ptr, w2_ptr, out_ptr, part_ptr, count_ptr, topk_w_ptr, ids_ptr,
    num_tokens, hidden, inter, stride_ar, stride_we, stride_wh, stride_ot,
    TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, SPLIT: tl.constexpr, PER: tl.constexpr,
    LAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (t, n, s): sum over slots s*PER .. s*PER + PER - 1 (< TOP_K) of w * (w2[e] @ a[slot])
    for H tile n; unquantized, no bias, ids assumed in range (the library checks those paths)."""
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, BLOCK_M)[:, None]
    lane0 = lanes == 0
    row0 = lanes * 0
    kk = tl.arange(0, TOP_K_P)
    k_in = kk < TOP_K
    ids = tl.load(ids_ptr + t * TOP_K + kk, mask=k_in, other=0).to(tl.int64)
    wk = tl.load(topk_w_ptr + t * TOP_K + kk, mask=k_in, other=0.0).to(tl.float32)
    okk = k_in.to(tl.int32)
    k_steps = tl.cdiv(inter, BLOCK_K)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, PER * k_steps):
        jj = it // k_steps
        j = s * PER + jj
        k0 = (it - jj * k_steps) * BLOCK_K
        sel = kk == j
        e = tl.sum(tl.where(sel, ids, 0), 0)
        w_j = tl.sum(tl.where(sel, wk, 0.0), 0)
        live = tl.sum(tl.where(sel, okk, 0), 0)
        k_ok = offs_k < live * (inter - k0)
        slot = t * TOP_K + j
        aa = tl.load(a_ptr + slot * stride_ar + row0 + (k0 + offs_k)[None, :], mask=lane0 & k_ok[None, :], other=0.0)
        ww = tl.load(w2_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wh + (k0 + offs_k)[:, None],
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        total += tl.dot(aa, ww) * w_j
    row = tl.sum(total, 0)  # rows 1.. are zero: row 0 is the slot's
    if SPLIT == 1:
        tl.store(out_ptr + t * stride_ot + offs_n, row.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + (s * num_tokens + t) * hidden + offs_n, row, mask=n_ok)
        if LAST:
            tl.debug_barrier()  # every thread's partial is written before the release below
            tile = t * tl.num_programs(1) + pid_n
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if done == SPLIT - 1:
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for q in tl.static_range(SPLIT):
                    acc += tl.load(part_ptr + (q * num_tokens + t) * hidden + offs_n, mask=n_ok, other=0.0,
                                   cache_modifier=".cg")
                tl.store(out_ptr + t * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def combine_kernel(part_ptr, out_ptr, num_tokens, hidden, stride_ot, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for q in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (q * num_tokens + t) * hidden + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_call(x, w13, w2, topk_w, ids, activation, split, last, block_n, block_k, stages, counters):
    """Direct GEMM1 (library) + the split GEMM2 (+ the combine kernel when not `last`)."""
    from fusedmoe.backends.triton.experts import (
        GemmProblem,
        direct_tiles,
        launch_gemm1,
        prepare_direct_launch,
    )

    T, H = x.shape
    E, inter = w13.shape[0], w2.shape[2]
    K = ids.shape[1]
    problem = GemmProblem(T * K, E, H, inter, K, True, x.dtype)
    t1 = direct_tiles(problem, None, x.device)[0]
    L = prepare_direct_launch(x, topk_w, ids, None, E, E, inter, activation, False, 1.702, None)
    launch_gemm1(L, w13, None, t1)
    out = torch.empty_like(x)
    per = -(-K // split)
    part = torch.empty(split, T, H, dtype=torch.float32, device=x.device) if split > 1 else out
    n_tiles = triton.cdiv(H, block_n)
    split_gemm2_kernel[(T, n_tiles, split)](
        L.a, w2, out, part, counters, L.weights_N, L.ids, T, H, inter, L.a.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), TOP_K=K, TOP_K_P=triton.next_power_of_2(K), SPLIT=split, PER=per, LAST=last,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages,
    )
    if split > 1 and not last:
        block = min(1024, triton.next_power_of_2(H))
        combine_kernel[(T, triton.cdiv(H, block))](part, out, T, H, out.stride(0), SPLIT=split, BLOCK=block)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b,deepseek-v3,llama-4-maverick")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    from fusedmoe.bench import decode_cells, preset_shapes

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float16 if smoke else torch.bfloat16
    shapes = ({"smoke": (6, 4, 40, 24, "silu", 1)} if smoke else
              {name: (*shape, 4) for name, shape in preset_shapes(args.presets).items()})
    variants = ([(2, True, 16, 32, 2), (2, False, 16, 32, 2), (3, True, 32, 16, 2)] if smoke else
                [(s, last, n, 256, 4) for s, last, n in itertools.product((2, 4, 8), (True, False), (16, 32, 64))])
    ceilings = None  # smoke: nothing timed
    if not smoke:
        from fusedmoe.bench import measure_ceilings

        ceilings = measure_ceilings(device)
        print(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s")
    rows = []
    counters = torch.zeros(1 << 16, dtype=torch.int32, device=device)  # self-resetting tile counters
    tokens = [3] if smoke else [int(t) for t in args.tokens.split(",")]
    for cell in decode_cells(shapes, tokens, device, dtype):
        ref = cell.library(True)[0]()
        cells = [("aligned", cell.library(False)), ("direct", cell.library(True))]
        for split, last, bn, bk, st in variants:
            if split > cell.top_k:
                continue
            label = f"split{split}-{'last' if last else 'pass'}-{bn}x{bk}"
            cells.append((label, cell.per_copy(split_call, split, last, bn, bk, st, counters)))
        for label, calls in cells:
            r = cell.row(label, calls, ref, ceilings, timed=not smoke)
            if r is None:
                continue
            rows.append(r)
            timing = "" if r["us"] is None else f"{r['us']:8.1f} us {r['pct_roofline']:6.1f}%"
            print(f"{cell.preset:18s} M={cell.tokens:<3d} {label:24s} {timing}  rel err {r['rel_err_vs_direct']:.1e}"
                  f"  repeat equal {r['deterministic']}", flush=True)
            if r["mismatch"]:
                print("  ^ MISMATCH")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
