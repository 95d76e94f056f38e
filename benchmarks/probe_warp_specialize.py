"""Does Triton's Hopper warp specialisation run here? A dense persistent bf16 GEMM, with and without
`tl.range(..., warp_specialize=True)`, each variant in its own process under a time limit (H100/H200)

    python benchmarks/probe_warp_specialize.py [--size 8192] [--limit 60]
    python benchmarks/probe_warp_specialize.py --one BM BN BK WARPS STAGES WS [--size N]   # one variant

The MoE GEMMs at M=4096 are compute-bound and run at 50-70% of the bf16 matmul rate (README). The
Hopper kernels that reach ~90% (CUTLASS, DeepGEMM, FlashAttention-3) are warp-specialised: a
producer warp group issues the TMA loads, consumer warp groups run the MMAs and the epilogue. Triton
exposes that as `warp_specialize=True` on a `tl.range` loop. With Triton 3.6 on sm90 the kernel
compiles (in ~1 s, to 12 warps: one producer and two 64-row consumer warp groups for 4 warps
asked), but every specialised variant hung on an H200, this plain dense GEMM included
(`results/2026-11-25_h200_c7ed091_ws_probe.txt`); the one without specialisation ran at 698
TFLOP/s, cuBLAS's rate. A hang is what a variant killed at --limit reports, so rerun this on a newer
Triton before building MoE kernels on it (`bench_persistent_gemm.py --only ws` is the MoE GEMM2).

The epilogue stores through pointers: a descriptor store of the [BM, BN] tile does not compile under
specialisation on sm90 with Triton 3.6 (each consumer warp group owns only half of the rows).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.kernels import _grouped_tile

VARIANTS = (  # BM, BN, BK, warps, stages, WS
    (128, 256, 64, 8, 3, 0), (128, 256, 64, 4, 3, 1), (128, 128, 64, 8, 4, 0),
    (128, 128, 64, 4, 4, 1), (128, 256, 64, 4, 4, 1), (128, 128, 64, 4, 3, 1),
)


@triton.jit
def dense_persistent_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_c,
                            NUM_PROGRAMS: tl.constexpr, GROUP_M: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    """c = a @ b.T (a [M, K], b [N, K], bf16, fp32 accumulation), NUM_PROGRAMS programs striding
    over the tiles in the library's grouped order (`kernels._grouped_tile`)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, warp_specialize=WS):
        pid_m, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([pid_m * BM, kk * BK])
            b = b_desc.load([pid_n * BN, kk * BK])
            acc = tl.dot(a, b.T, acc)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :], acc.to(tl.bfloat16),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


def run_one(bm: int, bn: int, bk: int, warps: int, stages: int, ws: int, size: int) -> str:
    """Time one variant on size^3 (triton.testing.do_bench) and check it against a float32 product."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    torch.manual_seed(0)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.full((size, size), float("nan"), device="cuda", dtype=torch.bfloat16)
    triton.set_allocator(lambda nbytes, align, stream: torch.empty(nbytes, dtype=torch.int8, device="cuda"))
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    a_desc, b_desc = TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk])

    def call():
        dense_persistent_kernel[(programs,)](a_desc, b_desc, c, size, size, size, c.stride(0),
                                             NUM_PROGRAMS=programs, GROUP_M=8, BM=bm, BN=bn, BK=bk,
                                             WS=bool(ws), num_warps=warps, num_stages=stages)

    call()
    torch.cuda.synchronize()
    ref = a.float() @ b.float().T
    err = ((c.float() - ref).norm() / ref.norm()).item()
    flops = 2 * size**3
    ms = triton.testing.do_bench(call, warmup=25, rep=200)
    ms_torch = triton.testing.do_bench(lambda: a @ b.T, warmup=25, rep=200)
    return (f"{bm}x{bn}x{bk} w{warps} s{stages} ws{ws} {size}^3: {ms * 1e3:8.1f} us "
            f"{flops / ms / 1e9:6.0f} TFLOP/s (torch {flops / ms_torch / 1e9:6.0f}) rel err {err:.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--limit", type=int, default=60, help="seconds per variant before it counts as hung")
    parser.add_argument("--one", type=int, nargs=6, metavar=("BM", "BN", "BK", "WARPS", "STAGES", "WS"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm90 for warp specialisation)")
        return 1
    if args.one:
        print(run_one(*args.one, args.size), flush=True)
        return 0
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for variant in VARIANTS:
        label = "{}x{}x{} w{} s{} ws{}".format(*variant)
        cmd = [sys.executable, __file__, "--size", str(args.size), "--one", *map(str, variant)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
        except subprocess.TimeoutExpired:
            print(f"{label}: no result within {args.limit} s (hung)", flush=True)
            continue
        out = done.stdout.strip().splitlines()
        why = out[-1] if done.returncode == 0 and out else f"rc {done.returncode}: {done.stderr.strip()[-300:]}"
        print(why if done.returncode == 0 else f"{label}: {why}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
