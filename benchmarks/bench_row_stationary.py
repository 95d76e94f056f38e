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
half of them. About 3% of the call: not adopted for bf16.

--quant int8_w8a8 / fp8_w8a8_block / fp8_w8a8_channel record the library's tiled W8A8 GEMM2 launch from one call
(`capture_gemm2`) and time it beside row-stationary forms on the same tensors. The first run
(results/2026-11-24_h200_4f412f2_row_stationary_w8a8.txt, H200, DeepSeek-V3; prototype kernels
then) gave int8 M=1024 197.0 -> 152.6 us, M=4096 457.0 -> 311.8; fp8 block M=1024 219.9 -> 150.5,
M=4096 524.6 -> 281.0 with the codes loaded once and split into their two 128-wide groups (loading
each group per N tile: 152.0 / 349.5 at best); all bitwise the library's y; Qwen3-235B (I = 384)
0-7%. Adopted for I <= 256 as kernels.moe_gemm2_rows_kernel (quant.gemm2_rows), which this mode
now sweeps over launch configs (`rows_launch`). With a 256-wide head and a 128-wide tail tile
("rows+tail"; fifteenth session, results/2026-11-24_h200_eafeb8b_rows_tail.txt) Qwen3-235B gains
8-35% (int8 M=1024 103.1 -> 84.8 us, M=4096 276.7 -> 221.1; fp8 block 114.6 -> 82.4, 305.2 ->
199.8; bitwise): adopted for I <= 384. --quant fp8_w8a8_channel too.
"""

from __future__ import annotations

import argparse
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


def capture_gemm2(shape: tuple, tokens: int, scheme: str, device: torch.device, dtype: torch.dtype):
    """Run one library call (the triton backend's experts computation, on CPU tensors too: the
    interpreter) for shape (experts, top_k, hidden, inter, activation) with the tiled GEMM2
    (FUSEDMOE_TRITON_GEMM2_ROWS=0) and return that GEMM2's launch (`kernel_report.recording`:
    grid, args, kwargs, the tensors alive) and a copy of its y."""
    from fusedmoe import MoEConfig, knobs, select_experts
    from fusedmoe.backends.triton import kernel_report
    from fusedmoe.backends.triton.experts import TritonExperts
    from fusedmoe.bench import _quantized_copy, random_expert_weights
    from fusedmoe.modular import ExpertWeights

    E, K, H, inter, act = shape
    g = torch.Generator(device=device).manual_seed(0)
    w13, w2, _, _ = random_expert_weights(E, H, inter, act, device=device, dtype=dtype, generator=g)
    q13, q2, _, _, params = _quantized_copy(w13, w2, None, None, scheme)
    del w13, w2
    x = torch.randn(tokens, H, device=device, generator=g).to(dtype)
    w, ids = select_experts(x, torch.randn(tokens, E, device=device, generator=g), K)
    config = MoEConfig(E, K, H, inter, dtype=dtype, quant=scheme, activation=act)
    with knobs.override(TRITON_GEMM2_ROWS=False), kernel_report.recording(run=True, only=("moe_gemm2_kernel",)) as calls:
        TritonExperts(config).apply(x, ExpertWeights(q13, q2, quant=params), w, ids, expert_map_E=None)
    if len(calls) != 1:
        raise RuntimeError(f"M={tokens}: {len(calls)} aligned GEMM2 launches (the direct path?)")
    return calls[0], calls[0].args[3].clone()


def rows_launch(call, block_n: int, split_n: int, warps: int, stages: int, tail: bool = True) -> torch.Tensor:
    """The library's row-stationary GEMM2 (kernels.moe_gemm2_rows_kernel) on the tensors of a
    recorded tiled GEMM2 launch, with this launch config; returns its y. tail: I as the library
    splits it (experts.gemm2_rows_split: 384 = 256 + 128), else one power-of-two tile."""
    from fusedmoe.backends.triton import kernels
    from fusedmoe.backends.triton.experts import gemm2_rows_split

    kw = call.kwargs
    a, w2, b2, y, topk_w, sorted_slot, block_expert, num_rows, num_slots, hidden, inter = call.args[:11]
    head, tail_i = gemm2_rows_split(int(inter)) if tail else (triton.next_power_of_2(int(inter)), 0)
    kernels.moe_gemm2_rows_kernel[(sorted_slot.numel() // kw["BLOCK_M"] * split_n,)](
        a, w2, b2, y, topk_w, sorted_slot, block_expert, num_rows, kw["as_ptr"], kw["ws_ptr"], num_slots, hidden,
        inter, *call.args[11:20], kw["stride_as0"], kw["stride_as1"], kw["stride_ws0"], kw["stride_ws1"],
        kw["stride_ws2"], QUANT=kw["QUANT"], ACC_INT=kw["ACC_INT"], HAS_BIAS=kw["HAS_BIAS"],
        SCALE_ROWS=kw["SCALE_ROWS"], SPLIT_N=split_n, BLOCK_M=kw["BLOCK_M"], BLOCK_N=block_n,
        BLOCK_I=head, TAIL_I=tail_i, NUM_STAGES=stages, num_warps=warps,
    )
    return y


def quant_rows(args, variants, smoke: bool) -> list[dict]:
    """--quant int8_w8a8 / fp8_w8a8_block: the library's tiled GEMM2, recorded from one call,
    against its row-stationary GEMM2 at each launch config, on the same tensors (fp8 block: N
    tiles of at most 128, one scale block)."""
    from fusedmoe.backends.triton.experts import gemm2_rows_split
    from fusedmoe.bench import check_and_time, check_variants, preset_shapes

    scheme = args.quant
    device = torch.device("cpu" if smoke else "cuda")
    small = (6, 2, 256, 256, "silu") if scheme == "fp8_w8a8_block" else (6, 2, 100, 48, "silu")
    tail = (5, 2, 128, 384, "silu") if scheme == "fp8_w8a8_block" else (5, 2, 72, 320, "silu")  # I = 256 + 128
    shapes = {"smoke": small, "smoke-tail": tail} if smoke else preset_shapes(args.presets)
    rows = []
    for preset, shape in shapes.items():
        for tokens in [40, 150] if smoke else [int(t) for t in args.tokens.split(",")]:
            call, ref = capture_gemm2(shape, tokens, scheme, device, torch.float16 if smoke else torch.bfloat16)
            kw = call.kwargs
            if kw.get("A_DESC") or kw.get("W_DESC") or kw.get("SWAP_AB"):
                print(f"{preset} M={tokens}: the library's GEMM2 takes descriptors / swap: {kw}")
                continue
            y, (num_slots, hidden, inter) = call.args[3], call.args[8:11]
            tile = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + f" w{kw['num_warps']} s{kw['num_stages']}"
            cells = [("library " + tile, lambda c=call, y=y: (c.fn[c.grid](*c.args, **c.kwargs), y)[1])]
            split_i = gemm2_rows_split(int(inter))[1] > 0
            for bn, split, warps, stages in variants:
                bn = min(bn, 128) if scheme == "fp8_w8a8_block" else bn
                for tail in (True, False) if split_i and scheme != "fp8_w8a8_block" else (True,):
                    cells.append((f"rows{'+tail' if split_i and tail else ''} {bn}x{split} w{warps} s{stages}",
                                  lambda v=(bn, split, warps, stages, tail), c=call: rows_launch(c, *v)))
            rows += check_variants(
                f"{preset:16s} M={tokens:<5d} {scheme}", cells,
                lambda fn, y=y, ref=ref: check_and_time(
                    [fn], ref, timed=not smoke, poison=lambda first: y.fill_(float("nan")) if first else None),
                2 * int(num_slots) * int(hidden) * int(inter), row=dict(preset=preset, tokens=tokens, quant=scheme),
                width=26, unit="TOP/s")
    return rows


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
    parser.add_argument("--quant", default=None, choices=(None, "int8_w8a8", "fp8_w8a8_block", "fp8_w8a8_channel"),
                        help="the library's tiled GEMM2 of this scheme (recorded from one call) against its "
                             "row-stationary GEMM2 at each --variants config")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import aligned_gemm2_cases, check_variants, finish_variants, preset_shapes

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
    if args.quant:
        return finish_variants(quant_rows(args, variants, smoke), args.json, device)
    rows = []
    for case in aligned_gemm2_cases(shapes, tokens, device, torch.float16 if smoke else torch.bfloat16, tiles=tiles):
        cells = [("library", case.library())]
        cells += [(f"rows {bn}x{split} w{warps} s{stages}",
                   case.calls(lambda L, w, v=(bn, split, warps, stages): row_stationary_call(L, w, *v)))
                  for bn, split, warps, stages in variants]
        rows += check_variants(f"{case.preset:16s} M={case.tokens:<5d} bm={case.L.block_m:<4d}", cells,
                               lambda calls, c=case: c.check(calls, timed=not smoke), case.flops,
                               row=dict(preset=case.preset, tokens=case.tokens, block_m=case.L.block_m,
                                        tile=str(case.tile)), width=22)
    return finish_variants(rows, args.json, device)


if __name__ == "__main__":
    raise SystemExit(main())
