"""Drive every Triton kernel once per representative and edge shape, for compute-sanitizer.

    python scripts/sanitize_driver.py [--big] [--list] [--only 0,3,7]

Cases 35.. repeat some with the direct decode path forced (`DIRECT`); 48.. run on the direct path
only (`direct_only_cases`); 50.. are odd K dimensions (`odd_k_cases`).

Each case runs through fusedmoe's public path on CUDA (`fusedmoe.fuzz.run_case` with backends
triton and batched_triton), so align (one-program, chunked, multi-launch), gemm1/gemm2, the
top-k reduce, the W8A8 activation quantizers and the weight-only decoders all launch; results
are also checked against the float64 reference. --big adds the int32-offset case
(T*K*H = 100000 * 6 * 4096 > 2^31, ~12 GB), which runs the kernels only (no reference).
Exit status 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from fusedmoe import fuzz, knobs

BASE = fuzz.FuzzCase(
    seed=0, profile="gpu", num_tokens=64, num_experts=8, top_k=2, hidden=256, inter=128,
    dtype="bfloat16", activation="silu", routing="uniform", bias=False, local_experts=None,
    weight_on_input=False, quant=None, swiglu_limit=None, ids_dtype="int32",
)


BACKENDS = ["triton", "batched_triton"]


def cases() -> list[fuzz.FuzzCase]:
    r = dataclasses.replace
    out = [
        BASE,
        r(BASE, num_tokens=1, top_k=8, num_experts=128),                 # decode: one-program align
        r(BASE, num_tokens=200, top_k=4, num_experts=60),                # chunked align (<= 1024 slots)
        r(BASE, num_tokens=1500, top_k=6, num_experts=257),              # multi-launch align, E = 257
        r(BASE, num_tokens=3, num_experts=512, top_k=16, routing="zipf"),  # very sparse, top-16
        r(BASE, routing="empty_experts", num_experts=64, top_k=6),       # experts with no tokens
        r(BASE, routing="one_expert", num_tokens=777),                   # everything on one expert
        r(BASE, hidden=727, inter=577, num_tokens=33),                   # H, I not multiples of any tile
        r(BASE, local_experts=(0, 2, 3, 7), bias=True),                  # expert_map with missing experts
        r(BASE, top_k=1, weight_on_input=True, bias=True, dtype="float16"),
        r(BASE, activation="swigluoai", bias=True, swiglu_limit=7.0),
        r(BASE, activation="relu2_no_mul"),
        r(BASE, num_tokens=5000, num_experts=4097, top_k=2, hidden=128, inter=128),  # torch align path
    ]
    for scheme in ("fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "fp8_w8a8_block",
                   "int8_w8a8", "fp8_w8a16", "int8_w8a16", "int4_w4a16_g32", "int4_w4a16_g128",
                   "mxfp4_w4a16", "nvfp4_w4a16"):
        out.append(r(BASE, quant=scheme, hidden=384, inter=256))
        out.append(r(BASE, quant=scheme, hidden=384, inter=256, num_tokens=1500, top_k=6,
                     num_experts=96, routing="empty_experts"))
    return [r(c, seed=i) for i, c in enumerate(out)]


# Cases run again with FUSEDMOE_TRITON_DIRECT=force: the direct decode path (GEMM1 by slot, GEMM2
# with the top-k sum) on decode, top-16 over 512 experts, odd sizes, expert_map, router weight on
# input, clamps, non-gated, and the weight-only decoders.
DIRECT = (1, 4, 7, 8, 9, 10, 11, 23, 25, 27, 29, 31, 33)


def direct_only_cases() -> list[fuzz.FuzzCase]:
    """Run with the direct path forced only (numbered after the repeats): GEMM2 spreading a
    token's slots over programs (tile split_k) with biases, an expert_map and 4-bit weights."""
    r = dataclasses.replace
    out = [
        r(BASE, num_tokens=2, top_k=3, local_experts=(0, 2, 3, 7), bias=True),  # 3 shares of one slot
        r(BASE, num_tokens=1, top_k=4, quant="int4_w4a16_g32", hidden=384, inter=256, activation="swigluoai",
          bias=True, swiglu_limit=7.0),
    ]
    first = len(cases()) + len(DIRECT)
    return [r(c, seed=first + i) for i, c in enumerate(out)]


def odd_k_cases() -> list[fuzz.FuzzCase]:
    """K not a multiple of 16 under the tiles Triton 3.6 miscompiled there (`experts.fit_k`): GPU
    fuzz seed 90064's shape (H = 11, the 16 x 128 GEMM1 tile at 4 warps) and wider odd H, and the
    row-stationary W8A8 GEMM2 at I = 4 (BLOCK_I < 32 did not compile). Numbered after the
    direct-only cases."""
    r = dataclasses.replace
    seed_90064 = r(BASE, num_tokens=192, num_experts=257, top_k=6, hidden=11, inter=688, activation="gelu",
                   bias=True, routing="zipf")
    out = [seed_90064, r(seed_90064, hidden=136), r(seed_90064, hidden=200), r(seed_90064, hidden=2888),
           r(BASE, quant="int8_w8a8", num_tokens=1024, top_k=8, num_experts=16, hidden=384, inter=4),
           r(BASE, quant="fp8_w8a8_channel", num_tokens=1024, top_k=8, num_experts=16, hidden=384, inter=4)]
    first = len(cases()) + len(DIRECT) + len(direct_only_cases())
    return [r(c, seed=first + i) for i, c in enumerate(out)]


def all_cases() -> list[tuple[fuzz.FuzzCase, bool]]:
    """(case, direct forced) for every case: cases(), the DIRECT repeats, direct_only_cases(),
    odd_k_cases()."""
    base = cases()
    return ([(c, False) for c in base] + [(base[i], True) for i in DIRECT] + [(c, True) for c in direct_only_cases()]
            + [(c, False) for c in odd_k_cases()])


def big() -> None:
    """T*K*H > 2^31: token offsets must be 64-bit (pitfalls: int32 overflow)."""
    from fusedmoe import fused_experts, select_experts

    T, E, K, H, I = 100_000, 8, 6, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) / 64
    w2 = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) / 11
    w, ids = select_experts(x, torch.randn(T, E, device="cuda", generator=g), K)
    out = fused_experts(x, w13, w2, w, ids, backend="triton")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    print(f"big T={T} K={K} H={H}: ok")


def triton_plan(case: fuzz.FuzzCase) -> str:
    """The contiguous `triton` path's plan for the case on this GPU (path, tiles, TMA loads), so
    the log shows which kernels' variants the tools covered."""
    from fusedmoe.activations import is_gated
    from fusedmoe.backends.triton.experts import GemmProblem, describe_plan
    from fusedmoe.quant.scheme import get_scheme

    local = case.num_experts if case.local_experts is None else len(case.local_experts)
    problem = GemmProblem(case.num_tokens * case.top_k, local, case.hidden, case.inter, case.top_k,
                          is_gated(case.activation), case.torch_dtype)
    d = describe_plan(problem, get_scheme(case.quant), torch.device("cuda"))
    tiles = ", ".join(f"{g} {dataclasses.astuple(d[g]['tile'])}{' tma ' + d[g]['tma'] if d[g]['tma'] else ''}"
                      for g in ("gemm1", "gemm2"))
    return f"{d['path']} ({d['launches']}): {tiles}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also the int32-overflow case (~12 GB)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--only", default="", help="comma-separated case numbers (see --list)")
    parser.add_argument("--kernels-only", action="store_true",
                        help="run the backends without the float64 reference (for the sanitizer runs; "
                             "the plain run checks the results)")
    args = parser.parse_args()
    failures = 0
    chosen = {int(i) for i in args.only.split(",") if i}
    for i, (case, direct) in enumerate(all_cases()):
        if chosen and i not in chosen:
            continue
        label = case.describe() + (" [direct]" if direct else "")
        if args.list:
            print(f"{i:3d} {label}")
            continue
        with knobs.override(TRITON_DIRECT="force" if direct else None):
            if args.kernels_only:  # the backends' launches alone: no float64 reference on the GPU
                runners = fuzz.candidates(case, torch.device("cuda"))
                problem = fuzz.make_problem(case, "cuda")
                for name in BACKENDS:
                    if name in runners:
                        runners[name](case, problem)
                        torch.cuda.synchronize()
                        print(f"{label:<100} {name:<16} ran", flush=True)
                continue
            result = fuzz.run_case(case, "cuda", backends=BACKENDS)
            plan = triton_plan(case)
        for o in result.outcomes:
            print(f"{label:<100} {o.backend:<16} {o.status} {o.detail or ''}", flush=True)
        print(f"{'':<100} triton plan: {plan}", flush=True)
        failures += len(result.failures)
    if args.big and not args.list:
        big()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
