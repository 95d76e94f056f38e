"""4-bit weight-only GEMM at 64 rows per expert: the weight tile as wgmma's B operand (shipped)
or as its A operand (swap AB), on an H100/H200.

    python benchmarks/bench_w4_swap.py [--fmt int4|e2m1] [--shapes mixtral-gemm1,...] [--json out.json]
    python benchmarks/bench_w4_swap.py --ir        # sm90 TTGIR of each variant, no GPU needed
    python benchmarks/bench_w4_swap.py --rows 16 --fmt int4 --variants bf16,shipped,swap,swapjoin   # decode

Where a row block has 64 rows (Mixtral at M=256: 512 slots over 8 experts) the weight-only
GEMMs run on wgmma, whose B operand must sit in shared memory: the shipped kernel decodes each
4-bit weight tile in registers and stores it back to shared memory (STS) before the MMA reads it.
wgmma's A operand may come from registers, so computing the transposed product
acc^T [N, M] = W [N, K] . x^T [K, M] lets the decoded weights go straight into the MMA:
    bf16      bf16 weights, the shipped orientation (the bf16 kernel's GEMM)
    shipped   4-bit, x [M, K] . W^T (decoded tile stored to shared memory for wgmma's B)
    swap      4-bit, W . x^T with x split into even / odd columns in registers (as shipped)
    swapjoin  4-bit, W . x^T with the two nibbles' values interleaved back into k order, so x
              is read as loaded (no split)
One expert's x (64 rows, all live) against E experts' weights stacked along N, 4 rotated weight
copies, CUDA-graph replay; each variant's output is checked against an fp32 reference.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import json

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.kernels import _w4_ptx_decode

SHAPES = {  # name: (N = experts x rows of W, K)
    "mixtral-gemm1": (8 * 28672, 4096),
    "mixtral-gemm2": (8 * 4096, 14336),
    "gptoss-gemm1": (32 * 5760, 2880),
}


@triton.jit
def _w4_tile_jn(w_ptr, s_ptr, offs_n, k0, stride_wn, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(lo, hi) decoded [BLOCK_K / 2, BLOCK_N] tiles of rows offs_n (the shipped orientation: B)."""
    offs_j = tl.arange(0, BLOCK_K // 2)
    b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k0 // 2 + offs_j)[:, None])
    groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    s = tl.load(s_ptr + offs_n[None, :] * stride_sn + groups[:, None]).to(tl.bfloat16)
    s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_K // GROUP, GROUP // 2, BLOCK_N)), (BLOCK_K // 2, BLOCK_N))
    return _w4_ptx_decode(b, s, FMT)


@triton.jit
def _w4_tile_nj(w_ptr, s_ptr, offs_n, k0, stride_wn, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(lo, hi) decoded [BLOCK_N, BLOCK_K / 2] tiles of rows offs_n (swapped: wgmma's A operand)."""
    offs_j = tl.arange(0, BLOCK_K // 2)
    b = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 // 2 + offs_j)[None, :])
    groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + groups[None, :]).to(tl.bfloat16)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), (BLOCK_N, BLOCK_K // 2))
    return _w4_ptx_decode(b, s, FMT)


@triton.jit
def _x_step(x_ptr, offs_m, k0, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's rows at K step k0 as loaded, and their even / odd columns (split in registers)."""
    xa = tl.load(x_ptr + offs_m[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :])
    x_even, x_odd = tl.split(tl.reshape(xa, (BLOCK_M, BLOCK_K // 2, 2)))
    return xa, x_even, x_odd


@triton.jit
def w4_gated_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, INTERLEAVED: tl.constexpr,
                    FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """out [M, N/2] = silu(gate) * up, the library's GEMM1 form. Not INTERLEAVED: gate rows n and up
    rows N/2 + n in one program, two accumulators; INTERLEAVED: row 2i is gate i and 2i + 1 up i,
    one accumulator of BLOCK_N rows, its BLOCK_N / 2 gate / up pairs split in the epilogue."""
    pid_n = tl.program_id(0)
    half = N // 2
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        _, x_even, x_odd = _x_step(x_ptr, offs_m, k0, K, BLOCK_M, BLOCK_K)
        lo, hi = _w4_tile_jn(w_ptr, s_ptr, offs_n, k0, stride_wn, stride_sn, FMT, GROUP, BLOCK_N, BLOCK_K)
        acc_g = tl.dot(x_odd, hi, tl.dot(x_even, lo, acc_g))
        if not INTERLEAVED:
            lo, hi = _w4_tile_jn(w_ptr, s_ptr, offs_n + half, k0, stride_wn, stride_sn, FMT, GROUP, BLOCK_N,
                                 BLOCK_K)
            acc_u = tl.dot(x_odd, hi, tl.dot(x_even, lo, acc_u))
    if INTERLEAVED:
        g, u = tl.split(tl.reshape(acc_g, (BLOCK_M, BLOCK_N // 2, 2)))
        offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        g, u, offs_o = acc_g, acc_u, offs_n
    tl.store(out_ptr + offs_m[:, None] * half + offs_o[None, :], g / (1.0 + tl.exp(-g)) * u)


@triton.jit
def w4_rows_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn,
                   W4: tl.constexpr, SWAP: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xa, x_even, x_odd = _x_step(x_ptr, offs_m, k0, K, BLOCK_M, BLOCK_K)
        if not W4:
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None])
            acc = tl.dot(xa, w, acc)
        elif W4 == 2:  # chunk layout: byte 8c + i holds k = 16c + i (low) and 16c + 8 + i (high)
            offs_j = tl.arange(0, BLOCK_K // 2)
            kk = k0 + (offs_j // 8) * 16 + offs_j % 8
            x_lo = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :])
            x_hi = tl.load(x_ptr + offs_m[:, None] * K + (kk + 8)[None, :])
            lo, hi = _w4_tile_jn(w_ptr, s_ptr, offs_n, k0, stride_wn, stride_sn, FMT, GROUP, BLOCK_N, BLOCK_K)
            acc = tl.dot(x_hi, hi, tl.dot(x_lo, lo, acc))
        elif SWAP == 0:
            lo, hi = _w4_tile_jn(w_ptr, s_ptr, offs_n, k0, stride_wn, stride_sn, FMT, GROUP, BLOCK_N, BLOCK_K)
            acc = tl.dot(x_odd, hi, tl.dot(x_even, lo, acc))
        else:
            lo, hi = _w4_tile_nj(w_ptr, s_ptr, offs_n, k0, stride_wn, stride_sn, FMT, GROUP, BLOCK_N, BLOCK_K)
            if SWAP == 1:
                acc = tl.dot(hi, tl.trans(x_odd), tl.dot(lo, tl.trans(x_even), acc))
            else:
                acc = tl.dot(tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)), tl.trans(xa), acc)
    if SWAP:
        acc = tl.trans(acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


VARIANTS = {"bf16": (0, 0), "shipped": (1, 0), "chunk": (2, 0), "swap": (1, 1), "swapjoin": (1, 2), "gated": (1, 0),
            "interleaved": (1, 0)}
GATED = ("gated", "interleaved")
TILES = [(bn, bk, w, s) for bn, bk, (w, s) in itertools.product((128, 256), (64, 128), ((4, 3), (4, 4), (8, 3)))]
# Decode (16 rows or fewer): narrower N tiles, longer K steps, deeper pipelines.
DECODE_TILES = [(bn, bk, w, s) for bn, bk, (w, s) in itertools.product(
    (64, 128, 256), (128, 256), ((4, 3), (4, 4), (4, 6), (8, 4)))]


def _launch(x, w, s, out, *, variant, fmt, group, bn, bk, warps, stages):
    w4, swap = VARIANTS[variant]
    N, K = w.shape[0], x.shape[1]
    if variant in GATED:
        interleaved = variant == "interleaved"
        if not interleaved:  # half the tile's rows from the gate half, half from the up half
            bn //= 2
        grid = (triton.cdiv(N if interleaved else N // 2, bn),)
        return w4_gated_kernel[grid](x, w, s, out, N, K, w.stride(0), s.stride(0), INTERLEAVED=interleaved, FMT=fmt,
                                     GROUP=group, BLOCK_M=x.shape[0], BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                     num_stages=stages)
    return w4_rows_kernel[(triton.cdiv(N, bn),)](
        x, w, s, out, N, K, w.stride(0), s.stride(0), W4=w4, SWAP=swap, FMT=fmt, GROUP=group,
        BLOCK_M=x.shape[0], BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def _run(x, ws, ss, ref, *, variant, fmt, group, tile) -> dict | None:
    """One variant and tile: checked against `ref`, then timed over the rotated copies."""
    from fusedmoe.bench import time_rotated

    bn, bk, warps, stages = tile
    cols = ws[0].shape[0] // (2 if variant in GATED else 1)
    out = torch.full((x.shape[0], cols), float("nan"), device=x.device)
    calls = [functools.partial(_launch, x, w, s, out, variant=variant, fmt=fmt, group=group, bn=bn, bk=bk,
                               warps=warps, stages=stages) for w, s in zip(ws, ss, strict=True)]
    label = f"  {variant:9s} {bn}x{bk} w{warps} s{stages}"
    try:
        calls[0]()
        err = ((out - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            print(f"{label}: WRONG, rel err {err:.2e}")
            return None
        us = time_rotated(calls) * 1e6
    except Exception as e:  # noqa: BLE001 - a tile that cannot compile is a row
        print(f"{label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:120]}")
        return None
    return dict(variant=variant, tile=list(tile), us=us, rel_err=err)


def _loop_instructions(compiled) -> str:
    """The longest loop of the SASS (a backward branch's span): its instruction count and the
    most frequent opcodes."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    from fusedmoe.backends.triton import kernel_report

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([kernel_report._tool("cuobjdump"), "-sass", path], capture_output=True,
                              text=True, check=True).stdout
    rows = [(int(m.group(1), 16), m.group(2)) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    spans = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass):
        at, to = int(m.group(1), 16), int(m.group(2), 16)
        if to < at:
            spans.append((to, at))
    if not spans:
        return "none"
    lo, hi = max(spans, key=lambda t: t[1] - t[0])
    ops = collections.Counter(op.split(".")[0] for a, op in rows if lo <= a <= hi)
    return f"{sum(ops.values())} instr {dict(ops.most_common(16))}"


def _ir_report(fmt: int, group: int, rows: int) -> None:
    """TTGIR facts per variant for sm90, compiled on this machine (Triton's CUDA backend)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fusedmoe.backends.triton import kernel_report

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32", "K": "i32",
           "stride_wn": "i32", "stride_sn": "i32"}
    for variant, (w4, swap) in VARIANTS.items():
        for bn, bk, warps, stages in ((128, 128, 4, 3), (128, 64, 4, 4), (256, 64, 8, 3), (128, 256, 4, 4)):
            kernel = w4_gated_kernel if variant in GATED else w4_rows_kernel
            consts = dict(FMT=fmt, GROUP=group, BLOCK_M=rows, BLOCK_N=bn // 2 if variant == "gated" else bn,
                          BLOCK_K=bk)
            if variant in GATED:
                consts.update(INTERLEAVED=variant == "interleaved")
            else:
                consts.update(W4=w4, SWAP=swap)
            s = dict(sig, **{k: "constexpr" for k in inspect.signature(kernel.fn).parameters if k not in sig})
            if not w4:
                s["w_ptr"] = "*bf16"
            src = ASTSource(kernel, s, {(list(s).index(k),): v for k, v in consts.items()},
                            {(i,): [["tt.divisibility", 16]] for i in range(8)})
            try:
                c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=warps, num_stages=stages))
            except Exception as e:  # noqa: BLE001
                print(f"{variant:9s} {bn}x{bk} w{warps} s{stages}: {type(e).__name__}: {str(e).splitlines()[-1][:150]}")
                continue
            ir, u = c.asm["ttgir"], kernel_report.usage(c)
            loop = _loop_instructions(c)
            dots = [ln for ln in ir.splitlines() if "warp_group_dot " in ln or "tt.dot " in ln]
            reg_a = sum("dot_op" in ln.split(" : ")[-1].split(" * ")[0] for ln in dots)  # A's type: registers
            print(f"{variant:9s} {bn}x{bk} w{warps} s{stages}: mma {'v3' if 'versionMajor = 3' in ir else 'v2'}, "
                  f"dots {len(dots)} (A in registers {reg_a}), local_alloc {ir.count('ttg.local_alloc')}, "
                  f"local_store {ir.count('ttg.local_store')}, regs {u['regs']}, stack {u['stack']}, "
                  f"shared {u['shared']}, STS {u['opcodes']['STS']}, HGMMA {u['opcodes']['HGMMA']}, "
                  f"main loop {loop}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="e2m1", choices=("int4", "e2m1"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="bf16,shipped,swapjoin")
    ap.add_argument("--ir", action="store_true")
    ap.add_argument("--rows", type=int, default=64, help="x's rows (one row block; 16 for decode)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fmt, group = (0, 32) if args.fmt == "int4" else (1, 16)
    if args.ir:
        _ir_report(fmt, group, args.rows)
        return
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
          f"fmt {args.fmt}, group {group}")
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        rows_m = args.rows
        x = torch.randn(rows_m, K, device=dev, dtype=torch.bfloat16)
        qs = [torch.randint(0, 256, (N, K // 2), device=dev, dtype=torch.uint8) for _ in range(4)]
        if fmt == 0:
            ss = [(torch.rand(N, K // group, device=dev) * 0.02 + 0.001).to(torch.bfloat16).float() for _ in range(4)]
        else:
            ss = [torch.exp2(torch.randint(-8, 2, (N, K // group), device=dev).float()) for _ in range(4)]
        lo, hi = (qs[0] & 15).int(), (qs[0] >> 4).int()
        codes = torch.stack((lo, hi), dim=-1).reshape(N, K)
        if fmt == 0:
            vals = ((codes ^ 8) - 8).float()
        else:
            table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device=dev)
            vals = table[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
        wref = vals * ss[0].repeat_interleave(group, dim=1)
        # the chunk layout of the same codes: byte 8c + i = code(16c + i) | code(16c + 8 + i) << 4
        qc = []
        for q in qs:
            c16 = torch.stack(((q & 15), (q >> 4)), dim=-1).reshape(N, K // 16, 16)
            qc.append((c16[:, :, :8] | (c16[:, :, 8:] << 4)).reshape(N, K // 2).contiguous())
        ref4 = x.float() @ wref.t()
        del vals, codes, lo, hi
        wb = [wref.bfloat16()] + [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        ref16 = x.float() @ wb[0].float().t()
        del wref
        flops = 2 * rows_m * N * K
        w4_bytes = N * K // 2 + N * (K // group) * 4  # the prototype keeps fp32 scales
        print(f"\n{name}: N={N} K={K}, {rows_m} rows; bf16 {N * K * 2 / 1e6:.0f} MB, 4-bit {N * K // 2 / 1e6:.0f} MB "
              f"+ scales; {flops / 1e9:.1f} GFLOP")
        for variant in args.variants.split(","):
            best = None
            for tile in (DECODE_TILES if rows_m <= 16 else TILES):
                ref = ref4 if VARIANTS[variant][0] else ref16
                if variant == "gated":
                    ref = torch.nn.functional.silu(ref[:, :N // 2]) * ref[:, N // 2:]
                elif variant == "interleaved":
                    ref = torch.nn.functional.silu(ref[:, 0::2]) * ref[:, 1::2]
                wsv = {0: wb, 1: qs, 2: qc}[VARIANTS[variant][0]]
                row = _run(x, wsv, ss, ref, variant=variant, fmt=fmt, group=group,
                           tile=tile)
                if row is None:
                    continue
                w_bytes = w4_bytes if VARIANTS[variant][0] else N * K * 2
                row.update(shape=name, rows=rows_m, tflops=flops / row["us"] / 1e6, gbs=w_bytes / row["us"] / 1e3)
                rows.append(row)
                if best is None or row["us"] < best["us"]:
                    best = row
            if best:
                print(f"  {variant:9s} best {best['tile']}: {best['us']:8.1f} us {best['tflops']:6.0f} TFLOP/s "
                      f"{best['gbs']:6.0f} GB/s of weights "
                      f"rel err {best['rel_err']:.1e}", flush=True)
        del qs, qc, ss, wb
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, fmt=args.fmt, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
