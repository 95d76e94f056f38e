"""Which tile parameters keep a row's bits (GPU): the evidence for `experts.batch_invariant_tiles`.

    python benchmarks/probe_batch_invariance.py [--quant mxfp4_w4a16] [--preset qwen3-30b-a3b] [--tokens 512]

A batch-invariant call must give each token the bits it would get in any other batch. The fixed
plan (`batch_invariant_tiles`: the heuristic's tiles for 1024 tokens, split_k 1) does by
construction, but pays at decode (a 64-row tile streaming weights over few programs). This probe
asks which of a tile's parameters change a row's bits on this GPU and Triton: it runs the aligned
path with the fixed plan and with variants that change one parameter of one GEMM, on the same
random batch, and says whether every output row is bitwise the fixed plan's (`same`) or not
(`DIFF`, with the count of rows that differ and the largest difference). The rule's own plans
(`batch_invariant_tiles` at M = 1-4096, as FUSEDMOE_BATCH_INVARIANT=1 runs them) are checked the
same way. Each variant also runs
on a 7-token sub-batch (its rows against the full batch's under the fixed plan). Changing block_k
or split_k changes the order of the K sum, so those variants must read DIFF: they are the check
that the probe can tell.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import triton

from fusedmoe import MoEConfig
from fusedmoe.backends.triton.experts import (
    GemmProblem,
    TritonExperts,
    batch_invariant_tiles,
    direct_reason,
    fit_k,
    plan_tiles,
    triton_experts,
)
from fusedmoe.backends.triton.weight_only import triton_weight_only_experts
from fusedmoe.modular import ExpertWeights
from fusedmoe.presets import get_preset
from fusedmoe.quant.scheme import get_scheme
from fusedmoe.quant.weights import quantize_weights


def variants(t, gemm1: bool):
    """(label, tile) pairs changing one parameter of tile t."""
    r = dataclasses.replace
    out = [(f"block_m {m}", r(t, block_m=m)) for m in (16, 32, 64, 128) if m != t.block_m]
    out += [(f"block_n {n}", r(t, block_n=n)) for n in (16, 32, 64, 128, 256) if n != t.block_n]
    out += [(f"num_warps {w}", r(t, num_warps=w)) for w in (4, 8) if w != t.num_warps]
    out += [(f"num_stages {s}", r(t, num_stages=s)) for s in (2, 3, 5) if s != t.num_stages]
    out += [(f"group_m {g}", r(t, group_m=g)) for g in (1, 16) if g != t.group_m]
    out += [("block_m 16 block_n 32 warps 4", r(t, block_m=16, block_n=32, num_warps=4)),
            ("block_m 16 block_n 64 warps 4", r(t, block_m=16, block_n=64, num_warps=4)),
            ("block_m 64 block_n 32 warps 4", r(t, block_m=64, block_n=32, num_warps=4))]
    out.append(("persistent", r(t, persistent=True)))
    if gemm1:
        out.append(("one_dot", r(t, one_dot=True)))
        out.append(("split_k 2 (control)", r(t, split_k=2)))
    out.append((f"block_k {t.block_k * 2} (control)", r(t, block_k=t.block_k * 2)))
    out.append((f"block_k {t.block_k // 2} (control)", r(t, block_k=t.block_k // 2)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--entry", type=int, default=None, help="token count whose plan to take apart")
    ap.add_argument("--only-plans", action="store_true",
                    help="whole plans, the rule's plans and block_m only, no one-parameter sweep")
    args = ap.parse_args()
    p = get_preset(args.preset)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, K, H, I = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp  # noqa: E741  (bench's TP split)
    x = torch.randn(args.tokens, H, device=dev, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) / I**0.5).to(torch.bfloat16)
    weights, ids = torch.topk(torch.randn(args.tokens, E, device=dev, generator=gen).softmax(-1), K)
    weights = weights.to(torch.bfloat16)
    scheme = get_scheme(args.quant)
    if scheme is None:
        def run(tiles, rows=None, direct=False):
            xs, ws, ii = (x, weights, ids) if rows is None else (x[rows], weights[rows], ids[rows])
            return triton_experts(xs, w13, w2, ws, ii, None, None, None, E, "silu", False, 1.702, None,
                                  tiles=tiles, direct=direct)
    else:
        config = MoEConfig(E, K, H, I, quant=scheme.name)
        q13, q2, params = quantize_weights(w13, w2, scheme.name)
        w = TritonExperts(config).process_weights(ExpertWeights(q13, q2, quant=params))
        qp = w.quant

        def run(tiles, rows=None, direct=False):
            xs, ws, ii = (x, weights, ids) if rows is None else (x[rows], weights[rows], ids[rows])
            return triton_weight_only_experts(xs, w.w13, w.w2, ws, ii, None, None, None, E, "silu", False, 1.702,
                                              None, qp.scheme, qp.w13_scale, qp.w2_scale, qp.w13_global_scale,
                                              qp.w2_global_scale, tiles=tiles, direct=direct)

    problem = GemmProblem(ids.numel(), E, H, I, K, True, torch.bfloat16)
    t1, t2 = fit_k(*batch_invariant_tiles(problem, scheme, dev), problem)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{p.name} {scheme.name if scheme else 'bf16'} M={args.tokens}")
    print(f"fixed plan: gemm1 {t1}\n            gemm2 {t2}")
    ref = run((t1, t2))
    sub = torch.tensor([0, 3, 100, 101, 255, 256, args.tokens - 1], device=dev)
    assert torch.equal(run((t1, t2), sub), ref[sub]), "the fixed plan itself is not batch-invariant"
    if args.entry:
        take_apart(run, ref, t1, t2, scheme, dev, E, K, H, I, args.entry)
        return
    whole_plans(run, ref, sub, scheme, dev, E, K, H, I)
    rule_plans(run, ref, scheme, dev, E, K, H, I)
    both_block_m(run, ref, t1, t2)
    if not args.only_plans:
        one_at_a_time(run, ref, sub, t1, t2, args.tokens)


def whole_plans(run, ref, sub, scheme, dev, E, K, H, I):  # noqa: E741
    """The default plan of each token count (the aligned path's tiles, block_m included, on both
    GEMMs; and the direct path where it runs), GEMM1 in one K pass."""
    for m in (1, 4, 16, 64, 256, 1024, 4096):
        pm = GemmProblem(m * K, E, H, I, K, True, torch.bfloat16)
        plans = [("aligned", False)] + ([("direct", True)] if direct_reason(pm) is None else [])
        for path, direct in plans:
            try:
                _, a1, a2 = plan_tiles(pm, scheme, dev, None, direct)
            except ValueError as exc:
                print(f"  M={m:<5d} {path:8s} plan refused: {exc}")
                continue
            for split in sorted({a1.split_k, 1}):
                tiles = (dataclasses.replace(a1, split_k=split), a2)
                rows = sub if direct else None  # the direct path: a decode batch (its rows against the full batch's)
                try:
                    got = run(tiles, rows, direct)
                    torch.cuda.synchronize()
                except (ValueError, NotImplementedError) as exc:
                    print(f"  M={m:<5d} {path:8s} split_k {split} invalid: {str(exc)[:100]}")
                    continue
                want = ref if rows is None else ref[rows]
                bad = (got != want).any(dim=1)
                print(f"  M={m:<5d} {path:8s} split_k {split} block_m {a1.block_m:3d} "
                      f"gemm1 {a1.block_n}x{a1.block_k} w{a1.num_warps} gemm2 {a2.block_m}x{a2.block_n}x{a2.block_k} "
                      f"w{a2.num_warps}{' persistent' if a2.persistent else ''}: "
                      + ("same" if not bad.any() else f"DIFF rows {int(bad.sum())}/{got.shape[0]}"), flush=True)


def rule_plans(run, ref, scheme, dev, E, K, H, I):  # noqa: E741
    """The plan `batch_invariant_tiles` gives each token count (what FUSEDMOE_BATCH_INVARIANT=1
    runs there, fitted as the call fits it), on this batch: the rule itself, checked."""
    for m in (1, 4, 16, 64, 256, 1024, 4096):
        pm = GemmProblem(m * K, E, H, I, K, True, torch.bfloat16)
        _, a1, a2 = plan_tiles(pm, scheme, dev, None, None, batch_invariant=True)
        got = run((a1, a2))
        torch.cuda.synchronize()
        bad = (got != ref).any(dim=1)
        print(f"  M={m:<5d} rule     block_m {a1.block_m:3d} gemm1 {a1.block_n}x{a1.block_k} w{a1.num_warps} "
              f"gemm2 {a2.block_m}x{a2.block_n}x{a2.block_k} w{a2.num_warps}{' persistent' if a2.persistent else ''}: "
              + ("same" if not bad.any() else f"DIFF rows {int(bad.sum())}/{got.shape[0]}"), flush=True)


def take_apart(run, ref, t1, t2, scheme, dev, E, K, H, I, m):  # noqa: E741
    """The plan of m tokens, one of its parameters at a time set to the fixed plan's."""
    pm = GemmProblem(m * K, E, H, I, K, True, torch.bfloat16)
    _, a1, a2 = plan_tiles(pm, scheme, dev, None, False)
    a1 = dataclasses.replace(a1, split_k=1)
    print(f"plan of M={m}: gemm1 {a1}\n  gemm2 {a2}")
    for which in ("gemm1", "gemm2"):
        base, fixed = (a1, t1) if which == "gemm1" else (a2, t2)
        for f in dataclasses.fields(base):
            if f.name in ("block_m", "split_k") or getattr(base, f.name) == getattr(fixed, f.name):
                continue
            tile = dataclasses.replace(base, **{f.name: getattr(fixed, f.name)})
            tiles = (tile, a2) if which == "gemm1" else (a1, tile)
            try:
                got = run(tiles)
                torch.cuda.synchronize()
            except (ValueError, NotImplementedError) as exc:
                print(f"  entry {which} {f.name} -> {getattr(fixed, f.name)} invalid: {str(exc)[:90]}")
                continue
            bad = (got != ref).any(dim=1)
            print(f"  entry {which} {f.name} {getattr(base, f.name)} -> {getattr(fixed, f.name)}: "
                  + ("same" if not bad.any() else f"DIFF rows {int(bad.sum())}/{got.shape[0]}"), flush=True)
    got = run((a1, a2))
    print("  entry as is: " + ("same" if torch.equal(got, ref) else "DIFF"))


def both_block_m(run, ref, t1, t2):
    """block_m changed on both GEMMs together (the alignment's row blocks are theirs)."""
    r = dataclasses.replace
    for label, kw in (("block_m 16", dict(block_m=16)), ("block_m 32", dict(block_m=32)),
                      ("block_m 128", dict(block_m=128)), ("block_m 128 warps 8", dict(block_m=128, num_warps=8)),
                      ("block_m 64 warps 8", dict(block_m=64, num_warps=8))):
        try:
            got = run((r(t1, **kw), r(t2, **kw)))
            torch.cuda.synchronize()
        except (ValueError, NotImplementedError) as exc:
            print(f"  both  {label:34s} invalid: {str(exc)[:100]}")
            continue
        bad = (got != ref).any(dim=1)
        print(f"  both  {label:34s} " + ("same" if not bad.any() else f"DIFF rows {int(bad.sum())}/{got.shape[0]}"),
              flush=True)


def one_at_a_time(run, ref, sub, t1, t2, tokens):
    """One parameter of one GEMM changed."""
    for which in ("gemm1", "gemm2"):
        base = t1 if which == "gemm1" else t2
        for label, tile in variants(base, which == "gemm1"):
            tiles = (tile, t2) if which == "gemm1" else (t1, tile)
            t0 = time.perf_counter()
            try:
                got = run(tiles)
                part = run(tiles, sub)
                torch.cuda.synchronize()
            except (ValueError, NotImplementedError) as exc:
                print(f"  {which} {label:34s} invalid: {str(exc)[:110]}")
                continue
            except Exception as exc:  # a compile failure (shared memory, ...): say so and go on
                print(f"  {which} {label:34s} failed: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            rows = (got != ref).any(dim=1)
            verdict = "same" if not rows.any() and torch.equal(part, ref[sub]) else (
                f"DIFF rows {int(rows.sum())}/{tokens}, sub-batch "
                f"{'same' if torch.equal(part, ref[sub]) else 'diff'}, "
                f"max |d| {float((got.float() - ref.float()).abs().max()):.3g}")
            print(f"  {which} {label:34s} {verdict}  ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
