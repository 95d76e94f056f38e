"""`torch` backend: the reference math (`fusedmoe.reference`) as an experts implementation."""

from __future__ import annotations

import torch

from fusedmoe.modular import Experts, ExpertWeights
from fusedmoe.reference import fused_experts_ref


class TorchExperts(Experts):
    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None) -> torch.Tensor:
        c = self.config
        y = fused_experts_ref(
            x_TH, weights.w13, weights.w2, topk_weights_TK, topk_ids_TK,
            activation=c.activation,
            apply_router_weight_on_input=c.apply_router_weight_on_input,
            expert_map_E=expert_map_E,
            global_num_experts=c.num_experts,
            w13_bias_LG=weights.w13_bias,
            w2_bias_LH=weights.w2_bias,
            swiglu_alpha=c.swiglu_alpha,
            swiglu_limit=c.swiglu_limit,
        )
        if out_TH is not None:
            return out_TH.copy_(y)
        return y
