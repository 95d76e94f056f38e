"""How fast can Triton run a dense fp8 GEMM with 128x128 block weight scales and 1x128 activation
scales, the form our fp8_w8a8_block MoE GEMMs use? (H100/H200)

    python benchmarks/bench_fp8_block_scaling.py run        # time MODE 0 / 1 / 2 at three shapes
    python benchmarks/bench_fp8_block_scaling.py compile    # sm90 compile on any machine: regs,
                                                            # wgmma waits in the TTGIR

MODE 0: `acc += tl.dot(a, b) * (sa * sb)[:, None]` per K step of 128 (the library's form).
MODE 1: the same with the scaling lagged one step (step k's dot issued before step k-1's partial
        is scaled), hoping Triton keeps one wgmma in flight across the scaling.
MODE 2: no scales, `acc = tl.dot(a, b, acc)`: the fp8 rate of this loop.
MODE 3: two 128-deep K steps per iteration (K a multiple of 256), both dots issued before either
        product is scaled. sm90 compile (2026-11-24, seventeenth session): Triton 3.6 still waits
        (`pendings = 0`) right after each dot, at twice the shared memory; not timed.
No expert gather, no routing: the ceiling of the block-scaled loop itself. Results:
results/2026-11-23_h200_8aa383c_fp8_block_scaling.txt (H200, Triton 3.6): MODE 0 753-841 TFLOP/s
at its best tile, MODE 2 1022-1382, MODE 1 slower than MODE 0 (Triton still waits for each
step's wgmma: `warp_group_dot_wait {pendings = 0}` in both MODE 0 and 1; MODE 2 keeps 1 pending).
"""
import functools
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def gemm(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
         GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    gid = pid // group
    first_m = gid * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsz
    pid_n = (pid % group) // gsz
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    nkb = K // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # MODE 1: the previous step's product
    s_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)  # and its scale
    for k0 in range(0, K, BLOCK_K * (2 if MODE == 3 else 1)):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs)
        if MODE == 3:  # two 128-deep K steps per iteration: both dots issued, then both scaled
            a1 = tl.load(a_ptrs + BLOCK_K, mask=m_ok[:, None], other=0.0)
            b1 = tl.load(b_ptrs + BLOCK_K)
            kb = k0 // 128
            sa = tl.load(sa_ptr + offs_m * nkb + kb, mask=m_ok, other=0.0)
            sa1 = tl.load(sa_ptr + offs_m * nkb + kb + 1, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + (pid_n * BLOCK_N // 128) * nkb + kb)
            sb1 = tl.load(sb_ptr + (pid_n * BLOCK_N // 128) * nkb + kb + 1)
            p0 = tl.dot(a, b)
            p1 = tl.dot(a1, b1)
            acc += p0 * (sa * sb)[:, None]
            acc += p1 * (sa1 * sb1)[:, None]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        elif MODE == 2:  # no scales (the dense fp8 rate of this loop)
            acc = tl.dot(a, b, acc)
        else:
            kb = k0 // 128
            sa = tl.load(sa_ptr + offs_m * nkb + kb, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + (pid_n * BLOCK_N // 128) * nkb + kb)
            if MODE == 0:  # scale each step's dot
                acc += tl.dot(a, b) * (sa * sb)[:, None]
            else:  # lagged: step k's dot issued, then step k-1's product scaled
                cur = tl.dot(a, b)
                acc += prev * s_prev[:, None]
                prev = cur
                s_prev = sa * sb
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MODE == 1:
        acc += prev * s_prev[:, None]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None])


def compile_only(mode, bm, bn, warps, stages):
    """triton.compile for sm90 (no GPU needed; BLOCK_N must divide 128: one weight scale per tile)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "MODE": "constexpr", "GROUP_M": "constexpr"}
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "MODE": mode, "GROUP_M": 8}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    src = ASTSource(gemm, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def run(M, N, K, configs, iters=50):
    dev = "cuda"
    a = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
    sa = torch.rand(M, K // 128, device=dev) + 0.5
    sb = torch.rand(N // 128, K // 128, device=dev) + 0.5
    ref = ((a.float().view(M, K // 128, 128) * sa[:, :, None]).view(M, K)
           @ (b.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K).T)
    for (mode, bm, bn, warps, stages) in configs:
        c = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        f = functools.partial(gemm[grid], a, b, sa, sb, c, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128,
                              MODE=mode, GROUP_M=8, num_warps=warps, num_stages=stages)
        try:
            f()
            torch.cuda.synchronize()
        except Exception as e:  # a config that does not compile or launch is a row, not a stop
            print(f"mode {mode} {bm}x{bn} w{warps} s{stages}: {type(e).__name__} {str(e)[:80]}")
            continue
        err = ((c.float() - ref).norm() / ref.norm()).item() if mode != 2 else float("nan")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                f()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            ts.append(start.elapsed_time(end) * 100)  # us per GEMM
        t = sorted(ts)[len(ts) // 2]
        print(f"M={M} N={N} K={K} mode {mode} {bm}x{bn} w{warps} s{stages}: {t:8.1f} us "
              f"{2*M*N*K/t/1e6:7.1f} TFLOP/s relerr {err:.2e}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        for mode in (0, 1, 2, 3):
            for (bm, bn, w, s) in [(128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4)]:
                k = compile_only(mode, bm, bn, w, s)
                ttgir = k.asm["ttgir"]
                waits = [l.strip()[:120] for l in ttgir.splitlines() if "warp_group_dot_wait" in l]
                asyncs = ttgir.count("isAsync = true")
                from fusedmoe.backends.triton.kernel_report import usage
                u = usage(k)
                print(mode, bm, bn, w, s, "regs", u["regs"], "stack", u["stack"], "smem", u["shared"], u["opcodes"]["QGMMA"], "wgmma",
                      "async dots", asyncs, "waits", [w_.split("pendings = ")[-1][:3] for w_ in waits])
    else:
        cfgs = [(m, bm, bn, w, s) for m in (2, 0, 1) for (bm, bn, w, s) in
                [(128, 128, 8, 4), (128, 128, 4, 4), (128, 128, 8, 3), (64, 128, 4, 4)]]
        for (M, N, K) in [(4096, 4096, 7168), (8192, 3072, 2048), (2048, 7168, 2048)]:
            run(M, N, K, cfgs)
