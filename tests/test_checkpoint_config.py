"""fusedmoe.quant.checkpoint_config.scheme_from_config on the quantization configs of real checkpoint
formats (as their config.json / hf_quant_config.json write them), and its refusals."""

from __future__ import annotations

import pytest

from fusedmoe.quant.checkpoint_config import checkpoint_format_from_config, scheme_from_config


def _ct(weights: dict, inputs: dict | None = None, fmt: str = "pack-quantized", **group) -> dict:
    """A compressed-tensors quantization_config with one config group over Linear layers."""
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          **group}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


INT4_G32 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False, "actorder": None}
FP8_BLOCK = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128],
             "dynamic": False}
FP8_GROUP_INPUT = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128,
                   "dynamic": True}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
FP8_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
         "dynamic": False}
NVFP4_INPUT = dict(NVFP4, dynamic="local")

CONFIGS = {
    # DeepSeek-V3 / Qwen3-FP8: the config.json's quantization_config
    "deepseek_fp8": ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}}, "fp8_w8a8_block"),
    "mistral_fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
                           "fp8_w8a8_tensor_static"),
    "fp8_tensor_dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8_w8a8_tensor"),
    "gpt_oss": ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}},
                "mxfp4_w4a16"),
    "qwen3_gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                    "checkpoint_format": "gptq"}, "int4_w4a16_g128"),
    "gptq_static_groups": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                            "static_groups": True, "sym": True}, "int4_w4a16_g32"),
    "gptq_v2_g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True,
                     "checkpoint_format": "gptq_v2"}, "int4_w4a16_g64"),
    "gptq_asymmetric": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
                        "int4_w4a16_g32_zp"),
    "gptq_v2_asymmetric_g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False,
                                "checkpoint_format": "gptq_v2"}, "int4_w4a16_g64_zp"),
    # transformers' AwqConfig as config.json writes it (Qwen / Mixtral AWQ checkpoints)
    "awq_gemm": ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                          "version": "gemm", "modules_to_not_convert": None}}, "int4_w4a16_g64_zp"),
    "awq_autoawq_upper_case": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                "version": "GEMM"}, "int4_w4a16_g128_zp"),
    "modelopt_nvfp4": ({"producer": {"name": "modelopt", "version": "0.29"},
                        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}},
                       "nvfp4"),
    "modelopt_fp8_config_json": ({"quant_method": "modelopt", "quant_algo": "FP8"}, "fp8_w8a8_tensor_static"),
    "kimi_k2_int4": (_ct(INT4_G32), "int4_w4a16_g32"),
    "ct_int4_asymmetric": (_ct(dict(INT4_G32, symmetric=False)), "int4_w4a16_g32_zp"),
    "ct_fp8_block": (_ct(FP8_BLOCK, FP8_GROUP_INPUT, "float-quantized"), "fp8_w8a8_block"),
    "ct_fp8_dynamic": (_ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized"), "fp8_w8a8_channel"),
    "ct_fp8_static": (_ct(FP8_TENSOR, FP8_TENSOR, "float-quantized"), "fp8_w8a8_tensor_static"),
    "ct_fp8_w8a16": (_ct(FP8_CHANNEL, None, "float-quantized"), "fp8_w8a16"),
    "ct_int8_w8a8": (_ct(INT8_CHANNEL, INT8_TOKEN, "int-quantized"), "int8_w8a8"),
    "ct_int8_w8a16": (_ct(INT8_CHANNEL, None, "pack-quantized"), "int8_w8a16"),
    "ct_nvfp4": (_ct(NVFP4, NVFP4_INPUT, "nvfp4-pack-quantized"), "nvfp4"),
    "ct_nvfp4_w4a16": (_ct(NVFP4, None, "nvfp4-pack-quantized"), "nvfp4_w4a16"),
    "ct_mxfp4": (_ct({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                      "dynamic": False}, None, "mxfp4-pack-quantized"), "mxfp4_w4a16"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_scheme_of_each_format(name):
    config, scheme = CONFIGS[name]
    assert scheme_from_config(config) == scheme


REFUSED = {
    "awq_gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
                 r"awq: version='gemv': fusedmoe reads AWQ's GEMM layout"),
    "awq_no_zero_point": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
                          r"awq: zero_point=false \(no qzeros\)"),
    "awq_3bit": ({"quant_method": "awq", "bits": 3, "group_size": 128}, r"awq: bits=3: fusedmoe loads 4-bit AWQ"),
    "awq_g256": ({"quant_method": "awq", "bits": 4, "group_size": 256}, r"awq: group_size=256: fusedmoe's int4"),
    "gptq_act_order": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
                       r"gptq: desc_act=true without static_groups \(act-order"),
    "gptq_marlin_format": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                            "checkpoint_format": "marlin"},
                           r"gptq: checkpoint_format='marlin': fusedmoe reads GPTQ's own layouts \('gptq', 'gptq_v2'\)"),
    "gptq_8bit": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True}, r"gptq: bits=8"),
    "gptq_per_channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True},
                         r"gptq: group_size=-1: fusedmoe's int4 schemes have groups of \(32, 64, 128\)"),
    "fp8_block_64": ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"fp8: weight_block_size=\[64, 64\]"),
    "ct_int8_asymmetric": (_ct(dict(INT8_CHANNEL, symmetric=False)),
                           r"config group 'group_0' weights: symmetric=false \(zero points\) with type='int' "
                           r"num_bits=8 strategy='channel': fusedmoe runs zero points with int4 group weights only"),
    "ct_asymmetric_activations": (_ct(INT8_CHANNEL, dict(INT8_TOKEN, symmetric=False), "int-quantized"),
                                  r"config group 'group_0' input_activations: symmetric=false \(zero points\)"),
    "ct_act_order": (_ct(dict(INT4_G32, actorder="group")), r"weights actorder='group' \(act-order\)"),
    "ct_int4_g256": (_ct(dict(INT4_G32, group_size=256)),
                     r"weights int4/group256/static with activations unquantized: fusedmoe has no such scheme"),
    "ct_two_schemes": ({"quant_method": "compressed-tensors", "config_groups": {
                           "experts": {"targets": ["re:.*experts.*"], "weights": INT4_G32},
                           "attention": {"targets": ["Linear"], "weights": FP8_CHANNEL,
                                         "input_activations": FP8_TOKEN}}},
                       r"config groups of different schemes \{'experts': 'int4_w4a16_g32', 'attention': "
                       r"'fp8_w8a8_channel'\}"),
    "modelopt_w4a8": ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A8_AWQ"}},
                      r"modelopt: quant_algo='W4A8_AWQ'"),
    "unknown_method": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                       r"quant_method 'bitsandbytes' is not a format fusedmoe loads"),
    "unquantized": ({"model_type": "mixtral", "hidden_size": 4096}, r"no quant_method in the config"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_configs_fusedmoe_cannot_run_are_refused_by_field(name):
    config, match = REFUSED[name]
    with pytest.raises(ValueError, match=match):
        scheme_from_config(config)


def test_not_a_mapping():
    with pytest.raises(TypeError, match="config must be a mapping"):
        scheme_from_config('{"quant_method": "fp8"}')


FORMATS = {"qwen3_gptq": "gptq", "gptq_static_groups": "gptq", "gptq_v2_g64": "gptq_v2", "gptq_asymmetric": "gptq",
           "gptq_v2_asymmetric_g64": "gptq_v2", "awq_gemm": "awq", "awq_autoawq_upper_case": "awq"}


@pytest.mark.parametrize("name", CONFIGS)
def test_checkpoint_format_of_each_config(name):
    """GPTQ's checkpoint_format (v1 when absent) and AWQ's: what their tensors cannot say; None elsewhere."""
    assert checkpoint_format_from_config(CONFIGS[name][0]) == FORMATS.get(name)


@pytest.mark.parametrize(("fmt", "config"), [
    ("int4_g32_compressed_tensors", "kimi_k2_int4"),
    ("int4_g32_gptq_asym", "gptq_asymmetric"),
    ("int4_g64_gptq_v2_asym", "gptq_v2_asymmetric_g64"),
    ("int4_g64_awq", "awq_gemm"),
    ("int4_g32_compressed_tensors_asym", "ct_int4_asymmetric"),
    ("int4_g64_gptq", "gptq_v2_g64"),
    ("fp8_block", "deepseek_fp8"),
    ("nvfp4_compressed_tensors", "ct_nvfp4"),
    ("int8_channel_bf16_scales", "ct_int8_w8a8"),
    ("int8_w8a16_pack_quantized", "ct_int8_w8a16"),
    ("mxfp4_compressed_tensors", "ct_mxfp4"),
])
def test_the_scheme_loads_its_checkpoint(fmt, config):
    """The scheme the config names is the one test_checkpoint's checkpoint of that format loads with."""
    from test_checkpoint import layer_for, load, make_checkpoint

    ckpt = make_checkpoint(fmt)
    scheme, checkpoint_format = scheme_from_config(CONFIGS[config][0]), checkpoint_format_from_config(CONFIGS[config][0])
    assert scheme == ckpt.scheme
    if ckpt.scheme.endswith("_zp"):  # symmetric GPTQ's zero points (all 8) read alike under either format
        assert checkpoint_format == ckpt.checkpoint_format
    load(layer_for(scheme, checkpoint_format=checkpoint_format), ckpt, "names")
