"""Input checks for `fused_experts`, raised before any kernel runs.

Shape, dtype, device and stride checks are free and always run. Checks that read tensor values
(ids in range, expert_map entries) need a device-to-host sync on GPUs, so there they run only
with validation on (`validate=True` or FUSEDMOE_VALIDATE=1); CPU tensors are always checked.
Without validation, kernels still never read out of bounds: out-of-range slots contribute zero.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from fusedmoe import knobs
from fusedmoe.activations import check_activation, is_gated

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ExpertsShape:
    """Sizes read off validated inputs."""

    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_local_experts: int
    num_global_experts: int
    top_k: int


def should_validate(validate: bool | None, *tensors: torch.Tensor | None) -> bool:
    """Explicit argument, else always for CPU tensors, else FUSEDMOE_VALIDATE.

    Never inside torch.compile tracing unless asked for: value checks would break the graph.
    """
    if validate is not None:
        if not isinstance(validate, bool):
            raise TypeError(f"validate={validate!r} must be True, False or None")
        return validate
    if torch.compiler.is_compiling():
        return False
    if all(t is None or t.device.type == "cpu" for t in tensors):
        return True
    return bool(knobs.get("VALIDATE"))


def is_real(value) -> bool:
    """A real number (int, float, numpy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_real(value) -> bool:
    """A finite real number. While torch.compile traces, a float that dynamo made symbolic (a
    value that changed between compiles) cannot be tested without a graph break: it passes as
    real, its finiteness unchecked there (eager calls and construction check it)."""
    return is_real(value) and (torch.compiler.is_compiling() or math.isfinite(value))


def is_integer(value) -> bool:
    """An integer (int, numpy integer), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def unwritable(t: torch.Tensor) -> str | None:
    """Why an in-place write into t would fail or corrupt (None: it can be written): elements
    sharing memory (a stride-0 dimension, e.g. from expand), a tensor autograd tracks, an inference
    tensor outside inference mode."""
    if any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride(), strict=True)):
        return f"its elements share memory (shape {_shape(t)}, strides {t.stride()}: an expanded view)"
    if t.requires_grad and torch.is_grad_enabled():
        return "autograd tracks it (requires_grad=True with grad mode on)"
    if not torch.compiler.is_compiling() and t.is_inference() and not torch.is_inference_mode_enabled():
        return "it is an inference tensor and inference mode is off"
    return None


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_experts_inputs(
    x_TH: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    activation: str,
    expert_map: torch.Tensor | None,
    global_num_experts: int | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    apply_router_weight_on_input: bool,
    quantized: bool,
    validate: bool | None,
) -> ExpertsShape:
    check_activation(activation)
    named = {"hidden_states": x_TH, "w13": w13, "w2": w2, "topk_weights": topk_weights_TK,
             "topk_ids": topk_ids_TK}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t, rank in (("hidden_states", x_TH, 2), ("w13", w13, 3), ("w2", w2, 3),
                          ("topk_weights", topk_weights_TK, 2), ("topk_ids", topk_ids_TK, 2)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D, got shape {_shape(t)}")
    if x_TH.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden_states dtype {x_TH.dtype} is not one of {list(FLOAT_DTYPES)}")
    if not topk_weights_TK.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights_TK.dtype}")
    if topk_ids_TK.dtype not in ID_DTYPES:
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
    device = x_TH.device
    extra = {"expert_map": expert_map, "w13_bias": w13_bias, "w2_bias": w2_bias}
    for name, t in extra.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if global_num_experts is not None and not is_integer(global_num_experts):
        raise TypeError(f"global_num_experts={global_num_experts!r} must be an int or None")
    for name, t in list(named.items()) + list(extra.items()):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but hidden_states is on {device}")
    if x_TH.stride(-1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        bad = [n for n, t in (("hidden_states", x_TH), ("w13", w13), ("w2", w2))
               if (t.stride(-1) != 1 if n == "hidden_states" else not t.is_contiguous())]
        raise ValueError(f"{', '.join(bad)} must be contiguous (call .contiguous())")

    num_tokens, hidden = x_TH.shape
    if _shape(topk_ids_TK) != _shape(topk_weights_TK) or topk_ids_TK.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids {_shape(topk_ids_TK)} and topk_weights {_shape(topk_weights_TK)} must both "
            f"be [{num_tokens}, top_k]"
        )
    top_k = topk_ids_TK.shape[1]
    if top_k < 1:
        raise ValueError(f"topk_ids {_shape(topk_ids_TK)} has no slots: top_k must be >= 1")
    num_local = w13.shape[0]
    if w2.shape[0] != num_local:
        raise ValueError(f"w13 has {num_local} experts but w2 has {w2.shape[0]}")
    if not quantized:
        if w13.dtype != x_TH.dtype or w2.dtype != x_TH.dtype:
            raise ValueError(
                f"unquantized weights must match hidden_states dtype {x_TH.dtype}; got w13 "
                f"{w13.dtype}, w2 {w2.dtype} (pass quant=QuantParams(...) for quantized weights)"
            )
        if w13.shape[2] != hidden or w2.shape[1] != hidden:
            raise ValueError(
                f"hidden size mismatch: hidden_states [{num_tokens}, {hidden}], w13 "
                f"{_shape(w13)} (expected [E, G, {hidden}]), w2 {_shape(w2)} (expected [E, {hidden}, I])"
            )
    intermediate = w2.shape[2] if not quantized else None
    if quantized:
        intermediate = w13.shape[1] // 2 if is_gated(activation) else w13.shape[1]
    rows = 2 * intermediate if is_gated(activation) else intermediate
    if w13.shape[1] != rows:
        kind = "gated" if is_gated(activation) else "non-gated"
        source = "" if quantized else f" (w2 {_shape(w2)}'s last dimension)"
        raise ValueError(
            f"w13 has {w13.shape[1]} rows per expert but {kind} activation {activation!r} with "
            f"intermediate size {intermediate}{source} needs {rows}"
        )
    for name, bias, want in (("w13_bias", w13_bias, (num_local, rows)), ("w2_bias", w2_bias, (num_local, hidden))):
        if bias is not None and _shape(bias) != want:
            raise ValueError(f"{name} has shape {_shape(bias)}, expected {want}")

    if expert_map is not None:
        if expert_map.dim() != 1 or expert_map.dtype not in ID_DTYPES:
            raise ValueError(
                f"expert_map must be a 1-D int32/int64 tensor, got {expert_map.dtype} shape "
                f"{_shape(expert_map)}"
            )
        if global_num_experts is not None and expert_map.numel() != global_num_experts:
            raise ValueError(
                f"expert_map has {expert_map.numel()} entries but global_num_experts={global_num_experts}"
            )
        num_global = expert_map.numel()
    else:
        num_global = num_local if global_num_experts is None else global_num_experts
        if num_global != num_local:
            raise ValueError(
                f"global_num_experts={global_num_experts} differs from the {num_local} experts in "
                "w13 but no expert_map says which are local"
            )
    if top_k > num_global:
        raise ValueError(f"top_k={top_k} exceeds the number of experts ({num_global})")
    if apply_router_weight_on_input and top_k != 1:
        raise ValueError(f"apply_router_weight_on_input=True needs top_k == 1, got top_k={top_k}")

    if should_validate(validate, x_TH) and num_tokens:
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < 0 or hi >= num_global:
            bad = lo if lo < 0 else hi
            raise ValueError(f"topk_ids contains {bad}, outside [0, {num_global})")
        if expert_map is not None and expert_map.numel():
            lo, hi = int(expert_map.min()), int(expert_map.max())
            if lo < -1 or hi >= num_local:
                raise ValueError(
                    f"expert_map values must be -1 or in [0, {num_local}), found {lo if lo < -1 else hi}"
                )
            owned = expert_map[expert_map >= 0]
            if owned.numel() != torch.unique(owned).numel():
                raise ValueError("expert_map sends two global experts to the same local expert")
    return ExpertsShape(num_tokens, hidden, intermediate, num_local, num_global, top_k)
