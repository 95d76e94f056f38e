"""`cpu` backend: slots sorted by expert, one matmul per expert segment, fp32 reduction.

    order = stable_sort(local_expert_of_slot)      # invalid slots sort last, past every expert
    for each expert e with a non-empty segment s:  y[s] = w2[e] @ act(w13[e] @ x[s])
    out = index_add(token_of_slot, w * y)          # fp32, then cast to x's dtype
GEMMs run in the weights' dtype (oneDNN accumulates bf16/fp16 in fp32); the activation and the
top-k reduction run in fp32. No Python loop over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedmoe.activations import apply_activation
from fusedmoe.modular import Experts, ExpertWeights, sort_slots


class CpuExperts(Experts):
    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None) -> torch.Tensor:
        c = self.config
        num_tokens, hidden = x_TH.shape
        num_local = weights.w13.shape[0]
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x_TH.device)
        if num_tokens:
            slots = sort_slots(topk_ids_TK, expert_map_E, c.num_experts, num_local)
            order_N, token_N = slots.order_N, slots.token_N
            counts = slots.counts.tolist()  # host-side segment bounds: fine on the CPU
            w_N = topk_weights_TK.flatten()[order_N].float().unsqueeze(-1)
            x_NH = x_TH[token_N]
            if c.apply_router_weight_on_input:
                x_NH = (x_NH.float() * w_N).to(x_TH.dtype)
            y_NH = torch.empty(len(order_N), hidden, dtype=torch.float32, device=x_TH.device)
            start = 0
            for e in range(num_local):
                end = start + counts[e]
                if end > start:
                    y_NH[start:end] = self._expert(x_NH[start:end], weights, e)
                start = end
            valid_rows = start  # rows past the last expert are invalid slots: they add nothing
            if not c.apply_router_weight_on_input:
                y_NH[:valid_rows] *= w_N[:valid_rows]
            out.index_add_(0, token_N[:valid_rows], y_NH[:valid_rows])
        result = out.to(x_TH.dtype)
        if out_TH is not None:
            return out_TH.copy_(result)
        return result

    def _expert(self, x_SH: torch.Tensor, weights: ExpertWeights, e: int) -> torch.Tensor:
        c = self.config
        dtype = weights.w13.dtype
        b13 = None if weights.w13_bias is None else weights.w13_bias[e].to(dtype)
        b2 = None if weights.w2_bias is None else weights.w2_bias[e].to(dtype)
        h = F.linear(x_SH.to(dtype), weights.w13[e], b13).float()
        a = apply_activation(h, c.activation, swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)
        return F.linear(a.to(dtype), weights.w2[e], b2).float()
