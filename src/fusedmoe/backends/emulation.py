"""`emulation` backend: dequantize the weights, fake-quantize activations, run the reference.

    w13, w2 = dequantize_weights(q13, q2, quant)            # float32, cached for the last weights
    out = fused_experts_ref(x, w13, w2, ..., input_transform=fq(a13_scale[e]),
                            intermediate_transform=fq(a2_scale[e]) after rounding to x's dtype)
fq = fake_quantize_activation with the scheme's activation key (weight-only schemes: identity).
The intermediate is rounded to the activation dtype before its quantization, as the Triton
kernels store it (and vLLM's): the codes come from what a 16-bit intermediate holds.
The hooks see one local expert's rows at a time, so a dynamic per-tensor scale (fp8 tensor, the
NVFP4 global scale) covers the rows routed to that expert, not the whole batch.
"""

from __future__ import annotations

import weakref

import torch

from fusedmoe.backends.torch_ref import reference_for
from fusedmoe.config import MoEConfig
from fusedmoe.modular import Experts, ExpertWeights, traced_experts, tracing
from fusedmoe.quant.activations import fake_quantize_activation
from fusedmoe.quant.params import TENSOR_FIELDS, QuantParams
from fusedmoe.quant.scheme import QuantKey
from fusedmoe.quant.weights import check_quant_weights, dequantize_weights
from fusedmoe.reference import Transform


class EmulationExperts(Experts):
    def __init__(self, config: MoEConfig):
        super().__init__(config)
        # (weak refs to the source tensors, (weight key, their versions), (w13, w2) float32). One
        # entry: repeated calls on one layer skip dequantization; it is dropped when its source
        # weights are freed (`_drop`), so no old layer's fp32 copy stays pinned by this object
        # (which the API's kernel cache keeps alive per config).
        self._cache: tuple[tuple[weakref.ref, ...], tuple, tuple[torch.Tensor, ...]] | None = None
        self._generation = 0  # which entry a `_drop` finalizer was registered for

    def apply(self, x_TH, weights: ExpertWeights, topk_weights_TK, topk_ids_TK, *, expert_map_E,
              out_TH=None) -> torch.Tensor:
        c = self.config
        quant = weights.quant
        if quant is None:
            raise ValueError(
                "the emulation backend runs quantized weights, but weights.quant is None "
                "(pass QuantParams, or select an unquantized backend)"
            )
        if c.quant is not None and quant.scheme != c.quant:
            raise ValueError(
                f"weights.quant has scheme {quant.scheme.name} but the config says {c.quant.name}"
            )
        check_quant_weights(weights.w13, weights.w2, quant, x_TH.shape[1], weights.w13.shape[1], gated=c.gated)
        if tracing():  # the dequantized-weight cache and the reference's loop stay out of the trace
            return traced_experts("emulation", c, x_TH, weights, topk_weights_TK, topk_ids_TK, expert_map_E, out_TH)
        w13_LGH, w2_LHI = self._dequantized(weights.w13, weights.w2, quant)
        key = quant.scheme.activation
        y = reference_for(
            c, x_TH, w13_LGH, w2_LHI, weights, topk_weights_TK, topk_ids_TK, expert_map_E,
            input_transform=activation_transform(key, quant.a13_scale),
            intermediate_transform=activation_transform(key, quant.a2_scale, round_to=x_TH.dtype),
        )
        if out_TH is not None:
            return out_TH.copy_(y)
        return y

    def _dequantized(
        self, w13: torch.Tensor, w2: torch.Tensor, quant: QuantParams
    ) -> tuple[torch.Tensor, ...]:
        # the weight-side tensors (activation scales do not enter the dequantized weights)
        sources = (w13, w2, *(getattr(quant, name) for name in TENSOR_FIELDS if name not in ("a13_scale", "a2_scale")))
        present = tuple(t for t in sources if t is not None)
        stamp = (quant.scheme.weight, *(_version(t) for t in present))
        if self._cache is not None:
            refs, cached_stamp, dequantized = self._cache
            # Equal stamps hold as many versions as there are refs.
            if cached_stamp == stamp and all(
                ref() is t for ref, t in zip(refs, present, strict=True)
            ):
                return dequantized
        dequantized = dequantize_weights(w13, w2, quant)
        self._cache = (tuple(weakref.ref(t) for t in present), stamp, dequantized)
        self._generation += 1
        weakref.finalize(w13, EmulationExperts._drop, weakref.ref(self), self._generation)
        return dequantized

    @staticmethod
    def _drop(owner: weakref.ref, generation: int) -> None:
        """The cached entry's w13 was freed: release its fp32 copies (unless a newer entry replaced it)."""
        self = owner()
        if self is not None and self._generation == generation:
            self._cache = None


def activation_transform(
    key: QuantKey | None, static_scale: torch.Tensor | None, round_to: torch.dtype | None = None,
) -> Transform | None:
    """The reference hook fake-quantizing one expert's activations (None: weight-only).

    static_scale holds one value for all experts or one per local expert ([L]). round_to: the
    activations are first rounded to this dtype (the intermediate: the kernels store it in the
    activation dtype, as vLLM's do, and quantize it from there).
    """
    if key is None:
        return None

    def transform(a: torch.Tensor, local_expert: int) -> torch.Tensor:
        if round_to is not None:
            a = a.to(round_to).to(a.dtype)
        scale = None
        if static_scale is not None:
            scale = static_scale.reshape(-1)[local_expert if static_scale.numel() > 1 else 0]
        return fake_quantize_activation(a, key, scale)

    return transform


def _version(t: torch.Tensor) -> int:
    # Inference tensors carry no version counter: they are taken as unchanged.
    return -1 if t.is_inference() else t._version
