"""The reference: the MoE experts math in plain PyTorch, float32 (or float64) throughout.

For each token t and slot k with e = topk_ids[t, k], w = topk_weights[t, k]:
    h = w13[e] @ x_t + b13[e]          a = act(h)           y = w2[e] @ a + b2[e]
    out_t += w * y                     (router weight on input: x_t <- w * x_t, no w after)
Slots whose id is outside [0, E) or that expert_map sends to -1 contribute zero.
This is the truth every backend is tested against; it favours clarity over speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedmoe.activations import SWIGLUOAI_ALPHA, apply_activation, is_gated
from fusedmoe.modular import local_slots

# (tensor, local expert index) -> tensor: fake-quantization hooks used by the emulation backend.
Transform = Callable[[torch.Tensor, int], torch.Tensor]


def _check_shapes(x_TH, w13_LGH, w2_LHI, topk_weights_TK, topk_ids_TK, activation: str) -> None:
    """The reference's own input errors: shapes and kinds only. Dtypes may differ (it computes
    in float32 / float64), ids may be out of range (their slots contribute zero), and the weight
    may go on the input at any top_k (each slot's input times its weight; fused_experts asks
    top_k == 1, as the seeds do, but the kernels' tests use more)."""
    for name, t, rank in (("hidden_states", x_TH, 2), ("w13", w13_LGH, 3), ("w2", w2_LHI, 3),
                          ("topk_weights", topk_weights_TK, 2), ("topk_ids", topk_ids_TK, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"fused_experts_ref: {name} must be a {rank}-D tensor, got {got}")
    if topk_ids_TK.is_floating_point() or topk_ids_TK.dtype == torch.bool:
        raise ValueError(f"fused_experts_ref: topk_ids must be integers, got {topk_ids_TK.dtype}")
    num_tokens, hidden = x_TH.shape
    if tuple(topk_ids_TK.shape) != tuple(topk_weights_TK.shape) or topk_ids_TK.shape[0] != num_tokens:
        raise ValueError(f"fused_experts_ref: topk_ids {tuple(topk_ids_TK.shape)} and topk_weights "
                         f"{tuple(topk_weights_TK.shape)} must both be [{num_tokens}, top_k]")
    inter = w2_LHI.shape[2]
    rows = 2 * inter if is_gated(activation) else inter
    if w13_LGH.shape[2] != hidden or w2_LHI.shape[1] != hidden or w13_LGH.shape[1] != rows \
            or w13_LGH.shape[0] != w2_LHI.shape[0]:
        raise ValueError(f"fused_experts_ref: w13 {tuple(w13_LGH.shape)} and w2 {tuple(w2_LHI.shape)} do not fit "
                         f"hidden_states {tuple(x_TH.shape)} and activation {activation!r} "
                         f"(expected w13 [E, {rows}, {hidden}], w2 [E, {hidden}, {inter}])")


def fused_experts_ref(
    x_TH: torch.Tensor,
    w13_LGH: torch.Tensor,
    w2_LHI: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map_E: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    w13_bias_LG: torch.Tensor | None = None,
    w2_bias_LH: torch.Tensor | None = None,
    swiglu_alpha: float = SWIGLUOAI_ALPHA,
    swiglu_limit: float | None = None,
    input_transform: Transform | None = None,
    intermediate_transform: Transform | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out [T, H] = sum_k w[t,k] * (w2[e] @ act(w13[e] @ x_t + b13[e]) + b2[e]), e = ids[t,k].

    Computes in float64 when x is float64, else float32; returns `out_dtype` (default x's).
    """
    _check_shapes(x_TH, w13_LGH, w2_LHI, topk_weights_TK, topk_ids_TK, activation)
    compute = torch.float64 if x_TH.dtype == torch.float64 else torch.float32
    num_tokens, hidden = x_TH.shape
    num_global = global_num_experts
    if num_global is None:
        num_global = expert_map_E.numel() if expert_map_E is not None else w13_LGH.shape[0]
    local_TK, valid_TK = local_slots(topk_ids_TK, expert_map_E, num_global)
    out = torch.zeros(num_tokens, hidden, dtype=compute, device=x_TH.device)

    for e in range(w13_LGH.shape[0]):
        token, slot = torch.nonzero((local_TK == e) & valid_TK, as_tuple=True)
        if token.numel() == 0:
            continue
        x = x_TH[token].to(compute)
        w = topk_weights_TK[token, slot].to(compute).unsqueeze(-1)
        if apply_router_weight_on_input:
            x = x * w
        if input_transform is not None:
            x = input_transform(x, e)
        h = x @ w13_LGH[e].to(compute).T
        if w13_bias_LG is not None:
            h = h + w13_bias_LG[e].to(compute)
        a = apply_activation(h, activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        if intermediate_transform is not None:
            a = intermediate_transform(a, e)
        y = a @ w2_LHI[e].to(compute).T
        if w2_bias_LH is not None:
            y = y + w2_bias_LH[e].to(compute)
        if not apply_router_weight_on_input:
            y = y * w
        out.index_add_(0, token, y)
    return out.to(out_dtype or x_TH.dtype)
