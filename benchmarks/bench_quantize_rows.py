"""quantize_rows_kernel alone on a GPU: per-token int8 codes of fp32 rows (the W8A8 intermediate,
and x-like widths), us and GB/s over rows per program and warps.

    python benchmarks/bench_quantize_rows.py [--rows 1,2,4] [--warps 2,4]

Each shape [rows, width] has `live` rows read (HAS_NUM_ROWS, as the aligned intermediate's padded
capacity); CUDA-graph replay over 4 input copies (fusedmoe.bench.time_rotated). Results:
benchmarks/results/2026-11-24_h200_4d3cb53_quantize_rows.txt (quant._launch_rows' choice).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from fusedmoe.backends.triton import quant_kernels
from fusedmoe.bench import time_rotated

SHAPES = ((16256, 768, 12288), (49152, 768, 41000), (8192, 2048, 8192), (12288, 384, 10000), (16384, 2880, 16384))


def time_rows(m: int, k: int, live: int, block_r: int, warps: int) -> tuple[float, float]:
    """(us, GB/s of live rows read and codes written) of one launch over [m, k] fp32 rows."""
    xs = [torch.randn(m, k, device="cuda") for _ in range(4)]
    q = torch.empty(m, k, device="cuda", dtype=torch.int8)
    s = torch.empty(m, 1, device="cuda")
    num_rows = torch.tensor([live], device="cuda", dtype=torch.int32)

    def call(x):
        quant_kernels.quantize_rows_kernel[(triton.cdiv(m, block_r), 1)](
            x, q, s, x, s, num_rows, s, m, k, k, 0, x.stride(0), x.stride(1), q.stride(0), q.stride(1),
            s.stride(0), s.stride(1), IS_INT=True, SOFT_FP8=False, SCALE_IN=0, HAS_ROW_W=False,
            HAS_NUM_ROWS=True, BLOCK_R=block_r, BLOCK_K=triton.next_power_of_2(k), ONE_PASS=True,
            num_warps=warps)

    us = time_rotated([lambda x=x: call(x) for x in xs]) * 1e6
    return us, live * k * (4 + 1) / us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--warps", default="2,4,8")
    args = ap.parse_args()
    for m, k, live in SHAPES:
        best = None
        for block_r, warps in itertools.product(map(int, args.rows.split(",")), map(int, args.warps.split(","))):
            if block_r * triton.next_power_of_2(k) > 32768:
                continue
            us, gbs = time_rows(m, k, live, block_r, warps)
            print(f"[{m}, {k}] live {live}: block_r {block_r:2d} warps {warps}: {us:7.1f} us {gbs:6.0f} GB/s", flush=True)
            if best is None or us < best[0]:
                best = (us, block_r, warps)
        print(f"BEST [{m}, {k}]: {best}", flush=True)


if __name__ == "__main__":
    main()
