"""The seeds' Marlin rows (`marlin`, `batched_marlin`), served by fusedmoe's Triton weight-only
kernels: checkpoints whose scheme also quantizes activations run with 16-bit activations.

vLLM runs NVFP4 and MXFP4-W4A8 MoE checkpoints on Hopper (no FP4 tensor cores) through Marlin:
the 4-bit weights are dequantized in registers and multiplied with bf16/fp16 activations; the
activation quantization of the scheme (and its calibrated input scales) is not applied. These
classes do the same with `weight_only.py`'s kernels, mapping each scheme to the weight-only
scheme with the identical weight format (`WEIGHT_ONLY_TWIN`). The result is the weight-only
math, closer to the unquantized layer than the W4A4 emulation (which rounds activations to
4 bits); the backend record says so (`Backend.weight_only_execution`), and the fuzz harness and
tests compare it with the weight-only reference.

Plain weight-only schemes (int4, mxfp4_w4a16, ...) are not served here: the `triton` row runs
them with the same kernels.
"""

from __future__ import annotations

from fusedmoe.backends.triton.experts import BatchedTritonExperts, TritonExperts
from fusedmoe.config import MoEConfig
from fusedmoe.modular import ExpertWeights
from fusedmoe.quant.params import QuantParams
from fusedmoe.quant.scheme import SCHEMES, QuantScheme

# scheme -> the weight-only scheme with the same weight payload, scales and global scales.
WEIGHT_ONLY_TWIN: dict[str, str] = {
    "nvfp4": "nvfp4_w4a16",
    "mxfp4_w4a8": "mxfp4_w4a16",
}


def weight_only_twin(scheme: QuantScheme) -> QuantScheme:
    """The weight-only scheme that runs `scheme`'s weights (ValueError if there is none)."""
    twin = WEIGHT_ONLY_TWIN.get(scheme.name)
    if twin is None:
        raise ValueError(
            f"the marlin backend runs {sorted(WEIGHT_ONLY_TWIN)} with 16-bit activations, not "
            f"{scheme.name}"
        )
    assert SCHEMES[twin].weight == scheme.weight, (scheme.name, twin)
    return SCHEMES[twin]


def _as_weight_only(config: MoEConfig) -> MoEConfig:
    if config.quant is None:
        raise ValueError("the marlin backend runs quantized checkpoints only (config.quant is None)")
    return config.replace(quant=weight_only_twin(config.quant))


def _weight_only_weights(weights: ExpertWeights, twin: QuantScheme) -> ExpertWeights:
    q = weights.quant
    if q is None:
        raise ValueError("the marlin backend needs quantized weights (weights.quant is None)")
    if q.scheme.name != twin.name and WEIGHT_ONLY_TWIN.get(q.scheme.name) != twin.name:
        raise ValueError(f"weights.quant has scheme {q.scheme.name}, which the marlin backend "
                         f"does not run as {twin.name}")
    # The activation scales (static fp8 / NVFP4 input global scales) belong to the activation
    # quantization that this execution skips.
    params = QuantParams(twin, q.w13_scale, q.w2_scale, w13_global_scale=q.w13_global_scale,
                         w2_global_scale=q.w2_global_scale)
    return weights.replace(quant=params)


class MarlinExperts(TritonExperts):
    """`marlin`: contiguous layout, weight-only execution of the scheme's weights."""

    def __init__(self, config: MoEConfig):
        super().__init__(_as_weight_only(config))

    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None):
        weights = _weight_only_weights(weights, self.config.quant)
        return super().apply(x_TH, weights, topk_weights_TK, topk_ids_TK, expert_map_E=expert_map_E,
                             out_TH=out_TH)


class BatchedMarlinExperts(BatchedTritonExperts):
    """`batched_marlin`: per-expert buffers [L, max_tokens, H], weight-only execution."""

    def __init__(self, config: MoEConfig):
        super().__init__(_as_weight_only(config))

    def apply_batched(self, x_LMH, num_tokens_L, weights: ExpertWeights, *, num_slots: int = 0, top_k: int = 1):
        return super().apply_batched(x_LMH, num_tokens_L, _weight_only_weights(weights, self.config.quant),
                                     num_slots=num_slots, top_k=top_k)
