"""Padding rows' cost: one fused_experts call under random and balanced routing (same bytes, same
flops), whole call and per kernel, on a GPU.

    python benchmarks/bench_padding.py deepseek-v3:4096:bf16 qwen3-30b-a3b:1024:int8_w8a8 ...

Random: select_experts on N(0, 1) logits, as `fusedmoe bench`. Balanced: token t's j-th expert is
(t*k + j) % E, so every expert gets exactly T*k/E rows, a multiple of the block size where T*k/E
is one: the aligned GEMMs then run no padding rows. Each cell is preset:tokens:scheme (bf16 or a
`fusedmoe bench --quant` scheme). Results: benchmarks/results/2026-11-24_h200_4d3cb53_padding_probe.txt.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from fusedmoe import fused_experts, select_experts
from fusedmoe.bench import _quantized_copy, balanced_ids, random_expert_weights, time_rotated
from fusedmoe.presets import get_preset


def kernel_times(call, reps: int = 3) -> dict[str, float]:
    """Device time per kernel name (us per call) of `call`, which makes `reps` x 4 calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name[:50]] += evt.device_time / (reps * 4)
    return totals


def main() -> None:
    for cell in sys.argv[1:]:
        name, tokens, scheme = cell.split(":")
        tokens, quant = int(tokens), None if scheme == "bf16" else scheme
        p = get_preset(name)
        inter = p.intermediate_size // p.bench_tp
        gen = torch.Generator(device="cuda").manual_seed(0)
        copies = []
        for _ in range(4):
            w13, w2, b13, b2 = random_expert_weights(p.num_experts, p.hidden_size, inter, p.activation, device="cuda",
                                                     dtype=torch.bfloat16, generator=gen, bias=p.has_bias)
            copies.append(_quantized_copy(w13, w2, b13, b2, quant) if quant else (w13, w2, b13, b2, None))
        x = torch.randn(tokens, p.hidden_size, device="cuda").bfloat16()
        w, ids = select_experts(x, torch.randn(tokens, p.num_experts, device="cuda"), p.top_k)
        balanced = balanced_ids(tokens, p.top_k, p.num_experts, torch.device("cuda"))
        counts = torch.bincount(ids.flatten(), minlength=p.num_experts)
        kw = dict(activation=p.activation, apply_router_weight_on_input=p.apply_router_weight_on_input,
                  backend="triton")

        def calls(route, x=x, w=w, kw=kw, copies=copies):
            return [lambda c=c: fused_experts(x, c[0], c[1], w, route, w13_bias=c[2], w2_bias=c[3], quant=c[4], **kw)
                    for c in copies]

        us = {label: [time_rotated(calls(route)) * 1e6 for _ in range(2)]
              for label, route in (("random", ids), ("balanced", balanced))}
        print(f"{name} M={tokens} {scheme}: random {us['random'][0]:.1f}/{us['random'][1]:.1f} us, balanced "
              f"{us['balanced'][0]:.1f}/{us['balanced'][1]:.1f} us; rows/expert mean {counts.float().mean():.1f} "
              f"min {counts.min().item()} max {counts.max().item()}", flush=True)
        for label, route in (("random", ids), ("balanced", balanced)):
            fns = calls(route)
            totals = kernel_times(lambda fns=fns: [f() for _ in range(3) for f in fns])
            print(f"   {label}: " + "; ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:7]),
                  flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
