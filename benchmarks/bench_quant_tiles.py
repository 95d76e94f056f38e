"""Tile exploration for the quantized Triton paths (GPU): heuristic tiles vs a small grid.

    python benchmarks/bench_quant_tiles.py [--schemes mxfp4_w4a16,...] [--presets ...] [--tokens 1,64,1024]
Times triton_quant_experts by CUDA-graph replay over 4 rotated quantized weight copies
(bench.time_rotated), bf16 activations; prints the heuristic's time, the best grid tile and
the bf16 triton time of the same call, each with % of the roofline at the quantized width.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from fusedmoe import bench, fused_experts, select_experts
from fusedmoe.backends.triton.experts import GemmProblem
from fusedmoe.backends.triton.quant import choose_quant_tiles, triton_quant_experts
from fusedmoe.backends.triton.tiles import TileConfig
from fusedmoe.backends.triton.weight_only import choose_weight_only_tiles
from fusedmoe.bench import _quantized_copy
from fusedmoe.presets import PRESETS
from fusedmoe.quant.scheme import get_scheme


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="mxfp4_w4a16,int4_w4a16_g32,fp8_w8a8_block")
    ap.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,64,1024")
    ap.add_argument("--splits", default="1", help="GEMM1 split_k values to add to the grid (decode)")
    ap.add_argument("--block-m", default="", help="row block sizes for the grid (default: the heuristic's)")
    ap.add_argument("--warps", default="4,8")
    args = ap.parse_args()
    ceil = bench.measure_ceilings()
    grid = [(bn, bk, nw) for bn, bk in ((64, 64), (128, 64), (64, 128), (128, 128), (32, 128), (64, 256), (32, 256),
                                        (128, 256))
            for nw in (int(w) for w in args.warps.split(","))]
    for name in args.presets.split(","):
        p = PRESETS[name]
        inter, h, E, K = p.intermediate_size // p.bench_tp, p.hidden_size, p.num_experts, p.top_k
        gen = torch.Generator(device="cuda").manual_seed(0)
        full = [((torch.randn(E, 2 * inter, h, device="cuda", generator=gen) / h**0.5).bfloat16(),
                 (torch.randn(E, h, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()) for _ in range(4)]
        for scheme in args.schemes.split(","):
            copies = [(q13, q2, prm) for q13, q2, _, _, prm in (_quantized_copy(w13, w2, None, None, scheme)
                                                                for w13, w2 in full)]
            w_bytes = bench.quant_bytes(scheme)
            for m in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
                w, ids = select_experts(x, torch.randn(m, E, device="cuda", generator=gen), K)
                touched = int(torch.unique(ids).numel())
                _, _, t_roof, _ = bench.roofline(p, m, touched, inter, ceil, *w_bytes)

                def call(c, tiles, x=x, w=w, ids=ids, scheme=scheme, E=E, p=p):
                    q13, q2, prm = c
                    return lambda: triton_quant_experts(
                        x, q13, q2, w, ids, None, None, None, E, p.activation, False, 1.702, None, scheme,
                        prm.w13_scale, prm.w2_scale, prm.a13_scale, prm.a2_scale, tiles=tiles,
                        w13_global_scale=prm.w13_global_scale, w2_global_scale=prm.w2_global_scale)

                def timed(tiles, copies=copies, call=call):
                    try:
                        return bench.time_rotated([call(c, tiles) for c in copies], iters=20)
                    except Exception:  # an invalid tile for this scheme
                        return float("inf")

                heur = timed(None)
                bf16 = bench.time_rotated([lambda c=c, x=x, w=w, ids=ids: fused_experts(x, c[0], c[1], w, ids)
                                           for c in full], iters=20)
                sch = get_scheme(scheme)
                prob = GemmProblem(ids.numel(), E, h, inter, K, True, torch.bfloat16)
                if sch.weight_only:
                    h1, h2 = choose_weight_only_tiles(prob, sch, x.device)
                else:
                    h1, h2 = choose_quant_tiles(prob, sch, x.device)
                best = (float("inf"), None)
                by_bm = {}
                block_ms = [int(b) for b in args.block_m.split(",")] if args.block_m else [h1.block_m]
                for bm, (bn, bk, nw), split in itertools.product(block_ms, grid,
                                                                 (int(s) for s in args.splits.split(","))):
                    t1 = TileConfig(bm, bn, bk, nw, 3, split)
                    t2 = TileConfig(bm, bn, bk, nw, 3, 1)
                    t = timed((t1, t2))
                    best = min(best, (t, (bm, bn, bk, nw, split)), key=lambda r: r[0])
                    by_bm[bm] = min(by_bm.get(bm, (float("inf"), None)), (t, (bn, bk, nw, split)), key=lambda r: r[0])
                pct = 100 * t_roof
                print(f"{name:15} {scheme:16} M={m:<5} heur {h1} / {h2}: {heur * 1e6:8.1f} us {pct / heur:5.1f}% | "
                      f"best bm,bn,bk,w,split={best[1]} {best[0] * 1e6:8.1f} us {pct / best[0]:5.1f}% | bf16 triton "
                      f"{bf16 * 1e6:8.1f} us", flush=True)
                if len(by_bm) > 1:
                    print("    best per block_m: " + ", ".join(f"{bm}: {t * 1e6:.1f} us {cfg}" for bm, (t, cfg) in by_bm.items()))


if __name__ == "__main__":
    main()
