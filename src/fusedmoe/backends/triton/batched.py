"""The one-rank batched dispatch and combine on the GPU (`modular.BatchedLocalPrepareFinalize`).

    dispatch: x_b[e, j] = x[token] (* w) for the j-th slot of local expert e (slot order), counts
    combine:  out[t] = sum_k w[t, k] * y_b[e(t,k), j(t,k)]    (fp32, slot order: deterministic)

An `align` with BLOCK_M = 1 sorts the slots by expert (1-3 launches, stable), one kernel places
them (`kernels.moe_batched_scatter_kernel`), the top-k reduce gathers them back (`moe_reduce_kernel`):
about 6 launches per call where the torch ops took ~45 (H100, whole batched call, Qwen3-30B M=1
138 -> 61 us: benchmarks/results/2026-11-25_h100_6de5762_batched_dispatch_kernels.txt). The same
results as the torch path in `modular.py`, which CPU tensors and torch.compile take. Routing
weights and ids may be strided views (a column slice): both are read through contiguous copies.
Both functions replay their recorded launches on eager calls of a signature seen twice
(`replay.replayable`), as the batched experts between them do.
"""

from __future__ import annotations

import torch

from fusedmoe.backends.triton.experts import _reduce, align, triton_cdiv, triton_next_pow2
from fusedmoe.backends.triton.launcher import launch
from fusedmoe.backends.triton.replay import replayable


@replayable
def batched_dispatch(
    x_TH: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None,
    num_global_experts: int,
    num_local: int,
    max_tokens: int,
    weight_on_input: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_b [L, M, H], counts [L] int32 (clamped to M), dest [N] int64, raw counts [L] int32).

    dest[n] = e*M + j, the buffer row of slot n, or -1 where it does not run here (invalid id,
    mapped away) or lies past the buffer (j >= M: dropped, as the torch dispatch drops it). Rows
    of x_b past a count are not written.
    """
    from fusedmoe.backends.triton import kernels

    device = x_TH.device
    hidden = x_TH.shape[1]
    n = topk_ids_TK.numel()
    x_b = torch.empty(num_local, max_tokens, hidden, dtype=x_TH.dtype, device=device)
    dest = torch.full((n,), -1, dtype=torch.int64, device=device)
    raw, counts = torch.zeros(2, num_local, dtype=torch.int32, device=device).unbind(0)
    if n == 0 or num_local == 0:
        return x_b, counts, dest, raw
    sorted_slot, pos_expert, num_used, _ = align(topk_ids_TK, expert_map_E, num_global_experts, num_local, 1,
                                                 launch_kw={})
    positions = sorted_slot.numel()
    block_p = 16
    block_h = min(512, triton_next_pow2(hidden))
    flat = x_b.view(num_local * max_tokens, hidden)
    launch(kernels.moe_batched_scatter_kernel, (triton_cdiv(positions, block_p),),
        x_TH, flat, topk_weights_TK.reshape(-1).contiguous(), sorted_slot, pos_expert, num_used, dest, counts, raw,
        positions, topk_ids_TK.shape[1], max_tokens, num_local, hidden, positions.bit_length() + 1,
        x_TH.stride(0), x_TH.stride(1), flat.stride(0), flat.stride(1),
        SCALE_IN=weight_on_input, BLOCK_P=block_p, BLOCK_H=block_h, num_warps=4,
    )
    return x_b, counts, dest, raw


@replayable
def batched_combine(y_LMH: torch.Tensor, dest_N: torch.Tensor, topk_weights_TK: torch.Tensor,
                    weight_on_input: bool) -> torch.Tensor:
    """out [T, H] in y's dtype: each token's slots summed from their buffer rows (dest >= 0), times
    their routing weights unless the dispatch applied them (the top-k reduce, gathering)."""
    num_tokens, top_k = topk_weights_TK.shape
    hidden = y_LMH.shape[-1]
    out = torch.empty(num_tokens, hidden, dtype=y_LMH.dtype, device=y_LMH.device)
    if num_tokens == 0 or hidden == 0:
        return out
    weights = None if weight_on_input else topk_weights_TK.reshape(-1).contiguous()
    _reduce(y_LMH.reshape(-1, hidden), out, None, top_k, {}, rows=dest_N, weights=weights)
    return out
