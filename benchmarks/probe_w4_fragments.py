"""Which plan of the 4-bit fragment kernels computes a wrong result (GPU; the interpreter too, at small shapes).

    python benchmarks/probe_w4_fragments.py [--quant int4_w4a16_g64] [--preset mixtral-8x7b] [--tokens 256]
    TRITON_INTERPRET=1 python benchmarks/probe_w4_fragments.py --shape 4,256,256,2 --tokens 64 --device cpu

int4 g64 laid as fragments computed a wrong result on an H200 at Mixtral M=256 under the plan
gemm1 128 x 128 x 128 in 8 warps and 3 stages, gemm2 128 x 128 x 64 in 4 warps and 4 stages
(relative error 10.8, results/2026-11-29_h200_0a5c3b8_int4_groups_layouts_mixtral_m256.txt
section 8). This probe found it to be a race in GEMM2 shared by every int4 group (some runs only;
results/2026-11-29_h200_ad9161a_rs_wgmma_hazard.txt): the register-operand wgmma kept in flight,
closed by kernels._rs_sync (FUSEDMOE_TRITON_RS_SYNC=0 brings it back). It lays the weights itself
(`to_fragments`: any group), runs the aligned path's whole call under the heuristic's plan, the
failing plan, each GEMM's failing tile beside the other's heuristic tile, and variants that change
one parameter of the failing plan, and prints each plan's relative error against emulation on the
checkpoint layout (the `bench --check` reference) with `fuzz.compare`'s verdict. An invalid
variant is named and skipped. --repeat N runs each plan N times (a race shows as runs that
differ); --stages checks GEMM1's intermediate against act(x @ deq(w13)^T) and GEMM2's rows against
the kernel's own intermediate @ deq(w2)^T apart, naming the wrong rows and columns; --gemm2-repeat
re-runs GEMM2 alone on that intermediate.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from fusedmoe.activations import apply_activation
from fusedmoe.api import fused_experts
from fusedmoe.backends.triton.experts import GemmProblem, launch_gemm2, prepare_launch
from fusedmoe.backends.triton.quant import triton_quant_experts
from fusedmoe.backends.triton.tiles import TileConfig, check_tile, fragment_tile, tile_mode
from fusedmoe.backends.triton.weight_only import (
    _kernel_args,
    _launch_gemms,
    _weight_args,
    choose_weight_only_tiles,
    scale_pad,
)
from fusedmoe.bench import _quantized_copy, check_cell, routing_draws, scaled_randn
from fusedmoe.presets import get_preset
from fusedmoe.quant.fragments import to_fragments
from fusedmoe.quant.scheme import get_scheme
from fusedmoe.quant.weights import dequantize_weight

FAILED = (TileConfig(128, 128, 128, 8, 3), TileConfig(128, 128, 64, 4, 4))  # the plan of 2026-11-29


def variants(failed: tuple[TileConfig, TileConfig]) -> list[tuple[str, int, dict]]:
    """(label, GEMM index, changes) one parameter from the failing plan; block_m moves both GEMMs
    (the aligned path's blocks are one alignment)."""
    t1, t2 = failed
    out = [("both block_m 64", -1, dict(block_m=64))]
    for i, t in ((0, t1), (1, t2)):
        out += [(f"gemm{i + 1} warps {8 if t.num_warps == 4 else 4}", i, dict(num_warps=8 if t.num_warps == 4 else 4)),
                (f"gemm{i + 1} block_k {64 if t.block_k == 128 else 128}", i, dict(block_k=64 if t.block_k == 128 else 128)),
                (f"gemm{i + 1} block_n 64", i, dict(block_n=64)),
                (f"gemm{i + 1} stages {t.num_stages + 1}", i, dict(num_stages=t.num_stages + 1))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="int4_w4a16_g64")
    ap.add_argument("--preset", default="mixtral-8x7b")
    ap.add_argument("--shape", help="E,H,I,top_k instead of the preset's (silu, no bias)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", help="comma-separated labels (or label prefixes) of the plans to run")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each plan (a race shows as errors that differ)")
    ap.add_argument("--gemm2-repeat", type=int, default=0, help="--stages: run GEMM2 alone this many times more")
    ap.add_argument("--stages", action="store_true",
                    help="check GEMM1's intermediate and GEMM2's rows (on the kernel's own intermediate) apart")
    args = ap.parse_args()
    device = torch.device(args.device)
    scheme = get_scheme(args.quant)
    if args.shape:
        experts, hidden, inter, top_k = (int(v) for v in args.shape.split(","))
        activation = "silu"
    else:
        p = get_preset(args.preset)
        experts, hidden, inter, top_k, activation = p.num_experts, p.hidden_size, p.intermediate_size, p.top_k, p.activation
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    gen = torch.Generator(device=device).manual_seed(args.seed)
    w13 = scaled_randn((experts, 2 * inter, hidden), hidden**-0.5, dtype=dtype, generator=gen)
    w2 = scaled_randn((experts, hidden, inter), inter**-0.5, dtype=dtype, generator=gen)
    q13, q2, _, _, params = _quantized_copy(w13, w2, None, None, scheme.name, prepare=False)
    del w13, w2
    [(x, _, topk_w, topk_ids)] = routing_draws(args.tokens, hidden, experts, top_k, 1, gen, dtype)
    ref = fused_experts(x, q13, q2, topk_w, topk_ids, quant=params, backend="emulation", activation=activation)
    fmt = scheme.weight.dtype
    f13, s13 = to_fragments(q13, params.w13_scale, fmt, scale_pad())
    f2, s2 = to_fragments(q2, params.w2_scale, fmt, scale_pad())
    mode, group = tile_mode(scheme)
    ok = (lambda t: check_tile(t, dtype=dtype, operands=2, allow_split=True, quant=mode, group=group),
          lambda t: check_tile(t, dtype=dtype, quant=mode, group=group))
    problem = GemmProblem(args.tokens * top_k, experts, hidden, inter, top_k, True, dtype, True)
    heuristic = choose_weight_only_tiles(problem, scheme, device)
    out = torch.empty_like(x)

    def run(plan: tuple[TileConfig, TileConfig]) -> tuple[float, str | None]:
        out.fill_(float("nan"))
        triton_quant_experts(x, f13, f2, topk_w, topk_ids, None, None, None, experts, activation, False, 1.702,
                             None, scheme, s13, s2, None, None, tiles=plan, out=out,
                             w13_global_scale=params.w13_global_scale, w2_global_scale=params.w2_global_scale,
                             direct=False)
        return check_cell(out, ref, scheme.name, device)

    name = f"{args.preset if not args.shape else args.shape} {scheme.name} as fragments, M={args.tokens}"
    print(f"{name}; {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    plans = [("heuristic", heuristic), ("failed plan", FAILED),
             ("gemm1 failed, gemm2 heuristic", (FAILED[0], dataclasses.replace(heuristic[1], block_m=128))),
             ("gemm1 heuristic, gemm2 failed", (dataclasses.replace(heuristic[0], block_m=128), FAILED[1]))]
    for label, which, change in variants(FAILED):
        plan = [FAILED[0], FAILED[1]]
        for i in (0, 1) if which < 0 else (which,):
            plan[i] = dataclasses.replace(plan[i], **change)
        plans.append((label, tuple(plan)))
    if args.only:
        wanted = args.only.split(",")
        plans = [(label, plan) for label, plan in plans if any(label.startswith(w) for w in wanted)]
    if args.stages:
        w13f, w2f = (dequantize_weight(q, s, scheme, g) for q, s, g in
                     ((q13, params.w13_scale, params.w13_global_scale), (q2, params.w2_scale, params.w2_global_scale)))
    def stages(plan: tuple[TileConfig, TileConfig]) -> str:
        """GEMM1's intermediate against act(x @ deq(w13)^T) and GEMM2's rows against the kernel's
        own intermediate @ deq(w2)^T (times the routed weight), float32, over the aligned rows that
        hold a slot: which GEMM computes a wrong value, and in which rows / columns."""
        t1, t2 = plan
        launch = prepare_launch(x, topk_w, topk_ids, None, experts, experts, inter, activation, False, 1.702, None,
                                t1.block_m)
        launch.a.fill_(float("nan"))
        launch.y.fill_(float("nan"))
        _launch_gemms(launch, f13, f2, None, None, t1, t2,
                      *_weight_args(scheme, s13, s2, params.w13_global_scale, params.w2_global_scale, x))
        torch.cuda.synchronize() if device.type == "cuda" else None
        slots = launch.sorted_slot.long()
        held = slots < topk_ids.numel()
        rows = held.nonzero().squeeze(1)
        slot = slots[rows]
        expert = launch.block_expert.long()[rows // t1.block_m]
        a_ref = torch.empty(rows.numel(), inter, device=device)
        y_ref = torch.empty(rows.numel(), hidden, device=device)
        a_got = launch.a[rows].float()
        for e in range(experts):
            sel = (expert == e).nonzero().squeeze(1)
            if sel.numel():
                h = x[slot[sel] // top_k].float() @ w13f[e].T
                a_ref[sel] = apply_activation(h, activation)
                y_ref[sel] = a_got[sel] @ w2f[e].T * topk_w.reshape(-1)[slot[sel]].float()[:, None]
        y_got = launch.y[slot].float()
        out = []
        for name, got, want in (("gemm1", a_got, a_ref), ("gemm2", y_got, y_ref)):
            diff = (got - want).abs().nan_to_num(float("inf"))
            err = ((got - want).float().norm() / want.norm()).item()
            badr = (diff > 0.05 * want.abs().amax(1, keepdim=True) + 1e-3).any(1)
            badc = (diff > 0.05 * want.abs().amax(1, keepdim=True) + 1e-3).any(0)
            where = ""
            if badr.any():
                r = badr.nonzero().squeeze(1)
                c = badc.nonzero().squeeze(1)
                where = (f" bad rows {r.numel()}/{rows.numel()} (aligned {rows[r][:6].tolist()}, experts "
                         f"{sorted(set(expert[r].tolist()))[:8]}), cols {c.numel()}/{got.shape[1]} "
                         f"(first {c[:6].tolist()}, mod 128 {sorted(set((c % 128).tolist()))[:8]})")
            out.append(f"{name} {err:.1e}{where}")
        for _ in range(args.gemm2_repeat):  # GEMM2 alone again on the same intermediate (no GEMM1 before it)
            launch.y.fill_(float("nan"))
            launch_gemm2(launch, f2, None, t2, _kernel_args(scheme, s2, params.w2_global_scale, x))
            got = launch.y[slot].float()
            err = ((got - y_ref).norm() / y_ref.norm()).item()
            out.append(f"gemm2 again {err:.1e}")
        return "; ".join(out)

    for label, plan in plans:
        plan = tuple(fragment_tile(t) for t in plan)
        why = ok[0](plan[0]) or ok[1](plan[1])
        tiles = f"gemm1 {plan[0].as_list()[:5]} gemm2 {plan[1].as_list()[:5]}"
        if why:
            print(f"  {label:<32} {tiles}: invalid ({why})")
            continue
        for _ in range(args.repeat):
            if args.stages:
                print(f"  {label:<32} {tiles}: {stages(plan)}")
                continue
            err, bad = run(plan)
            print(f"  {label:<32} {tiles}: rel err {err:.1e} {'WRONG: ' + bad if bad else 'ok'}")

if __name__ == "__main__":
    main()
