"""Routing: router logits [T, E] -> (topk_weights float32 [T, K], topk_ids int32 [T, K]).

    p = softmax(logits) | sigmoid(logits)               (computed in float32)
    c = p + e_score_correction_bias                      (selection only; weights stay unbiased)
    grouped: keep the topk_group best of num_expert_group contiguous groups (group score = sum
             of the top-2 c with a bias, max p without), the rest masked to -inf
    ids = topk(c, K); w = p[ids]; w /= sum(w) if renormalize; w *= routed_scaling_factor

Covers Mixtral/Qwen (softmax top-k, optional renormalize), DeepSeek-V2 (softmax, group max),
DeepSeek-V3/Kimi-K2/GLM-4.5 (sigmoid, biased grouped top-k, scaling), MiniMax-M2 (sigmoid + bias,
no groups), Llama-4 (sigmoid top-1 without renormalize) and any custom function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedmoe import knobs
from fusedmoe.modular import tracing
from fusedmoe.validation import is_finite_real, is_integer, should_validate

CustomRouting = Callable[[torch.Tensor, torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


def select_experts(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    custom_routing_function: CustomRouting | None = None,
    validate: bool | None = None,
    group_score: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token; returns (weights float32 [T, K], ids int32 [T, K]).

    Grouped top-k (use_grouped_topk) keeps the topk_group best of num_expert_group contiguous
    expert groups; group_score says how a group is ranked: "max" (its best selection score,
    DeepSeek-V2's group_limited_greedy) or "top2_sum" (the sum of its two best, DeepSeek-V3's
    noaux_tc, Mistral-4's); None: "top2_sum" with an e_score_correction_bias, else "max".

    `validate` (default: on for CPU tensors, FUSEDMOE_VALIDATE for GPU tensors) adds the checks
    that need a device-to-host sync: NaN/Inf logits.
    """
    num_experts = _check_routing_inputs(hidden_states, router_logits, top_k, scoring_func)
    if e_score_correction_bias is not None:
        if not isinstance(e_score_correction_bias, torch.Tensor):
            raise TypeError(f"e_score_correction_bias must be a tensor, got {type(e_score_correction_bias).__name__}")
        if e_score_correction_bias.shape != (num_experts,):
            raise ValueError(
                f"e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}, "
                f"expected ({num_experts},)"
            )
    if not is_finite_real(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor={routed_scaling_factor!r} must be a finite number")
    check_grouping(num_experts, top_k, use_grouped_topk, num_expert_group, topk_group, group_score,
                   custom=custom_routing_function is not None)
    checking = should_validate(validate, router_logits)
    if checking and not bool(torch.isfinite(router_logits).all()):
        bad = (~torch.isfinite(router_logits)).nonzero()[0].tolist()
        raise ValueError(
            f"router_logits contain NaN/Inf (first at token {bad[0]}, expert {bad[1]}); "
            "routing on them is undefined"
        )
    if checking and e_score_correction_bias is not None and not bool(torch.isfinite(e_score_correction_bias).all()):
        bad = int((~torch.isfinite(e_score_correction_bias)).nonzero()[0])
        raise ValueError(
            f"e_score_correction_bias contains NaN/Inf (first at expert {bad}: "
            f"{float(e_score_correction_bias[bad])}); selection on it is undefined"
        )
    if custom_routing_function is not None:
        out = custom_routing_function(hidden_states, router_logits, top_k, renormalize)
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise TypeError(f"custom_routing_function must return (weights, ids), got {type(out).__name__}"
                            + (f" of length {len(out)}" if isinstance(out, tuple | list) else ""))
        weights, ids = _check_custom_output(*out, router_logits.shape[0], top_k, num_experts, checking)
        if routed_scaling_factor != 1.0:
            weights = weights * routed_scaling_factor
        return weights, ids

    if _triton_routing(router_logits, num_experts, top_k, use_grouped_topk, num_expert_group, topk_group):
        from fusedmoe.backends.triton.routing import triton_select_experts

        return triton_select_experts(
            router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func,
            use_grouped_topk=use_grouped_topk, num_expert_group=num_expert_group, topk_group=topk_group,
            e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
            group_score=group_score,
        )

    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else torch.sigmoid(logits)
    select_on = scores
    if e_score_correction_bias is not None:
        select_on = scores + e_score_correction_bias.to(device=scores.device, dtype=torch.float32)

    if use_grouped_topk:
        top2_sum = resolve_group_score(group_score, e_score_correction_bias is not None) == "top2_sum"
        select_on = _mask_groups(select_on, num_expert_group, topk_group, top_k, top2_sum=top2_sum)

    ids = torch.topk(select_on, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def _triton_routing(router_logits: torch.Tensor, num_experts: int, top_k: int, use_grouped_topk: bool,
                    num_expert_group: int | None, topk_group: int | None) -> bool:
    """One Triton launch instead of the torch ops (the arguments were checked: `check_grouping`)."""
    if tracing():  # first: a trace (compile, export) and fake tensors take the torch ops
        return False
    return routing_path(router_logits.device.type, num_experts, top_k, use_grouped_topk, num_expert_group,
                        topk_group) is None


def routing_path(device_type: str, num_experts: int, top_k: int, use_grouped_topk: bool = False,
                 num_expert_group: int | None = None, topk_group: int | None = None) -> str | None:
    """Why select_experts runs the torch ops for this routing on this device (None: one Triton
    launch, `moe_routing_kernel`): not CUDA, FUSEDMOE_TRITON_ROUTING=0, or a configuration the
    kernel does not take. Traces (torch.compile, export), dispatch modes (fake tensors) and
    custom routing functions always take the torch ops."""
    if device_type != "cuda":
        return f"{device_type} tensors"
    if knobs.get("TRITON_ROUTING") is False:
        return "FUSEDMOE_TRITON_ROUTING=0"
    return routing_kernel_unsupported(num_experts, top_k, use_grouped_topk, num_expert_group, topk_group)


# moe_routing_kernel's limits: the rule is here, without triton, for select_experts and explain.
ROUTING_KERNEL_MAX_EXPERTS = 1024  # one token's scores live in one program's registers
ROUTING_KERNEL_MAX_TOP_K = 32  # the top-k picks are a loop of argmax reductions over E


def routing_kernel_unsupported(num_experts: int, top_k: int, use_grouped_topk: bool, num_expert_group: int | None,
                        topk_group: int | None) -> str | None:
    """Why `moe_routing_kernel` (fusedmoe.backends.triton.routing) cannot run this configuration
    (None: it can)."""
    if num_experts > ROUTING_KERNEL_MAX_EXPERTS:
        return f"E={num_experts} > {ROUTING_KERNEL_MAX_EXPERTS} (one token's scores in one program)"
    if top_k > ROUTING_KERNEL_MAX_TOP_K:
        return f"top_k={top_k} > {ROUTING_KERNEL_MAX_TOP_K}"
    if use_grouped_topk and num_expert_group > 1:  # one group keeps every expert: plain top-k
        if num_experts & (num_experts - 1) or num_expert_group & (num_expert_group - 1):
            return (f"grouped top-k over E={num_experts} in {num_expert_group} groups: the kernel needs "
                    "powers of two for both")
        if topk_group > 16:
            return f"topk_group={topk_group} > 16"
    return None


GROUP_SCORES = ("max", "top2_sum")  # how grouped top-k ranks a group (select_experts' group_score)


def resolve_group_score(group_score: str | None, has_bias: bool) -> str:
    """The group ranking select_experts applies: group_score, else by the correction bias'
    presence ("top2_sum" with one, as DeepSeek-V3; "max" without, as DeepSeek-V2)."""
    if group_score is not None:
        return group_score
    return "top2_sum" if has_bias else "max"


def check_grouping(num_experts: int, top_k: int, use_grouped_topk: bool, num_expert_group: int | None,
                   topk_group: int | None, group_score: str | None = None, *, custom: bool = False) -> None:
    """The grouped top-k arguments' errors (select_experts, and FusedMoE at construction). custom:
    a custom routing function routes instead (the grouping arguments unused: only group_score,
    which nothing would apply, is refused)."""
    if custom:
        if group_score is not None:
            raise ValueError("group_score ranks expert groups of the grouped top-k; a custom_routing_function "
                             "routes on its own")
        return
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if value is not None and not is_integer(value):
            raise TypeError(f"{name}={value!r} must be an int")
    if group_score is not None and group_score not in GROUP_SCORES:
        raise ValueError(f"group_score={group_score!r}; expected one of {GROUP_SCORES} or None")
    if not use_grouped_topk:
        if num_expert_group is not None or topk_group is not None:
            raise ValueError("num_expert_group/topk_group are only used with use_grouped_topk=True")
        if group_score is not None:
            raise ValueError(f"group_score={group_score!r} ranks expert groups: it is only used with "
                             "use_grouped_topk=True")
        return
    if num_expert_group is None or topk_group is None:
        raise ValueError("use_grouped_topk=True needs num_expert_group and topk_group")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_expert_group={num_expert_group}"
        )
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
    per_group = num_experts // num_expert_group
    if top_k > topk_group * per_group:
        raise ValueError(
            f"top_k={top_k} exceeds the experts left after group selection "
            f"(topk_group={topk_group} x {per_group} experts per group = {topk_group * per_group})"
        )


def _mask_groups(
    select_on: torch.Tensor, num_expert_group: int | None, topk_group: int | None, top_k: int, *, top2_sum: bool
) -> torch.Tensor:
    """Keep the topk_group best expert groups per token; others -> -inf (scores may be < 0)."""
    tokens, num_experts = select_on.shape  # arguments checked by select_experts (check_grouping)
    per_group = num_experts // num_expert_group
    grouped = select_on.view(tokens, num_expert_group, per_group)
    if top2_sum:  # DeepSeek-V3 noaux_tc, Mistral-4: a group scores the sum of its two best
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
    else:  # DeepSeek-V2 group_limited_greedy: the group's best score
        group_scores = grouped.amax(dim=-1)
    keep = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, num_expert_group, per_group)
    return select_on.masked_fill(~expert_mask.reshape(tokens, num_experts), float("-inf"))


def _check_routing_inputs(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, top_k: int, scoring_func: str
) -> int:
    for name, t in (("hidden_states", hidden_states), ("router_logits", router_logits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be 2-D [tokens, experts], got shape {tuple(router_logits.shape)}")
    if not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be floating point, got {router_logits.dtype}")
    tokens, num_experts = router_logits.shape
    if hidden_states.dim() != 2 or hidden_states.shape[0] != tokens:
        raise ValueError(
            f"hidden_states shape {tuple(hidden_states.shape)} does not match router_logits "
            f"shape {tuple(router_logits.shape)} (expected [{tokens}, hidden])"
        )
    if hidden_states.device != router_logits.device:
        raise ValueError(
            f"hidden_states on {hidden_states.device} but router_logits on {router_logits.device}"
        )
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be a positive int")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds the number of experts ({num_experts})")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func={scoring_func!r}; expected 'softmax' or 'sigmoid'")
    return num_experts


def _check_custom_output(weights, ids, tokens: int, top_k: int, num_experts: int, checking: bool):
    if not isinstance(weights, torch.Tensor) or not isinstance(ids, torch.Tensor):
        raise TypeError("custom_routing_function must return (weights, ids) tensors")
    if tuple(weights.shape) != (tokens, top_k) or tuple(ids.shape) != (tokens, top_k):
        raise ValueError(
            f"custom_routing_function returned weights {tuple(weights.shape)} and ids "
            f"{tuple(ids.shape)}, expected ({tokens}, {top_k}) each"
        )
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"custom_routing_function returned ids of dtype {ids.dtype}, expected integers")
    if checking and ids.numel():
        bad = (ids < 0) | (ids >= num_experts)
        if bool(bad.any()):
            t, k = bad.nonzero()[0].tolist()
            raise ValueError(
                f"custom_routing_function returned id {int(ids[t, k])} at token {t}, slot {k}: "
                f"outside [0, {num_experts})"
            )
    if ids.dtype != torch.int32:  # out of range -> -1 (a slot that contributes zero), never wrapped into range
        ids = torch.where((ids >= 0) & (ids < num_experts), ids, -1).to(torch.int32)
    return weights.float(), ids
