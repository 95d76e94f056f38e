"""Triton kernel used by the benchmark to measure read bandwidth (jitted code only)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Each program sums a grid-strided share of x: a pure read stream (one float written)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))
