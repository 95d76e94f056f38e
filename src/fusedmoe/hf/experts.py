"""transformers experts modules -> `fused_experts`: the math of one experts module, and the call.

    experts_forward(self, x_TH, top_k_index_TK, top_k_weights_TK)      # registered as "fusedmoe"
        = fused_experts(x, self.gate_up_proj | self.up_proj, self.down_proj, weights, ids, ...)

Reads a `@use_experts_implementation` module (or transformers' `FP8Experts`) in its own layout:
`gate_up_proj [E, 2I, H]` (gate rows first) or `up_proj [E, I, H]`, `down_proj [E, H, I]`, biases
`[E, 2I]` / `[E, H]` — exactly fusedmoe's weight contract, so nothing is copied. Transposed or
interleaved experts (gpt-oss) need the one-time re-layout of `fusedmoe.hf.patch`.
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe.activations import SWIGLUOAI_ALPHA
from fusedmoe.api import fused_experts
from fusedmoe.modular import call_op
from fusedmoe.quant.params import QuantParams


class UnsupportedModel(NotImplementedError):
    """A transformers module whose MoE math fusedmoe cannot express; the message names the feature."""


# transformers activation class -> (gated name, non-gated name); None = not expressible.
_ACTIVATIONS: dict[str, tuple[str | None, str | None]] = {
    "SiLUActivation": ("silu", "silu_no_mul"),
    "SiLU": ("silu", "silu_no_mul"),
    "GELUActivation": ("gelu", "gelu_no_mul"),  # exact erf form, also with use_gelu_python
    "GELUTanh": ("gelu_tanh", None),
    "NewGELUActivation": ("gelu_tanh", None),  # the same tanh formula written out
    "ReLUSquaredActivation": (None, "relu2_no_mul"),
}


@dataclass(frozen=True)
class ExpertsMath:
    """The activation of one experts module, in fusedmoe's names."""

    activation: str
    swiglu_alpha: float = SWIGLUOAI_ALPHA
    swiglu_limit: float | None = None


# torch functions used as act_fn directly (LFM2-MoE: F.silu); F.gelu's default is the exact erf form
_FUNCTIONS: dict[object, tuple[str | None, str | None]] = {
    torch.nn.functional.silu: ("silu", "silu_no_mul"),
    torch.nn.functional.gelu: ("gelu", "gelu_no_mul"),
}


def activation_of(act_fn: object, *, gated: bool, where: str) -> str:
    """fusedmoe's activation name for a transformers activation module or torch function (gated or not)."""
    names = _FUNCTIONS.get(act_fn) if callable(act_fn) and not isinstance(act_fn, torch.nn.Module) else None
    if names is None:
        names = _ACTIVATIONS.get(type(act_fn).__name__)
    name = None if names is None else names[0 if gated else 1]
    if name is None:
        kind = "gated" if gated else "non-gated"
        what = None
        if not isinstance(act_fn, torch.nn.Module) and hasattr(act_fn, "__name__"):  # a function: module.name
            what = ".".join(filter(None, (getattr(act_fn, "__module__", None), act_fn.__name__)))
        raise UnsupportedModel(
            f"{where}: activation {what or type(act_fn).__name__} as a {kind} expert activation is not one "
            f"of fusedmoe's (supported: {_supported_activations()})"
        )
    return name


def _supported_activations() -> str:
    gated = sorted({g for g, _ in _ACTIVATIONS.values() if g})
    plain = sorted({n for _, n in _ACTIVATIONS.values() if n})
    return f"gated {gated}, non-gated {plain}"


def experts_math(experts: torch.nn.Module) -> ExpertsMath:
    """The activation of a decorated experts module or `FP8Experts`, refusing what we cannot run."""
    where = type(experts).__name__
    has_gate = getattr(experts, "has_gate", True)
    if getattr(experts, "has_post_expert_norm", False):
        raise UnsupportedModel(f"{where}: a norm after each expert (has_post_expert_norm) is not supported")
    if getattr(experts, "gate_softcap", None) is not None or getattr(experts, "up_softcap", None) is not None:
        raise UnsupportedModel(f"{where}: softcapped SwiGLU (mlp_gate_softcap) is not supported")
    if type(experts).__name__ == "FP8Experts":
        # FP8Experts._apply_gate: swigluoai when the config has swiglu_alpha, else a clamped act.
        if has_gate and getattr(experts, "swiglu_alpha", None) is not None:
            return ExpertsMath("swigluoai", float(experts.swiglu_alpha), _limit(experts.swiglu_limit))
        act = activation_of(experts.act_fn, gated=has_gate, where=where)
        return ExpertsMath(act, swiglu_limit=_limit(getattr(experts, "limit", None)) if has_gate else None)
    if has_gate and not _default_gate(experts):
        custom = _CUSTOM_GATES.get(type(experts).__name__)
        if custom is None:
            raise UnsupportedModel(
                f"{where}: a custom gate function ({where}._apply_gate) is not one fusedmoe knows"
            )
        return custom(experts)
    return ExpertsMath(activation_of(experts.act_fn, gated=has_gate, where=where))


def _limit(value) -> float | None:
    return None if value is None else float(value)


def _default_gate(experts: torch.nn.Module) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    return getattr(type(experts), "_apply_gate", _default_apply_gate) is _default_apply_gate


def _clamped_silu(experts: torch.nn.Module) -> ExpertsMath:
    """gate.clamp(max=L), up.clamp(-L, L), silu(gate) * up with L = swiglu_limit."""
    return ExpertsMath("silu", swiglu_limit=_limit(experts.swiglu_limit))


# Experts classes whose `_apply_gate` is a clamped form of an activation we have (concatenated).
_CUSTOM_GATES = {
    # gate.clamp(max=limit), up.clamp(-limit, limit), act(gate) * up
    "DeepseekV4Experts": lambda m: ExpertsMath(
        activation_of(m.act_fn, gated=True, where="DeepseekV4Experts"), swiglu_limit=_limit(m.limit)
    ),
    "Glm5NextTextExperts": _clamped_silu,
    "HYV4Experts": _clamped_silu,
    "HYV4VLExperts": _clamped_silu,
    # act(gate) * up in float32, rounded to the input's dtype: fusedmoe's activation reads the
    # float32 accumulator anyway
    "BeamExperts": lambda m: ExpertsMath(activation_of(m.act_fn, gated=True, where="BeamExperts")),
    # gpt-oss's swigluoai on concatenated halves
    "MiniMaxM3VLExperts": lambda m: ExpertsMath(
        "swigluoai", float(m.swiglu_alpha), _limit(m.swiglu_limit)
    ),
}


def quant_params(experts: torch.nn.Module) -> QuantParams | None:
    """QuantParams for transformers' fine-grained FP8 experts (weights `float8_e4m3fn`), else None.

    `gate_up_proj_scale_inv [E, 2I/128, H/128]` and `down_proj_scale_inv [E, H/128, I/128]` are
    DeepSeek's block scales (multipliers): fusedmoe's `fp8_w8a8_block` with dynamic 1x128
    activation groups, which is what transformers' FP8 path computes.
    """
    weight = experts.gate_up_proj if getattr(experts, "has_gate", True) else experts.up_proj
    if weight.element_size() != 1:
        return None
    where = type(experts).__name__
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedModel(f"{where}: {weight.dtype} expert weights (FP4-packed experts) are not supported")
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedModel(
            f"{where}: FP8 experts with activation_scheme={scheme!r} are not supported (block FP8 "
            "quantizes activations dynamically)"
        )
    block = tuple(getattr(experts, "block_size", None) or ())
    if block != (128, 128):
        raise UnsupportedModel(
            f"{where}: FP8 experts with weight_block_size={list(block) or None} are not supported "
            "(fusedmoe runs 128x128 block scales)"
        )
    up_scale = experts.gate_up_proj_scale_inv if getattr(experts, "has_gate", True) else experts.up_proj_scale_inv
    return QuantParams("fp8_w8a8_block", _float_scale(up_scale), _float_scale(experts.down_proj_scale_inv))


def _float_scale(scale: torch.Tensor) -> torch.Tensor:
    # ue8m0 checkpoints store powers of two in float8_e8m0fnu; the kernels read float32.
    return scale if scale.dtype == torch.float32 else scale.float()


def run_experts(
    experts: torch.nn.Module,
    x_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    math: ExpertsMath,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    quant: QuantParams | None = None,
    apply_router_weight_on_input: bool = False,
    placeholders: bool = False,
) -> torch.Tensor:
    """fused_experts on HF routing outputs; returns [T, H] in x's dtype.

    Under transformers' expert parallelism ids >= E are placeholders with weight 0: they map to
    expert E, which `expert_map` marks as not on this rank, so they add exactly zero. `placeholders`
    skips ids >= E the same way whatever their weight (LongCat-Flash's identity experts, which the
    caller adds).
    """
    num_experts = w13.shape[0]
    expert_map = global_num_experts = None
    ids = top_k_index_TK
    if placeholders or getattr(experts, "_is_expert_parallel", False):
        ids = ids.clamp(max=num_experts)
        expert_map = torch.arange(num_experts + 1, dtype=torch.int32, device=ids.device)
        expert_map[num_experts] = -1
        global_num_experts = num_experts + 1
    x = x_TH if quant is not None or x_TH.dtype == w13.dtype else x_TH.to(w13.dtype)
    out = call_op(
        torch.ops.fusedmoe.hf_experts, _hf_experts_impl, x, w13, w2, top_k_weights_TK, ids, w13_bias, w2_bias, expert_map,
        None if quant is None else quant.w13_scale, None if quant is None else quant.w2_scale,
        "" if quant is None else quant.scheme.name, math.activation, math.swiglu_alpha,
        math.swiglu_limit, apply_router_weight_on_input,
        -1 if global_num_experts is None else global_num_experts,
    )
    return out.to(x_TH.dtype)


def _hf_experts_impl(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, w13_scale,
                w2_scale, quant, activation, swiglu_alpha, swiglu_limit, apply_router_weight_on_input,
                global_num_experts):
    return fused_experts(
        x, w13, w2, topk_weights, topk_ids,
        activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        w13_bias=w13_bias, w2_bias=w2_bias, expert_map=expert_map,
        global_num_experts=None if global_num_experts < 0 else global_num_experts,
        quant=QuantParams(quant, w13_scale, w2_scale) if quant else None,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )


# One opaque op around fused_experts: torch.compile (fullgraph too) sees a single node instead of
# tracing validation, the oracle and a CPU backend's host-side loop (43 s -> seconds to compile).
# Plain eager calls (generate under no_grad) run its body directly (`call_op`).
_hf_experts = torch.library.custom_op(
    "fusedmoe::hf_experts", _hf_experts_impl, mutates_args=(),
    schema="(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor? w13_bias, "
           "Tensor? w2_bias, Tensor? expert_map, Tensor? w13_scale, Tensor? w2_scale, str quant, "
           "str activation, float swiglu_alpha, float? swiglu_limit, bool apply_router_weight_on_input, "
           "int global_num_experts) -> Tensor",
)


@_hf_experts.register_fake
def _(x, w13, w2, topk_weights, topk_ids, *rest):
    return x.new_empty(x.shape)


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The "fusedmoe" entry of transformers' ExpertsInterface / FP8ExpertsInterface."""
    where = type(self).__name__
    if getattr(self, "is_transposed", False) or not getattr(self, "is_concatenated", True):
        raise UnsupportedModel(
            f"{where} stores its experts transposed or with gate/up interleaved; run "
            "fusedmoe.hf.patch(model), which re-lays them out once, instead of "
            "experts_implementation='fusedmoe'"
        )
    has_gate = getattr(self, "has_gate", True)
    has_bias = getattr(self, "has_bias", False)
    w13 = self.gate_up_proj if has_gate else self.up_proj
    b13 = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    return run_experts(
        self, hidden_states, top_k_index, top_k_weights, w13, self.down_proj, experts_math(self),
        w13_bias=b13, w2_bias=self.down_proj_bias if has_bias else None, quant=quant_params(self),
    )
