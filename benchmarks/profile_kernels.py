"""Per-kernel device time of one fused_experts call (torch.profiler), for decode/prefill shapes.

    python benchmarks/profile_kernels.py --presets qwen3-30b-a3b,deepseek-v3 --tokens 1,16,256 [--quant SCHEME] [--pdl]

Programmatic dependent launch is off unless --pdl: under it a kernel starts before the one it
depends on ends and waits inside, so the profiler counts that wait in its time (the alignment
read 34 us at Qwen3-30B M=4096 with PDL, 14.7 alone). The call's own total is `fusedmoe bench`'s.

`--profile-runs N` makes the same calls for an outside profiler instead: after a warm-up call on
every weight copy (compiles, tile lookups), N eager calls on the first copy between
`torch.cuda.profiler.start()` and `stop()`, so `ncu --profile-from-start off` sees only those
(scripts/gpu_check.sh's ncu step):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        python benchmarks/profile_kernels.py --presets gpt-oss-120b --tokens 1 --quant int8_w8a8 --profile-runs 2
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections import defaultdict

import torch

from fusedmoe import fused_experts, knobs
from fusedmoe.bench import _quantized_copy, cell_draws, random_expert_weights
from fusedmoe.presets import get_preset

DEVICE = "cuda"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,llama-4-maverick")
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--quant", default=None, help="a scheme `fusedmoe bench --quant` takes (weights quantized)")
    ap.add_argument("--pdl", action="store_true",
                    help="keep programmatic dependent launch (a kernel's time then includes its wait)")
    ap.add_argument("--profile-runs", type=int, default=0, metavar="N",
                    help="no timing: N eager calls per cell between cudaProfilerStart/Stop, for ncu")
    args = ap.parse_args()
    if args.profile_runs < 0:
        ap.error(f"--profile-runs must be >= 0, got {args.profile_runs}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (torch sees none)")
    with contextlib.nullcontext() if args.pdl else knobs.override(PDL=False):
        profile(args)


def profile(args) -> None:
    """Each preset's problems as `fusedmoe bench` times them: its benchmark TP split, biases where
    the preset has them, 4 weight copies (`bench.random_expert_weights`, quantized as bench does)
    and each cell's routing draws (`bench.cell_draws`), copy i with draw i."""
    device = torch.device(DEVICE)
    copies = 4
    for name in args.presets.split(","):
        p = get_preset(name)
        inter = p.intermediate_size // p.bench_tp
        gen = torch.Generator(device=device).manual_seed(0)
        ws = []  # (w13, w2, b13, b2, QuantParams or None) per copy
        for _ in range(copies):
            w13, w2, b13, b2 = random_expert_weights(p.num_experts, p.hidden_size, inter, p.activation, device=device,
                                                     dtype=torch.bfloat16, generator=gen, bias=p.has_bias)
            ws.append(_quantized_copy(w13, w2, b13, b2, args.quant) if args.quant else (w13, w2, b13, b2, None))
        kw = dict(activation=p.activation, backend=args.backend,
                  apply_router_weight_on_input=p.apply_router_weight_on_input)
        for t in (int(v) for v in args.tokens.split(",")):
            calls = [functools.partial(fused_experts, d[0], c[0], c[1], d[2], d[3], w13_bias=c[2], w2_bias=c[3],
                                       quant=c[4], **kw)
                     for c, d in zip(ws, cell_draws(p, t, copies, 0, device, torch.bfloat16), strict=True)]
            for call in calls:
                call()
            torch.cuda.synchronize()
            if args.profile_runs:
                torch.cuda.profiler.start()
                for _ in range(args.profile_runs):
                    calls[0]()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                print(f"{name} {args.quant or 'bf16'} M={t}: {args.profile_runs} eager calls profiled")
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    for call in calls:
                        call()
                torch.cuda.synchronize()
            totals = defaultdict(float)
            for evt in prof.events():
                if evt.device_type == torch.autograd.DeviceType.CUDA:
                    totals[evt.name[:60]] += evt.device_time / (5 * copies)
            total = sum(totals.values())
            pdl = "PDL on" if args.pdl else "PDL off"
            print(f"{name} {args.quant or 'bf16'} M={t}: device total {total:.1f} us over {len(totals)} kernels ({pdl})")
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {v:8.1f} us  {k}")


if __name__ == "__main__":
    main()
