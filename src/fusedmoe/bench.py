"""Benchmarks: one timer (CUDA-graph replay, median, weights rotated) and the roofline.

    t      = median over replays of a graph that runs the layer once on each of R >= 4 weight
             copies, divided by R (so decode reads HBM, not the 50-60 MB L2); each copy runs its
             own draw of tokens and routing, so t is a mean over R routings
    bytes  = E_touched * (G + I) * H * w_bytes + T * H * 2 * a_bytes     (E_touched from the ids,
             the mean over the R draws)
    flops  = 2 * T * K * H * (G + I)                                     (G = 2I gated, else I)
    t_roof = max(bytes / BW, flops / PEAK), BW and PEAK measured in the same run
    % roof = t_roof / t
Routing is excluded: ids and weights are drawn (uniform random logits) before timing. Each cell
(preset, T) draws its R tokens and logits from its own generator (`cell_generator`), so a cell
times the same inputs and routings whichever cells ran before it in the process, and every
backend of the cell the same ones.
With `quant` (a W8A8 or weight-only scheme) `triton` runs the rotated copies quantized by
`quantize_weights` (int4 scales stored in bf16, as Kimi-K2 ships them) and bytes count the
quantized width plus scales (`quant_bytes`); other backends (`grouped_mm`, `torch`) run the bf16
copies as the baseline, measured against the same (quantized) roof.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fusedmoe.presets import Preset

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
TARGET_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "llama-4-maverick")


@dataclass(frozen=True)
class Ceilings:
    device: str
    bandwidth: float  # bytes/s: the largest of a D2D copy (read + write) and two read-only streams
    bf16_flops: float  # FLOP/s of an 8192^3 bf16 matmul
    fp8_flops: float | None = None  # FLOP/s of an 8192^3 e4m3 torch._scaled_mm (W8A8 fp8 roofline)
    int8_flops: float | None = None  # OP/s of an 8192^3 torch._int_mm (W8A8 int8 roofline)

    def peak(self, operand: str | None = None) -> float:
        """The compute ceiling for 8-bit ("fp8", "int8") or bf16 (None) operands; bf16's when the
        8-bit rate was not measured."""
        rate = {"fp8": self.fp8_flops, "int8": self.int8_flops}.get(operand or "")
        return rate or self.bf16_flops

    @property
    def ridge(self) -> float:
        return self.bf16_flops / self.bandwidth


@dataclass
class Row:
    preset: str
    backend: str
    tokens: int
    experts_touched: float  # distinct experts the cell's ids route to (mean over its draws)
    us: float
    tflops: float
    gbps: float
    roof_pct: float
    bound: str
    speedup_vs: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    rel_err: float | None = None  # --check: relative Frobenius error against the cell's reference
    mismatch: str | None = None  # --check: why the output is beyond its scheme's bound, or why its check failed


def _events_median(fn: Callable[[], None], iters: int) -> float:
    """Median seconds of fn() timed with CUDA events."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _bandwidth(device: torch.device, gib: float) -> float:
    src = torch.randn(int(gib * 2**30) // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_bw = 2 * src.numel() * 2 / _events_median(lambda: dst.copy_(src), 10)
    src.sum(dtype=torch.float32)
    read_bw = src.numel() * 2 / _events_median(lambda: src.sum(dtype=torch.float32), 10)
    triton_bw = 0.0
    try:  # torch's reduction is not a pure stream; a grid-strided Triton read usually is faster
        from fusedmoe.bench_kernels import stream_read_kernel

        programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        partial = torch.empty(programs, device=device, dtype=torch.float32)

        def read() -> None:
            stream_read_kernel[(programs,)](src, partial, src.numel(), BLOCK=8192, num_warps=8)

        read()
        triton_bw = src.numel() * 2 / _events_median(read, 10)
    except ImportError:
        pass
    return max(copy_bw, read_bw, triton_bw)


def _matmul_rate(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    a @ b
    return 2 * 8192**3 / _events_median(lambda: a @ b, 10)


def _matmul_rate_8bit(device: torch.device, kind: str) -> float | None:
    """Rate of an 8192^3 fp8 (e4m3, unit scales, bf16 out) or int8 (int32 out) matmul on random
    data; None where torch has no such kernel for this GPU."""
    n = 8192
    try:
        if kind == "fp8":
            a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major B
            one = torch.ones((), device=device)
            def mm():
                return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        else:
            a = torch.randint(-127, 128, (n, n), device=device, dtype=torch.int8)
            b = torch.randint(-127, 128, (n, n), device=device, dtype=torch.int8).t().contiguous().t()
            def mm():
                return torch._int_mm(a, b)
        mm()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return 2 * n**3 / _events_median(mm, 10)


def measure_ceilings(device: torch.device | str = "cuda", gib: float = 2.0, *, eight_bit: bool = False) -> Ceilings:
    """Bandwidth (copy or read, whichever is faster) and dense bf16 rate, on random data; with
    `eight_bit`, also the fp8 and int8 matmul rates (the W8A8 rooflines)."""
    device = torch.device(device)
    fp8 = _matmul_rate_8bit(device, "fp8") if eight_bit else None
    int8 = _matmul_rate_8bit(device, "int8") if eight_bit else None
    return Ceilings(torch.cuda.get_device_name(device), _bandwidth(device, gib), _matmul_rate(device), fp8, int8)


def time_rotated(calls: Sequence[Callable[[], object]], *, graph: bool = True, iters: int = 30) -> float:
    """Median seconds per call over `calls` (one per weight copy), replayed as one CUDA graph."""
    for call in calls:  # compile / JIT every kernel outside capture
        call()
    torch.cuda.synchronize()
    if not graph:
        def run():
            for call in calls:
                call()
        return _events_median(run, max(3, iters // 3)) / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in calls:
            call()
    g.replay()
    torch.cuda.synchronize()
    return _events_median(g.replay, iters) / len(calls)


def host_us(fn: Callable[[], object], calls: int, wall: bool = False) -> float:
    """Host microseconds a call: `calls` eager calls back to back without synchronising (the GPU
    work is not waited for, so a host-bound call shows its host cost), after 10 warm-up calls.
    wall: until the GPU has finished them too (an eager loop's time per call, host- or GPU-bound)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if wall:
        torch.cuda.synchronize()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


# The references: timed eagerly (batched_torch copies host tensors, which a capture refuses).
EAGER_BACKENDS = ("torch", "batched_torch")
# The batched layout's local dispatch allocates [E, M, H] buffers per call (max_tokens = M).
BATCHED_BUFFER_LIMIT = 4 << 30

# Backends that run the quantized copies under --quant, in either layout (the others time the
# bf16 baseline).
QUANT_BACKENDS = ("triton", "batched_triton", "marlin", "batched_marlin")


def bench_scheme(backend: str, quant: str | None) -> str:
    """The scheme `backend` runs in `bench_preset` under `quant`: the scheme itself for the
    quantized backends, else the bf16 baseline ("unquantized")."""
    from fusedmoe.quant.scheme import get_scheme

    return get_scheme(quant).name if quant is not None and backend in QUANT_BACKENDS else "unquantized"


def check_and_time(calls: Sequence[Callable[[], torch.Tensor]], ref: torch.Tensor, *,
                   timed: bool = True, poison: Callable[[bool], None] | None = None) -> tuple[float | None, float, bool]:
    """One kernel variant of a prototype benchmark: (us per call by `time_rotated`, None when not
    `timed`; relative Frobenius error of calls[0]() against `ref`; whether two calls of it are
    bitwise equal). `poison(True)` before the two checked calls (e.g. NaN-fill the variant's
    buffers so an unwritten element shows), `poison(False)` before timing."""
    if poison:
        poison(True)
    out, again = calls[0](), calls[0]()
    if poison:
        poison(False)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    us = time_rotated(calls) * 1e6 if timed else None
    return us, err, bool(torch.equal(out, again))


@dataclass
class DecodeCell:
    """One (preset, token count) of the decode prototype benchmarks (benchmarks/bench_direct_split.py,
    bench_fused_decode.py, bench_coop_decode.py): random inputs, the rotated (w13, w2) copies and
    the library's calls on them (unquantized, no bias, routed weight on the output)."""

    preset: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    weights: list

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def tolerance(self) -> float:
        """The relative error a variant may show against the library (bf16 / fp16 rounding)."""
        return 2e-2 if self.x.dtype == torch.bfloat16 else 2e-3

    def per_copy(self, fn: Callable[..., torch.Tensor], *args, weights: list | None = None) -> list:
        """One call per weight copy (or per entry of `weights`): fn(x, w13, w2, topk_weights,
        topk_ids, activation, *args)."""
        return [lambda c=c: fn(self.x, c[0], c[1], self.topk_weights, self.topk_ids, self.activation, *args)
                for c in (self.weights if weights is None else weights)]

    def library(self, direct: bool | None) -> list[Callable[[], torch.Tensor]]:
        """triton_experts per weight copy (direct: the path; None: the library's plan)."""
        from fusedmoe.activations import SWIGLUOAI_ALPHA
        from fusedmoe.backends.triton.experts import triton_experts

        def call(x, w13, w2, topk_w, ids, act):
            return triton_experts(x, w13, w2, topk_w, ids, None, None, None, self.experts, act, False,
                                  SWIGLUOAI_ALPHA, None, direct=direct)

        return self.per_copy(call)

    def row(self, label: str, calls: Sequence[Callable[[], torch.Tensor]], ref: torch.Tensor,
            ceilings: Ceilings | None, *, timed: bool = True) -> dict | None:
        """`check_and_time` one variant of this cell: its result row (us and % of roofline when
        timed, relative error against `ref`, determinism, mismatch beyond `tolerance`), or None
        after printing why it failed to compile or run."""
        try:
            us, err, same = check_and_time(calls, ref, timed=timed)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is a row
            print(f"{self.preset} M={self.tokens} {label}: {type(exc).__name__}: {str(exc)[:160]}")
            return None
        pct = None if us is None else self.pct_roofline(us, ceilings)
        return dict(preset=self.preset, tokens=self.tokens, variant=label, us=us, pct_roofline=pct,
                    rel_err_vs_direct=err, deterministic=same, mismatch=err > self.tolerance or not same)

    def pct_roofline(self, us: float, ceilings: Ceilings) -> float:
        from fusedmoe.presets import get_preset

        touched = int(torch.unique(self.topk_ids).numel())
        _, _, t_roof, _ = roofline(get_preset(self.preset), self.tokens, touched, self.inter, ceilings)
        return 100 * t_roof / (us * 1e-6)


def _routed_problems(shapes: dict[str, tuple], tokens: Sequence[int], device: torch.device, dtype: torch.dtype):
    """(name, shape, [(w13, w2)] * copies, x, topk_weights, topk_ids) for {name: (experts, top_k,
    hidden, inter, activation, copies)} at each token count: weights drawn once per shape (seed 0),
    then each count's tokens and routing. The prototype benchmarks' shared inputs."""
    from fusedmoe.routing import select_experts

    for name, shape in shapes.items():
        E, K, H, inter, act, copies = shape
        g = torch.Generator(device=device).manual_seed(0)
        weights = [random_expert_weights(E, H, inter, act, device=device, dtype=dtype, generator=g)[:2]
                   for _ in range(copies)]
        for t in tokens:
            x = torch.randn(t, H, device=device, generator=g).to(dtype)
            topk_w, ids = select_experts(x, torch.randn(t, E, device=device, generator=g), K)
            yield name, shape, weights, x, topk_w, ids


def decode_cells(shapes: dict[str, tuple], tokens: Sequence[int], device: torch.device,
                 dtype: torch.dtype):
    """DecodeCells for {name: (experts, top_k, hidden, inter, activation, copies)} at each token
    count (`_routed_problems`)."""
    for name, (E, K, H, inter, act, _), weights, x, topk_w, ids in _routed_problems(shapes, tokens, device, dtype):
        yield DecodeCell(name, E, K, H, inter, act, x, topk_w, ids, weights)


def balanced_ids(tokens: int, top_k: int, experts: int, device: torch.device) -> torch.Tensor:
    """Top-k ids with token t's j-th expert (t*k + j) % E: every expert gets T*k/E slots (where E
    divides T*k), so the aligned GEMMs run no padding rows; distinct within a token for k <= E."""
    slots = torch.arange(tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)
    return (slots % experts).to(torch.int32)


@dataclass
class AlignedGemm2Case:
    """One (preset, token count) of the aligned-GEMM2 prototype benchmarks
    (benchmarks/bench_persistent_gemm.py, bench_tail_block.py): the library's alignment `L` and
    GEMM1 output for random inputs, the rotated w2 copies, GEMM2's tile, and the library's GEMM2
    output `ref`. A variant is fn(L, w2) writing L.y."""

    preset: str
    tokens: int
    L: object
    w2s: list
    tile: object
    ref: torch.Tensor
    flops: int

    def calls(self, fn: Callable[[object, torch.Tensor], None]) -> list[Callable[[], torch.Tensor]]:
        """One call per w2 copy: fn(L, w2), returning L.y."""
        return [lambda w=w: (fn(self.L, w), self.L.y)[1] for w in self.w2s]

    def library(self) -> list[Callable[[], torch.Tensor]]:
        from fusedmoe.backends.triton.experts import launch_gemm2

        return self.calls(lambda L, w: launch_gemm2(L, w, None, self.tile))

    def check(self, calls: Sequence[Callable[[], torch.Tensor]], *, timed: bool) -> tuple[float | None, float, bool]:
        """`check_and_time` against the library's y, L.y NaN-filled before the checked calls."""
        return check_and_time(calls, self.ref, timed=timed,
                              poison=lambda first: self.L.y.fill_(float("nan")) if first else None)


def aligned_gemm2_cases(shapes: dict[str, tuple], tokens: Sequence[int], device: torch.device, dtype: torch.dtype,
                        *, tiles: tuple | None = None, balanced: bool = False):
    """AlignedGemm2Cases for {name: (experts, top_k, hidden, inter, activation, copies)} at each
    token count: weights drawn once per shape (seed 0), then each count's tokens and routing
    (`balanced_ids` when balanced); tiles (gemm1, gemm2) or `choose_tiles`'."""
    from fusedmoe.activations import SWIGLUOAI_ALPHA, is_gated
    from fusedmoe.backends.triton.experts import (
        GemmProblem,
        choose_tiles,
        launch_gemm1,
        launch_gemm2,
        prepare_launch,
    )

    for name, (E, K, H, inter, act, _), weights, x, topk_w, ids in _routed_problems(shapes, tokens, device, dtype):
        t = x.shape[0]
        if balanced:
            ids = balanced_ids(t, K, E, device)
        t1, t2 = tiles or choose_tiles(GemmProblem(t * K, E, H, inter, K, is_gated(act), dtype), device)
        L = prepare_launch(x, topk_w, ids, None, E, E, inter, act, False, SWIGLUOAI_ALPHA, None, t2.block_m)
        launch_gemm1(L, weights[0][0], None, t1)
        L.y.fill_(float("nan"))
        launch_gemm2(L, weights[0][1], None, t2)
        yield AlignedGemm2Case(name, t, L, [w2 for _, w2 in weights], t2, L.y.clone(), 2 * t * K * H * inter)


def check_variants(head: str, cells: Sequence[tuple[str, object]], check: Callable[[object], tuple], flops: int, *,
                   row: dict, width: int = 28, unit: str = "TFLOP/s") -> list[dict]:
    """The prototype benchmarks' variant loop: for each (label, calls) `check(calls)` -> (us or
    None, rel err, ...) (`check_and_time` / `AlignedGemm2Case.check`); a variant that raises
    (cannot compile, out of shared memory) is printed as a line of its own and left out. Returns
    one dict per variant (`row` | variant, us, tflops, rel_err) and prints it after `head`."""
    rows = []
    for label, calls in cells:
        try:
            us, err, *_ = check(calls)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is a line
            print(f"{head} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        rate = None if us is None else flops / (us * 1e-6) / 1e12
        rows.append(dict(row, variant=label, us=us, tflops=rate, rel_err=err))
        timing = "" if us is None else f"{us:8.1f} us {rate:6.0f} {unit}"
        print(f"{head} {label:{width}s} {timing}  rel err {err:.1e}", flush=True)
    return rows


def finish_variants(rows: list[dict], json_path: str | None, device: torch.device) -> int:
    """Write the variant rows (`check_variants`) as JSON with the versions; the exit status: 0
    when every variant's output matched the reference within 1e-2, else 1."""
    import json

    import triton

    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=str(device), torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)
    return 0 if all(r["rel_err"] < 1e-2 for r in rows) else 1


def quant_backend(scheme: str | None) -> str:
    """The backend --quant times: marlin for the schemes it runs weight-only, else triton."""
    from fusedmoe.backends.triton.marlin import WEIGHT_ONLY_TWIN
    from fusedmoe.quant.scheme import get_scheme

    resolved = get_scheme(scheme)
    return "marlin" if resolved is not None and resolved.name in WEIGHT_ONLY_TWIN else "triton"


# Bytes of one stored group scale: int4 bf16 (as benchmarked, `_quantized_copy`), mxfp4 e8m0,
# nvfp4 e4m3 (its fp32 global scale per expert is negligible).
_GROUP_SCALE_BYTES = {"int4": 2, "mxfp4": 1, "nvfp4": 1}


def quant_bytes(scheme: str | None) -> tuple[float, float]:
    """(bytes per weight, bytes per activation element) for the roofline: bf16 2 and 2; W8A8
    1 and 1, plus fp32 block scales for fp8 block (4 bytes per 128 x 128 = 16384 weights);
    weight-only 1 (fp8, int8) or 0.5 + scale bytes / group (int4 g32 with bf16 scales 0.5625,
    mxfp4 0.53125, nvfp4 0.5625; asymmetric int4 adds its bf16 zero points: g32 0.625) and 2; per-tensor and per-channel scales are negligible
    (<= 4 / H per weight)."""
    from fusedmoe.backends.triton.marlin import WEIGHT_ONLY_TWIN
    from fusedmoe.backends.triton.weight_only import WEIGHT_ONLY_SCHEMES
    from fusedmoe.quant.scheme import get_scheme

    resolved = get_scheme(scheme)
    if resolved is None:
        return 2.0, 2.0
    key = resolved.weight
    if resolved.name in WEIGHT_ONLY_SCHEMES or resolved.name in WEIGHT_ONLY_TWIN:  # marlin: weight-only
        if key.dtype in ("fp8", "int8"):
            return 1.0, 2.0
        return 0.5 + _GROUP_SCALE_BYTES[key.dtype] * (2 if resolved.has_zero else 1) / key.group, 2.0
    if resolved.weight_only or key.dtype not in ("fp8", "int8"):
        raise ValueError(
            f"bench --quant takes a scheme the triton backend runs (W8A8: fp8_w8a8_*, int8_w8a8; "
            f"weight-only: {', '.join(sorted(WEIGHT_ONLY_SCHEMES))}) or marlin runs weight-only "
            f"({', '.join(sorted(WEIGHT_ONLY_TWIN))}), not {resolved.name}"
        )
    w_bytes = 1.0 + (4 / 16384 if key.granularity == "block" else 0.0)
    return w_bytes, 1.0


def quant_operand(scheme: str | None) -> str | None:
    """The tensor-core operand type of a scheme's GEMMs: "fp8"/"int8" for W8A8, None (bf16/fp16
    math) for unquantized and weight-only schemes."""
    from fusedmoe.quant.scheme import get_scheme

    resolved = get_scheme(scheme)
    if resolved is None or resolved.weight_only:
        return None
    return resolved.weight.dtype if resolved.weight.dtype in ("fp8", "int8") else None


def roofline(preset: Preset, tokens: int, experts_touched: float, inter: int, ceilings: Ceilings,
             w_bytes: float = 2.0, a_bytes: float = 2, operand: str | None = None) -> tuple[float, float, float, str]:
    """(bytes, flops, t_roof seconds, 'memory'|'compute') for one call; `operand` "fp8"/"int8"
    takes that matmul rate as the compute ceiling (W8A8), None bf16's."""
    from fusedmoe.activations import is_gated

    g = 2 * inter if is_gated(preset.activation) else inter
    bytes_ = experts_touched * (g + inter) * preset.hidden_size * w_bytes + tokens * preset.hidden_size * 2 * a_bytes
    flops = 2 * tokens * preset.top_k * preset.hidden_size * (g + inter)
    t_mem, t_cmp = bytes_ / ceilings.bandwidth, flops / ceilings.peak(operand)
    return bytes_, flops, max(t_mem, t_cmp), "memory" if t_mem >= t_cmp else "compute"


def preset_shapes(names: str) -> dict[str, tuple[int, int, int, int, str]]:
    """{name: (experts, top_k, hidden, intermediate at the preset's benchmark TP split,
    activation)} of comma-separated preset names (the prototype benchmarks' shape table)."""
    from fusedmoe.presets import get_preset

    return {name: (p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp, p.activation)
            for name, p in ((n, get_preset(n)) for n in names.split(","))}


def random_expert_weights(experts: int, hidden: int, inter: int, activation: str, *, device: torch.device,
                          dtype: torch.dtype, generator: torch.Generator, bias: bool = False) -> tuple:
    """(w13 [E, G, H], w2 [E, H, I], b13 [E, G] or None, b2 [E, H] or None) of N(0, 1) values
    scaled by 1/sqrt(fan-in), so the layer's outputs stay O(1); G = 2I for gated activations."""
    from fusedmoe.activations import is_gated

    rows = 2 * inter if is_gated(activation) else inter

    def randn(*shape, scale=1.0):
        return scaled_randn(shape, scale, dtype=dtype, generator=generator, device=device)

    return (randn(experts, rows, hidden, scale=hidden**-0.5), randn(experts, hidden, inter, scale=inter**-0.5),
            randn(experts, rows) if bias else None, randn(experts, hidden) if bias else None)


def scaled_randn(shape: tuple, scale: float, *, dtype: torch.dtype, generator: torch.Generator,
                 device: torch.device | None = None) -> torch.Tensor:
    """N(0, scale^2) values drawn in `dtype` itself (on `device`, default the generator's), scaled
    in place.

    Drawn in float32 and cast, a gpt-oss-120b w13 passed through 17 GB of float32 temporaries;
    blocks allocated next can sit in those cached segments, which `empty_cache` then cannot
    return: the likely reason each `fusedmoe tune --jobs` worker held 10.49 GiB for a 1.7 GB int4
    copy and 14 of them ran an H200 out of memory (2026-11-29)."""
    return torch.randn(*shape, device=device or generator.device, generator=generator, dtype=dtype).mul_(scale)


def preset_quant_reason(preset: Preset, quant: str | None) -> str | None:
    """Why `quant` cannot quantize this preset's weights at its benchmark split (a group scale
    that does not divide H or the per-GPU I: int4 g128 and gpt-oss's 2880), or None."""
    from fusedmoe.quant.scheme import get_scheme
    from fusedmoe.quant.weights import check_group_divides

    scheme = get_scheme(quant)
    if scheme is None:
        return None
    try:
        check_group_divides(scheme, "w13", preset.hidden_size)
        check_group_divides(scheme, "w2", preset.intermediate_size // preset.bench_tp)
    except ValueError as exc:
        return str(exc)
    return None


def check_cell(out: torch.Tensor, ref: torch.Tensor, scheme: str | None, device: torch.device) -> tuple[float, str | None]:
    """`fusedmoe bench --check`: (relative Frobenius error of a backend's output against its
    cell's reference, why that is beyond the fuzz's bound for the scheme or None). The bounds are
    `fuzz.scheme_tolerance`'s (chained fp8 accumulators where the device runs them)."""
    from fusedmoe import fuzz
    from fusedmoe.quant.scheme import get_scheme

    s = get_scheme(scheme)
    tol = fuzz.scheme_tolerance(s, out.dtype, chained_fp8=fuzz.scheme_chains_fp8(s, device))
    o, r = out.double(), ref.double()
    err = ((o - r).norm() / r.norm()).item() if r.norm() > 0 else float((o - r).norm() > 0)
    return err, fuzz.compare(out, r, tol)


# --check: runs of a deterministic backend's checked call that must give its first output bit for
# bit (a race passes one check now and then: the 4-bit fragment GEMMs' in-flight wgmma computed
# wrong rows on 3-13 of 25-40 runs of one plan on an H200, kernels._rs_sync)
CHECK_RUNS = 8


def repeat_mismatch(call: Callable[[], torch.Tensor], first: torch.Tensor, runs: int = CHECK_RUNS) -> str | None:
    """Why one of `call`'s runs 2..runs does not give `first` bit for bit (`fuzz.repeat_differs`), or None."""
    from fusedmoe.fuzz import repeat_differs

    for run in range(2, runs + 1):
        why = repeat_differs(first, call(), f"run {run} of {runs}")
        if why is not None:
            return why
    return None


def cell_generator(seed: int, tokens: int, device: torch.device | str) -> torch.Generator:
    """The generator of one cell's tokens and router logits: seeded by (seed, tokens) alone.

    A generator shared across the cells made a cell's inputs, and so its routing, depend on the
    token counts timed before it: int4 g32 Mixtral M=256 read 654-659 us alone or after M=1024 and
    732-741 us after M=1, 16 or 64 in one process (H200, 2026-11-29; SM clock 1980 MHz throughout).
    Small draws advance the generator alike, so those three left M=256 one other routing; at ~64
    slots an expert, how many experts spill into a second 64-row tile moves with the draw.
    """
    state = np.random.SeedSequence([seed, tokens]).generate_state(2, dtype=np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1]))


def cell_draws(preset: Preset, tokens: int, copies: int, seed: int, device: torch.device | str,
               dtype: torch.dtype, route_kw: dict | None = None) -> list[tuple]:
    """A cell's inputs: (x [T, H], logits [T, E], topk_weights, topk_ids) for each of its `copies`
    weight copies, from `cell_generator(seed, tokens)`; so the replay's mean is over `copies`
    routings (a single draw moved int4 Mixtral M=256 by ~12%). The ids are the preset's plain
    top-k of the logits (softmax, or sigmoid where the router weight goes on the input); with
    route_kw (`bench --routing`) the preset's own routing of them, as the timed calls run it."""
    if route_kw is None:
        route_kw = dict(renormalize=not preset.apply_router_weight_on_input,
                        scoring_func="sigmoid" if preset.apply_router_weight_on_input else "softmax")
    return routing_draws(tokens, preset.hidden_size, preset.num_experts, preset.top_k, copies,
                         cell_generator(seed, tokens, device), dtype, **route_kw)


def routing_draws(tokens: int, hidden: int, experts: int, top_k: int, copies: int, generator: torch.Generator,
                  dtype: torch.dtype, **route_kw) -> list[tuple]:
    """`copies` draws of (x [T, H] in dtype, logits [T, E] float32, topk_weights, topk_ids) from
    `generator`, the ids `select_experts(x, logits, top_k, **route_kw)`: one routing per rotated
    weight copy, for the bench (`cell_draws`) and the tuner (`tune.tune_shape`)."""
    from fusedmoe.routing import select_experts

    device = generator.device
    draws = []
    for _ in range(copies):
        x = torch.randn(tokens, hidden, device=device, generator=generator).to(dtype)
        logits = torch.randn(tokens, experts, device=device, generator=generator)
        draws.append((x, logits, *select_experts(x, logits, top_k, **route_kw)))
    return draws


def bench_preset(
    preset: Preset,
    backends: Sequence[str],
    tokens_list: Sequence[int],
    ceilings: Ceilings,
    *,
    copies: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    quant: str | None = None,
    routing: bool = False,
    check: bool = False,
) -> list[Row]:
    """Time each backend on one preset (its benchmark TP split) at each token count.

    quant: a W8A8 or weight-only scheme for `triton`, or NVFP4 / MXFP4-W4A8 for `marlin` (the
    other backends keep bf16 weights: the baseline). routing: every timed call runs
    `select_experts` first (the preset's routing, with its correction bias where it has one, on
    the cell's fixed logits), as a layer's forward does; bytes, FLOPs and the roofline stay the
    experts'. check: after timing, each backend's output on the first weight copy is compared
    with a reference on the same weights (`check_cell`; Row.rel_err, Row.mismatch), and a
    deterministic backend's call must repeat it bit for bit (`repeat_mismatch`): the float32
    `fused_experts_ref` for the bf16 baseline, the `emulation` backend for a quantized scheme (its
    numerical definition); for a weight-only execution of an activation-quantized scheme
    (`marlin`'s NVFP4 / MXFP4-W4A8) the emulation of its weight-only twin on the same codes
    (`weight_only_copy`: activations unquantized, as that execution runs them; the bound stays
    the scheme's, as the fuzz holds it).
    """
    from fusedmoe.api import fused_experts
    from fusedmoe.backends import REGISTRY
    from fusedmoe.quant.scheme import get_scheme
    from fusedmoe.routing import select_experts

    device = torch.device("cuda")
    inter = preset.intermediate_size // preset.bench_tp
    gen = torch.Generator(device=device).manual_seed(seed)
    h = preset.hidden_size
    w_bytes, a_bytes = quant_bytes(quant)
    keep_float = any(bench_scheme(b, quant) == "unquantized" for b in backends)
    weights, quantized, checked_copy = [], [], None
    for i in range(copies):
        w13, w2, b13, b2 = random_expert_weights(preset.num_experts, h, inter, preset.activation, device=device,
                                                 dtype=dtype, generator=gen, bias=preset.has_bias)
        if quant is not None:
            quantized.append(_quantized_copy(w13, w2, b13, b2, quant))
            if check and i == 0:  # emulation's copy of the same codes, in the checkpoint layout
                checked_copy = _quantized_copy(w13, w2, b13, b2, quant, prepare=False)
        weights.append((w13, w2, b13, b2) if keep_float else None)
    route_kw = dict(preset.routing)
    if routing and preset.has_correction_bias:  # its own generator: the cells' draws stay those of runs without
        bias_gen = torch.Generator(device=device).manual_seed(seed + 1)
        route_kw["e_score_correction_bias"] = 0.3 * torch.randn(preset.num_experts, device=device, generator=bias_gen)
    out: list[Row] = []
    for tokens in tokens_list:
        draws = cell_draws(preset, tokens, copies, seed, device, dtype, route_kw if routing else None)
        touched = statistics.fmean(int(torch.unique(d[3]).numel()) for d in draws)
        nbytes, flops, t_roof, bound = roofline(preset, tokens, touched, inter, ceilings, w_bytes, a_bytes,
                                                quant_operand(quant))
        results: dict[str, float] = {}
        refs: dict[str, torch.Tensor] = {}  # check: the cell's reference output per scheme
        for backend in backends:
            if progress:
                progress(f"{preset.name} M={tokens} {backend}")
            kw = dict(activation=preset.activation, backend=backend,
                      apply_router_weight_on_input=preset.apply_router_weight_on_input)
            if REGISTRY[backend].layout == "batched":  # local dispatch into [E, M, H] buffers, then combine
                kw["activation_format"] = "batched"
                buffers = preset.num_experts * tokens * h * torch.finfo(dtype).bits // 8
                if buffers > BATCHED_BUFFER_LIMIT:
                    out.append(_failed(preset, backend, tokens, touched, bound,
                                       f"batched buffers [{preset.num_experts}, {tokens}, {h}] of {buffers / 2**30:.1f}"
                                       f" GiB > {BATCHED_BUFFER_LIMIT / 2**30:.0f}: not run"))
                    continue
            # (w13, w2, b13, b2, QuantParams or None) per rotated copy
            copies_here = quantized if bench_scheme(backend, quant) != "unquantized" else [(*w, None) for w in weights]
            calls = [
                (lambda c=c, kw=kw, d=d:
                 fused_experts(d[0], c[0], c[1], d[2], d[3], w13_bias=c[2], w2_bias=c[3], quant=c[4], **kw))
                for c, d in zip(copies_here, draws, strict=True)
            ]
            if routing:
                calls = [
                    (lambda c=c, kw=kw, d=d:
                     fused_experts(d[0], c[0], c[1], *select_experts(d[0], d[1], preset.top_k, **route_kw),
                                   w13_bias=c[2], w2_bias=c[3], quant=c[4], **kw))
                    for c, d in zip(copies_here, draws, strict=True)
                ]
            try:
                t = time_rotated(calls, graph=backend not in EAGER_BACKENDS)
            except Exception as exc:
                out.append(_failed(preset, backend, tokens, touched, bound, f"{type(exc).__name__}: {exc}"))
                continue
            results[backend] = t
            row = Row(preset.name, backend, tokens, touched, t * 1e6, flops / t / 1e12, nbytes / t / 1e9,
                      100 * t_roof / t, bound)
            if check:
                scheme = bench_scheme(backend, quant)
                name = None if scheme == "unquantized" else scheme
                weight_only = name is not None and get_scheme(name).activation is not None and \
                    REGISTRY[backend].weight_only_execution
                ref_key = f"{scheme} weight-only" if weight_only else scheme
                try:
                    if ref_key not in refs:
                        # calls[0]'s: weight copy 0, draw 0, whose ids are already the ones it routes to
                        x, _, topk_w, topk_ids = draws[0]
                        copy = weights[0] if name is None else checked_copy
                        refs[ref_key] = _cell_reference(preset, x, topk_w, topk_ids,
                                                        weight_only_copy(copy) if weight_only else copy)
                    first = calls[0]()
                    row.rel_err, row.mismatch = check_cell(first, refs[ref_key], name, device)
                    if row.mismatch is None and REGISTRY[backend].deterministic:
                        row.mismatch = repeat_mismatch(calls[0], first)
                except Exception as exc:
                    row.mismatch = f"check failed: {type(exc).__name__}: {exc}"
            out.append(row)
        for row in out[-len(backends):]:
            if row.tokens == tokens and row.backend in results:
                row.speedup_vs = {b: results[b] / results[row.backend] for b in results if b != row.backend}
    del weights, quantized, checked_copy
    torch.cuda.empty_cache()
    return out


def _cell_reference(preset: Preset, x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor,
                    copy: tuple) -> torch.Tensor:
    """`bench_preset(check=True)`'s reference on one weight copy (`reference_output` with the
    preset's activation and router-weight placement)."""
    return reference_output(x, topk_w, topk_ids, copy, preset.activation, preset.apply_router_weight_on_input)


def weight_only_copy(copy: tuple) -> tuple:
    """A quantized copy (w13, w2, b13, b2, QuantParams) of an activation-quantized scheme (NVFP4
    W4A4, MXFP4 W4A8) as its weight-only twin reads it (`marlin.weight_only_twin`: the same codes
    and weight scales, activations unquantized): what `marlin` executes, for its reference."""
    from fusedmoe.backends.triton.marlin import weight_only_twin

    w13, w2, b13, b2, params = copy
    twin = dataclasses.replace(params, scheme=weight_only_twin(params.scheme), a13_scale=None, a2_scale=None)
    return w13, w2, b13, b2, twin


def reference_output(x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor, copy: tuple,
                     activation: str, apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The reference a timed output is checked against (`bench --check`, the tuner's plans): for
    (w13, w2, b13, b2) in bf16 / fp16 / fp32, the float32 `fused_experts_ref`; for (w13, w2, b13,
    b2, QuantParams) in the checkpoint layout (`_quantized_copy(prepare=False)`: emulation does
    not read the triton layer's fragments), the `emulation` backend."""
    from fusedmoe.api import fused_experts
    from fusedmoe.reference import fused_experts_ref

    kw = dict(activation=activation, apply_router_weight_on_input=apply_router_weight_on_input)
    if len(copy) == 4:
        w13, w2, b13, b2 = copy
        return fused_experts_ref(x, w13, w2, topk_w, topk_ids, w13_bias_LG=b13, w2_bias_LH=b2,
                                 out_dtype=torch.float32, **kw)
    w13, w2, b13, b2, params = copy
    return fused_experts(x, w13, w2, topk_w, topk_ids, w13_bias=b13, w2_bias=b2, quant=params,
                         backend="emulation", **kw)


def _failed(preset: Preset, backend: str, tokens: int, touched: float, bound: str, reason: str) -> Row:
    """The row of a backend that cannot run a cell here: its reason instead of times."""
    nan = float("nan")
    return Row(preset.name, backend, tokens, touched, nan, nan, nan, nan, bound, error=reason[:200])


def _quantized_copy(w13, w2, b13, b2, scheme: str, prepare: bool | None = None) -> tuple:
    """(q13, q2, b13, b2, QuantParams); static activation scales calibrated for N(0, 1) inputs.
    prepare (default: on a GPU): the codes and scales as the triton backend's process_weights
    leaves them for a layer (4-bit fragments, group-major int4 scales). Until 2026-11-27 only
    the scales were taken, so the 4-bit fragment GEMMs read checkpoint-ordered codes: the same
    bytes, so the times stood, but the values were wrong (tests/test_triton_wo.py::
    test_bench_copies_are_laid_out_as_the_layer_runs_them checks the layout now)."""
    from fusedmoe.quant.params import LAID_AS_SCALES
    from fusedmoe.quant.weights import quantize_weights

    static = scheme.endswith("_static")
    amax = (torch.tensor(6.0), torch.tensor(10.0)) if static else None  # |x| ~ 5 sigma, |a| ~ 8
    # a chunk of experts at a time (quant.weights.QUANTIZE_CHUNK_ELEMENTS): the float32 temporaries
    # of a whole gpt-oss-120b weight at once (~16 GB each) ran an 80 GB H100 out of memory
    q13, q2, params = quantize_weights(w13, w2, scheme, activation_amax=amax)
    if params.scheme.weight.dtype == "int4":  # bf16 group scales, as quant_bytes counts them
        # (quantize_weights stores them so for bf16 weights already; fp32 weights' are cast)
        params = dataclasses.replace(params, **{name: getattr(params, name).to(torch.bfloat16)
                                                for name in LAID_AS_SCALES
                                                if getattr(params, name) is not None})
    if q13.is_cuda if prepare is None else prepare:  # as the layer's process_weights leaves them
        from fusedmoe.backends.triton.weight_only import prepare_weights
        from fusedmoe.modular import ExpertWeights

        prepared = prepare_weights(ExpertWeights(q13, q2, b13, b2, params))
        q13, q2, params = prepared.w13, prepared.w2, prepared.quant
    return q13, q2, b13, b2, params


def format_table(rows: Sequence[Row], baselines: Sequence[str] = ("torch", "grouped_mm")) -> str:
    """The rows as a table; with a `check` column where any row was checked (its relative error,
    `!` where beyond the bound), and the mismatches' reasons below."""
    checked = any(r.rel_err is not None or r.mismatch for r in rows)
    head = f"{'preset':18} {'backend':11} {'M':>5} {'E_act':>5} {'us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'%roof':>6} {'bound':7}"
    head += "".join(f" {'vs ' + b:>14}" for b in baselines) + (f" {'check':>9}" if checked else "")
    lines, notes = [head, "-" * len(head)], []
    for r in rows:
        if r.error:
            lines.append(f"{r.preset:18} {r.backend:11} {r.tokens:>5} {r.experts_touched:>5g}  error: {r.error}")
            continue
        line = (f"{r.preset:18} {r.backend:11} {r.tokens:>5} {r.experts_touched:>5g} {r.us:>9.1f} "
                f"{r.tflops:>8.1f} {r.gbps:>7.0f} {r.roof_pct:>6.1f} {r.bound:7}")
        for b in baselines:
            s = r.speedup_vs.get(b)
            line += f" {f'{s:.2f}x' if s else '-':>14}"
        if checked:
            mark = "-" if r.rel_err is None else f"{r.rel_err:.1e}" + ("!" if r.mismatch else "")
            line += f" {mark:>9}"
            if r.mismatch:
                notes.append(f"{r.preset} {r.backend} M={r.tokens}: {r.mismatch}")
        lines.append(line)
    return "\n".join(lines + notes)


def mismatched(rows: Sequence[Row]) -> list[Row]:
    """The rows whose checked output was beyond its bound (`check_cell`), or whose check failed."""
    return [r for r in rows if r.mismatch]
