"""Which plan and tiles should the 4-bit weight-only path take at decode? (H100/H200)

    python benchmarks/bench_wo_decode.py [--schemes int4_w4a16_g32,mxfp4_w4a16] [--presets a,b]
                                         [--tokens 1,4,16] [--json out.json]

For each preset (bf16 activations, the preset's benchmark TP split, biases where it has them),
scheme and token count, one process (rows compare on one GPU at one clock):
    auto        the library's choice (`experts.choose_plan`)
    aligned     the aligned path, heuristic tiles (`weight_only.choose_weight_only_tiles`)
    direct      the direct decode path, heuristic tiles (`experts.direct_tiles`), when it can run
then, per path, a coordinate search: GEMM1's tile over (BLOCK_N, BLOCK_K, split_k) with GEMM2's
heuristic tile, then GEMM2's over (BLOCK_N, BLOCK_K[, slot shares]) with the best GEMM1 tile.
The weight-only heuristic never splits GEMM1's K (measured before the direct path existed, where
its partials cost more than the few programs lost); the direct path at one token gives GEMM1 one
16-row block per slot, so Llama-4 (one slot, I = 1024) has 16-32 GEMM1 programs for 132 SMs.
Each output is checked against the aligned heuristic call (relative Frobenius error; the paths
sum in different orders) and timed by CUDA-graph replay over 4 rotated weight copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import torch
import triton


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="int4_w4a16_g32,mxfp4_w4a16")
    parser.add_argument("--presets", default="llama-4-maverick,qwen3-30b-a3b,deepseek-v3,qwen3-235b-a22b,"
                        "gpt-oss-120b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--no-search", action="store_true", help="auto / aligned / direct rows only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from fusedmoe.activations import is_gated
    from fusedmoe.backends.triton.experts import (
        GemmProblem,
        choose_plan,
        direct_reason,
        direct_tiles,
    )
    from fusedmoe.backends.triton.tiles import TileConfig, check_tile, tile_mode
    from fusedmoe.backends.triton.weight_only import (
        choose_weight_only_tiles,
        triton_weight_only_experts,
    )
    from fusedmoe.bench import (
        _quantized_copy,
        check_and_time,
        measure_ceilings,
        quant_bytes,
        random_expert_weights,
        roofline,
    )
    from fusedmoe.presets import get_preset
    from fusedmoe.quant.scheme import get_scheme
    from fusedmoe.routing import select_experts

    device, dtype = torch.device("cuda"), torch.bfloat16
    ceilings = measure_ceilings(device)
    print(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    rows, start = [], time.time()
    for name, scheme_name in itertools.product(args.presets.split(","), args.schemes.split(",")):
        p, scheme = get_preset(name), get_scheme(scheme_name)
        quant, group = tile_mode(scheme)
        E, K, H, inter = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp
        gated = is_gated(p.activation)
        g = torch.Generator(device=device).manual_seed(0)
        copies = [_quantized_copy(*random_expert_weights(E, H, inter, p.activation, device=device, dtype=dtype,
                                                         generator=g, bias=p.has_bias), scheme_name)
                  for _ in range(4)]
        w_bytes, a_bytes = quant_bytes(scheme_name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, H, device=device, generator=g).to(dtype)
            topk_w, ids = select_experts(x, torch.randn(tokens, E, device=device, generator=g), K)
            problem = GemmProblem(tokens * K, E, H, inter, K, gated, dtype)
            _, _, t_roof, _ = roofline(p, tokens, int(torch.unique(ids).numel()), inter, ceilings, w_bytes, a_bytes)

            def calls(direct, tiles=None, x=x, topk_w=topk_w, ids=ids, p=p, E=E, scheme=scheme, copies=copies):
                return [lambda c=c: triton_weight_only_experts(
                    x, c[0], c[1], topk_w, ids, c[2], c[3], None, E, p.activation, p.apply_router_weight_on_input,
                    1.702, None, scheme, c[4].w13_scale, c[4].w2_scale, c[4].w13_global_scale,
                    c[4].w2_global_scale, tiles=tiles, direct=direct) for c in copies]

            ref = calls(False)[0]()

            def row(label, direct, tiles, ref=ref, tokens=tokens, name=name, scheme_name=scheme_name,
                    t_roof=t_roof):
                try:
                    us, err, same = check_and_time(calls(direct, tiles), ref)
                except Exception as exc:  # noqa: BLE001 - a tile that cannot compile is a row
                    print(f"{name:16s} {scheme_name:15s} M={tokens:<3d} {label:40s} {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[-1][:160]}", flush=True)
                    return float("inf")
                pct = 100 * t_roof / (us * 1e-6)
                rows.append(dict(preset=name, scheme=scheme_name, tokens=tokens, variant=label, us=us, pct=pct,
                                 rel_err=err, repeat_equal=same,
                                 tiles=None if tiles is None else [dataclasses.asdict(t) for t in tiles]))
                print(f"{name:16s} {scheme_name:15s} M={tokens:<3d} {label:40s} {us:8.1f} us {pct:6.1f}%  "
                      f"rel err {err:.1e}  repeat equal {same}", flush=True)
                return us

            is_direct, _, _ = choose_plan(problem, scheme, device)
            row(f"auto ({'direct' if is_direct else 'aligned'})", None, None)
            paths = [("aligned", False, choose_weight_only_tiles(problem, scheme, device))]
            if direct_reason(problem) is None:
                paths.append(("direct", True, direct_tiles(problem, scheme, device)))
            for label, direct, (t1, t2) in paths:
                best = (row(f"{label} heuristic {_fmt(t1)} / {_fmt(t2)}", direct, (t1, t2)), t1, t2)
                if args.no_search:
                    continue
                for bn, bk, split in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8)):
                    c1 = TileConfig(t1.block_m, bn, bk, 4, 4, split)
                    c1 = _fit(c1, dtype, 2 if gated else 1, True, quant, group, check_tile)
                    if c1 is None or c1 == t1:
                        continue
                    us = row(f"{label} gemm1 {_fmt(c1)}", direct, (c1, t2))
                    best = min(best, (us, c1, t2), key=lambda r: r[0])
                b1 = best[1]
                shares = (1, 2, 4, 8) if direct else (1,)
                for bn, bk, split in itertools.product((32, 64, 128), (128, 256), shares):
                    c2 = _fit(TileConfig(t2.block_m, bn, bk, 4, 4, split), dtype, 1, direct, quant, group, check_tile)
                    if c2 is None or c2 == t2:
                        continue
                    us = row(f"{label} gemm2 {_fmt(b1)} / {_fmt(c2)}", direct, (b1, c2))
                    best = min(best, (us, b1, c2), key=lambda r: r[0])
                print(f"{name:16s} {scheme_name:15s} M={tokens:<3d} BEST {label}: {_fmt(best[1])} / {_fmt(best[2])} "
                      f"{best[0]:.1f} us ({time.time() - start:.0f} s)", flush=True)
        del copies
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=ceilings.device, torch=torch.__version__, triton=triton.__version__,
                           bandwidth=ceilings.bandwidth, rows=rows), f, indent=1)
    return 0 if all(r["rel_err"] < 2e-2 for r in rows) else 1


def _fmt(t) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages} k{t.split_k}"


def _fit(tile, dtype, operands, allow_split, quant, group, check_tile):
    """`tile` with its stages lowered until it fits, or None when it cannot run."""
    while check_tile(tile, dtype=dtype, operands=operands, allow_split=allow_split, quant=quant, group=group):
        if tile.num_stages <= 2:
            return None
        tile = dataclasses.replace(tile, num_stages=tile.num_stages - 1)
    return tile


if __name__ == "__main__":
    raise SystemExit(main())
