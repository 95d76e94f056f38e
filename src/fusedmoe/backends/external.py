"""Adapters to kernel packages fusedmoe does not ship (FlashInfer, DeepGEMM, AITER, IPEX, TPU).

The oracle selects these from their records (package present, capability, scheme...). An
adapter imports its package only when constructed. FlashInfer CUTLASS has a real adapter
(w13 re-laid as [up; gate], as that kernel expects); it is written against FlashInfer's
documented `cutlass_fused_moe` and has not run here (FlashInfer is not installed on our
machines). The others say plainly that fusedmoe cannot drive them yet.
"""

from __future__ import annotations

import importlib

import torch

from fusedmoe.modular import Experts, ExpertWeights


def swap_w13_halves(w13_LGH: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> [up; gate] along dim 1 (the layout FlashInfer CUTLASS/TRTLLM read)."""
    i = w13_LGH.shape[1] // 2
    return torch.cat([w13_LGH[:, i:], w13_LGH[:, :i]], dim=1).contiguous()


class _Adapter(Experts):
    package: str = ""

    def __init__(self, config):
        super().__init__(config)
        try:
            self.module = importlib.import_module(self.package)
        except ImportError as exc:
            raise ImportError(
                f"backend needs the {self.package!r} package, which failed to import: {exc}"
            ) from exc


class _NotWired(_Adapter):
    backend = ""

    def __init__(self, config):
        super().__init__(config)
        raise NotImplementedError(
            f"fusedmoe selected {self.backend!r} (package {self.package!r} is installed), but its "
            "adapter is not written yet; pass backend='triton' (or 'torch'), or exclude it with "
            "the FUSEDMOE_USE_* knob for its group"
        )

    def apply(self, *args, **kwargs):  # pragma: no cover - construction already raised
        raise NotImplementedError


class FlashInferCutlassExperts(_Adapter):
    """FlashInfer `cutlass_fused_moe` for unquantized bf16/fp16 weights."""

    package = "flashinfer"
    supports_inplace = False

    def process_weights(self, weights: ExpertWeights) -> ExpertWeights:
        if self.config.gated:
            weights = weights.replace(w13=swap_w13_halves(weights.w13))
        return weights

    def apply(self, x_TH, weights, topk_weights_TK, topk_ids_TK, *, expert_map_E, out_TH=None):
        if self.config.quant is not None:
            raise NotImplementedError("fusedmoe's FlashInfer CUTLASS adapter covers unquantized MoE only")
        from flashinfer.fused_moe import cutlass_fused_moe

        p = self.config.parallel
        result = cutlass_fused_moe(
            x_TH, topk_ids_TK.to(torch.int32), topk_weights_TK.float(), weights.w13, weights.w2,
            x_TH.dtype, quant_scales=None, tp_size=p.tp_size, tp_rank=p.tp_rank,
            ep_size=p.ep_size, ep_rank=p.ep_rank,
        )
        y = result[0] if isinstance(result, (list, tuple)) else result
        return out_TH.copy_(y) if out_TH is not None else y


class FlashInferTrtllmExperts(_NotWired):
    package, backend = "flashinfer", "flashinfer_trtllm"


class FlashInferCuteDslExperts(_NotWired):
    package, backend = "flashinfer", "flashinfer_cutedsl"


class FlashInferB12xExperts(_NotWired):
    package, backend = "flashinfer", "flashinfer_b12x"


class DeepGemmExperts(_NotWired):
    package, backend = "deep_gemm", "deepgemm"


class AiterExperts(_NotWired):
    package, backend = "aiter", "aiter"


class XpuExperts(_NotWired):
    package, backend = "intel_extension_for_pytorch", "xpu"


class TpuExperts(_NotWired):
    package, backend = "tpu_inference", "tpu"
