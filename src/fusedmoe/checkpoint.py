"""One MoE layer of a Hugging Face checkpoint directory, loaded without transformers.

    moe = fusedmoe.checkpoint.load_moe_layer("Qwen3-30B-A3B-GPTQ-Int4", layer=3, device="cuda")
    y = moe(x)                       # [T, H]: the router, then the routed (and shared) experts

`config.json` gives the sizes, the routing and, through its `quantization_config`, the experts'
scheme and how GPTQ / AWQ tensors are stored (`quant.scheme_from_config`,
`quant.checkpoint_format_from_config`); the layer's tensors are found through
`model.safetensors.index.json` (or the one `model.safetensors`) and only they are read
(`safetensors.safe_open`, the `hf` extra). The experts load through `FusedMoE.load_weights` (every
checkpoint format of `fusedmoe.quant.checkpoint`), the router into an fp32 `nn.Linear`. Families
by `model_type` (`FAMILIES`): Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V3 / Kimi-K2, gpt-oss.
Quantized shared experts (DeepSeek-V3 FP8's, a GPTQ / AWQ checkpoint's with their zero points) are
dequantized at load and run 16 / 32-bit, their activations unquantized; `shared=False` leaves them out. For a model already loaded in transformers,
`fusedmoe.hf.patch` is the route instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusedmoe.layer import FusedMoE
from fusedmoe.quant.checkpoint_config import checkpoint_format_from_config, scheme_from_config
from fusedmoe.shared import SharedExperts


@dataclass(frozen=True)
class CheckpointFamily:
    """Where a model_type keeps one MoE layer's pieces, and how it routes.

    block: the layer's MoE module under `model.layers.{L}.`; router: its router module (a Linear,
    weight [E, H], bias where `router_bias`). routing(config) -> FusedMoE routing keywords.
    shared(config) -> the shared experts' intermediate size (0: none); shared_gate: Qwen2-MoE's
    sigmoid gate on them. sparse(config, L): whether layer L is an MoE layer."""

    experts: str
    top_k: str
    intermediate: str
    block: str = "mlp"
    router: str = "gate"
    router_bias: bool = False
    routing: Callable[[Mapping], dict] = lambda c: {"renormalize": True}
    shared: Callable[[Mapping], int] = lambda c: 0
    shared_gate: bool = False
    sparse: Callable[[Mapping, int], bool] = lambda c, layer: True
    layer_kwargs: Callable[[Mapping], dict] = lambda c: {}


def _qwen_sparse(c: Mapping, layer: int) -> bool:
    step = c.get("decoder_sparse_step", 1) or 1
    return layer not in (c.get("mlp_only_layers") or []) and c.get("num_experts", 0) > 0 and (layer + 1) % step == 0


def _deepseek_routing(c: Mapping) -> dict:
    grouped = c.get("n_group") or 1
    return dict(scoring_func=c.get("scoring_func", "sigmoid"), renormalize=c.get("norm_topk_prob", True),
                use_grouped_topk=True, num_expert_group=grouped, topk_group=c.get("topk_group") or 1,
                routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                has_correction_bias=c.get("topk_method", "noaux_tc") == "noaux_tc")


_DEEPSEEK = CheckpointFamily(
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", routing=_deepseek_routing,
    shared=lambda c: (c.get("n_shared_experts") or 0) * c["moe_intermediate_size"],
    sparse=lambda c, layer: layer >= c.get("first_k_dense_replace", 0) and layer % (c.get("moe_layer_freq") or 1) == 0,
)
_QWEN = dict(experts="num_experts", top_k="num_experts_per_tok", intermediate="moe_intermediate_size",
             routing=lambda c: {"renormalize": bool(c.get("norm_topk_prob", False))}, sparse=_qwen_sparse)

FAMILIES: dict[str, CheckpointFamily] = {
    "mixtral": CheckpointFamily("num_local_experts", "num_experts_per_tok", "intermediate_size",
                                block="block_sparse_moe"),
    "qwen3_moe": CheckpointFamily(**_QWEN),
    "qwen2_moe": CheckpointFamily(**_QWEN, shared=lambda c: c.get("shared_expert_intermediate_size") or 0,
                                  shared_gate=True),
    "deepseek_v3": _DEEPSEEK,
    "kimi_k2": _DEEPSEEK,
    "gpt_oss": CheckpointFamily(
        "num_local_experts", "num_experts_per_tok", "intermediate_size", router="router", router_bias=True,
        layer_kwargs=lambda c: dict(activation="swigluoai", has_bias=True,
                                    swiglu_limit=float(c.get("swiglu_limit", 7.0)))),
}


class CheckpointMoE(nn.Module):
    """A checkpoint's MoE layer: `router` (fp32 Linear) -> `moe` (FusedMoE, its shared experts too)."""

    def __init__(self, router: nn.Linear, moe: FusedMoE, model_type: str, layer: int):
        super().__init__()
        self.router, self.moe, self.model_type, self.layer = router, moe, model_type, layer

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.moe(x_TH, self.router(x_TH.float()))


def load_moe_layer(path: str | Path, layer: int, *, device: torch.device | str | None = None,
                   params_dtype: torch.dtype = torch.bfloat16, shared: bool = True,
                   **moe_kwargs: Any) -> CheckpointMoE:
    """Layer `layer`'s MoE block of the checkpoint directory `path` (module docstring), weights
    processed for the backend the oracle picks on `device`. `moe_kwargs` go to FusedMoE (backend,
    parallel, ...)."""
    path = Path(path)
    config, text, model_type, fam = _config_and_family(path)
    layers = text.get("num_hidden_layers")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < (layers or layer + 1):
        raise ValueError(f"layer={layer!r} outside [0, {layers}) (num_hidden_layers)")
    if not fam.sparse(text, layer):
        raise ValueError(f"{path}: layer {layer} of {model_type} is a dense MLP, not an MoE layer")
    quantized = "quantization_config" in config
    scheme = scheme_from_config(config) if quantized else None
    fmt = checkpoint_format_from_config(config) if quantized else None
    prefix = f"model.layers.{layer}.{fam.block}."
    tensors = _read_layer(path, prefix)
    shared_inter = fam.shared(text) if shared else 0
    shared_module = None
    if shared_inter:
        shared_module = SharedExperts(text["hidden_size"], shared_inter, gate=fam.shared_gate,
                                      params_dtype=params_dtype, device=device)
        if scheme is not None and any(n.startswith(_SHARED) and not n.endswith(".weight") for n in tensors):
            # dequantized once here: the shared MLP runs 16 / 32-bit
            tensors = _dequantized_shared(tensors, scheme, fmt, text["hidden_size"], shared_inter)
    routing = fam.routing(text)
    moe = FusedMoE(text[fam.experts], text[fam.top_k], text["hidden_size"], text[fam.intermediate],
                   params_dtype=params_dtype, quant=scheme, prequantized=scheme is not None,
                   checkpoint_format=fmt, device=device, shared_experts=shared_module, **routing, **fam.layer_kwargs(text), **moe_kwargs)
    named = [(prefix + n, t) for n, t in tensors.items()]
    used = {n[len(prefix):] for n in moe.load_weights(named)}
    if routing.get("has_correction_bias"):
        bias = tensors.get(f"{fam.router}.e_score_correction_bias")
        if bias is None:
            raise ValueError(f"{path}: {prefix}{fam.router}.e_score_correction_bias is missing (topk_method noaux_tc)")
        with torch.no_grad():
            moe.e_score_correction_bias.copy_(bias.float())
        used.add(f"{fam.router}.e_score_correction_bias")
    weight = tensors.get(f"{fam.router}.weight")
    if weight is None:
        raise ValueError(f"{path}: the router weight {prefix}{fam.router}.weight is missing")
    router = nn.Linear(weight.shape[1], weight.shape[0], bias=fam.router_bias, device=device, dtype=torch.float32)
    with torch.no_grad():
        router.weight.copy_(weight.float())
        if fam.router_bias:
            router.bias.copy_(tensors[f"{fam.router}.bias"].float())
    used |= {f"{fam.router}.weight", f"{fam.router}.bias"}
    if shared_module is not None:  # SharedExperts holds uninitialised storage until each part loads
        parts = {*_PROJ, *(("gate",) if fam.shared_gate else ())}
        if shared_module._loaded != parts:
            raise ValueError(f"{path}: config.json gives layer {layer} shared experts (intermediate {shared_inter}) "
                             f"but its checkpoint holds {sorted(shared_module._loaded) or 'none'} of {sorted(parts)}")
    moe.process_weights_after_loading()
    left = sorted(n for n in tensors if n not in used and not (not shared and n.startswith("shared_expert")))
    if left:
        raise ValueError(f"{path}: layer {layer} tensors no part of the layer took: {left[:6]}")
    return CheckpointMoE(router, moe, model_type, layer)


_SHARED = ("shared_expert.", "shared_experts.")  # Qwen2-MoE, DeepSeek-V3 (shared_expert_gate stays 16-bit)
_PROJ = ("gate_proj", "up_proj", "down_proj")


def _dequantized_shared(tensors: dict, scheme, checkpoint_format: str | None, hidden: int, inter: int) -> dict:
    """`tensors` with the shared experts' quantized projections replaced by their float32
    `<prefix><proj>.weight`: each loaded, as stored, into a one-expert prequantized FusedMoE (the
    routed experts' loader and checks), then dequantized (`quant.dequantize_weights`, zero points
    included)."""
    from fusedmoe.quant.weights import dequantize_weights

    prefix = next(p for p in _SHARED if any(n.startswith(p) for n in tensors))
    one = FusedMoE(1, 1, hidden, inter, params_dtype=torch.float32, quant=scheme, prequantized=True,
                   checkpoint_format=checkpoint_format, backend="emulation")
    out = {}
    for name, tensor in tensors.items():
        proj = name[len(prefix):].split(".")[0] if name.startswith(prefix) else None
        if proj in _PROJ:
            one.load_expert_weight(0, name[len(prefix):], tensor)
        else:
            out[name] = tensor
    one.process_weights_after_loading()
    w13, w2 = dequantize_weights(one.w13_weight, one.w2_weight, one.quant_params)
    out |= {f"{prefix}gate_proj.weight": w13[0, :inter], f"{prefix}up_proj.weight": w13[0, inter:],
            f"{prefix}down_proj.weight": w2[0]}
    return out


def _config_and_family(path: Path) -> tuple[dict, Mapping, str, CheckpointFamily]:
    """(config.json, its text config, model_type, FAMILIES' record of it), or ValueError."""
    config = _read_json(path / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    model_type = text.get("model_type") or config.get("model_type")
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(f"{path}: model_type {model_type!r} is not one load_moe_layer reads "
                         f"({', '.join(sorted(FAMILIES))}); a model loaded in transformers: fusedmoe.hf.patch")
    return config, text, model_type, fam


def first_moe_layer(path: str | Path) -> int:
    """The first layer of the checkpoint directory `path` that is an MoE layer."""
    path = Path(path)
    _, text, _, fam = _config_and_family(path)
    layers = text.get("num_hidden_layers") or 0
    found = next((layer for layer in range(layers) if fam.sparse(text, layer)), None)
    if found is None:
        raise ValueError(f"{path}: no MoE layer of a known family in config.json (model_type "
                         f"{text.get('model_type')!r}, {layers} layers)")
    return found


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read_layer(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """{name after prefix: tensor} of every checkpoint tensor under `prefix`, read from its shard."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, file in _read_json(index)["weight_map"].items():
            if name.startswith(prefix):
                files.setdefault(file, []).append(name)
    elif (path / "model.safetensors").is_file():
        files = {"model.safetensors": None}
    else:
        raise ValueError(f"{path}: neither model.safetensors.index.json nor model.safetensors")
    tensors = {}
    for file, names in files.items():
        with safe_open(str(path / file), framework="pt", device="cpu") as f:
            for name in names if names is not None else [n for n in f.keys() if n.startswith(prefix)]:  # noqa: SIM118 (safe_open has keys(), no __iter__)
                tensors[name[len(prefix):]] = f.get_tensor(name)
    if not tensors:
        raise ValueError(f"{path}: no tensor under {prefix!r}")
    return tensors
