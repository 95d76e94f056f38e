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

--quant int8_w8a8 / fp8_w8a8_block capture the library's W8A8 GEMM2 launch from one call
(`capture_gemm2`) and time it beside the scheme's row-stationary form on the same tensors
(results/2026-11-24_h200_4f412f2_row_stationary_w8a8.txt, H200, DeepSeek-V3): int8 M=1024 197.0 ->
152.6 us, M=4096 457.0 -> 311.8; fp8 block M=1024 219.9 -> 150.5, M=4096 524.6 -> 281.0 (the codes
loaded once and split into their two 128-wide groups); both bitwise the library's y. Qwen3-235B
(I = 384) gained 0-7%. Adopted for I <= 256 as kernels.moe_gemm2_rows_kernel (quant.gemm2_rows).
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


@triton.jit
def row_stationary_int8_gemm2_kernel(
    a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr, as_ptr, ws_ptr,
    num_slots, hidden, inter, stride_ar, stride_we, stride_wh, stride_ys, stride_as, stride_ws0, stride_ws1,
    SPLIT_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """The int8 W8A8 form (per-token codes and scales, per-channel w2 scales): the row block's
    codes and scales loaded once, int32 whole-K dots, the library's epilogue order."""
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
    a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_i[None, :], mask=row_ok[:, None] & i_ok[None, :],
                other=0)
    sa = tl.load(as_ptr + rows.to(tl.int64) * stride_as, mask=row_ok, other=0.0)
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
        w = tl.load(w_base + offs_n.to(tl.int64)[None, :] * stride_wh, mask=i_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(a, w, out_dtype=tl.int32)
        sw = tl.load(ws_ptr + expert * stride_ws0 + offs_n * stride_ws1, mask=n_ok, other=0.0).to(tl.float32)
        out = acc.to(tl.float32) * sa[:, None] * sw[None, :] * weight[:, None]
        tl.store(y_rows + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def row_stationary_fp8_block_gemm2_kernel(
    a_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr, as_ptr, ws_ptr,
    num_slots, hidden, inter, stride_ar, stride_we, stride_wh, stride_ys, stride_as0, stride_as1,
    stride_ws0, stride_ws1, stride_ws2,
    SPLIT_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KB: tl.constexpr,
    NUM_STAGES: tl.constexpr, A_ONCE: tl.constexpr,
):
    """The fp8 block W8A8 form (1x128 activation groups, 128x128 weight blocks; BLOCK_N <= 128 so
    an N tile lies in one scale block): per N tile, one 128-deep dot per K block, scaled by its
    group and block scales. A_ONCE (NUM_KB == 2): the row block's [BLOCK_M, 256] codes are loaded
    once and split, else each K block's codes are loaded per N tile (from L2)."""
    pid_m = tl.program_id(0) // SPLIT_N
    part = tl.program_id(0) % SPLIT_N
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + rows)
    row_ok = slot < num_slots
    offs_k = tl.arange(0, 128)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_ar
    if A_ONCE:
        offs_i = tl.arange(0, 256)
        a2 = tl.load(a_rows + offs_i[None, :], mask=row_ok[:, None] & (offs_i < inter)[None, :], other=0.0)
        a_lo, a_hi = tl.split(tl.permute(tl.reshape(a2, (BLOCK_M, 2, 128)), (0, 2, 1)))
        sa_lo = tl.load(as_ptr + rows.to(tl.int64) * stride_as0, mask=row_ok, other=0.0)
        sa_hi = tl.load(as_ptr + rows.to(tl.int64) * stride_as0 + stride_as1, mask=row_ok, other=0.0)
    weight = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    num_n = tl.cdiv(hidden, BLOCK_N)
    per = tl.cdiv(num_n, SPLIT_N)
    lo = part * per
    hi = tl.minimum(lo + per, num_n)
    w_base = w_ptr + expert * stride_we
    ws_base = ws_ptr + expert * stride_ws0
    y_rows = y_ptr + slot.to(tl.int64)[:, None] * stride_ys
    for t in tl.range(lo, hi, num_stages=NUM_STAGES):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        nb = (t * BLOCK_N) // 128
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if A_ONCE:
            w_lo = tl.load(w_base + offs_n.to(tl.int64)[None, :] * stride_wh + offs_k[:, None],
                           mask=n_ok[None, :], other=0.0)
            w_hi = tl.load(w_base + offs_n.to(tl.int64)[None, :] * stride_wh + (128 + offs_k)[:, None],
                           mask=(128 + offs_k < inter)[:, None] & n_ok[None, :], other=0.0)
            sw_lo = tl.load(ws_base + nb * stride_ws1).to(tl.float32)
            sw_hi = tl.load(ws_base + nb * stride_ws1 + stride_ws2).to(tl.float32)
            acc += tl.dot(a_lo, w_lo) * (sa_lo * sw_lo)[:, None]
            acc += tl.dot(a_hi, w_hi) * (sa_hi * sw_hi)[:, None]
        else:
            for kb in tl.static_range(NUM_KB):
                k_ok = offs_k < inter - kb * 128
                a = tl.load(a_rows + (kb * 128 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + offs_n.to(tl.int64)[None, :] * stride_wh + (kb * 128 + offs_k)[:, None],
                            mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                sa = tl.load(as_ptr + rows.to(tl.int64) * stride_as0 + kb * stride_as1, mask=row_ok, other=0.0)
                sw = tl.load(ws_base + nb * stride_ws1 + kb * stride_ws2).to(tl.float32)
                acc += tl.dot(a, w) * (sa * sw)[:, None]
        out = acc * weight[:, None]
        tl.store(y_rows + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def capture_gemm2(shape: tuple, tokens: int, scheme: str, device: torch.device, dtype: torch.dtype):
    """Run one library call (`fused_experts`, backend triton) for shape (experts, top_k, hidden,
    inter, activation) and return its aligned GEMM2 launch (kernel_report.Call: grid, args,
    kwargs, the tensors still alive) and a copy of its y."""
    from fusedmoe import MoEConfig, select_experts
    from fusedmoe.backends.triton import kernel_report, kernels
    from fusedmoe.backends.triton.experts import TritonExperts
    from fusedmoe.bench import _quantized_copy
    from fusedmoe.modular import ExpertWeights

    E, K, H, inter, act = shape
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(E, 2 * inter, H, device=device, generator=g) / 50).to(dtype)
    w2 = (torch.randn(E, H, inter, device=device, generator=g) / 30).to(dtype)
    q13, q2, _, _, params = _quantized_copy(w13, w2, None, None, scheme)
    del w13, w2
    x = torch.randn(tokens, H, device=device, generator=g).to(dtype)
    w, ids = select_experts(x, torch.randn(tokens, E, device=device, generator=g), K)
    calls, fn = [], kernels.moe_gemm2_kernel

    class Tap:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(kernel_report.Call("moe_gemm2_kernel", fn, tuple(grid), args, kwargs))
                return fn[grid](*args, **kwargs)
            return launch

    kernels.moe_gemm2_kernel = Tap()
    try:  # the triton backend's experts computation (on CPU tensors too: the interpreter)
        config = MoEConfig(E, K, H, inter, dtype=dtype, quant=scheme, activation=act)
        TritonExperts(config).apply(x, ExpertWeights(q13, q2, quant=params), w, ids, expert_map_E=None)
    finally:
        kernels.moe_gemm2_kernel = fn
    if len(calls) != 1:
        raise RuntimeError(f"M={tokens}: {len(calls)} aligned GEMM2 launches (the direct path?)")
    return calls[0], calls[0].args[3].clone()


def quant_rows(args, variants, smoke: bool) -> list[dict]:
    """--quant int8_w8a8 / fp8_w8a8_block: the library's captured GEMM2 against the row-stationary
    kernel of the scheme (fp8 block: each variant with and without A_ONCE where I <= 256)."""
    scheme = args.quant
    from fusedmoe.bench import preset_shapes

    device = torch.device("cpu" if smoke else "cuda")
    small = (6, 2, 256, 256, "silu") if args.quant == "fp8_w8a8_block" else (6, 2, 100, 48, "silu")
    shapes = {"smoke": small} if smoke else preset_shapes(args.presets)
    tokens_list = [40, 150] if smoke else [int(t) for t in args.tokens.split(",")]
    rows = []
    for preset, shape in shapes.items():
        for tokens in tokens_list:
            call, ref = capture_gemm2(shape, tokens, scheme, device, torch.float16 if smoke else torch.bfloat16)
            a, w2, _, y, topk_w, sorted_slot, block_expert, num_rows, num_slots, hidden, inter = call.args[:11]
            kw = call.kwargs
            if kw.get("A_DESC") or kw.get("W_DESC") or kw.get("SWAP_AB"):
                print(f"{preset} M={tokens}: the library's GEMM2 takes descriptors / swap: {kw}")
                continue
            block_m = kw["BLOCK_M"]
            tile = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + f" w{kw['num_warps']} s{kw['num_stages']}"
            ws, as_ = kw["ws_ptr"], kw["as_ptr"]
            blocks = sorted_slot.numel() // block_m
            flops = 2 * int(num_slots) * int(hidden) * int(inter)

            def library(call=call, y=y):
                call.fn[call.grid](*call.args, **call.kwargs)
                return y

            cells = [("library " + tile, library)]
            if scheme == "fp8_w8a8_block":
                for bn, split, warps, stages in variants:
                    for a_once in ([False, True] if triton.next_power_of_2(int(inter)) == 256 else [False]):
                        def proto_b(v=(bn, split, warps, stages), a_once=a_once, a=a, w2=w2, y=y, ws=ws, as_=as_, kw=kw,
                                    blocks=blocks, block_m=block_m, sorted_slot=sorted_slot, block_expert=block_expert,
                                    num_rows=num_rows, topk_w=topk_w, num_slots=num_slots, hidden=hidden, inter=inter):
                            bn, split, warps, stages = v
                            row_stationary_fp8_block_gemm2_kernel[(blocks * split,)](
                                a, w2, y, topk_w, sorted_slot, block_expert, num_rows, as_, ws, num_slots, hidden,
                                inter, a.stride(0), w2.stride(0), w2.stride(1), y.stride(0), kw["stride_as0"],
                                kw["stride_as1"], kw["stride_ws0"], kw["stride_ws1"], kw["stride_ws2"],
                                SPLIT_N=split, BLOCK_M=block_m, BLOCK_N=min(bn, 128), NUM_KB=triton.cdiv(int(inter), 128),
                                NUM_STAGES=stages, A_ONCE=a_once, num_warps=warps)
                            return y
                        cells.append((f"rows {min(bn, 128)}x{split} w{warps} s{stages}{' a1' if a_once else ''}", proto_b))
                variants_here = []
            else:
                variants_here = variants
            for bn, split, warps, stages in variants_here:
                def proto(v=(bn, split, warps, stages), a=a, w2=w2, y=y, ws=ws, as_=as_, kw=kw, blocks=blocks,
                          block_m=block_m, sorted_slot=sorted_slot, block_expert=block_expert, num_rows=num_rows,
                          topk_w=topk_w, num_slots=num_slots, hidden=hidden, inter=inter):
                    bn, split, warps, stages = v
                    row_stationary_int8_gemm2_kernel[(blocks * split,)](
                        a, w2, y, topk_w, sorted_slot, block_expert, num_rows, as_, ws, num_slots, hidden, inter,
                        a.stride(0), w2.stride(0), w2.stride(1), y.stride(0), kw["stride_as0"], kw["stride_ws0"],
                        kw["stride_ws1"], SPLIT_N=split, BLOCK_M=block_m, BLOCK_N=bn,
                        BLOCK_I=triton.next_power_of_2(inter), NUM_STAGES=stages, num_warps=warps)
                    return y
                cells.append((f"rows {bn}x{split} w{warps} s{stages}", proto))
            from fusedmoe.bench import check_and_time

            for label, fn in cells:
                try:
                    us, err, same = check_and_time([fn], ref, timed=not smoke,
                                                   poison=lambda first, y=y: y.fill_(float("nan")) if first else None)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is a row
                    print(f"{preset} M={tokens} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                rows.append(dict(preset=preset, tokens=tokens, variant=label, us=us, rel_err=err, quant=scheme))
                timing = "" if us is None else f"{us:8.1f} us {flops / (us * 1e-6) / 1e12:6.0f} TOP/s"
                print(f"{preset:16s} M={tokens:<5d} {scheme} {label:26s} {timing}  rel err {err:.1e}", flush=True)
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
    parser.add_argument("--quant", default=None, choices=(None, "int8_w8a8", "fp8_w8a8_block"),
                        help="the library's GEMM2 of this scheme (captured from one call) against the scheme's kernel")
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
    if args.quant:
        rows = quant_rows(args, variants, smoke)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=str(device), torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                          indent=1)
        return 0 if all(r["rel_err"] < 1e-2 for r in rows) else 1
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
