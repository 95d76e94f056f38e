"""Host time of one eager decode launch: Triton's launcher against torch inductor's static launcher
(a prototype; GPU).

    python benchmarks/bench_launch_host.py [--preset qwen3-30b-a3b] [--tokens 1] [--calls 2000]

An eager `fused_experts` call at decode spends ~245 us of host time on an H200 host for ~25 us of
GPU work, about half of it in Triton's per-launch Python (`JITFunction.run`: binding and
specialising every argument, the cache key, the used-globals check, launch metadata). torch's
inductor launches compiled Triton kernels from their cubin through a C++ launcher
(`StaticallyLaunchedCudaKernel`; private, in `torch._inductor.runtime.static_triton_launcher`, or
`static_cuda_launcher` in older torch) that takes only the non-constexpr arguments. It knows no
programmatic dependent launch, TMA descriptors or clusters: an eager-only path for the decode
kernels, which use neither of the last two (a kernel compiled with PDL waits for nothing when
launched without the attribute).

Per kernel of one call (recorded with `kernel_report.recording(run=True)`): the output of a
static launch against Triton's, bitwise, into NaN-poisoned buffers; then host us a launch both
ways (`bench.host_us`: back to back, no synchronisation). The library does not use the static
launcher; this says whether a version-guarded eager path would be worth it.
"""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile

import torch

from fusedmoe import fused_experts, select_experts
from fusedmoe.backends.triton import kernel_report
from fusedmoe.bench import host_us
from fusedmoe.presets import get_preset

# the decode kernels and the buffers each may write (poisoned before each way, compared after)
WRITES = {"moe_gemm1_kernel": ("a_ptr", "hpart_ptr"), "moe_act_kernel": ("a_ptr",),
          "moe_gemm2_direct_kernel": ("out_ptr",), "moe_reduce_kernel": ("out_ptr",)}
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
    with kernel_report.recording(run=True, only=tuple(WRITES)) as calls:
        fused_experts(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    launcher = _static_launcher_class()
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.preset} M={args.tokens}; "
          f"{launcher.__module__}.{launcher.__name__}")
    print(f"{'kernel':26} {'grid':>16} {'args':>5} {'triton us':>10} {'static us':>10}  output")
    folder = tempfile.mkdtemp(prefix="fusedmoe_static_")
    for n, call in enumerate(calls):
        try:
            print(_one(call, launcher, stream, os.path.join(folder, f"{n}_{call.name}.cubin"), args.calls))
        except Exception as exc:  # a prototype on a private API: say what failed and go on
            print(f"{call.name:26} static launcher failed: {type(exc).__name__}: {exc}"[:300])


def _one(call: kernel_report.Call, launcher, stream: int, cubin: str, calls: int) -> str:
    """One recorded launch both ways: the written buffers compared, host us a launch each."""
    grid = tuple(call.grid) + (1,) * (3 - len(call.grid))
    compiled = call.fn[call.grid](*call.args, **call.kwargs)  # Triton's cached CompiledKernel
    static = launcher(compiled)
    static.reload_cubin_from_raw(cubin)
    static.load_kernel(torch.cuda.current_device())
    runtime = _runtime_args(call, static)
    bound = _bound(call)
    out = [bound[name] for name in WRITES[call.name] if isinstance(bound.get(name), torch.Tensor)]

    def triton_launch():
        call.fn[call.grid](*call.args, **call.kwargs)

    def static_launch():
        static.run(*grid, stream, *runtime)

    written = {}
    for way, launch in (("triton", triton_launch), ("static", static_launch)):
        for t in out:
            t.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        written[way] = [t.clone() for t in out]
    same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
               for a, b in zip(written["triton"], written["static"], strict=True))
    same = same and not all(bool(a.isnan().all()) for a in written["triton"])  # something written
    t_triton, t_static = host_us(triton_launch, calls), host_us(static_launch, calls)
    return (f"{call.name:26} {str(grid):>16} {len(runtime):>5} {t_triton:>10.2f} {t_static:>10.2f}  "
            f"{'bitwise equal' if same else 'DIFFERS'}")

if __name__ == "__main__":
    main()
