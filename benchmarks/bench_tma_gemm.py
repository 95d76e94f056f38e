"""Does loading operands through TMA descriptors speed up our expert GEMMs at large M? (H100/H200)

    python benchmarks/bench_tma_gemm.py [--shapes qwen3-gemm1,...] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_tma_gemm.py --smoke     # logic check on the CPU

The compute-bound cells of the bench (M=4096: 47-63% of roofline, the GEMMs at 370-490
TFLOP/s, docs/perf-notes.md) load both operands with pointer arithmetic (`tl.load`, cp.async
pipelining). This isolates one question before touching `kernels.py`: the grouped GEMM of the
sorted layout, y[r] = a[r] @ w[expert(r)]^T with each expert's rows padded to BLOCK_M (as
`align` lays them out; gemm2's A operand is exactly this, gemm1's is gathered by token instead),
timed with the weights (and A) loaded through host-side `TensorDescriptor`s (TMA on Hopper)
against plain pointer loads, same tiles. Rows are checked against torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton
import triton.language as tl

# name: (experts, rows routed in total at M=4096, N, K); gemm1 N = 2I (gate+up), K = H
SHAPES = {
    "mixtral-gemm1": (8, 4096 * 2, 2 * 14336, 4096),
    "mixtral-gemm2": (8, 4096 * 2, 4096, 14336),
    "qwen3-gemm1": (128, 4096 * 8, 2 * 768, 2048),
    "qwen3-gemm2": (128, 4096 * 8, 2048, 768),
    "deepseek-gemm1": (256, 4096 * 8, 2 * 256, 7168),
    "deepseek-gemm2": (256, 4096 * 8, 7168, 256),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)]


@triton.jit
def grouped_gemm_kernel(
    a, w, y_ptr, block_expert_ptr, num_blocks, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    A_TMA: tl.constexpr, W_TMA: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m, n] = sum_k a[m, k] * w[e(m), n, k] for one BLOCK_M x BLOCK_N tile (grouped order)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    expert = tl.load(block_expert_ptr + pid_m)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A_TMA:
            at = a.load([m0, k0])
        else:
            k_ok = offs_k < K - k0
            at = tl.load(a + offs_m[:, None].to(tl.int64) * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                         mask=k_ok[None, :], other=0.0)
        if W_TMA:  # w viewed as [E * N, K]: rows past this expert's N belong to the next, masked at the store
            wt = w.load([expert * N + n0, k0]).T
        else:
            k_ok = offs_k < K - k0
            wt = tl.load(w + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
                         + (k0 + offs_k)[:, None] * stride_wk, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(at, wt, acc)
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=offs_n[None, :] < N)


def make_problem(experts: int, rows: int, N: int, K: int, block_m: int, device, dtype, seed=0):
    """Sorted rows: uniform routing counts, each expert padded to block_m (padding rows zero)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    counts = torch.bincount(torch.randint(experts, (rows,), generator=g), minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    a = torch.zeros(total, K, dtype=dtype, device=device)
    starts = torch.cumsum(padded, 0) - padded
    for e in range(experts):
        s, c = int(starts[e]), int(counts[e])
        a[s:s + c] = torch.randn(c, K, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(experts, N, K, generator=g) / K**0.5).to(device=device, dtype=dtype)
    block_expert = torch.repeat_interleave(torch.arange(experts), padded // block_m).to(device=device, dtype=torch.int32)
    return a, w, block_expert, counts, starts


def run(a, w, block_expert, tile, a_tma: bool, w_tma: bool, y=None):
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, warps, stages = tile
    E, N, K = w.shape
    num_blocks = block_expert.numel()
    y = torch.empty(a.shape[0], N, dtype=a.dtype, device=a.device) if y is None else y
    a_arg = TensorDescriptor.from_tensor(a, [BM, BK]) if a_tma else a
    w_arg = TensorDescriptor.from_tensor(w.view(E * N, K), [BN, BK]) if w_tma else w
    grid = (num_blocks * triton.cdiv(N, BN),)
    grouped_gemm_kernel[grid](
        a_arg, w_arg, y, block_expert, num_blocks, N, K,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        A_TMA=a_tma, W_TMA=w_tma, GROUP_M=8, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
        num_warps=warps, num_stages=stages,
    )
    return y


def check(y, a, w, counts, starts) -> float:
    worst = 0.0
    for e in range(w.shape[0]):
        s, c = int(starts[e]), int(counts[e])
        if c == 0:
            continue
        ref = a[s:s + c].float() @ w[e].float().T
        err = ((y[s:s + c].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if smoke else "cuda"
    dtype = torch.float16 if smoke else torch.bfloat16
    variants = [("pointers", False, False), ("tma-w", False, True), ("tma-a+w", True, True)]
    shapes = {"smoke-a": (3, 40, 48, 96), "smoke-b": (5, 70, 32, 64)} if smoke else \
        {s: SHAPES[s] for s in args.shapes.split(",")}
    tiles = [(16, 32, 32, 4, 2)] if smoke else TILES
    if not smoke:
        print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    rows = []
    for name, (E, R, N, K) in shapes.items():
        for tile in tiles:
            a, w, be, counts, starts = make_problem(E, R, N, K, tile[0], device, dtype)
            flops = 2 * int(counts.sum()) * N * K
            for label, a_tma, w_tma in variants:
                try:
                    y = run(a, w, be, tile, a_tma, w_tma)
                    err = check(y, a, w, counts, starts)
                    us = float("nan")
                    if not smoke:
                        us = 1e3 * triton.testing.do_bench(functools.partial(run, a, w, be, tile, a_tma, w_tma, y), rep=200)
                    row = dict(shape=name, tile=list(tile), variant=label, us=us,
                               tflops=flops / us / 1e6 if us == us else float("nan"), rel_err=err)
                except Exception as exc:  # a variant that cannot compile here is a row with its reason
                    row = dict(shape=name, tile=list(tile), variant=label, error=f"{type(exc).__name__}: {exc}"[:200])
                rows.append(row)
                print(f"{name:<16} {str(tile):<22} {label:<9} " + (
                    f"{row['us']:9.1f} us {row['tflops']:7.1f} TFLOP/s  err {row['rel_err']:.1e}"
                    if "error" not in row else row["error"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if "error" in r or r["rel_err"] > (1e-2 if dtype == torch.bfloat16 else 1e-3)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
