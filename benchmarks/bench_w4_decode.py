"""Where does the 4-bit weight-only decode spend its time? One expert's GEMM at decode (16 rows,
one live), weights streamed from HBM (8 rotated copies), each variant timed by CUDA-graph replay.

    bf16 / bf16-reg   bf16 weights into the dot straight from the load / through registers
    w4-shipped        the shipped decode: int32 unpack, fp32 value * fp32 group scale, to bf16
    w4-ptx            inline-PTX decode: prmt + lop3 build bf16 pairs, fma.bf16x2 with the scale
    *-noscale         the decode without the group scale (a floor; results not checked)
    *-xsplit          x read contiguously and split into even / odd columns in registers
                      (instead of two stride-2 loads)
    w4-hoist          one unary inline-PTX decode per nibble (no scale) and one dot per group,
                      the group scale applied to the group's fp32 partial: every op between the
                      weight load and the dot is elementwise and unary, so Triton can give the
                      load the dot operand's layout (no shared-memory round trip of the decoded
                      tile); each BK step loads its BK / group groups one by one
SWAP=1 computes acc^T = w^T x^T (the weight tile as the dot's A operand). --ir prints how many
shared-memory allocations and layout conversions each compiled variant has.

    python benchmarks/bench_w4_decode.py [--fmt int4|mxfp4] > result.txt
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton import kernels
from fusedmoe.backends.triton.kernels import _w4_value

# The shipped PTX decode (kernels._w4_ptx_decode), and the same without the scale multiply.
_NOSCALE_TAIL = """
mov.b32 $0, u0;
mov.b32 $1, u1;
mov.b32 $2, u2;
mov.b32 $3, u3;
}
"""
ASM_INT4_NOSCALE = tl.constexpr(kernels.W4_PTX_INT4.value.replace(kernels._W4_PTX_TAIL, _NOSCALE_TAIL))
ASM_E2M1_NOSCALE = tl.constexpr(kernels.W4_PTX_E2M1.value.replace(kernels._W4_PTX_TAIL, _NOSCALE_TAIL))


@triton.jit
def _asm_decode(b, s, FMT: tl.constexpr, SCALE: tl.constexpr):
    if SCALE:
        lo, hi = kernels._w4_ptx_decode(b, s, FMT)
    elif FMT == 0:
        lo, hi = tl.inline_asm_elementwise(ASM_INT4_NOSCALE, "=r,=r,=r,=r,r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(ASM_E2M1_NOSCALE, "=r,=r,=r,=r,r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


# Unary decodes for w4-hoist: 4 bytes in, the 4 low (high) nibbles' values out as bf16, unscaled.
_HOIST_INT4 = """
{
.reg .b32 t0, t1, one, k;
mov.b32 one, 0x3F803F80;
mov.b32 k, 0xC308C308;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
SHIFT
lop3.b32 t0, t0, 0x000F000F, 0x43084308, 0x6A;
lop3.b32 t1, t1, 0x000F000F, 0x43084308, 0x6A;
fma.rn.bf16x2 $0, t0, one, k;
fma.rn.bf16x2 $1, t1, one, k;
}
"""
_HOIST_E2M1 = """
{
.reg .b32 t0, t1, w0, w1, k, neg0;
mov.b32 k, 0x7E807E80;
mov.b32 neg0, 0x80008000;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
SHIFT
shl.b32 w0, t0, 12;
shl.b32 w1, t1, 12;
shl.b32 t0, t0, 6;
shl.b32 t1, t1, 6;
and.b32 w0, w0, 0x80008000;
and.b32 w1, w1, 0x80008000;
lop3.b32 t0, t0, 0x01C001C0, w0, 0xEA;
lop3.b32 t1, t1, 0x01C001C0, w1, 0xEA;
fma.rn.bf16x2 $0, t0, k, neg0;
fma.rn.bf16x2 $1, t1, k, neg0;
}
"""
_HI_SHIFT = "shr.u32 t0, t0, 4;\nshr.u32 t1, t1, 4;"
HOIST_INT4_LO = tl.constexpr(_HOIST_INT4.replace("SHIFT", ""))
HOIST_INT4_HI = tl.constexpr(_HOIST_INT4.replace("SHIFT", _HI_SHIFT))
HOIST_E2M1_LO = tl.constexpr(_HOIST_E2M1.replace("SHIFT", ""))
HOIST_E2M1_HI = tl.constexpr(_HOIST_E2M1.replace("SHIFT", _HI_SHIFT))


@triton.jit
def _hoist_decode(b, FMT: tl.constexpr):
    if FMT == 0:
        lo = tl.inline_asm_elementwise(HOIST_INT4_LO, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(HOIST_INT4_HI, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        lo = tl.inline_asm_elementwise(HOIST_E2M1_LO, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(HOIST_E2M1_HI, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
    return lo, hi


@triton.jit
def w4_hoist_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn,
                    SWAP: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A K step of BLOCK_K covers BLOCK_K / GROUP groups, each loaded, decoded and multiplied on
    its own (one load per group keeps every decode unary and each group's partial separate)."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    offs_j = tl.arange(0, GROUP // 2)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, K // GROUP, BLOCK_K // GROUP):
        for i in tl.static_range(BLOCK_K // GROUP):
            g = g0 + i
            xa = tl.load(x_ptr + offs_m[:, None] * K + (g * GROUP + offs_k)[None, :])
            x_even, x_odd = tl.split(tl.reshape(xa, (BLOCK_M, GROUP // 2, 2)))
            s = tl.load(s_ptr + offs_n * stride_sn + g)
            if SWAP:  # bytes as [n, j]: the A operand [BLOCK_N, GROUP / 2]
                b = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (g * GROUP // 2 + offs_j)[None, :])
                lo, hi = _hoist_decode(b, FMT)
                part = tl.dot(lo, tl.trans(x_even))
                part = tl.dot(hi, tl.trans(x_odd), part)
                acc += part * s[:, None]
            else:
                b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (g * GROUP // 2 + offs_j)[:, None])
                lo, hi = _hoist_decode(b, FMT)
                part = tl.dot(x_even, lo)
                part = tl.dot(x_odd, hi, part)
                acc += part * s[None, :]
    if SWAP:
        acc = tl.trans(acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


@triton.jit
def _acc(acc, x, w, SWAP: tl.constexpr):
    return tl.dot(tl.trans(w), tl.trans(x), acc) if SWAP else tl.dot(x, w, acc)


@triton.jit
def w4_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, flip,
                   W4: tl.constexpr, DECODE: tl.constexpr, XSPLIT: tl.constexpr, SWAP: tl.constexpr, S_BF16: tl.constexpr,
                   FMT: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not W4:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            xa = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :])
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None])
            if DECODE == 4:  # through registers: a runtime xor with 0
                w = (w.to(tl.int16, bitcast=True) ^ flip.to(tl.int16)).to(tl.bfloat16, bitcast=True)
            acc = _acc(acc, xa, w, SWAP)
    else:
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            if XSPLIT:
                xa = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :])
                x_even, x_odd = tl.split(tl.reshape(xa, (BLOCK_M, BLOCK_K // 2, 2)))
            else:
                kk = k0 + 2 * offs_j
                x_even = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :])
                x_odd = tl.load(x_ptr + offs_m[:, None] * K + (kk + 1)[None, :])
            b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k0 // 2 + offs_j)[:, None])
            if BLOCK_K > GROUP:
                groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                s = tl.load(s_ptr + offs_n[None, :] * stride_sn + groups[:, None])
                if S_BF16:  # to bf16 before the broadcast: one cvt per group
                    s = s.to(tl.bfloat16)
                s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_K // GROUP, GROUP // 2, BLOCK_N)),
                               (BLOCK_K // 2, BLOCK_N))
            else:
                s = tl.load(s_ptr + offs_n[None, :] * stride_sn + k0 // GROUP)
                if S_BF16:
                    s = s.to(tl.bfloat16)
            if DECODE == 0:
                bi = b.to(tl.int32)
                lo = (_w4_value(bi & 15, FMT) * s).to(tl.bfloat16)
                hi = (_w4_value((bi >> 4) & 15, FMT) * s).to(tl.bfloat16)
            elif DECODE == 1:
                lo, hi = _asm_decode(b, s, FMT, True)
            elif DECODE == 2:
                lo, hi = _asm_decode(b, s, FMT, False)
            else:
                bi = b.to(tl.int32)
                lo = ((bi & 15) ^ 8).to(tl.bfloat16)
                hi = ((bi >> 4) ^ 8).to(tl.bfloat16)
            acc = _acc(acc, x_even, lo, SWAP)
            acc = _acc(acc, x_odd, hi, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


# (name, W4, DECODE, XSPLIT): DECODE 0 shipped fp32 decode, 1 PTX + scale, 2 PTX without scale,
# 3 plain cast without scale, 4 bf16 weights passed through registers, 5 w4-hoist.
VARIANTS = {
    "bf16": (0, 0, 0), "bf16-reg": (0, 4, 0),
    "w4-shipped": (1, 0, 0), "w4-shipped-xsplit": (1, 0, 1),
    "w4-ptx": (1, 1, 0), "w4-ptx-xsplit": (1, 1, 1), "w4-ptx-noscale-xsplit": (1, 2, 1),
    "w4-cast-noscale-xsplit": (1, 3, 1), "w4-hoist": (1, 5, 1),
}


def _launch(x, ws, ss, out, i, *, variant, swap, fmt, group, bn, bk, stages):
    w, s = ws[i], ss[i]
    N, K = out.shape[1], x.shape[1]
    w4, decode, xsplit = VARIANTS[variant]
    if decode == 5:
        return w4_hoist_kernel[(triton.cdiv(N, bn),)](
            x, w, s, out, N, K, w.stride(0), s.stride(0), SWAP=swap, FMT=fmt, GROUP=group, BLOCK_M=16,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)
    return w4_gemm_kernel[(triton.cdiv(N, bn),)](
        x, w, s, out, N, K, w.stride(0), s.stride(0), 0, W4=w4, DECODE=decode, XSPLIT=xsplit,
        SWAP=swap, S_BF16=decode in (1, 2), FMT=fmt, GROUP=group, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
        num_stages=stages)


def _reference(x, q, s, fmt, group):
    from fusedmoe.quant.formats import int4_unpack, mxfp4_dequantize  # noqa: F401

    lo, hi = (q & 15).int(), (q >> 4).int()
    codes = torch.stack((lo, hi), dim=-1).reshape(q.shape[0], -1)
    if fmt == "int4":
        vals = ((codes ^ 8) - 8).float()
    else:
        table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device=q.device)
        vals = table[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    w = vals * s.float().repeat_interleave(group, dim=1)
    return x.float() @ w.t()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="int4", choices=("int4", "mxfp4"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--stages", default="4")
    ap.add_argument("--ir", action="store_true")
    args = ap.parse_args()
    variants = args.variants.split(",")
    stages_list = [int(m) for m in args.stages.split(",")]
    fmt_code = 0 if args.fmt == "int4" else 1
    group = 32
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; fmt {args.fmt}")
    shapes = {"mixtral-gemm1(1 expert)": (28672, 4096), "qwen3-gemm1(8 experts)": (12288, 2048),
              "deepseek-gemm2(8 experts)": (57344, 256)}
    copies = 8
    for name, (N, K) in shapes.items():
        x = torch.randn(16, K, device=dev, dtype=torch.bfloat16)
        x[1:] = 0  # decode: one live row in a 16-row block
        qs = [torch.randint(0, 256, (N, K // 2), device=dev, dtype=torch.uint8) for _ in range(copies)]
        if args.fmt == "int4":
            ss = [(torch.rand(N, K // group, device=dev) * 0.02 + 0.001).to(torch.bfloat16).float()
                  for _ in range(copies)]
        else:
            ss = [torch.exp2(torch.randint(-8, 2, (N, K // group), device=dev).float()) for _ in range(copies)]
        wb = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        ref = _reference(x, qs[0], ss[0], args.fmt, group)
        out = torch.empty(16, N, device=dev, dtype=torch.float32)
        w4_bytes = N * K // 2 + N * K // group * 4
        print(f"\n{name}: N={N} K={K}; bf16 {N * K * 2 / 1e6:.1f} MB, 4-bit {w4_bytes / 1e6:.1f} MB")
        print(f"{'variant':>24} {'swap':>4} {'BN':>4} {'BK':>4} {'stg':>3} {'us':>8} {'GB/s':>7} {'rel_err':>9}")
        for variant, swap, bn, bk, stages in itertools.product(variants, (0, 1), (64, 128), (group, 128, 256),
                                                              stages_list):
            if bk == group and VARIANTS[variant][1] != 5:
                continue
            w4, decode, _ = VARIANTS[variant]
            cfg = f"{variant:>24} {swap:>4} {bn:>4} {bk:>4} {stages:>3}"
            ws = qs if w4 else wb
            call = functools.partial(_launch, x, ws, ss, out, variant=variant, swap=swap, fmt=fmt_code,
                                     group=group, bn=bn, bk=bk, stages=stages)
            try:
                out.fill_(float("nan"))
                compiled = call(0)
                torch.cuda.synchronize()
                if args.ir:
                    ir = compiled.asm["ttgir"]
                    mma = "v3" if "versionMajor = 3" in ir else "v2" if "versionMajor = 2" in ir else "-"
                    print(f"{cfg} ir: mma {mma}, local_alloc {ir.count('ttg.local_alloc')}, "
                          f"local_load {ir.count('ttg.local_load')}, convert_layout {ir.count('ttg.convert_layout')}")
            except Exception as e:  # noqa: BLE001
                print(f"{cfg} failed: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                continue
            err = float("nan")
            if w4 and decode in (0, 1, 5):
                err = ((out[:1] - ref[:1]).norm() / ref[:1].norm()).item()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(copies * 4):
                    call(i % copies)
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / (copies * 4))
            us = sorted(times)[len(times) // 2]
            nbytes = w4_bytes if w4 else N * K * 2
            print(f"{cfg} {us:8.1f} {nbytes / us / 1e3:7.0f} {err:9.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
