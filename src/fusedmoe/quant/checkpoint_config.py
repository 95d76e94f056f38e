"""Which fusedmoe scheme a pre-quantized checkpoint's experts are in, from its Hugging Face config.

    scheme_from_config(config) -> "fp8_w8a8_block", "int4_w4a16_g32", ...
    checkpoint_format_from_config(config) -> "gptq" | "gptq_v2" | "awq" | None

`config` is a model's `config.json` (its `quantization_config` is read), that `quantization_config`
alone, or ModelOpt's `hf_quant_config.json`. The answer is the `quant=` of
`FusedMoE(..., quant=..., prequantized=True)`, whose loader then takes the checkpoint's expert
tensors (`fusedmoe.quant.checkpoint`); the second is its `checkpoint_format=`, how GPTQ's / AWQ's
tensors are stored (what they cannot tell themselves). Formats, by `quant_method`:

    fp8                 weight_block_size [128, 128] -> fp8_w8a8_block (dynamic activations);
                        none -> fp8_w8a8_tensor (dynamic) / fp8_w8a8_tensor_static (static)
    mxfp4               gpt-oss -> mxfp4_w4a16 (bf16 activations)
    gptq                bits 4, no desc_act (or with static_groups) -> int4_w4a16_g{group_size}
                        (32, 64, 128), sym=false -> int4_w4a16_g{group_size}_zp; checkpoint_format
                        "gptq" (v1, the default: zero points stored z - 1) or "gptq_v2" (z)
    awq                 bits 4, zero_point true, version gemm (AutoAWQ GEMM) -> int4_w4a16_g{group_size}_zp
    modelopt            quant_algo NVFP4 -> nvfp4; FP8 -> fp8_w8a8_tensor_static
    compressed-tensors  each config group's weights / input_activations as (weight key,
                        activation key) of `quant.scheme`, matched against SCHEMES: fp8 block /
                        channel / tensor, int8 W8A8 and W8A16, int4 pack-quantized (W4A16; symmetric=false:
                        the *_zp scheme), nvfp4 (W4A4 or W4A16), mxfp4 (W4A16)

A configuration fusedmoe cannot run raises ValueError naming the field that decides it
(zero points outside int4 groups, act-order, an AWQ kernel layout other than GEMM, a block or group
size without a scheme, several schemes at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusedmoe.quant.scheme import SCHEMES, QuantKey

INT4_GROUPS = (32, 64, 128)
GPTQ_FORMATS = ("gptq", "gptq_v2")  # GPTQModel's checkpoint_format values whose tensors fusedmoe reads


def scheme_from_config(config: Mapping[str, Any]) -> str:
    """The fusedmoe scheme name of a checkpoint's experts (module docstring), or ValueError."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (a parsed config.json), got {type(config).__name__}")
    if isinstance(config.get("quantization_config"), Mapping):  # a model's config.json
        config = config["quantization_config"]
    elif isinstance(config.get("quantization"), Mapping):  # ModelOpt's hf_quant_config.json
        return _modelopt({**config["quantization"], "quant_method": "modelopt"})
    method = config.get("quant_method")
    if method is None:
        raise ValueError("no quant_method in the config (nor a quantization_config holding one): an unquantized "
                         "checkpoint needs no scheme")
    readers = {"fp8": _fp8, "mxfp4": _mxfp4, "gptq": _gptq, "modelopt": _modelopt,
               "compressed-tensors": _compressed_tensors, "awq": _awq}
    reader = readers.get(str(method).lower())
    if reader is None:
        raise ValueError(f"quant_method {method!r} is not a format fusedmoe loads ({', '.join(sorted(readers))})")
    return reader(config)


def checkpoint_format_from_config(config: Mapping[str, Any]) -> str | None:
    """FusedMoE's `checkpoint_format` for a checkpoint's experts: GPTQ's checkpoint_format ("gptq",
    the v1 default, or "gptq_v2"), "awq" for AWQ, None for every other format (its tensors' names
    say how they are stored). The config is checked as `scheme_from_config` checks it."""
    scheme_from_config(config)
    if isinstance(config.get("quantization_config"), Mapping):
        config = config["quantization_config"]
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        return config.get("checkpoint_format") or "gptq"
    return "awq" if method == "awq" else None


def _fp8(c: Mapping) -> str:
    block = c.get("weight_block_size")
    dynamic = c.get("activation_scheme", "dynamic") == "dynamic"
    if block is None:
        return "fp8_w8a8_tensor" if dynamic else "fp8_w8a8_tensor_static"
    if list(block) != [128, 128]:
        raise ValueError(f"fp8: weight_block_size={list(block)}: fusedmoe's block scheme has 128x128 blocks")
    if not dynamic:
        raise ValueError(f"fp8: activation_scheme={c.get('activation_scheme')!r} with weight blocks: the block "
                         "scheme quantizes activations dynamically (1x128 groups)")
    return "fp8_w8a8_block"


def _mxfp4(c: Mapping) -> str:
    return "mxfp4_w4a16"


def _gptq(c: Mapping) -> str:
    bits, group = c.get("bits"), c.get("group_size")
    if bits != 4:
        raise ValueError(f"gptq: bits={bits}: fusedmoe loads 4-bit GPTQ (int4_w4a16_g*)")
    fmt = c.get("checkpoint_format") or "gptq"
    if fmt not in GPTQ_FORMATS:  # marlin, bitblas, ...: tensors re-laid for one kernel
        raise ValueError(f"gptq: checkpoint_format={fmt!r}: fusedmoe reads GPTQ's own layouts {GPTQ_FORMATS}")
    if c.get("desc_act", False) and not c.get("static_groups", False):
        # with static groups the groups stay in column order (g_idx = k // g; the loader checks it)
        raise ValueError("gptq: desc_act=true without static_groups (act-order: groups of permuted input "
                         "columns) is not run by fusedmoe")
    if group not in INT4_GROUPS:
        raise ValueError(f"gptq: group_size={group}: fusedmoe's int4 schemes have groups of {INT4_GROUPS}")
    # sym=false: a zero point per group (qzeros), the asymmetric twin
    return f"int4_w4a16_g{group}" + ("" if c.get("sym", True) is True else "_zp")


def _modelopt(c: Mapping) -> str:
    algo = str(c.get("quant_algo", "")).upper()
    if algo == "NVFP4":
        group = c.get("group_size", 16)
        if group != 16:
            raise ValueError(f"modelopt NVFP4: group_size={group}: NVFP4 scales 16 inputs")
        return "nvfp4"
    if algo == "FP8":
        return "fp8_w8a8_tensor_static"
    raise ValueError(f"modelopt: quant_algo={c.get('quant_algo')!r}: fusedmoe loads ModelOpt NVFP4 and FP8")


def _awq(c: Mapping) -> str:
    """AutoAWQ's GEMM layout (transformers' AwqConfig defaults: version gemm, zero_point true)."""
    bits, group = c.get("bits", c.get("w_bit")), c.get("group_size", c.get("q_group_size"))
    version = str(c.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"awq: bits={bits}: fusedmoe loads 4-bit AWQ (int4_w4a16_g*_zp)")
    if version != "gemm":  # gemv / gemv_fast / marlin / exllama / ipex: tensors re-laid for one kernel
        raise ValueError(f"awq: version={c.get('version')!r}: fusedmoe reads AWQ's GEMM layout (qweight [K, N/8])")
    if c.get("zero_point", True) is not True:
        raise ValueError("awq: zero_point=false (no qzeros): fusedmoe loads AWQ with its zero points "
                         "(int4_w4a16_g*_zp)")
    if group not in INT4_GROUPS:
        raise ValueError(f"awq: group_size={group}: fusedmoe's int4 schemes have groups of {INT4_GROUPS}")
    return f"int4_w4a16_g{group}_zp"


def _compressed_tensors(c: Mapping) -> str:
    groups = c.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("compressed-tensors: no config_groups")
    found = {}
    for name, group in groups.items():
        where = f"compressed-tensors config group {name!r}"
        weights, inputs = group.get("weights"), group.get("input_activations")
        if not isinstance(weights, Mapping):
            raise ValueError(f"{where}: no weights")
        if group.get("output_activations"):
            raise ValueError(f"{where}: output_activations are quantized, which fusedmoe does not run")
        weight_key = _ct_key(where + " weights", weights, weight=True)
        act_key = None if inputs is None else _ct_key(where + " input_activations", inputs, weight=False)
        if weight_key.dtype == "int4" and weights.get("actorder") not in (None, False, "none"):
            raise ValueError(f"{where}: weights actorder={weights.get('actorder')!r} (act-order) is not run by fusedmoe")
        match = [s.name for s in SCHEMES.values() if s.weight == weight_key and s.activation == act_key]
        if not match:
            raise ValueError(f"{where}: weights {weight_key} with activations {act_key or 'unquantized'}: fusedmoe "
                             "has no such scheme")
        found[name] = match[0]
    if len(set(found.values())) > 1:
        raise ValueError(f"compressed-tensors: config groups of different schemes {found}: pick the experts' "
                         "group's scheme by hand")
    return next(iter(found.values()))


def _ct_key(where: str, args: Mapping, *, weight: bool) -> QuantKey:
    """One compressed-tensors QuantizationArgs as the QuantKey `quant.scheme` names it."""
    kind, bits, strategy = args.get("type"), args.get("num_bits"), args.get("strategy")
    symmetric = args.get("symmetric", True) is True
    if not symmetric and not (weight and kind == "int" and bits == 4 and strategy == "group"):
        raise ValueError(f"{where}: symmetric=false (zero points) with type={kind!r} num_bits={bits!r} "
                         f"strategy={strategy!r}: fusedmoe runs zero points with int4 group weights only "
                         "(int4_w4a16_g*_zp)")
    if kind == "float" and bits == 8:
        dtype = "fp8"
    elif kind == "int" and bits in (8, 4):
        dtype = "int8" if bits == 8 else "int4"
    elif kind == "float" and bits == 4 and strategy == "tensor_group" and args.get("group_size") == 16:
        dtype = "nvfp4"
    elif kind == "float" and bits == 4 and strategy == "group" and args.get("group_size") == 32:
        return QuantKey("mxfp4", "group", 32)  # mxfp4-pack-quantized: e8m0 scales per 32
    else:
        raise ValueError(f"{where}: type={kind!r} num_bits={bits!r} strategy={strategy!r}: no fusedmoe format")
    dynamic = args.get("dynamic", False)
    if dtype == "nvfp4":  # a global scale per tensor (weights: stored; activations: stored or computed)
        return QuantKey("nvfp4", "group", 16, dynamic=not weight)
    if weight and dynamic:
        raise ValueError(f"{where}: dynamic weight scales")
    if strategy == "block":
        block = args.get("block_structure")
        if block is None or list(block) != [128, 128]:
            raise ValueError(f"{where}: block_structure={block}: fusedmoe's block scheme has 128x128 blocks")
        return QuantKey(dtype, "block", (128, 128))
    if strategy == "group":
        return QuantKey(dtype, "group", args.get("group_size"), dynamic=bool(dynamic) and not weight,
                        symmetric=symmetric)
    if strategy in ("tensor", "channel", "token"):
        return QuantKey(dtype, strategy, dynamic=bool(dynamic) and not weight)
    raise ValueError(f"{where}: strategy={strategy!r} has no fusedmoe scale layout")
