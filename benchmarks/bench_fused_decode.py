"""Does one kernel for the whole decode layer beat the direct / aligned paths? (H100/H200)

    python benchmarks/bench_fused_decode.py [--presets a,b] [--tokens 1,4] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_fused_decode.py --smoke      # logic check on the CPU

Issue 3's decode idea: program (slot, I chunk) computes its chunk of the activation
act(x @ w13[e, chunk]^T) with CUDA-core FMAs (a decode row is one token: no tensor-core padding),
multiplies it by the matching columns of w2 and writes an fp32 partial [H]; a combine kernel sums
a token's K x chunks partials in a fixed order (deterministic) into the output. Two launches
instead of the direct path's two or three, no [slots, I] round trip, and the program count
(slots x I / chunk) no longer depends on H tiles: Llama-4's single expert at M=1 gets I / 8 = 128
programs where the direct GEMM2 has 160 H tiles of one slot and GEMM1 64 N tiles.

w2 is read either as stored ([E, H, I], a chunk's columns are CHUNK x 2 bytes of each row) or
from an I-major copy ([E, I, H] viewed as [E, H, I]: a chunk's rows are contiguous), the layout a
weight-processing step could keep (the prefill GEMM2 takes any strides). Times are whole calls
(routing excluded) against the library's aligned and direct paths; outputs are checked against
the library's direct output. Result (H200, results/2026-11-23_h200_fused-decode.*): 2-4x slower
than the library in every cell; not adopted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.kernels import _activation, _pdl_release, _pdl_wait


@triton.jit
def fused_decode_kernel(
    x_ptr, w13_ptr, w2_ptr, part_ptr, topk_w_ptr, ids_ptr,
    hidden, inter, n_chunks, alpha, limit,
    stride_xt, stride_w1e, stride_w1n, stride_w2e, stride_w2h, stride_w2i,
    TOP_K: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    BI: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr,
):
    """Program (c, slot): partial[slot, c, :] = w * (w2[e][:, chunk c] @ act(w13[e][chunk c] @ x[t]))
    with chunk c = SUB consecutive BI-wide slices of I (later slices add into the partial row,
    which only this program touches). Unquantized, no bias, ids in range (prototype)."""
    _pdl_wait(PDL)
    c = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    t = slot // TOP_K
    e = tl.load(ids_ptr + slot).to(tl.int64)
    w = tl.load(topk_w_ptr + slot).to(tl.float32)
    part_row = part_ptr + (slot * n_chunks + c) * hidden
    offs_b = tl.arange(0, BI)
    offs_k = tl.arange(0, BK)
    offs_h = tl.arange(0, BH)
    w1 = w13_ptr + e * stride_w1e
    w2 = w2_ptr + e * stride_w2e
    for sub in tl.static_range(SUB):
        offs_i = (c * SUB + sub) * BI + offs_b
        i_ok = offs_i < inter
        g_rows = w1 + offs_i[:, None].to(tl.int64) * stride_w1n
        acc_g = tl.zeros((BI, BK), dtype=tl.float32)
        acc_u = tl.zeros((BI, BK), dtype=tl.float32)
        for k0 in range(0, hidden, BK):
            k_ok = (k0 + offs_k) < hidden
            xv = tl.load(x_ptr + t * stride_xt + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            m = i_ok[:, None] & k_ok[None, :]
            wg = tl.load(g_rows + (k0 + offs_k)[None, :], mask=m, other=0.0)
            acc_g += wg.to(tl.float32) * xv[None, :]
            if GATED:
                wu = tl.load(g_rows + inter * stride_w1n + (k0 + offs_k)[None, :], mask=m, other=0.0)
                acc_u += wu.to(tl.float32) * xv[None, :]
        a = _activation(tl.sum(acc_g, 1), tl.sum(acc_u, 1), alpha, limit, ACT, False)
        # the library stores the activation in the input dtype: round as it does
        a = tl.where(i_ok, a, 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        for h0 in range(0, hidden, BH):
            h_ok = (h0 + offs_h) < hidden
            w2t = tl.load(w2 + (h0 + offs_h)[:, None].to(tl.int64) * stride_w2h + offs_i[None, :] * stride_w2i,
                          mask=h_ok[:, None] & i_ok[None, :], other=0.0)
            p = tl.sum(w2t.to(tl.float32) * a[None, :], 1) * w
            if sub > 0:
                p += tl.load(part_row + h0 + offs_h, mask=h_ok, other=0.0)
            tl.store(part_row + h0 + offs_h, p, mask=h_ok)
    _pdl_release(PDL)


@triton.jit
def combine_kernel(part_ptr, out_ptr, hidden, rows, stride_ot, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t, :] = sum over the token's `rows` partial rows, in order, in fp32."""
    _pdl_wait(PDL)
    t = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = part_ptr + t * rows * hidden + offs
    for r in range(0, rows):
        acc += tl.load(base + r * hidden, mask=ok, other=0.0)
    _pdl_release(PDL)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fused_call(x, w13, w2, topk_w, ids, activation, bi, sub, bk, bh, warps, stages, block, pdl):
    from fusedmoe.activations import is_gated
    from fusedmoe.backends.triton.experts import ACT_CODES

    T, H = x.shape
    inter = w2.shape[2]
    K = ids.shape[1]
    n_chunks = triton.cdiv(inter, bi * sub)
    part = torch.empty(T * K * n_chunks, H, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    extra = dict(launch_pdl=True) if pdl else {}
    fused_decode_kernel[(n_chunks, T * K)](
        x, w13, w2, part, topk_w, ids, H, inter, n_chunks, 1.702, 7.0,
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        TOP_K=K, ACT=ACT_CODES[activation], GATED=is_gated(activation), BI=bi, SUB=sub, BK=bk, BH=bh, PDL=pdl,
        num_warps=warps, num_stages=stages, **extra,
    )
    combine_kernel[(triton.cdiv(H, block), T)](part, out, H, K * n_chunks, out.stride(0), BLOCK=block, PDL=pdl,
                                               **extra)
    return out


def variants(smoke: bool, inter: int):
    if smoke:
        return [(8, 1, 16, 16, 4, 2, 32), (4, 3, 32, 8, 4, 1, 16)]
    rows = [(bi, 1, bk, 64, warps, 3, 128) for bi, bk, warps in itertools.product((8, 16, 32), (256, 512), (4, 8))]
    rows += [(8, 2, 256, 64, 4, 3, 128), (16, 2, 256, 64, 4, 3, 128)]
    return [r for r in rows if r[0] * r[1] <= inter and r[0] * r[2] <= 8192]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,llama-4-maverick,gpt-oss-120b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--top", type=int, default=6, help="variants kept per cell in the printout")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    from fusedmoe.backends.triton.experts import pdl
    from fusedmoe.bench import decode_cells, preset_shapes

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float16 if smoke else torch.bfloat16
    use_pdl = bool(pdl(device)) if not smoke else False
    shapes = ({"smoke": (6, 4, 40, 24, "silu", 1)} if smoke else
              {name: (*shape, 4) for name, shape in preset_shapes(args.presets).items()})
    ceilings = None  # smoke: nothing timed
    if not smoke:
        from fusedmoe.bench import measure_ceilings

        ceilings = measure_ceilings(device)
        print(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s, PDL {use_pdl}", flush=True)
    rows = []
    i_major = {}  # per shape: w2 I-major (the same values, rows of one intermediate index contiguous over H)
    tokens = [3] if smoke else [int(t) for t in args.tokens.split(",")]
    for cell in decode_cells(shapes, tokens, device, dtype):
        if cell.preset not in i_major:
            i_major[cell.preset] = [(w13, w2.transpose(1, 2).contiguous().transpose(1, 2)) for w13, w2 in cell.weights]
        ref = cell.library(True)[0]()
        cells = [("aligned", cell.library(False)), ("direct", cell.library(True))]
        for layout, wl in (("w2", cell.weights), ("w2T", i_major[cell.preset])):
            for v in variants(smoke, cell.inter):
                bi, sub, bk, bh, warps, _, _ = v
                label = f"fused-{layout}-i{bi}x{sub}-k{bk}-h{bh}-w{warps}"
                cells.append((label, cell.per_copy(fused_call, *v, use_pdl, weights=wl)))
        cell_rows = [r for r in (cell.row(label, calls, ref, ceilings, timed=not smoke) for label, calls in cells)
                     if r is not None]
        rows += cell_rows
        ranked = sorted(cell_rows, key=lambda r: (r["us"] is None, r["us"] or 0))
        shown = [r for r in ranked if not r["variant"].startswith("fused")] + \
            [r for r in ranked if r["variant"].startswith("fused")][:args.top]
        for r in shown + [r for r in cell_rows if r["mismatch"]]:
            timing = "" if r["us"] is None else f"{r['us']:8.1f} us {r['pct_roofline']:6.1f}%"
            print(f"{cell.preset:18s} M={cell.tokens:<3d} {r['variant']:34s} {timing}  rel err "
                  f"{r['rel_err_vs_direct']:.1e}  repeat equal {r['deterministic']}"
                  f"{'  MISMATCH' if r['mismatch'] else ''}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)
    return 0 if not any(r["mismatch"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
