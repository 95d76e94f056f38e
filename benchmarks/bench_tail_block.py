"""Would a narrow tail path cut the padding rows' cost of the aligned GEMMs? (H100/H200)

    python benchmarks/bench_tail_block.py [--presets a,b] [--tokens 4096] [--tails 16,32] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_tail_block.py --smoke

Each expert's rows are padded to whole BLOCK_M blocks. Under random routing, where the mean rows
per expert sit near a multiple of BLOCK_M (DeepSeek-V3 and gpt-oss at M=4096: 128 +- 11 rows with
128-row blocks), about half the experts get one more, nearly empty block, and the call takes
15-24% longer than with every expert at its mean (`bench_padding.py`,
results/2026-11-24_h200_4d3cb53_padding_probe.txt). The padding rows sit at the end of each
expert's last block, so a program whose block has at most TAIL_M live rows can run a
[TAIL_M, BLOCK_N] tile instead (a scalar branch; both tiles are compiled into the one kernel),
in the same launch, so the expert's weight tile still comes from L2 beside its full blocks.

A second variant folds the tail instead (`merged_gemm2_kernel`): an expert's last block with at
most TAIL_M live rows is no program of its own, and the block before it runs a second
[TAIL_M, BLOCK_N] dot on the same weight tile each K step (the block list is made by torch here,
untimed).

This prototype is the aligned GEMM2 (y[slot] = w_slot * a[row] @ w2[e]^T, unquantized, no bias),
pointer loads, the library's grouped program order. Variants: TAIL_M = 0 (the full tile only:
the like-for-like base), each --tails value, and each folded --tails value, on the library's
alignment and GEMM1 output with the tiles `choose_tiles` picks (the library's own GEMM2, with TMA
descriptors where it takes them, is timed beside them). Every variant's y is checked against the
library's (relative error; the narrow tile may run another MMA, so not bitwise).

Result (H200, fourteenth session, results/2026-11-24_h200_3136eb5_tail_block.txt): neither wins.
The narrow tile gains 0-7% on the pointer base in some cells (Qwen3-30B M=1024 133.8 -> 124.9 us,
gpt-oss M=4096 782 -> 750 in one run, 773 -> 773 in the next) and loses in others (Mixtral M=4096
+3%); balanced routing, the ceiling, is 8-18% faster (DeepSeek-V3 M=4096 542 -> 444). A tail
program still streams the whole weight tile over the whole K, which is what it costs. Folding
removes those programs (gpt-oss M=4096: 192 -> 128 programs per N tile) but is no faster there and
20-30% slower elsewhere, even where no block folds (DeepSeek-V3 M=1024): the second dot takes HMMA
beside the wgmma and the kernel's registers go 117 -> 165 (128x128 tile) and 124 -> 240 (64x128),
halving the programs per SM. Not adopted.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.kernels import _tile_ids


@triton.jit
def _gemm2_rows(a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, expert, row0, pid_n, num_slots, hidden, inter,
                stride_ar, stride_we, stride_wh, stride_ys,
                BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[slot(r), n tile] for the BM aligned rows from row0 (padding rows: slot num_slots, not stored)."""
    rows = row0 + tl.arange(0, BM)
    slot = tl.load(sorted_slot_ptr + rows)
    row_ok = slot < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wh + offs_k[:, None]
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(y_ptr + slot.to(tl.int64)[:, None] * stride_ys + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def tail_gemm2_kernel(
    a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, hidden, inter, stride_ar, stride_we, stride_wh, stride_ys,
    TAIL_M: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The aligned GEMM2 over (row block, N tile) programs; TAIL_M > 0: a block with at most
    TAIL_M live rows runs the [TAIL_M, BLOCK_N] tile."""
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid_m, pid_n = _tile_ids(tl.num_programs(0) // num_n, num_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    row0 = pid_m * BLOCK_M
    if TAIL_M > 0:
        live = tl.sum((tl.load(sorted_slot_ptr + row0 + tl.arange(0, BLOCK_M)) < num_slots).to(tl.int32), 0)
        if live <= TAIL_M:  # the expert's last block, nearly empty: its live rows come first
            _gemm2_rows(a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, expert, row0, pid_n, num_slots, hidden,
                        inter, stride_ar, stride_we, stride_wh, stride_ys, TAIL_M, BLOCK_N, BLOCK_K)
        else:
            _gemm2_rows(a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, expert, row0, pid_n, num_slots, hidden,
                        inter, stride_ar, stride_we, stride_wh, stride_ys, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _gemm2_rows(a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, expert, row0, pid_n, num_slots, hidden,
                    inter, stride_ar, stride_we, stride_wh, stride_ys, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def merged_gemm2_kernel(
    a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, prog_row0_ptr, prog_expert_ptr, prog_tail_ptr, num_progs_ptr,
    num_slots, hidden, inter, stride_ar, stride_we, stride_wh, stride_ys,
    TAIL_M: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The aligned GEMM2 over a compacted block list: an expert's last block with at most TAIL_M
    live rows is no program of its own; the block before it (prog_tail = 1) runs a second
    [TAIL_M, BLOCK_N] dot on the same weight tile each K step, so the tail costs no weight load
    and no program."""
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid_m, pid_n = _tile_ids(tl.num_programs(0) // num_n, num_n, GROUP_M)
    if pid_m >= tl.load(num_progs_ptr):
        return
    row0 = tl.load(prog_row0_ptr + pid_m)
    expert = tl.load(prog_expert_ptr + pid_m).to(tl.int64)
    if tl.load(prog_tail_ptr + pid_m) != 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        rows_t = row0 + BLOCK_M + tl.arange(0, TAIL_M)
        slot = tl.load(sorted_slot_ptr + rows)
        slot_t = tl.load(sorted_slot_ptr + rows_t)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_k[None, :]
        t_ptrs = a_ptr + rows_t.to(tl.int64)[:, None] * stride_ar + offs_k[None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wh + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_t = tl.zeros((TAIL_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            a_t = tl.load(t_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc)
            acc_t = tl.dot(a_t, w, acc_t)
            a_ptrs += BLOCK_K
            t_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        row_ok = slot < num_slots
        weight = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + slot.to(tl.int64)[:, None] * stride_ys + offs_n[None, :],
                 (acc * weight[:, None]).to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
        t_ok = slot_t < num_slots
        weight_t = tl.load(topk_w_ptr + slot_t, mask=t_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + slot_t.to(tl.int64)[:, None] * stride_ys + offs_n[None, :],
                 (acc_t * weight_t[:, None]).to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])
    else:
        _gemm2_rows(a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, expert, row0, pid_n, num_slots, hidden,
                    inter, stride_ar, stride_we, stride_wh, stride_ys, BLOCK_M, BLOCK_N, BLOCK_K)


def merged_blocks(L, tail_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prog_row0, prog_expert, prog_tail, num_progs) from the library's alignment: an expert's
    last block with <= tail_m live rows folds into the block before it (same expert). Made by
    torch here (a prototype, untimed); the alignment kernel would write it."""
    block_m, slots = L.block_m, L.y.shape[0]
    blocks = int(L.num_rows.item()) // block_m
    live = (L.sorted_slot[:blocks * block_m].view(blocks, block_m) < slots).sum(1)
    expert = L.block_expert[:blocks]
    folds = torch.zeros(blocks, dtype=torch.bool, device=live.device)
    folds[1:] = (expert[1:] == expert[:-1]) & (live[1:] <= tail_m)
    tail = torch.zeros(blocks, dtype=torch.int32, device=live.device)
    tail[:-1] = folds[1:].to(torch.int32)
    keep = ~folds
    row0 = (torch.arange(blocks, device=live.device, dtype=torch.int32) * block_m)[keep]
    num = torch.tensor([row0.numel()], dtype=torch.int32, device=live.device)
    pad = L.sorted_slot.numel() // block_m - row0.numel()
    fill = lambda t: torch.cat([t, t.new_zeros(pad)])  # noqa: E731 - grid sized as the library's
    return fill(row0), fill(expert[keep].to(torch.int32)), fill(tail[keep]), num


def merged_call(L, w2, tile, tail_m: int, plan) -> None:
    """One launch of the folded-tail prototype (plan: `merged_blocks`)."""
    from fusedmoe.backends.triton.experts import GROUP_M

    a, y = L.a, L.y
    hidden, inter = y.shape[1], a.shape[1]
    row0, expert, tail, num = plan
    merged_gemm2_kernel[(row0.numel() * triton.cdiv(hidden, tile.block_n),)](
        a, w2, y, L.weights_N, L.sorted_slot, row0, expert, tail, num, y.shape[0], hidden, inter,
        a.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        TAIL_M=tail_m, GROUP_M=GROUP_M, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def tail_call(L, w2, tile, tail_m: int) -> None:
    """One launch of the prototype over the library's aligned rows L (a: GEMM1's output)."""
    from fusedmoe.backends.triton.experts import GROUP_M

    a, y = L.a, L.y
    hidden, inter = y.shape[1], a.shape[1]
    blocks = L.sorted_slot.numel() // L.block_m
    tail_gemm2_kernel[(blocks * triton.cdiv(hidden, tile.block_n),)](
        a, w2, y, L.weights_N, L.sorted_slot, L.block_expert, L.num_rows, y.shape[0], hidden, inter,
        a.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        TAIL_M=tail_m, GROUP_M=GROUP_M, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def compile_report(tails: list[int]) -> None:
    """Compile the prototype for sm90 on this machine (no GPU: kernel_report's compile_call) at
    DeepSeek-V3 / gpt-oss M=4096's GEMM2 tile (128x128x64, 8 warps, 3 stages) and print each
    TAIL_M's registers, spills, shared memory and MMA opcodes."""
    from fusedmoe.backends.triton import kernel_report as kr

    E, H, inter, slots, block_m = 128, 2880, 2880, 16384, 128
    rows = slots + E * (block_m - 1)
    a, w2 = torch.empty(rows, inter, dtype=torch.bfloat16), torch.empty(E, H, inter, dtype=torch.bfloat16)
    y, weights = torch.empty(slots, H, dtype=torch.bfloat16), torch.empty(slots)
    sorted_slot, block_expert = torch.empty(rows, dtype=torch.int32), torch.empty(rows // block_m, dtype=torch.int32)
    num_rows = torch.empty(1, dtype=torch.int32)
    for tail in [0, *tails]:
        call = kr.Call("tail_gemm2_kernel", tail_gemm2_kernel, (1,),
                       (a, w2, y, weights, sorted_slot, block_expert, num_rows, slots, H, inter, a.stride(0),
                        w2.stride(0), w2.stride(1), y.stride(0)),
                       dict(TAIL_M=tail, GROUP_M=8, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                            num_stages=3))
        u = kr.usage(kr.compile_call(call))
        ops = {k: v for k, v in u["opcodes"].items() if k in ("HGMMA", "HMMA", "LDGSTS", "LDG", "BAR") and v}
        print(f"TAIL_M {tail:3d}: {u['regs']} registers, {u['stack']} B stack, {u['shared']} B shared, "
              f"{u['instructions']} instructions, {ops}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="deepseek-v3,gpt-oss-120b,qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--tails", default="16,32")
    parser.add_argument("--balanced", action="store_true", help="every expert exactly T*k/E rows (no tail blocks)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile", action="store_true", help="compile for sm90 here, print registers (no GPU)")
    args = parser.parse_args()
    tails = [int(t) for t in args.tails.split(",")]
    if args.compile:
        compile_report(tails)
        return 0
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import aligned_gemm2_cases, check_variants, finish_variants, preset_shapes

    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        shapes, tokens = {"smoke": (6, 2, 64, 48, "silu", 1)}, [40, 150]
        tiles = (TileConfig(32, 16, 32, 4, 1), TileConfig(32, 32, 16, 4, 1))
    else:
        from fusedmoe.bench import measure_ceilings

        shapes = {name: (*shape, 4) for name, shape in preset_shapes(args.presets).items()}
        tokens, tiles = [int(t) for t in args.tokens.split(",")], None
        print(f"{measure_ceilings(device).device}", flush=True)
    rows = []
    for case in aligned_gemm2_cases(shapes, tokens, device, torch.float16 if smoke else torch.bfloat16,
                                    tiles=tiles, balanced=args.balanced):
        cells = [("library", case.library())]
        cells += [(f"prototype tail {tail}", case.calls(lambda L, w, tail=tail, t=case.tile: tail_call(L, w, t, tail)))
                  for tail in [0, *tails] if tail < case.tile.block_m]
        for tail in tails:
            if tail < case.tile.block_m:
                plan = merged_blocks(case.L, tail)
                folded = int(plan[3].item())
                cells.append((f"folded tail {tail} ({folded} progs)",
                              case.calls(lambda L, w, tail=tail, t=case.tile, p=plan: merged_call(L, w, t, tail, p))))
        rows += check_variants(f"{case.preset:16s} M={case.tokens:<5d} {case.tile}", cells,
                               lambda calls, c=case: c.check(calls, timed=not smoke), case.flops,
                               row=dict(preset=case.preset, tokens=case.tokens, tile=str(case.tile),
                                        balanced=args.balanced))
    return finish_variants(rows, args.json, device)


if __name__ == "__main__":
    raise SystemExit(main())
