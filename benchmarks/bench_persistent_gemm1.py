"""Would a persistent one-dot GEMM1 close the gap to OpenAI's matmul_ogs at large M? (H100/H200)

    python benchmarks/bench_persistent_gemm1.py [--presets a,b] [--tokens 1024,4096] [--tk-src DIR] [--json out.json]
                                                [--only 'tile,pers,pers chunk8'] [--stages 4]
    TRITON_INTERPRET=1 python benchmarks/bench_persistent_gemm1.py --smoke
    ncu --kernel-name regex:one_dot_gemm1 --launch-skip 2 --launch-count 2 \
        python benchmarks/bench_persistent_gemm1.py --eager-pair gpt-oss-120b

At M=4096 matmul_ogs's GEMM1 (gather + fused SwiGLU) led the library's by 12-15% at gpt-oss-120b
and DeepSeek-V3 on the H200 (results/2026-11-25_h200_eb0ebd3_triton_kernels_profile.txt), and the
one-dot GEMM1 (`TileConfig.one_dot`, results/2026-11-27_h200_bdb1fac_one_dot_gemm1.txt) closed
only part of it. matmul_ogs runs one program per SM over the real tiles in a flattened
`tl.range(..., flatten=True, warp_specialize=True)` loop, and loads x's gathered rows without a
mask (rows past an expert's count wrap to live ones; whole K steps need no K mask). A persistent
GEMM1 with two dots lost in every cell (results/2026-11-25_h200_d299ba8_persistent_gemm1_probe.txt);
the one-dot form was not tried persistent.

This prototype is the library's one-dot GEMM1 (unquantized, gated, no bias, the routed weight on
the output; w13 as stored through a [2, BLOCK_N, BLOCK_K] TMA box of its [2E, I, H] view) with
three switches: PERSISTENT (NUM_SMS * per_sm programs over the real tiles, grouped order, the
flattened loop), WS (warp_specialize=True on that loop) and CLAMP (padding rows read x row 0
instead of a masked load, and no K mask where H is a multiple of BLOCK_K). Every variant's
output is checked against the library's GEMM1 on the same alignment, then timed over rotated w13
copies (CUDA-graph replay, median); the library's plan is timed first and last. With --tk-src
(the folder holding `triton_kernels`, see bench_triton_kernels.py) matmul_ogs's GEMM1 on the same
routing is timed beside them (its rows in its own order: timed, not compared).

`--eager-pair PRESET` runs the 128 x 2*128 x 64 tile (8 warps, 4 stages) at M=4096 eagerly, one
program per tile then persistent, twice (for ncu: the second pair). H100
(results/2026-11-27_h100_8da3dc2_ncu_persistent_gemm1.txt): the persistent launch reads 15-20% more
bytes from DRAM at the same throughput (L2 hit rate 34 -> 23% at gpt-oss-120b, 24 -> 14% at
DeepSeek-V3), which is what it loses there. Handing each persistent program CHUNK consecutive
tiles instead (`pers chunk8` / `chunk16`) lost 30-45% more on the H100
(results/2026-11-27_h100_8da3dc2_persistent_gemm1_chunks.txt).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.kernels import _activation, _grouped_tile, _row_block


@triton.jit
def _one_dot_tile(pid_m, pid_n, x_ptr, w_desc, a_ptr, sorted_slot_ptr, block_expert_ptr, num_slots, top_k,
                  hidden, inter, alpha, limit, stride_xt, stride_xh, stride_ar, stride_ai,
                  ACT: tl.constexpr, CLAMP: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, rows, slot, row_ok = _row_block(pid_m, sorted_slot_ptr, block_expert_ptr, num_slots, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if CLAMP:  # padding rows read token 0 (their outputs are padding rows of a)
        x_row = tl.where(row_ok, slot // top_k, 0).to(tl.int64)
    else:
        x_row = (slot // top_k).to(tl.int64)
    x_ptrs = x_ptr + x_row[:, None] * stride_xt + offs_k[None, :] * stride_xh
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if CLAMP and EVEN_K:
            xa = tl.load(x_ptrs)
        elif CLAMP:
            xa = tl.load(x_ptrs, mask=(offs_k < hidden - k0)[None, :], other=0.0)
        else:
            xa = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k < hidden - k0)[None, :], other=0.0)
        w = w_desc.load([2 * expert.to(tl.int32), pid_n * BLOCK_N, k0])
        w = tl.reshape(w, (2 * BLOCK_N, BLOCK_K)).T
        acc = tl.dot(xa, w, acc)
        x_ptrs += BLOCK_K * stride_xh
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    act = _activation(acc_g, acc_u, alpha, limit, ACT, False)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_n[None, :] * stride_ai
    tl.store(a_ptrs, act.to(a_ptr.dtype.element_ty), mask=(offs_n < inter)[None, :])


@triton.jit
def one_dot_gemm1_kernel(
    x_ptr, w_desc, a_ptr, sorted_slot_ptr, block_expert_ptr, num_rows_ptr,
    num_slots, top_k, hidden, inter, alpha, limit, stride_xt, stride_xh, stride_ar, stride_ai,
    ACT: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, WS: tl.constexpr,
    CLAMP: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr = 0,
):
    """a[r, :] = act(gate, up) of x[token(r)] @ w13[e]^T: one tile per program, or (PERSISTENT)
    the grid striding over the real tiles in one flattened loop (WS: warp-specialised). CHUNK > 0:
    each program takes CHUNK consecutive tiles of the grouped order at a time (chunks c, c + G,
    ...; with CHUNK = GROUP_M a chunk is one N tile of a group's row blocks, so an expert's row
    blocks run back to back on one SM and share its weight tile in L2); the last chunk's tiles
    past the end repeat the last tile (the same values written again)."""
    num_n = tl.cdiv(inter, BLOCK_N)
    if PERSISTENT:
        num_m = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
        if CHUNK > 0:
            num_tiles = num_m * num_n
            chunks = tl.cdiv(num_tiles, CHUNK)
            mine = tl.cdiv(chunks - tl.program_id(0), tl.num_programs(0)) * CHUNK
        else:
            mine = tl.cdiv(num_m * num_n - tl.program_id(0), tl.num_programs(0))
        for i in tl.range(0, mine, flatten=True, warp_specialize=WS):
            if CHUNK > 0:
                tile = (tl.program_id(0) + (i // CHUNK) * tl.num_programs(0)) * CHUNK + i % CHUNK
                tile = tl.minimum(tile, num_tiles - 1)
            else:
                tile = tl.program_id(0) + i * tl.num_programs(0)
            pid_m, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
            _one_dot_tile(pid_m, pid_n, x_ptr, w_desc, a_ptr, sorted_slot_ptr, block_expert_ptr, num_slots, top_k,
                          hidden, inter, alpha, limit, stride_xt, stride_xh, stride_ar, stride_ai,
                          ACT, CLAMP, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.num_programs(0) // num_n, num_n, GROUP_M)
        if pid_m * BLOCK_M < tl.load(num_rows_ptr):
            _one_dot_tile(pid_m, pid_n, x_ptr, w_desc, a_ptr, sorted_slot_ptr, block_expert_ptr, num_slots, top_k,
                          hidden, inter, alpha, limit, stride_xt, stride_xh, stride_ar, stride_ai,
                          ACT, CLAMP, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)


def one_dot_call(L, w13: torch.Tensor, tile, *, persistent: bool, ws: bool, clamp: bool, per_sm: int = 1,
                 chunk: int = 0):
    from fusedmoe.activations import SWIGLUOAI_LIMIT
    from fusedmoe.backends.triton.experts import ACT_CODES, _descriptor

    x, a = L.x, L.a
    inter, hidden = a.shape[1], x.shape[1]
    w_desc = _descriptor(w13, (2, tile.block_n, tile.block_k), rows=inter)
    limit = SWIGLUOAI_LIMIT if L.activation == "swigluoai" else 0.0
    tiles = (L.sorted_slot.numel() // tile.block_m) * triton.cdiv(inter, tile.block_n)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    grid = min(tiles, per_sm * sms) if persistent else tiles
    one_dot_gemm1_kernel[(grid,)](
        x, w_desc, a, L.sorted_slot, L.block_expert, L.num_rows, L.num_slots, L.top_k, hidden, inter,
        float(L.swiglu_alpha), float(limit), x.stride(0), x.stride(1), a.stride(0), a.stride(1),
        ACT=ACT_CODES[L.activation], GROUP_M=tile.group_m, PERSISTENT=persistent, WS=ws, CLAMP=clamp,
        EVEN_K=hidden % tile.block_k == 0, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        CHUNK=chunk, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def tk_gemm1_calls(tk, x, logits, top_k, w13s):
    """matmul_ogs's GEMM1 (gather + fused SwiGLU, no bias) per w13 copy on its routing of
    `logits` (the ids both sides use), as bench_triton_kernels.Cell calls it."""
    from bench_triton_kernels import as_kn

    from fusedmoe.activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, interleave_gate_up

    E = logits.shape[1]
    topk_w, ids, bitmatrix = tk.topk.topk(logits, top_k, apply_softmax=True)
    rdata, gather, _ = tk.routing.routing_from_bitmatrix(bitmatrix, topk_w, ids, E, top_k)
    mo = tk.matmul_ogs
    act = mo.FusedActivation(mo.FnSpecs("swiglu", tk.swiglu.swiglu_fn, ("alpha", "limit")),
                             (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT), 2)
    w1s = [as_kn(interleave_gate_up(w13, 1), "kn") for w13 in w13s]
    calls = [lambda w=w: mo.matmul_ogs(x, w, None, rdata, gather_indx=gather, fused_activation=act) for w in w1s]
    return calls, topk_w.float(), ids.to(torch.int32)


def case_rows(name, shape, w13s, x, logits, tk, *, smoke: bool, only: tuple = (), stages: tuple = ()) -> list[dict]:
    """The plan, each one-dot variant (checked against the plan's real rows, then timed) and
    matmul_ogs's GEMM1 (timed) on one routed problem."""
    from fusedmoe.activations import SWIGLUOAI_ALPHA
    from fusedmoe.backends.triton.experts import (
        GemmProblem,
        choose_tiles,
        launch_gemm1,
        prepare_launch,
    )
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import check_variants, time_rotated
    from fusedmoe.routing import select_experts

    E, K, H, inter, act = shape
    t = x.shape[0]
    tk_calls = None
    if tk is not None:
        tk_calls, topk_w, ids = tk_gemm1_calls(tk, x, logits, K, w13s)
    else:
        topk_w, ids = select_experts(x, logits, K)
    t1 = (TileConfig(16, 16, 32, 4, 1) if smoke else
          choose_tiles(GemmProblem(t * K, E, H, inter, K, True, x.dtype), x.device)[0])
    bm = t1.block_m
    L = prepare_launch(x, topk_w, ids, None, E, E, inter, act, False, SWIGLUOAI_ALPHA, None, bm)
    launch_gemm1(L, w13s[0], None, t1)
    live = int(L.num_rows.item())
    # the real rows' indices (CLAMP leaves other values in the padding rows)
    real = torch.nonzero(L.sorted_slot[:live] < L.num_slots).squeeze(1)
    ref = L.a.index_select(0, real)

    def calls(fn):
        return [lambda w=w: fn(w) for w in w13s]

    def check(c):  # NaN-poisoned a, the real rows against ref, twice; then the launches alone timed
        L.a.fill_(float("nan"))
        c[0]()
        out = L.a.index_select(0, real)
        c[0]()
        same = torch.equal(out, L.a.index_select(0, real))
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        return (None if smoke else time_rotated(c) * 1e6), err, same

    plan = ("plan " + str(t1.as_list()), calls(lambda w: launch_gemm1(L, w, None, t1)))
    cells = [plan]
    if smoke:
        shapes_v = [(16, 32, 4, 2)]
    elif stages:
        shapes_v = [(128, 64, 8, s) if bm >= 64 else (64, 64, 4, s) for s in stages]
    else:
        shapes_v = [(128, 64, 8, 3), (128, 64, 8, 4)] if bm >= 64 else [(64, 64, 4, 4), (32, 128, 4, 3)]
    # (label, persistent, warp_specialize, clamp, programs per SM, chunk)
    variants = [("tile", False, False, False, 1, 0), ("tile clamp", False, False, True, 1, 0),
                ("pers", True, False, False, 1, 0), ("pers clamp", True, False, True, 1, 0),
                ("pers chunk8", True, False, False, 1, 8), ("pers chunk16", True, False, False, 1, 16)]
    if not smoke:  # the interpreter runs warp_specialize loops as plain loops
        variants += [("pers ws clamp", True, True, True, 1, 0), ("pers clamp 2/SM", True, False, True, 2, 0)]
    if only:
        variants = [v for v in variants if v[0] in only]
    for bn, bk, warps, n_stages in shapes_v:
        tile = TileConfig(bm, bn, bk, warps, n_stages)
        for label, persistent, ws, clamp, per_sm, chunk in variants:
            fn = (lambda w, tile=tile, p=persistent, s=ws, c=clamp, n=per_sm, k=chunk:  # noqa: E731
                  one_dot_call(L, w, tile, persistent=p, ws=s, clamp=c, per_sm=n, chunk=k))
            cells.append((f"{label} {bm}x{2 * bn}x{bk} w{warps} s{n_stages}", calls(fn)))
    cells.append(("plan again", plan[1]))
    flops = 2 * t * K * H * 2 * inter
    rows = check_variants(f"{name:16s} M={t:<5d}", cells, check, flops, row=dict(preset=name, tokens=t), width=40)
    if tk_calls is not None:
        us = time_rotated(tk_calls) * 1e6
        rate = flops / (us * 1e-6) / 1e12
        print(f"{name:16s} M={t:<5d} {'matmul_ogs gemm1':40s} {us:8.1f} us {rate:6.0f} TFLOP/s", flush=True)
        rows.append(dict(preset=name, tokens=t, variant="matmul_ogs gemm1", us=us, tflops=rate, rel_err=0.0))
    return rows


def eager_pair(name: str) -> None:
    """The one-dot tile at M=4096 eagerly, one program per tile then persistent, twice (ncu)."""
    from fusedmoe.activations import SWIGLUOAI_ALPHA
    from fusedmoe.backends.triton.experts import prepare_launch
    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import preset_shapes, random_expert_weights
    from fusedmoe.routing import select_experts

    E, K, H, inter, act = preset_shapes(name)[name]
    g = torch.Generator("cuda").manual_seed(0)
    w13 = random_expert_weights(E, H, inter, act, device="cuda", dtype=torch.bfloat16, generator=g)[0]
    x = torch.randn(4096, H, device="cuda", generator=g).bfloat16()
    topk_w, ids = select_experts(x, torch.randn(4096, E, device="cuda", generator=g), K)
    L = prepare_launch(x, topk_w, ids, None, E, E, inter, act, False, SWIGLUOAI_ALPHA, None, 128)
    tile = TileConfig(128, 128, 64, 8, 4)
    for _ in range(2):
        for persistent in (False, True):
            one_dot_call(L, w13, tile, persistent=persistent, ws=False, clamp=False)
        torch.cuda.synchronize()


def main() -> int:
    from fusedmoe.activations import is_gated
    from fusedmoe.bench import finish_variants, preset_shapes, random_expert_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="gpt-oss-120b,deepseek-v3,mixtral-8x7b,qwen3-30b-a3b")
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--tk-src", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="", help="comma-separated variant labels to run (tile, pers, pers chunk8, ...)")
    parser.add_argument("--stages", default="", help="comma-separated num_stages of the variants' tile (default 3,4)")
    parser.add_argument("--eager-pair", default=None, metavar="PRESET",
                        help="only run the tile and persistent launches eagerly, twice (for ncu)")
    args = parser.parse_args()
    if args.eager_pair:
        eager_pair(args.eager_pair)
        return 0
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float16 if smoke else torch.bfloat16
    tk = None
    if args.tk_src is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_triton_kernels import load_tk

        tk = load_tk(args.tk_src)
    if smoke:  # odd I (a tail N tile), a K tail; swigluoai and silu
        shapes, tokens = {"smoke": (6, 2, 72, 40, "swigluoai", 1), "smoke-silu": (5, 2, 64, 48, "silu", 1)}, [40]
    else:
        shapes = {name: (*shape, args.copies) for name, shape in preset_shapes(args.presets).items()}
        tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name, (E, K, H, inter, act, copies) in shapes.items():
        if not is_gated(act):
            continue
        g = torch.Generator(device=device).manual_seed(0)
        w13s = [random_expert_weights(E, H, inter, act, device=device, dtype=dtype, generator=g)[0]
                for _ in range(copies)]
        for t in tokens:
            x = torch.randn(t, H, device=device, generator=g).to(dtype)
            logits = torch.randn(t, E, device=device, generator=g)
            rows += case_rows(name, (E, K, H, inter, act), w13s, x, logits, tk, smoke=smoke,
                              only=tuple(v for v in args.only.split(",") if v),
                              stages=tuple(int(v) for v in args.stages.split(",") if v))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return finish_variants(rows, args.json, device)


if __name__ == "__main__":
    raise SystemExit(main())
