"""Quantization schemes: one named value per checkpoint format the experts can consume.

A scheme pairs a weight key with an activation key (None = weight-only: activations stay
bf16/fp16). Keys say the number format, the scale granularity and whether scales are static
(stored in the checkpoint) or dynamic (computed at run time). The oracle keys its priority
orders on `scheme.family` and its support sets on `scheme.name`.

Scale layouts (E experts, N output rows, K input columns of one GEMM; w13 has N = 2I, K = H):
    tensor   weight_scale [E]            one fp32 scale per expert and GEMM
    channel  weight_scale [E, N]         one per output row
    block    weight_scale [E, N/128, K/128]   (DeepSeek `weight_scale_inv`, a multiplier)
    group g  weight_scale [E, N, K/g]    int4 (bf16/fp32 scales), nvfp4 (e4m3, g=16), mxfp4 (e8m0, g=32)
             weight_zero  [E, N, K/g]    asymmetric int4 (`*_zp`) only: the zero point z - 8 in the
                                         scale's dtype (codes are stored as q - 8, so w = s * (v - zero)
                                         with v the signed code; symmetric int4 is zero = 0)
Activation scales: tensor static [1] (or [E] per expert); token dynamic [M, 1]; group [M, K/128].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QuantDType = Literal["fp8", "int8", "int4", "nvfp4", "mxfp4", "mxfp8"]
Granularity = Literal["tensor", "channel", "token", "block", "group"]
Family = Literal["unquantized", "fp8", "int8", "int4", "nvfp4", "mxfp4"]


@dataclass(frozen=True)
class QuantKey:
    """How one operand is quantized: format, scale granularity, group size, static or dynamic."""

    dtype: QuantDType
    granularity: Granularity
    group: int | tuple[int, int] | None = None
    dynamic: bool = False
    symmetric: bool = True

    def __str__(self) -> str:
        group = ""
        if isinstance(self.group, tuple):
            group = f"{self.group[0]}x{self.group[1]}"
        elif self.group is not None:
            group = str(self.group)
        kind = "dynamic" if self.dynamic else "static"
        return f"{self.dtype}/{self.granularity}{group}/{kind}" + ("" if self.symmetric else "/asym")


@dataclass(frozen=True)
class QuantScheme:
    """A named (weight key, activation key) pair; activation None means weight-only."""

    name: str
    family: Family
    weight: QuantKey
    activation: QuantKey | None
    description: str = ""

    @property
    def weight_only(self) -> bool:
        return self.activation is None

    @property
    def has_zero(self) -> bool:
        """Whether the weights carry zero points (asymmetric int4: QuantParams.w13_zero / w2_zero)."""
        return not self.weight.symmetric

    def __str__(self) -> str:
        return self.name


_FP8_T = QuantKey("fp8", "tensor")
_FP8_CH = QuantKey("fp8", "channel")
_FP8_BLK = QuantKey("fp8", "block", (128, 128))
_INT8_CH = QuantKey("int8", "channel")

SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in (
        QuantScheme(
            "fp8_w8a8_tensor", "fp8", _FP8_T, QuantKey("fp8", "tensor", dynamic=True),
            "FP8 e4m3, one weight scale per expert, dynamic per-tensor activation scale",
        ),
        QuantScheme(
            "fp8_w8a8_tensor_static", "fp8", _FP8_T, QuantKey("fp8", "tensor"),
            "FP8 e4m3, per-expert weight scale, static activation scale from the checkpoint",
        ),
        QuantScheme(
            "fp8_w8a8_channel", "fp8", _FP8_CH, QuantKey("fp8", "token", dynamic=True),
            "FP8 e4m3, per-output-channel weight scales, dynamic per-token activation scales",
        ),
        QuantScheme(
            "fp8_w8a8_block", "fp8", _FP8_BLK, QuantKey("fp8", "group", 128, dynamic=True),
            "FP8 e4m3, 128x128 weight blocks, dynamic 1x128 activation groups (DeepSeek-V3)",
        ),
        QuantScheme(
            "int8_w8a8", "int8", _INT8_CH, QuantKey("int8", "token", dynamic=True),
            "INT8 symmetric, per-channel weights, dynamic per-token activations",
        ),
        QuantScheme("fp8_w8a16", "fp8", _FP8_CH, None, "FP8 weights (per channel), bf16/fp16 math"),
        QuantScheme("int8_w8a16", "int8", _INT8_CH, None, "INT8 weights (per channel), bf16/fp16 math"),
        *(
            QuantScheme(
                f"int4_w4a16_g{g}", "int4", QuantKey("int4", "group", g), None,
                f"INT4 symmetric weights, one scale per {g} inputs (GPTQ sym=true), bf16/fp16 math",
            )
            for g in (32, 64, 128)
        ),
        *(
            QuantScheme(
                f"int4_w4a16_g{g}_zp", "int4", QuantKey("int4", "group", g, symmetric=False), None,
                f"INT4 asymmetric weights, one scale and one zero point per {g} inputs (AWQ, GPTQ "
                "sym=false), bf16/fp16 math",
            )
            for g in (32, 64, 128)
        ),
        QuantScheme(
            "mxfp4_w4a16", "mxfp4", QuantKey("mxfp4", "group", 32), None,
            "MXFP4: e2m1 weights, e8m0 scale per 32 (gpt-oss), bf16/fp16 math",
        ),
        QuantScheme(
            "mxfp4_w4a8", "mxfp4", QuantKey("mxfp4", "group", 32),
            QuantKey("mxfp8", "group", 32, dynamic=True),
            "MXFP4 weights with MXFP8 (e4m3 + e8m0 per 32) activations",
        ),
        QuantScheme(
            "nvfp4", "nvfp4", QuantKey("nvfp4", "group", 16),
            QuantKey("nvfp4", "group", 16, dynamic=True),
            "NVFP4 W4A4: e2m1 + e4m3 scale per 16 + fp32 global scale (ModelOpt)",
        ),
        QuantScheme(
            "nvfp4_w4a16", "nvfp4", QuantKey("nvfp4", "group", 16), None,
            "NVFP4 weights, bf16/fp16 math",
        ),
    )
}

FAMILY_LABEL = {
    "unquantized": "Unquantized",
    "fp8": "FP8",
    "int8": "Int8",
    "int4": "Int4",
    "nvfp4": "NvFp4",
    "mxfp4": "MxFp4",
}


def get_scheme(quant: str | QuantScheme | None) -> QuantScheme | None:
    """Resolve a scheme name (None / "none" = unquantized)."""
    if quant is None or isinstance(quant, QuantScheme):
        return quant
    if quant in ("none", "unquantized", ""):
        return None
    try:
        return SCHEMES[quant]
    except KeyError:
        raise ValueError(
            f"quant={quant!r} is not a known quantization scheme; expected one of {sorted(SCHEMES)}"
        ) from None


def family_of(quant: QuantScheme | None) -> Family:
    return "unquantized" if quant is None else quant.family
