"""`torch` / `batched_torch` backends: the reference math (`fusedmoe.reference`) as experts
implementations, on token rows (standard layout) or per-expert buffers (batched layout)."""

from __future__ import annotations

import torch

from fusedmoe.config import MoEConfig
from fusedmoe.modular import BatchedExperts, Experts, ExpertWeights, traced_experts, tracing
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
        if tracing():  # its per-expert loop has data-dependent sizes
            return traced_experts("torch", self.config, x_TH, weights, topk_weights_TK, topk_ids_TK,
                                  expert_map_E, out_TH)
        y = reference_for(self.config, x_TH, weights.w13, weights.w2, weights, topk_weights_TK,
                          topk_ids_TK, expert_map_E)
        if out_TH is not None:
            return out_TH.copy_(y)
        return y


def batched_reference(
    x: torch.Tensor,
    num_tokens: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    apply_router_weight_on_input: bool,
    swiglu_alpha: float,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """y[e, j] = expert_e(x[e, j]) for j < num_tokens[e], zero past it: the reference per expert."""
    num_local, max_tokens, _ = x.shape
    out = torch.zeros_like(x)
    for e, count in enumerate(num_tokens.tolist()[:num_local]):
        rows = min(int(count), max_tokens)
        if rows == 0:
            continue
        ones = torch.ones(rows, 1, dtype=torch.float32, device=x.device)
        ids = torch.zeros(rows, 1, dtype=torch.int32, device=x.device)
        out[e, :rows] = fused_experts_ref(
            x[e, :rows], w13[e : e + 1], w2[e : e + 1], ones, ids, activation=activation,
            apply_router_weight_on_input=apply_router_weight_on_input,
            w13_bias_LG=None if w13_bias is None else w13_bias[e : e + 1],
            w2_bias_LH=None if w2_bias is None else w2_bias[e : e + 1],
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        )
    return out


# fusedmoe::batched_reference: what a torch.compile trace records (the loop's sizes are data).
batched_reference_op = torch.library.custom_op("fusedmoe::batched_reference", batched_reference, mutates_args=())
batched_reference_op.register_fake(lambda x, *args, **kwargs: torch.empty_like(x))


class BatchedTorchExperts(BatchedExperts):
    """y[e, j] = expert_e(x[e, j]) for j < num_tokens[e], zero past it (no routed weight)."""

    def apply_batched(self, x_LMH, num_tokens_L, weights: ExpertWeights, *, num_slots: int = 0,
                      top_k: int = 1) -> torch.Tensor:
        del num_slots, top_k  # tile hints: nothing to pick here
        c = self.config
        args = (x_LMH, num_tokens_L, weights.w13, weights.w2, weights.w13_bias, weights.w2_bias, c.activation,
                c.apply_router_weight_on_input, c.swiglu_alpha, c.swiglu_limit)
        return batched_reference_op(*args) if tracing() else batched_reference(*args)
