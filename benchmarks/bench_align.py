"""Device time of the slot alignments (torch ops, one-program small, one-program chunked, multi-program).

    python benchmarks/bench_align.py [--slots 64,256,...] [--experts 8,128,256] [--block-m 64] [--chunk 1024]
                                     [--multi-chunks 1024] [--chunked-max 32768]

Each cell: median over CUDA-graph replays of 4 calls on different ids (fusedmoe.bench.time_rotated);
every path is checked bitwise against align_torch first. The chunked and multi-program kernels run
at every N (also where `align` routes elsewhere) to show the crossovers: ALIGN_CHUNKED_MAX_SLOTS is
where `multi` beats `chunked`. Several --multi-chunks give one column each (`multi@C`), to pick
ALIGN_MULTI_CHUNK. The chunked kernel is serial in N (~5.5 us per 1024 slots on an H100), so it is
skipped past --chunked-max.
"""

from __future__ import annotations

import argparse
import functools

import torch

from fusedmoe.backends.triton.experts import (
    ALIGN_CHUNK,
    ALIGN_MULTI_CHUNK,
    ALIGN_SMALL_MAX_SLOTS,
    _align_chunked,
    _align_multi,
    _align_small,
    align_torch,
)
from fusedmoe.bench import time_rotated

TOP_K = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", default="64,256,512,1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--experts", default="8,128,256")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=ALIGN_CHUNK)
    ap.add_argument("--multi-chunks", default=str(ALIGN_MULTI_CHUNK))
    ap.add_argument("--chunked-max", type=int, default=32768)
    args = ap.parse_args()
    multi_chunks = [int(v) for v in args.multi_chunks.split(",")]
    paths = {"torch": align_torch, "small": _align_small,
             "chunked": functools.partial(_align_chunked, chunk=args.chunk)}
    for c in multi_chunks:
        paths["multi" if len(multi_chunks) == 1 else f"multi@{c}"] = functools.partial(_align_multi, chunk=c)
    best_multi = [p for p in paths if p.startswith("multi")]
    print(f"{torch.cuda.get_device_name()}, block_m={args.block_m}, chunk={args.chunk}, "
          f"multi chunks={multi_chunks}, top_k<={TOP_K}; us per call")
    print(f"{'N':>6} {'E':>4} " + " ".join(f"{p:>10}" for p in paths) + "  speedup vs torch (chunked, multi)")
    for n in (int(v) for v in args.slots.split(",")):
        for e in (int(v) for v in args.experts.split(",")):
            top_k = min(TOP_K, e, n)
            gen = torch.Generator(device="cuda").manual_seed(n + e)
            ids = [torch.rand(n // top_k, e, generator=gen, device="cuda").topk(top_k, dim=1).indices.int()
                   for _ in range(4)]
            want = align_torch(ids[0], None, e, e, args.block_m)
            us = {}
            for name, fn in paths.items():
                if (name == "small" and n > ALIGN_SMALL_MAX_SLOTS) or (name == "chunked" and n > args.chunked_max):
                    continue
                got = fn(ids[0], None, e, e, args.block_m)
                if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    raise AssertionError(f"{name} differs from align_torch at N={n}, E={e}")
                calls = [functools.partial(fn, x, None, e, e, args.block_m) for x in ids]
                us[name] = time_rotated(calls) * 1e6
            cells = " ".join(f"{us[p]:10.1f}" if p in us else f"{'-':>10}" for p in paths)
            chunked = us["torch"] / us["chunked"] if "chunked" in us else float("nan")
            multi = us["torch"] / min(us[p] for p in best_multi)
            print(f"{n:>6} {e:>4} {cells}  {chunked:.2f}x {multi:.2f}x")


if __name__ == "__main__":
    main()
