"""The quantized-weight bundle passed as `fused_experts(..., quant=QuantParams(...))`.

Payload tensors (w13, w2) are passed as the usual weight arguments, in their storage format:
    fp8 schemes      float8_e4m3fn [E, N, K]
    int8 schemes     int8          [E, N, K]
    int4 / fp4       uint8         [E, N, K // 2]   two codes per byte, low nibble = even k
Scales follow `fusedmoe.quant.scheme` (tensor [E], channel [E, N], block [E, N/128, K/128],
group [E, N, K/g]); `a13_scale`/`a2_scale` are static activation scales (fp8 static: [1] or [E];
nvfp4: the fp32 input global scale [E]); `w13_global_scale`/`w2_global_scale` are NVFP4's fp32
per-expert global scales [E]; `w13_zero`/`w2_zero` are asymmetric int4's zero points (`*_zp`
schemes only): the scales' shape and dtype, each the group's zero point z minus 8 (codes are
stored as q - 8), so w = scale * (code - zero).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fusedmoe.quant.scheme import QuantScheme, get_scheme


@dataclass
class QuantParams:
    scheme: QuantScheme | str
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None
    w13_zero: torch.Tensor | None = None
    w2_zero: torch.Tensor | None = None

    def __post_init__(self) -> None:
        scheme = get_scheme(self.scheme)
        if scheme is None:
            raise ValueError("QuantParams needs a quantization scheme, got None")
        self.scheme = scheme


# QuantParams' tensors in declaration order (the custom ops take them so: api._QUANT_TENSORS)
TENSOR_FIELDS = tuple(f.name for f in dataclasses.fields(QuantParams) if f.name != "scheme")
# The weights' scales and the zero points laid as them: a re-lay of the scales (group-major,
# fragments) moves all four alike
LAID_AS_SCALES = ("w13_scale", "w2_scale", "w13_zero", "w2_zero")
