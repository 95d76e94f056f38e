"""How far each quantization scheme moves a MoE layer's output from the full-precision layer.

    from fusedmoe.quant.accuracy import measure
    measure("fp8_w8a8_block")   # Accuracy(weight_rel=..., out_rel=..., out_diff=..., act_rel=...)

`measure` quantizes random weights (N(0, 1/K) entries, tokens N(0, 1), uniform routing) with
the scheme, runs the `emulation` backend (the scheme's arithmetic: dequantized weights and
fake-quantized activations, float32) and compares it with the float64 layer on the original
weights. Two figures per comparison: the relative Frobenius error and DeepGEMM's global
difference, 1 - 2<x, y> / (|x|^2 + |y|^2), which is about half the squared relative error for
small errors and also catches a wrong sign or scale. `act_rel` separates the activation rounding
(W8A8, W4A8, W4A4) from the weight rounding: emulation against the weight-only math on the same
dequantized weights.

These are the scheme's own errors. The kernels are held to the scheme's arithmetic separately:
tests compare each backend with `emulation` (or the reference on dequantized weights) within
the tolerances of `fusedmoe.fuzz.tolerance`; `docs/quantization.md` has both tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe.reference import fused_experts_ref


def rel_fro(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def global_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """DeepGEMM's calc_diff: 1 - 2<out, ref> / (|out|^2 + |ref|^2) in float64 (0 = equal)."""
    out, ref = out.double(), ref.double()
    denominator = (out * out + ref * ref).sum().clamp_min(1e-300)
    return (1 - 2 * (out * ref).sum() / denominator).item()


# (out_rel, out_diff) of `measure(scheme)` at its defaults (T=256, E=8, K=2, H=1024, I=512,
# silu, seed 0); docs/quantization.md prints them and tests/test_quant_accuracy.py holds each
# scheme to a band around them at another size and seed.
EXPECTED: dict[str, tuple[float, float]] = {
    "fp8_w8a8_tensor": (6.6e-2, 2.2e-3),
    "fp8_w8a8_tensor_static": (6.6e-2, 2.2e-3),
    "fp8_w8a8_channel": (6.5e-2, 2.1e-3),
    "fp8_w8a8_block": (6.4e-2, 2.0e-3),
    "int8_w8a8": (2.5e-2, 3.2e-4),
    "fp8_w8a16": (4.6e-2, 1.1e-3),
    "int8_w8a16": (1.4e-2, 9.2e-5),
    "int4_w4a16_g32": (1.7e-1, 1.4e-2),
    "int4_w4a16_g64": (1.9e-1, 1.8e-2),
    "int4_w4a16_g128": (2.1e-1, 2.1e-2),
    "int4_w4a16_g32_zp": (1.4e-1, 9.9e-3),
    "int4_w4a16_g64_zp": (1.6e-1, 1.3e-2),
    "int4_w4a16_g128_zp": (1.8e-1, 1.5e-2),
    "mxfp4_w4a16": (2.0e-1, 2.1e-2),
    "mxfp4_w4a8": (2.1e-1, 2.2e-2),
    "nvfp4": (2.3e-1, 2.7e-2),
    "nvfp4_w4a16": (1.7e-1, 1.4e-2),
}


@dataclass(frozen=True)
class Accuracy:
    scheme: str
    weight_rel: float  # w13's dequantized weights against the originals, relative Frobenius
    out_rel: float     # the scheme's output (emulation) against the full-precision layer
    out_diff: float    # the same as a global difference
    act_rel: float     # emulation against the weight-only math on its dequantized weights


def measure(scheme: str, *, tokens: int = 256, experts: int = 8, top_k: int = 2, hidden: int = 1024,
            inter: int = 512, activation: str = "silu", seed: int = 0) -> Accuracy:
    """The scheme's errors on one random layer (float32 emulation on the CPU; a few seconds)."""
    from fusedmoe import fuzz
    from fusedmoe.api import fused_experts

    case = fuzz.FuzzCase(
        seed=seed, profile="cpu", num_tokens=tokens, num_experts=experts, top_k=top_k, hidden=hidden,
        inter=inter, dtype="float32", activation=activation, routing="uniform", bias=False,
        local_experts=None, weight_on_input=False, quant=scheme, swiglu_limit=None, ids_dtype="int32",
    )
    p = fuzz.make_problem(case)
    w = p.weights
    out = fused_experts(p.x_TH, w.w13, w.w2, p.topk_weights_TK, p.topk_ids_TK, activation=activation,
                        quant=w.quant, backend="emulation")
    full = fused_experts_ref(p.x_TH.double(), p.w13_full_LGH.double(), p.w2_full_LHI.double(),
                             p.topk_weights_TK, p.topk_ids_TK, activation=activation)
    weight_only = fuzz.reference(case, p, weight_only=True)
    return Accuracy(scheme, rel_fro(p.w13_LGH, p.w13_full_LGH), rel_fro(out, full), global_diff(out, full),
                    rel_fro(out, weight_only))
