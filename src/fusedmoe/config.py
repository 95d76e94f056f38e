"""Frozen descriptions of a MoE problem: the parallel split and the whole layer config.

`MoEConfig` is what the oracle selects on; it holds no tensors. Every field is validated at
construction and errors name the offending value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from fusedmoe.activations import ACTIVATIONS, SWIGLUOAI_ALPHA, is_gated
from fusedmoe.quant.scheme import Family, QuantScheme, family_of, get_scheme
from fusedmoe.validation import is_finite_real, is_integer

ActivationFormat = Literal["standard", "batched"]
Placement = Literal["linear", "round_robin"]
Dispatch = Literal["alltoall", "alltoall_batched", "allgather"]
DISPATCHES = ("alltoall", "alltoall_batched", "allgather")

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Routing methods a monolithic backend (one that fuses the router) may have to reproduce.
ROUTING_METHODS = ("softmax_topk", "sigmoid_topk", "grouped_topk", "llama4", "custom")


@dataclass(frozen=True)
class ParallelConfig:
    """How the layer is split: tensor (intermediate), data (tokens) and expert parallelism.

    With EP each rank owns whole experts (`num_experts / ep_size` of them); with TP each rank
    owns `intermediate_size / tp_size` columns of every expert it holds. The process group is
    an (outer x tp) grid, rank = outer_rank * tp_size + tp_rank, where the outer ranks are the
    EP ranks (or the DP ranks when ep_size == 1). DP ranks hold different tokens; the
    ep_size / dp_size EP ranks of one DP rank hold the same ones (dp_size 1: every rank does).
    `dispatch` says how tokens reach the experts' ranks under EP: "alltoall" (each (token, k)
    copy to its expert's rank, standard layout), "alltoall_batched" (the same, received as
    per-local-expert buffers: batched layout) or "allgather" (every rank sees every token,
    partial outputs reduce-scattered back). `quantize_dispatch`: under a W8A8 scheme with
    per-row dynamic activation scales (fp8 per-token or 1x128 groups, int8 per-token) rows
    cross the wire quantized (1 byte an element plus fp32 scales).
    """

    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    placement: Placement = "linear"
    dispatch: Dispatch = "alltoall"
    quantize_dispatch: bool = True

    def __post_init__(self) -> None:
        for kind in ("tp", "dp", "ep"):
            size, rank = getattr(self, f"{kind}_size"), getattr(self, f"{kind}_rank")
            for name, value in ((f"{kind}_size", size), (f"{kind}_rank", rank)):
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{name}={value!r} must be an int")
            if size < 1:
                raise ValueError(f"{kind}_size={size} must be >= 1")
            if not 0 <= rank < size:
                raise ValueError(f"{kind}_rank={rank} must be in [0, {kind}_size={size})")
        if self.placement not in ("linear", "round_robin"):
            raise ValueError(f"placement={self.placement!r}; expected 'linear' or 'round_robin'")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch={self.dispatch!r}; expected one of {list(DISPATCHES)}")
        ep, dp = self.ep_size, self.dp_size
        if ep > 1 and dp > 1:
            if ep % dp:
                raise ValueError(
                    f"ep_size={ep} is not a multiple of dp_size={dp} ({ep} % {dp} = {ep % dp}): "
                    "each DP rank spans ep_size / dp_size EP ranks"
                )
            if self.dp_rank != self.ep_rank // (ep // dp):
                raise ValueError(
                    f"dp_rank={self.dp_rank} but ep_rank={self.ep_rank} belongs to DP rank "
                    f"{self.ep_rank // (ep // dp)} (ep_rank // (ep_size / dp_size) = "
                    f"{self.ep_rank} // {ep // dp})"
                )

    @classmethod
    def for_rank(cls, rank: int, *, tp_size: int = 1, dp_size: int = 1, ep_size: int = 1,
                 placement: Placement = "linear", dispatch: Dispatch = "alltoall") -> ParallelConfig:
        """The config of process `rank` in a group of (max(ep, dp) * tp) ranks."""
        outer = max(ep_size, dp_size)
        world = outer * tp_size
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(
                f"rank={rank!r} must be in [0, {world}) (max(ep_size={ep_size}, dp_size={dp_size}) "
                f"x tp_size={tp_size} = {world} ranks)"
            )
        outer_rank, tp_rank = divmod(rank, tp_size)
        if ep_size > 1:
            ep_rank = outer_rank
            dp_rank = outer_rank // (ep_size // dp_size) if ep_size % dp_size == 0 else 0
        else:
            ep_rank, dp_rank = 0, outer_rank
        return cls(tp_size, tp_rank, dp_size, dp_rank, ep_size, ep_rank, placement, dispatch)

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1

    @property
    def use_dp(self) -> bool:
        return self.dp_size > 1

    @property
    def use_tp(self) -> bool:
        return self.tp_size > 1

    @property
    def use_batched_activation_format(self) -> bool:
        """Experts receive per-local-expert buffers (the batched all-to-all's layout)."""
        return self.use_ep and self.dispatch == "alltoall_batched"

    @property
    def outer_size(self) -> int:
        """Ranks along the expert (or, without EP, data) axis of the grid."""
        return max(self.ep_size, self.dp_size)

    @property
    def outer_rank(self) -> int:
        return self.ep_rank if self.ep_size > 1 else self.dp_rank

    @property
    def world_size(self) -> int:
        return self.outer_size * self.tp_size

    @property
    def rank(self) -> int:
        """This process's rank in the MoE process group."""
        return self.outer_rank * self.tp_size + self.tp_rank

    @property
    def token_replicas(self) -> int:
        """How many outer ranks hold the same tokens (ep_size / dp_size under EP, else 1)."""
        return self.ep_size // self.dp_size if self.use_ep else 1


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer as the oracle sees it: shapes, numerics, features, split and request.

    `intermediate_size` is the model's full expert width; each TP rank holds
    `intermediate_size_per_partition` of it. `swiglu_limit` asks for the SwiGLU clamp (on
    swigluoai it overrides the default 7.0). `backend` is "auto" or a backend name.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype = torch.bfloat16
    activation: str = "silu"
    has_bias: bool = False
    quant: QuantScheme | str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = SWIGLUOAI_ALPHA
    activation_format: ActivationFormat = "standard"
    backend: str = "auto"
    apply_router_weight_on_input: bool = False
    has_expert_map: bool = False
    routing_method: str = "softmax_topk"
    routed_scaling_factor: float = 1.0
    max_num_tokens: int | None = None
    allow_cutlass: bool = False
    batch_invariant: bool = False
    enable_eplb: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "quant", get_scheme(self.quant))
        object.__setattr__(self, "backend", str(self.backend).strip().lower())
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError(f"parallel must be a fusedmoe.ParallelConfig, got {type(self.parallel).__name__}")
        for name in ("has_bias", "apply_router_weight_on_input", "has_expert_map", "allow_cutlass",
                     "batch_invariant", "enable_eplb"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if value is None and name == "swiglu_limit":
                continue
            if not is_finite_real(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"dtype={self.dtype} must be one of {list(ACTIVATION_DTYPES)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; expected one of {list(ACTIVATIONS)}")
        if self.swiglu_limit is not None:
            if not is_gated(self.activation):
                raise ValueError(
                    f"swiglu_limit={self.swiglu_limit} needs a gated activation, "
                    f"not {self.activation!r}"
                )
            if not self.swiglu_limit > 0:
                raise ValueError(f"swiglu_limit={self.swiglu_limit} must be > 0")
        if self.activation_format not in ("standard", "batched"):
            raise ValueError(
                f"activation_format={self.activation_format!r}; expected 'standard' or 'batched'"
            )
        if self.routing_method not in ROUTING_METHODS:
            raise ValueError(
                f"routing_method={self.routing_method!r}; expected one of {list(ROUTING_METHODS)}"
            )
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(
                f"apply_router_weight_on_input=True needs top_k == 1 (got top_k={self.top_k}): "
                "the weight scales the expert's input, which is only defined for one expert"
            )
        tp, ep = self.parallel.tp_size, self.parallel.ep_size
        if self.intermediate_size % tp:
            raise ValueError(
                f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp}"
            )
        if self.num_experts % ep:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by ep_size={ep} "
                f"({self.num_experts} % {ep} = {self.num_experts % ep})"
            )
        if self.parallel.use_batched_activation_format and self.activation_format != "batched":
            raise ValueError(
                f"dispatch={self.parallel.dispatch!r} with ep_size={ep} delivers per-expert "
                f"buffers: activation_format must be 'batched', not {self.activation_format!r}"
            )
        if self.max_num_tokens is not None and (not is_integer(self.max_num_tokens) or self.max_num_tokens < 1):
            raise ValueError(f"max_num_tokens={self.max_num_tokens} must be >= 1")

    # Derived views -------------------------------------------------------------------------
    @property
    def family(self) -> Family:
        return family_of(self.quant)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.parallel.ep_size

    @property
    def intermediate_size_per_partition(self) -> int:
        return self.intermediate_size // self.parallel.tp_size

    @property
    def gated(self) -> bool:
        return is_gated(self.activation)

    @property
    def needs_expert_map(self) -> bool:
        # Batched buffers arrive already dispatched to this rank's experts: no map to apply.
        standard_ep = self.parallel.use_ep and self.activation_format == "standard"
        return self.has_expert_map or standard_ep

    @property
    def needs_clamp(self) -> bool:
        return self.swiglu_limit is not None

    def replace(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)
