"""Quantization: schemes, the scale bundle, quantize/dequantize helpers for every scheme."""

from fusedmoe.quant.params import QuantParams
from fusedmoe.quant.scheme import SCHEMES, QuantKey, QuantScheme, get_scheme

__all__ = ["SCHEMES", "QuantKey", "QuantParams", "QuantScheme", "get_scheme"]
