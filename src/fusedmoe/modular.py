"""The modular kernel: prepare/finalize (dispatch/combine tokens) around an experts computation.

    out = finalize(experts.apply(*prepare(x, topk_weights, topk_ids)))

`Experts` owns permute -> GEMM1 -> activation -> GEMM2 -> weighted top-k reduction for the
experts of this rank, so its output is already [T, H]. `PrepareFinalize` owns token movement:
`LocalPrepareFinalize` (one rank, no communication) is the base case; expert-parallel dispatch
subclasses it. Weight layout changes a backend wants happen once, in `Experts.process_weights`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from fusedmoe.config import MoEConfig
from fusedmoe.quant.params import QuantParams

# Legend: T tokens, H hidden, I intermediate (per partition), G = 2I (gated) or I, E global
# experts, L local experts, K top-k.


@dataclass
class ExpertWeights:
    """The tensors of the local experts, in the canonical layout unless a backend re-laid them.

    w13 [L, G, H] (rows [0, I) gate, [I, 2I) up), w2 [L, H, I], biases [L, G] and [L, H].
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    quant: QuantParams | None = None

    def replace(self, **changes) -> ExpertWeights:
        return replace(self, **changes)


class Experts(abc.ABC):
    """Computes out[t] = sum_k w[t,k] * expert(ids[t,k])(x[t]) over this rank's experts.

    Slots whose id is outside [0, E) or maps to -1 in expert_map contribute exactly zero.
    """

    layout: ClassVar[str] = "standard"
    supports_inplace: ClassVar[bool] = True

    def __init__(self, config: MoEConfig):
        self.config = config

    def process_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """Once after loading: return the weights in the layout `apply` expects."""
        return weights

    @abc.abstractmethod
    def apply(
        self,
        x_TH: torch.Tensor,
        weights: ExpertWeights,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        *,
        expert_map_E: torch.Tensor | None,
        out_TH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return [T, H] in x's dtype (written into out_TH when given)."""


class PrepareFinalize:
    """Token movement around the experts. The base class is one rank: nothing moves."""

    def prepare(
        self, x_TH: torch.Tensor, topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x_TH, topk_weights_TK, topk_ids_TK

    def finalize(self, out_TH: torch.Tensor) -> torch.Tensor:
        return out_TH


LocalPrepareFinalize = PrepareFinalize


class ModularMoE:
    """prepare -> experts -> finalize."""

    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts):
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    def __call__(
        self,
        x_TH: torch.Tensor,
        weights: ExpertWeights,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        *,
        expert_map_E: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> torch.Tensor:
        x, w, ids = self.prepare_finalize.prepare(x_TH, topk_weights_TK, topk_ids_TK)
        out = x_TH if inplace and self.experts.supports_inplace else None
        y = self.experts.apply(x, weights, w, ids, expert_map_E=expert_map_E, out_TH=out)
        return self.prepare_finalize.finalize(y)


def local_slots(
    topk_ids_TK: torch.Tensor, expert_map_E: torch.Tensor | None, num_global_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(local expert index [T, K] int64, valid mask [T, K]) for every (token, slot).

    Ids outside [0, E) and ids that expert_map sends to -1 are invalid (they contribute zero);
    their local index is 0 so that indexing with it stays in bounds.
    """
    ids = topk_ids_TK.long()
    valid = (ids >= 0) & (ids < num_global_experts)
    local = torch.where(valid, ids, torch.zeros_like(ids))
    if expert_map_E is not None:
        local = expert_map_E.long()[local]
        valid &= local >= 0
        local = torch.where(valid, local, torch.zeros_like(local))
    return local, valid
