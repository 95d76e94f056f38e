"""Host time of one eager decode launch five ways (GPU): Triton's `JITFunction.run`, the compiled
kernel's own launcher called directly (with tensors, and with their addresses), the library's
launcher, and torch inductor's static launcher.

    python benchmarks/bench_launch_host.py [--preset qwen3-30b-a3b] [--tokens 1] [--calls 2000] [--profile]

Triton's `run` binds and specialises every argument, builds the cache key, compares every module
global the kernel's source reaches with its compile-time value and builds launch metadata on
every launch. `direct` calls the `CompiledKernel`'s launcher (`kernel.run`, the call `run` ends
with) with every argument; `direct-int` the same with each tensor passed as its address (Triton's
C launcher then makes no `data_ptr()` call and no driver pointer query for it); `library`,
fusedmoe.backends.triton.launcher.launch on a repeated argument key (its key, then `direct-int`).
`static` is inductor's C++ launcher from the cubin (`StaticallyLaunchedCudaKernel`, private, in
`torch._inductor.runtime.static_triton_launcher` or `static_cuda_launcher` in older torch), which
knows no programmatic dependent launch or TMA descriptors; measured for comparison, not used.

Per kernel of one call (recorded with `kernel_report.recording(run=True)`): host us a launch each
way (`bench.host_us`: back to back, no synchronisation). `--profile` adds cProfile's view of the
first kernel's launches through `run`. Outputs are compared by tests/test_launcher.py (GPU).
"""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile

import torch

from fusedmoe import fused_experts, select_experts
from fusedmoe.backends.triton import kernel_report
from fusedmoe.backends.triton.launcher import launch
from fusedmoe.bench import host_us
from fusedmoe.presets import get_preset

DECODE_KERNELS = ("moe_gemm1_kernel", "moe_act_kernel", "moe_gemm2_direct_kernel", "moe_reduce_kernel")
COLUMNS = ("triton", "direct", "direct-int", "library", "static")
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "launch_pdl", "launch_cooperative_grid")


def _static_launcher_class():
    try:
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
    except ImportError:
        from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
    return StaticallyLaunchedCudaKernel


def _bound(call: kernel_report.Call) -> dict:
    kwargs = {k: v for k, v in call.kwargs.items() if k not in LAUNCH_OPTIONS}
    bound = inspect.signature(call.fn.fn).bind(*call.args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _runtime_args(call: kernel_report.Call, static) -> list:
    """The recorded launch's arguments the cubin takes: those Triton did not make constants."""
    constant = set(static.full_constexprs)
    params = call.fn.params
    return [value for i, value in enumerate(_bound(call).values())
            if i not in constant and not params[i].is_constexpr]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="cProfile the first kernel's Triton launch")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch_host.py needs a CUDA device")
    p = get_preset(args.preset)
    E, K, H, inter = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=dt, generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, device=dev, dtype=dt, generator=gen) / inter**0.5
    x = torch.randn(args.tokens, H, device=dev, dtype=dt, generator=gen)
    weights, ids = select_experts(x, torch.randn(args.tokens, E, device=dev, generator=gen), K)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the recording
    torch.cuda.synchronize()
    with kernel_report.recording(run=True, only=DECODE_KERNELS) as calls:
        fused_experts(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    launcher = _static_launcher_class()
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.preset} M={args.tokens}; "
          f"{launcher.__module__}.{launcher.__name__}")
    print(f"{'kernel':26} {'grid':>14} {'args':>4} " + " ".join(f"{w:>10}" for w in COLUMNS) + "  (host us a launch)")
    folder = tempfile.mkdtemp(prefix="fusedmoe_static_")
    for n, call in enumerate(calls):
        print(_one(call, launcher, stream, os.path.join(folder, f"{n}_{call.name}.cubin"), args.calls))
    if args.profile:
        profile_triton_launch(calls[0], args.calls)


def _one(call: kernel_report.Call, launcher, stream: int, cubin: str, calls: int) -> str:
    """Host us of one recorded launch three ways: Triton's `JITFunction.run`; `direct`, the
    CompiledKernel's own launcher (`kernel.run`, what `run` ends with, as the library's
    fusedmoe.backends.triton.launcher calls it on a repeat); `static`, inductor's launcher. The
    outputs are not compared here: some of these kernels accumulate into their output or take an
    input as a placeholder argument, so poisoning by name is not sound. tests/test_launcher.py
    compares the library's outputs both ways on the GPU."""
    grid = tuple(call.grid) + (1,) * (3 - len(call.grid))
    compiled = call.fn[call.grid](*call.args, **call.kwargs)  # Triton's cached CompiledKernel
    values = list(_bound(call).values())

    def triton_launch():
        call.fn[call.grid](*call.args, **call.kwargs)

    def direct_launch():
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    addresses = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]

    def direct_int_launch():  # tensors as their addresses: no data_ptr() call or pointer query in C
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *addresses)

    def library_launch():  # the library's launcher: key, plan, then the direct call with addresses
        launch(call.fn, tuple(call.grid), *call.args, **call.kwargs)

    ways = {"triton": triton_launch, "direct": direct_launch, "direct-int": direct_int_launch,
            "library": library_launch}
    try:
        if not hasattr(compiled, "_cubin_path"):  # inductor sets it when it writes the cubin itself
            compiled._cubin_path = None  # the launcher then writes `asm["cubin"]` to `cubin`
        static = launcher(compiled)
        static.reload_cubin_from_raw(cubin)
        static.load_kernel(torch.cuda.current_device())
        runtime = _runtime_args(call, static)
        ways["static"] = lambda: static.run(*grid, stream, *runtime)
    except Exception as exc:  # a private API: say what failed and go on
        print(f"{call.name}: static launcher failed: {type(exc).__name__}: {exc}"[:300])
    times = {way: host_us(launch, calls) for way, launch in ways.items()}
    cols = " ".join(f"{times.get(w, float('nan')):>10.2f}" for w in COLUMNS)
    return f"{call.name:26} {str(grid):>14} {len(values):>4} {cols}"


def profile_triton_launch(call: kernel_report.Call, calls: int) -> None:
    """Where a Triton launch's host time goes: cProfile over `calls` launches, top functions."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call.fn[call.grid](*call.args, **call.kwargs)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
