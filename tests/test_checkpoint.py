"""Pre-quantized checkpoints through FusedMoE: build each on-disk format from random float weights,
load it per expert (names or load_expert_weight), and compare the layer with the reference on
the checkpoint's own dequantization (written here by hand, independent of the library's).

Legend: T tokens, H hidden, I intermediate, E experts; one projection is [N, K].
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe.backends.emulation import activation_transform
from fusedmoe.quant.formats import FP8_DTYPE, mxfp4_quantize, nvfp4_quantize
from fusedmoe.quant.weights import (
    dequantize_weight,
    dequantize_weights,
    quantize_weight,
    quantize_weights,
)
from fusedmoe.reference import fused_experts_ref

E, TOP_K, H, I, T = 4, 2, 192, 256, 11  # noqa: E741 - H = 1.5 blocks: a partial last block
SAME_MATH_RTOL = 1e-6
HF = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Small tensors on 2 busy cores: intra-op threads cost more than they save (see test_quant).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (fp8 included, which torch.equal may not compare)."""
    return actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(
        actual.contiguous().flatten().view(torch.uint8), expected.contiguous().flatten().view(torch.uint8))


def float_weights(seed: int) -> dict[str, torch.Tensor]:
    """gate/up [E, I, H], down [E, H, I]; up is 3x gate so per-tensor scales differ."""
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(E, I, H, generator=g) * H**-0.5,
            "up": torch.randn(E, I, H, generator=g) * 3 * H**-0.5,
            "down": torch.randn(E, H, I, generator=g) * I**-0.5}


# Checkpoints: per expert {(e, projection, tensor name): tensor} + its dequantization --------------
@dataclass
class Checkpoint:
    scheme: str
    tensors: dict[tuple[int, str, str], torch.Tensor]
    w13: torch.Tensor  # [E, 2I, H] float32, the checkpoint's values: gate rows, then up
    w2: torch.Tensor  # [E, H, I]
    a13: torch.Tensor | None = None  # [E] static activation scales the layer must use
    a2: torch.Tensor | None = None
    checkpoint_format: str | None = None  # FusedMoE's checkpoint_format (GPTQ / AWQ zero points)


def _assemble(scheme, per_proj, dequant, a13=None, a2=None, checkpoint_format=None) -> Checkpoint:
    tensors = {(e, p, name): t[e] for p, named in per_proj.items() for name, t in named.items()
               for e in range(E)}
    return Checkpoint(scheme, tensors, torch.cat((dequant["gate"], dequant["up"]), 1),
                      dequant["down"], a13, a2, checkpoint_format)


def _block_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[-2:]
    return q.float() * s.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]


def fp8_block(w, seed) -> Checkpoint:
    """DeepSeek: weight fp8 [N, K] + weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]."""
    per, deq = {}, {}
    for p, wp in w.items():
        q, s, *_ = quantize_weight(wp, "fp8_w8a8_block")
        per[p] = {"weight": q, "weight_scale_inv": s}
        deq[p] = _block_dequant(q, s)
    return _assemble("fp8_w8a8_block", per, deq)


def _fp8_tensor(w, scheme, scale_name, shared_w13, scalar_shape, input_scales, seed):
    """weight fp8 + per-tensor scale; shared_w13: gate and up quantized with one scale."""
    per, deq = {}, {}
    joint = torch.cat((w["gate"], w["up"]), 1)
    for p, wp in w.items():
        source = joint if shared_w13 and p != "down" else wp
        _, s, *_ = quantize_weight(source, "fp8_w8a8_tensor")
        q = (wp / s.view(-1, 1, 1)).clamp(-448, 448).to(FP8_DTYPE)
        per[p] = {"weight": q, scale_name: s.reshape(E, *scalar_shape)}
        deq[p] = q.float() * s.view(-1, 1, 1)
    a13 = a2 = None
    if input_scales:
        g = torch.Generator().manual_seed(seed)
        ins = {p: 0.004 + 0.01 * torch.rand(E, generator=g) for p in w}
        for p in w:
            per[p]["input_scale"] = ins[p].reshape(E, 1)
        a13, a2 = torch.maximum(ins["gate"], ins["up"]), ins["down"]
    return _assemble(scheme, per, deq, a13, a2)


def fp8_tensor(w, seed):  # compressed-tensors: weight_scale [1]
    return _fp8_tensor(w, "fp8_w8a8_tensor", "weight_scale", True, (1,), False, seed)


def fp8_tensor_scale_inv_0d(w, seed):  # Mistral: weight_block_size null, 0-d weight_scale_inv
    return _fp8_tensor(w, "fp8_w8a8_tensor", "weight_scale_inv", True, (), False, seed)


def fp8_tensor_static(w, seed):  # ModelOpt FP8: scalar weight_scale + input_scale
    return _fp8_tensor(w, "fp8_w8a8_tensor_static", "weight_scale", True, (), True, seed)


def _per_channel(w, scheme, scale_dtype) -> Checkpoint:
    per, deq = {}, {}
    for p, wp in w.items():
        q, s, *_ = quantize_weight(wp, scheme)
        s = s.to(scale_dtype).unsqueeze(-1)  # [E, N, 1] as stored
        per[p] = {"weight": q, "weight_scale": s}
        deq[p] = q.float() * s.float()
    return _assemble(scheme, per, deq)


def fp8_channel(w, seed):
    return _per_channel(w, "fp8_w8a8_channel", torch.float32)


def int8_channel_bf16_scales(w, seed):  # compressed-tensors int-quantized, bf16 scales
    return _per_channel(w, "int8_w8a8", torch.bfloat16)


def nvfp4_unpack_by_hand(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float [..., K]: element 2j is byte j's LOW nibble (ModelOpt)."""
    lo, hi = E2M1[(packed & 0xF).long()], E2M1[(packed >> 4).long()]
    return torch.stack((lo, hi), -1).flatten(-2)


def _nvfp4(w, scheme, shared_w13, input_scales, seed) -> Checkpoint:
    """ModelOpt: weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32 []."""
    per, deq = {}, {}
    joint_amax = torch.cat((w["gate"], w["up"]), 1).abs().amax((1, 2))
    for p, wp in w.items():
        amax = joint_amax if shared_w13 and p != "down" else wp.abs().amax((1, 2))
        g2 = amax / (448 * 6)
        q, block = nvfp4_quantize(wp, g2.view(-1, 1, 1))
        per[p] = {"weight": q, "weight_scale": block, "weight_scale_2": g2.reshape(E)}
        values = nvfp4_unpack_by_hand(q).unflatten(-1, (-1, 16))
        deq[p] = (values * (block.float() * g2.view(-1, 1, 1)).unsqueeze(-1)).flatten(-2)
    a13 = a2 = None
    if input_scales:
        g = torch.Generator().manual_seed(seed)
        ins = {p: (1 + torch.rand(E, generator=g)) / (448 * 6) for p in w}
        for p in w:
            per[p]["input_scale"] = ins[p]
        a13, a2 = torch.maximum(ins["gate"], ins["up"]), ins["down"]
    return _assemble(scheme, per, deq, a13, a2)


def nvfp4(w, seed):
    return _nvfp4(w, "nvfp4", True, True, seed)


def nvfp4_dynamic_input(w, seed):  # no input_scale: the activation global is computed per call
    return _nvfp4(w, "nvfp4", True, False, seed)


def nvfp4_weight_only(w, seed):  # W4A16 ignores the checkpoint's input_scale
    ckpt = _nvfp4(w, "nvfp4_w4a16", True, True, seed)
    ckpt.a13 = ckpt.a2 = None
    return ckpt


def _nvfp4_compressed_tensors(w, scheme, shared_w13, seed) -> Checkpoint:
    """compressed-tensors nvfp4-pack-quantized from bf16 weights: weight_packed, weight_scale,
    and global scales stored as divisors, g = 448 * 6 / amax (weight_global_scale [1],
    input_global_scale [1]); W = e2m1(code) * weight_scale / g."""
    per, deq = {}, {}
    w = {p: wp.bfloat16() for p, wp in w.items()}
    joint_amax = torch.cat((w["gate"], w["up"]), 1).float().abs().amax((1, 2))
    for p, wp in w.items():
        amax = joint_amax if shared_w13 and p != "down" else wp.float().abs().amax((1, 2))
        divisor = (448 * 6) / amax
        q, block = nvfp4_quantize(wp, torch.reciprocal(divisor).view(-1, 1, 1))
        per[p] = {"weight_packed": q, "weight_scale": block, "weight_global_scale": divisor.view(E, 1)}
        values = nvfp4_unpack_by_hand(q).unflatten(-1, (-1, 16))
        deq[p] = (values * (block.float() / divisor.view(-1, 1, 1)).unsqueeze(-1)).flatten(-2)
    g = torch.Generator().manual_seed(seed)
    ins = {p: (1 + torch.rand(E, generator=g)) / (448 * 6) for p in w}
    for p in w:
        per[p]["input_global_scale"] = torch.reciprocal(ins[p]).view(E, 1)
    a13 = torch.maximum(torch.reciprocal(per["gate"]["input_global_scale"]),
                        torch.reciprocal(per["up"]["input_global_scale"])).view(E)
    a2 = torch.reciprocal(per["down"]["input_global_scale"]).view(E)
    if scheme == "nvfp4_w4a16":
        a13 = a2 = None
    return _assemble(scheme, per, deq, a13, a2)


def nvfp4_compressed_tensors(w, seed):
    return _nvfp4_compressed_tensors(w, "nvfp4", True, seed)


def nvfp4_compressed_tensors_weight_only(w, seed):
    return _nvfp4_compressed_tensors(w, "nvfp4_w4a16", True, seed)


def ct_pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [..., K] in [-8, 7] -> compressed-tensors pack-quantized int32 [..., K / 8]: code 8j+i
    in bits 4i..4i+3 of word j, stored as q + 8 (written here from the format's description)."""
    stored = (q.long() + 8).unflatten(-1, (-1, 8))
    words = (stored << (4 * torch.arange(8))).sum(-1)  # < 2^32: wrap to int32's two's complement
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _int4_compressed_tensors(w, scheme, scale_dtype, shapes) -> Checkpoint:
    """compressed-tensors pack-quantized (symmetric int4, one scale per group of g inputs):
    weight_packed int32 [N, K/8], weight_scale [N, K/g] in scale_dtype, weight_shape [2];
    W = q * s with q = clamp(round(w / s), -8, 7), s = amax(group) / 7."""
    group = int(scheme.rsplit("_g", 1)[1])
    per, deq = {}, {}
    for p, wp in w.items():
        groups = wp.unflatten(-1, (-1, group))
        s = (groups.abs().amax(-1) / 7).to(scale_dtype)
        q = (groups / s.float().unsqueeze(-1)).round().clamp(-8, 7)
        per[p] = {"weight_packed": ct_pack_int4(q.flatten(-2)), "weight_scale": s}
        if shapes:
            per[p]["weight_shape"] = torch.tensor([list(wp.shape[1:])] * E)
        deq[p] = (q * s.float().unsqueeze(-1)).flatten(-2)
    return _assemble(scheme, per, deq)


def gptq_pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [..., N, K] in [-8, 7] -> GPTQ qweight int32 [..., K / 8, N]: code 8r+i of column n in
    bits 4i..4i+3 of word (r, n), stored as q + 8 (AutoGPTQ's packing along the input dim)."""
    codes = (q.long() + 8).transpose(-1, -2).unflatten(-2, (-1, 8))  # [..., K/8, 8, N]
    words = (codes << (4 * torch.arange(8)).view(8, 1)).sum(-2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _int4_gptq(w, scheme, v1: bool, g_idx: bool) -> Checkpoint:
    """GPTQ, symmetric, no act-order: qweight int32 [K/8, N], scales fp16 [K/g, N], qzeros int32
    [K/g, N/8] all eight zero points 8 (stored 7 = 0x7 nibbles by AutoGPTQ's v1 format, 8 by v2),
    g_idx [K] = k // g; W = (code - 8) * s."""
    group = int(scheme.rsplit("_g", 1)[1])
    per, deq = {}, {}
    for p, wp in w.items():
        n, k = wp.shape[1:]
        groups = wp.unflatten(-1, (-1, group))
        s = (groups.abs().amax(-1) / 7).half()  # [E, N, K/g]
        q = (groups / s.float().unsqueeze(-1)).round().clamp(-8, 7).flatten(-2)
        zero_word = 0x77777777 if v1 else 0x88888888 - 2**32
        per[p] = {"qweight": gptq_pack_int4(q), "scales": s.transpose(-1, -2).contiguous(),
                  "qzeros": torch.full((E, k // group, n // 8), zero_word, dtype=torch.int32)}
        if g_idx:
            per[p]["g_idx"] = (torch.arange(k) // group).int().expand(E, k)
        deq[p] = q * s.float().repeat_interleave(group, -1)
    return _assemble(scheme, per, deq, checkpoint_format="gptq" if v1 else "gptq_v2")


def int4_g64_gptq(w, seed):  # AutoGPTQ v1: zeros stored as 7, g_idx stored
    return _int4_gptq(w, "int4_w4a16_g64", True, True)


def int4_g32_gptq_v2(w, seed):  # GPTQModel v2: zeros stored as 8, no g_idx
    return _int4_gptq(w, "int4_w4a16_g32", False, False)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 (two's complement), as safetensors stores them."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_n(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[..., R, N] in [0, 15] -> int32 [..., R, N / 8]: nibble i (bits 4i..4i+3) of word j holds
    column 8j + order[i] (GPTQ's qzeros: in order; AutoAWQ's GEMM qweight / qzeros: its order_map)."""
    v = values.long().unflatten(-1, (-1, 8))[..., list(order)]
    return as_int32((v << (4 * torch.arange(8))).sum(-1))


AWQ_ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear


def asym_by_hand(wp: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """AWQ / GPTQ asymmetric int4 of [E, N, K]: per group s = (max - min) / 15 over the range
    widened to hold 0, z = round(-min / s), q = clamp(round(w / s) + z, 0, 15) against the stored
    s -> (q [E, N, K], z [E, N, K/g] unsigned ints, s [E, N, K/g] in scale_dtype); W = (q - z) * s."""
    groups = wp.float().unflatten(-1, (-1, group))
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).to(scale_dtype)
    z = (-lo / s.float()).round().clamp(0, 15)
    q = ((groups / s.float().unsqueeze(-1)).round() + z.unsqueeze(-1)).clamp(0, 15)
    return q.flatten(-2).long(), z.long(), s


def asym_tensors(fmt: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """One projection's [E, N, K] unsigned codes q, [E, N, K/g] zero points z and scales s as the
    checkpoint format `fmt` stores them (packed here from each format's description)."""
    if fmt in ("gptq", "gptq_v2"):  # qweight [K/8, N] as symmetric GPTQ; qzeros [K/g, N/8] in order
        stored = z - 1 if fmt == "gptq" else z  # v1 stores z - 1
        return {"qweight": gptq_pack_int4(q - 8), "scales": s.transpose(-1, -2).contiguous(),
                "qzeros": pack_along_n(stored.transpose(-1, -2))}
    if fmt == "awq":  # qweight [K, N/8], qzeros [K/g, N/8], both in AWQ's order; scales [K/g, N]
        return {"qweight": pack_along_n(q.transpose(-1, -2), AWQ_ORDER_MAP),
                "qzeros": pack_along_n(z.transpose(-1, -2), AWQ_ORDER_MAP),
                "scales": s.transpose(-1, -2).contiguous()}
    # compressed-tensors pack-quantized, symmetric=false: weight_packed as symmetric (q + 8 of the signed
    # code q - 8, i.e. q), weight_zero_point [N/8, K/g] packed along N (row 8j+i in nibble i), signed zp + 8 = z
    return {"weight_packed": ct_pack_int4(q - 8), "weight_scale": s,
            "weight_zero_point": pack_along_n(z.transpose(-1, -2)).transpose(-1, -2).contiguous(),
            "weight_shape": torch.tensor([list(q.shape[1:])] * q.shape[0])}


def _int4_asym(w, scheme, fmt, scale_dtype, g_idx=False) -> Checkpoint:
    group = int(scheme.split("_g")[1].split("_")[0])
    per, deq = {}, {}
    for p, wp in w.items():
        q, z, s = asym_by_hand(wp, group, scale_dtype)
        if fmt == "gptq":
            assert z.min() >= 1  # v1 cannot store z = 0 (z - 1 = -1)
        per[p] = asym_tensors(fmt, q, z, s)
        if g_idx:
            per[p]["g_idx"] = (torch.arange(wp.shape[-1]) // group).int().expand(E, -1)
        deq[p] = ((q - z.repeat_interleave(group, -1)) * s.float().repeat_interleave(group, -1)).float()
    return _assemble(scheme, per, deq, checkpoint_format=None if fmt == "compressed-tensors" else fmt)


def int4_g32_gptq_asym(w, seed):  # AutoGPTQ v1, sym=false: zeros stored z - 1, fp16 scales, g_idx
    return _int4_asym(w, "int4_w4a16_g32_zp", "gptq", torch.float16, g_idx=True)


def int4_g64_gptq_v2_asym(w, seed):  # GPTQModel format='gptq_v2', sym=false: zeros stored z
    return _int4_asym(w, "int4_w4a16_g64_zp", "gptq_v2", torch.float16)


def int4_g64_awq(w, seed):  # AutoAWQ GEMM: fp16 scales
    return _int4_asym(w, "int4_w4a16_g64_zp", "awq", torch.float16)


def int4_g32_compressed_tensors_asym(w, seed):  # llm-compressor W4A16 asymmetric: bf16 scales
    return _int4_asym(w, "int4_w4a16_g32_zp", "compressed-tensors", torch.bfloat16)


def int8_w8a16_pack_quantized(w, seed):  # llm-compressor W8A16: 8-bit codes in int32 words
    """weight_packed int32 [N, K/4] (code 4j+b in byte b of word j, stored q + 128), weight_scale
    bf16 [N, 1], weight_shape [2]."""
    per, deq = {}, {}
    for p, wp in w.items():
        s = (wp.abs().amax(-1, keepdim=True) / 127).bfloat16()
        q = (wp / s.float()).round().clamp(-128, 127)
        stored = (q.long() + 128).unflatten(-1, (-1, 4))
        words = (stored << (8 * torch.arange(4))).sum(-1)
        per[p] = {"weight_packed": torch.where(words >= 2**31, words - 2**32, words).to(torch.int32),
                  "weight_scale": s, "weight_shape": torch.tensor([list(wp.shape[1:])] * E)}
        deq[p] = q * s.float()
    return _assemble("int8_w8a16", per, deq)


def mxfp4_compressed_tensors(w, seed):  # mxfp4-pack-quantized: per expert, unlike gpt-oss's fused tensors
    """weight_packed uint8 [N, K/2] (low nibble = even k), weight_scale uint8 e8m0 [N, K/32]."""
    per, deq = {}, {}
    for p, wp in w.items():
        q, scale = mxfp4_quantize(wp)
        per[p] = {"weight_packed": q, "weight_scale": scale}
        deq[p] = mxfp4_dequant_by_hand(q.unflatten(-1, (-1, 16)), scale)
    return _assemble("mxfp4_w4a16", per, deq)


def int4_g32_compressed_tensors(w, seed):  # Kimi-K2's: group 32, bf16 scales, weight_shape stored
    return _int4_compressed_tensors(w, "int4_w4a16_g32", torch.bfloat16, True)


def int4_g64_compressed_tensors(w, seed):  # fp32 scales, no weight_shape
    return _int4_compressed_tensors(w, "int4_w4a16_g64", torch.float32, False)


# compressed-tensors name -> (ModelOpt name, stored value -> ModelOpt's multiplier)
CT_TO_MODELOPT = {"weight_packed": ("weight", None), "weight_scale": ("weight_scale", None),
                  "weight_global_scale": ("weight_scale_2", torch.reciprocal),
                  "input_global_scale": ("input_scale", torch.reciprocal)}


def as_modelopt(ckpt: Checkpoint) -> Checkpoint:
    """The same checkpoint under ModelOpt's names: global scales as multipliers 1 / g, scalar."""
    tensors = {}
    for (e, p, n), t in ckpt.tensors.items():
        name, convert = CT_TO_MODELOPT[n]
        tensors[(e, p, name)] = convert(t).reshape(()) if convert else t
    return Checkpoint(ckpt.scheme, tensors, ckpt.w13, ckpt.w2, ckpt.a13, ckpt.a2)


FORMATS: dict[str, Callable[[dict, int], Checkpoint]] = {
    f.__name__: f for f in (fp8_block, fp8_tensor, fp8_tensor_scale_inv_0d, fp8_tensor_static,
                            fp8_channel, int8_channel_bf16_scales, nvfp4, nvfp4_dynamic_input,
                            nvfp4_weight_only, nvfp4_compressed_tensors,
                            nvfp4_compressed_tensors_weight_only, int4_g32_compressed_tensors,
                            int4_g64_compressed_tensors, int4_g64_gptq, int4_g32_gptq_v2,
                            int8_w8a16_pack_quantized, mxfp4_compressed_tensors, int4_g32_gptq_asym,
                            int4_g64_gptq_v2_asym, int4_g64_awq, int4_g32_compressed_tensors_asym)
}


def make_checkpoint(fmt: str, seed: int | None = None) -> Checkpoint:
    seed = zlib.crc32(fmt.encode()) if seed is None else seed
    return FORMATS[fmt](float_weights(seed), seed + 1)


# gpt-oss MXFP4: fused per layer, gate/up rows interleaved ---------------------------------------
@dataclass
class GptOss:
    tensors: dict[str, torch.Tensor]
    w13: torch.Tensor  # [E, 2I, H] de-interleaved: gate rows, then up
    w2: torch.Tensor
    b13: torch.Tensor
    b2: torch.Tensor


def mxfp4_dequant_by_hand(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, N, K/32, 16] bytes (low nibble first) * 2^(s - 127) -> [E, N, K]."""
    values = nvfp4_unpack_by_hand(blocks)  # [E, N, K/32, 32]
    return (values * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def make_gpt_oss(seed: int = 7) -> GptOss:
    w = float_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    interleaved = torch.stack((w["gate"], w["up"]), 2).flatten(1, 2)  # row 2i gate, 2i+1 up
    tensors = {}
    for name, wt in (("gate_up_proj", interleaved), ("down_proj", w["down"])):
        packed, scales = mxfp4_quantize(wt)
        tensors[f"{name}_blocks"] = packed.unflatten(-1, (-1, 16))
        tensors[f"{name}_scales"] = scales
        tensors[f"{name}_bias"] = (0.1 * torch.randn(*wt.shape[:2], generator=g)).bfloat16()
    d13 = mxfp4_dequant_by_hand(tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"])
    b13 = tensors["gate_up_proj_bias"].float()
    return GptOss(tensors, torch.cat((d13[:, 0::2], d13[:, 1::2]), 1),
                  mxfp4_dequant_by_hand(tensors["down_proj_blocks"], tensors["down_proj_scales"]),
                  torch.cat((b13[:, 0::2], b13[:, 1::2]), 1), tensors["down_proj_bias"].float())


# Loading and the reference ---------------------------------------------------------------------
def layer_for(scheme: str, parallel: ParallelConfig | None = None, **kwargs) -> FusedMoE:
    return FusedMoE(E, TOP_K, H, I, params_dtype=torch.float32, quant=scheme, prequantized=True,
                    parallel=parallel, **kwargs)


def layer_of(ckpt: Checkpoint, parallel: ParallelConfig | None = None, **kwargs) -> FusedMoE:
    """The fp32 layer that loads `ckpt`: its scheme and checkpoint format."""
    return layer_for(ckpt.scheme, parallel, checkpoint_format=ckpt.checkpoint_format, **kwargs)


def load(layer: FusedMoE, ckpt: Checkpoint, loader: str) -> None:
    if loader == "names":
        named = [(f"model.layers.3.mlp.experts.{e}.{HF[p]}.{n}", t)
                 for (e, p, n), t in ckpt.tensors.items()]
        assert layer.load_weights(named) == {n for n, _ in named}
    else:
        for (e, p, n), t in ckpt.tensors.items():
            layer.load_expert_weight(e, f"{p}.{n}", t)
    layer.process_weights_after_loading()


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)


def reference(layer, x, logits, w13, w2, a13=None, a2=None, **kwargs) -> torch.Tensor:
    """fused_experts_ref on the checkpoint's dequantized weights with the scheme's
    fake-quantized activations (static scales: the checkpoint's, fused as the spec says)."""
    weights, ids = layer.route(x, logits)
    key = layer.config.quant.activation
    return fused_experts_ref(x, w13, w2, weights, ids, activation=layer.config.activation,
                             input_transform=activation_transform(key, a13),
                             intermediate_transform=activation_transform(key, a2), **kwargs)


# Forward == reference on the dequantized checkpoint ---------------------------------------------
@pytest.mark.parametrize("loader", ("names", "load_expert_weight"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_matches_dequantized_checkpoint(fmt: str, loader: str) -> None:
    ckpt = make_checkpoint(fmt)
    layer = layer_of(ckpt)
    load(layer, ckpt, loader)
    assert layer.selection.name == "emulation"
    x, logits = batch()
    out = layer(x, logits)
    ref = reference(layer, x, logits, ckpt.w13, ckpt.w2, ckpt.a13, ckpt.a2)
    assert 0.1 < ref.pow(2).mean().sqrt() < 10  # O(1) data, not a vacuous match
    assert rel_error(out, ref) < SAME_MATH_RTOL


def test_gpt_oss_mxfp4_deinterleaved() -> None:
    ckpt = make_gpt_oss()
    layer = layer_for("mxfp4_w4a16", activation="swigluoai", has_bias=True)
    named = [(f"model.layers.0.mlp.experts.{n}", t) for n, t in ckpt.tensors.items()]
    assert layer.load_weights(named) == {n for n, _ in named}
    x, logits = batch()
    out = layer(x, logits)
    ref = reference(layer, x, logits, ckpt.w13, ckpt.w2, w13_bias_LG=ckpt.b13, w2_bias_LH=ckpt.b2)
    assert rel_error(out, ref) < SAME_MATH_RTOL
    # Gate row 0 of expert 1 is the checkpoint's row 0, up row 0 its row 1.
    packed = ckpt.tensors["gate_up_proj_blocks"][1].flatten(-2)
    assert torch.equal(layer.w13_weight[1, 0], packed[0])
    assert torch.equal(layer.w13_weight[1, I], packed[1])


def test_nibble_order_is_low_first() -> None:
    """Hand-packed byte 0x5A: element 0 = code 0xA (-1.0), element 1 = code 0x5 (3.0)."""
    layer = layer_for("nvfp4_w4a16")
    w = float_weights(5)
    ckpt = _nvfp4(w, "nvfp4_w4a16", True, False, 6)
    ckpt.tensors[(0, "gate", "weight")] = ckpt.tensors[(0, "gate", "weight")].clone()
    ckpt.tensors[(0, "gate", "weight")][0, 0] = 0x5A
    load(layer, ckpt, "load_expert_weight")
    d13 = dequantize_weight(layer.w13_weight, layer.w13_scale, "nvfp4_w4a16", layer.w13_global_scale)
    unit = ckpt.tensors[(0, "gate", "weight_scale")][0, 0].float() \
        * ckpt.tensors[(0, "gate", "weight_scale_2")]
    assert torch.equal(d13[0, 0, :2], torch.stack((-1.0 * unit, 3.0 * unit)))


def test_int4_pack_quantized_word_order() -> None:
    """A hand-made word: codes 0..7 of gate row 0 of expert 0 are q = -8, -1, 0, 1, 7, 3, -4, 2,
    stored (q + 8) low nibble first: 0xA4BF9870; the layer dequantizes them in that order, and
    keeps the checkpoint's bf16 scales in a bf16 layer (fp32 in an fp32 one)."""
    ckpt = make_checkpoint("int4_g32_compressed_tensors")
    q = torch.tensor([-8, -1, 0, 1, 7, 3, -4, 2])
    word = 0xA4BF9870 - 2**32  # nibbles from the lowest: 0, 7, 8, 9, F, B, 4, A
    assert ct_pack_int4(q).item() == word
    packed = ckpt.tensors[(0, "gate", "weight_packed")].clone()
    packed[0, 0] = word
    ckpt.tensors[(0, "gate", "weight_packed")] = packed
    for dtype in (torch.float32, torch.bfloat16):
        layer = FusedMoE(E, TOP_K, H, I, params_dtype=dtype, quant=ckpt.scheme, prequantized=True)
        assert layer.w13_scale.dtype == dtype
        load(layer, ckpt, "load_expert_weight")
        if layer.selection.name != "emulation":  # the Triton layout (scales group-major): not read here
            continue
        d13 = dequantize_weight(layer.w13_weight, layer.w13_scale, ckpt.scheme)
        scale = ckpt.tensors[(0, "gate", "weight_scale")][0, 0].float()
        assert torch.equal(d13[0, 0, :8], q.float() * scale)


def unsigned_codes_by_hand(payload: torch.Tensor) -> torch.Tensor:
    """The library's int4 payload uint8 [..., K/2] (two's-complement nibbles, low = even k) -> the
    unsigned codes q = code + 8 [..., K]."""
    nibbles = torch.stack((payload & 0xF, payload >> 4), -1).flatten(-2).long()
    return torch.where(nibbles >= 8, nibbles - 16, nibbles) + 8


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("fmt", ("gptq", "gptq_v2", "awq", "compressed-tensors"))
def test_asymmetric_checkpoint_loads_what_quantize_weights_makes(fmt: str, dtype: torch.dtype) -> None:
    """quantize_weights(..., int4_w4a16_g32_zp) written out in each asymmetric format (codes, zero
    points and scales as the format stores them) loads back bit for bit: payload, scales and
    zero points (z - 8, the scales' dtype); the layer's output is the online-quantized layer's."""
    scheme = "int4_w4a16_g32_zp"
    w = {p: wp.to(dtype) for p, wp in float_weights(21).items()}
    w13, w2 = torch.cat((w["gate"], w["up"]), 1), w["down"]
    q13, q2, params = quantize_weights(w13, w2, scheme)
    per = {"gate": (q13[:, :I], params.w13_scale[:, :I], params.w13_zero[:, :I]),
           "up": (q13[:, I:], params.w13_scale[:, I:], params.w13_zero[:, I:]),
           "down": (q2, params.w2_scale, params.w2_zero)}
    tensors = {}
    for p, (payload, scale, zero) in per.items():
        z = zero.long() + 8
        assert fmt != "gptq" or z.min() >= 1  # v1 cannot store z = 0
        for name, t in asym_tensors(fmt, unsigned_codes_by_hand(payload), z, scale).items():
            tensors |= {(e, p, name): t[e] for e in range(E)}
    layer = FusedMoE(E, TOP_K, H, I, params_dtype=dtype, quant=scheme, prequantized=True,
                     checkpoint_format=None if fmt == "compressed-tensors" else fmt)
    load(layer, Checkpoint(scheme, tensors, w13, w2), "names")
    assert layer.selection.name == "emulation"
    for name, want in (("w13_weight", q13), ("w2_weight", q2), ("w13_scale", params.w13_scale),
                       ("w2_scale", params.w2_scale), ("w13_zero", params.w13_zero), ("w2_zero", params.w2_zero)):
        assert same_bits(getattr(layer, name), want), name
    online = FusedMoE(E, TOP_K, H, I, params_dtype=dtype, quant=scheme)
    with torch.no_grad():
        online.w13_weight.copy_(w13)
        online.w2_weight.copy_(w2)
    x, logits = batch()
    assert torch.equal(layer(x.to(dtype), logits), online(x.to(dtype), logits))


def test_awq_nibble_order() -> None:
    """Hand-made AWQ words (AutoAWQ's order_map [0, 2, 4, 6, 1, 3, 5, 7]): qweight word 0x76543210
    of input 0 holds columns 0..7 = q 0, 4, 1, 5, 2, 6, 3, 7; qzeros word 0xFEDCBA98 of group 0
    holds zero points 8, 12, 9, 13, 10, 14, 11, 15. The layer dequantizes exactly that."""
    assert pack_along_n(torch.tensor([[0, 4, 1, 5, 2, 6, 3, 7]]), AWQ_ORDER_MAP).item() == 0x76543210
    ckpt = make_checkpoint("int4_g64_awq")
    tensors = dict(ckpt.tensors)
    for name, word in (("qweight", 0x76543210), ("qzeros", 0xFEDCBA98 - 2**32)):
        tensors[(1, "up", name)] = tensors[(1, "up", name)].clone()
        tensors[(1, "up", name)][0, 0] = word
    layer = layer_of(ckpt)
    load(layer, Checkpoint(ckpt.scheme, tensors, ckpt.w13, ckpt.w2, checkpoint_format="awq"), "load_expert_weight")
    d13, _ = dequantize_weights(layer.w13_weight, layer.w2_weight, layer.quant_params)
    scale = tensors[(1, "up", "scales")][0, :8].float()
    q, z = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]), torch.tensor([8, 12, 9, 13, 10, 14, 11, 15])
    assert torch.equal(layer.w13_zero[1, I : I + 8, 0], (z - 8).float())
    assert torch.equal(d13[1, I : I + 8, 0], (q - z) * scale)


# Fusing w13 when gate and up scales differ -----------------------------------------------------
# Layer vs the unfused checkpoint's math: one half of w13 carries one more e4m3 rounding
# (weights for fp8, block scales for nvfp4: RMS <= 2^-4 / sqrt(3) = 0.036 each), which GEMM1's
# output and silu(g) * u carry on; measured 0.045 (fp8, gate scale 1/3 of up's), 0.061 (nvfp4).
FUSED_RTOL = {"fp8": 0.06, "nvfp4": 0.1}
# Layer vs the float weights: test_quant's out_tolerance, sqrt(3 r_w^2 + 3 r_a^2) with r = 0.036
# (fp8) and 0.15 (e2m1); measured 0.067 and 0.215.
FLOAT_RTOL = {"fp8": 0.088, "nvfp4": 0.37}


def _halves_within_rounding(d13, w13, scale_gate, scale_up, floor):
    """The half with the larger scale is exact; the other within one e4m3 rounding (2^-4)."""
    exact, rounded = (slice(0, I), slice(I, 2 * I)) if scale_gate >= scale_up \
        else (slice(I, 2 * I), slice(0, I))
    assert torch.equal(d13[:, exact], w13[:, exact])
    err = (d13[:, rounded] - w13[:, rounded]).abs()
    assert (err <= 2**-4 * w13[:, rounded].abs() + floor).all()
    assert not torch.equal(d13[:, rounded], w13[:, rounded])  # the rescale did happen


def test_fp8_tensor_requantizes_to_max_scale() -> None:
    w = float_weights(11)
    ckpt = _fp8_tensor(w, "fp8_w8a8_tensor", "weight_scale", False, (1,), False, 12)
    s_gate = ckpt.tensors[(2, "gate", "weight_scale")]
    s_up = ckpt.tensors[(2, "up", "weight_scale")]
    assert s_up > 2 * s_gate  # the case the fusion exists for
    layer = layer_for("fp8_w8a8_tensor")
    load(layer, ckpt, "names")
    assert layer.w13_scale.shape == (E,) and layer.w13_scale[2] == torch.maximum(s_gate, s_up)
    d13 = layer.w13_weight.float() * layer.w13_scale.view(-1, 1, 1)
    # fp8 subnormals step by 2^-9 of the scale: half of that is the absolute floor.
    _halves_within_rounding(d13[2:3], ckpt.w13[2:3], s_gate, s_up, 2**-10 * s_up)
    x, logits = batch()
    out = layer(x, logits)
    assert rel_error(out, reference(layer, x, logits, ckpt.w13, ckpt.w2)) < FUSED_RTOL["fp8"]
    exact = reference(layer, x, logits, torch.cat((w["gate"], w["up"]), 1), w["down"])
    assert rel_error(out, exact) < FLOAT_RTOL["fp8"]


def test_nvfp4_unifies_global_scales_to_max() -> None:
    w = float_weights(13)
    ckpt = _nvfp4(w, "nvfp4", False, True, 14)
    g_gate = ckpt.tensors[(1, "gate", "weight_scale_2")]
    g_up = ckpt.tensors[(1, "up", "weight_scale_2")]
    assert g_up > 2 * g_gate
    layer = layer_for("nvfp4")
    load(layer, ckpt, "load_expert_weight")
    assert layer.w13_global_scale.shape == (E,)
    assert layer.w13_global_scale[1] == torch.maximum(g_gate, g_up)
    assert torch.equal(layer.a13_scale, ckpt.a13)
    d13 = dequantize_weight(layer.w13_weight, layer.w13_scale, "nvfp4", layer.w13_global_scale)
    # e4m3 subnormals step by 2^-9: the floor is half a step times the largest code (6).
    _halves_within_rounding(d13[1:2], ckpt.w13[1:2], g_gate, g_up, 6 * 2**-10 * g_up)
    x, logits = batch()
    out = layer(x, logits)
    same_ckpt = reference(layer, x, logits, ckpt.w13, ckpt.w2, ckpt.a13, ckpt.a2)
    assert rel_error(out, same_ckpt) < FUSED_RTOL["nvfp4"]
    exact = reference(layer, x, logits, torch.cat((w["gate"], w["up"]), 1), w["down"], ckpt.a13,
                      ckpt.a2)
    assert rel_error(out, exact) < FLOAT_RTOL["nvfp4"]


@pytest.mark.parametrize("scheme", ("nvfp4", "nvfp4_w4a16"))
def test_nvfp4_compressed_tensors_loads_like_modelopt(scheme: str) -> None:
    """Mixtral names, gate and up with different global scales: every processed tensor equals the
    ModelOpt-named load of the same checkpoint bit for bit."""
    ckpt = _nvfp4_compressed_tensors(float_weights(17), scheme, False, 18)
    g_gate = ckpt.tensors[(1, "gate", "weight_global_scale")]
    g_up = ckpt.tensors[(1, "up", "weight_global_scale")]
    assert g_gate > 2 * g_up  # divisors: the up half has the larger multiplier
    ct = layer_for(scheme)
    mixtral = {"gate": "w1", "up": "w3", "down": "w2"}
    named = [(f"model.layers.0.block_sparse_moe.experts.{e}.{mixtral[p]}.{n}", t)
             for (e, p, n), t in ckpt.tensors.items()]
    assert ct.load_weights(named) == {n for n, _ in named}
    ct.process_weights_after_loading()
    modelopt = layer_for(scheme)
    load(modelopt, as_modelopt(ckpt), "names")
    assert ct.w13_global_scale[1] == torch.reciprocal(g_up)
    loaded = dict(ct.named_buffers()) | dict(ct.named_parameters())
    expected = dict(modelopt.named_buffers()) | dict(modelopt.named_parameters())
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        assert same_bits(loaded[name], t), name
    x, logits = batch()
    assert torch.equal(ct(x, logits), modelopt(x, logits))


# Tensor and expert parallelism -----------------------------------------------------------------
@pytest.mark.parametrize("fmt", ("fp8_block", "nvfp4", "fp8_tensor_static", "gpt_oss", "int4_g32_compressed_tensors",
                                 "int4_g64_gptq", "int4_g32_gptq_asym", "int4_g64_awq",
                                 "int4_g32_compressed_tensors_asym"))
def test_tp2_ranks_sum_to_tp1(fmt: str) -> None:
    """Formats whose activation quantization is split-invariant: 128-groups aligned to I_p,
    static scales, weight-only."""
    x, logits = batch()
    outs = []
    for tp in (1, 2):
        total = 0
        for rank in range(tp):
            parallel = ParallelConfig(tp_size=tp, tp_rank=rank)
            if fmt == "gpt_oss":
                layer = layer_for("mxfp4_w4a16", parallel, activation="swigluoai", has_bias=True)
                for name, t in make_gpt_oss().tensors.items():
                    layer.load_fused_experts_weight(name, t)
            else:
                ckpt = make_checkpoint(fmt)
                layer = layer_of(ckpt, parallel)
                load(layer, ckpt, "load_expert_weight")
            total = total + layer(x, logits).double()
        outs.append(total)
    assert rel_error(outs[1], outs[0]) < SAME_MATH_RTOL


@pytest.mark.parametrize("placement", ("linear", "round_robin"))
def test_ep_ranks_load_only_their_experts(placement: str) -> None:
    ckpt = make_checkpoint("fp8_block")
    x, logits = batch()
    full = layer_for("fp8_w8a8_block")
    load(full, ckpt, "names")
    total = 0
    for rank in range(2):
        layer = layer_for("fp8_w8a8_block", ParallelConfig(ep_size=2, ep_rank=rank, placement=placement))
        owned = set(layer.local_to_global.tolist())
        accepted = {e for (e, p, n), t in ckpt.tensors.items() if layer.load_expert_weight(e, f"{p}.{n}", t)}
        assert accepted == owned and len(owned) == E // 2
        layer.process_weights_after_loading()
        assert torch.equal(layer.w13_scale, full.w13_scale[layer.local_to_global])
        total = total + layer(x, logits).double()
    assert rel_error(total, full(x, logits)) < SAME_MATH_RTOL


def test_gpt_oss_ep_rank_takes_its_experts() -> None:
    ckpt = make_gpt_oss()
    layer = layer_for("mxfp4_w4a16", ParallelConfig(ep_size=2, ep_rank=1, placement="round_robin"),
                      activation="swigluoai", has_bias=True)
    for name, t in ckpt.tensors.items():
        layer.load_fused_experts_weight(name, t)
    scales = ckpt.tensors["down_proj_scales"]
    assert torch.equal(layer.w2_scale, scales[[1, 3]])


# Errors ----------------------------------------------------------------------------------------
def _fp8(*shape):
    return torch.randn(*shape).to(FP8_DTYPE)


@dataclass(frozen=True)
class Bad:
    id: str
    scheme: str
    call: Callable[[FusedMoE], object]
    match: str
    kwargs: tuple = ()


BAD = [
    Bad("weight_dtype", "fp8_w8a8_block", lambda m: m.load_expert_weight(1, "gate_proj.weight", torch.randn(I, H)),
        r"expert 1 gate_proj.weight: checkpoint tensor has dtype torch.float32, expected "
        r"torch.float8_e4m3fn \(fp8_w8a8_block, weight \[N, K\] = \[256, 192\]\)"),
    Bad("weight_shape", "fp8_w8a8_block", lambda m: m.load_expert_weight(2, "w2.weight", _fp8(I, H)),
        r"expert 2 w2.weight: checkpoint tensor has shape \(256, 192\), expected \(192, 256\)"),
    Bad("block_scale_shape", "fp8_w8a8_block",
        lambda m: m.load_expert_weight(0, "up_proj.weight_scale_inv", torch.ones(2, 1)),
        r"expert 0 up_proj.weight_scale_inv: checkpoint tensor has shape \(2, 1\), expected \(2, 2\)"),
    Bad("tensor_scale_shape", "fp8_w8a8_tensor",
        lambda m: m.load_expert_weight(0, "gate.weight_scale", torch.ones(2)),
        r"expert 0 gate.weight_scale: checkpoint tensor has shape \(2,\), expected \(\) or \(1,\)"),
    Bad("channel_scale_shape", "int8_w8a8",
        lambda m: m.load_expert_weight(3, "down_proj.weight_scale", torch.ones(I, 1)),
        r"expert 3 down_proj.weight_scale: .* shape \(256, 1\), expected \(192, 1\) or \(1,\)"),
    Bad("int8_scale_dtype", "int8_w8a8",
        lambda m: m.load_expert_weight(3, "down_proj.weight_scale", torch.ones(H, 1, dtype=torch.int32)),
        r"dtype torch.int32, expected torch.float32 or torch.bfloat16 or torch.float16"),
    Bad("nvfp4_unpacked", "nvfp4",
        lambda m: m.load_expert_weight(0, "gate_proj.weight", torch.zeros(I, H, dtype=torch.uint8)),
        r"shape \(256, 192\), expected \(256, 96\) \(nvfp4, weight \[N, K\] = \[256, 192\]\)"),
    Bad("nvfp4_scale_dtype", "nvfp4",
        lambda m: m.load_expert_weight(0, "gate_proj.weight_scale", torch.ones(I, H // 16)),
        r"gate_proj.weight_scale: checkpoint tensor has dtype torch.float32, expected torch.float8_e4m3fn"),
    Bad("global_on_fp8", "fp8_w8a8_block",
        lambda m: m.load_expert_weight(0, "gate_proj.weight_scale_2", torch.ones(())),
        r"weight_scale_2 is NVFP4's global scale; fp8_w8a8_block has none"),
    Bad("static_on_dynamic", "fp8_w8a8_tensor",
        lambda m: m.load_expert_weight(0, "w1.input_scale", torch.ones(1)),
        r"expert 0 w1.input_scale: fp8_w8a8_tensor computes activation scales at run time"),
    Bad("unknown_tensor", "fp8_w8a8_block",
        lambda m: m.load_expert_weight(0, "w1.weight_offset", torch.ones(1)),
        r"unknown checkpoint tensor 'weight_offset' in shard 'w1.weight_offset'"),
    Bad("int4_zero_point", "int4_w4a16_g32",
        lambda m: m.load_weights([("mlp.experts.0.gate_proj.weight_zero_point", torch.zeros(1, 6, dtype=torch.int32))]),
        r"expert 0 gate_proj.weight_zero_point: the checkpoint is asymmetric \(a zero point per group\), "
        r"int4_w4a16_g32 symmetric: it loads as 'int4_w4a16_g32_zp'"),
    Bad("fp8_zero_point", "fp8_w8a8_block",
        lambda m: m.load_expert_weight(0, "w2.weight_zero_point", torch.zeros(H // 8, 2, dtype=torch.int32)),
        r"expert 0 w2.weight_zero_point: the checkpoint is asymmetric .* fp8_w8a8_block symmetric: fusedmoe runs "
        r"zero points with int4 groups only"),
    Bad("zp_qzeros_without_format", "int4_w4a16_g32_zp",
        lambda m: m.load_expert_weight(0, "up_proj.qzeros", torch.zeros(H // 32, I // 8, dtype=torch.int32)),
        r"expert 0 up_proj.qzeros: GPTQ and AWQ store zero points alike but differently .* build the layer with "
        r"checkpoint_format= one of \('gptq', 'gptq_v2', 'awq'\)"),
    Bad("zp_qzeros_shape", "int4_w4a16_g32_zp",
        lambda m: m.load_expert_weight(0, "up_proj.qzeros", torch.zeros(I // 8, H // 32, dtype=torch.int32)),
        r"expert 0 up_proj.qzeros: expected int32 \(6, 32\) \(GPTQ / AWQ zero points, packed along N, of \[N, K\] = "
        r"\[256, 192\], g = 32\), got torch.int32 \(32, 6\)", (("checkpoint_format", "gptq"),)),
    Bad("ct_zero_point_transposed", "int4_w4a16_g32_zp",
        lambda m: m.load_expert_weight(1, "down_proj.weight_zero_point", torch.zeros(I // 32, H // 8, dtype=torch.int32)),
        r"expert 1 down_proj.weight_zero_point: expected int32 \(24, 8\) \(compressed-tensors zero points, packed "
        r"along N, of \[N, K\] = \[192, 256\], g = 32\), got torch.int32 \(8, 24\)"),
    Bad("ct_zero_point_unpacked", "int4_w4a16_g32_zp",
        lambda m: m.load_expert_weight(1, "down_proj.weight_zero_point", torch.zeros(H, I // 32, dtype=torch.int8)),
        r"expert 1 down_proj.weight_zero_point: expected int32 \(24, 8\) .* got torch.int8 \(192, 8\)"),
    Bad("gptq_v1_zero_15", "int4_w4a16_g32_zp",
        lambda m: m.load_expert_weight(2, "w1.qzeros", torch.full((H // 32, I // 8), 0x77777777, dtype=torch.int32)
                                       .index_fill_(1, torch.tensor([3]), 0x777F7777)),
        r"expert 2 w1.qzeros: 6 zero points stored as 15, the first of output 28 in group 0: the GPTQ v1 format "
        r"\(checkpoint_format 'gptq'\) stores z - 1, so 15 would be z = 16", (("checkpoint_format", "gptq"),)),
    Bad("awq_qweight_without_format", "int4_w4a16_g64_zp",
        lambda m: m.load_expert_weight(0, "gate_proj.qweight", torch.zeros(H, I // 8, dtype=torch.int32)),
        r"expert 0 gate_proj.qweight: checkpoint tensor has shape \(192, 32\), expected \(24, 256\) "
        r"\(int4_w4a16_g64_zp, GPTQ, .*\): AWQ's qweight is \[K, N/8\], build the layer with checkpoint_format='awq'"),
    Bad("awq_qweight_gptq_shaped", "int4_w4a16_g64_zp",
        lambda m: m.load_expert_weight(0, "gate_proj.qweight", torch.zeros(H // 8, I, dtype=torch.int32)),
        r"expert 0 gate_proj.qweight: checkpoint tensor has shape \(24, 256\), expected \(192, 32\) "
        r"\(int4_w4a16_g64_zp, AWQ, weight \[N, K\] = \[256, 192\]\)$", (("checkpoint_format", "awq"),)),
    Bad("zp_two_namings", "int4_w4a16_g32_zp",
        lambda m: (m.load_expert_weight(0, "w1.qzeros", torch.zeros(H // 32, I // 8, dtype=torch.int32)),
                   m.load_expert_weight(1, "w1.weight_zero_point", torch.zeros(I // 8, H // 32, dtype=torch.int32))),
        r"expert 1 w1.weight_zero_point: this layer already loaded weight_zero tensors named 'qzeros'",
        (("checkpoint_format", "gptq_v2"),)),
    Bad("int4_act_order", "int4_w4a16_g32",
        lambda m: m.weight_loader(torch.zeros(H, dtype=torch.int32), "experts.w13_weight_g_idx", "w1", 0),
        r"expert 0 w1.weight_g_idx: input columns out of group order: the checkpoint uses GPTQ activation "
        r"reordering"),
    Bad("int4_unpacked", "int4_w4a16_g32",
        lambda m: m.load_expert_weight(0, "up_proj.weight_packed", torch.zeros(I, H // 2, dtype=torch.uint8)),
        r"up_proj.weight_packed: checkpoint tensor has shape \(256, 96\), expected \(256, 24\)"),
    Bad("int4_packed_dtype", "int4_w4a16_g32",
        lambda m: m.load_expert_weight(0, "up_proj.weight_packed", torch.zeros(I, H // 8, dtype=torch.int64)),
        r"up_proj.weight_packed: checkpoint tensor has dtype torch.int64, expected torch.int32"),
    Bad("int4_scale_dtype", "int4_w4a16_g64",
        lambda m: m.load_expert_weight(1, "down_proj.weight_scale", torch.ones(H, I // 64, dtype=FP8_DTYPE)),
        r"down_proj.weight_scale: checkpoint tensor has dtype torch.float8_e4m3fn, expected torch.float32 "
        r"or torch.bfloat16 or torch.float16"),
    Bad("int4_weight_shape", "int4_w4a16_g32",
        lambda m: m.load_expert_weight(2, "down_proj.weight_shape", torch.tensor([I, H])),
        r"expert 2 down_proj.weight_shape: the checkpoint's weight is \[256, 192\], this layer's "
        r"\[N, K\] = \[192, 256\]"),
    Bad("gptq_asymmetric", "int4_w4a16_g64",
        lambda m: m.load_weights([("mlp.experts.1.down_proj.qzeros",
                                   torch.full((I // 64, H // 8), 0x77777777, dtype=torch.int32).index_fill_(
                                       0, torch.tensor([1]), 0x76777777))]),
        r"expert 1 down_proj.qzeros: zero points other than 8 \(words \['0x76777777', '0x77777777'\]\): the "
        r"checkpoint is asymmetric \(a zero point per group\), int4_w4a16_g64 symmetric; it loads as "
        r"'int4_w4a16_g64_zp'"),
    Bad("gptq_zeros_shape", "int4_w4a16_g64",
        lambda m: m.load_expert_weight(0, "gate_proj.qzeros", torch.zeros(I // 8, H // 64, dtype=torch.int32)),
        r"expert 0 gate_proj.qzeros: expected int32 \(3, 32\) \(GPTQ zero points of \[N, K\] = \[256, 192\], "
        r"g = 64\), got torch.int32 \(32, 3\)"),
    Bad("gptq_act_order", "int4_w4a16_g64",
        lambda m: m.load_weights([("mlp.experts.2.up_proj.g_idx", torch.arange(H).flip(0) // 64)]),
        r"expert 2 up_proj.g_idx: input columns out of group order: the checkpoint uses GPTQ activation reordering"),
    Bad("gptq_scales_untransposed", "int4_w4a16_g64",
        lambda m: m.load_expert_weight(0, "w3.scales", torch.ones(I, H // 64, dtype=torch.float16)),
        r"expert 0 w3.scales: checkpoint tensor has shape \(256, 3\), expected \(3, 256\) \(int4_w4a16_g64, "
        r"GPTQ, weight \[N, K\] = \[256, 192\]\)"),
    Bad("gptq_on_fp8", "fp8_w8a8_block",
        lambda m: m.load_expert_weight(0, "w1.qweight", torch.zeros(H // 8, I, dtype=torch.int32)),
        r"expert 0 w1.qweight is a GPTQ / AWQ int4 tensor; this layer's scheme is fp8_w8a8_block"),
    Bad("companion_on_nvfp4", "nvfp4",
        lambda m: m.load_expert_weight(0, "w1.weight_shape", torch.tensor([I, H])),
        r"expert 0 w1.weight_shape belongs to a pack-quantized int4 / int8 checkpoint; this layer's scheme is nvfp4"),
    Bad("gptq_zeros_on_int8", "int8_w8a16",
        lambda m: m.load_expert_weight(0, "w2.qzeros", torch.zeros(1, 1, dtype=torch.int32)),
        r"expert 0 w2.qzeros belongs to an int4 \(GPTQ or pack-quantized\) checkpoint; this layer's scheme is "
        r"int8_w8a16"),
    Bad("int8_packed_shape", "int8_w8a16",
        lambda m: m.load_expert_weight(0, "w2.weight_packed", torch.zeros(H, I // 8, dtype=torch.int32)),
        r"expert 0 w2.weight_packed: checkpoint tensor is torch.int32 \(192, 32\), expected int32 \(192, 64\) "
        r"\(pack-quantized int8"),
    Bad("mxfp4_scale_dtype", "mxfp4_w4a16",
        lambda m: m.load_expert_weight(0, "w1.weight_scale", torch.ones(I, H // 32)),
        r"expert 0 w1.weight_scale: checkpoint tensor has dtype torch.float32, expected torch.uint8 "
        r"\(mxfp4_w4a16, weight \[N, K\] = \[256, 192\]\)"),
    Bad("gpt_oss_shape", "mxfp4_w4a16",
        lambda m: m.load_fused_experts_weight("gate_up_proj_blocks", torch.zeros(E, I, H // 32, 16, dtype=torch.uint8)),
        r"gate_up_proj_blocks: checkpoint tensor has shape \(4, 256, 6, 16\), expected "
        r"\(4, 512, 6, 16\) \(gpt-oss MXFP4, E = 4, H = 192, I = 256\)",
        (("activation", "swigluoai"), ("has_bias", True))),
    Bad("gpt_oss_dtype", "mxfp4_w4a16",
        lambda m: m.load_fused_experts_weight("down_proj_scales", torch.zeros(E, H, I // 32)),
        r"down_proj_scales: checkpoint tensor has dtype torch.float32, expected torch.uint8",
        (("activation", "swigluoai"), ("has_bias", True))),
    Bad("ct_global_zero", "nvfp4",
        lambda m: m.load_expert_weight(2, "down_proj.weight_global_scale", torch.zeros(1)),
        r"expert 2 down_proj.weight_global_scale: compressed-tensors stores this global scale as a "
        r"divisor \(448 \* 6 / amax\), so it must be positive; got \[0.0\]"),
    Bad("ct_and_modelopt_names", "nvfp4",
        lambda m: (m.load_expert_weight(0, "w1.weight_scale_2", torch.ones(())),
                   m.load_expert_weight(1, "w1.weight_global_scale", torch.ones(1))),
        r"expert 1 w1.weight_global_scale: this layer already loaded weight_scale_2 tensors named "
        r"'weight_scale_2'; one checkpoint uses one naming"),
    Bad("gpt_oss_on_fp8", "fp8_w8a8_block",
        lambda m: m.load_weights([("mlp.experts.down_proj_blocks", torch.zeros(1))]),
        r"down_proj_blocks: gpt-oss MXFP4 tensors need quant='mxfp4_w4a16' .* this layer has "
        r"quant='fp8_w8a8_block'"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.id)
def test_load_rejects(bad: Bad) -> None:
    layer = layer_for(bad.scheme, **dict(bad.kwargs))
    with pytest.raises(ValueError, match=bad.match):
        bad.call(layer)


def test_quantized_tensor_on_unquantized_layer() -> None:
    layer = FusedMoE(E, TOP_K, H, I, params_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"'gate_proj.weight_scale_inv' is a quantized checkpoint "
                                         r"tensor: build the layer with quant="):
        layer.load_weights([("mlp.experts.0.gate_proj.weight_scale_inv", torch.ones(2, 2))])


@pytest.mark.parametrize(
    ("scheme", "tp", "match"),
    [
        ("fp8_w8a8_block", 4, r"fp8_w8a8_block scales cover 128x128 blocks: the intermediate size "
                              r"per partition I / tp = 256 / 4 = 64 must be a multiple of 128 "
                              r"\(64 % 128 = 64\)"),
        ("nvfp4", 32, r"nvfp4 scales cover groups of 16 inputs: .* 256 / 32 = 8 must be a multiple "
                      r"of 16 \(8 % 16 = 8\)"),
        (None, 1, r"prequantized=True needs quant=<scheme>"),
        ("int4_w4a16_g128", 1, r"int4_w4a16_g128 has one scale per 128 inputs, but w13's K = 192 is not a "
                               r"multiple of 128 \(192 % 128 = 64\)"),
    ],
    ids=("block_tp4", "nvfp4_tp32", "no_scheme", "int4_group_straddles_h"),
)
def test_construction_rejects(scheme, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        layer_for(scheme, ParallelConfig(tp_size=tp))


def test_missing_scale_detected() -> None:
    ckpt = make_checkpoint("nvfp4")
    layer = layer_for("nvfp4")
    for (e, p, n), t in ckpt.tensors.items():
        if (e, p, n) not in ((2, "up", "weight_scale_2"), (3, "down", "input_scale")):
            layer.load_expert_weight(e, f"{p}.{n}", t)
    with pytest.raises(RuntimeError, match=r"never loaded \(expert, shard\): "
                                           r"\[\(2, 'up.weight_scale_2'\), \(3, 'down.input_scale'\)\]"):
        layer.process_weights_after_loading()


def test_missing_compressed_tensors_global_scale_named() -> None:
    ckpt = make_checkpoint("nvfp4_compressed_tensors")
    layer = layer_for("nvfp4")
    load_now = [(f"mlp.experts.{e}.{HF[p]}.{n}", t) for (e, p, n), t in ckpt.tensors.items()
                if (e, p, n) != (1, "up", "weight_global_scale")]
    layer.load_weights(load_now)
    with pytest.raises(RuntimeError, match=r"never loaded \(expert, shard\): "
                                           r"\[\(1, 'up.weight_global_scale'\)\]"):
        layer.process_weights_after_loading()


def test_missing_zero_points_named() -> None:
    ckpt = make_checkpoint("int4_g32_gptq_asym")
    layer = layer_of(ckpt)
    for (e, p, n), t in ckpt.tensors.items():
        if (e, p, n) != (3, "down", "qzeros"):
            layer.load_expert_weight(e, f"{p}.{n}", t)
    with pytest.raises(RuntimeError, match=r"never loaded \(expert, shard\): \[\(3, 'down.qzeros'\)\]"):
        layer.process_weights_after_loading()


@pytest.mark.parametrize(("scheme", "kwargs", "match"), [
    ("int4_w4a16_g32", dict(checkpoint_format="awq"),
     r"checkpoint_format='awq' stores a zero point per group: quant='int4_w4a16_g32' is symmetric; AWQ loads as "
     r"'int4_w4a16_g32_zp'"),
    ("int4_w4a16_g32_zp", dict(checkpoint_format="gptq_v3"),
     r"checkpoint_format='gptq_v3'; expected None or one of \('gptq', 'gptq_v2', 'awq'\)"),
    ("fp8_w8a8_block", dict(checkpoint_format="gptq"),
     r"checkpoint_format='gptq' describes pre-quantized GPTQ / AWQ int4 tensors: .* this layer has "
     r"quant='fp8_w8a8_block', prequantized=True"),
    ("int4_w4a16_g32_zp", dict(checkpoint_format="gptq", prequantized=False),
     r"this layer has quant='int4_w4a16_g32_zp', prequantized=False"),
], ids=("awq_symmetric", "unknown", "fp8", "online"))
def test_checkpoint_format_rejected_at_construction(scheme, kwargs, match) -> None:
    kwargs = dict(dict(quant=scheme, prequantized=True), **kwargs)
    with pytest.raises(ValueError, match=match):
        FusedMoE(E, TOP_K, H, I, params_dtype=torch.float32, **kwargs)


def test_prequantized_layer_with_nothing_loaded_is_refused():
    from fusedmoe import FusedMoE

    layer = FusedMoE(4, 2, 256, 128, params_dtype=torch.float32, quant="fp8_w8a8_block", prequantized=True)
    with pytest.raises(RuntimeError, match="no checkpoint tensors were loaded"):
        layer.process_weights_after_loading()


# On a GPU: the checkpoint through the GPU's backend (Triton; marlin for NVFP4 W4A4) -------------
GPU_RTOL = 3e-2  # bf16 activations and outputs against the fp32 CPU layer (tests/test_gpu_quant.py)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_on_gpu(fmt: str) -> None:
    """The same checkpoint loaded into a bf16 layer on the GPU agrees with the CPU layer
    (emulation: the scheme's math in fp32); weight-only execution (marlin) with the reference on
    the dequantized weights, activations unquantized."""
    ckpt = make_checkpoint(fmt)
    cpu = layer_of(ckpt)
    load(cpu, ckpt, "names")
    gpu = FusedMoE(E, TOP_K, H, I, params_dtype=torch.bfloat16, quant=ckpt.scheme, prequantized=True,
                   checkpoint_format=ckpt.checkpoint_format, device="cuda")
    load(gpu, ckpt, "load_expert_weight")
    assert gpu.selection.name in ("triton", "marlin")
    x, logits = batch()
    x = x.bfloat16().float()  # the GPU layer's input values: fp8 codes flip on bf16 rounding otherwise
    out = gpu(x.cuda().bfloat16(), logits.cuda()).float().cpu()
    if gpu.selection.backend.weight_only_execution:
        weights, ids = cpu.route(x, logits)
        want = fused_experts_ref(x, ckpt.w13, ckpt.w2, weights, ids, activation=cpu.config.activation)
    else:
        want = cpu(x, logits)
    assert 0.1 < want.pow(2).mean().sqrt() < 10
    assert rel_error(out, want) < GPU_RTOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpt_oss_mxfp4_checkpoint_on_gpu() -> None:
    """gpt-oss's fused MXFP4 tensors (gate / up rows interleaved, biases) loaded into a bf16 layer
    on the GPU: the Triton weight-only kernels (re-laid as fragments where the rule says) against
    the reference on the de-interleaved dequantized weights, swigluoai with its biases."""
    ckpt = make_gpt_oss()
    gpu = FusedMoE(E, TOP_K, H, I, params_dtype=torch.bfloat16, quant="mxfp4_w4a16", prequantized=True,
                   activation="swigluoai", has_bias=True, device="cuda")
    named = [(f"model.layers.0.mlp.experts.{n}", t) for n, t in ckpt.tensors.items()]
    assert gpu.load_weights(named) == {n for n, _ in named}
    assert gpu.process_weights_after_loading().name == "triton"
    x, logits = batch()
    x = x.bfloat16().float()
    out = gpu(x.cuda().bfloat16(), logits.cuda()).float().cpu()
    cpu = layer_for("mxfp4_w4a16", activation="swigluoai", has_bias=True)
    weights, ids = cpu.route(x, logits)
    want = fused_experts_ref(x, ckpt.w13, ckpt.w2, weights, ids, activation="swigluoai",
                             w13_bias_LG=ckpt.b13, w2_bias_LH=ckpt.b2)
    assert 0.1 < want.pow(2).mean().sqrt() < 10
    assert rel_error(out, want) < GPU_RTOL
