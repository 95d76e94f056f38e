"""fusedmoe.checkpoint.load_moe_layer on small checkpoint directories written here (config.json +
safetensors, one file or an index over shards), against the reference on the checkpoint's own
dequantized weights (tests/test_checkpoint.py's formats)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from fusedmoe import select_experts  # noqa: E402
from fusedmoe.checkpoint import load_moe_layer  # noqa: E402
from fusedmoe.reference import fused_experts_ref  # noqa: E402
from test_checkpoint import (  # noqa: E402
    TOP_K,
    E,
    H,
    I,
    asym_by_hand,
    asym_tensors,
    make_checkpoint,
    make_gpt_oss,
    reference,
)

HF = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}


def write(path: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tensors = {n: t.contiguous().clone() for n, t in tensors.items()}  # no two share storage (safetensors)
    if shards == 1:
        safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
        return path
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        safetensors_torch.save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def experts(ckpt, prefix: str, names: dict) -> dict[str, torch.Tensor]:
    return {f"{prefix}experts.{e}.{names[p]}.{n}": t for (e, p, n), t in ckpt.tensors.items()}


def batch(seed: int = 3) -> torch.Tensor:
    return torch.randn(7, H, generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_mixtral_in_one_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    router = torch.randn(E, H, generator=g)
    prefix = "model.layers.1.block_sparse_moe."
    tensors = {f"{prefix}gate.weight": router, "model.layers.0.block_sparse_moe.gate.weight": router}
    for e in range(E):
        tensors |= {f"{prefix}experts.{e}.w1.weight": w13[e, :I], f"{prefix}experts.{e}.w3.weight": w13[e, I:],
                    f"{prefix}experts.{e}.w2.weight": w2[e]}
    config = {"model_type": "mixtral", "num_local_experts": E, "num_experts_per_tok": TOP_K, "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": 2}
    moe = load_moe_layer(write(tmp_path, config, tensors), 1, params_dtype=torch.float32)
    x = batch()
    weights, ids = select_experts(x, x @ router.T, TOP_K, renormalize=True)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    assert rel(moe(x), want) < 1e-5 and want.abs().max() > 0.1


def _ct_int4(group: int, symmetric: bool) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                                           "group_size": group}}}}


# test_checkpoint's int4 formats -> the quantization_config their checkpoint directory carries
INT4_CONFIGS = {
    "int4_g32_gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
    "int4_g32_compressed_tensors": _ct_int4(32, True),
    "int4_g32_gptq_asym": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False},
    "int4_g64_gptq_v2_asym": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False,
                              "checkpoint_format": "gptq_v2"},
    "int4_g64_awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "int4_g32_compressed_tensors_asym": _ct_int4(32, False),
}


@pytest.mark.parametrize("fmt", INT4_CONFIGS)
def test_qwen3_moe_int4_over_shards(tmp_path, fmt):
    """GPTQ / AWQ / pack-quantized int4 experts (asymmetric ones with their zero points), the scheme
    and the GPTQ / AWQ checkpoint format read off the quantization_config, the tensors spread over
    three shards of an index."""
    ckpt = make_checkpoint(fmt)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(1))
    prefix = "model.layers.0.mlp."
    config = {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": TOP_K, "hidden_size": H,
              "moe_intermediate_size": I, "norm_topk_prob": True, "num_hidden_layers": 1,
              "quantization_config": INT4_CONFIGS[fmt]}
    tensors = experts(ckpt, prefix, HF) | {f"{prefix}gate.weight": router}
    moe = load_moe_layer(write(tmp_path, config, tensors, shards=3), 0, params_dtype=torch.float32)
    assert moe.moe.config.quant.name == ckpt.scheme and moe.moe.prequantized
    x = batch()
    weights, ids = select_experts(x, x @ router.T, TOP_K, renormalize=True)
    assert rel(moe(x), fused_experts_ref(x, ckpt.w13, ckpt.w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_qwen2_moe_asymmetric_shared_expert_dequantized_with_its_zero_points(tmp_path, fmt):
    """Qwen2-MoE with AWQ (or GPTQ sym=false) experts and shared expert: the shared expert's qweight /
    qzeros / scales are dequantized at load through the one-expert prequantized layer, zero points
    included, and run with its sigmoid gate."""
    ckpt = make_checkpoint({"awq": "int4_g64_awq", "gptq": "int4_g32_gptq_asym"}[fmt])
    group = 64 if fmt == "awq" else 32
    g = torch.Generator().manual_seed(8)
    shared_i = 128
    prefix = "model.layers.0.mlp."
    tensors = experts(ckpt, prefix, HF) | {f"{prefix}gate.weight": torch.randn(E, H, generator=g),
                                           f"{prefix}shared_expert_gate.weight": torch.randn(1, H, generator=g)}
    dequantized = {}
    for p, shape in {"gate_proj": (shared_i, H), "up_proj": (shared_i, H), "down_proj": (H, shared_i)}.items():
        q, z, s = asym_by_hand(torch.randn(1, *shape, generator=g) / shape[1]**0.5, group, torch.float16)
        tensors |= {f"{prefix}shared_expert.{p}.{n}": t[0] for n, t in asym_tensors(fmt, q, z, s).items()}
        dequantized[p] = ((q - z.repeat_interleave(group, -1)) * s.float().repeat_interleave(group, -1))[0]
    quant = INT4_CONFIGS["int4_g64_awq" if fmt == "awq" else "int4_g32_gptq_asym"]
    config = {"model_type": "qwen2_moe", "num_experts": E, "num_experts_per_tok": TOP_K, "hidden_size": H,
              "moe_intermediate_size": I, "shared_expert_intermediate_size": shared_i, "norm_topk_prob": False,
              "num_hidden_layers": 1, "quantization_config": quant}
    moe = load_moe_layer(write(tmp_path, config, tensors), 0, params_dtype=torch.float32)
    assert torch.equal(moe.moe.shared_experts.down, dequantized["down_proj"])
    x = batch()
    logits = x @ tensors[f"{prefix}gate.weight"].T
    routed = reference(moe.moe, x, logits, ckpt.w13, ckpt.w2)
    d = dequantized
    mlp = torch.nn.functional.silu(x @ d["gate_proj"].T) * (x @ d["up_proj"].T) @ d["down_proj"].T
    mlp = mlp * torch.sigmoid(x @ tensors[f"{prefix}shared_expert_gate.weight"].T)
    assert rel(moe(x), routed + mlp) < 1e-5 and mlp.abs().max() > 0.1


def _deepseek(tmp_path, shared_tensors: dict, **config_changes) -> tuple[Path, object, dict]:
    ckpt = make_checkpoint("fp8_block")
    g = torch.Generator().manual_seed(2)
    prefix = "model.layers.1.mlp."
    tensors = experts(ckpt, prefix, HF) | {f"{prefix}gate.weight": torch.randn(E, H, generator=g),
                                           f"{prefix}gate.e_score_correction_bias": 0.1 * torch.randn(E, generator=g)}
    tensors |= {f"{prefix}{n}": t for n, t in shared_tensors.items()}
    config = {"model_type": "deepseek_v3", "n_routed_experts": E, "num_experts_per_tok": TOP_K, "hidden_size": H,
              "moe_intermediate_size": I, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
              "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
              "topk_method": "noaux_tc", "first_k_dense_replace": 1, "num_hidden_layers": 2,
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}, **config_changes}
    return write(tmp_path, config, tensors), ckpt, {n[len(prefix):]: t for n, t in tensors.items()}


def test_deepseek_v3_fp8_with_grouped_routing_and_a_shared_expert(tmp_path):
    g = torch.Generator().manual_seed(4)
    shared = {"gate_proj": torch.randn(I, H, generator=g) / H**0.5, "up_proj": torch.randn(I, H, generator=g) / H**0.5,
              "down_proj": torch.randn(H, I, generator=g) / I**0.5}
    path, ckpt, tensors = _deepseek(tmp_path, {f"shared_experts.{p}.weight": t for p, t in shared.items()})
    moe = load_moe_layer(path, 1, params_dtype=torch.float32)
    x = batch()
    logits = x @ tensors["gate.weight"].T
    weights, ids = select_experts(x, logits, TOP_K, scoring_func="sigmoid", renormalize=True, use_grouped_topk=True,
                                  num_expert_group=2, topk_group=1, routed_scaling_factor=2.5,
                                  e_score_correction_bias=tensors["gate.e_score_correction_bias"])
    assert torch.equal(moe.moe.route(x, logits)[1], ids)  # the checkpoint's routing, bias included
    routed = reference(moe.moe, x, logits, ckpt.w13, ckpt.w2)
    mlp = torch.nn.functional.silu(x @ shared["gate_proj"].T) * (x @ shared["up_proj"].T) @ shared["down_proj"].T
    assert rel(moe(x), routed + mlp) < 1e-5
    with pytest.raises(ValueError, match="layer 0 of deepseek_v3 is a dense MLP"):
        load_moe_layer(path, 0)
    no_shared, _, _ = _deepseek(tmp_path / "no_shared", {})  # the config gives one; no tensor holds it
    with pytest.raises(ValueError, match=r"layer 1 shared experts \(intermediate 256\) but its checkpoint holds none"):
        load_moe_layer(no_shared, 1)


def test_quantized_shared_experts_are_dequantized_or_left_out(tmp_path):
    """DeepSeek-V3 FP8's shared expert (fp8 weights + block scales) is dequantized at load: the
    shared MLP on the checkpoint's dequantized values, activations unquantized; shared=False
    leaves it out."""
    from fusedmoe.quant.weights import dequantize_weight, quantize_weight

    g = torch.Generator().manual_seed(6)
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    stored, dequantized = {}, {}
    for p, shape in shapes.items():
        q, s, *_ = quantize_weight(torch.randn(1, *shape, generator=g) / shape[1]**0.5, "fp8_w8a8_block")
        stored |= {f"shared_experts.{p}.weight": q[0], f"shared_experts.{p}.weight_scale_inv": s[0]}
        dequantized[p] = dequantize_weight(q, s, "fp8_w8a8_block")[0]
    path, ckpt, _ = _deepseek(tmp_path, stored)
    moe = load_moe_layer(path, 1, params_dtype=torch.float32)
    assert torch.equal(moe.moe.shared_experts.down, dequantized["down_proj"])
    x = batch()
    routed = reference(moe.moe, x, moe.router(x), ckpt.w13, ckpt.w2)
    d = dequantized
    mlp = torch.nn.functional.silu(x @ d["gate_proj"].T) * (x @ d["up_proj"].T) @ d["down_proj"].T
    assert rel(moe(x), routed + mlp) < 1e-5
    alone = load_moe_layer(path, 1, params_dtype=torch.float32, shared=False)
    assert alone.moe.shared_experts is None and rel(alone(x), routed) < 1e-5


def test_gpt_oss_mxfp4_with_router_bias(tmp_path):
    ckpt = make_gpt_oss()
    g = torch.Generator().manual_seed(5)
    router_w, router_b = torch.randn(E, H, generator=g), torch.randn(E, generator=g)
    prefix = "model.layers.0.mlp."
    tensors = {f"{prefix}experts.{n}": t for n, t in ckpt.tensors.items()}
    tensors |= {f"{prefix}router.weight": router_w, f"{prefix}router.bias": router_b}
    config = {"model_type": "gpt_oss", "num_local_experts": E, "num_experts_per_tok": TOP_K, "hidden_size": H,
              "intermediate_size": I, "swiglu_limit": 7.0, "num_hidden_layers": 1,
              "quantization_config": {"quant_method": "mxfp4"}}
    moe = load_moe_layer(write(tmp_path, config, tensors), 0, params_dtype=torch.float32)
    x = batch()
    logits = x @ router_w.T + router_b
    weights, ids = select_experts(x, logits, TOP_K, renormalize=True)
    want = fused_experts_ref(x, ckpt.w13, ckpt.w2, weights, ids, activation="swigluoai", swiglu_limit=7.0,
                             w13_bias_LG=ckpt.b13, w2_bias_LH=ckpt.b2)
    assert rel(moe(x), want) < 1e-5


def test_bad_directories_are_refused_by_what_is_wrong(tmp_path):
    config = {"model_type": "mixtral", "num_local_experts": E, "num_experts_per_tok": TOP_K, "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": 1}
    prefix = "model.layers.0.block_sparse_moe."
    ckpt = make_checkpoint("fp8_block")  # float tensors of its dequantized weights below
    tensors = {f"{prefix}experts.{e}.{MIXTRAL[p]}.weight": (ckpt.w13[e, :I] if p == "gate" else ckpt.w13[e, I:]
                                                             if p == "up" else ckpt.w2[e])
               for e in range(E) for p in MIXTRAL}
    no_router = write(tmp_path / "no_router", config, tensors)
    with pytest.raises(ValueError, match=r"the router weight model.layers.0.block_sparse_moe.gate.weight is missing"):
        load_moe_layer(no_router, 0)
    extra = write(tmp_path / "extra", config, tensors | {f"{prefix}gate.weight": torch.randn(E, H),
                                                          f"{prefix}experts.0.w1.lora_A": torch.randn(4, H)})
    with pytest.raises(ValueError, match=r"tensors no part of the layer took: \['experts.0.w1.lora_A'\]"):
        load_moe_layer(extra, 0)
    with pytest.raises(ValueError, match=r"layer=1 outside \[0, 1\)"):
        load_moe_layer(extra, 1)
    llama = write(tmp_path / "llama", {"model_type": "llama4_text"}, {"x": torch.ones(1)})
    with pytest.raises(ValueError, match=r"model_type 'llama4_text' is not one load_moe_layer reads"):
        load_moe_layer(llama, 0)
    with pytest.raises(ValueError, match=r"config.json"):
        load_moe_layer(tmp_path / "missing", 0)


def _gptq_dir(tmp_path):
    """A one-layer Qwen3-MoE checkpoint directory of GPTQ int4 g32 (v2) experts."""
    ckpt = make_checkpoint("int4_g32_gptq_v2")
    prefix = "model.layers.0.mlp."
    config = {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": TOP_K, "hidden_size": H,
              "moe_intermediate_size": I, "norm_topk_prob": True, "num_hidden_layers": 1,
              "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}}
    return write(tmp_path, config, experts(ckpt, prefix, HF) | {f"{prefix}gate.weight": torch.randn(E, H)})


def test_demo_on_a_checkpoint_directory(tmp_path, capsys):
    """`fusedmoe demo --checkpoint DIR`: the first MoE layer (DeepSeek-V3's first_k_dense_replace
    skipped) against the same layer in fp32 emulation, and timed; a GPTQ checkpoint likewise."""
    from fusedmoe.checkpoint import first_moe_layer
    from fusedmoe.cli import main

    g = torch.Generator().manual_seed(4)
    shared = {f"shared_experts.{p}.weight": torch.randn(*((I, H) if p != "down_proj" else (H, I)), generator=g) / 16
              for p in HF.values()}
    path, _, _ = _deepseek(tmp_path / "ds", shared)
    assert first_moe_layer(path) == 1
    assert main(["demo", "--checkpoint", str(path), "--device", "cpu", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "layer 1 of deepseek_v3" in out and "quant=fp8_w8a8_block" in out and "shared=True" in out
    assert re.search(r"rel. error   \d\.\d\de[+-]\d\d vs the same layer in fp32 \(emulation\) on the CPU: ok", out), out
    # a bf16 layer is held to bf16's tolerance (it was held to float32's: its output was cast first)
    assert main(["demo", "--checkpoint", str(_gptq_dir(tmp_path / "gptq")), "--device", "cpu", "--dtype", "bfloat16",
                 "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "dtype=bfloat16" in out and re.search(r"rel. error   [1-9]\.\d\de-0[2-4] .*: ok", out), out
    with pytest.raises(ValueError, match="no MoE layer of a known family"):
        first_moe_layer(write(tmp_path / "dense", {"model_type": "deepseek_v3", "num_hidden_layers": 1,
                                                   "first_k_dense_replace": 3}, {"x": torch.ones(1)}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["fp8_block", "int4_g32_gptq_v2"])
def test_demo_on_a_checkpoint_directory_on_the_gpu(tmp_path, capsys, fmt):
    """On a GPU the demo holds the GPU layer (Triton, bf16) to the fp32 emulation on the CPU."""
    from fusedmoe.cli import main

    if fmt == "fp8_block":
        path, _, _ = _deepseek(tmp_path, {}, n_shared_experts=0)
    else:
        path = _gptq_dir(tmp_path)
    assert main(["demo", "--checkpoint", str(path), "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "backend      triton" in out and "on the CPU: ok" in out, out
