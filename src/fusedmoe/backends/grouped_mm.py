"""`grouped_mm` backend: PyTorch's grouped GEMM (`torch.nn.functional.grouped_mm`) over slots
sorted by expert. It is what many users would write by hand, so it is a row in our tables.

    order = stable_sort(local_expert_of_slot); offs = cumsum(counts)     # on device, no sync
    h = grouped_mm(x[token(order)], w13^T, offs); a = act(h); y = grouped_mm(a, w2^T, offs)
    out[t] = sum_k w * y[slot]                                           # fp32, deterministic
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedmoe.activations import apply_activation
from fusedmoe.modular import Experts, ExpertWeights, sort_slots

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    return _grouped_mm is not None


class GroupedMMExperts(Experts):
    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None) -> torch.Tensor:
        c = self.config
        num_tokens, hidden = x_TH.shape
        top_k = topk_ids_TK.shape[1]
        num_local = weights.w13.shape[0]
        slots = sort_slots(topk_ids_TK, expert_map_E, c.num_experts, num_local)
        local_N, order_N, token_N = slots.local_N, slots.order_N, slots.token_N
        offs = torch.cumsum(slots.counts[:num_local], 0, dtype=torch.int32)
        sorted_local = local_N[order_N].clamp(max=num_local - 1)
        w_N = topk_weights_TK.flatten()[order_N].float().unsqueeze(-1)

        x_NH = x_TH[token_N]
        if c.apply_router_weight_on_input:
            x_NH = (x_NH.float() * w_N).to(x_TH.dtype)
        h = _grouped_mm(x_NH, weights.w13.transpose(1, 2), offs=offs).float()
        if weights.w13_bias is not None:
            h = h + weights.w13_bias[sorted_local].float()
        a = apply_activation(h, c.activation, swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)
        y = _grouped_mm(a.to(x_TH.dtype), weights.w2.transpose(1, 2), offs=offs).float()
        if weights.w2_bias is not None:
            y = y + weights.w2_bias[sorted_local].float()
        if not c.apply_router_weight_on_input:
            y = y * w_N
        # Rows past the last group are not written by grouped_mm: select, never multiply, them away.
        is_valid = (local_N[order_N] < num_local).unsqueeze(-1)
        y = torch.where(is_valid, y, torch.zeros((), dtype=y.dtype, device=y.device))
        y_slots = torch.empty_like(y).index_copy_(0, order_N, y)  # back to slot order: no atomics
        out = y_slots.view(num_tokens, top_k, hidden).sum(dim=1).to(x_TH.dtype)
        if out_TH is not None:
            return out_TH.copy_(out)
        return out
