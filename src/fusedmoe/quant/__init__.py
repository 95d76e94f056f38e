"""Quantization: schemes, the scale bundle, quantize/dequantize helpers for every scheme."""

from fusedmoe.quant.activations import fake_quantize_activation
from fusedmoe.quant.checkpoint_config import checkpoint_format_from_config, scheme_from_config
from fusedmoe.quant.params import QuantParams
from fusedmoe.quant.scheme import SCHEMES, QuantKey, QuantScheme, get_scheme
from fusedmoe.quant.weights import (
    check_quant_weights,
    dequantize_weight,
    dequantize_weights,
    quantize_weight,
    quantize_weights,
)

__all__ = [
    "SCHEMES",
    "QuantKey",
    "QuantParams",
    "QuantScheme",
    "check_quant_weights",
    "checkpoint_format_from_config",
    "dequantize_weight",
    "dequantize_weights",
    "fake_quantize_activation",
    "get_scheme",
    "quantize_weight",
    "quantize_weights",
    "scheme_from_config",
]
