"""Small random-initialised transformers models of each family (tests, `fusedmoe demo --hf`).

    build(family, scale=1) -> model of the family's `tiny` config (hidden, intermediate x scale)

transformers initialises weights with std 0.02, which leaves a tiny model's logits nearly blind to
its MoE blocks; the MoE tensors (router, experts, shared experts, correction biases) are redrawn
here with std 0.3 * sqrt(64 / hidden) (matrices) and 0.5 (vectors), so that a wrong expert or
routing weight shows in the logits. A hash router's token -> experts table (DeepSeek-V4) gets K
distinct random experts per token.
"""

from __future__ import annotations

import torch

from fusedmoe.hf.families import Family, family, hash_table_of, router_linear
from fusedmoe.hf.patch import block_family

# Config keys that are sizes, scaled by `scale` (head counts stay fixed).
_SIZES = ("hidden_size", "d_model", "intermediate_size", "moe_intermediate_size",
          "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
          "intermediate_size_mlp", "shared_intermediate_size", "ffn_hidden_size", "head_dim",
          "linear_key_head_dim", "linear_value_head_dim", "kv_lora_rank", "q_lora_rank",
          "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_head_dim", "indexer_head_dim",
          "out_hidden_size", "mrope_section")


def tiny_config(fam: Family | str, *, scale: int = 1, **overrides):
    """The family's config class on its `tiny` keyword arguments, sizes multiplied by `scale`;
    an override that is a dict updates the tiny dict under its key (a multimodal family's
    `text_config`), any other replaces the value."""
    import transformers

    fam = family(fam) if isinstance(fam, str) else fam
    if not fam.config:
        raise ValueError(f"{fam.name} has no small config (it is listed as refused: {fam.refused})")

    def scaled(kwargs: dict) -> dict:
        out = {}
        for key, value in kwargs.items():
            if isinstance(value, dict):
                out[key] = scaled(value)
            elif key in _SIZES and isinstance(value, list):  # mrope_section: parts of head_dim / 2
                out[key] = [v * scale for v in value]
            elif key in _SIZES and value is not None:
                out[key] = value * scale
            else:
                out[key] = value
        return out

    def merged(base: dict, extra: dict) -> dict:
        out = dict(base)
        for key, value in extra.items():
            out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    kwargs = merged(scaled(dict(fam.tiny)), overrides)
    return getattr(transformers, fam.config)(**kwargs)


def build(fam: Family | str, *, scale: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu", **overrides) -> torch.nn.Module:
    """A causal LM of the family in eval mode, MoE tensors redrawn so that they matter."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(fam, scale=scale, **overrides)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError:  # a multimodal family whose MoE is in its text model (Qwen3-VL-MoE): text-only input
        try:
            model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        except ValueError:
            name = fam if isinstance(fam, str) else fam.model_type
            raise ValueError(
                f"{name}: transformers has no causal-LM or image-text-to-text model for "
                f"{type(config).__name__}, so no model runs it from token ids: its blocks are patched "
                "inside the whole model that runs them (Qwen3-Omni-MoE's talker, which generates from "
                "the thinker's hidden states, inside Qwen3-Omni-MoE)") from None
    redraw_moe(model, seed=seed + 1)
    return model.to(device=device, dtype=dtype).eval()


def redraw_moe(model: torch.nn.Module, *, seed: int) -> torch.nn.Module:
    """The tensors of the model's MoE blocks redrawn in place (std as the module docstring says)."""
    generator = torch.Generator().manual_seed(seed)
    matrix_std = 0.3 * (64 / model.config.get_text_config().hidden_size) ** 0.5
    with torch.no_grad():
        for module in model.modules():
            fam = block_family(module)
            if fam is None:
                continue
            for tensor in list(module.parameters()) + list(module.buffers()):
                if tensor.is_floating_point():
                    std = matrix_std if tensor.dim() > 1 else 0.5
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
            router = getattr(module, fam.router)
            table = hash_table_of(fam, router)
            if table is not None:  # each token's K distinct experts, at random (transformers' init: all 0)
                experts = router_linear(fam, router).weight.shape[0]
                picks = torch.rand(table.shape[0], experts, generator=generator).argsort(dim=-1)
                table.copy_(picks[:, : table.shape[1]])
    return model
