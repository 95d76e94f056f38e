"""Does the direct GEMM2 finishing a split-K GEMM1's activation (one launch less) win? (H100/H200)

    python benchmarks/bench_fold.py [--presets a,b] [--tokens 1,4] [--quant int4_w4a16_g32] [--json out.json]

The direct decode path (one token, or few slots) runs GEMM1 split over K where it has too few
programs (Llama-4 and DeepSeek-V3 at M=1, the 4-bit weight-only decode): its fp32 gate/up
partials were finished by `moe_act_kernel` (sum, bias, activation, rounding) before the direct
GEMM2 read them. With `experts.FOLD_ACTIVATION` GEMM2 does that on load instead (bitwise the
same values), so the call has one launch less. This times whole library calls with the fold on
and off, alternating rounds in one process (CUDA-graph replay, median, 4 weight copies), checks
the outputs are bitwise equal, and reports whether GEMM1 split at all (no split: nothing folds).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from fusedmoe.backends.triton import experts as experts_mod


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="llama-4-maverick,deepseek-v3,qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--quant", default=None, help="a weight-only scheme (its direct path), else bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from fusedmoe.api import fused_experts
    from fusedmoe.backends.triton import kernels
    from fusedmoe.bench import (
        _quantized_copy,
        measure_ceilings,
        preset_shapes,
        random_expert_weights,
        roofline,
        time_rotated,
    )
    from fusedmoe.presets import get_preset
    from fusedmoe.routing import select_experts

    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    print(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s; torch {torch.__version__}, triton "
          f"{triton.__version__}; quant {args.quant}", flush=True)
    rows = []
    for name, (E, K, H, inter, act) in preset_shapes(args.presets).items():
        g = torch.Generator(device=device).manual_seed(0)
        copies = []
        for _ in range(4):
            w13, w2, _, _ = random_expert_weights(E, H, inter, act, device=device, dtype=torch.bfloat16, generator=g)
            copies.append(_quantized_copy(w13, w2, None, None, args.quant) if args.quant else (w13, w2, None, None, None))
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, H, device=device, generator=g).to(torch.bfloat16)
            w, ids = select_experts(x, torch.randn(tokens, E, device=device, generator=g), K)
            calls = [lambda c=c, x=x, w=w, ids=ids, act=act: fused_experts(x, c[0], c[1], w, ids, activation=act,
                                                                           quant=c[4], backend="triton")
                     for c in copies]
            act_kernel, act_launches = kernels.moe_act_kernel, []

            class Spy:  # counts the activation launches of a split-K GEMM1 (none when folded)
                def __getitem__(self, grid, act_kernel=act_kernel, act_launches=act_launches):
                    act_launches.append(grid)
                    return act_kernel[grid]

            kernels.moe_act_kernel = Spy()
            try:
                outs, times = {}, {True: [], False: []}
                for fold in (True, False):
                    experts_mod.FOLD_ACTIVATION = fold
                    outs[fold] = calls[0]()
                did_fold = bool(act_launches)  # the act kernel ran with the fold off: GEMM1 split
                for _ in range(args.rounds):
                    for fold in (True, False):
                        experts_mod.FOLD_ACTIVATION = fold
                        times[fold].append(time_rotated(calls) * 1e6)
            finally:
                kernels.moe_act_kernel = act_kernel
                experts_mod.FOLD_ACTIVATION = True
            same = torch.equal(outs[True], outs[False])
            touched = int(torch.unique(ids).numel())
            wb = 0.5 if args.quant and "4" in args.quant.split("_")[1] else 2.0
            _, _, t_roof, _ = roofline(get_preset(name), tokens, touched, inter, ceilings, w_bytes=wb)
            on, off = min(times[True]), min(times[False])
            rows.append(dict(preset=name, tokens=tokens, folded=did_fold, us_fold=times[True], us_act_kernel=times[False],
                             bitwise_equal=same))
            print(f"{name:18s} M={tokens:<3d} split GEMM1 folded: {did_fold!s:5s}  fold {on:7.1f} us  act kernel "
                  f"{off:7.1f} us  ({100 * (off - on) / off:+5.1f}%; ~{100 * t_roof / (on * 1e-6):5.1f}% of roofline)  "
                  f"bitwise equal {same}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=ceilings.device, torch=torch.__version__, triton=triton.__version__,
                           quant=args.quant, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
