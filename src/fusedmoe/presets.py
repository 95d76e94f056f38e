"""Shapes and routing of real MoE models, in one registry (CLI, demo, benchmarks, tests).

Sizes are the model's own (per layer, before any split); `bench_tp` is the tensor-parallel
split our benchmarks use for it (the per-GPU intermediate is `intermediate_size / bench_tp`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from fusedmoe.config import MoEConfig, ParallelConfig


@dataclass(frozen=True)
class Preset:
    name: str
    model: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    has_bias: bool = False
    routing: dict = field(default_factory=dict)  # select_experts keywords
    has_correction_bias: bool = False
    apply_router_weight_on_input: bool = False
    bench_tp: int = 1
    checkpoint_quant: str | None = None  # the format the released checkpoint uses
    note: str = ""

    def config(self, *, dtype=torch.bfloat16, tp: int | None = None, **changes) -> MoEConfig:
        tp = self.bench_tp if tp is None else tp
        routing_method = (
            "grouped_topk" if self.routing.get("use_grouped_topk")
            else "llama4" if self.apply_router_weight_on_input
            else f"{self.routing.get('scoring_func', 'softmax')}_topk"
        )
        base = dict(
            dtype=dtype, activation=self.activation, has_bias=self.has_bias,
            parallel=ParallelConfig(tp_size=tp), routing_method=routing_method,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            routed_scaling_factor=self.routing.get("routed_scaling_factor", 1.0),
        )
        base.update(changes)
        return MoEConfig(self.num_experts, self.top_k, self.hidden_size, self.intermediate_size, **base)

    def scaled(self, divisor: int) -> Preset:
        """The same routing with hidden and intermediate sizes divided (rounded up to 16)."""
        if divisor <= 1:
            return self
        def shrink(n: int) -> int:
            return max(16, -(-n // divisor // 16) * 16)
        return dataclasses.replace(
            self, name=f"{self.name}/{divisor}", hidden_size=shrink(self.hidden_size),
            intermediate_size=shrink(self.intermediate_size),
        )

    def weight_bytes(self, dtype=torch.bfloat16, tp: int = 1) -> int:
        rows = 3 if self.activation in ("silu", "gelu", "gelu_tanh", "swigluoai") else 2
        size = dtype.itemsize
        return self.num_experts * rows * self.hidden_size * (self.intermediate_size // tp) * size


_SOFTMAX_RENORM = dict(scoring_func="softmax", renormalize=True)
_DEEPSEEK = dict(
    scoring_func="sigmoid", renormalize=True, use_grouped_topk=True,
    num_expert_group=8, topk_group=4, routed_scaling_factor=2.5,
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 8, 2, 4096, 14336,
               routing=_SOFTMAX_RENORM),
        Preset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 128, 8, 2048, 768, routing=_SOFTMAX_RENORM),
        Preset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 128, 8, 4096, 1536,
               routing=_SOFTMAX_RENORM, bench_tp=4),
        Preset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 256, 8, 7168, 2048, routing=_DEEPSEEK,
               has_correction_bias=True, bench_tp=8, checkpoint_quant="fp8_w8a8_block",
               note="plus 1 shared expert outside the routed experts"),
        Preset("gpt-oss-20b", "openai/gpt-oss-20b", 32, 4, 2880, 2880, activation="swigluoai",
               has_bias=True, routing=_SOFTMAX_RENORM, checkpoint_quant="mxfp4_w4a16",
               note="checkpoint gate/up are interleaved; router has a bias"),
        Preset("gpt-oss-120b", "openai/gpt-oss-120b", 128, 4, 2880, 2880, activation="swigluoai",
               has_bias=True, routing=_SOFTMAX_RENORM, checkpoint_quant="mxfp4_w4a16",
               note="checkpoint gate/up are interleaved; router has a bias"),
        Preset("llama-4-maverick", "meta-llama/Llama-4-Maverick-17B-128E", 128, 1, 5120, 8192,
               routing=dict(scoring_func="sigmoid", renormalize=False),
               apply_router_weight_on_input=True, bench_tp=8,
               note="plus a shared expert; MoE on every other layer"),
        Preset("kimi-k2", "moonshotai/Kimi-K2-Instruct", 384, 8, 7168, 2048,
               routing=dict(_DEEPSEEK, num_expert_group=1, topk_group=1, routed_scaling_factor=2.827),
               has_correction_bias=True, bench_tp=8, checkpoint_quant="fp8_w8a8_block"),
        Preset("glm-4.5-air", "zai-org/GLM-4.5-Air", 128, 8, 4096, 1408,
               routing=dict(_DEEPSEEK, num_expert_group=1, topk_group=1, routed_scaling_factor=1.0),
               has_correction_bias=True, bench_tp=2),
    )
}


def get_preset(name: str) -> Preset:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[key]
