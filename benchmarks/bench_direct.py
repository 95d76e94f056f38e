"""The direct decode path against the aligned one, and its GEMM2 tiles (H100/H200).

    python benchmarks/bench_direct.py [--presets a,b] [--tokens 1,4,16] [--sweep-tokens 1] [--json out.json]

Decode on fine-grained experts loses to launch count (docs/perf-notes.md): align, gemm1, gemm2,
reduce. The direct path reads each slot's expert from the ids in GEMM1 and sums a token's slots
in GEMM2 (two launches, three with split-K). Per preset and M this times, routing excluded,
CUDA-graph replay over 4 rotated weight copies (`fusedmoe.bench.time_rotated`):
    aligned   triton_experts(direct=False) with the chosen tiles
    direct    triton_experts(direct=True) with the chosen tiles (`direct_tiles`)
    sweep     (M in --sweep-tokens) direct with GEMM2 tiles BLOCK_N x BLOCK_K x stages
and the % of the roofline (`fusedmoe.bench.roofline`, ceilings measured in the run). Every
direct output is checked against the aligned one (relative error printed).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from fusedmoe.backends.triton.experts import GemmProblem, direct_tiles, triton_experts
from fusedmoe.backends.triton.tiles import TileConfig
from fusedmoe.bench import measure_ceilings, roofline, time_rotated
from fusedmoe.presets import get_preset
from fusedmoe.routing import select_experts

PRESETS = "mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,llama-4-maverick"
SWEEP = [TileConfig(16, n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4, 6))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--sweep-tokens", default="1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    print(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s, {ceilings.bf16_flops / 1e12:.0f} TFLOP/s")
    sweep_tokens = {int(t) for t in args.sweep_tokens.split(",") if t}
    rows = []
    for name in args.presets.split(","):
        p = get_preset(name)
        inter = p.intermediate_size // p.bench_tp
        gated = p.activation in ("silu", "gelu", "gelu_tanh", "swigluoai")
        g = torch.Generator(device=device).manual_seed(0)
        h = p.hidden_size
        copies = []
        for _ in range(4):
            w13 = (torch.randn(p.num_experts, (2 if gated else 1) * inter, h, device=device, generator=g) / h**0.5)
            w2 = torch.randn(p.num_experts, h, inter, device=device, generator=g) / inter**0.5
            b13 = torch.randn(p.num_experts, w13.shape[1], device=device, generator=g) if p.has_bias else None
            b2 = torch.randn(p.num_experts, h, device=device, generator=g) if p.has_bias else None
            copies.append(tuple(None if t is None else t.bfloat16() for t in (w13, w2, b13, b2)))
            del w13, w2
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, h, device=device, generator=g).bfloat16()
            topk_w, ids = select_experts(x, torch.randn(tokens, p.num_experts, device=device, generator=g), p.top_k,
                                         renormalize=not p.apply_router_weight_on_input)
            touched = int(torch.unique(ids).numel())
            _, _, t_roof, _ = roofline(p, tokens, touched, inter, ceilings)

            def calls(p=p, x=x, topk_w=topk_w, ids=ids, weights=copies, **kw):
                return [lambda c=c: triton_experts(x, c[0], c[1], topk_w, ids, c[2], c[3], None, p.num_experts,
                                                   p.activation, p.apply_router_weight_on_input, 1.702, None, **kw)
                        for c in weights]

            aligned = calls(direct=False)[0]()
            problem = GemmProblem(ids.numel(), p.num_experts, h, inter, p.top_k, gated, torch.bfloat16)
            with_tiles = [("aligned", None, dict(direct=False)), ("direct", None, dict(direct=True))]
            if tokens in sweep_tokens:
                t1 = direct_tiles(problem, None, device)[0]
                with_tiles += [("direct", t2, dict(direct=True, tiles=(t1, t2))) for t2 in SWEEP]
            for mode, t2, kw in with_tiles:
                try:
                    out = calls(**kw)[0]()
                    err = ((out.float() - aligned.float()).norm() / aligned.float().norm()).item()
                    t = time_rotated(calls(**kw))
                except Exception as exc:  # noqa: BLE001 - a tile that cannot compile is a row
                    print(f"{name} M={tokens} {mode} {t2}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                row = dict(preset=name, tokens=tokens, mode=mode, gemm2_tile=None if t2 is None else t2.as_list(),
                           us=t * 1e6, pct_roofline=100 * t_roof / t, rel_err_vs_aligned=err)
                rows.append(row)
                tile = "" if t2 is None else f" gemm2 {t2.block_n}x{t2.block_k} s{t2.num_stages}"
                print(f"{name:18s} M={tokens:<3d} {mode:8s}{tile:22s} {t * 1e6:8.1f} us {100 * t_roof / t:6.1f}%"
                      f"  rel err vs aligned {err:.1e}", flush=True)
        copies.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=ceilings.device, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
