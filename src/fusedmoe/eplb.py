"""Expert-parallel load balancing (EPLB): physical expert slots, replicas of hot experts, routing
spread over the replicas, per-slot load statistics, and the rebalancing that moves the weights.

    P = E + R physical slots, P / ep_size per EP rank (slot p lives on rank p // (P / ep_size))
    physical_to_logical [P]: the logical expert whose weights slot p holds (every one >= once)
    route:     logical id e of (token t, slot k) -> logical_to_physical[e, (t + k) % logical_replica_count[e]]
    record:    expert_load_view[p] += rows routed to p (this rank's tokens)
    rebalance: load per logical expert -> replica counts (the next replica to the largest
               load / count) -> replicas packed onto ranks, heaviest first, onto the least loaded
               rank with a free slot that does not hold that expert yet -> weights moved
Legend: E logical experts, R redundant slots, P physical slots, L = P / ep_size slots per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe.distributed import ExpertPlacement, all_to_all_v, exchange_counts


@dataclass(frozen=True)
class PhysicalPlacement:
    """Which logical expert each physical slot holds; slots are split linearly over EP ranks."""

    num_logical: int
    ep_size: int
    physical_to_logical: tuple[int, ...]

    def __post_init__(self) -> None:
        num_physical = len(self.physical_to_logical)
        if self.ep_size < 1 or num_physical % self.ep_size:
            raise ValueError(
                f"{num_physical} physical experts cannot be split evenly over ep_size={self.ep_size}"
            )
        if num_physical < self.num_logical:
            raise ValueError(f"{num_physical} physical slots cannot hold {self.num_logical} logical experts")
        bad = sorted({e for e in self.physical_to_logical if not 0 <= e < self.num_logical})
        if bad:
            raise ValueError(f"physical slots name logical experts outside [0, {self.num_logical}): {bad[:4]}")
        missing = sorted(set(range(self.num_logical)) - set(self.physical_to_logical))
        if missing:
            raise ValueError(f"logical experts without a physical slot: {missing[:8]}")

    @classmethod
    def initial(cls, num_logical: int, num_redundant: int, ep_size: int) -> PhysicalPlacement:
        """Slot p holds logical p mod E: the linear placement, then replicas of experts 0, 1, ..."""
        if num_redundant < 0:
            raise ValueError(f"num_redundant_experts={num_redundant} must be >= 0")
        num_physical = num_logical + num_redundant
        if num_physical % ep_size:
            raise ValueError(
                f"num_experts={num_logical} + num_redundant_experts={num_redundant} = {num_physical} "
                f"physical experts is not divisible by ep_size={ep_size} "
                f"({num_physical} % {ep_size} = {num_physical % ep_size})"
            )
        return cls(num_logical, ep_size, tuple(p % num_logical for p in range(num_physical)))

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def local_logical(self, rank: int) -> list[int]:
        """[L]: the logical expert of each of rank's slots, in slot order."""
        per = self.slots_per_rank
        return list(self.physical_to_logical[rank * per : (rank + 1) * per])

    def replica_counts(self) -> list[int]:
        counts = [0] * self.num_logical
        for e in self.physical_to_logical:
            counts[e] += 1
        return counts

    def logical_to_physical(self, width: int) -> torch.Tensor:
        """[E, width] int64: each logical expert's slots in increasing order, -1 padded."""
        table = torch.full((self.num_logical, width), -1, dtype=torch.int64)
        filled = [0] * self.num_logical
        for p, e in enumerate(self.physical_to_logical):
            if filled[e] >= width:
                raise ValueError(f"logical expert {e} has more than {width} replicas")
            table[e, filled[e]] = p
            filled[e] += 1
        return table

    def slot_placement(self) -> ExpertPlacement:
        """The owner of every physical slot (what the dispatch sends by)."""
        per = self.slots_per_rank
        return ExpertPlacement(self.ep_size, tuple(p // per for p in range(self.num_physical)))


def rebalance(load_E: list[float], num_physical: int, ep_size: int) -> PhysicalPlacement:
    """A placement of `num_physical` slots for logical loads `load_E` (deterministic).

    replicas: start at one each; each extra slot goes to argmax load[e] / count[e] (lowest e on
    ties). packing: replicas by load / count, heaviest first, each onto the rank with the
    smallest total (then fewest slots, then lowest rank) that has a free slot and no replica of
    that expert yet (any rank with a free slot if none). Each rank's slots sorted by expert.
    """
    num_logical = len(load_E)
    if num_physical < num_logical:
        raise ValueError(f"num_physical={num_physical} < {num_logical} logical experts")
    if ep_size < 1 or num_physical % ep_size:
        raise ValueError(f"num_physical={num_physical} is not divisible by ep_size={ep_size}")
    if any(x < 0 for x in load_E):
        raise ValueError("expert loads must be >= 0")
    count = [1] * num_logical
    for _ in range(num_physical - num_logical):
        e = max(range(num_logical), key=lambda i: (load_E[i] / count[i], -i))
        count[e] += 1
    replicas = sorted(((load_E[e] / count[e], e) for e in range(num_logical) for _ in range(count[e])),
                      key=lambda r: (-r[0], r[1]))
    per = num_physical // ep_size
    bins: list[list[int]] = [[] for _ in range(ep_size)]
    totals = [0.0] * ep_size
    for load, e in replicas:
        free = [r for r in range(ep_size) if len(bins[r]) < per]
        fresh = [r for r in free if e not in bins[r]] or free
        r = min(fresh, key=lambda i: (totals[i], len(bins[i]), i))
        bins[r].append(e)
        totals[r] += load
    return PhysicalPlacement(num_logical, ep_size, tuple(e for b in bins for e in sorted(b)))


def to_physical(topk_ids_TK: torch.Tensor, logical_to_physical: torch.Tensor,
                replica_count_E: torch.Tensor, num_physical: int) -> torch.Tensor:
    """Logical ids -> physical slots, replica (t + k) % count for token t, slot k: consecutive
    tokens of a hot expert alternate over its replicas whatever slot it takes (t*K + k would tie
    the replica to k when count divides K). Ids outside [0, E) become num_physical (contribute
    zero). Same dtype as the ids."""
    num_logical = replica_count_E.numel()
    ids = topk_ids_TK.long()
    valid = (ids >= 0) & (ids < num_logical)
    e = ids.clamp(0, num_logical - 1)
    num_tokens, top_k = ids.shape
    n = (torch.arange(num_tokens, device=ids.device).unsqueeze(1)
         + torch.arange(top_k, device=ids.device).unsqueeze(0))
    phys = logical_to_physical[e]  # [T, K, width]
    phys = phys.gather(-1, (n % replica_count_E[e]).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, phys, num_physical).to(topk_ids_TK.dtype)


def record_load(load_P: torch.Tensor, physical_TK: torch.Tensor) -> None:
    """load_P[p] += slots routed to p (slots at num_physical or beyond are not counted)."""
    num_physical = load_P.numel()
    ids = physical_TK.flatten().long()
    valid = (ids >= 0) & (ids < num_physical)
    load_P.scatter_add_(0, torch.where(valid, ids, 0), valid.to(load_P.dtype))


def move_plan(old: PhysicalPlacement, new: PhysicalPlacement, rank: int):
    """For `rank`: (local copies [(new slot, old slot)], rows to send per destination rank
    [[old slot, ...]], rows received per source rank [[new slot, ...]]). A slot whose expert the
    rank already holds is copied locally; otherwise the lowest rank holding it sends it."""
    ep = old.ep_size
    old_local = [old.local_logical(r) for r in range(ep)]
    new_local = [new.local_logical(r) for r in range(ep)]
    holder = {}
    for r in range(ep):
        for e in old_local[r]:
            holder.setdefault(e, r)
    copies = []
    send: list[list[int]] = [[] for _ in range(ep)]
    recv: list[list[int]] = [[] for _ in range(ep)]
    for dst in range(ep):
        for j, e in enumerate(new_local[dst]):
            if e in old_local[dst]:
                if dst == rank:
                    copies.append((j, old_local[dst].index(e)))
                continue
            src = holder[e]
            if src == rank:
                send[dst].append(old_local[src].index(e))
            if dst == rank:
                recv[src].append(j)
    return copies, send, recv


def move_rows(tensors: list[torch.Tensor], old: PhysicalPlacement, new: PhysicalPlacement,
              rank: int, group) -> None:
    """Rewrite each [L, ...] tensor in place so that slot j holds new's expert: local copies,
    the rest in one all_to_all of raw bytes over the EP group."""
    copies, send, recv = move_plan(old, new, rank)
    per = old.slots_per_rank
    rows = [t.reshape(per, -1).contiguous().view(torch.uint8) for t in tensors]
    widths = [r.shape[1] for r in rows]
    packed = torch.cat(rows, dim=1) if rows else None
    result = packed.clone()
    for j, i in copies:
        result[j] = packed[i]
    if group is not None:
        order = [i for dst in send for i in dst]
        counts = torch.tensor([len(d) for d in send], dtype=torch.int64, device=packed.device)
        sizes_send, sizes_recv = exchange_counts(counts, group)
        got = all_to_all_v(packed[order] if order else packed[:0], sizes_send, sizes_recv, group)
        slots = [j for src in recv for j in src]
        if slots:
            result[torch.tensor(slots, device=packed.device)] = got
    elif any(send) or any(recv):
        raise RuntimeError("moving experts between EP ranks needs the layer's process group")
    start = 0
    for t, width in zip(tensors, widths, strict=True):
        part = result[:, start : start + width].contiguous().view(t.dtype).reshape(t.shape)
        with torch.no_grad():
            t.copy_(part)
        start += width
