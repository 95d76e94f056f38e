"""Expert, data and tensor parallelism over torch.distributed: placement, groups, dispatch/combine.

    placement: global expert g -> (EP rank owner[g], local index)       (linear | round_robin)
    dispatch:  this rank's (token, k) copies -> the rank owning expert k   (all_to_all_single)
               or every rank's tokens -> every rank                        (all_gather)
    experts:   this rank's experts on what it received (standard rows or batched buffers)
    combine:   results -> the token's rank, w * y summed over k in fp32 in slot order; partial
               outputs summed over EP ranks (reduce_scatter) and TP ranks (all_reduce, fp32)
Every rank ends with the full output of its own tokens. Ranks with zero tokens still take part
in every collective; split sizes are exchanged first (a device-to-host read), so token counts
may differ per rank. CUDA graphs: the all-gather dispatch with `max_num_tokens` set pads every
rank to that many rows instead and reads nothing back to the host, so it can be captured; the
all-to-all dispatches cannot (their split sizes are data).

Legend: T tokens (this rank), K top-k, N = T*K slots, H hidden, E global experts, L local
experts, R rows received by this rank, S rows sent by it, M max rows per local expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.modular import (
    ModularMoE,
    PrepareFinalize,
    StandardDispatch,
)

__all__ = [
    "AllGatherPrepareFinalize",
    "AllToAllBatchedPrepareFinalize",
    "AllToAllPrepareFinalize",
    "ExpertPlacement",
    "MoEGroups",
    "TensorParallelReduce",
    "make_distributed",
]


# Placement ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertPlacement:
    """Which EP rank holds each global expert: `owner[g]`. Each rank holds E / ep_size experts,
    in increasing global id; the local index of g is its position among its owner's experts.

    linear: rank r owns [r*L, (r+1)*L); round_robin: expert g lives on rank g % ep_size.
    """

    ep_size: int
    owner: tuple[int, ...]

    def __post_init__(self) -> None:
        num = len(self.owner)
        if self.ep_size < 1:
            raise ValueError(f"ep_size={self.ep_size} must be >= 1")
        if num == 0 or num % self.ep_size:
            raise ValueError(
                f"{num} experts cannot be split evenly over ep_size={self.ep_size} "
                f"({num} % {self.ep_size} = {num % self.ep_size if self.ep_size else num})"
            )
        bad = [(g, r) for g, r in enumerate(self.owner) if not 0 <= r < self.ep_size]
        if bad:
            raise ValueError(f"expert owners must be in [0, ep_size={self.ep_size}); got (expert, owner) {bad[:4]}")
        held = [self.owner.count(r) for r in range(self.ep_size)]
        want = num // self.ep_size
        uneven = {r: n for r, n in enumerate(held) if n != want}
        if uneven:
            raise ValueError(
                f"every EP rank must hold {num} / {self.ep_size} = {want} experts; "
                f"ranks holding another number (rank: experts): {uneven}"
            )

    @classmethod
    def create(cls, num_experts: int, parallel: ParallelConfig) -> ExpertPlacement:
        ep = parallel.ep_size
        if num_experts % ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep_size={ep} "
                f"({num_experts} % {ep} = {num_experts % ep})"
            )
        local = num_experts // ep
        if parallel.placement == "linear":
            owner = tuple(g // local for g in range(num_experts))
        else:
            owner = tuple(g % ep for g in range(num_experts))
        return cls(ep, owner)

    @property
    def num_experts(self) -> int:
        return len(self.owner)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def local_to_global(self, rank: int) -> torch.Tensor:
        """[L] int64: the global ids rank `rank` holds, in local order."""
        return torch.tensor([g for g, r in enumerate(self.owner) if r == rank], dtype=torch.int64)

    def expert_map(self, rank: int) -> torch.Tensor:
        """[E] int32: global id -> local index on `rank`, -1 where another rank holds it."""
        expert_map = torch.full((self.num_experts,), -1, dtype=torch.int32)
        expert_map[self.local_to_global(rank)] = torch.arange(self.num_local_experts, dtype=torch.int32)
        return expert_map

    def owner_E(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.owner, dtype=torch.int64, device=device)


# Process groups ----------------------------------------------------------------------------------
_SUBGROUPS: dict[tuple, tuple] = {}


class MoEGroups:
    """The groups one layer talks over, from the (outer x tp) grid of `parallel`.

    outer: the ranks with this tp_rank (EP, or DP without EP); tp: the ranks with this outer
    rank; replicas: the outer ranks of this DP rank (same tokens). Each is None when it would
    hold one rank. Groups that are not the whole group are created with `dist.new_group`, a
    collective of the default group: every process must build the layer (the groups are
    created once per grid and shared by every layer on it).
    """

    def __init__(self, parallel: ParallelConfig, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "a process group was requested but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) first"
            )
        group = dist.group.WORLD if group is None else group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world != parallel.world_size:
            raise ValueError(
                f"the process group has {world} ranks but {parallel} spans "
                f"max(ep_size={parallel.ep_size}, dp_size={parallel.dp_size}) x "
                f"tp_size={parallel.tp_size} = {parallel.world_size}"
            )
        if rank != parallel.rank:
            raise ValueError(
                f"this process is rank {rank} of the group but the config says rank "
                f"{parallel.rank} (outer_rank {parallel.outer_rank} x tp_size {parallel.tp_size} "
                f"+ tp_rank {parallel.tp_rank}); build it with ParallelConfig.for_rank({rank}, ...)"
            )
        self.parallel = parallel
        self.group = group
        outer, tp, reps = parallel.outer_size, parallel.tp_size, parallel.token_replicas
        self.outer: dist.ProcessGroup | None = None
        self.tp: dist.ProcessGroup | None = None
        # replicas: the outer ranks holding this rank's tokens (same tp_rank), when they are
        # neither one rank nor the whole outer axis.
        self.replicas: dist.ProcessGroup | None = None
        if tp == 1:
            self.outer = group if outer > 1 else None
        elif outer == 1:
            self.tp = group
        needs_outer_tp = tp > 1 and outer > 1
        needs_replicas = 1 < reps < outer
        if needs_outer_tp or needs_replicas:
            key = (id(group), outer, tp, reps)
            if key not in _SUBGROUPS:
                ranks = [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r
                         for r in range(world)]
                tp_groups = outer_groups = replica_groups = None
                if needs_outer_tp:
                    tp_groups = [dist.new_group([ranks[o * tp + t] for t in range(tp)])
                                 for o in range(outer)]
                    outer_groups = [dist.new_group([ranks[o * tp + t] for o in range(outer)])
                                    for t in range(tp)]
                if needs_replicas:
                    replica_groups = [[dist.new_group([ranks[(d * reps + c) * tp + t] for c in range(reps)])
                                       for d in range(outer // reps)] for t in range(tp)]
                _SUBGROUPS[key] = (outer_groups, tp_groups, replica_groups)
            outer_groups, tp_groups, replica_groups = _SUBGROUPS[key]
            if needs_outer_tp:
                self.outer = outer_groups[parallel.tp_rank]
                self.tp = tp_groups[parallel.outer_rank]
            if needs_replicas:
                self.replicas = replica_groups[parallel.tp_rank][parallel.outer_rank // reps]
        if reps > 1 and reps == outer:
            self.replicas = self.outer  # dp_size 1: the whole outer axis holds the same tokens


# Collectives with unequal sizes ------------------------------------------------------------------
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same arguments).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def exchange_counts(send_counts: torch.Tensor, group) -> tuple[list[int], list[int]]:
    """(send, recv) split sizes of an all-to-all: rank r's send_counts[j] is j's recv[r]."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return send_counts.tolist(), recv.tolist()


def all_to_all_v(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows [sum(send), ...] split by `send` -> rows [sum(recv), ...] (rank order)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def gather_sizes(n: int, group, device: torch.device) -> list[int]:
    size = dist.get_world_size(group)
    out = torch.empty(size, dtype=torch.int64, device=device)
    _all_gather(out, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return out.tolist()


def all_gather_v(x: torch.Tensor, sizes: list[int], group, fill=0) -> torch.Tensor:
    """Every rank's rows, concatenated in rank order; sizes[r] rows from rank r (each rank's rows
    padded with `fill` to the largest on the wire). Equal sizes (a fixed capacity): the wire layout
    is the result, padding rows included."""
    width = max(1, max(sizes))
    out = x.new_empty((len(sizes) * width, *x.shape[1:]))
    padded = x.contiguous()
    if x.shape[0] != width:
        padded = x.new_full((width, *x.shape[1:]), fill)
        padded[: x.shape[0]] = x
    _all_gather(out, padded, group=group)
    if min(sizes) == width:
        return out
    return torch.cat([out[r * width : r * width + n] for r, n in enumerate(sizes)])


def reduce_scatter_v(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """x holds every rank's block (sizes[r] rows each, rank order); returns the sum over ranks
    of this rank's block."""
    width = max(1, max(sizes))
    if min(sizes) == width:  # equal sizes: x is already the wire layout
        out = x.new_empty((width, *x.shape[1:]))
        _reduce_scatter(out, x.contiguous(), group=group)
        return out
    padded = x.new_zeros((len(sizes) * width, *x.shape[1:]))
    start = 0
    for r, n in enumerate(sizes):
        padded[r * width : r * width + n] = x[start : start + n]
        start += n
    out = x.new_empty((width, *x.shape[1:]))
    _reduce_scatter(out, padded, group=group)
    return out[: sizes[rank]]


# Activations on the wire ------------------------------------------------------------------------
# Schemes whose experts quantize x with per-row dynamic scales: rows may cross the wire already
# quantized (1 byte an element plus fp32 scales instead of 2 or 4). The receiver dequantizes to
# the activation dtype; the experts' own quantization of those rows finds the same scales and
# codes, up to one rounding of the dequantized value to that dtype.
WIRE_KEYS = (("fp8", "token"), ("fp8", "group"), ("int8", "token"))


def wire_key(config: MoEConfig):
    """The activation QuantKey rows are sent in, or None (sent in the activation dtype)."""
    scheme = config.quant
    if not config.parallel.quantize_dispatch or scheme is None or scheme.activation is None:
        return None
    key = scheme.activation
    if not key.dynamic or (key.dtype, key.granularity) not in WIRE_KEYS:
        return None
    return key


def quantize_rows(x_SH: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [S, H] uint8 (fp8 bits or int8 two's complement), scales [S, groups] fp32)."""
    from fusedmoe.quant.formats import FP8_MAX, INT_RANGE, absmax_scale, fp8_quantize, int_quantize

    x = x_SH.float()
    hidden = x.shape[1]
    group = key.group if key.granularity == "group" else hidden
    padded = torch.nn.functional.pad(x, (0, -hidden % group)).view(x.shape[0], -1, group)
    fmt_max = FP8_MAX if key.dtype == "fp8" else INT_RANGE[8][1]
    scale = absmax_scale(padded.abs().amax(-1, keepdim=True), fmt_max)
    if key.dtype == "fp8":
        q = fp8_quantize(padded, scale)
    else:
        q = int_quantize(padded, scale, 8).to(torch.int8)
    codes = q.flatten(1)[:, :hidden].contiguous().view(torch.uint8)
    return codes, scale.squeeze(-1).contiguous()


def dequantize_rows(codes_SH: torch.Tensor, scale_SG: torch.Tensor, key, dtype: torch.dtype) -> torch.Tensor:
    from fusedmoe.quant.formats import FP8_DTYPE

    hidden = codes_SH.shape[1]
    group = key.group if key.granularity == "group" else hidden
    q = codes_SH.view(FP8_DTYPE if key.dtype == "fp8" else torch.int8).float()
    q = torch.nn.functional.pad(q, (0, -hidden % group)).view(q.shape[0], -1, group)
    return (q * scale_SG.unsqueeze(-1)).flatten(1)[:, :hidden].to(dtype)


def send_rows(rows_SH: torch.Tensor, key, move) -> torch.Tensor:
    """move(tensor) -> tensor (an all_to_all_v or all_gather_v), applied to the rows as they
    travel: quantized codes and scales under `key`, else as they are."""
    if key is None:
        return move(rows_SH)
    codes, scale = quantize_rows(rows_SH, key)
    return dequantize_rows(move(codes), move(scale), key, rows_SH.dtype)


# Prepare / finalize ------------------------------------------------------------------------------
class _Distributed(PrepareFinalize):
    """Shared steps: take this rank's share of replicated tokens, reduce TP partials, rebuild."""

    def __init__(self, config: MoEConfig, groups: MoEGroups, placement: ExpertPlacement):
        self.config = config
        self.parallel = config.parallel
        self.groups = groups
        self.placement = placement
        self.wire = wire_key(config)
        self._owner: torch.Tensor | None = None

    def owner_E(self, device: torch.device) -> torch.Tensor:
        if self._owner is None or self._owner.device != device:
            self._owner = self.placement.owner_E(device)
        return self._owner

    def _share(self, num_tokens: int, replica: int | None = None) -> slice:
        """The tokens a replica (default: this rank's) dispatches: the EP ranks of one DP rank hold
        the same tokens and split them evenly (replica c of r takes [c*T/r, (c+1)*T/r))."""
        r = self.parallel.token_replicas
        c = self.parallel.outer_rank % r if replica is None else replica
        return slice(c * num_tokens // r, (c + 1) * num_tokens // r)

    def _share_sizes(self, num_tokens: int) -> list[int]:
        """Rows of each replica's share (replica order): every replica holds the same tokens, so
        each computes all the sizes itself."""
        shares = (self._share(num_tokens, c) for c in range(self.parallel.token_replicas))
        return [s.stop - s.start for s in shares]

    def _rebuild(self, out_TH: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each replica's share of the output -> the whole of it on every replica (an all-gather
        over the replica group, in share order; the sizes known without asking)."""
        if self.parallel.token_replicas == 1:
            return out_TH
        return all_gather_v(out_TH, self._share_sizes(num_tokens), self.groups.replicas)

    def _reduce_tp(self, out_TH: torch.Tensor) -> torch.Tensor:
        if self.groups.tp is not None:
            dist.all_reduce(out_TH, group=self.groups.tp)
        return out_TH


@dataclass
class AllToAllHandle:
    """What dispatch did, for combine: the sent slots (grouped by destination rank), the split
    sizes both ways, this rank's routing weights and token counts."""

    slots_S: torch.Tensor
    send: list[int]
    recv: list[int]
    topk_weights_TK: torch.Tensor
    num_tokens: int  # before taking this rank's share
    share: slice


class AllToAllPrepareFinalize(_Distributed):
    """Standard layout: each valid (token, k) copy goes to the rank owning expert k.

        dispatch: rows x[t] (x[t] * w[t,k] with weight on input) and ids, grouped by owner rank,
                  through all_to_all_single (counts exchanged first); the receiver runs them as
                  top-1 rows of weight 1 with its expert_map
        combine:  y back through all_to_all_single; out[t] = sum_k w[t,k] * y[t,k] (fp32)
    Ids outside [0, E) are never sent and contribute zero.
    """

    def _send(self, x_TH, topk_weights_TK, topk_ids_TK):
        c, groups = self.config, self.groups
        num_tokens = x_TH.shape[0]
        share = self._share(num_tokens)
        x, w, ids = x_TH[share], topk_weights_TK[share], topk_ids_TK[share]
        top_k = ids.shape[1]
        ids_N = ids.flatten().long()
        valid_N = (ids_N >= 0) & (ids_N < c.num_experts)
        outer = self.parallel.outer_size
        owner = self.owner_E(x.device)[ids_N.clamp(0, c.num_experts - 1)]
        dest_N = torch.where(valid_N, owner, outer)
        order_N = torch.sort(dest_N, stable=True).indices
        counts = torch.zeros(outer + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, dest_N, torch.ones_like(dest_N))
        send, recv = exchange_counts(counts[:outer].contiguous(), groups.outer)
        slots_S = order_N[: sum(send)]
        rows = x[slots_S // top_k]
        if c.apply_router_weight_on_input:
            rows = (rows.float() * w.flatten()[slots_S].float().unsqueeze(-1)).to(x.dtype)
        x_RH = send_rows(rows, self.wire, lambda t: all_to_all_v(t, send, recv, groups.outer))
        ids_R = all_to_all_v(ids_N[slots_S].to(torch.int32), send, recv, groups.outer)
        return x_RH, ids_R, AllToAllHandle(slots_S, send, recv, w, num_tokens, share)

    def dispatch(self, x_TH, topk_weights_TK, topk_ids_TK, expert_map_E) -> StandardDispatch:
        if expert_map_E is None:
            raise ValueError("expert-parallel dispatch needs this rank's expert_map")
        x_RH, ids_R, handle = self._send(x_TH, topk_weights_TK, topk_ids_TK)
        ones = torch.ones(x_RH.shape[0], 1, dtype=torch.float32, device=x_RH.device)
        return StandardDispatch(x_RH, ones, ids_R.unsqueeze(1), expert_map_E, handle)

    def combine(self, y_RH: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        h = handle
        y_SH = all_to_all_v(y_RH, h.recv, h.send, self.groups.outer)
        w = h.topk_weights_TK
        num, top_k = w.shape
        hidden = y_RH.shape[1]
        values = y_SH.float()
        if not self.config.apply_router_weight_on_input:
            values = values * w.flatten()[h.slots_S].float().unsqueeze(-1)
        out_N = torch.zeros(num * top_k, hidden, dtype=torch.float32, device=y_RH.device)
        out_N.index_copy_(0, h.slots_S, values)
        out = self._reduce_tp(out_N.view(num, top_k, hidden).sum(dim=1))
        return self._rebuild(out.to(y_RH.dtype), h.num_tokens)


@dataclass
class BatchedA2AHandle:
    a2a: AllToAllHandle
    local_R: torch.Tensor
    row_R: torch.Tensor
    top_k: int = 1  # the received rows are top-1 rows, as in the standard layout's dispatch

    @property
    def num_slots(self) -> int:
        """The rows received: at most this many buffer rows are live."""
        return self.local_R.numel()


class AllToAllBatchedPrepareFinalize(AllToAllPrepareFinalize):
    """Batched layout: the all-to-all above, the received rows placed in per-local-expert
    buffers x[L, M, H] with counts [L] (M = max_num_tokens x outer ranks when the config sets
    max_num_tokens, which fixes the shape; else the largest count)."""

    def dispatch(self, x_TH, topk_weights_TK, topk_ids_TK, expert_map_E, num_local: int):
        if expert_map_E is None:
            raise ValueError("expert-parallel dispatch needs this rank's expert_map")
        x_RH, ids_R, handle = self._send(x_TH, topk_weights_TK, topk_ids_TK)
        local_R = expert_map_E.long()[ids_R.long()]
        counts_L = torch.zeros(num_local, dtype=torch.int64, device=x_RH.device)
        counts_L.scatter_add_(0, local_R, torch.ones_like(local_R))
        worst = int(counts_L.max()) if num_local and local_R.numel() else 0
        cap = self.config.max_num_tokens
        if cap is not None:
            width = cap * self.parallel.outer_size
            if worst > width:
                raise ValueError(
                    f"a local expert received {worst} rows but the batched buffers hold "
                    f"max_num_tokens={cap} x {self.parallel.outer_size} ranks = {width}"
                )
        else:
            width = max(1, worst)
        order_R = torch.sort(local_R, stable=True).indices
        start_L = torch.cumsum(counts_L, 0) - counts_L
        row_sorted = torch.arange(local_R.numel(), device=x_RH.device) - start_L[local_R[order_R]]
        row_R = torch.empty_like(row_sorted).scatter_(0, order_R, row_sorted)
        x_LMH = x_RH.new_empty(num_local, width, x_RH.shape[1])  # rows past a count are never read
        x_LMH[local_R, row_R] = x_RH
        return x_LMH, counts_L.to(torch.int32), BatchedA2AHandle(handle, local_R, row_R)

    def combine(self, y_LMH: torch.Tensor, handle: BatchedA2AHandle) -> torch.Tensor:
        return super().combine(y_LMH[handle.local_R, handle.row_R], handle.a2a)


@dataclass
class AllGatherHandle:
    sizes: list[int]  # rows each outer rank gathered (all `max_num_tokens` with a fixed capacity)
    num_tokens: int  # before taking this rank's share
    rows: int  # this rank's share


class AllGatherPrepareFinalize(_Distributed):
    """Standard layout, DP+EP the simple way: every rank sees every token.

        dispatch: all_gather x, weights, ids (unequal counts padded to the largest)
        experts:  this rank's experts on all tokens (expert_map), weighted, summed over k
        combine:  reduce_scatter the partial outputs (fp32) back to the tokens' ranks

    With `max_num_tokens` set (the most tokens one rank dispatches per call) every rank's rows
    are padded to it (zero rows, weight 0, id -1: they contribute nothing), so no counts are
    exchanged: the forward reads nothing back to the host and is CUDA-graph capturable (NCCL).
    A rank with more rows than that raises before any collective.
    """

    def __init__(self, config: MoEConfig, groups: MoEGroups, placement: ExpertPlacement):
        super().__init__(config, groups, placement)
        if config.apply_router_weight_on_input:
            self.wire = None  # the experts quantize x * w, and w is applied after the gather

    def dispatch(self, x_TH, topk_weights_TK, topk_ids_TK, expert_map_E) -> StandardDispatch:
        if expert_map_E is None:
            raise ValueError("expert-parallel dispatch needs this rank's expert_map")
        share = self._share(x_TH.shape[0])
        x, w, ids = x_TH[share], topk_weights_TK[share].float(), topk_ids_TK[share].to(torch.int32)
        group = self.groups.outer
        cap = self.config.max_num_tokens
        rows = x.shape[0]
        if cap is None:
            sizes = gather_sizes(rows, group, x.device)
        else:
            if rows > cap:
                raise ValueError(
                    f"this rank dispatches {rows} tokens but max_num_tokens={cap} (the fixed capacity "
                    f"of the all-gather dispatch); raise max_num_tokens or split the batch"
                )
            sizes = [cap] * dist.get_world_size(group)  # padding rows: zeros, weight 0, id -1 (add nothing)
        x_all = send_rows(x, self.wire, lambda t: all_gather_v(t, sizes, group))
        w_all = all_gather_v(w, sizes, group)
        ids_all = all_gather_v(ids, sizes, group, fill=-1)
        handle = AllGatherHandle(sizes, x_TH.shape[0], rows)
        return StandardDispatch(x_all, w_all, ids_all, expert_map_E, handle)

    def combine(self, y_MH: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        rank = dist.get_rank(self.groups.outer)
        out = reduce_scatter_v(y_MH.float(), handle.sizes, rank, self.groups.outer)[: handle.rows]
        out = self._reduce_tp(out)
        return self._rebuild(out.to(y_MH.dtype), handle.num_tokens)


class TensorParallelReduce:
    """Any one-rank prepare/finalize, then the TP partial sums all-reduced (fp32)."""

    def __init__(self, inner, groups: MoEGroups):
        self.inner = inner
        self.groups = groups

    def dispatch(self, *args, **kwargs):
        return self.inner.dispatch(*args, **kwargs)

    def combine(self, y, handle) -> torch.Tensor:
        out = self.inner.combine(y, handle)
        reduced = out.float()
        dist.all_reduce(reduced, group=self.groups.tp)
        return reduced.to(out.dtype)


def make_distributed(config: MoEConfig, experts, groups: MoEGroups,
                     placement: ExpertPlacement) -> ModularMoE:
    """The modular kernel for this rank: the prepare/finalize the parallel config asks for."""
    from fusedmoe.modular import make_modular

    p = config.parallel
    batched = experts.layout == "batched"
    if not p.use_ep:
        kernel = make_modular(config, experts)
        if groups.tp is not None:
            kernel.prepare_finalize = TensorParallelReduce(kernel.prepare_finalize, groups)
        return kernel
    if batched != p.use_batched_activation_format:
        raise ValueError(
            f"backend layout {experts.layout!r} does not match dispatch={p.dispatch!r} "
            f"(batched experts need dispatch='alltoall_batched')"
        )
    cls = {"alltoall": AllToAllPrepareFinalize, "alltoall_batched": AllToAllBatchedPrepareFinalize,
           "allgather": AllGatherPrepareFinalize}[p.dispatch]
    return ModularMoE(cls(config, groups, placement), experts)

