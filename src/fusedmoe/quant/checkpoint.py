"""Pre-quantized checkpoints -> the fused payload and scale layouts of `fusedmoe.quant.params`.

    check_checkpoint_tensor -> tp_slice -> (layer places rows) -> fuse_fp8_tensor_scales |
    fuse_nvfp4_global_scales;  gpt-oss: gpt_oss_mxfp4_tensor (fused over experts on disk)
Per expert and projection on disk (N output rows, K input columns; gate/up: N = I, K = H;
down: N = H, K = I; I the full intermediate, I_p = I / tp this rank's part):
    fp8 block     weight fp8 [N, K] + weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]  (DeepSeek)
    fp8 tensor    weight fp8 [N, K] + weight_scale [] / [1] (or 0-d weight_scale_inv), input_scale
    fp8 channel   weight fp8 [N, K] + weight_scale [N, 1]
    int8 channel  weight int8 [N, K] + weight_scale [N, 1] (fp32 or bf16)    (compressed-tensors)
    nvfp4         weight uint8 [N, K/2] + weight_scale e4m3 [N, K/16] + weight_scale_2 fp32 []
                  + input_scale fp32 []                                                 (ModelOpt)
    nvfp4         weight_packed + weight_scale + weight_global_scale fp32 [1]
                  + input_global_scale fp32 [1]              (compressed-tensors nvfp4-pack-quantized)
    int4 group    weight_packed int32 [N, K/8] + weight_scale [N, K/g] (fp32, bf16 or fp16)
                  + weight_shape [2] (optional)     (compressed-tensors pack-quantized, symmetric:
                  Kimi-K2, llm-compressor's W4A16); word j holds codes 8j..8j+7, code 8j+i in
                  bits 4i..4i+3, each stored as q + 8 (`int4_payload` re-packs them as the
                  library's two's-complement nibbles, two per byte, low = even k)
    mxfp4         weight_packed uint8 [N, K/2] (low nibble = even k) + weight_scale uint8 [N, K/32]
                  (e8m0)                         (compressed-tensors mxfp4-pack-quantized, W4A16)
    int8 channel  weight_packed int32 [N, K/4] + weight_scale [N, 1]  (compressed-tensors pack-quantized
                  8-bit, W8A16: four codes a word, lowest byte first, stored q + 128; `int8_payload`)
    int4 group    qweight int32 [K/8, N] + scales [K/g, N] + qzeros int32 [K/g, N/8] + g_idx [K]
                  (optional)               (GPTQ, without act-order: AutoGPTQ / GPTQModel, e.g.
                  Qwen3-30B-A3B-GPTQ-Int4); word r of column n holds the unsigned codes 8r..8r+7
                  the same way, so qweight.T is pack-quantized's weight_packed and scales.T its
                  weight_scale (`gptq_as_packed`); g_idx must be k // g. qzeros' word j of group
                  row c holds the zero points of columns 8j..8j+7, column 8j+i in bits 4i..4i+3,
                  stored z - 1 by the v1 format (checkpoint_format "gptq") and z by "gptq_v2":
                  symmetric, all 8 (checked, dropped); sym=false loads them (`*_zp` schemes)
    int4 group    + weight_zero_point int32 [ceil(N/8), K/g]       (compressed-tensors pack-quantized,
                  symmetric=false): packed along N, word j of group column c holds rows
                  8j..8j+7, row 8j+i in bits 4i..4i+3, each the signed zero point + 8 (= z)
    int4 group    qweight int32 [K, N/8] + qzeros int32 [K/g, N/8] + scales fp16 [K/g, N]
                  (AutoAWQ GEMM, zero_point=true): packed along N in AWQ's order, nibble i of
                  word j holds column 8j + AWQ_ORDER[i]; codes and zero points unsigned
                  (`awq_as_packed` re-packs qweight as pack-quantized's weight_packed)
Zero points load as z - 8 in the scale's layout and dtype (`zero_point_tensor`): asymmetric int4
dequantizes as W = scale * ((q - 8) - (z - 8)) with q the unsigned code. GPTQ's and AWQ's qzeros
look alike, so the layer is told which it loads (FusedMoE's checkpoint_format,
`CHECKPOINT_FORMATS`); compressed-tensors' tensors have their own names.
Every scale is a multiplier: W = decode(weight) * scale [* weight_scale_2]. The flavour is told
by the names: compressed-tensors' NVFP4 global scales are stored as divisors (448 * 6 / amax)
and load as their reciprocals, into the same buffers as ModelOpt's.
"""

from __future__ import annotations

import math
import warnings

import torch

from fusedmoe.quant.formats import FP8_DTYPE, FP8_MAX, MX_GROUP, fp8_quantize
from fusedmoe.quant.scheme import QuantKey, QuantScheme

# Checkpoint tensor name -> its role; DeepSeek's `weight_scale_inv` is a multiplier like
# `weight_scale` (the 0-d Mistral variant too), so both fill the weight scale. compressed-tensors
# NVFP4 renames the payload and the two global scales.
ROLES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "weight_zero")
TENSOR_ROLES = {
    "weight": "weight",
    "weight_packed": "weight",
    "qweight": "weight",  # GPTQ, transposed (gptq_as_packed); AWQ, re-packed (awq_as_packed)
    "scales": "weight_scale",  # GPTQ / AWQ, transposed
    "weight_scale": "weight_scale",
    "weight_scale_inv": "weight_scale",
    "weight_scale_2": "weight_scale_2",
    "weight_global_scale": "weight_scale_2",
    "input_scale": "input_scale",
    "input_global_scale": "input_scale",
    "qzeros": "weight_zero",  # GPTQ / AWQ, asymmetric schemes only (symmetric: a companion)
    "weight_zero_point": "weight_zero",  # compressed-tensors, asymmetric schemes only
}
# compressed-tensors stores NVFP4 global scales as divisors, g = 448 * 6 / amax (x * g lands in
# e4m3 x e2m1 range); vLLM loads them as 1 / g (vllm-project/vllm,
# vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe.py,
# CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading: w13_scale_2 =
# 1.0 / w13_weight_global_scale, a13_scale = 1.0 / w13_input_global_scale).
RECIPROCAL_TENSORS = ("weight_global_scale", "input_global_scale")
GPTQ_TENSORS = ("qweight", "scales")  # stored [K-ish, N]: transposed to [N, K-ish] at load
ZERO_POINT_TENSORS = ("qzeros", "weight_zero_point")  # unpacked to z - 8, [N, K/g] (zero_point_tensor)
# Companions: tensors checked against the layer and then dropped, nothing to load
# (`check_companion`): pack-quantized's weight_shape [N, K]; GPTQ's zero points of a symmetric
# scheme (all 8) and group index (k // g without act-order); pack-quantized's group index
# (written with act-order)
COMPANION_TENSORS = ("weight_shape", "qzeros", "g_idx", "weight_g_idx")
ACT_ORDER = "GPTQ activation reordering (act-order: groups of permuted input columns)"
GPTQ_SYMMETRIC_ZEROS = (0x77777777, 0x88888888 - 2**32)  # eight zero points of 8: AutoGPTQ v1 (z - 1), v2
# What GPTQ's / AWQ's tensors cannot say themselves: how qzeros (and AWQ's qweight) are stored.
# The names are GPTQ's `checkpoint_format` values and AWQ's `quant_method`
# (`checkpoint_config.checkpoint_format_from_config`).
CHECKPOINT_FORMATS = {
    "gptq": "GPTQ v1 (AutoGPTQ, GPTQModel's default): qzeros hold z - 1",
    "gptq_v2": "GPTQ v2 (GPTQModel format='gptq_v2'): qzeros hold z",
    "awq": "AutoAWQ GEMM: qweight [K, N/8] and qzeros packed along N in AWQ's order, zeros hold z",
}
# AutoAWQ's GEMM packing (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear: order_map):
# nibble i (bits 4i..4i+3) of word j holds column 8j + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPT_OSS_TENSORS = (
    "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
    "down_proj_blocks", "down_proj_scales", "down_proj_bias",
)
_PAYLOAD_DTYPE = {"fp8": FP8_DTYPE, "int8": torch.int8, "int4": torch.int32, "nvfp4": torch.uint8,
                  "mxfp4": torch.uint8}
_CODES_PER_ELEMENT = {"int4": 8, "nvfp4": 2, "mxfp4": 2}  # packed payloads: codes per stored element along K
_FLOAT_SCALE = (torch.float32, torch.bfloat16, torch.float16)
_GROUP_SCALE = {"int4": _FLOAT_SCALE, "nvfp4": (FP8_DTYPE,), "mxfp4": (torch.uint8,)}  # e4m3 / e8m0 codes
_SCALAR_SHAPES = ((), (1,))


def roles_of(scheme: QuantScheme) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) roles of one projection's checkpoint tensors under `scheme`.

    A static fp8 activation scale must come from the checkpoint; NVFP4's input global scale
    may (without it the global is computed per call); asymmetric int4 needs its zero points.
    """
    key, act = scheme.weight, scheme.activation
    required = ["weight", "weight_scale"]
    optional = []
    if key.dtype == "nvfp4":
        required.append("weight_scale_2")
    if scheme.has_zero:
        required.append("weight_zero")
    if act is not None and not act.dynamic:
        required.append("input_scale")
    elif act is not None and act.dtype == "nvfp4":
        optional.append("input_scale")
    return tuple(required), tuple(optional)


def partition_alignment(scheme: QuantScheme) -> int:
    """The multiple of which I_p must be: a block or group may not straddle the TP cut or the
    gate/up seam of w13, and packed codes come two per byte."""
    key = scheme.weight
    if key.granularity == "block":
        return key.group[0]
    if key.granularity == "group":
        return key.group
    return 1


def check_partition(scheme: QuantScheme, intermediate: int, tp_size: int) -> None:
    """Raise unless I_p = intermediate / tp_size is a multiple of `partition_alignment`."""
    align = partition_alignment(scheme)
    inter = intermediate // tp_size
    if inter % align:
        what = ("128x128 blocks" if scheme.weight.granularity == "block"
                else f"groups of {align} inputs")
        raise ValueError(
            f"{scheme.name} scales cover {what}: the intermediate size per partition "
            f"I / tp = {intermediate} / {tp_size} = {inter} must be a multiple of {align} "
            f"({inter} % {align} = {inter % align}), or a block would straddle the gate/up seam "
            "or the TP cut"
        )


def expected_tensor(
    scheme: QuantScheme, role: str, n: int, k: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """(allowed shapes, allowed dtypes) of one projection's `role` tensor for a [N, K] weight."""
    key = scheme.weight
    if role == "weight":
        return ((n, k // _CODES_PER_ELEMENT.get(key.dtype, 1)),), (_PAYLOAD_DTYPE[key.dtype],)
    if role == "weight_scale":
        if key.granularity == "block":
            block_n, block_k = key.group
            return ((math.ceil(n / block_n), math.ceil(k / block_k)),), _FLOAT_SCALE
        if key.granularity == "tensor":
            return _SCALAR_SHAPES, _FLOAT_SCALE
        if key.granularity == "channel":  # [1] is a per-tensor scale, broadcast exactly
            return ((n, 1), (1,)), _FLOAT_SCALE
        return ((n, k // key.group),), _GROUP_SCALE[key.dtype]
    if role == "weight_scale_2":
        if key.dtype != "nvfp4":
            raise ValueError(f"weight_scale_2 is NVFP4's global scale; {scheme.name} has none")
        return _SCALAR_SHAPES, (torch.float32,)
    if role == "input_scale":
        return _SCALAR_SHAPES, (torch.float32,)
    if role == "weight_zero":  # as unpacked by zero_point_tensor
        if not scheme.has_zero:
            raise ValueError(f"weight_zero is asymmetric int4's zero point; {scheme.name} has none")
        return ((n, k // key.group),), (torch.float32,)
    raise ValueError(f"unknown checkpoint tensor role {role!r}; expected one of {ROLES}")


def check_checkpoint_tensor(
    scheme: QuantScheme, where: str, name: str, tensor: torch.Tensor, n: int, k: int
) -> None:
    """Raise ValueError naming `where` (expert and projection) unless `tensor` fits `name`."""
    shapes, dtypes = expected_tensor(scheme, TENSOR_ROLES[name], n, k)
    got = tuple(tensor.shape)
    context = f"({scheme.name}, weight [N, K] = [{n}, {k}])"
    if got not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{where}.{name}: checkpoint tensor has shape {got}, expected {want} {context}")
    if tensor.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(
            f"{where}.{name}: checkpoint tensor has dtype {tensor.dtype}, expected {want} {context}"
        )


def check_checkpoint_format(scheme: QuantScheme | None, checkpoint_format: str | None, prequantized: bool) -> None:
    """Raise ValueError unless `checkpoint_format` (None or a `CHECKPOINT_FORMATS` name) fits a
    layer of `scheme`: GPTQ's and AWQ's formats describe pre-quantized int4 tensors, and AWQ's
    carry zero points (a `*_zp` scheme)."""
    if checkpoint_format is None:
        return
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r}; expected None or one of "
                         f"{tuple(CHECKPOINT_FORMATS)}")
    if not prequantized or scheme is None or scheme.weight.dtype != "int4":
        raise ValueError(f"checkpoint_format={checkpoint_format!r} describes pre-quantized GPTQ / AWQ int4 tensors: "
                         f"it needs quant='int4_w4a16_g*' (or '*_zp'), prequantized=True; this layer has "
                         f"quant={scheme and scheme.name!r}, prequantized={prequantized}")
    if checkpoint_format == "awq" and not scheme.has_zero:
        raise ValueError(f"checkpoint_format='awq' stores a zero point per group: quant={scheme.name!r} is "
                         f"symmetric; AWQ loads as {scheme.name + '_zp'!r}")


def is_companion(scheme: QuantScheme, name: str) -> bool:
    """Whether the checkpoint tensor `name` is only checked under `scheme` (`COMPANION_TENSORS`):
    GPTQ's qzeros are, unless the scheme has zero points to load."""
    return name in COMPANION_TENSORS and not (scheme.has_zero and name in ZERO_POINT_TENSORS)


def _integers(tensor: torch.Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)


def check_companion(scheme: QuantScheme, where: str, name: str, tensor: torch.Tensor, n: int, k: int) -> None:
    """Raise ValueError naming `where` unless the companion tensor `name` (`COMPANION_TENSORS`)
    agrees with the layer's [N, K] weight under `scheme`: weight_shape (int4 or int8) holds
    [N, K]; qzeros (symmetric int4) int32 [K/g, N/8] holds zero points of 8 only; g_idx /
    weight_g_idx (int4) [K] holds k // g (no act-order)."""
    key = scheme.weight
    packed = ("int4", "int8") if name == "weight_shape" else ("int4",)
    if key.dtype not in packed:
        what = "a pack-quantized int4 / int8" if name == "weight_shape" else "an int4 (GPTQ or pack-quantized)"
        raise ValueError(f"{where}.{name} belongs to {what} checkpoint; this layer's scheme is {scheme.name}")
    group = key.group
    if name == "weight_shape":
        if not _integers(tensor) or tuple(tensor.shape) != (2,):
            raise ValueError(f"{where}.{name}: expected 2 integers [N, K] = [{n}, {k}], got "
                             f"{tensor.dtype} shape {tuple(tensor.shape)}")
        got = [int(v) for v in tensor.tolist()]
        if got != [n, k]:
            raise ValueError(f"{where}.{name}: the checkpoint's weight is {got}, this layer's [N, K] = [{n}, {k}]")
    elif name == "qzeros":
        want = (k // group, n // 8)
        if tensor.dtype != torch.int32 or tuple(tensor.shape) != want:
            raise ValueError(f"{where}.{name}: expected int32 {want} (GPTQ zero points of [N, K] = [{n}, {k}], "
                             f"g = {group}), got {tensor.dtype} {tuple(tensor.shape)}")
        words = torch.unique(tensor).tolist()
        if not set(words) <= set(GPTQ_SYMMETRIC_ZEROS) or len(words) > 1:
            raise ValueError(f"{where}.{name}: zero points other than 8 (words {[hex(w % 2**32) for w in words[:4]]}): "
                             f"the checkpoint is asymmetric (a zero point per group), {scheme.name} symmetric; "
                             f"it loads as {scheme.name + '_zp'!r}")
    else:  # g_idx / weight_g_idx
        if not _integers(tensor) or tuple(tensor.shape) != (k,):
            raise ValueError(f"{where}.{name}: expected {k} integers (each input column's group), got "
                             f"{tensor.dtype} shape {tuple(tensor.shape)}")
        trivial = torch.arange(k, device=tensor.device) // group
        if not torch.equal(tensor.to(trivial.dtype), trivial):
            raise ValueError(f"{where}.{name}: input columns out of group order: the checkpoint uses "
                             f"{ACT_ORDER}, which fusedmoe does not run")


def check_gptq_tensor(scheme: QuantScheme, where: str, name: str, tensor: torch.Tensor, n: int, k: int,
                      checkpoint_format: str | None = None) -> None:
    """Raise ValueError naming `where` unless GPTQ's `name` (qweight int32 [K/8, N], scales
    float [K/g, N]; AWQ's qweight int32 [K, N/8] under checkpoint_format "awq") fits an int4
    layer's [N, K] weight under `scheme`."""
    key = scheme.weight
    if key.dtype != "int4":
        raise ValueError(f"{where}.{name} is a GPTQ / AWQ int4 tensor; this layer's scheme is {scheme.name} "
                         "(GPTQ loads into int4_w4a16_g32 / g64 / g128, AWQ into their *_zp twins)")
    awq = checkpoint_format == "awq"
    if name == "qweight":
        shape, dtypes = ((k, n // 8) if awq else (k // 8, n)), (torch.int32,)
    else:
        shape, dtypes = (k // key.group, n), _FLOAT_SCALE
    context = f"({scheme.name}, {'AWQ' if awq else 'GPTQ'}, weight [N, K] = [{n}, {k}])"
    if tuple(tensor.shape) != shape:
        hint = ""
        if name == "qweight" and not awq and tuple(tensor.shape) == (k, n // 8):
            hint = ": AWQ's qweight is [K, N/8], build the layer with checkpoint_format='awq'"
        raise ValueError(f"{where}.{name}: checkpoint tensor has shape {tuple(tensor.shape)}, expected {shape} "
                         f"{context}{hint}")
    if tensor.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{where}.{name}: checkpoint tensor has dtype {tensor.dtype}, expected {want} {context}")


def check_packed_int8(where: str, name: str, tensor: torch.Tensor, n: int, k: int) -> None:
    """Raise ValueError naming `where` unless pack-quantized 8-bit `name` is int32 [N, K/4]."""
    if tensor.dtype != torch.int32 or k % 4 or tuple(tensor.shape) != (n, k // 4):
        raise ValueError(f"{where}.{name}: checkpoint tensor is {tensor.dtype} {tuple(tensor.shape)}, expected "
                         f"int32 ({n}, {k // 4}) (pack-quantized int8: four codes a word, weight [N, K] = [{n}, {k}])")


def _word_fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] -> their `bits`-wide fields [..., W, 32 / bits] as int32, the lowest
    first (shifts, not a byte view: the host's byte order does not matter)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _nibble_words(nibbles: torch.Tensor) -> torch.Tensor:
    """`_word_fields(words, 4)`'s inverse: values [..., W, 8] in [0, 15] -> int32 words [..., W]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nibbles.device)
    words = (nibbles.to(torch.int64) << shifts).sum(-1)  # < 2^32: wrap to int32's two's complement
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, N/8] packed along N -> the unsigned values [R, N] in column order."""
    nibbles = _word_fields(packed, 4)  # [R, N/8, 8]: nibble i holds column 8j + AWQ_ORDER[i]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits in nibble AWQ_ORDER.index(c)
    return nibbles[..., inverse].flatten(-2)


def awq_as_packed(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ's qweight int32 [K, N/8] -> pack-quantized's weight_packed int32 [N, K/8]: the unsigned
    codes q (= signed code + 8) in column order, transposed, eight a word along K, low first."""
    q_NK = _awq_columns(qweight).t()
    return _nibble_words(q_NK.unflatten(-1, (-1, 8)))


def check_zero_point_tensor(scheme: QuantScheme, where: str, name: str, tensor: torch.Tensor, n: int, k: int,
                            checkpoint_format: str | None) -> None:
    """Raise ValueError naming `where` unless the zero-point tensor `name` (`ZERO_POINT_TENSORS`)
    loads into `scheme`: an asymmetric int4 scheme, GPTQ's / AWQ's qzeros int32 [K/g, N/8] with
    the checkpoint format known, compressed-tensors' weight_zero_point int32 [ceil(N/8), K/g]."""
    if not scheme.has_zero:
        twin = scheme.name + "_zp"
        fix = (f"it loads as {twin!r}" if scheme.weight.dtype == "int4"
               else "fusedmoe runs zero points with int4 groups only (int4_w4a16_g*_zp)")
        raise ValueError(f"{where}.{name}: the checkpoint is asymmetric (a zero point per group), {scheme.name} "
                         f"symmetric: {fix}")
    group = scheme.weight.group
    if name == "qzeros":
        if checkpoint_format is None:
            raise ValueError(f"{where}.{name}: GPTQ and AWQ store zero points alike but differently (GPTQ v1: z - 1, "
                             "v2: z, AWQ: z in its nibble order): build the layer with checkpoint_format= one of "
                             f"{tuple(CHECKPOINT_FORMATS)} (checkpoint_config.checkpoint_format_from_config)")
        want, what = (k // group, math.ceil(n / 8)), "GPTQ / AWQ zero points, packed along N"
    else:
        want, what = (math.ceil(n / 8), k // group), "compressed-tensors zero points, packed along N"
    if tensor.dtype != torch.int32 or tuple(tensor.shape) != want:
        raise ValueError(f"{where}.{name}: expected int32 {want} ({what}, of [N, K] = [{n}, {k}], g = {group}), "
                         f"got {tensor.dtype} {tuple(tensor.shape)}")


def zero_point_tensor(where: str, name: str, tensor: torch.Tensor, n: int, checkpoint_format: str | None
                      ) -> torch.Tensor:
    """A checked zero-point tensor (`check_zero_point_tensor`) -> float32 [N, K/g] of z - 8, the
    layout and values of QuantParams.w13_zero / w2_zero.

    qzeros [K/g, N/8]: column 8j+i in nibble i of word j (GPTQ; v1 stores z - 1, so z = stored + 1)
    or in nibble AWQ_ORDER.index(i) (AWQ); weight_zero_point [ceil(N/8), K/g]: row 8j+i in nibble i
    of word j, stored as the signed zero point + 8, which is z. A v1 nibble of 15 (z = 16) is
    refused: AutoGPTQ writes z = 0 as -1, whose sign bits also overwrite the word's higher nibbles.
    """
    if name == "weight_zero_point":
        z_NG = _word_fields(tensor, 4).transpose(-1, -2).flatten(-3, -2)[:n]  # [N/8, K/g, 8] -> [N, K/g]
    elif checkpoint_format == "awq":
        z_NG = _awq_columns(tensor).t()[:n]
    else:
        stored = _word_fields(tensor, 4).flatten(-2).t()[:n]  # [K/g, N/8, 8] -> [N, K/g]
        if checkpoint_format == "gptq":
            bad = (stored == 15).nonzero()
            if len(bad):
                row, group = bad[0].tolist()
                raise ValueError(
                    f"{where}.{name}: {len(bad)} zero points stored as 15, the first of output {row} in group {group}: "
                    "the GPTQ v1 format (checkpoint_format 'gptq') stores z - 1, so 15 would be z = 16, outside "
                    "[0, 15] (AutoGPTQ writes z = 0 as -1, which also overwrites the word's higher nibbles); a "
                    "checkpoint storing z itself is checkpoint_format 'gptq_v2'"
                )
            stored = stored + 1
        z_NG = stored
    return (z_NG - 8).float()


def int8_payload(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized 8-bit int32 [N, K/4] -> int8 [N, K]: word j's byte b is
    code 4j+b stored as q + 128, so q is that byte XOR 0x80 read as two's complement."""
    return (_word_fields(packed, 8) ^ 0x80).to(torch.uint8).view(torch.int8).flatten(-2)


def gptq_as_packed(tensor: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [K/8, N] / scales [K/g, N] -> pack-quantized's weight_packed [N, K/8] /
    weight_scale [N, K/g]: the same words (eight codes along K, low nibble first, stored q + 8
    for a zero point of 8), transposed."""
    return tensor.t().contiguous()


def int4_payload(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int4 int32 [N, K/8] -> uint8 [N, K/2] two's-complement
    nibbles, low = even k (`formats.int4_pack`'s layout).

    Word j's byte b holds codes 8j+2b (low nibble) and 8j+2b+1, each stored as q + 8; the
    library's nibble of q is (q + 8) - 8 mod 16 = (q + 8) XOR 8.
    """
    return (_word_fields(packed, 8) ^ 0x88).to(torch.uint8).flatten(-2)


def as_multiplier(where: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checked tensor as the multiplier its role holds: 1 / t (fp32) for compressed-tensors'
    global scales (`RECIPROCAL_TENSORS`), t otherwise.

    A divisor must be positive: 1 / 0 would scale the projection by inf.
    """
    if name not in RECIPROCAL_TENSORS:
        return tensor
    if not (tensor > 0).all():
        raise ValueError(
            f"{where}.{name}: compressed-tensors stores this global scale as a divisor "
            f"(448 * 6 / amax), so it must be positive; got {tensor.flatten().tolist()}"
        )
    return torch.reciprocal(tensor.float())


def tp_slice(key: QuantKey, role: str, is_down: bool, tensor: torch.Tensor, inter: int,
             tp_rank: int) -> torch.Tensor:
    """This rank's part of a checked tensor: rows [r I_p, (r+1) I_p) of gate/up, columns of down,
    in the tensor's own units (bytes: I_p / 2, blocks: I_p / 128, groups: I_p / g).

    Per-tensor scales (and channel scales of down, whose rows are H) are not split; zero points
    (unpacked, `zero_point_tensor`) split as their group scales.
    """
    if tensor.dim() < 2 or (is_down and role == "weight_scale" and key.granularity == "channel"):
        return tensor
    per = inter
    if role == "weight" and key.dtype in ("nvfp4", "mxfp4", "int4") and is_down:  # bytes (int4: as re-packed)
        per = inter // 2
    elif role == "weight_scale" and key.granularity == "block":
        per = inter // key.group[0]
    elif role in ("weight_scale", "weight_zero") and key.granularity == "group" and is_down:
        per = inter // key.group
    cut = slice(tp_rank * per, (tp_rank + 1) * per)
    return tensor[:, cut] if is_down else tensor[cut]


def fuse_fp8_tensor_scales(
    w13_LGH: torch.Tensor, scale_L2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One per-tensor scale per expert for w13 from per-half scales (vLLM
    requantize_with_max_scale):  s = max(s_gate, s_up);  q_h' = e4m3(q_h * s_h / s).

    The half with the larger scale is unchanged; the other rounds once more in e4m3 (relative
    error <= 2^-4). Dividing by the max never overflows 448.
    """
    scale_L = scale_L2.amax(dim=1)
    inter = w13_LGH.shape[1] // 2
    halves = w13_LGH.float().unflatten(1, (2, inter))  # [L, 2, I, H]
    ratio = (scale_L2 / scale_L.unsqueeze(1)).view(-1, 2, 1, 1)
    # q * 1.0 re-encodes to the same e4m3 value, so the max half stays bit-exact.
    return fp8_quantize(halves * ratio, 1.0).flatten(1, 2), scale_L


def fuse_nvfp4_global_scales(
    block_scale_LGk: torch.Tensor, global_L2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One NVFP4 global scale per expert for w13:  g = max(g_gate, g_up);
    b_h' = e4m3(b_h * g_h / g) for each half's e4m3 block scales; codes unchanged.

    b' * g = b * g_h up to one e4m3 rounding of b' (relative <= 2^-4, exact for the half whose
    global is g, and when g_h / g is a power of two). The max never overflows e4m3's 448, unlike
    the min; vLLM keeps w1's global instead, which misscales up_proj when the two differ. Block
    scales that flush to zero (g_h / g below ~2^-9 / b_h) are reported with a warning.
    """
    global_L = global_L2.amax(dim=1)
    inter = block_scale_LGk.shape[1] // 2
    halves = block_scale_LGk.float().unflatten(1, (2, inter))
    ratio = (global_L2 / global_L.unsqueeze(1)).view(-1, 2, 1, 1)
    rescaled = (halves * ratio).clamp(max=FP8_MAX).to(FP8_DTYPE)
    flushed = int(((rescaled.float() == 0) & (halves != 0)).sum())
    if flushed:
        warnings.warn(
            f"unifying NVFP4 w1/w3 global scales (ratios down to {ratio.min().item():.3g}) "
            f"flushed {flushed} nonzero e4m3 block scales to zero",
            stacklevel=2,
        )
    return rescaled.flatten(1, 2), global_L


def gpt_oss_mxfp4_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    num_experts: int,
    hidden: int,
    intermediate: int,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> torch.Tensor:
    """gpt-oss's fused tensor `name` (all E experts) -> this rank's part in the fused layout.

    gate_up_*: rows interleaved on disk (gate = 0::2, up = 1::2) -> [gate I_p; up I_p] rows;
    *_blocks [E, N, K/32, 16] -> payload [E, N, K/2] (byte j: low nibble = element 2j);
    down_*: columns r I_p .. (r+1) I_p (bytes / 2, scales / 32); down_proj_bias is not split.
    """
    if name not in GPT_OSS_TENSORS:
        raise ValueError(f"unknown gpt-oss expert tensor {name!r}; expected one of {GPT_OSS_TENSORS}")
    E, H, I = num_experts, hidden, intermediate  # noqa: E741
    if H % MX_GROUP:
        raise ValueError(
            f"gpt-oss MXFP4 packs groups of {MX_GROUP}: H = {H} is not a multiple of {MX_GROUP} "
            f"({H} % {MX_GROUP} = {H % MX_GROUP})"
        )
    gate_up = name.startswith("gate_up")
    n, k = (2 * I, H) if gate_up else (H, I)
    kind = name.rsplit("_", 1)[1]
    want_shape, want_dtypes = {
        "blocks": ((E, n, k // MX_GROUP, MX_GROUP // 2), (torch.uint8,)),
        "scales": ((E, n, k // MX_GROUP), (torch.uint8,)),
        "bias": ((E, n), _FLOAT_SCALE),
    }[kind]
    context = f"(gpt-oss MXFP4, E = {E}, H = {H}, I = {I})"
    if tuple(tensor.shape) != want_shape:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, expected {want_shape} {context}"
        )
    if tensor.dtype not in want_dtypes:
        want = " or ".join(str(d) for d in want_dtypes)
        raise ValueError(f"{name}: checkpoint tensor has dtype {tensor.dtype}, expected {want} {context}")
    inter = I // tp_size
    if inter % MX_GROUP:
        raise ValueError(
            f"gpt-oss MXFP4 scales cover groups of {MX_GROUP}: I / tp = {I} / {tp_size} = {inter} "
            f"must be a multiple of {MX_GROUP} ({inter} % {MX_GROUP} = {inter % MX_GROUP})"
        )
    t = tensor.flatten(-2) if kind == "blocks" else tensor
    if gate_up:
        rows = slice(tp_rank * inter, (tp_rank + 1) * inter)
        return torch.cat((t[:, 0::2][:, rows], t[:, 1::2][:, rows]), dim=1)
    if kind == "bias":
        return t
    per = {"blocks": inter // 2, "scales": inter // MX_GROUP}[kind]
    return t[..., tp_rank * per : (tp_rank + 1) * per]
