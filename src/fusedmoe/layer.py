"""`FusedMoE`: the MoE layer as a torch.nn.Module.

    create weights -> load per-expert checkpoint tensors -> process_weights_after_loading()
    -> forward(hidden_states, router_logits) = experts(route(router_logits))

Parameters follow the seeds' `create_weights`: `w13_weight` [L, 2I/tp, H] (gate rows first, then
up; [L, I/tp, H] for non-gated activations), `w2_weight` [L, H, I/tp], optional `w13_bias`
[L, G], `w2_bias` [L, H]. L = num_experts / ep_size local experts; TP shards the intermediate.
With TP > 1 the output is this rank's partial sum (the caller all-reduces), and the down
projection's bias is added on tp_rank 0 only so that the sum counts it once.
With `quant=<scheme>` the layer loads full-precision checkpoints and quantizes them in
`process_weights_after_loading` (online quantization; scales become buffers `w13_scale`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from fusedmoe.activations import SWIGLUOAI_ALPHA
from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.modular import ExpertWeights, ModularMoE, make_modular
from fusedmoe.oracle import Selection, select_backend
from fusedmoe.platform import Platform
from fusedmoe.routing import CustomRouting, select_experts
from fusedmoe.validation import check_experts_inputs

# Checkpoint names of the three projections (HF/Qwen/DeepSeek style and Mixtral style).
SHARD_ALIASES = {
    "gate_proj": "gate", "w1": "gate", "gate": "gate",
    "up_proj": "up", "w3": "up", "up": "up",
    "down_proj": "down", "w2": "down", "down": "down",
}
_EXPERT_NAME = re.compile(r"(?:^|\.)experts\.(\d+)\.(\w+)\.(weight|bias)$")


def expert_placement(num_experts: int, parallel: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert_map [E] int32: global -> local or -1, local_to_global [L] int64) for this EP rank.

    linear: rank r owns experts [r*L, (r+1)*L); round_robin: expert g lives on rank g % ep_size.
    """
    ep, rank = parallel.ep_size, parallel.ep_rank
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep}")
    local = num_experts // ep
    if parallel.placement == "linear":
        local_to_global = torch.arange(rank * local, (rank + 1) * local)
    else:
        local_to_global = torch.arange(rank, num_experts, ep)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[local_to_global] = torch.arange(local, dtype=torch.int32)
    return expert_map, local_to_global


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
        has_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        custom_routing_function: CustomRouting | None = None,
        apply_router_weight_on_input: bool = False,
        swiglu_alpha: float = SWIGLUOAI_ALPHA,
        swiglu_limit: float | None = None,
        quant=None,
        parallel: ParallelConfig | None = None,
        backend: str = "auto",
        activation_format: str = "standard",
        device: torch.device | str | None = None,
        platform: Platform | None = None,
    ):
        super().__init__()
        params_dtype = params_dtype or torch.get_default_dtype()
        parallel = parallel or ParallelConfig()
        if use_grouped_topk:
            routing_method = "grouped_topk"
        elif custom_routing_function is not None:
            routing_method = "custom"
        elif apply_router_weight_on_input and scoring_func == "sigmoid":
            routing_method = "llama4"
        else:
            routing_method = f"{scoring_func}_topk"
        self.config = MoEConfig(
            num_experts, top_k, hidden_size, intermediate_size,
            dtype=params_dtype, activation=activation, has_bias=has_bias, quant=quant,
            parallel=parallel, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
            activation_format=activation_format, backend=backend,
            apply_router_weight_on_input=apply_router_weight_on_input,
            routing_method=routing_method, routed_scaling_factor=routed_scaling_factor,
        )
        if self.config.quant is not None and self.config.quant.activation is not None \
                and not self.config.quant.activation.dynamic and self.config.quant.family == "fp8":
            raise NotImplementedError(
                f"FusedMoE(quant={self.config.quant.name!r}) quantizes full-precision checkpoints "
                "at load time, and static activation scales need calibration data; loading "
                "pre-quantized checkpoints is not in this release"
            )
        self.quant_params = None
        self.routing = dict(
            renormalize=renormalize, scoring_func=scoring_func, use_grouped_topk=use_grouped_topk,
            num_expert_group=num_expert_group, topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            custom_routing_function=custom_routing_function,
        )
        self.platform = platform
        self.top_k = top_k
        c = self.config
        num_local, inter = c.num_local_experts, c.intermediate_size_per_partition
        rows = 2 * inter if c.gated else inter
        factory = dict(dtype=params_dtype, device=device)
        self.w13_weight = nn.Parameter(torch.empty(num_local, rows, hidden_size, **factory), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_local, hidden_size, inter, **factory), requires_grad=False)
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
        expert_map, local_to_global = expert_placement(num_experts, parallel)
        self.register_buffer("local_to_global", local_to_global.to(device), persistent=False)
        self.register_buffer(
            "expert_map", expert_map.to(device) if parallel.use_ep else None, persistent=False
        )
        self._global_to_local = {int(g): i for i, g in enumerate(local_to_global.tolist())}
        self._loaded = torch.zeros(num_local, 3, dtype=torch.bool)  # gate, up, down
        self.selection: Selection | None = None
        self._kernel: ModularMoE | None = None

    # Loading -----------------------------------------------------------------------------------
    def load_expert_weight(self, expert_id: int, shard: str, tensor: torch.Tensor) -> bool:
        """Load one checkpoint tensor of global expert `expert_id`; False if not on this rank.

        shard: gate/up/down (aliases gate_proj, up_proj, down_proj, w1, w3, w2) for the weight,
        or the same with a "_bias" suffix. Full (unsharded) tensors: gate/up [I, H], down [H, I],
        gate/up bias [I], down bias [H]; this rank's TP slice is taken here.
        """
        if self._kernel is not None:
            raise RuntimeError(
                "weights were already processed for backend "
                f"{self.selection.name!r}; load every weight before process_weights_after_loading()"
            )
        is_bias = shard.endswith("_bias")
        kind = SHARD_ALIASES.get(shard[: -len("_bias")] if is_bias else shard)
        if kind is None:
            raise ValueError(f"unknown shard {shard!r}; expected one of {sorted(SHARD_ALIASES)}")
        c = self.config
        if not 0 <= expert_id < c.num_experts:
            raise ValueError(f"expert_id={expert_id} outside [0, {c.num_experts})")
        if kind == "gate" and not c.gated:
            raise ValueError(f"activation {c.activation!r} is not gated: its experts have no gate projection")
        if is_bias and not c.has_bias:
            raise ValueError(f"{shard!r}: the layer was built with has_bias=False")
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
            self._loaded[local, ("gate", "up", "down").index(kind)] = True
        return True

    def weight_loader(self, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int) -> bool:
        """vLLM-style entry: `shard_id` w1/w3/w2 (or gate/up/down); bias when the name ends in bias."""
        shard = shard_id + ("_bias" if weight_name.endswith("bias") else "")
        return self.load_expert_weight(expert_id, shard, loaded_weight)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `...experts.{e}.{gate_proj,up_proj,down_proj,w1,w3,w2}.{weight,bias}` tensors.

        Returns the names consumed (those of experts on other EP ranks included); other names
        are left for the caller.
        """
        used = set()
        for name, tensor in named_tensors:
            m = _EXPERT_NAME.search(name)
            if m is None or m.group(2) not in SHARD_ALIASES:
                continue
            expert, proj, kind = int(m.group(1)), m.group(2), m.group(3)
            self.load_expert_weight(expert, proj + ("_bias" if kind == "bias" else ""), tensor)
            used.add(name)
        return used

    # Processing --------------------------------------------------------------------------------
    def process_weights_after_loading(self) -> Selection:
        """Choose the backend for these weights' device and re-lay the weights as it wants."""
        if self._kernel is not None:
            return self.selection
        c = self.config
        needed = self._loaded if c.gated else self._loaded[:, 1:]
        if self._loaded.any() and not needed.all():
            missing = [
                (int(self.local_to_global[e]), ("gate", "up", "down")[s + (0 if c.gated else 1)])
                for e, s in (~needed).nonzero().tolist()
            ]
            raise RuntimeError(f"checkpoint tensors never loaded (expert, shard): {missing[:8]}")
        platform = self.platform or Platform.for_device(self.w13_weight.device)
        self.selection = select_backend(c, platform)
        experts = self.selection.experts(c)
        if c.quant is not None:
            self._quantize()
        processed = experts.process_weights(self._expert_weights())
        with torch.no_grad():
            for name in ("w13", "w2"):
                new = getattr(processed, name)
                param = getattr(self, f"{name}_weight")
                if new is not param:
                    self._parameters[f"{name}_weight"] = nn.Parameter(new, requires_grad=False)
        self._kernel = make_modular(c, experts)
        return self.selection

    def _quantize(self) -> None:
        """Online quantization: the loaded full-precision weights become the scheme's payload."""
        from fusedmoe.quant.weights import quantize_weights

        with torch.no_grad():
            q13, q2, params = quantize_weights(self.w13_weight, self.w2_weight, self.config.quant)
        self._parameters["w13_weight"] = nn.Parameter(q13, requires_grad=False)
        self._parameters["w2_weight"] = nn.Parameter(q2, requires_grad=False)
        for name in ("w13_scale", "w2_scale", "a13_scale", "a2_scale", "w13_global_scale",
                     "w2_global_scale"):
            self.register_buffer(f"{name}", getattr(params, name))
        self.quant_params = params

    def _expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias,
                             self.quant_params)

    # Forward -----------------------------------------------------------------------------------
    def route(self, hidden_states: torch.Tensor, router_logits: torch.Tensor):
        return select_experts(
            hidden_states, router_logits, self.top_k,
            e_score_correction_bias=self.e_score_correction_bias, **self.routing,
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [..., H], router_logits [..., E] -> [..., H] (this rank's partial sum)."""
        if self._kernel is None:
            self.process_weights_after_loading()
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = router_logits.reshape(-1, router_logits.shape[-1])
        if logits.shape[-1] != self.config.num_experts:
            raise ValueError(
                f"router_logits have {logits.shape[-1]} experts, the layer has {self.config.num_experts}"
            )
        if x.dtype != self.config.dtype:
            raise ValueError(f"hidden_states dtype {x.dtype} differs from the layer's {self.config.dtype}")
        topk_weights, topk_ids = self.route(x, logits)
        c = self.config
        check_experts_inputs(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
            activation=c.activation, expert_map=self.expert_map, global_num_experts=c.num_experts,
            w13_bias=self.w13_bias, w2_bias=self.w2_bias,
            apply_router_weight_on_input=c.apply_router_weight_on_input, quantized=c.quant is not None,
            validate=False,
        )
        if x.shape[0] == 0:
            return hidden_states.new_empty(hidden_states.shape)
        out = self._kernel(x, self._expert_weights(), topk_weights, topk_ids, expert_map_E=self.expert_map)
        return out.reshape(*lead, out.shape[-1])

    def extra_repr(self) -> str:
        c = self.config
        backend = self.selection.name if self.selection else f"{c.backend} (not selected yet)"
        return (
            f"experts={c.num_experts} (local {c.num_local_experts}), top_k={c.top_k}, "
            f"hidden={c.hidden_size}, intermediate={c.intermediate_size_per_partition}, "
            f"activation={c.activation}, dtype={c.dtype}, backend={backend}"
        )
