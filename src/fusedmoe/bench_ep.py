"""Expert-parallel benchmark: one MoE layer split over N ranks against one device running it whole.

    t_ep  = max over ranks of the median time of dispatch -> experts -> combine (M tokens a rank)
    t_one = median time of the unsplit layer on one device for the same N * M tokens
    speedup = t_one / t_ep   (N devices doing the work of one; N is the ideal)
With `shared` (`--shared`): one shared expert of the routed experts' size (DeepSeek style) is
added to every timed call, and each row also times it in sequence after the routed experts
(FUSEDMOE_SHARED_OVERLAP=0): us_sequential / us says what the side-stream overlap with the
dispatch and combine buys. Routing is drawn once before timing (as in `fusedmoe bench`). The
all-to-all dispatches exchange split sizes through the host, so their calls run eagerly. With
`graph` (`--graph`, all-gather dispatch only) each M runs at a fixed capacity of M tokens a rank
(`max_num_tokens`) and the row adds the same call captured in a CUDA graph and replayed
(`us_graph`), so the launch and host time a graph removes is measured. One weight copy per rank:
decode shapes whose local experts fit in L2 read less HBM than a real model step would. Sizes are
the presets' own, without `fusedmoe bench`'s TP split (`Preset.bench_tp`): DeepSeek-V3 runs
I = 2048 here, I = 256 there. The one-device baseline is an eager call (host time included).

GPU: `torchrun --nproc-per-node N -m fusedmoe bench --ep N ...` (nccl, one GPU per rank), or
`fusedmoe bench --ep N` alone, which starts the N ranks itself. CPU smoke test (gloo, shrunken
presets): `fusedmoe bench --ep 2 --device cpu --scale 32 --tokens 4`.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from fusedmoe import knobs
from fusedmoe.presets import Preset


@dataclass(frozen=True)
class EpBenchSpec:
    presets: tuple[str, ...]
    tokens: tuple[int, ...]  # per rank
    dispatch: str = "alltoall"
    device: str = "cuda"  # cuda (nccl) | cpu (gloo)
    dtype: torch.dtype = torch.bfloat16
    scale: int = 1  # divide hidden and intermediate (presets.scaled)
    iters: int = 20
    backend: str = "auto"
    baseline: bool = True  # also time the unsplit layer on rank 0's device
    shared: bool = False  # add a shared expert (intermediate size of a routed one) to every call
    graph: bool = False  # all-gather with a fixed capacity: also time the call as a CUDA graph

    def __post_init__(self) -> None:
        if self.graph and (self.dispatch != "allgather" or self.device != "cuda"):
            raise ValueError("graph=True (--graph) needs dispatch='allgather' on cuda: the all-to-all "
                             "dispatches read their split sizes back to the host and cannot be captured")
        if self.dispatch not in ("alltoall", "alltoall_batched", "allgather"):
            raise ValueError(f"dispatch={self.dispatch!r}; expected alltoall, alltoall_batched or allgather")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}; expected 'cuda' or 'cpu'")
        if not self.tokens or min(self.tokens) < 0:
            raise ValueError(f"tokens={self.tokens}: give one or more counts >= 0")
        if self.iters < 1:
            raise ValueError(f"iters={self.iters} must be >= 1")


@dataclass
class EpRow:
    preset: str
    ep: int
    dispatch: str
    backend: str
    tokens_per_rank: int
    us: float  # slowest rank's median
    us_one_device: float | None
    speedup: float | None  # t_one / t_ep; ideal = ep
    us_sequential: float | None = None  # with shared: the shared expert after the routed ones
    us_graph: float | None = None  # with graph: the same call captured and replayed


def _median_seconds(fn: Callable[[], object], device: torch.device, iters: int, barrier) -> float:
    fn()  # JIT / autotune outside timing
    times = []
    for _ in range(iters):
        barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _layer(preset: Preset, parallel, spec: EpBenchSpec, device: torch.device, gen: torch.Generator, group):
    """The preset's layer with random local weights (N(0, 1/fan_in)), processed."""
    from fusedmoe.layer import FusedMoE

    routing = dict(preset.routing)
    layer = FusedMoE(
        preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size,
        params_dtype=spec.dtype, activation=preset.activation, has_bias=preset.has_bias,
        has_correction_bias=preset.has_correction_bias,
        apply_router_weight_on_input=preset.apply_router_weight_on_input,
        parallel=parallel, backend=spec.backend, device=device, group=group, **routing,
    )
    _fill_random((layer.w13_weight, layer.w2_weight), gen, device)
    with torch.no_grad():
        for b in (layer.w13_bias, layer.w2_bias):
            if b is not None:
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, device=device))
    layer.process_weights_after_loading()
    return layer


def run_rank(rank: int, world: int, spec: EpBenchSpec) -> list[dict]:
    """Every rank (the process group is up): rows as dicts, identical on every rank."""
    import torch.distributed as dist

    from fusedmoe.config import ParallelConfig
    from fusedmoe.presets import get_preset

    if spec.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    group = dist.group.WORLD

    def barrier() -> None:
        dist.barrier(group=group)

    rows = []
    for name in spec.presets:
        preset = get_preset(name).scaled(spec.scale)
        parallel = ParallelConfig.for_rank(rank, ep_size=world, dp_size=world, dispatch=spec.dispatch)
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        layer = _layer(preset, parallel, spec, device, gen, group)
        shared = _shared(preset, spec, device, gen) if spec.shared else None
        for tokens in spec.tokens:
            x = torch.randn(tokens, preset.hidden_size, generator=gen, device=device).to(spec.dtype)
            logits = torch.randn(tokens, preset.num_experts, generator=gen, device=device)
            topk_w, topk_ids = layer.route(x, logits)
            weights = layer._expert_weights()

            if spec.graph:  # this M's capacity (the prepare-finalize reads only max_num_tokens of it)
                pf = layer._kernel.prepare_finalize
                pf.config = replace(pf.config, max_num_tokens=max(1, tokens))
            split = _with_shared(functools.partial(layer._kernel, x, weights, topk_w, topk_ids,
                                                   expert_map_E=layer.expert_map), shared, x)
            t = torch.tensor([_median_seconds(split, device, spec.iters, barrier)], dtype=torch.float64,
                             device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            graphed = None
            if spec.graph:
                replay = _captured(split, device)
                t_graph = torch.tensor([_median_seconds(replay, device, spec.iters, barrier)],
                                       dtype=torch.float64, device=device)
                dist.all_reduce(t_graph, op=dist.ReduceOp.MAX, group=group)
                graphed = float(t_graph) * 1e6
            seq = None
            if shared is not None:
                with knobs.override(SHARED_OVERLAP=False):
                    t_seq = torch.tensor([_median_seconds(split, device, spec.iters, barrier)],
                                         dtype=torch.float64, device=device)
                dist.all_reduce(t_seq, op=dist.ReduceOp.MAX, group=group)
                seq = float(t_seq) * 1e6
            t_one = torch.zeros(1, dtype=torch.float64, device=device)
            if spec.baseline and rank == 0:
                t_one[0] = _one_device(preset, spec, device, tokens * world)
            dist.all_reduce(t_one, group=group)  # rank 0's value everywhere
            one = float(t_one) if spec.baseline and tokens else None
            rows.append(asdict(EpRow(
                preset.name, world, spec.dispatch, layer.selection.name, tokens, float(t) * 1e6,
                None if one is None else one * 1e6, None if one is None else one / float(t), seq, graphed,
            )))
        layer = shared = None  # free this preset's weights before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _captured(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn captured in a CUDA graph (after warm-up calls on a side stream, as torch asks; every rank
    captures at the same time, so the collectives pair up); returns its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _one_device(preset: Preset, spec: EpBenchSpec, device: torch.device, tokens: int) -> float:
    """Median seconds of the unsplit layer (all experts, no communication) on `tokens` tokens."""
    gen = torch.Generator(device=device).manual_seed(7)
    layer = _layer(preset, None, spec, device, gen, None)
    x = torch.randn(tokens, preset.hidden_size, generator=gen, device=device).to(spec.dtype)
    logits = torch.randn(tokens, preset.num_experts, generator=gen, device=device)
    topk_w, topk_ids = layer.route(x, logits)
    weights = layer._expert_weights()
    if tokens == 0:
        return 0.0
    call = functools.partial(layer._kernel, x, weights, topk_w, topk_ids)
    shared = _shared(preset, spec, device, gen) if spec.shared else None
    return _median_seconds(_with_shared(call, shared, x), device, spec.iters, lambda: None)


def _shared(preset: Preset, spec: EpBenchSpec, device: torch.device, gen: torch.Generator):
    """One shared expert of a routed expert's size (silu gated MLP), random N(0, 1/fan_in)."""
    from fusedmoe.shared import SharedExperts

    se = SharedExperts(preset.hidden_size, preset.intermediate_size, params_dtype=spec.dtype, device=device)
    _fill_random((se.gate_up, se.down), gen, device)
    return se


def _fill_random(params, gen: torch.Generator, device: torch.device) -> None:
    """Weights N(0, 1 / fan_in), fan_in = the last dimension."""
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen, device=device) / p.shape[-1] ** 0.5)


def _with_shared(routed: Callable[[], torch.Tensor], shared, x: torch.Tensor) -> Callable[[], object]:
    """routed(), plus the shared expert on x as the layer runs it (`shared.run_overlapped`)."""
    if shared is None:
        return routed
    from fusedmoe.shared import run_overlapped

    return lambda: run_overlapped(shared, x, routed)


def _torchrun_rank() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def run(spec: EpBenchSpec, ep: int, *, timeout_s: float = 1800.0) -> list[dict]:
    """Under torchrun: join its group (nccl or gloo) and run this rank. Otherwise start `ep`
    ranks with the built-in launcher. Returns the rows (every rank has them)."""
    import torch.distributed as dist

    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cuda" and torch.cuda.device_count() == 0:
        raise ValueError("bench --ep on cuda needs GPUs; --device cpu runs the gloo smoke test")
    launched = _torchrun_rank()
    if launched is not None:
        rank, world = launched
        if world != ep:
            raise ValueError(f"--ep {ep} but torchrun started {world} ranks (--nproc-per-node)")
        if spec.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        try:
            return run_rank(rank, world, spec)
        finally:
            dist.destroy_process_group()
    from fusedmoe.launch import launch

    return launch(run_rank, ep, args=(spec,), backend=backend, timeout_s=timeout_s)[0]


def format_rows(rows: list[dict]) -> str:
    shared = any(r.get("us_sequential") is not None for r in rows)
    graph = any(r.get("us_graph") is not None for r in rows)
    head = f"{'preset':22} {'ep':>3} {'dispatch':17} {'backend':14} {'M/rank':>6} {'us':>10} {'1-dev us':>10} {'speedup':>8}"
    if shared:
        head += f" {'seq. us':>10} {'overlap':>8}"
    if graph:
        head += f" {'graph us':>10} {'1-dev/graph':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        one = "-" if r["us_one_device"] is None else f"{r['us_one_device']:.1f}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"{r['preset']:22} {r['ep']:>3} {r['dispatch']:17} {r['backend']:14} "
                     f"{r['tokens_per_rank']:>6} {r['us']:>10.1f} {one:>10} {speed:>8}"
                     + (f" {r['us_sequential']:>10.1f} {r['us_sequential'] / r['us']:>7.2f}x" if shared else "")
                     + (_graph_cells(r) if graph else ""))
    return "\n".join(lines)


def _graph_cells(r: dict) -> str:
    g = r.get("us_graph")
    if g is None:
        return f" {'-':>10} {'-':>11}"
    speed = "-" if r["us_one_device"] is None else f"{r['us_one_device'] / g:.2f}x"
    return f" {g:>10.1f} {speed:>11}"
