"""Expert weights <-> their quantized storage: float [E, N, K] <-> (payload, scales) per scheme.

    q13, q2, params = quantize_weights(w13, w2, scheme)
    w13, w2 = dequantize_weights(q13, q2, params)            # float32, w within the format's step
Payloads follow `fusedmoe.quant.params` (fp8 / int8 [E, N, K], 4-bit codes uint8 [E, N, K / 2]),
scales the layouts of `fusedmoe.quant.scheme`; `check_quant_weights` validates both.
Legend: E experts (the local ones), N output rows and K input columns of one GEMM: w13 has
N = G (2I gated, I otherwise), K = H; w2 has N = H, K = I.
"""

from __future__ import annotations

import math

import torch

from fusedmoe.quant.formats import (
    FP8_DTYPE,
    FP8_MAX,
    INT_RANGE,
    absmax_scale,
    fp8_dequantize,
    fp8_quantize,
    group_view,
    int4_asym_quantize,
    int4_pack,
    int4_unpack,
    int_dequantize,
    int_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)
from fusedmoe.quant.fragments import (
    FRAG_K,
    FRAG_N,
    fragment_scale_shape,
    from_fragments,
    is_fragments,
    scale_chunk,
)
from fusedmoe.quant.params import QuantParams
from fusedmoe.quant.scheme import QuantKey, QuantScheme, get_scheme

_PAYLOAD_DTYPE = {
    "fp8": FP8_DTYPE, "int8": torch.int8, "int4": torch.uint8, "nvfp4": torch.uint8,
    "mxfp4": torch.uint8,
}
_PACKED = frozenset(("int4", "nvfp4", "mxfp4"))  # two 4-bit codes per byte along K
# Scales are multipliers; fp8/int8/int4 ones may be stored in any float type (Kimi-K2 ships bf16).
# quantize_weights writes float32.
_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_DTYPES = {"nvfp4": (FP8_DTYPE,), "mxfp4": (torch.uint8,)}


def quantize_weights(
    w13_EGH: torch.Tensor,
    w2_EHI: torch.Tensor,
    scheme: QuantScheme | str,
    *,
    activation_amax: tuple[torch.Tensor | float, torch.Tensor | float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, QuantParams]:
    """(q13, q2, QuantParams) for float weights w13 [E, G, H], w2 [E, H, I].

    Static activation scales cannot be read off weights: `activation_amax` = (GEMM1 input amax,
    GEMM2 input amax), scalars or [E], gives a_scale = amax / 448 (fp8_w8a8_tensor_static) or the
    NVFP4 input global scale amax / (448 * 6). Without it a13_scale/a2_scale stay None: the static
    fp8 scheme then needs them set before use; NVFP4 computes dynamic global scales.
    """
    scheme = _resolve(scheme)
    _check_float_weight(scheme, "w13", w13_EGH)
    _check_float_weight(scheme, "w2", w2_EHI)
    if w13_EGH.shape[0] != w2_EHI.shape[0]:
        raise ValueError(f"w13 has {w13_EGH.shape[0]} experts but w2 has {w2_EHI.shape[0]}")
    if w2_EHI.shape[1] != w13_EGH.shape[2]:
        raise ValueError(f"w13 {tuple(w13_EGH.shape)} and w2 {tuple(w2_EHI.shape)} disagree on H "
                         f"({w13_EGH.shape[2]} against {w2_EHI.shape[1]})")
    if w2_EHI.device != w13_EGH.device:
        raise ValueError(f"w2 is on {w2_EHI.device} but w13 is on {w13_EGH.device}")
    q13, scale13, global13, zero13 = quantize_weight(w13_EGH, scheme)
    q2, scale2, global2, zero2 = quantize_weight(w2_EHI, scheme)
    a13, a2 = _activation_scales(scheme, activation_amax, w13_EGH.shape[0], w13_EGH.device)
    return q13, q2, QuantParams(scheme, scale13, scale2, a13, a2, global13, global2, zero13, zero2)


def quantize_weight(
    w_ENK: torch.Tensor, scheme: QuantScheme | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(payload, scale, global scale or None, zero point or None) of one weight [E, N, K] under
    scheme's weight key.

    fp8 / int: s = amax(granule) / qmax, q = quantize(w / s) (int4 of bf16 weights: s stored in
    bf16 and q rounded against it);  asymmetric int4 (`*_zp`): s and zero per group from the
    group's range (`formats.int4_asym_quantize`), in the scale's dtype;  nvfp4: global =
    amax(expert) / 2688, e4m3 scale per 16; mxfp4: e8m0 scale per 32. All-zero granules quantize
    to 0 without NaN.
    """
    scheme = _resolve(scheme)
    _check_float_weight(scheme, "w", w_ENK)
    parts = [_quantize_experts(w_ENK[chunk], scheme) for chunk in _expert_chunks(*w_ENK.shape)]
    if len(parts) == 1:
        return parts[0]
    return tuple(None if part is None else torch.cat([p[i] for p in parts]) for i, part in enumerate(parts[0]))


# Every scheme's codes and scales of an expert depend on that expert's weights alone (a scale's
# granule is at most one expert), so experts are quantized and dequantized a chunk at a time, bit
# for bit as all at once: the temporaries (e2m1 encoding holds ~30 bytes an element in int64
# buckets and masks) then stay near QUANTIZE_CHUNK_ELEMENTS elements' worth instead of growing with
# the whole weight (gpt-oss-120b's experts, 3.2 G weights: ~74 GB to quantize to mxfp4 at once).
QUANTIZE_CHUNK_ELEMENTS = 1 << 26  # ~2 GB of temporaries a chunk


def _expert_chunks(num_experts: int, n: int, k: int) -> list[slice]:
    """Slices of the expert dim of [E, N, K] weights, about QUANTIZE_CHUNK_ELEMENTS weights each
    (one expert at least)."""
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // max(1, n * k))
    return [slice(e, e + step) for e in range(0, num_experts, step)] or [slice(0, 0)]


def _quantize_experts(
    w_ENK: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    key = scheme.weight
    w = w_ENK.float()
    if key.dtype == "nvfp4":
        global_E = nvfp4_global_scale(w.abs().amax(dim=(1, 2)))
        q, block_scale = nvfp4_quantize(w, global_E.view(-1, 1, 1))
        return q, block_scale, global_E, None
    if key.dtype == "mxfp4":
        q, scale = mxfp4_quantize(w)
        return q, scale, None, None
    if key.dtype == "fp8":
        scale = absmax_scale(_amax(w, key), FP8_MAX)
        return fp8_quantize(w, _expand(scale, key, w.shape)), scale, None, None
    if scheme.has_zero:  # scales in bf16 for bf16 weights, as below
        scale_dtype = torch.bfloat16 if w_ENK.dtype == torch.bfloat16 else torch.float32
        codes, scale, zero = int4_asym_quantize(group_view(w, key.group), scale_dtype)
        return int4_pack(codes.flatten(-2)), scale, None, zero
    bits = 8 if key.dtype == "int8" else 4
    # Symmetric: s = amax / qmax (127 or 7), so -amax..amax maps onto [-qmax, qmax] unclipped.
    scale = absmax_scale(_amax(w, key), INT_RANGE[bits][1])
    if bits == 4 and w_ENK.dtype == torch.bfloat16:
        # int4 group scales of bf16 weights stored in bf16, as GPTQ / AWQ / Kimi-K2 checkpoints
        # ship them and as `fusedmoe bench` times int4: fp32 scales are 1 bit a weight at group
        # 32, bf16 0.5 (5 -> 4.5 bits, 10% of what a decode streams; the bf16 kernel rounds them
        # to bf16 anyway). The codes are rounded against the stored scale. bf16 has fp32's
        # exponent range, so no scale underflows; fp16 / fp32 weights keep fp32 scales.
        scale = scale.to(torch.bfloat16)
    q = int_quantize(w, _expand(scale.float(), key, w.shape), bits)
    return (q if bits == 8 else int4_pack(q)), scale, None, None


def dequantize_weight(
    q: torch.Tensor,
    scale: torch.Tensor,
    scheme: QuantScheme | str,
    global_scale: torch.Tensor | None = None,
    *,
    zero: torch.Tensor | None = None,
    shape_NK: tuple[int, int] | None = None,
) -> torch.Tensor:
    """float32 [E, N, K] = decode(q) * scale (expanded over its granule) [* global_scale, nvfp4]
    [(decode(q) - zero) * scale, asymmetric int4].

    shape_NK, when given, is the (N, K) the caller expects; a payload holding another raises.
    """
    scheme = _resolve(scheme)
    key = scheme.weight
    pack = 2 if key.dtype in _PACKED else 1
    _check_payload("q", q, scheme)
    if shape_NK is not None and (q.shape[1], q.shape[2] * pack) != tuple(shape_NK):
        raise ValueError(
            f"payload of shape {tuple(q.shape)} holds [E, {q.shape[1]}, {q.shape[2] * pack}] "
            f"{scheme.name} weights, expected [E, {shape_NK[0]}, {shape_NK[1]}]"
        )
    check_group_divides(scheme, "q", q.shape[2] * pack)
    _check_weight_scale("scale", scale, scheme, q.shape[0], q.shape[1], q.shape[2] * pack, q.device)
    check_zero("zero", zero, scale, scheme)
    if key.dtype == "nvfp4":
        if global_scale is None:
            raise ValueError(f"{scheme.name} weights need global_scale (fp32 [E]), got None")
        _check_tensor("global_scale", global_scale, ((q.shape[0],),), (torch.float32,), scheme, q.device)
    elif global_scale is not None:
        raise ValueError(f"global_scale is set but {scheme.name} has none (only nvfp4 does)")
    chunks = _expert_chunks(q.shape[0], q.shape[1], q.shape[2] * pack)
    if len(chunks) == 1:
        return _dequantize_experts(q, scale, scheme, global_scale, zero)
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2] * pack, dtype=torch.float32, device=q.device)
    for chunk in chunks:  # into one output: the float weights are the big tensor here
        out[chunk] = _dequantize_experts(q[chunk], scale[chunk], scheme,
                                         None if global_scale is None else global_scale[chunk],
                                         None if zero is None else zero[chunk])
    return out


def _dequantize_experts(q: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme, global_scale: torch.Tensor | None,
                        zero: torch.Tensor | None) -> torch.Tensor:
    key = scheme.weight
    if is_fragments(scale) and key.dtype in _PACKED:  # the triton backend's fragment layout: back to the checkpoint's
        if zero is not None:  # laid as its scales are
            zero = from_fragments(q, zero, key.dtype)[1]
        q, scale = from_fragments(q, scale, key.dtype)
    if key.dtype == "nvfp4":
        return nvfp4_dequantize(q, scale, global_scale.float().view(-1, 1, 1))
    if key.dtype == "mxfp4":
        return mxfp4_dequantize(q, scale)
    if key.dtype == "fp8":
        return fp8_dequantize(q, _expand(scale.float(), key, q.shape))
    values = q if key.dtype == "int8" else int4_unpack(q)
    return int_dequantize(values, _expand(scale.float(), key, values.shape),
                          None if zero is None else _expand(zero.float(), key, values.shape))


def dequantize_weights(
    q13: torch.Tensor, q2: torch.Tensor, params: QuantParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, G, H], w2 [E, H, I]) in float32 from the payloads and params' weight scales."""
    w13 = dequantize_weight(q13, params.w13_scale, params.scheme, params.w13_global_scale, zero=params.w13_zero)
    w2 = dequantize_weight(q2, params.w2_scale, params.scheme, params.w2_global_scale, zero=params.w2_zero)
    return w13, w2


def check_quant_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    params: QuantParams,
    hidden_size: int,
    intermediate_rows: int,
    gated: bool | None = None,
) -> None:
    """Raise ValueError unless payloads and scales match params.scheme for w13 [E, G, H] and w2
    [E, H, I] (G = intermediate_rows; I = G / 2 for a gated activation, G for a non-gated one;
    gated=None takes either, read off w2).

    Metadata only (shapes, dtypes, devices, presence): no device sync.
    """
    check_quant_tensors(w13, w2, params.scheme, params.w13_scale, params.w2_scale, params.a13_scale,
                        params.a2_scale, params.w13_global_scale, params.w2_global_scale, hidden_size,
                        intermediate_rows, gated, w13_zero=params.w13_zero, w2_zero=params.w2_zero)


def check_quant_tensors(
    w13: torch.Tensor,
    w2: torch.Tensor,
    scheme: QuantScheme,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    w13_global_scale: torch.Tensor | None,
    w2_global_scale: torch.Tensor | None,
    hidden_size: int,
    intermediate_rows: int,
    gated: bool | None = None,
    *,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
) -> None:
    """`check_quant_weights` on the parts of a QuantParams (kernels that take them one by one)."""
    key = scheme.weight
    pack = 2 if key.dtype in _PACKED else 1
    packing = f" ({key.dtype} packs two codes per byte along K)" if pack == 2 else ""
    for name, q in (("w13", w13), ("w2", w2)):
        _check_payload(name, q, scheme)
    if w2.device != w13.device:
        raise ValueError(f"w2 is on {w2.device} but w13 is on {w13.device}")
    num_experts, rows, hidden = w13.shape[0], intermediate_rows, hidden_size
    check_group_divides(scheme, "w13", hidden)
    want13 = (num_experts, rows, hidden // pack)
    if tuple(w13.shape) != want13:
        raise ValueError(
            f"w13 has shape {tuple(w13.shape)}, expected {want13} for {scheme.name} with "
            f"G = {rows}, H = {hidden}{packing}"
        )
    intermediate = w2.shape[2] * pack
    if gated is None:
        widths = (rows // 2, rows) if rows % 2 == 0 else (rows,)
        rule = "I = G / 2 gated, I = G non-gated"
    else:
        widths = (rows // 2,) if gated else (rows,)
        rule = "I = G / 2: a gated activation" if gated else "I = G: a non-gated activation"
    if tuple(w2.shape[:2]) != (num_experts, hidden) or intermediate not in widths:
        expected = " or ".join(f"{(num_experts, hidden, i // pack)}" for i in widths)
        raise ValueError(
            f"w2 has shape {tuple(w2.shape)}, expected {expected} ({rule}) for {scheme.name} with "
            f"G = {rows}, H = {hidden}{packing}"
        )
    check_group_divides(scheme, "w2", intermediate)

    device = w13.device
    for name, scale, n, k in (
        ("w13_scale", w13_scale, rows, hidden),
        ("w2_scale", w2_scale, hidden, intermediate),
    ):
        _check_weight_scale(name, scale, scheme, num_experts, n, k, device)
    check_zero("w13_zero", w13_zero, w13_scale, scheme)
    check_zero("w2_zero", w2_zero, w2_scale, scheme)
    for name, global_scale in (
        ("w13_global_scale", w13_global_scale),
        ("w2_global_scale", w2_global_scale),
    ):
        if key.dtype == "nvfp4":
            _check_tensor(name, global_scale, ((num_experts,),), (torch.float32,), scheme, device)
        elif global_scale is not None:
            raise ValueError(
                f"{name} is set but {scheme.name} has no global scale (only nvfp4 does)"
            )

    check_activation_scales(scheme, a13_scale, a2_scale, num_experts, device)


def check_activation_scales(scheme: QuantScheme, a13_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
                            num_experts: int, device: torch.device) -> None:
    """Raise ValueError unless the activation scales match the scheme: both given for static
    activation quantization ([], [1] or [E] fp32 on `device`), None for dynamic or none (NVFP4's
    global input scale is optional). Metadata only: no device sync."""
    act = scheme.activation
    required = act is not None and not act.dynamic
    # NVFP4's activation global scale is optional: the checkpoint's input_scale, else dynamic.
    allowed = required or (act is not None and act.dtype == "nvfp4")
    for name, scale in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if scale is None and required:
            raise ValueError(
                f"{name} is None but {scheme.name} quantizes activations with a static scale "
                f"({act}): set QuantParams.{name} (shape (1,) or ({num_experts},)), e.g. with "
                "quantize_weights(..., activation_amax=...)"
            )
        if scale is None:
            continue
        if not allowed:
            what = "no activation quantization"
            if act is not None:
                what = f"dynamic activation scales ({act})"
            raise ValueError(f"{name} is set but {scheme.name} has {what}; leave it None")
        _check_tensor(name, scale, ((), (1,), (num_experts,)), _FLOAT_SCALE_DTYPES, scheme, device)


# Helpers --------------------------------------------------------------------------------------
def _check_payload(name: str, q: torch.Tensor, scheme: QuantScheme) -> None:
    dtype = _PAYLOAD_DTYPE[scheme.weight.dtype]
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"{name} must be 3-D [E, N, K], got shape {tuple(q.shape)}")
    if q.dtype != dtype:
        raise ValueError(f"{name} has dtype {q.dtype}, expected {dtype} for {scheme.name}")


def _check_weight_scale(name: str, scale: torch.Tensor, scheme: QuantScheme, num_experts: int, n: int, k: int,
                        device: torch.device) -> None:
    """The weight scale of an [E, n, k] weight: the scheme's shape and dtypes (or, for the 4-bit
    formats, the fragment order's), on `device`."""
    key = scheme.weight
    shapes = (scale_shape(key, num_experts, n, k),)
    dtypes = _SCALE_DTYPES.get(key.dtype, _FLOAT_SCALE_DTYPES)
    if key.dtype in _PACKED and n % FRAG_N == 0 and k % FRAG_K == 0 and k % scale_chunk(key.group) == 0:
        shapes += (fragment_scale_shape(num_experts, n, k, key.group),)  # or in fragment order
        if is_fragments(scale) and key.dtype == "nvfp4":  # fragments.nv_scale_codes
            shapes, dtypes = shapes[1:], (torch.uint8,)
    _check_tensor(name, scale, shapes, dtypes, scheme, device)


def check_zero(name: str, zero: torch.Tensor | None, scale: torch.Tensor, scheme: QuantScheme) -> None:
    """Asymmetric int4's zero points: present exactly for a `*_zp` scheme, with its scale's shape,
    dtype, device and strides (the kernels index both with the scale's strides). Metadata only."""
    if not scheme.has_zero:
        if zero is not None:
            raise ValueError(f"{name} is set but {scheme.name} is symmetric (zero points belong to the "
                             f"*_zp schemes, e.g. {scheme.name}_zp)" if scheme.weight.dtype == "int4"
                             else f"{name} is set but {scheme.name} has no zero points")
        return
    if zero is None:
        raise ValueError(f"{name} is None but {scheme.name} is asymmetric: it needs zero points (the "
                         f"scales' shape {tuple(scale.shape)} and dtype {scale.dtype}, each z - 8)")
    if not isinstance(zero, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(zero).__name__}")
    for what, got, want in (("shape", tuple(zero.shape), tuple(scale.shape)), ("dtype", zero.dtype, scale.dtype),
                            ("device", zero.device, scale.device), ("strides", zero.stride(), scale.stride())):
        if got != want:
            raise ValueError(f"{name} has {what} {got}, expected its scale's {want} for {scheme.name}")


def _resolve(scheme: QuantScheme | str) -> QuantScheme:
    resolved = get_scheme(scheme)
    if resolved is None:
        raise ValueError(f"a quantization scheme is required, got {scheme!r}")
    return resolved


def _check_float_weight(scheme: QuantScheme, name: str, w: torch.Tensor) -> None:
    if w.dim() != 3 or not w.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point [E, N, K] tensor, got {w.dtype} {tuple(w.shape)}"
        )
    check_group_divides(scheme, name, w.shape[2])


def check_group_divides(scheme: QuantScheme, name: str, k: int) -> None:
    key = scheme.weight
    if key.granularity == "group" and k % key.group:
        raise ValueError(
            f"{scheme.name} has one scale per {key.group} inputs, but {name}'s K = {k} is not a "
            f"multiple of {key.group} ({k} % {key.group} = {k % key.group})"
        )


def scale_shape(key: QuantKey, num_experts: int, n: int, k: int) -> tuple[int, ...]:
    """Shape of the weight scales of E experts' [N, K] weights (layouts of `quant.scheme`)."""
    if key.granularity == "tensor":
        return (num_experts,)
    if key.granularity == "channel":
        return (num_experts, n)
    if key.granularity == "block":
        block_n, block_k = key.group
        return (num_experts, math.ceil(n / block_n), math.ceil(k / block_k))
    return (num_experts, n, k // key.group)


def _amax(w_ENK: torch.Tensor, key: QuantKey) -> torch.Tensor:
    """|w| maximum over each scale's granule, in the layout of `scale_shape`."""
    w = w_ENK.abs()
    if key.granularity == "tensor":
        return w.amax(dim=(1, 2))
    if key.granularity == "channel":
        return w.amax(dim=2)
    if key.granularity == "block":
        _, n, k = w.shape
        block_n, block_k = key.group
        # Zero padding leaves every |w| maximum unchanged and makes edge blocks whole.
        w = torch.nn.functional.pad(w, (0, -k % block_k, 0, -n % block_n))
        blocks = w.unflatten(2, (-1, block_k)).unflatten(1, (-1, block_n))
        return blocks.amax(dim=(2, 4))
    return group_view(w, key.group).amax(-1)


def _expand(scale: torch.Tensor, key: QuantKey, shape_ENK: torch.Size) -> torch.Tensor:
    """The scale of every element, broadcastable to shape_ENK."""
    _, n, k = shape_ENK
    if key.granularity == "tensor":
        return scale.view(-1, 1, 1)
    if key.granularity == "channel":
        return scale.unsqueeze(-1)
    if key.granularity == "block":
        block_n, block_k = key.group
        return scale.repeat_interleave(block_n, 1)[:, :n].repeat_interleave(block_k, 2)[:, :, :k]
    return scale.repeat_interleave(key.group, -1)


def _activation_scales(
    scheme: QuantScheme,
    activation_amax: tuple[torch.Tensor | float, torch.Tensor | float] | None,
    num_experts: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if activation_amax is None:
        return None, None
    act = scheme.activation
    if act is None or (act.dynamic and act.dtype != "nvfp4"):
        raise ValueError(
            f"activation_amax sets static activation scales, but {scheme.name} has "
            f"{'no activation quantization' if act is None else f'dynamic ones ({act})'}"
        )
    scales = []
    for name, amax in zip(("GEMM1", "GEMM2"), activation_amax, strict=True):
        amax = torch.as_tensor(amax, dtype=torch.float32, device=device).reshape(-1)
        if amax.numel() not in (1, num_experts):
            raise ValueError(
                f"activation_amax for {name} has {amax.numel()} values, expected 1 or {num_experts}"
            )
        bad = ~(torch.isfinite(amax) & (amax > 0))
        if bool(bad.any()):  # an offline helper: the sync is fine here
            raise ValueError(
                f"activation_amax for {name} must be finite and > 0, got {float(amax[bad][0])} "
                "(a zero or NaN amax makes a zero, NaN or negative activation scale)"
            )
        if act.dtype == "nvfp4":
            scales.append(nvfp4_global_scale(amax))
        else:
            scales.append(absmax_scale(amax, FP8_MAX))
    return scales[0], scales[1]


def _check_tensor(
    name: str,
    t: torch.Tensor | None,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    scheme: QuantScheme,
    device: torch.device,
) -> None:
    want = " or ".join(str(shape) for shape in shapes)
    if t is None:
        raise ValueError(f"{name} is None, expected a tensor of shape {want} for {scheme.name}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want} for {scheme.name}")
    if t.dtype not in dtypes:
        want = " or ".join(map(str, dtypes))
        raise ValueError(f"{name} has dtype {t.dtype}, expected {want} for {scheme.name}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the weights are on {device}")
