"""Functional entry points: `fused_experts` (given routing) and `fused_moe` (routing included).

    topk_weights, topk_ids = select_experts(x, router_logits, top_k, ...)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, ...)

Each call validates its inputs, describes the problem as a `MoEConfig`, asks the oracle for a
backend (cached per config and platform) and runs prepare -> experts -> finalize.
"""

from __future__ import annotations

import functools
import inspect

import torch

from fusedmoe.activations import SWIGLUOAI_ALPHA, is_gated
from fusedmoe.backends import generation
from fusedmoe.config import MoEConfig
from fusedmoe.modular import ExpertWeights, ModularMoE, experts_ops, make_modular, tracing
from fusedmoe.oracle import knob_state, select_backend
from fusedmoe.platform import Platform
from fusedmoe.quant.params import TENSOR_FIELDS, QuantParams
from fusedmoe.routing import select_experts
from fusedmoe.validation import check_experts_inputs, should_validate, unwritable


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    quant: QuantParams | None = None,
    backend: str = "auto",
    swiglu_alpha: float = SWIGLUOAI_ALPHA,
    swiglu_limit: float | None = None,
    inplace: bool = False,
    validate: bool | None = None,
    activation_format: str = "standard",
) -> torch.Tensor:
    """out [T, H] = sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(hidden_states[t]).

    expert(x) = w2[e] @ act(w13[e] @ x + w13_bias[e]) + w2_bias[e]; w13 is [E, 2I, H] (rows
    [0, I) gate, [I, 2I) up) for gated activations, [E, I, H] for `*_no_mul`; w2 is [E, H, I].
    With expert_map (global id -> local index, -1 = not on this rank) w13/w2 hold the local
    experts and unmapped slots contribute zero. `inplace=True` writes into hidden_states when
    the backend allows it. activation_format="batched" dispatches the slots into per-expert
    buffers [L, max_tokens, H] first (the layout of expert-parallel all-to-all) and runs a
    batched backend on them.
    """
    if quant is not None and not isinstance(quant, QuantParams):
        raise TypeError(f"quant must be a fusedmoe.QuantParams or None, got {type(quant).__name__}")
    traced = tracing()  # torch.compile / export / fake tensors: the checks below, then one custom op
    for name, flag in (("inplace", inplace), ("apply_router_weight_on_input", apply_router_weight_on_input)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} must be a bool")
    shape = check_experts_inputs(
        hidden_states, w13, w2, topk_weights, topk_ids,
        activation=activation, expert_map=expert_map, global_num_experts=global_num_experts,
        w13_bias=w13_bias, w2_bias=w2_bias,
        apply_router_weight_on_input=apply_router_weight_on_input,
        quantized=quant is not None, validate=False if traced else validate,
    )
    if quant is not None:
        from fusedmoe.quant.weights import check_quant_weights

        check_quant_weights(w13, w2, quant, shape.hidden_size, w13.shape[1], gated=is_gated(activation))
    if inplace and (why := unwritable(hidden_states)) is not None:
        raise ValueError(f"inplace=True cannot write into hidden_states: {why}")
    if traced:  # the body runs the value checks when the graph runs
        args = (hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map,
                global_num_experts, activation, apply_router_weight_on_input,
                *_flat_quant(quant), backend, swiglu_alpha, swiglu_limit, validate, activation_format)
        if inplace:
            fused_experts_out_op(*args, out=hidden_states)
            return hidden_states
        return fused_experts_op(*args)
    if quant is not None and should_validate(validate, hidden_states):
        for name in ("a13_scale", "a2_scale"):
            scale = getattr(quant, name)
            ok = None if scale is None else torch.isfinite(scale) & (scale > 0)
            if ok is not None and not bool(ok.all()):
                bad = scale[~ok][0]
                raise ValueError(f"quant.{name} holds {float(bad)}: static activation scales must be finite "
                                 "and > 0 (a zero one quantizes every activation to 0 or NaN)")
    dtype = hidden_states.dtype
    config = _config(
        shape.num_global_experts,
        shape.top_k,
        shape.hidden_size,
        shape.intermediate_size,
        # float64 is accepted for the torch reference; the oracle sees it as float32 math.
        dtype=torch.float32 if dtype == torch.float64 else dtype,
        activation=activation,
        has_bias=w13_bias is not None or w2_bias is not None,
        quant=None if quant is None else quant.scheme,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
        backend=backend,
        apply_router_weight_on_input=apply_router_weight_on_input,
        has_expert_map=expert_map is not None,
        activation_format=activation_format,
    )
    if dtype == torch.float64 and config.backend not in ("torch", "reference", "ref"):
        raise ValueError("float64 hidden_states are only supported with backend='torch'")
    kernel = _kernel(config, Platform.for_device(hidden_states.device), knob_state(), generation())
    if shape.num_tokens == 0:
        return hidden_states if inplace else hidden_states.new_empty(0, shape.hidden_size)
    weights = ExpertWeights(w13, w2, w13_bias, w2_bias, quant)
    return kernel(hidden_states, weights, topk_weights, topk_ids, expert_map_E=expert_map, inplace=inplace)


_QUANT_TENSORS = TENSOR_FIELDS


def _flat_quant(quant: QuantParams | None) -> tuple:
    """QuantParams as the custom op's arguments: the scheme's name, then its tensors."""
    if quant is None:
        return (None,) + (None,) * len(_QUANT_TENSORS)
    return (quant.scheme.name, *(getattr(quant, name) for name in _QUANT_TENSORS))


def _fused_experts_op_impl(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    global_num_experts: int | None,
    activation: str,
    apply_router_weight_on_input: bool,
    quant_scheme: str | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    w13_global_scale: torch.Tensor | None,
    w2_global_scale: torch.Tensor | None,
    w13_zero: torch.Tensor | None,
    w2_zero: torch.Tensor | None,
    backend: str,
    swiglu_alpha: float,
    swiglu_limit: float | None,
    validate: bool | None,
    activation_format: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    quant = None
    if quant_scheme is not None:
        quant = QuantParams(quant_scheme, w13_scale, w2_scale, a13_scale, a2_scale, w13_global_scale,
                            w2_global_scale, w13_zero, w2_zero)
    # the _out op writes `out`: it holds hidden_states (functionalized: a copy of them), or is them
    x = hidden_states if out is None or out is hidden_states else out.copy_(hidden_states)
    return fused_experts(
        x, w13, w2, topk_weights, topk_ids, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map,
        global_num_experts=global_num_experts, w13_bias=w13_bias, w2_bias=w2_bias, quant=quant,
        backend=backend, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, inplace=out is not None,
        validate=validate, activation_format=activation_format,
    )


# Custom ops fusedmoe::fused_experts(_out): what a torch.compile(fullgraph=True) / export trace
# records for a `fused_experts` call (the oracle and the config are Python a trace cannot hold).
fused_experts_op, fused_experts_out_op = experts_ops("fused_experts", _fused_experts_op_impl)


_cached_config = functools.lru_cache(maxsize=256)(MoEConfig)


def _config(*args, **kwargs) -> MoEConfig:
    """MoEConfig (frozen, validated in __post_init__: ~8 us) once per distinct set of arguments; a
    config that fails validation raises every time (lru_cache keeps no exceptions), and an
    unhashable argument gets MoEConfig's own error."""
    try:
        return _cached_config(*args, **kwargs)
    except TypeError:
        return MoEConfig(*args, **kwargs)


@functools.lru_cache(maxsize=256)
def _kernel(config: MoEConfig, platform: Platform, knobs_now: tuple, registry_gen: int) -> ModularMoE:
    del knobs_now, registry_gen  # cache key only: a changed knob or registry selects again
    selection = select_backend(config, platform)
    return make_modular(config, selection.experts(config))


_ROUTING_KEYS = frozenset(inspect.signature(select_experts).parameters) - {
    "hidden_states", "router_logits", "top_k",
}


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    **kwargs,
) -> torch.Tensor:
    """select_experts(hidden_states, router_logits, top_k, ...) then fused_experts(...).

    Routing keywords (renormalize, scoring_func, use_grouped_topk, num_expert_group, topk_group, group_score,
    e_score_correction_bias, routed_scaling_factor, custom_routing_function) go to
    `select_experts`; the rest to `fused_experts`. `validate` goes to both.
    """
    routing = {k: kwargs.pop(k) for k in list(kwargs) if k in _ROUTING_KEYS}
    if "validate" in routing:
        kwargs["validate"] = routing["validate"]
    unknown = set(kwargs) - set(inspect.signature(fused_experts).parameters)
    if unknown:
        raise TypeError(f"fused_moe got unexpected keyword arguments {sorted(unknown)}")
    num_experts = kwargs.get("global_num_experts")
    if num_experts is None:
        expert_map = kwargs.get("expert_map")
        num_experts = expert_map.numel() if isinstance(expert_map, torch.Tensor) else (
            w13.shape[0] if isinstance(w13, torch.Tensor) and w13.dim() == 3 else None)
    if isinstance(router_logits, torch.Tensor) and router_logits.dim() == 2 and num_experts is not None \
            and router_logits.shape[1] != num_experts:
        raise ValueError(
            f"router_logits {tuple(router_logits.shape)} score {router_logits.shape[1]} experts but the "
            f"layer has {num_experts} (w13's experts, or expert_map's / global_num_experts' count)"
        )
    topk_weights, topk_ids = select_experts(hidden_states, router_logits, top_k, **routing)
    return fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, **kwargs)
