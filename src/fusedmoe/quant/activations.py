"""Activation fake-quantization: x -> dequantize(quantize(x)) in float32, per activation QuantKey.

    fp8   tensor    s = amax(x) / 448 (dynamic) or the static scale
    fp8   token     s_m = amax(x_m) / 448
    fp8   group g   s_mj = amax(x_m[jg : (j+1)g]) / 448 (the last group may be short)
    int8  token     s_m = amax(x_m) / 127, round half to even
    nvfp4 group 16  global = static scale or amax(x) / (448 * 6); e4m3 scale per 16; e2m1 codes
    mxfp8 group 32  e4m3 values, e8m0 scale per 32
Rows (m) run over every leading dim of x [..., K]; all-zero rows and groups come back as zeros.
"""

from __future__ import annotations

import torch

from fusedmoe.quant.formats import (
    FP8_MAX,
    INT_RANGE,
    MX_GROUP,
    NVFP4_GROUP,
    absmax_scale,
    fp8_dequantize,
    fp8_quantize,
    group_view,
    int_dequantize,
    int_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)
from fusedmoe.quant.scheme import QuantKey


def fake_quantize_activation(
    x: torch.Tensor, key: QuantKey, static_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 dequantize(quantize(x)) with the format and scale granularity of `key`.

    static_scale: the fp8 per-tensor scale of a static key, or NVFP4's input global scale
    (optional there: without it the global scale is amax(x) / (448 * 6)). Scalar or 1 element.
    """
    _check_static_scale(key, static_scale)
    x = x.float()
    kind = (key.dtype, key.granularity)
    if kind == ("fp8", "tensor"):
        if static_scale is None:
            scale = absmax_scale(x.abs().amax(), FP8_MAX)
        else:
            scale = static_scale.float()
        return fp8_dequantize(fp8_quantize(x, scale), scale)
    if kind == ("fp8", "token"):
        scale = absmax_scale(x.abs().amax(-1, keepdim=True), FP8_MAX)
        return fp8_dequantize(fp8_quantize(x, scale), scale)
    if kind == ("fp8", "group"):
        return _fake_quantize_fp8_groups(x, key.group)
    if kind == ("int8", "token"):
        scale = absmax_scale(x.abs().amax(-1, keepdim=True), INT_RANGE[8][1])
        return int_dequantize(int_quantize(x, scale, 8), scale)
    if kind == ("nvfp4", "group") and key.group == NVFP4_GROUP:
        if static_scale is None:
            global_scale = nvfp4_global_scale(x.abs().amax())
        else:
            global_scale = static_scale.float()
        return nvfp4_dequantize(*nvfp4_quantize(x, global_scale), global_scale)
    if kind == ("mxfp8", "group") and key.group == MX_GROUP:
        return mxfp8_dequantize(*mxfp8_quantize(x))
    raise ValueError(f"no activation fake-quantization for {key}")


def _fake_quantize_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    k = x.shape[-1]
    # Zero-pad a short last group to a whole one: padding changes no |x| maximum.
    x_g = group_view(torch.nn.functional.pad(x, (0, -k % group)), group)
    scale = absmax_scale(x_g.abs().amax(-1, keepdim=True), FP8_MAX)
    return fp8_dequantize(fp8_quantize(x_g, scale), scale).flatten(-2)[..., :k]


def _check_static_scale(key: QuantKey, static_scale: torch.Tensor | None) -> None:
    if not key.dynamic and (key.dtype, key.granularity) != ("fp8", "tensor"):
        raise ValueError(
            f"no activation fake-quantization for {key}: only fp8 per-tensor scales are static"
        )
    takes_static = not key.dynamic or key.dtype == "nvfp4"
    if static_scale is None:
        if not key.dynamic:
            raise ValueError(
                f"{key} activations need a static scale (QuantParams.a13_scale / a2_scale), "
                "got None"
            )
        return
    if not takes_static:
        raise ValueError(f"{key} activations compute their scales at run time; got a static scale")
    if static_scale.numel() != 1:
        raise ValueError(
            f"static_scale must hold one value (index per-expert scales first), got shape "
            f"{tuple(static_scale.shape)}"
        )
