"""Which tile parameters keep a row's bits (GPU): the evidence for `experts.batch_invariant_tiles`.

    python benchmarks/probe_batch_invariance.py [--quant mxfp4_w4a16] [--preset qwen3-30b-a3b] [--tokens 512]

A batch-invariant call must give each token the bits it would get in any other batch. The fixed
plan (`batch_invariant_tiles`: the heuristic's tiles for 1024 tokens, split_k 1) does by
construction, but pays at decode (a 64-row tile streaming weights over few programs). This probe
asks which of a tile's parameters change a row's bits on this GPU and Triton: it runs the aligned
path with the fixed plan and with variants that change one parameter of one GEMM, on the same
random batch, and says whether every output row is bitwise the fixed plan's (`same`) or not
(`DIFF`, with the count of rows that differ and the largest difference). Each variant also runs
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
    fit_k,
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
    args = ap.parse_args()
    p = get_preset(args.preset)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, K, H, I = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size  # noqa: E741
    x = torch.randn(args.tokens, H, device=dev, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) / I**0.5).to(torch.bfloat16)
    weights, ids = torch.topk(torch.randn(args.tokens, E, device=dev, generator=gen).softmax(-1), K)
    weights = weights.to(torch.bfloat16)
    scheme = get_scheme(args.quant)
    if scheme is None:
        def run(tiles, rows=None):
            xs, ws, ii = (x, weights, ids) if rows is None else (x[rows], weights[rows], ids[rows])
            return triton_experts(xs, w13, w2, ws, ii, None, None, None, E, "silu", False, 1.702, None,
                                  tiles=tiles, direct=False)
    else:
        config = MoEConfig(E, K, H, I, quant=scheme.name)
        q13, q2, params = quantize_weights(w13, w2, scheme.name)
        w = TritonExperts(config).process_weights(ExpertWeights(q13, q2, quant=params))
        qp = w.quant

        def run(tiles, rows=None):
            xs, ws, ii = (x, weights, ids) if rows is None else (x[rows], weights[rows], ids[rows])
            return triton_weight_only_experts(xs, w.w13, w.w2, ws, ii, None, None, None, E, "silu", False, 1.702,
                                              None, qp.scheme, qp.w13_scale, qp.w2_scale, qp.w13_global_scale,
                                              qp.w2_global_scale, tiles=tiles, direct=False)

    problem = GemmProblem(ids.numel(), E, H, I, K, True, torch.bfloat16)
    t1, t2 = fit_k(*batch_invariant_tiles(problem, scheme, dev), problem)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{p.name} {scheme.name if scheme else 'bf16'} M={args.tokens}")
    print(f"fixed plan: gemm1 {t1}\n            gemm2 {t2}")
    ref = run((t1, t2))
    sub = torch.tensor([0, 3, 100, 101, 255, 256, args.tokens - 1], device=dev)
    assert torch.equal(run((t1, t2), sub), ref[sub]), "the fixed plan itself is not batch-invariant"
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
                f"DIFF rows {int(rows.sum())}/{args.tokens}, sub-batch "
                f"{'same' if torch.equal(part, ref[sub]) else 'diff'}, "
                f"max |d| {float((got.float() - ref.float()).abs().max()):.3g}")
            print(f"  {which} {label:34s} {verdict}  ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
