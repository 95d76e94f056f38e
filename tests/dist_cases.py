"""Multi-process cases for tests/test_distributed.py: data, and the function every rank runs.

Each `DistCase` is one layer split over a process group; `run_cases` (run by every rank through
`fusedmoe.launch.launch`) builds the same random checkpoint and batches on every rank from one
seed, runs the split layer on this rank's tokens and reports its relative error against the
single-process reference `fused_experts_ref` with the full weights, plus a bitwise rerun check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from fusedmoe import FusedMoE, ParallelConfig, fused_experts_ref
from fusedmoe.activations import ACTIVATIONS, is_gated
from fusedmoe.shared import SharedExperts
from quant_problems import code_flip_stats


@dataclass(frozen=True)
class DistCase:
    """tokens: tokens per DP rank (len == dp); routing "random" or "skewed" (every token to
    experts of EP rank `hot_rank`)."""

    name: str
    world: int
    tp: int = 1
    dp: int = 1
    ep: int = 1
    placement: str = "linear"
    dispatch: str = "alltoall"
    tokens: tuple[int, ...] = (7,)
    routing: str = "random"
    hot_rank: int = 0
    experts: int = 8
    top_k: int = 2
    hidden: int = 32
    inter: int = 24
    activation: str = "silu"
    bias: bool = False
    weight_on_input: bool = False
    backend: str = "cpu"
    max_num_tokens: int | None = None
    dtype: torch.dtype = torch.float32
    shared: bool = False  # a Qwen2-MoE-style shared expert with its sigmoid gate
    redundant: int = 0  # > 0: EPLB with this many redundant slots, rebalanced after one forward
    quant: str | None = None  # online-quantized weights; the reference is the unsplit layer
    quantize_dispatch: bool = True

    def __post_init__(self) -> None:
        if len(self.tokens) != self.dp:
            raise ValueError(f"{self.name}: tokens={self.tokens} needs one count per DP rank (dp={self.dp})")
        if max(self.ep, self.dp) * self.tp != self.world:
            raise ValueError(f"{self.name}: max(ep, dp) x tp != world={self.world}")

    def parallel(self, rank: int) -> ParallelConfig:
        return dataclasses.replace(
            ParallelConfig.for_rank(rank, tp_size=self.tp, dp_size=self.dp, ep_size=self.ep,
                                    placement=self.placement, dispatch=self.dispatch),
            quantize_dispatch=self.quantize_dispatch)


def _checkpoint(case: DistCase, gen: torch.Generator):
    gated = is_gated(case.activation)
    rows = 2 * case.inter if gated else case.inter
    w13 = torch.randn(case.experts, rows, case.hidden, generator=gen) / case.hidden**0.5
    w2 = torch.randn(case.experts, case.hidden, case.inter, generator=gen) / case.inter**0.5
    b13 = torch.randn(case.experts, rows, generator=gen) * 0.1 if case.bias else None
    b2 = torch.randn(case.experts, case.hidden, generator=gen) * 0.1 if case.bias else None
    return gated, w13, w2, b13, b2


def _layer(case: DistCase, rank: int | None, w, group, device: torch.device, seed: int) -> FusedMoE:
    """rank None: the unsplit layer."""
    gated, w13, w2, b13, b2 = (t if t is None or isinstance(t, bool) else t.to(device, case.dtype) for t in w)
    layer = FusedMoE(
        case.experts, case.top_k, case.hidden, case.inter, params_dtype=case.dtype, device=device,
        activation=case.activation, has_bias=case.bias, quant=case.quant,
        parallel=None if rank is None else case.parallel(rank),
        apply_router_weight_on_input=case.weight_on_input,
        scoring_func="sigmoid" if case.weight_on_input else "softmax",
        renormalize=not case.weight_on_input, backend=case.backend, group=group,
        max_num_tokens=case.max_num_tokens,
        shared_experts=SharedExperts(case.hidden, 40, gate=True, params_dtype=case.dtype, device=device)
        if case.shared else None,
        enable_eplb=case.redundant > 0 and rank is not None,
        num_redundant_experts=case.redundant if rank is not None else 0,
    )
    i = case.inter
    for e in range(case.experts):
        if gated:
            layer.load_expert_weight(e, "gate", w13[e, :i])
            layer.load_expert_weight(e, "up", w13[e, i:])
        else:
            layer.load_expert_weight(e, "up", w13[e])
        layer.load_expert_weight(e, "down", w2[e])
        if case.bias:
            if gated:
                layer.load_expert_weight(e, "gate_bias", b13[e, :i])
                layer.load_expert_weight(e, "up_bias", b13[e, i:])
            else:
                layer.load_expert_weight(e, "up_bias", b13[e])
            layer.load_expert_weight(e, "down_bias", b2[e])
    if case.shared:
        gen = torch.Generator().manual_seed(seed)
        named = [(f"mlp.shared_expert.{n}.weight", torch.randn(*shape, generator=gen) / shape[1] ** 0.5)
                 for n, shape in (("gate_proj", (40, case.hidden)), ("up_proj", (40, case.hidden)),
                                  ("down_proj", (case.hidden, 40)))]
        named.append(("mlp.shared_expert_gate.weight", torch.randn(1, case.hidden, generator=gen)))
        assert len(layer.load_weights([(n, t.to(case.dtype)) for n, t in named])) == 4
    layer.process_weights_after_loading()
    return layer


def shared_ref(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """s(x) = down(silu(gate(x)) * up(x)) * sigmoid(x @ g), fp32, from the layer's own tensors."""
    se = layer.shared_experts
    w = se.gate_up.detach().cpu().float()
    i = se.intermediate_size
    h = torch.nn.functional.silu(x @ w[:i].T) * (x @ w[i:].T)
    return (h @ se.down.detach().cpu().float().T) * torch.sigmoid(x @ se.gate.detach().cpu().float().T)


def _batch(case: DistCase, gen: torch.Generator, rank: int):
    total = sum(case.tokens)
    x = torch.randn(total, case.hidden, generator=gen)
    logits = torch.randn(total, case.experts, generator=gen)
    if case.routing == "skewed":
        from fusedmoe.distributed import ExpertPlacement

        owner = ExpertPlacement.create(case.experts, case.parallel(0)).owner_E()
        logits = logits + 20.0 * (owner == case.hot_rank).float()
    dp_rank = case.parallel(rank).dp_rank
    start = sum(case.tokens[:dp_rank])
    rows = slice(start, start + case.tokens[dp_rank])
    return x[rows], logits[rows]


def run_cases(rank: int, world: int, cases: list[DistCase], seed: int,
              device: str = "cpu") -> dict[str, dict]:
    """Every rank: each case's {rel_err, rows_off, rerun_equal, shape, local_experts,
    routed_owners}; rows_off: `quant_problems.code_flip_stats`'s rows off the reference.

    device "cuda": rank r runs on cuda:r (nccl). The reference runs in fp32 on the CPU, on the
    inputs rounded to the case's dtype.
    """
    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    results = {}
    for i, case in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + i)
        weights = _checkpoint(case, gen)
        layer = _layer(case, rank, weights, dist.group.WORLD, dev, seed + i)
        x, logits = _batch(case, gen, rank)
        x = x.to(dev, case.dtype)
        logits = logits.to(dev)
        with _wire_spy() as wire, _host_reads(layer) as host_reads:
            out = layer(x, logits)
        again = layer(x, logits)
        _, w13, w2, b13, b2 = (t if t is None or isinstance(t, bool) else t.to(case.dtype).float()
                               for t in weights)
        topk_w, topk_ids = (t.cpu() for t in layer.route(x, logits))
        ref = fused_experts_ref(x.cpu().float(), w13, w2, topk_w, topk_ids, activation=case.activation,
                                apply_router_weight_on_input=case.weight_on_input,
                                w13_bias_LG=b13, w2_bias_LH=b2)
        if case.shared:
            ref = ref + shared_ref(layer, x.cpu().float())
        if case.quant:  # quantized numerics: the reference is the same layer unsplit
            ref = _layer(case, None, weights, None, dev, seed + i)(x, logits).cpu().float()
        out, again = out.cpu().float(), again.cpu().float()
        after = {}
        if case.redundant:
            before = layer.eplb
            placement = layer.rebalance_experts()
            moved = layer(x, logits).cpu().float()
            after = {
                "rel_err_after_rebalance": _rel(moved, ref),
                "physical_to_logical": placement.physical_to_logical,
                "changed": placement != before,
            }
        scale = ref.abs().max().item() if ref.numel() else 0.0
        err = (out - ref).abs().max().item() if ref.numel() else 0.0
        owner = layer.placement.owner_E()[topk_ids.long()] if topk_ids.numel() else topk_ids
        rows_off = code_flip_stats(out, ref)[0]
        results[case.name] = after | {
            "rel_err": err / max(scale, 1e-30),
            "rows_off": rows_off,
            "rerun_equal": torch.equal(out, again),
            "shape": tuple(out.shape),
            "want_shape": tuple(x.shape),
            "local_experts": layer.w13_weight.shape[0],
            "routed_owners": sorted(set(owner.flatten().tolist())),
            "wire": sorted(set(wire)),
            "host_reads": sorted(set(host_reads)),
        }
    return results


@contextlib.contextmanager
def _host_reads(layer: FusedMoE):
    """Records each tensor-to-host read (`tolist`, `item`, `int()`, `bool()`, ...) made inside the
    layer's dispatch and combine: on a GPU each would be a device-to-host sync, which a CUDA
    graph cannot capture."""
    reads = []
    pf = getattr(layer._kernel, "prepare_finalize", None)
    if pf is None:
        yield reads
        return
    names = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
    real = {n: getattr(torch.Tensor, n) for n in names}
    own = {n for n in names if n in vars(torch.Tensor)}
    inside = [False]

    def spy(name):
        def read(self, *args, **kwargs):
            if inside[0]:
                reads.append(name)
            return real[name](self, *args, **kwargs)
        return read

    def watched(fn):
        def call(*args, **kwargs):
            inside[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
        return call

    for n in names:
        setattr(torch.Tensor, n, spy(n))
    pf.dispatch, pf.combine = watched(pf.dispatch), watched(pf.combine)
    try:
        yield reads
    finally:
        for n in names:
            if n in own:
                setattr(torch.Tensor, n, real[n])
            else:
                delattr(torch.Tensor, n)
        del pf.dispatch, pf.combine  # the class's methods again


def run_capture(rank: int, world: int, seed: int, local_only: bool = False) -> dict:
    """Every rank (NCCL, cuda:rank): the all-gather dispatch with a fixed capacity captured in a
    CUDA graph, then replayed on new inputs copied into the captured ones. Reports whether an eager
    call synced with the host (sync debug mode "error"), whether each replay equals an eager call
    on the same inputs bitwise, and each replay's relative error against the fp32 reference.

    local_only: the reference counts this rank's experts only (a loopback group on one GPU, whose
    reduce-scatter keeps this rank's own partial sums)."""
    case = DistCase("capture", world, dp=world, ep=world, dispatch="allgather", tokens=(40, 64)[:world],
                    experts=16, hidden=256, inter=128, backend="auto", dtype=torch.bfloat16,
                    max_num_tokens=64)
    import torch.distributed as dist

    dev = torch.device(f"cuda:{torch.cuda.current_device() if local_only else rank}")
    torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(seed)
    weights = _checkpoint(case, gen)
    layer = _layer(case, rank, weights, dist.group.WORLD, dev, seed)
    _, w13, w2, _, _ = (t if t is None or isinstance(t, bool) else t.to(case.dtype).float() for t in weights)
    x_s, logits_s = (t.to(dev) for t in _batch(case, gen, rank))
    x_s = x_s.to(case.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer(x_s, logits_s)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    sync_error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x_s, logits_s)
    except RuntimeError as exc:
        sync_error = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = layer(x_s, logits_s)
    replays = []
    for i in range(3):
        x, logits = _batch(case, torch.Generator().manual_seed(seed + 1 + i), rank)
        x_s.copy_(x.to(dev, case.dtype))
        logits_s.copy_(logits.to(dev))
        graph.replay()
        got = out_s.clone()
        eager = layer(x_s, logits_s)
        topk_w, topk_ids = (t.cpu() for t in layer.route(x_s, logits_s))
        if local_only:
            topk_ids = torch.where(layer.expert_map.cpu()[topk_ids.long()] >= 0, topk_ids, -1)
        ref = fused_experts_ref(x_s.cpu().float(), w13, w2, topk_w, topk_ids, activation=case.activation)
        replays.append({"equal_eager": torch.equal(got, eager), "rel_err": _rel(got.cpu().float(), ref)})
    return {"sync_error": sync_error, "replays": replays}


@contextlib.contextmanager
def _wire_spy():
    """Records (dtype, row width) of every tensor `distributed.send_rows` moves between ranks
    (the token rows, or their codes and scales when they travel quantized)."""
    import fusedmoe.distributed as fd

    moved, real = [], fd.send_rows

    def spy(rows_SH, key, move):
        def recording(t):
            moved.append((str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])))
            return move(t)

        return real(rows_SH, key, recording)

    fd.send_rows = spy
    try:
        yield moved
    finally:
        fd.send_rows = real


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def run_errors(rank: int, world: int, seed: int) -> dict[str, str]:
    """Every rank: the message of each misconfiguration it must refuse (before communicating)."""
    import torch.distributed as dist

    msgs = {}
    attempts = {
        "world_mismatch": lambda: FusedMoE(8, 2, 16, 16, parallel=ParallelConfig.for_rank(rank, ep_size=4),
                                           group=dist.group.WORLD),
        "rank_mismatch": lambda: FusedMoE(8, 2, 16, 16, parallel=ParallelConfig.for_rank(world - 1 - rank, ep_size=world),
                                          group=dist.group.WORLD),
        "experts_not_divisible": lambda: FusedMoE(6, 2, 16, 16, parallel=ParallelConfig.for_rank(rank, ep_size=4),
                                                  group=dist.group.WORLD),
    }
    for name, make in attempts.items():
        try:
            make()
        except ValueError as exc:
            msgs[name] = str(exc)
        else:
            msgs[name] = "no error"
    return msgs


GRIDS = {  # world -> (tp, dp, ep) splits of that many ranks
    2: ((1, 2, 2), (1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 2, 1)),
    4: ((1, 4, 4), (1, 2, 4), (1, 1, 4), (2, 2, 2), (2, 1, 2), (4, 1, 1), (2, 2, 1), (1, 4, 1)),
}


def random_cases(world: int, count: int, seed: int) -> list[DistCase]:
    """`count` random valid splits of `world` ranks: sizes, routing, features, dispatch."""
    import random

    rng = random.Random(seed)
    out = []
    for n in range(count):
        tp, dp, ep = rng.choice([g for g in GRIDS[world] if max(g[1], g[2]) * g[0] == world])
        experts = ep * rng.choice((2, 3, 4)) if ep > 1 else rng.choice((3, 5, 8))
        top_k = rng.randint(1, min(4, experts))
        placement = rng.choice(("linear", "round_robin"))
        redundant = rng.choice((0, 0, ep, 2 * ep)) if ep > 1 and placement == "linear" else 0
        on_input = top_k == 1 and rng.random() < 0.3
        dispatch = rng.choice(("alltoall", "alltoall_batched", "allgather"))
        out.append(DistCase(
            f"fuzz{world}_{n}", world, tp=tp, dp=dp, ep=ep, placement=placement, dispatch=dispatch,
            tokens=tuple(rng.choice((0, 1, 2, 5, 7, 13)) for _ in range(dp)),
            # skewed: all top-k on one rank's experts, so k must fit in them
            routing=rng.choice(("random", "skewed")) if ep > 1 and top_k <= experts // ep else "random",
            hot_rank=rng.randrange(ep), experts=experts, top_k=top_k,
            hidden=rng.choice((16, 24, 40)), inter=8 * tp * rng.choice((1, 2, 3)),
            activation=rng.choice(ACTIVATIONS), bias=rng.random() < 0.5, weight_on_input=on_input,
            backend="auto", shared=rng.random() < 0.3, redundant=redundant,
            # drawn last (earlier fields keep their values per seed): a fixed all-gather capacity
            max_num_tokens=None if dispatch != "allgather" or rng.random() < 0.5 else 13 + rng.randint(0, 3),
        ))
    return out
