"""`cpu` backend: slots sorted by expert, one matmul per expert segment, fp32 reduction.

    order = stable_sort(local_expert_of_slot)      # invalid slots sort last, past every expert
    for each expert e with a non-empty segment s:  y[s] = w2[e] @ act(w13[e] @ x[s])
    out = index_add(token_of_slot, w * y)          # fp32, then cast to x's dtype
GEMMs run in the weights' dtype (oneDNN accumulates bf16/fp16 in fp32); the activation and the
top-k reduction run in fp32. No Python loop over tokens. Registered as the custom ops
`fusedmoe::cpu_experts(_out)` with fake kernels, so a CPU layer compiles with fullgraph=True.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedmoe.activations import apply_activation
from fusedmoe.modular import Experts, ExpertWeights, experts_ops, sort_slots, tracing


def cpu_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    num_global_experts: int,
    activation: str,
    apply_router_weight_on_input: bool,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts computation above for tensors on any device (the segment bounds go to the host)."""
    num_tokens, hidden = x.shape
    num_local = w13.shape[0]
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens:
        slots = sort_slots(topk_ids, expert_map, num_global_experts, num_local)
        order_N, token_N = slots.order_N, slots.token_N
        counts = slots.counts.tolist()  # host-side segment bounds: fine on the CPU
        w_N = topk_weights.flatten()[order_N].float().unsqueeze(-1)
        x_NH = x[token_N]
        if apply_router_weight_on_input:
            x_NH = (x_NH.float() * w_N).to(x.dtype)
        y_NH = torch.empty(len(order_N), hidden, dtype=torch.float32, device=x.device)
        start = 0
        for e in range(num_local):
            end = start + counts[e]
            if end > start:
                y_NH[start:end] = _expert(x_NH[start:end], w13[e], w2[e],
                                          None if w13_bias is None else w13_bias[e],
                                          None if w2_bias is None else w2_bias[e],
                                          activation, swiglu_alpha, swiglu_limit)
            start = end
        valid_rows = start  # rows past the last expert are invalid slots: they add nothing
        if not apply_router_weight_on_input:
            y_NH[:valid_rows] *= w_N[:valid_rows]
        acc.index_add_(0, token_N[:valid_rows], y_NH[:valid_rows])
    result = acc.to(x.dtype)
    if out is not None:
        return out.copy_(result)
    return result


def _expert(x_SH, w13, w2, b13, b2, activation: str, swiglu_alpha: float, swiglu_limit: float | None):
    dtype = w13.dtype
    h = F.linear(x_SH.to(dtype), w13, None if b13 is None else b13.to(dtype)).float()
    a = apply_activation(h, activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    return F.linear(a.to(dtype), w2, None if b2 is None else b2.to(dtype)).float()


# Custom ops: torch.compile(fullgraph=True) sees one opaque call (the segment loop's data-dependent
# sizes would break the graph); eager calls run cpu_experts itself, which autograd can follow.
cpu_experts_op, cpu_experts_out_op = experts_ops("cpu_experts", cpu_experts)


class CpuExperts(Experts):
    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None) -> torch.Tensor:
        c = self.config
        args = (x_TH, weights.w13, weights.w2, topk_weights_TK, topk_ids_TK, weights.w13_bias, weights.w2_bias,
                expert_map_E, c.num_experts, c.activation, c.apply_router_weight_on_input, c.swiglu_alpha,
                c.swiglu_limit)
        if not tracing():  # eager: the body itself (differentiable, unlike the ops)
            return cpu_experts(*args, out=out_TH)
        if out_TH is not None:
            cpu_experts_out_op(*args, out=out_TH)
            return out_TH
        return cpu_experts_op(*args)
