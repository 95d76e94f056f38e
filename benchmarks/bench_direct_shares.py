"""How many shares should the direct GEMM2 split a token's slots into? (H100/H200)

    python benchmarks/bench_direct_shares.py [--presets a,b] [--tokens 1,4] [--shares 1,2,4,8]

For each preset (bf16, biases where the preset has them) and token count: the aligned path, the
direct path with the heuristic's tiles (`tiles.direct_gemm2_heuristic`, marked *), and the same
tiles with GEMM2's `split_k` (its shares) forced to each value of --shares; one process, so the
rows compare on one GPU at one clock (rentals differ by up to ~10%). Outputs are checked against
the heuristic direct call (deterministic: bitwise equal repeats). A share is
cdiv(top_k, split_k) whole slots, so split_k past top_k runs top_k shares.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="llama-4-maverick,qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--shares", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=1, help="time every row this many times, in turn (the "
                        "differences between share counts are 5-10%%, about a run's noise)")
    args = parser.parse_args()
    from fusedmoe.activations import is_gated
    from fusedmoe.backends.triton.experts import GemmProblem, direct_tiles, triton_experts
    from fusedmoe.bench import check_and_time, measure_ceilings, random_expert_weights, roofline
    from fusedmoe.presets import get_preset
    from fusedmoe.routing import select_experts

    device, dtype = torch.device("cuda"), torch.bfloat16
    ceilings = measure_ceilings(device)
    print(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s", flush=True)
    for name in args.presets.split(","):
        p = get_preset(name)
        E, K, H, inter = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp
        g = torch.Generator(device=device).manual_seed(0)

        ws = [random_expert_weights(E, H, inter, p.activation, device=device, dtype=dtype, generator=g,
                                    bias=p.has_bias) for _ in range(4)]
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, H, device=device, generator=g).to(dtype)
            topk_w, ids = select_experts(x, torch.randn(tokens, E, device=device, generator=g), K)
            problem = GemmProblem(tokens * K, E, H, inter, K, is_gated(p.activation), dtype)
            t1, t2 = direct_tiles(problem, None, device)

            def calls(direct, tiles=None, x=x, topk_w=topk_w, ids=ids, p=p, E=E, ws=ws):
                return [lambda c=c: triton_experts(x, c[0], c[1], topk_w, ids, c[2], c[3], None, E, p.activation,
                                                   False, 1.702, None, tiles=tiles, direct=direct) for c in ws]

            ref = calls(True)[0]()
            _, _, t_roof, _ = roofline(p, tokens, int(torch.unique(ids).numel()), inter, ceilings)
            rows = [("aligned", calls(False)), (f"direct {t2.split_k}*", calls(True))]
            rows += [(f"direct {s}", calls(True, (t1, dataclasses.replace(t2, split_k=s))))
                     for s in (int(v) for v in args.shares.split(",")) if s != t2.split_k]
            for rep, (label, cs) in itertools.product(range(args.repeat), rows):
                us, err, same = check_and_time(cs, ref)
                print(f"{name:18s} M={tokens:<3d} {label:12s} gemm2 tile {t2.block_n}x{t2.block_k} run {rep} "
                      f"{us:8.1f} us {100 * t_roof / (us * 1e-6):6.1f}%  rel err {err:.1e}  repeat equal {same}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
