"""Decode sweep (GPU): the fused decode kernel over its tiles vs the align + two-GEMM path.

    python benchmarks/bench_decode.py [--presets a,b] [--tokens 1,2,4,8,16,32]
Times by CUDA-graph replay over 4 rotated weight copies (bench.time_rotated), bf16. Prints per
(preset, M): the two-GEMM time (tuned/heuristic tiles), the heuristic decode tile's time, the best
decode tile and its time, each with % of the memory roofline.
"""

from __future__ import annotations

import argparse

import torch

from fusedmoe import bench, select_experts
from fusedmoe.backends.triton.experts import GemmProblem, choose_tiles, triton_experts
from fusedmoe.backends.triton.tiles import DecodeConfig, check_decode, decode_heuristic
from fusedmoe.presets import PRESETS


def timed(p, copies, x, w, ids, **kw) -> float:
    """Median seconds per call of triton_experts over the rotated weight copies."""
    def call(c):
        return lambda: triton_experts(x, c[0], c[1], w, ids, c[2], c[3], None, p.num_experts, p.activation,
                                      p.apply_router_weight_on_input, 1.702, None, **kw)
    return bench.time_rotated([call(c) for c in copies], iters=50)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(bench.TARGET_PRESETS))
    ap.add_argument("--tokens", default="1,2,4,8,16")
    args = ap.parse_args()
    ceil = bench.measure_ceilings()
    print(f"{ceil.device}: {ceil.bandwidth / 1e12:.2f} TB/s, {ceil.bf16_flops / 1e12:.0f} TFLOP/s")
    grid = [DecodeConfig(bi, bh, nw, st) for bi in (16, 32, 64) for bh in (64, 128, 256, 512) for nw in (4,)
            for st in (3, 5) if 2048 <= bi * bh <= 8192]
    grid = [c for c in grid if check_decode(c, torch.bfloat16) is None]
    for name in args.presets.split(","):
        p = PRESETS[name]
        inter, h, E, K = p.intermediate_size // p.bench_tp, p.hidden_size, p.num_experts, p.top_k
        gated = p.activation in ("silu", "gelu", "gelu_tanh", "swigluoai")
        rows = 2 * inter if gated else inter
        gen = torch.Generator(device="cuda").manual_seed(0)
        copies = [((torch.randn(E, rows, h, device="cuda", generator=gen) / h**0.5).bfloat16(),
                   (torch.randn(E, h, inter, device="cuda", generator=gen) / inter**0.5).bfloat16(),
                   torch.randn(E, rows, device="cuda", generator=gen).bfloat16() if p.has_bias else None,
                   torch.randn(E, h, device="cuda", generator=gen).bfloat16() if p.has_bias else None)
                  for _ in range(4)]
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
            w, ids = select_experts(x, torch.randn(m, E, device="cuda", generator=gen), K,
                                    renormalize=not p.apply_router_weight_on_input)
            touched = int(torch.unique(ids).numel())
            _, _, t_roof, _ = bench.roofline(p, m, touched, inter, ceil)

            def run(**kw):
                return timed(p, copies, x, w, ids, **kw)  # noqa: B023 (called inside this iteration)

            problem = GemmProblem(ids.numel(), E, h, inter, K, gated, torch.bfloat16)
            two = run(tiles=choose_tiles(problem, x.device))
            ref = triton_experts(x, *copies[0][:2], w, ids, *copies[0][2:], None, E, p.activation,
                                 p.apply_router_weight_on_input, 1.702, None, tiles=choose_tiles(problem, x.device))
            heur = decode_heuristic(ids.numel(), inter, h)
            out = triton_experts(x, *copies[0][:2], w, ids, *copies[0][2:], None, E, p.activation,
                                 p.apply_router_weight_on_input, 1.702, None, decode=heur)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t_heur = run(decode=heur)
            best = min(((run(decode=c), c) for c in grid), key=lambda r: r[0])
            def pct(t, t_roof=t_roof):
                return 100 * t_roof / t
            print(f"{name:17} M={m:<3} E_act={touched:<4} two-gemm {two * 1e6:7.1f} us {pct(two):5.1f}% | "
                  f"decode heur {heur.block_i}x{heur.block_h}w{heur.num_warps}s{heur.num_stages} {t_heur * 1e6:7.1f} us "
                  f"{pct(t_heur):5.1f}% | best {best[1].block_i}x{best[1].block_h}w{best[1].num_warps}s{best[1].num_stages} "
                  f"{best[0] * 1e6:7.1f} us {pct(best[0]):5.1f}% | err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
