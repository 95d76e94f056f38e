"""`FusedMoE`: the MoE layer as a torch.nn.Module.

    create weights -> load per-expert checkpoint tensors -> process_weights_after_loading()
    -> forward(hidden_states, router_logits) = experts(route(router_logits))

Parameters follow the seeds' `create_weights`: `w13_weight` [L, 2I/tp, H] (gate rows first, then
up; [L, I/tp, H] for non-gated activations), `w2_weight` [L, H, I/tp], optional `w13_bias`
[L, G], `w2_bias` [L, H]. L = num_experts / ep_size local experts; TP shards the intermediate.
Without a process group, a split layer's output is this rank's partial sum (the caller
all-reduces), and the down projection's bias is added on tp_rank 0 only so that the sum counts
it once. With `group=` it dispatches/combines over torch.distributed and returns the full output
of this rank's tokens (`fusedmoe.distributed`, docs/parallel.md). `enable_eplb` makes the local
experts physical slots, (num_experts + num_redundant_experts) / ep_size of them, rebalanced by
`rebalance_experts()` (`fusedmoe.eplb`); `shared_experts` adds a dense MLP (`fusedmoe.shared`).
`max_num_tokens` (the most tokens a rank dispatches per call) fixes the batched buffers' shape,
and with `dispatch="allgather"` pads every rank's rows to it, so no sizes are exchanged and the
EP forward can be captured in a CUDA graph (docs/parallel.md).
With `quant=<scheme>` the layer loads full-precision checkpoints and quantizes them in
`process_weights_after_loading` (online quantization; scales become buffers `w13_scale`, ...).
With `quant=<scheme>, prequantized=True` it loads the checkpoint's payloads and scales instead
(`fusedmoe.quant.checkpoint`): `w13_weight`/`w2_weight` hold the storage dtype and the scale
buffers the fused layout, except that w13's per-tensor values (fp8 weight scale, NVFP4 global
scale, input scales) stay per half, [L, 2] (gate, up), until processing fuses them to [L].
Asymmetric int4 (`*_zp`) loads its zero points into `w13_zero` / `w2_zero` (z - 8, the scales'
layout); GPTQ's and AWQ's tensors look alike, so `checkpoint_format` ("gptq", "gptq_v2", "awq")
says which the layer loads (`checkpoint_config.checkpoint_format_from_config` reads it off the
config), required for their zero points.
Weights may also be written directly (`param.data.copy_`, `load_state_dict`, `nn.init`, a new
Parameter); a full-precision layer whose weights were neither loaded nor written raises at
processing, naming the (expert, shard) pairs (a NaN sentinel per shard in the fresh storage).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from fusedmoe.activations import SWIGLUOAI_ALPHA
from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.distributed import ExpertPlacement, MoEGroups, make_distributed
from fusedmoe.eplb import PhysicalPlacement, move_rows, rebalance, record_load, to_physical
from fusedmoe.errors import BackendRequestError, NoBackendError
from fusedmoe.modular import ExpertWeights, ModularMoE, make_modular
from fusedmoe.oracle import Selection, check_backend_request, select_backend
from fusedmoe.platform import Platform
from fusedmoe.quant.checkpoint import (
    COMPANION_TENSORS,
    GPT_OSS_TENSORS,
    GPTQ_TENSORS,
    ROLES,
    TENSOR_ROLES,
    ZERO_POINT_TENSORS,
    as_multiplier,
    awq_as_packed,
    check_checkpoint_format,
    check_checkpoint_tensor,
    check_companion,
    check_gptq_tensor,
    check_packed_int8,
    check_partition,
    check_zero_point_tensor,
    fuse_fp8_tensor_scales,
    fuse_nvfp4_global_scales,
    gpt_oss_mxfp4_tensor,
    gptq_as_packed,
    int4_payload,
    int8_payload,
    is_companion,
    roles_of,
    tp_slice,
    zero_point_tensor,
)
from fusedmoe.quant.formats import FP8_DTYPE
from fusedmoe.quant.params import LAID_AS_SCALES, TENSOR_FIELDS, QuantParams
from fusedmoe.quant.weights import check_group_divides, scale_shape
from fusedmoe.routing import CustomRouting, check_grouping, select_experts
from fusedmoe.shared import SharedExperts, run_overlapped
from fusedmoe.validation import check_experts_inputs, is_integer, unwritable

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Checkpoint names of the three projections (HF/Qwen/DeepSeek style and Mixtral style).
SHARD_ALIASES = {
    "gate_proj": "gate", "w1": "gate", "gate": "gate",
    "up_proj": "up", "w3": "up", "up": "up",
    "down_proj": "down", "w2": "down", "down": "down",
}
_EXPERT_NAME = re.compile(
    r"(?:^|\.)experts\.(\d+)\.(\w+)\.(bias|" + "|".join((*TENSOR_ROLES, *COMPANION_TENSORS)) + r")$"
)
_GPT_OSS_NAME = re.compile(r"(?:^|\.)experts\.(" + "|".join(GPT_OSS_TENSORS) + r")$")
_PROJECTIONS = ("gate", "up", "down")
_PER_EXPERT = ("w13_weight", "w2_weight", "w13_bias", "w2_bias", "w13_scale", "w2_scale",
               "w13_global_scale", "w2_global_scale", "a13_scale", "a2_scale", "w13_zero", "w2_zero")
_PAYLOAD_DTYPE = {"fp8": FP8_DTYPE, "int8": torch.int8, "int4": torch.uint8, "nvfp4": torch.uint8,
                  "mxfp4": torch.uint8}
_SCALE_DTYPE = {"nvfp4": FP8_DTYPE, "mxfp4": torch.uint8}  # others: float32 (int4: below)


def _expert_index(expert_id) -> int:
    """A Python int from an integral expert id (int, numpy integer, 0-d integer tensor); a float,
    bool or other value is a TypeError, not an id that silently matches no expert."""
    if isinstance(expert_id, torch.Tensor):
        if expert_id.numel() != 1 or expert_id.is_floating_point() or expert_id.is_complex() \
                or expert_id.dtype == torch.bool:
            raise TypeError(f"expert_id must be an integer, got a {expert_id.dtype} tensor of shape "
                            f"{tuple(expert_id.shape)}")
        return int(expert_id)
    if not is_integer(expert_id):
        raise TypeError(f"expert_id must be an integer, got {expert_id!r} ({type(expert_id).__name__})")
    return int(expert_id)


def _same_tokens(hidden_states: torch.Tensor, router_logits: torch.Tensor) -> bool:
    """Both [..., features] over the same tokens: equal leading dimensions, or one of them
    flattened to [tokens, features] (router logits computed on the flattened input)."""
    if hidden_states.dim() < 1 or router_logits.dim() < 1:
        return False
    lead_x, lead_l = hidden_states.shape[:-1], router_logits.shape[:-1]
    if lead_x == lead_l:
        return True
    flat = (len(lead_l) == 1 and lead_l[0] == lead_x.numel()) or (len(lead_x) == 1 and lead_x[0] == lead_l.numel())
    return flat


class FusedMoE(nn.Module):
    """A Mixture-of-Experts layer: routing + experts, with the backend chosen by the oracle."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype | None = None,
        activation: str = "silu",
        has_bias: bool = False,
        renormalize: bool = True,
        scoring_func: str = "softmax",
        use_grouped_topk: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        group_score: str | None = None,
        has_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        custom_routing_function: CustomRouting | None = None,
        apply_router_weight_on_input: bool = False,
        swiglu_alpha: float = SWIGLUOAI_ALPHA,
        swiglu_limit: float | None = None,
        quant=None,
        prequantized: bool = False,
        checkpoint_format: str | None = None,
        parallel: ParallelConfig | None = None,
        backend: str = "auto",
        activation_format: str | None = None,
        device: torch.device | str | None = None,
        platform: Platform | None = None,
        group: ProcessGroup | None = None,
        max_num_tokens: int | None = None,
        shared_experts: nn.Module | None = None,
        enable_eplb: bool = False,
        num_redundant_experts: int = 0,
        inplace: bool = False,
        batch_invariant: bool = False,
    ):
        super().__init__()
        if device is not None and torch.device(device).type == "meta":
            raise ValueError(
                "FusedMoE cannot be built on the meta device: its expert-placement buffers are "
                "computed at construction and `to_empty()` would leave them uninitialized. Build it "
                "on the device it runs on (or on the CPU and move it before loading)."
            )
        # batch_invariant (as FUSEDMOE_BATCH_INVARIANT=1): the experts' output for a token does not
        # depend on the rest of the batch (docs/reliability.md#batch-invariance); shared experts and
        # the router projection are the caller's matmuls.
        # inplace (the seeds' use_inplace): forward overwrites hidden_states with the output and
        # returns it; the backend writes there directly when it allows it (`supports_inplace`),
        # else the output is copied in. Calls that cannot (shared experts reading the input on a
        # side stream, a process group's dispatch, autograd on the input) return a new tensor.
        self.inplace = inplace
        params_dtype = params_dtype or torch.get_default_dtype()
        parallel = parallel or ParallelConfig()
        if activation_format is None:
            activation_format = "batched" if parallel.use_batched_activation_format else "standard"
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func={scoring_func!r}; expected 'softmax' or 'sigmoid'")
        check_grouping(num_experts, top_k, use_grouped_topk, num_expert_group, topk_group, group_score,
                       custom=custom_routing_function is not None)
        if use_grouped_topk:
            routing_method = "grouped_topk"
        elif custom_routing_function is not None:
            routing_method = "custom"
        elif apply_router_weight_on_input and scoring_func == "sigmoid":
            routing_method = "llama4"
        else:
            routing_method = f"{scoring_func}_topk"
        if num_redundant_experts and not enable_eplb:
            raise ValueError(
                f"num_redundant_experts={num_redundant_experts} needs enable_eplb=True: replicas "
                "only receive tokens when routing spreads over them"
            )
        if enable_eplb and parallel.placement != "linear":
            raise ValueError(
                f"enable_eplb=True places experts itself (physical slots split linearly, "
                f"rebalanced by load); placement={parallel.placement!r} must be 'linear'"
            )
        self.num_logical_experts = num_experts
        self.eplb: PhysicalPlacement | None = None
        if enable_eplb:
            self.eplb = PhysicalPlacement.initial(num_experts, num_redundant_experts, parallel.ep_size)
        num_slots = num_experts + num_redundant_experts  # physical experts: what the kernel sees
        self.config = MoEConfig(
            num_slots, top_k, hidden_size, intermediate_size, enable_eplb=enable_eplb,
            dtype=params_dtype, activation=activation, has_bias=has_bias, quant=quant,
            parallel=parallel, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
            activation_format=activation_format, backend=backend,
            apply_router_weight_on_input=apply_router_weight_on_input,
            routing_method=routing_method, routed_scaling_factor=routed_scaling_factor,
            max_num_tokens=max_num_tokens, batch_invariant=batch_invariant,
        )
        # With a group, forward communicates and returns the full output on every rank; without
        # one it returns this rank's partial sum (the caller reduces).
        self.groups = None if group is None else MoEGroups(parallel, group)
        self.shared_experts = shared_experts
        check_backend_request(self.config)
        scheme = self.config.quant
        if scheme is not None and not prequantized:  # online quantization: its groups must tile H and I / tp
            check_group_divides(scheme, "w13", hidden_size)
            check_group_divides(scheme, "w2", self.config.intermediate_size_per_partition)
        if prequantized and scheme is None:
            raise ValueError("prequantized=True needs quant=<scheme>: the checkpoint's format")
        check_checkpoint_format(scheme, checkpoint_format, prequantized)
        if prequantized:
            check_partition(scheme, intermediate_size, parallel.tp_size)
            check_group_divides(scheme, "w13", hidden_size)  # a group may not straddle two rows
        elif scheme is not None and scheme.activation is not None \
                and not scheme.activation.dynamic and scheme.family == "fp8":
            raise NotImplementedError(
                f"FusedMoE(quant={scheme.name!r}) quantizes full-precision checkpoints at load "
                "time, and static activation scales need calibration data; load a checkpoint "
                "that carries input_scale with prequantized=True"
            )
        self.prequantized = prequantized
        self.checkpoint_format = checkpoint_format  # how GPTQ's / AWQ's qzeros (and AWQ's qweight) are stored
        self.quant_params = None
        self.routing = dict(
            renormalize=renormalize, scoring_func=scoring_func, use_grouped_topk=use_grouped_topk,
            num_expert_group=num_expert_group, topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            custom_routing_function=custom_routing_function, group_score=group_score,
        )
        self.platform = platform
        c = self.config
        num_local, inter = c.num_local_experts, c.intermediate_size_per_partition
        rows = 2 * inter if c.gated else inter
        factory = dict(dtype=params_dtype, device=device)
        if prequantized:
            self._create_quantized_storage(num_local, rows, hidden_size, inter, device, params_dtype)
        else:
            self.w13_weight = nn.Parameter(torch.empty(num_local, rows, hidden_size, **factory),
                                           requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(num_local, hidden_size, inter, **factory),
                                          requires_grad=False)
            self._mark_unwritten()
        if has_bias:
            self.w13_bias = nn.Parameter(torch.zeros(num_local, rows, **factory), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(num_local, hidden_size, **factory), requires_grad=False)
        else:
            self.w13_bias = self.w2_bias = None
        if has_correction_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
            )
        else:
            self.e_score_correction_bias = None
        if self.eplb is None:
            self.placement = ExpertPlacement.create(num_experts, parallel)
            local_to_global = self.placement.local_to_global(parallel.ep_rank)
        else:  # kernel ids are physical slots; local_to_global names each slot's logical expert
            self.placement = self.eplb.slot_placement()
            local_to_global = torch.tensor(self.eplb.local_logical(parallel.ep_rank), dtype=torch.int64)
        expert_map = self.placement.expert_map(parallel.ep_rank)
        self.register_buffer("local_to_global", local_to_global.to(device), persistent=False)
        self.register_buffer(
            "expert_map", expert_map.to(device) if parallel.use_ep else None, persistent=False
        )
        self._set_local_experts()
        self._init_eplb_state(device)
        # [L, projection (gate, up, down), role (ROLES: weight, weight_scale, ...)]
        self._loaded = torch.zeros(num_local, len(_PROJECTIONS), len(ROLES), dtype=torch.bool)
        self._role_names: dict[str, str] = {}  # role -> the checkpoint's name for it
        self.selection: Selection | None = None
        self._kernel: ModularMoE | None = None
        self._processed_device: torch.device | None = None  # where the weights were laid out for the backend

    # Expert-parallel load balancing ------------------------------------------------------------
    def _set_local_experts(self) -> None:
        """Loading writes a logical expert into its first local slot; replicas copy it later."""
        self._global_to_local: dict[int, int] = {}
        self._replica_slots: list[tuple[int, int]] = []  # (slot, first slot of the same expert)
        for slot, g in enumerate(self.local_to_global.tolist()):
            if g in self._global_to_local:
                self._replica_slots.append((slot, self._global_to_local[g]))
            else:
                self._global_to_local[g] = slot

    def _init_eplb_state(self, device) -> None:
        """The seeds' EPLB attributes: None without EPLB; else `expert_load_view` [P] (slots routed
        to each physical expert by this rank since the last rebalance), `logical_to_physical_map`
        [E, R+1] (-1 padded) and `logical_replica_count` [E]."""
        if self.eplb is None:
            self.expert_load_view = self.logical_to_physical_map = self.logical_replica_count = None
            return
        width = self.eplb.num_physical - self.eplb.num_logical + 1
        self.register_buffer("expert_load_view",
                             torch.zeros(self.eplb.num_physical, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("logical_to_physical_map",
                             self.eplb.logical_to_physical(width).to(device), persistent=False)
        self.register_buffer("logical_replica_count",
                             torch.tensor(self.eplb.replica_counts(), dtype=torch.int64, device=device),
                             persistent=False)

    @property
    def enable_eplb(self) -> bool:
        return self.eplb is not None

    def _fill_replicas(self) -> None:
        """Copy each replica slot from the slot its logical expert was loaded into."""
        if not self._replica_slots:
            return
        dst = torch.tensor([d for d, _ in self._replica_slots])
        src = torch.tensor([s for _, s in self._replica_slots])
        with torch.no_grad():
            for t in self._per_expert_tensors():
                t[dst.to(t.device)] = t[src.to(t.device)]
            self._loaded[dst] = self._loaded[src]

    def _per_expert_tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer indexed by local expert slot first."""
        num_local = self.config.num_local_experts
        out = []
        for name in _PER_EXPERT:
            t = getattr(self, name, None)
            if t is None:
                continue
            if t.dim() == 0 or t.shape[0] != num_local:
                raise NotImplementedError(
                    f"{name} has shape {tuple(t.shape)}: the backend re-laid it without a leading "
                    f"per-expert dimension of {num_local}, so its experts cannot be moved"
                )
            out.append(t)
        return out

    def rebalance_experts(self, load_E: torch.Tensor | None = None) -> PhysicalPlacement:
        """Recompute the placement from the recorded loads and move the weights (a collective
        over the layer's group under EP: every rank calls it). Loads are summed over all ranks
        first; `load_E` [E] replaces the recorded statistics. Resets `expert_load_view`."""
        if self.eplb is None:
            raise RuntimeError("rebalance_experts() needs a layer built with enable_eplb=True")
        if self._kernel is None:
            self.process_weights_after_loading()
        old = self.eplb
        if load_E is None:
            load_P = self.expert_load_view.clone()
            if self.groups is not None:
                import torch.distributed as dist

                dist.all_reduce(load_P, group=self.groups.group)
            load_E = torch.zeros(old.num_logical, dtype=torch.int64, device=load_P.device)
            load_E.scatter_add_(0, torch.tensor(old.physical_to_logical, device=load_P.device), load_P)
        if tuple(load_E.shape) != (old.num_logical,):
            raise ValueError(f"load_E has shape {tuple(load_E.shape)}, expected ({old.num_logical},)")
        new = rebalance([float(x) for x in load_E.tolist()], old.num_physical, old.ep_size)
        rank = self.config.parallel.ep_rank
        if old.ep_size > 1 and self.groups is None:
            raise RuntimeError("rebalancing moves experts between EP ranks: build the layer with group=...")
        outer = None if self.groups is None else self.groups.outer
        move_rows(self._per_expert_tensors(), old, new, rank, outer)
        width = self.logical_to_physical_map.shape[1]
        with torch.no_grad():
            self.logical_to_physical_map.copy_(new.logical_to_physical(width))
            self.logical_replica_count.copy_(torch.tensor(new.replica_counts()))
            self.local_to_global.copy_(torch.tensor(new.local_logical(rank)))
            self.expert_load_view.zero_()
        self.eplb = new
        self._set_local_experts()
        return new

    def _create_quantized_storage(self, num_local: int, rows: int, hidden: int, inter: int,
                                  device: torch.device | str | None, params_dtype: torch.dtype) -> None:
        """Payload parameters in storage dtype, scale buffers in the layout being loaded. int4
        group scales are held in bf16 for a bf16 layer (as Kimi-K2 and llm-compressor store them,
        and as `quantize_weights` makes them for bf16 weights: half the scale bytes a decode
        streams; an fp32 checkpoint scale rounds once, relative 2^-9), else in fp32."""
        scheme = self.config.quant
        key = scheme.weight
        pack = 2 if key.dtype in ("nvfp4", "mxfp4", "int4") else 1
        payload = dict(dtype=_PAYLOAD_DTYPE[key.dtype], device=device)
        self.w13_weight = nn.Parameter(torch.empty(num_local, rows, hidden // pack, **payload),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_local, hidden, inter // pack, **payload),
                                      requires_grad=False)
        parts = 2 if self.config.gated else 1  # per-tensor values of w13: one per half
        per_tensor = dict(dtype=torch.float32, device=device)
        scale_dtype = torch.bfloat16 if key.dtype == "int4" and params_dtype == torch.bfloat16 else torch.float32
        scale = dict(dtype=_SCALE_DTYPE.get(key.dtype, scale_dtype), device=device)
        if key.granularity == "tensor":
            self.register_buffer("w13_scale", torch.empty(num_local, parts, **per_tensor))
        else:
            self.register_buffer("w13_scale", torch.empty(scale_shape(key, num_local, rows, hidden), **scale))
        self.register_buffer("w2_scale", torch.empty(scale_shape(key, num_local, hidden, inter), **scale))
        if scheme.has_zero:  # asymmetric int4: zero points laid and typed as the scales
            self.register_buffer("w13_zero", torch.empty_like(self.w13_scale))
            self.register_buffer("w2_zero", torch.empty_like(self.w2_scale))
        if key.dtype == "nvfp4":
            self.register_buffer("w13_global_scale", torch.empty(num_local, parts, **per_tensor))
            self.register_buffer("w2_global_scale", torch.empty(num_local, **per_tensor))
        required, optional = roles_of(scheme)
        if "input_scale" in required + optional:
            self.register_buffer("a13_scale", torch.empty(num_local, parts, **per_tensor))
            self.register_buffer("a2_scale", torch.empty(num_local, **per_tensor))

    # Loading -----------------------------------------------------------------------------------
    def load_expert_weight(self, expert_id: int, shard: str, tensor: torch.Tensor) -> bool:
        """Load one checkpoint tensor of global expert `expert_id`; False if not on this rank.

        shard: gate/up/down (aliases gate_proj, up_proj, down_proj, w1, w3, w2) for the weight,
        or the same with a "_bias" suffix. Full (unsharded) tensors: gate/up [I, H], down [H, I],
        gate/up bias [I], down bias [H]; this rank's TP slice is taken here.
        Pre-quantized layers also take "<projection>.<tensor>" with tensor one of weight,
        weight_scale, weight_scale_inv, weight_scale_2, input_scale (or compressed-tensors'
        weight_packed, weight_global_scale, input_global_scale, weight_shape, weight_zero_point;
        GPTQ's and AWQ's qweight, scales, qzeros, g_idx), shaped as stored on disk
        (`fusedmoe.quant.checkpoint`; qzeros of an asymmetric scheme need `checkpoint_format`).
        """
        if self._kernel is not None:
            raise RuntimeError(
                "weights were already processed for backend "
                f"{self.selection.name!r}; load every weight before process_weights_after_loading()"
            )
        if not isinstance(shard, str):
            raise TypeError(f"shard must be a str such as 'gate_proj', got {type(shard).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"the {shard!r} tensor of expert {expert_id!r} must be a torch.Tensor, "
                            f"got {type(tensor).__name__}")
        expert_id = _expert_index(expert_id)
        proj, _, name = shard.partition(".")
        is_bias = not name and proj.endswith("_bias")
        if is_bias:
            proj = proj[: -len("_bias")]
        kind = SHARD_ALIASES.get(proj)
        if kind is None:
            raise ValueError(f"unknown shard {shard!r}; expected one of {sorted(SHARD_ALIASES)}")
        name = name or "weight"
        if name not in TENSOR_ROLES and name not in COMPANION_TENSORS:
            raise ValueError(
                f"unknown checkpoint tensor {name!r} in shard {shard!r}; expected one of "
                f"{sorted(TENSOR_ROLES)}"
            )
        if name != "weight" and not self.prequantized:
            raise ValueError(
                f"{shard!r} is a quantized checkpoint tensor: build the layer with "
                "quant=<the checkpoint's scheme>, prequantized=True"
            )
        c = self.config
        if not 0 <= expert_id < self.num_logical_experts:
            raise ValueError(f"expert_id={expert_id} outside [0, {self.num_logical_experts})")
        if kind == "gate" and not c.gated:
            raise ValueError(f"activation {c.activation!r} is not gated: its experts have no gate projection")
        if is_bias and not c.has_bias:
            raise ValueError(f"{shard!r}: the layer was built with has_bias=False")
        if is_companion(c.quant, name):  # weight_shape, symmetric GPTQ's zero points, group index: checked only
            n, k = (c.hidden_size, c.intermediate_size) if kind == "down" else (c.intermediate_size, c.hidden_size)
            check_companion(c.quant, f"expert {expert_id} {proj}", name, tensor, n, k)
            return self._global_to_local.get(expert_id) is not None
        if self.prequantized and not is_bias:
            return self._load_quantized(expert_id, proj, kind, name, tensor)
        full_i, inter, hidden = c.intermediate_size, c.intermediate_size_per_partition, c.hidden_size
        tp = c.parallel.tp_rank
        cols = slice(tp * inter, (tp + 1) * inter)
        if kind == "down":
            want = (hidden,) if is_bias else (hidden, full_i)
        else:
            want = (full_i,) if is_bias else (full_i, hidden)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"expert {expert_id} {shard}: checkpoint tensor has shape {tuple(tensor.shape)}, "
                f"expected {want}"
            )
        local = self._global_to_local.get(expert_id)
        if local is None:  # checked like a local one, so a bad checkpoint fails on every rank
            return False
        # w13 rows: [0, I) gate, [I, 2I) up (non-gated: [0, I) up).
        offset = inter if (kind == "up" and c.gated) else 0
        with torch.no_grad():
            if is_bias:
                if kind == "down":
                    value = tensor if c.parallel.tp_rank == 0 else torch.zeros_like(tensor)
                    self.w2_bias[local].copy_(value)
                else:
                    self.w13_bias[local, offset : offset + inter].copy_(tensor[cols])
            elif kind == "down":
                self.w2_weight[local].copy_(tensor[:, cols])
            else:
                self.w13_weight[local, offset : offset + inter].copy_(tensor[cols])
        if not is_bias:
            self._loaded[local, _PROJECTIONS.index(kind), ROLES.index("weight")] = True
        return True

    def _load_quantized(self, expert_id: int, proj: str, kind: str, name: str,
                        tensor: torch.Tensor) -> bool:
        c = self.config
        scheme = c.quant
        key = scheme.weight
        full_i, inter, hidden = c.intermediate_size, c.intermediate_size_per_partition, c.hidden_size
        is_down = kind == "down"
        n, k = (hidden, full_i) if is_down else (full_i, hidden)
        where = f"expert {expert_id} {proj}"
        awq = self.checkpoint_format == "awq"
        if name in GPTQ_TENSORS:  # checked as stored, then as pack-quantized's twin
            check_gptq_tensor(scheme, where, name, tensor, n, k, self.checkpoint_format)
            tensor = awq_as_packed(tensor) if awq and name == "qweight" else gptq_as_packed(tensor)
        elif name in ZERO_POINT_TENSORS:  # packed codes -> float z - 8 [N, K/g]
            check_zero_point_tensor(scheme, where, name, tensor, n, k, self.checkpoint_format)
            tensor = zero_point_tensor(where, name, tensor, n, self.checkpoint_format)
        elif name == "weight_packed" and key.dtype == "int8":  # pack-quantized 8-bit words -> int8 codes
            check_packed_int8(where, name, tensor, n, k)
            tensor = int8_payload(tensor)
        check_checkpoint_tensor(scheme, where, name, tensor, n, k)
        role = TENSOR_ROLES[name]
        required, optional = roles_of(scheme)
        if role not in required + optional:  # only input_scale can get here
            if scheme.activation is None:
                # Weight-only: activations stay bf16/fp16, the checkpoint's calibration is moot.
                return self._global_to_local.get(expert_id) is not None
            raise ValueError(
                f"{where}.{name}: {scheme.name} computes activation scales at run time "
                f"({scheme.activation}); a checkpoint with static input scales loads as "
                "fp8_w8a8_tensor_static"
            )
        seen = self._role_names.setdefault(role, name)
        if seen != name:
            raise ValueError(
                f"{where}.{name}: this layer already loaded {role} tensors named {seen!r}; "
                "one checkpoint uses one naming (ModelOpt or compressed-tensors)"
            )
        tensor = as_multiplier(where, name, tensor)
        if role == "weight" and key.dtype == "int4":  # compressed-tensors' int32 words -> nibble bytes
            tensor = int4_payload(tensor)
        local = self._global_to_local.get(expert_id)
        if local is None:  # checked like a local one, so a bad checkpoint fails on every rank
            return False
        part = tp_slice(key, role, is_down, tensor, inter, c.parallel.tp_rank)
        half = 1 if kind == "up" and c.gated else 0
        rows = slice(half * inter, (half + 1) * inter)
        if role == "weight":
            target = self.w2_weight[local] if is_down else self.w13_weight[local, rows]
        elif role == "weight_scale" and key.granularity == "tensor":
            target = self.w2_scale[local] if is_down else self.w13_scale[local, half]
        elif role == "weight_scale":
            if key.granularity == "block":  # I_p is a multiple of the block (check_partition)
                rows = slice(rows.start // key.group[0], rows.stop // key.group[0])
            target = self.w2_scale[local] if is_down else self.w13_scale[local, rows]
        elif role == "weight_scale_2":
            target = self.w2_global_scale[local] if is_down else self.w13_global_scale[local, half]
        elif role == "weight_zero":  # laid as the group scales; the copy casts to their dtype (exact)
            target = self.w2_zero[local] if is_down else self.w13_zero[local, rows]
        else:
            target = self.a2_scale[local] if is_down else self.a13_scale[local, half]
        if target.dim() < part.dim():  # per-tensor [1] or [] and channel [N, 1] scales
            part = part.reshape(-1) if target.dim() else part.reshape(())
        with torch.no_grad():
            target.copy_(part)  # broadcasts a [1] channel scale; bf16 scales widen exactly
        self._loaded[local, _PROJECTIONS.index(kind), ROLES.index(role)] = True
        return True

    def load_fused_experts_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Load one of gpt-oss's per-layer MXFP4 tensors (`GPT_OSS_TENSORS`, all E experts):
        this rank's experts, de-interleaved to [gate; up] rows and TP-sliced."""
        if self._kernel is not None:
            raise RuntimeError(
                "weights were already processed for backend "
                f"{self.selection.name!r}; load every weight before process_weights_after_loading()"
            )
        c = self.config
        if not self.prequantized or c.quant.weight.dtype != "mxfp4":
            raise ValueError(
                f"{name}: gpt-oss MXFP4 tensors need quant='mxfp4_w4a16' (or 'mxfp4_w4a8'), "
                f"prequantized=True; this layer has quant={c.quant and c.quant.name!r}, "
                f"prequantized={self.prequantized}"
            )
        if not c.gated:
            raise ValueError(f"{name}: gpt-oss experts are gated, activation {c.activation!r} is not")
        if name.endswith("_bias") and not c.has_bias:
            raise ValueError(f"{name!r}: the layer was built with has_bias=False")
        part = gpt_oss_mxfp4_tensor(
            name, tensor, num_experts=self.num_logical_experts, hidden=c.hidden_size,
            intermediate=c.intermediate_size, tp_size=c.parallel.tp_size, tp_rank=c.parallel.tp_rank,
        )
        part = part[self.local_to_global.to(part.device)]
        gate_up = name.startswith("gate_up")
        kind = name.rsplit("_", 1)[1]
        prefix = "w13" if gate_up else "w2"
        target = getattr(self, {"blocks": f"{prefix}_weight", "scales": f"{prefix}_scale",
                                "bias": f"{prefix}_bias"}[kind])
        if kind == "bias" and not gate_up and c.parallel.tp_rank != 0:
            part = torch.zeros_like(part)  # counted once in the TP sum, as for per-expert biases
        with torch.no_grad():
            target.copy_(part)
        if kind != "bias":
            projs = [0, 1] if gate_up else [2]
            self._loaded[:, projs, ROLES.index("weight" if kind == "blocks" else "weight_scale")] = True

    def weight_loader(self, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int) -> bool:
        """vLLM-style entry: `shard_id` w1/w3/w2 (or gate/up/down); bias when the name ends in
        bias, a quantized tensor when it ends in one of its names (w13_weight_scale_inv, ...)."""
        names = (*TENSOR_ROLES, *COMPANION_TENSORS)
        # the longest name the weight's ends in (weight_g_idx, not g_idx)
        tensor = max((t for t in names if t != "weight" and weight_name.endswith(t)), key=len, default=None)
        if tensor is not None:
            shard = f"{shard_id}.{tensor}"
        else:
            shard = shard_id + ("_bias" if weight_name.endswith("bias") else "")
        return self.load_expert_weight(expert_id, shard, loaded_weight)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `...experts.{e}.{gate_proj,up_proj,down_proj,w1,w3,w2}.{weight,bias}` tensors,
        their quantized companions (`.weight_scale`, `.weight_scale_inv`, `.weight_scale_2`,
        `.input_scale`; compressed-tensors NVFP4: `.weight_packed`, `.weight_scale`,
        `.weight_global_scale`, `.input_global_scale`; compressed-tensors int4 pack-quantized:
        `.weight_packed`, `.weight_scale`, `.weight_shape`, asymmetric `.weight_zero_point`; GPTQ / AWQ
        int4: `.qweight`, `.scales`, `.qzeros`, `.g_idx`) and gpt-oss's fused
        `...experts.{gate_up_proj,down_proj}_{blocks,scales,bias}`.

        With `SharedExperts` attached, also `...shared_experts.*` / `...shared_expert.*` /
        `...shared_expert_gate.weight`. Returns the names consumed (those of experts on other EP
        ranks included); other names are left for the caller.
        """
        used = set()
        named_tensors = list(named_tensors)
        if isinstance(self.shared_experts, SharedExperts):
            used |= self.shared_experts.load_weights(named_tensors)
        for name, tensor in named_tensors:
            fused = _GPT_OSS_NAME.search(name)
            if fused is not None:
                self.load_fused_experts_weight(fused.group(1), tensor)
                used.add(name)
                continue
            m = _EXPERT_NAME.search(name)
            if m is None or m.group(2) not in SHARD_ALIASES:
                continue
            expert, proj, kind = int(m.group(1)), m.group(2), m.group(3)
            shard = {"weight": proj, "bias": f"{proj}_bias"}.get(kind, f"{proj}.{kind}")
            self.load_expert_weight(expert, shard, tensor)
            used.add(name)
        return used

    # Processing --------------------------------------------------------------------------------
    def process_weights_after_loading(self) -> Selection:
        """Choose the backend for these weights' device and re-lay the weights as it wants."""
        if self._kernel is not None:
            return self.selection
        c = self.config
        self._fill_replicas()
        self._check_all_loaded()
        platform = self.platform or Platform.for_device(self.w13_weight.device)
        self.selection = select_backend(c, platform)
        self._processed_device = self.w13_weight.device
        experts = self.selection.experts(c)
        if self.prequantized:
            self._fuse_prequantized()
        elif c.quant is not None:
            self._quantize()
        processed = experts.process_weights(self._expert_weights())
        with torch.no_grad():
            for name in ("w13", "w2"):
                new = getattr(processed, name)
                param = getattr(self, f"{name}_weight")
                if new is not param:
                    self._parameters[f"{name}_weight"] = nn.Parameter(new, requires_grad=False)
            if processed.quant is not self.quant_params:  # re-laid scales (Triton: int4 / nvfp4 group-major)
                for name in LAID_AS_SCALES:
                    if getattr(processed.quant, name) is not getattr(self.quant_params, name):
                        self.register_buffer(name, getattr(processed.quant, name))
                self.quant_params = processed.quant
        if self.groups is None:
            self._kernel = make_modular(c, experts)
        else:
            self._kernel = make_distributed(c, experts, self.groups, self.placement)
        return self.selection

    def _check_all_loaded(self) -> None:
        """Raise listing (expert, shard) pairs never loaded; where nothing was loaded at all into a
        full-precision layer (its parameters may have been written directly), those never written
        either (`_mark_unwritten`'s sentinels).

        Optional roles (NVFP4's input_scale) are all-or-nothing across the layer.
        """
        c = self.config
        required, optional = roles_of(c.quant) if self.prequantized else (("weight",), ())
        projs = [0, 1, 2] if c.gated else [1, 2]
        loaded = self._loaded[:, projs]
        if not loaded.any():
            if self.prequantized:  # its storage is only ever filled by loading
                raise RuntimeError("no checkpoint tensors were loaded into this pre-quantized layer")
            # full-precision parameters may have been written directly: unless they never were
            unwritten = self._never_written()
            if unwritten:
                raise RuntimeError(
                    f"FusedMoE weights were neither loaded nor written (expert, shard): {unwritten[:8]}"
                    f"{' ...' if len(unwritten) > 8 else ''} ({len(unwritten)} in all): load them "
                    "(load_weights, load_expert_weight, weight_loader) or write w13_weight / w2_weight "
                    "before process_weights_after_loading() or the first forward (the storage is "
                    "torch.empty: computing on it would return garbage)"
                )
            return
        roles = list(required) + [r for r in optional if loaded[..., ROLES.index(r)].any()]
        needed = loaded[..., [ROLES.index(r) for r in roles]]
        if needed.all():
            return
        names = [self._role_names.get(role, role) for role in roles]  # as the checkpoint says
        missing = [
            (int(self.local_to_global[e]),
             _PROJECTIONS[projs[p]] + ("" if names[r] == "weight" else f".{names[r]}"))
            for e, p, r in (~needed).nonzero().tolist()
        ]
        raise RuntimeError(f"checkpoint tensors never loaded (expert, shard): {missing[:8]}")

    def _fuse_prequantized(self) -> None:
        """Fuse w13's per-half values, then hand the buffers to QuantParams.

        fp8 per-tensor: requantize to max(s_gate, s_up); NVFP4: one global per expert, the
        max (`fusedmoe.quant.checkpoint`); input scales: max over the halves, as gate and up
        read one quantized x and the larger scale clips neither calibration.
        """
        scheme = self.config.quant
        with torch.no_grad():
            if scheme.weight.granularity == "tensor":
                q13, scale13 = fuse_fp8_tensor_scales(self.w13_weight, self.w13_scale)
                self._parameters["w13_weight"] = nn.Parameter(q13, requires_grad=False)
                self.register_buffer("w13_scale", scale13)
            if scheme.weight.dtype == "nvfp4":
                scale13, global13 = fuse_nvfp4_global_scales(self.w13_scale, self.w13_global_scale)
                self.register_buffer("w13_scale", scale13)
                self.register_buffer("w13_global_scale", global13)
            if hasattr(self, "a13_scale"):
                if self._loaded[..., ROLES.index("input_scale")].any():
                    self.register_buffer("a13_scale", self.a13_scale.amax(dim=1))
                else:  # NVFP4 without calibration: dynamic activation global scales
                    self.a13_scale = self.a2_scale = None
        self.quant_params = QuantParams(
            scheme, self.w13_scale, self.w2_scale, getattr(self, "a13_scale", None),
            getattr(self, "a2_scale", None), getattr(self, "w13_global_scale", None),
            getattr(self, "w2_global_scale", None), getattr(self, "w13_zero", None), getattr(self, "w2_zero", None),
        )

    def _quantize(self) -> None:
        """Online quantization: the loaded full-precision weights become the scheme's payload."""
        from fusedmoe.quant.weights import quantize_weights

        with torch.no_grad():
            q13, q2, params = quantize_weights(self.w13_weight, self.w2_weight, self.config.quant)
        self._parameters["w13_weight"] = nn.Parameter(q13, requires_grad=False)
        self._parameters["w2_weight"] = nn.Parameter(q2, requires_grad=False)
        for name in TENSOR_FIELDS:
            self.register_buffer(name, getattr(params, name))
        self.quant_params = params

    # Sentinels: weights never written ---------------------------------------------------------
    def _sentinels(self) -> list[tuple[str, str, int]]:
        """(parameter, shard, row) of each full-precision shard's sentinel: element [e, row, 0]."""
        c = self.config
        inter = c.intermediate_size_per_partition
        w13 = [("w13_weight", "gate", 0), ("w13_weight", "up", inter)] if c.gated else [("w13_weight", "up", 0)]
        return [*w13, ("w2_weight", "down", 0)]

    def _mark_unwritten(self) -> None:
        """NaN into one element of each expert's shard of the fresh (torch.empty) weights, so a
        layer whose weights were neither loaded nor assigned is told apart from one whose
        parameters were written directly (`param.data.copy_`, `load_state_dict`, `nn.init`): a
        write anywhere on the shard covers it. Checked once, when the weights are processed."""
        if self.w13_weight.is_meta or self.w13_weight.numel() == 0 or self.w2_weight.numel() == 0:
            return
        with torch.no_grad():
            for name, _, row in self._sentinels():
                getattr(self, name).data[:, row, 0] = float("nan")
        for name in ("w13_weight", "w2_weight"):  # a parameter assigned in its place is not checked
            getattr(self, name)._fusedmoe_sentinels = True

    def __deepcopy__(self, memo: dict) -> FusedMoE:
        """nn.Module's deep copy (its __dict__, memo-shared), keeping the sentinel marks, which
        nn.Parameter's own deep copy drops with every Python attribute: a copy of a never-written
        layer raises as the original does, and a copy of a written one computes."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        for name, param in self._parameters.items():
            if getattr(param, "_fusedmoe_sentinels", False) and new._parameters.get(name) is not None:
                new._parameters[name]._fusedmoe_sentinels = True
        return new

    def _never_written(self) -> list[tuple[int, str]]:
        """(global expert, shard) pairs whose sentinel is still NaN in a parameter that was not
        replaced since the layer made it (one small device-to-host read)."""
        found = []
        for name, shard, row in self._sentinels():
            param = getattr(self, name)
            if not getattr(param, "_fusedmoe_sentinels", False) or param.is_meta:
                continue
            with torch.no_grad():
                nan = torch.isnan(param.data[:, row, 0]).cpu()
            found += [(int(self.local_to_global[e]), shard) for e in nan.nonzero().flatten().tolist()]
        return sorted(found)

    def _expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias,
                             self.quant_params)

    # Forward -----------------------------------------------------------------------------------
    def route(self, hidden_states: torch.Tensor, router_logits: torch.Tensor):
        return select_experts(
            hidden_states, router_logits, self.config.top_k,
            e_score_correction_bias=self.e_score_correction_bias, **self.routing,
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [..., H], router_logits [..., E] -> [..., H]: the full output with a
        process group (every rank must call forward, with its own tokens, possibly none), else
        this rank's partial sum."""
        if self._kernel is None:
            self.process_weights_after_loading()
        elif self.w13_weight.device != self._processed_device:
            self._check_moved()
        if not _same_tokens(hidden_states, router_logits):
            raise ValueError(
                f"hidden_states {tuple(hidden_states.shape)} and router_logits {tuple(router_logits.shape)} "
                "must be [..., hidden] and [..., experts] with the same leading dimensions (or one of "
                "them flattened to [tokens, ...])"
            )
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = router_logits.reshape(-1, router_logits.shape[-1])
        if logits.shape[-1] != self.num_logical_experts:
            raise ValueError(
                f"router_logits have {logits.shape[-1]} experts, the layer has {self.num_logical_experts}"
            )
        if x.dtype != self.config.dtype:
            raise ValueError(f"hidden_states dtype {x.dtype} differs from the layer's {self.config.dtype}")
        topk_weights, topk_ids = self.route(x, logits)
        c = self.config
        if self.eplb is not None:  # logical ids -> physical slots, replicas in turn; count them
            topk_ids = to_physical(topk_ids, self.logical_to_physical_map, self.logical_replica_count,
                                   c.num_experts)
            record_load(self.expert_load_view, topk_ids)
        check_experts_inputs(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
            activation=c.activation, expert_map=self.expert_map, global_num_experts=c.num_experts,
            w13_bias=self.w13_bias, w2_bias=self.w2_bias,
            apply_router_weight_on_input=c.apply_router_weight_on_input, quantized=c.quant is not None,
            validate=False,
        )
        if x.shape[0] == 0 and self.groups is None:
            return hidden_states.new_empty(hidden_states.shape)

        def routed(inplace: bool = False) -> torch.Tensor:
            return self._kernel(x, self._expert_weights(), topk_weights, topk_ids,
                                expert_map_E=self.expert_map, inplace=inplace)

        if self.inplace and self.groups is None and (self.shared_experts is None or not self._adds_shared) \
                and unwritable(hidden_states) is None:  # else a new output (expanded, autograd, inference)
            out = routed(inplace=True)  # written into x, which views hidden_states when contiguous
            if not hidden_states.is_contiguous():  # reshape copied: write back (no data_ptr: compile-safe)
                hidden_states.copy_(out.view(hidden_states.shape))
            return hidden_states
        if self.shared_experts is None or not self._adds_shared:
            out = routed()
        else:
            out, shared = run_overlapped(self.shared_experts, x, routed)
            out = (out.float() + shared.float()).to(out.dtype)
        return out.reshape(*lead, out.shape[-1])

    def _check_moved(self) -> None:
        """The layer was moved (`.to()`, `.cuda()`) after its weights were processed: fine where
        the new device's platform selects the same backend (the weights are laid out for it),
        else an error: the layout and kernel chosen for the old device would run on the new one."""
        device = self.w13_weight.device
        platform = self.platform or Platform.for_device(device)
        try:
            name = select_backend(self.config, platform).name
            verdict = repr(name)
        except (BackendRequestError, NoBackendError) as exc:  # nothing (or not the requested backend) runs there
            name, verdict = None, f"no backend ({str(exc).splitlines()[0]})"
        if name != self.selection.name:
            raise RuntimeError(
                f"FusedMoE processed its weights on {self._processed_device} for backend "
                f"{self.selection.name!r}, but they are now on {device}, where the oracle selects "
                f"{verdict}: the weights are laid out for {self.selection.name!r}. Move the layer to the "
                "device it runs on before process_weights_after_loading() (or the first forward), "
                "or build it there."
            )
        self._processed_device = device

    @property
    def _adds_shared(self) -> bool:
        """With a group every rank's output is whole: each adds the shared MLP. Without one the
        caller sums partial outputs, so only one rank per token group adds it (as the down bias)."""
        p = self.config.parallel
        return self.groups is not None or (p.tp_rank == 0 and p.ep_rank % p.token_replicas == 0)

    def extra_repr(self) -> str:
        c = self.config
        backend = self.selection.name if self.selection else f"{c.backend} (not selected yet)"
        return (
            f"experts={self.num_logical_experts}"
            + (f" (+{c.num_experts - self.num_logical_experts} redundant)" if self.eplb else "")
            + f" (local {c.num_local_experts}), top_k={c.top_k}, "
            f"hidden={c.hidden_size}, intermediate={c.intermediate_size_per_partition}, "
            f"activation={c.activation}, dtype={c.dtype}, backend={backend}"
        )
