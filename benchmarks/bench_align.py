"""Device time of the three slot alignments (torch ops, one-program small, one-program chunked).

    python benchmarks/bench_align.py [--slots 64,256,...] [--experts 8,128,256] [--block-m 64] [--chunk 1024]

Each cell: median over CUDA-graph replays of 4 calls on different ids (fusedmoe.bench.time_rotated);
every path is checked bitwise against align_torch first. The chunked kernel runs at every N (also
past ALIGN_MAX_SLOTS, where `align` routes to torch) to show the crossover.
"""

from __future__ import annotations

import argparse
import functools

import torch

from fusedmoe.backends.triton.experts import (
    ALIGN_CHUNK,
    ALIGN_SMALL_MAX_SLOTS,
    _align_chunked,
    _align_small,
    align_torch,
)
from fusedmoe.bench import time_rotated

TOP_K = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", default="64,256,512,2048,8192,32768")
    ap.add_argument("--experts", default="8,128,256")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=ALIGN_CHUNK)
    args = ap.parse_args()
    chunked = functools.partial(_align_chunked, chunk=args.chunk)
    paths = {"torch": align_torch, "small": _align_small, "chunked": chunked}
    print(f"{torch.cuda.get_device_name()}, block_m={args.block_m}, chunk={args.chunk}, top_k<={TOP_K}; us per call")
    print(f"{'N':>6} {'E':>4} " + " ".join(f"{p:>8}" for p in paths) + "  speedup(chunked vs torch)")
    for n in (int(v) for v in args.slots.split(",")):
        for e in (int(v) for v in args.experts.split(",")):
            top_k = min(TOP_K, e, n)
            gen = torch.Generator(device="cuda").manual_seed(n + e)
            ids = [torch.rand(n // top_k, e, generator=gen, device="cuda").topk(top_k, dim=1).indices.int()
                   for _ in range(4)]
            want = align_torch(ids[0], None, e, e, args.block_m)
            us = {}
            for name, fn in paths.items():
                if name == "small" and n > ALIGN_SMALL_MAX_SLOTS:
                    continue
                got = fn(ids[0], None, e, e, args.block_m)
                if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    raise AssertionError(f"{name} differs from align_torch at N={n}, E={e}")
                calls = [functools.partial(fn, x, None, e, e, args.block_m) for x in ids]
                us[name] = time_rotated(calls) * 1e6
            cells = " ".join(f"{us[p]:8.1f}" if p in us else f"{'-':>8}" for p in paths)
            ratio = us["torch"] / us["chunked"] if "chunked" in us else float("nan")
            print(f"{n:>6} {e:>4} {cells}  {ratio:.2f}x")


if __name__ == "__main__":
    main()
