"""Host-side cost of one eager `fused_experts` / `FusedMoE` call (GPU): what Python spends per call
when nothing is captured in a CUDA graph (transformers' eager models, first steps of a server).

    python benchmarks/profile_host.py [--preset qwen3-30b-a3b] [--tokens 1] [--calls 300]
Prints wall time per call (host-bound at decode: the GPU work is a few tens of us) with each
kernel launched through Triton's `JITFunction.run` (FUSEDMOE_TRITON_LAUNCHER=0) and through the
library's cached launcher (fusedmoe.backends.triton.launcher, the default), alternating three
rounds (medians), the GPU time of the same calls replayed in a CUDA graph, and the cProfile
functions with the most own time.
The header says which CPU the process runs on and times three calls that do not involve the
library (a Python function call, a `torch.empty` on the GPU, an empty Triton kernel's launch): the
eager time has differed ~2x between processes on one host and tree, and these tell a slow
process (all three slower) from a slow path in the library (only the library's calls slower).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
import triton

from fusedmoe import FusedMoE, fused_experts, knobs, select_experts
from fusedmoe.bench import host_us, time_rotated
from fusedmoe.presets import get_preset


@triton.jit
def _empty_kernel(ptr):
    pass


def _process_line(dev: torch.device) -> str:
    """Where this process runs and what calls outside the library cost in it."""
    with open("/proc/self/stat") as stat:
        cpu = stat.read().rsplit(")", 1)[1].split()[36]  # field 39: the CPU it last ran on
    buf = torch.empty(16, device=dev)
    return (f"process {os.getpid()}: cpu {cpu} of {len(os.sched_getaffinity(0))} allowed; python call "
            f"{host_us(lambda: None, 20000) * 1e3:.0f} ns, torch.empty(cuda) "
            f"{host_us(lambda: torch.empty(16, device=dev), 2000):.2f} us, empty Triton launch "
            f"{host_us(lambda: _empty_kernel[(1,)](buf), 2000):.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    p = get_preset(args.preset)
    E, K, H, inter = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp
    dev, dt = torch.device("cuda"), torch.bfloat16
    w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) / H**0.5
    w2 = torch.randn(E, H, inter, device=dev, dtype=dt) / inter**0.5
    x = torch.randn(args.tokens, H, device=dev, dtype=dt)
    logits = torch.randn(args.tokens, E, device=dev, dtype=dt)
    w, ids = select_experts(x, logits, K)
    layer = FusedMoE(E, K, H, inter, device=dev, params_dtype=dt)
    for e in range(E):
        layer.load_expert_weight(e, "gate", w13[e, :inter])
        layer.load_expert_weight(e, "up", w13[e, inter:])
        layer.load_expert_weight(e, "down", w2[e])
    layer.process_weights_after_loading()

    calls = {"fused_experts": lambda: fused_experts(x, w13, w2, w, ids),
             "FusedMoE.forward (routing included)": lambda: layer(x, logits)}
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.preset} M={args.tokens}")
    print(_process_line(dev))
    for name, fn in calls.items():
        walls = {False: [], None: []}
        for _ in range(3):
            for way, times in walls.items():
                with knobs.override(TRITON_LAUNCHER=way):
                    times.append(host_us(fn, args.calls, wall=True))
        triton_run, cached = (sorted(walls[way])[1] for way in (False, None))
        gpu = time_rotated([fn] * min(args.calls, 50), iters=5) * 1e6  # one graph of the calls
        print(f"{name:40} eager wall {triton_run:8.1f} us/call via JITFunction.run, {cached:8.1f} via "
              f"the cached launcher   graph replay {gpu:8.1f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        calls["fused_experts"]()
    torch.cuda.synchronize()
    prof.disable()
    print(f"\ncProfile of {args.calls} fused_experts calls, by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
