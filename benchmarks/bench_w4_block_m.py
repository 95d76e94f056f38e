"""4-bit weight-only at ~32-128 rows per expert: 64- or 128-row blocks? (H100/H200)

    python benchmarks/bench_w4_block_m.py [--cells mixtral-8x7b:256,qwen3-30b-a3b:1024]
        [--schemes nvfp4_w4a16,mxfp4_w4a16,int4_w4a16_g32] [--json out.json]

The weight-only GEMMs decode every weight tile in registers once per row block, so their time
follows the number of row blocks, not the rows. At Mixtral M=256 (512 slots over 8 experts, 64
rows per expert on average) the library's 64-row blocks give each expert one or two blocks
(~12 in all for random routing): the decode runs ~1.5x per weight. One 128-row block per expert
decodes each tile once at the price of MMAs over padding rows. Per cell and scheme this times
the whole call (`triton_weight_only_experts`, routing excluded, CUDA-graph replay over 4 rotated
weight copies) with the library's plan, then with 128-row tile pairs, and the bf16 kernel on the
same routing; it prints the row blocks of each block size and checks every output against the
library plan's (relative error).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from fusedmoe.activations import is_gated
from fusedmoe.backends.triton.experts import GemmProblem, triton_experts
from fusedmoe.backends.triton.tiles import TileConfig
from fusedmoe.backends.triton.weight_only import (
    choose_weight_only_tiles,
    triton_weight_only_experts,
)
from fusedmoe.bench import _quantized_copy, random_expert_weights, time_rotated
from fusedmoe.presets import get_preset
from fusedmoe.quant.scheme import get_scheme
from fusedmoe.routing import select_experts

GEMM1 = [TileConfig(128, *t) for t in ((64, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 4), (128, 128, 8, 2))]
GEMM2 = [TileConfig(128, *t) for t in ((128, 64, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2))]


def _blocks(ids: torch.Tensor, experts: int, block_m: int) -> int:
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    return int(((counts + block_m - 1) // block_m).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="mixtral-8x7b:256,qwen3-30b-a3b:1024,gpt-oss-120b:1024")
    ap.add_argument("--schemes", default="nvfp4_w4a16,mxfp4_w4a16,int4_w4a16_g32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows = []
    for cell in args.cells.split(","):
        name, tokens = cell.split(":")
        p, tokens = get_preset(name), int(tokens)
        inter = p.intermediate_size // p.bench_tp
        h, gated = p.hidden_size, is_gated(p.activation)
        g = torch.Generator(device=dev).manual_seed(0)
        floats = [random_expert_weights(p.num_experts, h, inter, p.activation, device=dev, dtype=torch.float32,
                                        generator=g)[:2] for _ in range(4)]
        x = torch.randn(tokens, h, device=dev, generator=g).bfloat16()
        topk_w, ids = select_experts(x, torch.randn(tokens, p.num_experts, device=dev, generator=g), p.top_k,
                                     renormalize=not p.apply_router_weight_on_input)
        common = (None, None, None, p.num_experts, p.activation, p.apply_router_weight_on_input, 1.702, None)
        bf16 = [functools.partial(triton_experts, x, w13.bfloat16(), w2.bfloat16(), topk_w, ids, *common)
                for w13, w2 in floats]
        bf16_us = time_rotated(bf16) * 1e6
        blocks = {bm: _blocks(ids, p.num_experts, bm) for bm in (32, 64, 128)}
        print(f"\n{name} M={tokens}: {ids.numel()} slots over {p.num_experts} experts; row blocks "
              + ", ".join(f"{n} of {bm}" for bm, n in blocks.items()) + f"; bf16 {bf16_us:.1f} us")
        del bf16
        for scheme_name in args.schemes.split(","):
            scheme = get_scheme(scheme_name)
            copies = [_quantized_copy(w13, w2, None, None, scheme_name) for w13, w2 in floats]

            def calls(tiles, copies=copies, scheme=scheme, head=(x, topk_w, ids), common=common):
                x_, w_, ids_ = head
                return [functools.partial(triton_weight_only_experts, x_, q13, q2, w_, ids_, *common, scheme,
                                          prm.w13_scale, prm.w2_scale, prm.w13_global_scale, prm.w2_global_scale,
                                          tiles=tiles, direct=False if tiles is not None else None)
                        for q13, q2, _, _, prm in copies]

            problem = GemmProblem(ids.numel(), p.num_experts, h, inter, p.top_k, gated, torch.bfloat16)
            plan = choose_weight_only_tiles(problem, scheme, dev)
            ref = calls(None)[0]().float()
            candidates = [("library", None)] + [("bm128", (t1, t2)) for t1 in GEMM1 for t2 in GEMM2[:1]]
            candidates += [("bm128", (GEMM1[0], t2)) for t2 in GEMM2[1:]]
            best, lib = None, None
            for label, tiles in candidates:
                try:
                    out = calls(tiles)[0]().float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    us = time_rotated(calls(tiles)) * 1e6
                except Exception as e:  # noqa: BLE001 - a tile that cannot run is a row
                    print(f"  {scheme_name} {label} {tiles}: {type(e).__name__}: {str(e).splitlines()[-1][:120]}")
                    continue
                t1, t2 = tiles if tiles is not None else plan
                row = dict(preset=name, tokens=tokens, scheme=scheme_name, label=label,
                           gemm1=t1.as_list(), gemm2=t2.as_list(), us=us,
                           bf16_us=bf16_us, rel_err_vs_library=err, blocks=blocks)
                rows.append(row)
                if label == "library":
                    lib = us
                elif best is None or us < best["us"]:
                    best = row
                print(f"  {scheme_name:16s} {label:8s} g1 {t1.block_m}x{t1.block_n}x{t1.block_k} w{t1.num_warps} "
                      f"s{t1.num_stages}  g2 {t2.block_m}x{t2.block_n}x{t2.block_k} w{t2.num_warps} s{t2.num_stages}"
                      f"  {us:8.1f} us  ({us / bf16_us:.2f}x bf16)  err {err:.1e}", flush=True)
            if best is not None and lib is not None:  # the library's plan ran, and a 128-row pair
                print(f"  {scheme_name}: library {lib:.1f} us, best 128-row {best['us']:.1f} us "
                      f"({best['us'] / lib - 1:+.1%}), bf16 {bf16_us:.1f}")
            del copies
        del floats
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
