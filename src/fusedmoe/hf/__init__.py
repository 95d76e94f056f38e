"""Hugging Face transformers integration: MoE models from `transformers` run on fusedmoe.

    import fusedmoe.hf                                   # registers experts_implementation "fusedmoe"
    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="fusedmoe")
    model.set_experts_implementation("fusedmoe")         # or switch a loaded model
    fusedmoe.hf.patch(model)                             # whole blocks: routing + experts + shared
    fusedmoe.hf.unpatch(model)

The experts implementation replaces only the experts of `@use_experts_implementation` classes
(bf16/fp16/fp32 and transformers' block-FP8 experts); routing and shared experts stay in
transformers. `patch` also fuses the routing and reaches blocks the hook does not (Llama-4, DBRX,
gpt-oss's transposed experts). Families and their status: `FAMILIES`, docs/hf.md.
"""

from __future__ import annotations

from fusedmoe.hf.experts import UnsupportedModel, experts_forward
from fusedmoe.hf.families import FAMILIES, Family, family
from fusedmoe.hf.patch import is_patched, patch, unpatch

IMPLEMENTATION = "fusedmoe"


def register() -> None:
    """Register `experts_forward` as "fusedmoe" in transformers' experts interfaces (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # transformers without fine-grained FP8
        return
    FP8ExpertsInterface.register(IMPLEMENTATION, experts_forward)


register()

__all__ = [
    "FAMILIES",
    "IMPLEMENTATION",
    "Family",
    "UnsupportedModel",
    "experts_forward",
    "family",
    "is_patched",
    "patch",
    "register",
    "unpatch",
]
