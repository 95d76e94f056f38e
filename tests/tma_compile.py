"""Compile gemm1 / gemm2 with their TMA descriptor loads for sm90, on any machine (no GPU needed).

    python tests/tma_compile.py      # JSON: per kernel, whether the PTX has the bulk tensor
                                     # loads (cp.async.bulk.tensor) and wgmma, or
                                     # {"unavailable": why} where sm90 cannot be compiled

The launchers' own arguments are recorded and compiled for GPUTarget("cuda", 90, 32) by
`fusedmoe.backends.triton.kernel_report` (CPU tensors, FUSEDMOE_TRITON_TMA=force), so the check
sees what a launch on an H100/H200 would compile. Needs Triton's CUDA backend (ptxas); run
without TRITON_INTERPRET (under the interpreter @triton.jit functions cannot be compiled).
"""

from __future__ import annotations

import json
import sys

import torch

# (gemm1 tile, gemm2 tile): the large-M heuristic's choices with descriptors (tiles.heuristic)
TILES = ((128, 64, 64, 8, 3), (128, 128, 64, 4, 4))


def unavailable() -> str | None:
    """Why this machine cannot compile for sm90 (no CUDA backend, no ptxas), or None."""
    from fusedmoe.backends.triton.kernel_report import unavailable

    return unavailable()


def compile_sm90(dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, bool]]:
    """{kernel name: {"bulk_tensor": .., "wgmma": .., "a_desc": .., "w_desc": ..}} for one gated
    large-M problem with the TMA loads on."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton import kernel_report
    from fusedmoe.backends.triton.experts import Launch, launch_gemm1, launch_gemm2
    from fusedmoe.backends.triton.tiles import TileConfig

    t1, t2 = (TileConfig(*t) for t in TILES)
    T, K, H, I, L = 64, 2, 256, 128, 4
    rows = 4 * t1.block_m
    launch = Launch(torch.zeros(T, H, dtype=dtype), torch.zeros(T * K), torch.zeros(rows, dtype=torch.int32),
                    torch.zeros(rows // t1.block_m, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                    torch.zeros(T * K, dtype=torch.int8), torch.zeros(rows, I, dtype=dtype),
                    torch.zeros(T * K, H, dtype=dtype), K, "silu", False, True, 1.702, None, t1.block_m)
    w13, w2 = torch.zeros(L, 2 * I, H, dtype=dtype), torch.zeros(L, H, I, dtype=dtype)
    with kernel_report.recording() as calls, knobs.override(TRITON_TMA="force"):
        launch_gemm1(launch, w13, None, t1)
        launch_gemm2(launch, w2, None, t2)
    out = {}
    for call in calls:
        ptx = kernel_report.compile_call(call).asm["ptx"]
        out[call.name] = {"bulk_tensor": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma" in ptx,
                          "a_desc": bool(call.kwargs.get("A_DESC")), "w_desc": bool(call.kwargs.get("W_DESC"))}
    return out


if __name__ == "__main__":
    reason = unavailable()
    json.dump({"unavailable": reason} if reason else compile_sm90(), sys.stdout, indent=1)
    print()
