"""Does one persistent cooperative launch with grid barriers beat the direct decode path? (H100/H200)

    python benchmarks/bench_coop_decode.py [--presets a,b] [--tokens 1,4] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_coop_decode.py --smoke      # logic check on the CPU

The direct path (`experts.choose_plan`, one token) launches GEMM1 (+ the split-K activation
kernel) and the direct GEMM2 (+ the reduce of its slot shares): 2-4 kernels, each with its own
ramp (first loads in flight) and tail (last wave). At M=1 the whole layer streams 31-75 MB, 7-18
us at the roofline, so those ramps and tails are a large share (Qwen3-30B M=1: GEMM1 50 MB in 16.3
us, GEMM2 25 MB in 9.6 + 1.3). Here one cooperative launch (`launch_cooperative_grid=True`: every
program resident at once) runs the phases back to back with grid barriers between them:

    A  GEMM1 items (slot, N tile, K share), one flattened loop over (item, K step) per program so
       the weight loads of consecutive items pipeline; fp32 gate/up partials per share, or the
       activation at once when there is one share
    B  (shares > 1) a[slot, :] = act(sum of the shares' partials), in share order
    C  GEMM2 items (token, H tile, slot share), flattened over (item, slot, K step) as the direct
       GEMM2; fp32 partials per share, or the output at once when there is one share
    D  (shares > 1) out[t, :] = sum of the partials, in share order

Deterministic (every sum in a fixed order). The barrier: one arrival counter and a generation
word (sense reversal, self-resetting, so graph replays need no memset). PHASE selects one phase
per launch instead (the interpreter runs programs one after another, so a barrier would never
open there): --smoke checks the phases' logic that way, the GPU runs the barrier form.
Unquantized, gated activations, no bias, ids in range (a prototype; the library checks those).
Times are whole calls (routing excluded) against the library's auto plan; outputs are checked
against the library's direct output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.kernels import _activation


@triton.jit
def _grid_sync(bar_ptr, nprog):
    """Every program of the grid waits here until all have arrived; stores before are visible to
    loads after (gpu-scope acquire / release around a CTA barrier)."""
    tl.debug_barrier()
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    old = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if old == nprog - 1:  # the last to arrive resets the count and opens the barrier
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
    else:
        cur = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
        while cur == gen:
            cur = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _sum_shares(base, share_stride, offs, ok, SHARES: tl.constexpr, BLOCK: tl.constexpr):
    """sum over s < SHARES of base[s * share_stride + offs] in fp32, in share order (L2 reads:
    written by other programs before the last barrier)."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SHARES):
        acc += tl.load(base + s * share_stride + offs, mask=ok, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _pick(sel, values, other):
    return tl.sum(tl.where(sel, values, other), 0)


@triton.jit
def coop_decode_kernel(
    x_ptr, w13_ptr, w2_ptr, out_ptr, topk_w_ptr, ids_ptr, a_ptr, hpart_ptr, part_ptr, bar_ptr,
    num_tokens, num_experts, hidden, inter, alpha, limit,
    stride_xt, stride_w1e, stride_w1n, stride_w2e, stride_w2h, stride_ot,
    TOP_K: tl.constexpr, S_P: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
    SPLIT1: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
    SPLIT2: tl.constexpr, PER: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
    BA: tl.constexpr, BH: tl.constexpr, PHASE: tl.constexpr,
):
    """PHASE 0: all phases with grid barriers (cooperative launch); 1-4: phase A-D alone."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    S = num_tokens * TOP_K
    ss = tl.arange(0, S_P)
    e_all = tl.load(ids_ptr + ss, mask=ss < S, other=-1).to(tl.int64)
    ok_all = (ss < S) & (e_all >= 0) & (e_all < num_experts)
    e_all = tl.where(ok_all, e_all, 0)
    live_all = ok_all.to(tl.int32)
    w_all = tl.where(ok_all, tl.load(topk_w_ptr + ss, mask=ss < S, other=0.0).to(tl.float32), 0.0)
    lanes = tl.arange(0, 16)[:, None]
    lane0 = lanes == 0
    row0 = lanes * 0

    # ---- A: GEMM1 over (slot, N tile, K share) items
    if PHASE == 0 or PHASE == 1:
        nt1 = tl.cdiv(inter, BN1)
        items = S * nt1 * SPLIT1
        kps = tl.cdiv(tl.cdiv(hidden, SPLIT1), BK1) * BK1
        ksteps = kps // BK1
        mine = tl.cdiv(tl.maximum(items - pid, 0), nprog)
        offs_k = tl.arange(0, BK1)
        offs_b = tl.arange(0, BN1)
        acc_g = tl.zeros((16, BN1), dtype=tl.float32)
        acc_u = tl.zeros((16, BN1), dtype=tl.float32)
        for it in range(0, mine * ksteps):
            i = it // ksteps
            ks = it - i * ksteps
            w = pid + i * nprog
            slot = w // (nt1 * SPLIT1)
            r = w - slot * (nt1 * SPLIT1)
            nti = r // SPLIT1
            sp = r - nti * SPLIT1
            sel = ss == slot
            e = _pick(sel, e_all, 0)
            live = _pick(sel, live_all, 0)
            token = (slot // TOP_K).to(tl.int64)
            k0 = sp * kps + ks * BK1
            k_ok = offs_k < live * (hidden - k0)
            offs_n = nti * BN1 + offs_b
            n_ok = offs_n < inter
            xa = tl.load(x_ptr + token * stride_xt + row0 + (k0 + offs_k)[None, :], mask=lane0 & k_ok[None, :],
                         other=0.0)
            wg_ptrs = w13_ptr + e * stride_w1e + offs_n[None, :].to(tl.int64) * stride_w1n + (k0 + offs_k)[:, None]
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(wg_ptrs + inter * stride_w1n, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            first = ks == 0
            acc_g = tl.dot(xa, wg, tl.where(first, 0.0, acc_g))
            acc_u = tl.dot(xa, wu, tl.where(first, 0.0, acc_u))
            if ks == ksteps - 1:
                st_ok = lane0 & n_ok[None, :]
                if SPLIT1 == 1:
                    act = _activation(acc_g, acc_u, alpha, limit, ACT, HAS_LIMIT)
                    tl.store(a_ptr + slot.to(tl.int64) * inter + row0 + offs_n[None, :],
                             act.to(a_ptr.dtype.element_ty), mask=st_ok)
                else:
                    h = hpart_ptr + (sp * S + slot).to(tl.int64) * (2 * inter) + row0 + offs_n[None, :]
                    tl.store(h, acc_g, mask=st_ok)
                    tl.store(h + inter, acc_u, mask=st_ok)
    if PHASE == 0:
        _grid_sync(bar_ptr, nprog)

    # ---- B: the activation of the split GEMM1's partials
    if SPLIT1 > 1 and (PHASE == 0 or PHASE == 2):
        nta = tl.cdiv(inter, BA)
        offs_a = tl.arange(0, BA)
        for w in range(pid, S * nta, nprog):
            slot = w // nta
            offs_n = (w - slot * nta) * BA + offs_a
            n_ok = offs_n < inter
            h = hpart_ptr + slot.to(tl.int64) * (2 * inter)
            g = _sum_shares(h, S * 2 * inter, offs_n, n_ok, SPLIT1, BA)
            u = _sum_shares(h + inter, S * 2 * inter, offs_n, n_ok, SPLIT1, BA)
            act = _activation(g, u, alpha, limit, ACT, HAS_LIMIT)
            tl.store(a_ptr + slot.to(tl.int64) * inter + offs_n, act.to(a_ptr.dtype.element_ty), mask=n_ok)
        if PHASE == 0:
            _grid_sync(bar_ptr, nprog)

    # ---- C: GEMM2 over (token, H tile, slot share) items, routed weight and slot sum in fp32
    if PHASE == 0 or PHASE == 3:
        nt2 = tl.cdiv(hidden, BN2)
        items = num_tokens * nt2 * SPLIT2
        ksteps = tl.cdiv(inter, BK2)
        per_item = PER * ksteps
        mine = tl.cdiv(tl.maximum(items - pid, 0), nprog)
        offs_k = tl.arange(0, BK2)
        offs_b = tl.arange(0, BN2)
        total = tl.zeros((16, BN2), dtype=tl.float32)
        for it in range(0, mine * per_item):
            i = it // per_item
            q = it - i * per_item
            jj = q // ksteps
            k0 = (q - jj * ksteps) * BK2
            w = pid + i * nprog
            t = w // (nt2 * SPLIT2)
            r = w - t * (nt2 * SPLIT2)
            nti = r // SPLIT2
            s = r - nti * SPLIT2
            j = s * PER + jj
            slot = t * TOP_K + j
            sel = (ss == slot) & (j < TOP_K)
            e = _pick(sel, e_all, 0)
            live = _pick(sel, live_all, 0)
            w_j = _pick(sel, w_all, 0.0)
            k_ok = offs_k < live * (inter - k0)
            offs_n = nti * BN2 + offs_b
            n_ok = offs_n < hidden
            aa = tl.load(a_ptr + slot.to(tl.int64) * inter + row0 + (k0 + offs_k)[None, :],
                         mask=lane0 & k_ok[None, :], other=0.0, cache_modifier=".cg")
            ww = tl.load(w2_ptr + e * stride_w2e + offs_n[None, :].to(tl.int64) * stride_w2h + (k0 + offs_k)[:, None],
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            total = tl.where(q == 0, 0.0, total) + tl.dot(aa, ww) * w_j
            if q == per_item - 1:
                st_ok = lane0 & n_ok[None, :]
                if SPLIT2 == 1:
                    tl.store(out_ptr + t.to(tl.int64) * stride_ot + row0 + offs_n[None, :],
                             total.to(out_ptr.dtype.element_ty), mask=st_ok)
                else:
                    tl.store(part_ptr + (t * SPLIT2 + s).to(tl.int64) * hidden + row0 + offs_n[None, :], total,
                             mask=st_ok)
    # ---- D: the slot shares' partials, summed in share order
    if SPLIT2 > 1:
        if PHASE == 0:
            _grid_sync(bar_ptr, nprog)
        if PHASE == 0 or PHASE == 4:
            nth = tl.cdiv(hidden, BH)
            offs_h = tl.arange(0, BH)
            for w in range(pid, num_tokens * nth, nprog):
                t = w // nth
                offs = (w - t * nth) * BH + offs_h
                h_ok = offs < hidden
                acc = _sum_shares(part_ptr + (t * SPLIT2).to(tl.int64) * hidden, hidden, offs, h_ok, SPLIT2, BH)
                tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3}


class Coop:
    """One variant: tiles, shares, warps / stages, programs per SM; buffers reused across calls."""

    def __init__(self, split1, bn1, bk1, split2, bn2, bk2, warps, stages, occ, cooperative=True):
        self.v = (split1, bn1, bk1, split2, bn2, bk2, warps, stages, occ)
        self.cooperative = cooperative
        self.bufs = {}
        self.programs = None
        self.poison = False  # NaN outputs and intermediates before the call (the correctness runs)

    def label(self) -> str:
        s1, n1, k1, s2, n2, k2, wp, st, occ = self.v
        return f"g1 {n1}x{k1}/{s1} g2 {n2}x{k2}/{s2} w{wp}s{st} x{occ}"

    def __call__(self, x, w13, w2, topk_w, ids, activation):
        s1, bn1, bk1, s2, bn2, bk2, warps, stages, occ = self.v
        T, H = x.shape
        E, inter, K = w13.shape[0], w2.shape[2], ids.shape[1]
        S = T * K
        key = (T, H, inter, K, x.dtype, x.device)
        if key not in self.bufs:
            dev = x.device
            self.bufs[key] = (torch.empty(S, inter, dtype=x.dtype, device=dev),
                              torch.empty(s1, S, 2 * inter, dtype=torch.float32, device=dev),
                              torch.empty(T * s2, H, dtype=torch.float32, device=dev),
                              torch.zeros(2, dtype=torch.int32, device=dev))
        a, hpart, part, bar = self.bufs[key]
        out = torch.empty_like(x)
        if self.poison:
            for t in (out, a, hpart, part):
                t.fill_(float("nan"))
        per = -(-K // s2)
        args = (x, w13, w2, out, topk_w, ids, a, hpart, part, bar, T, E, H, inter, 1.702, 7.0,
                x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), out.stride(0))
        meta = dict(TOP_K=K, S_P=max(16, triton.next_power_of_2(S)), ACT=ACT_CODES[activation],
                    HAS_LIMIT=activation == "swigluoai", SPLIT1=s1, BN1=bn1, BK1=bk1, SPLIT2=s2, PER=per,
                    BN2=bn2, BK2=bk2, BA=min(1024, triton.next_power_of_2(inter)),
                    BH=min(1024, triton.next_power_of_2(H)), num_warps=warps, num_stages=stages)
        if not self.cooperative:  # one launch per phase (the interpreter: a barrier would never open)
            phases = [(1, S * triton.cdiv(inter, bn1) * s1)]
            if s1 > 1:
                phases.append((2, S * triton.cdiv(inter, meta["BA"])))
            phases.append((3, T * triton.cdiv(H, bn2) * s2))
            if s2 > 1:
                phases.append((4, T * triton.cdiv(H, meta["BH"])))
            for phase, n in phases:
                coop_decode_kernel[(min(n, 7),)](*args, PHASE=phase, **meta)
            return out
        if self.programs is None:
            compiled = coop_decode_kernel.warmup(*args, PHASE=0, grid=(1,), launch_cooperative_grid=True, **meta)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(x.device)
            regs = max(1, compiled.n_regs) * 32 * warps
            fit = min(65536 // regs, (227 * 1024) // max(1, compiled.metadata.shared), 2048 // (32 * warps))
            self.fit = fit
            self.spills = compiled.n_spills
            self.programs = props.multi_processor_count * min(occ, fit)
            if fit < 1:
                raise RuntimeError("does not fit on an SM")
        coop_decode_kernel[(self.programs,)](*args, PHASE=0, launch_cooperative_grid=True, **meta)
        return out


def variants(smoke: bool, inter: int, hidden: int, top_k: int):
    if smoke:
        return [Coop(1, 16, 32, 1, 16, 32, 4, 2, 1, False), Coop(3, 16, 16, 2, 32, 16, 4, 2, 1, False),
                Coop(2, 32, 16, 3, 16, 32, 4, 2, 1, False)]
    out = []
    for (s1, bn1, bk1), (s2, bn2, bk2), occ in itertools.product(
            [(1, 32, 256), (2, 32, 256), (4, 32, 128), (1, 16, 256), (4, 64, 128)],
            [(1, 64, 256), (top_k, 64, 256), (max(1, top_k // 2), 32, 256), (top_k, 32, 128)],
            (1, 2)):
        if s2 > top_k or (s1 > 1 and hidden // s1 < bk1):
            continue
        out.append(Coop(s1, bn1, bk1, s2, bn2, bk2, 4, 4 if bk1 <= 128 else 3, occ))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,llama-4-maverick,gpt-oss-120b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (interpreter)")
    parser.add_argument("--limit", type=int, default=0, help="time only the first N variants per cell")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    from fusedmoe.bench import (
        check_and_time,
        decode_cells,
        measure_ceilings,
        preset_shapes,
        time_rotated,
    )

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float16 if smoke else torch.bfloat16
    shapes = ({"smoke-silu": (6, 4, 40, 24, "silu", 1), "smoke-oai": (5, 5, 48, 20, "swigluoai", 1)} if smoke else
              {name: (*shape, 4) for name, shape in preset_shapes(args.presets).items()})
    if not smoke:
        ceilings = measure_ceilings(device)
        print(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    tokens = [1, 3] if smoke else [int(t) for t in args.tokens.split(",")]
    for cell in decode_cells(shapes, tokens, device, dtype):
        ref = cell.library(True)[0]()
        vs = variants(smoke, cell.inter, cell.hidden, cell.top_k)[: args.limit or None]
        runs = [("library auto", cell.library(None), None), ("library direct", cell.library(True), None)]
        runs += [(v.label(), cell.per_copy(v), v) for v in vs]
        timed = set()  # (variant, programs): a variant whose grid fit capped repeats an earlier launch
        for label, calls, v in runs:
            try:
                if v is None:
                    us, err, same = check_and_time(calls, ref, timed=not smoke)
                else:
                    us, err, same = check_and_time(calls, ref, timed=False,
                                                   poison=lambda on, v=v: setattr(v, "poison", on))
                    if (v.v[:8], v.programs) in timed:
                        continue
                    timed.add((v.v[:8], v.programs))
                    us = None if smoke else time_rotated(calls) * 1e6
            except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is a row
                print(f"{cell.preset} M={cell.tokens} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            extra = f" programs {v.programs} fit/SM {v.fit} spills {v.spills}" if v is not None and v.programs else ""
            pct = None if us is None else cell.pct_roofline(us, ceilings)
            rows.append(dict(preset=cell.preset, tokens=cell.tokens, variant=label, us=us, pct_roofline=pct,
                             rel_err_vs_direct=err, deterministic=same, detail=extra.strip()))
            timing = "" if us is None else f"{us:8.1f} us {pct:6.1f}%"
            print(f"{cell.preset:18s} M={cell.tokens:<3d} {label:34s} {timing}  rel err {err:.1e}  repeat equal "
                  f"{same}{extra}", flush=True)
            if not err <= cell.tolerance or not same:
                print("  ^ MISMATCH", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
