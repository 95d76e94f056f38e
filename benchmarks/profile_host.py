"""Host-side cost of one eager `fused_experts` / `FusedMoE` call (GPU): what Python spends per call
when nothing is captured in a CUDA graph (transformers' eager models, first steps of a server).

    python benchmarks/profile_host.py [--preset qwen3-30b-a3b] [--tokens 1] [--calls 300] [--quant SCHEME]
                                      [--layout standard|batched]
Prints wall time per call (host-bound at decode: the GPU work is a few tens of us) with each
kernel launched through Triton's `JITFunction.run` (FUSEDMOE_TRITON_LAUNCHER=0), through the
library's cached launcher (fusedmoe.backends.triton.launcher; FUSEDMOE_TRITON_REPLAY=0), and with
the recorded launches replayed as well (fusedmoe.backends.triton.replay, the default),
alternating three rounds (medians), the GPU time of the same calls replayed in a CUDA graph, where the eager
`fused_experts` call's wall time goes by a sampling profiler (a timer signal every --interval-us
records the running Python line and its callers: unlike cProfile, whose per-call overhead
inflates code that makes many small calls, it charges each line the wall time spent in it, C
calls such as a kernel launch included), and the cProfile functions with the most own time (for
their call counts). --quant times a W8A8 or weight-only scheme (weights quantized by
`quantize_weights`; the layer quantizes its bf16 weights at loading, so it is left out for
static activation scales, which need calibration). --layout batched times the one-rank batched
path (dispatch into per-expert buffers, `batched_triton`, combine), whose experts replay too.
The header says which CPU the process runs on and times three calls that do not involve the
library (a Python function call, a `torch.empty` on the GPU, an empty Triton kernel's launch): the
eager time has differed ~2x between processes on one host and tree, and these tell a slow
process (all three slower) from a slow path in the library (only the library's calls slower).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import signal
import time

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


def _where(code, line: int | None = None) -> str:
    path = code.co_filename
    for marker in ("/site-packages/", "/src/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{code.co_firstlineno if line is None else line}({code.co_name})"


def sample(fn, calls: int, interval_us: float) -> tuple[float, collections.Counter, collections.Counter, int]:
    """Run fn `calls` times under a wall-clock timer signal; returns (us a call without the
    sampler's own time, samples by innermost line, samples by function on the stack (once a
    sample), total samples)."""
    stacks: list = []  # (innermost code, its line, the codes on the stack), kept raw: formatted after
    busy = [False]

    def handler(signum, frame):
        if busy[0]:  # a signal during the handler (a slow host): dropped
            return
        busy[0] = True
        t0 = time.perf_counter()
        codes = []
        f = frame
        while f is not None:
            codes.append(f.f_code)
            f = f.f_back
        stacks.append((frame.f_code, frame.f_lineno, codes))
        spent[0] += time.perf_counter() - t0
        busy[0] = False

    spent = [0.0]
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, interval_us * 1e-6, interval_us * 1e-6)
    t0 = time.perf_counter()
    try:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    wall = time.perf_counter() - t0 - spent[0]
    lines: collections.Counter = collections.Counter()
    funcs: collections.Counter = collections.Counter()
    for code, line, codes in stacks:
        lines[_where(code, line)] += 1
        for c in set(codes):
            funcs[_where(c)] += 1
    return wall / calls * 1e6, lines, funcs, len(stacks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--interval-us", type=float, default=97.0, help="the sampler's period")
    ap.add_argument("--top", type=int, default=30, help="rows in each profile table")
    ap.add_argument("--quant", default=None, help="a W8A8 or weight-only scheme the triton backend runs")
    ap.add_argument("--layout", default="standard", choices=["standard", "batched"],
                    help="batched: the one-rank dispatch into per-expert buffers and the batched_triton experts")
    args = ap.parse_args()
    p = get_preset(args.preset)
    E, K, H, inter = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp
    dev, dt = torch.device("cuda"), torch.bfloat16
    w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) / H**0.5
    w2 = torch.randn(E, H, inter, device=dev, dtype=dt) / inter**0.5
    x = torch.randn(args.tokens, H, device=dev, dtype=dt)
    logits = torch.randn(args.tokens, E, device=dev, dtype=dt)
    w, ids = select_experts(x, logits, K)
    q13, q2, params = w13, w2, None
    if args.quant is not None:
        from fusedmoe.quant.weights import quantize_weights

        static = (torch.tensor(6.0), torch.tensor(10.0)) if args.quant.endswith("static") else None
        q13, q2, params = quantize_weights(w13, w2, args.quant, activation_amax=static)
    fmt = args.layout
    calls = {"fused_experts": lambda: fused_experts(x, q13, q2, w, ids, quant=params, activation_format=fmt)}
    if args.quant is None or not args.quant.endswith("static"):
        layer = FusedMoE(E, K, H, inter, device=dev, params_dtype=dt, quant=args.quant, activation_format=fmt)
        for e in range(E):
            layer.load_expert_weight(e, "gate", w13[e, :inter])
            layer.load_expert_weight(e, "up", w13[e, inter:])
            layer.load_expert_weight(e, "down", w2[e])
        layer.process_weights_after_loading()
        calls["FusedMoE.forward (routing included)"] = lambda: layer(x, logits)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.preset} M={args.tokens}"
          f"{'' if args.quant is None else ' ' + args.quant}{'' if fmt == 'standard' else ' ' + fmt}")
    print(_process_line(dev))
    eager: dict[str, float] = {}
    ways = {"JITFunction.run": dict(TRITON_LAUNCHER=False), "cached launcher": dict(TRITON_REPLAY=False),
            "launcher + replay": {}}
    for name, fn in calls.items():
        walls: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(3):
            for way, setting in ways.items():
                with knobs.override(**setting):
                    walls[way].append(host_us(fn, args.calls, wall=True))
        medians = {way: sorted(times)[1] for way, times in walls.items()}
        eager[name] = medians["launcher + replay"]
        gpu = time_rotated([fn] * min(args.calls, 50), iters=5) * 1e6  # one graph of the calls
        print(f"{name:40} eager wall us/call: " + ", ".join(f"{way} {us:.1f}" for way, us in medians.items())
              + f"; graph replay {gpu:.1f} us/call")
    sample(calls["fused_experts"], args.calls, args.interval_us)  # warm
    base = eager["fused_experts"]
    per_call, lines, funcs, n = sample(calls["fused_experts"], max(args.calls, 10000), args.interval_us)
    print(f"\nSampled fused_experts (launcher + replay): {n} samples, {per_call:.1f} us a call under the sampler "
          f"(its handler's time taken out); us below = share of samples x {base:.1f} us, the eager wall above")
    for title, counter in (("by line (innermost frame)", lines), ("by function on the stack (inclusive)", funcs)):
        print(f"  {title}:")
        for where, count in counter.most_common(args.top):
            print(f"    {count / n * base:8.2f} us {count / n:6.1%}  {where}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        calls["fused_experts"]()
    torch.cuda.synchronize()
    prof.disable()
    print(f"\ncProfile of {args.calls} fused_experts calls, by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
