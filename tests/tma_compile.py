"""Compile gemm1 / gemm2 with their TMA descriptor loads for sm90, on any machine (no GPU needed).

    python tests/tma_compile.py      # JSON: per kernel, whether the PTX has the bulk tensor
                                     # loads (cp.async.bulk.tensor) and wgmma, or
                                     # {"unavailable": why} where sm90 cannot be compiled

The launchers' own arguments are recorded (kernel objects replaced by recorders, CPU tensors,
FUSEDMOE_TRITON_TMA=force) and compiled as an ASTSource for GPUTarget("cuda", 90, 32), so the
check sees what a launch on an H100/H200 would compile. Needs Triton's CUDA backend (ptxas); run
without TRITON_INTERPRET (under the interpreter @triton.jit functions cannot be compiled).
"""

from __future__ import annotations

import inspect
import json
import sys

import torch
import triton
import triton.language as tl

# (gemm1 tile, gemm2 tile): the large-M heuristic's choices with descriptors (tiles.heuristic)
TILES = ((128, 64, 64, 8, 3), (128, 128, 64, 4, 4))
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int8: "i8"}


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _source(fn, args, kwargs):
    """(ASTSource, options) of one recorded launch: tensors and descriptors typed, ints of 1 and
    None specialized as constexprs (as Triton's launcher does), launch options split off."""
    from triton.compiler import ASTSource
    from triton.tools.tensor_descriptor import TensorDescriptor

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    kwargs.pop("launch_pdl", None)
    bound = inspect.signature(fn.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    constexpr = [p.is_constexpr for p in fn.params]
    signature, constants = {}, {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        if constexpr[i] or value is None or (type(value) is int and value == 1):
            signature[name] = "constexpr"
            constants[(i,)] = value
        elif isinstance(value, TensorDescriptor):
            signature[name] = f"tensordesc<{TYPES[value.base.dtype]}[{', '.join(map(str, value.block_shape))}]>"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
    return ASTSource(fn, signature, constants), options


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs))


def unavailable() -> str | None:
    """Why this machine cannot compile for sm90 (no CUDA backend, no ptxas), or None."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        src = ASTSource(_copy_kernel, {"src_ptr": "*fp32", "dst_ptr": "*fp32", "BLOCK": "constexpr"},
                        {(2,): 16})
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # the reason is the report: the caller skips with it
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def compile_sm90(dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, bool]]:
    """{kernel name: {"bulk_tensor": .., "wgmma": .., "a_desc": .., "w_desc": ..}} for one gated
    large-M problem with the TMA loads on."""
    from triton.backends.compiler import GPUTarget

    from fusedmoe import knobs
    from fusedmoe.backends.triton import kernels
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
    recorders = {name: _Recorder(getattr(kernels, name)) for name in ("moe_gemm1_kernel", "moe_gemm2_kernel")}
    saved = {name: getattr(kernels, name) for name in recorders}
    try:
        for name, recorder in recorders.items():
            setattr(kernels, name, recorder)
        with knobs.override(TRITON_TMA="force"):
            launch_gemm1(launch, w13, None, t1)
            launch_gemm2(launch, w2, None, t2)
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
    out = {}
    for name, recorder in recorders.items():
        (args, kwargs), = recorder.calls
        src, options = _source(recorder.fn, args, kwargs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        out[name] = {"bulk_tensor": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma" in ptx,
                     "a_desc": bool(kwargs.get("A_DESC")), "w_desc": bool(kwargs.get("W_DESC"))}
    return out


if __name__ == "__main__":
    reason = unavailable()
    json.dump({"unavailable": reason} if reason else compile_sm90(), sys.stdout, indent=1)
    print()
