"""`torch` backend: the reference math (`fusedmoe.reference`) as an experts implementation."""

from __future__ import annotations

import torch

from fusedmoe.config import MoEConfig
from fusedmoe.modular import Experts, ExpertWeights
from fusedmoe.reference import Transform, fused_experts_ref


def reference_for(
    config: MoEConfig, x_TH, w13, w2, weights: ExpertWeights, topk_weights_TK, topk_ids_TK,
    expert_map_E, *, input_transform: Transform | None = None,
    intermediate_transform: Transform | None = None,
) -> torch.Tensor:
    """`fused_experts_ref` with the numerics the config asks for (w13/w2 may be dequantized)."""
    return fused_experts_ref(
        x_TH, w13, w2, topk_weights_TK, topk_ids_TK,
        activation=config.activation,
        apply_router_weight_on_input=config.apply_router_weight_on_input,
        expert_map_E=expert_map_E,
        global_num_experts=config.num_experts,
        w13_bias_LG=weights.w13_bias,
        w2_bias_LH=weights.w2_bias,
        swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        input_transform=input_transform,
        intermediate_transform=intermediate_transform,
    )


class TorchExperts(Experts):
    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None) -> torch.Tensor:
        y = reference_for(self.config, x_TH, weights.w13, weights.w2, weights, topk_weights_TK,
                          topk_ids_TK, expert_map_E)
        if out_TH is not None:
            return out_TH.copy_(y)
        return y
