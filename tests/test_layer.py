"""FusedMoE: create -> load per-expert checkpoint tensors -> process -> forward.

The layer's forward must equal `fused_moe` on the stacked full weights with the same routing;
TP ranks (intermediate split) and EP ranks (expert split) must sum to the single layer.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from cases import assert_close_rel
from fusedmoe import FusedMoE, ParallelConfig, fused_moe
from fusedmoe.activations import GATED

# Legend: T tokens, H hidden, I intermediate, G = 2I or I, E experts.


@dataclass(frozen=True)
class LayerCase:
    name: str
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 64
    intermediate: int = 48
    activation: str = "silu"
    has_bias: bool = False
    correction_bias: bool = False
    apply_router_weight_on_input: bool = False
    routing: tuple[tuple[str, object], ...] = (("renormalize", True),)
    dtype: torch.dtype = torch.float32

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    @property
    def id(self) -> str:
        return f"{self.name}-{str(self.dtype).removeprefix('torch.')}"

    def layer(self, parallel: ParallelConfig | None = None, **options) -> FusedMoE:
        return FusedMoE(
            self.num_experts, self.top_k, self.hidden, self.intermediate,
            params_dtype=self.dtype, activation=self.activation, has_bias=self.has_bias,
            has_correction_bias=self.correction_bias,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            parallel=parallel, **dict(self.routing), **options,
        )


def dbrx_routing(hidden_states, router_logits, top_k, renormalize):
    """DBRX: softmax -> top-k -> divide by the L1 norm (moe_normalize_expert_weights=1)."""
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    return weights / weights.norm(p=1, dim=-1, keepdim=True), ids


DEEPSEEK_ROUTING = (
    ("scoring_func", "sigmoid"), ("use_grouped_topk", True), ("num_expert_group", 4),
    ("topk_group", 2), ("renormalize", True), ("routed_scaling_factor", 2.5),
)
LAYER_CASES = [
    LayerCase("mixtral_softmax_renorm"),
    LayerCase("deepseek_v3_grouped", num_experts=16, top_k=4, correction_bias=True,
              routing=DEEPSEEK_ROUTING),
    LayerCase("gpt_oss_swigluoai_bias", activation="swigluoai", has_bias=True),
    LayerCase("silu_bias", has_bias=True, routing=(("renormalize", False),)),
    LayerCase("nemotron_relu2_no_mul", activation="relu2_no_mul", has_bias=True),
    LayerCase("dbrx_custom_routing", top_k=4, routing=(("custom_routing_function", dbrx_routing),)),
    LayerCase("llama4_weight_on_input", top_k=1, apply_router_weight_on_input=True,
              routing=(("scoring_func", "sigmoid"), ("renormalize", False))),
]
LAYER_CASES += [dataclasses.replace(c, dtype=torch.bfloat16) for c in LAYER_CASES]
# Mistral-4's grouped routing: softmax scores, groups ranked by their two best, no correction bias
MISTRAL4_ROUTING = (("use_grouped_topk", True), ("num_expert_group", 8), ("topk_group", 2),
                    ("group_score", "top2_sum"), ("routed_scaling_factor", 1.5))
LAYER_CASES.append(LayerCase("mistral4_grouped_top2_sum", num_experts=32, top_k=4, routing=MISTRAL4_ROUTING))


# Checkpoint ------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """Full (unsharded) per-expert tensors, float32, as a hub checkpoint stores them."""

    experts: list[dict[str, torch.Tensor]]  # shard (gate/up/down[_bias]) -> tensor
    correction_bias: torch.Tensor | None

    def stacked(self, case: LayerCase) -> dict:
        """fused_moe keyword tensors: w13 [E, G, H] (gate rows, then up), w2 [E, H, I], biases."""

        def stack(fn):
            return torch.stack([fn(e) for e in self.experts]).to(case.dtype)

        halves = ("gate", "up") if case.gated else ("up",)
        out = dict(
            w13=stack(lambda e: torch.cat([e[h] for h in halves])),
            w2=stack(lambda e: e["down"]),
        )
        if case.has_bias:
            out["w13_bias"] = stack(lambda e: torch.cat([e[f"{h}_bias"] for h in halves]))
            out["w2_bias"] = stack(lambda e: e["down_bias"])
        return out


def make_checkpoint(case: LayerCase) -> Checkpoint:
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    H, I = case.hidden, case.intermediate  # noqa: E741

    def randn(*shape, scale):
        return torch.randn(*shape, generator=g) * scale

    experts = []
    for _ in range(case.num_experts):
        shards = {"up": randn(I, H, scale=H**-0.5), "down": randn(H, I, scale=I**-0.5)}
        if case.gated:
            shards["gate"] = randn(I, H, scale=H**-0.5)
        if case.has_bias:
            shards |= {f"{s}_bias": randn(H if s == "down" else I, scale=0.5) for s in list(shards)}
        experts.append(shards)
    bias = randn(case.num_experts, scale=0.3) if case.correction_bias else None
    return Checkpoint(experts, bias)


def make_batch(case: LayerCase, num_tokens: int = 29) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + 1)
    x = torch.randn(num_tokens, case.hidden, generator=g).to(case.dtype)
    logits = torch.randn(num_tokens, case.num_experts, generator=g)
    return x, logits


HF_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def _named(ckpt: Checkpoint, prefix: str, names: dict[str, str]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for e, shards in enumerate(ckpt.experts):
        for shard, tensor in shards.items():
            proj, _, bias = shard.partition("_")
            out.append((f"{prefix}.experts.{e}.{names[proj]}.{'bias' if bias else 'weight'}", tensor))
    return out


def load_hf(layer: FusedMoE, ckpt: Checkpoint) -> None:
    named = _named(ckpt, "model.layers.0.mlp", HF_NAMES)
    extra = [("model.layers.0.mlp.gate.weight", torch.randn(3, 3))]  # the router: not ours
    assert layer.load_weights(named + extra) == {n for n, _ in named}


def load_mixtral(layer: FusedMoE, ckpt: Checkpoint) -> None:
    named = _named(ckpt, "model.layers.0.block_sparse_moe", MIXTRAL_NAMES)
    assert layer.load_weights(named) == {n for n, _ in named}


def load_vllm_weight_loader(layer: FusedMoE, ckpt: Checkpoint) -> None:
    for e, shards in enumerate(ckpt.experts):
        for shard, tensor in shards.items():
            proj, _, bias = shard.partition("_")
            param = "w2" if proj == "down" else "w13"
            layer.weight_loader(tensor, f"experts.{param}_{'bias' if bias else 'weight'}",
                                MIXTRAL_NAMES[proj], e)


def load_per_expert(layer: FusedMoE, ckpt: Checkpoint) -> None:
    for e, shards in enumerate(ckpt.experts):
        for shard, tensor in shards.items():
            layer.load_expert_weight(e, shard, tensor)


LOADERS: dict[str, Callable[[FusedMoE, Checkpoint], None]] = {
    "hf_names": load_hf,
    "mixtral_names": load_mixtral,
    "weight_loader": load_vllm_weight_loader,
    "load_expert_weight": load_per_expert,
}


def build(case: LayerCase, ckpt: Checkpoint, parallel: ParallelConfig | None = None,
          loader: str = "load_expert_weight", **options) -> FusedMoE:
    layer = case.layer(parallel, **options)
    LOADERS[loader](layer, ckpt)
    if ckpt.correction_bias is not None:
        layer.e_score_correction_bias.copy_(ckpt.correction_bias)
    layer.process_weights_after_loading()
    return layer


def functional(case: LayerCase, ckpt: Checkpoint, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return fused_moe(
        x, router_logits=logits, top_k=case.top_k, activation=case.activation,
        apply_router_weight_on_input=case.apply_router_weight_on_input,
        e_score_correction_bias=ckpt.correction_bias, **ckpt.stacked(case), **dict(case.routing),
    )


# Forward == fused_moe ---------------------------------------------------------------------------
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.id)
def test_forward_equals_fused_moe(case: LayerCase, loader: str) -> None:
    ckpt = make_checkpoint(case)
    layer = build(case, ckpt, loader=loader)
    assert layer.selection.name == "cpu"
    x, logits = make_batch(case)
    out = layer(x, logits)
    assert out.dtype == case.dtype
    assert_close_rel(out, functional(case, ckpt, x, logits), case.dtype)


def test_group_score_reaches_the_routing() -> None:
    """Guard the data and the plumbing: the Mistral-4 case's layer output changes when the
    layer is built without its group_score (the groups ranked by their best score instead)."""
    case = next(c for c in LAYER_CASES if c.name == "mistral4_grouped_top2_sum")
    ckpt = make_checkpoint(case)
    x, logits = make_batch(case)
    by_max = dataclasses.replace(case, routing=tuple(kv for kv in case.routing if kv[0] != "group_score"))
    with torch.no_grad():
        given = build(case, ckpt)(x, logits)
        default = build(by_max, ckpt)(x, logits)
    assert (given - default).abs().amax() > 1e-3


def test_correction_bias_changes_routing() -> None:
    """Guard the data: the DeepSeek case's correction bias is not a no-op."""
    case = next(c for c in LAYER_CASES if c.correction_bias)
    ckpt = make_checkpoint(case)
    x, logits = make_batch(case)
    without = dataclasses.replace(ckpt, correction_bias=torch.zeros(case.num_experts))
    assert not torch.allclose(functional(case, ckpt, x, logits), functional(case, without, x, logits))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
def test_leading_batch_dims(dtype: torch.dtype) -> None:
    case = dataclasses.replace(LAYER_CASES[0], dtype=dtype)
    layer = build(case, make_checkpoint(case))
    x, logits = make_batch(case, num_tokens=2 * 7)
    out = layer(x.reshape(2, 7, case.hidden), logits.reshape(2, 7, case.num_experts))
    assert out.shape == (2, 7, case.hidden)
    assert torch.equal(out.reshape(14, case.hidden), layer(x, logits))


@pytest.mark.parametrize("backend", ("auto", "torch"))
def test_inplace_overwrites_hidden_states(backend: str) -> None:
    """inplace=True (the seeds' use_inplace): forward returns hidden_states, overwritten with the
    output the out-of-place layer gives; a non-contiguous input is written back too; an input
    autograd tracks is left alone."""
    case = LAYER_CASES[0]
    ckpt = make_checkpoint(case)
    ref_layer = build(case, ckpt, backend=backend)
    layer = build(case, ckpt, backend=backend, inplace=True)
    assert layer.selection.name == ("cpu" if backend == "auto" else "torch")
    x, logits = make_batch(case, num_tokens=9)
    want = ref_layer(x, logits)
    h = x.clone()
    got = layer(h, logits)
    assert got is h and torch.equal(h, want)
    x2, logits2 = make_batch(case, num_tokens=14)
    want2 = ref_layer(x2, logits2).reshape(2, 7, case.hidden)
    h2 = torch.empty(7, 2, case.hidden, dtype=x2.dtype).transpose(0, 1)  # [2, 7, H]: forward's reshape copies
    h2.copy_(x2.reshape(2, 7, case.hidden))
    assert not h2.is_contiguous()
    assert layer(h2, logits2.reshape(2, 7, -1)) is h2 and torch.equal(h2, want2)
    tracked = x.clone().requires_grad_()
    out = layer(tracked, logits)
    assert out is not tracked and torch.equal(tracked.detach(), x)


@pytest.mark.parametrize("case", [c for c in LAYER_CASES if c.name in
                                  ("mixtral_softmax_renorm", "deepseek_v3_grouped", "gpt_oss_swigluoai_bias",
                                   "llama4_weight_on_input")], ids=lambda c: c.id)
def test_cpu_layer_compiles_fullgraph(case: LayerCase) -> None:
    """torch.compile(fullgraph=True) of a CPU layer: the cpu backend is the custom op
    fusedmoe::cpu_experts (its segment loop has data-dependent sizes); the same output as eager,
    in place too."""
    ckpt = make_checkpoint(case)
    layer = build(case, ckpt)
    assert layer.selection.name == "cpu"
    x, logits = make_batch(case, num_tokens=11)
    want = layer(x, logits)
    torch._dynamo.reset()  # each layer instance is a recompile of forward: stay under the limit
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close_rel(compiled(x, logits), want, case.dtype)
    inplace = build(case, ckpt, inplace=True)
    h = x.clone()
    torch.compile(inplace, fullgraph=True, backend="aot_eager")(h, logits)
    assert_close_rel(h, want, case.dtype)


@pytest.mark.parametrize(("backend", "quant"), [("torch", None), ("emulation", "fp8_w8a8_block"),
                                              ("emulation", "mxfp4_w4a16")])
def test_torch_and_emulation_layers_compile_fullgraph(backend: str, quant: str | None) -> None:
    """Backends without a custom op of their own (the reference loop, emulation's dequantized
    cache) go into the trace as fusedmoe::fused_experts naming them: the eager output, in place
    too."""
    E, K, H, I = 6, 2, 128, 64
    gen = torch.Generator().manual_seed(37)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    x, logits = torch.randn(9, H, generator=gen), torch.randn(9, E, generator=gen)
    outs = []
    for inplace in (False, True):
        layer = FusedMoE(E, K, H, I, params_dtype=torch.float32, backend=backend, quant=quant, inplace=inplace)
        for e in range(E):
            layer.load_expert_weight(e, "gate_proj", w13[e, :I])
            layer.load_expert_weight(e, "up_proj", w13[e, I:])
            layer.load_expert_weight(e, "down_proj", w2[e])
        assert layer.process_weights_after_loading().name == backend
        want = layer(x.clone(), logits)
        torch._dynamo.reset()
        h = x.clone()
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(h, logits)
        assert torch.equal(got, want)
        outs.append(h)
    assert torch.equal(outs[0], x) and torch.equal(outs[1], want)


def test_batched_cpu_layer_compiles_fullgraph() -> None:
    """The batched layout on CPU (dispatch torch ops, batched_torch's per-expert loop as the op
    fusedmoe::batched_reference): the eager output; opcheck on the op."""
    from fusedmoe.backends.torch_ref import batched_reference_op

    E, K, H, I = 8, 2, 64, 32
    gen = torch.Generator().manual_seed(41)
    layer = FusedMoE(E, K, H, I, params_dtype=torch.float32, activation="swigluoai", has_bias=True,
                     activation_format="batched")
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / H**0.5)
    assert layer.process_weights_after_loading().name == "batched_torch"
    x, logits = torch.randn(7, H, generator=gen), torch.randn(7, E, generator=gen)
    want = layer(x, logits)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x, logits), want)
    x_b = torch.randn(E, 4, H, generator=gen)
    counts = torch.tensor([0, 4, 1, 3, 2, 0, 4, 1], dtype=torch.int32)
    torch.library.opcheck(batched_reference_op, (x_b, counts, layer.w13_weight, layer.w2_weight, layer.w13_bias,
                                                 layer.w2_bias, "swigluoai", False, 1.702, 7.0))


def test_cpu_layer_exports() -> None:
    """torch.export of a CPU layer: the program holds fusedmoe::cpu_experts and runs as the layer."""
    case = LAYER_CASES[0]
    layer = build(case, make_checkpoint(case))
    x, logits = make_batch(case, num_tokens=6)
    program = torch.export.export(layer, (x, logits))
    targets = [str(node.target) for node in program.graph.nodes]
    assert "fusedmoe.cpu_experts.default" in targets
    assert torch.equal(program.module()(x, logits), layer(x, logits))


def test_cpu_experts_opcheck() -> None:
    """torch.library.opcheck on fusedmoe::cpu_experts and its _out form (schema, fake kernel,
    dispatch), with biases and an expert_map."""
    from fusedmoe.backends.cpu import cpu_experts_op, cpu_experts_out_op
    from fusedmoe.routing import select_experts

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 32, generator=gen)
    w13, w2 = torch.randn(3, 48, 32, generator=gen) / 6, torch.randn(3, 32, 24, generator=gen) / 5
    b13, b2 = torch.randn(3, 48, generator=gen), torch.randn(3, 32, generator=gen)
    w, ids = select_experts(x, torch.randn(6, 5, generator=gen), 2)
    expert_map = torch.tensor([0, -1, 1, -1, 2], dtype=torch.int32)
    args = (x, w13, w2, w, ids, b13, b2, expert_map, 5, "silu", False, 1.702, None)
    torch.library.opcheck(cpu_experts_op, args)
    torch.library.opcheck(cpu_experts_out_op, (*args[:13], torch.empty_like(x)))


def test_cpu_backend_eager_is_differentiable() -> None:
    """Eager CPU calls run the experts' torch ops themselves (not the custom op, which has no
    autograd): gradients reach the input."""
    case = LAYER_CASES[0]
    layer = build(case, make_checkpoint(case))
    x, logits = make_batch(case, num_tokens=5)
    tracked = x.clone().requires_grad_()
    layer(tracked, logits).square().sum().backward()
    assert tracked.grad is not None and tracked.grad.abs().sum() > 0


def test_zero_tokens() -> None:
    case = LAYER_CASES[0]
    layer = build(case, make_checkpoint(case))
    x, logits = make_batch(case, num_tokens=0)
    assert layer(x, logits).shape == (0, case.hidden)


# Tensor and expert parallelism -----------------------------------------------------------------
PARALLEL_CASES = [c for c in LAYER_CASES if c.name in
                  ("mixtral_softmax_renorm", "deepseek_v3_grouped", "gpt_oss_swigluoai_bias",
                   "nemotron_relu2_no_mul", "llama4_weight_on_input")]
SPLITS = {
    "tp2": [ParallelConfig(tp_size=2, tp_rank=r) for r in range(2)],
    "ep2_linear": [ParallelConfig(ep_size=2, ep_rank=r) for r in range(2)],
    "ep2_round_robin": [ParallelConfig(ep_size=2, ep_rank=r, placement="round_robin") for r in range(2)],
    "ep4_round_robin": [ParallelConfig(ep_size=4, ep_rank=r, placement="round_robin") for r in range(4)],
    "tp2_ep2": [ParallelConfig(tp_size=2, tp_rank=t, ep_size=2, ep_rank=r)
                for t in range(2) for r in range(2)],
}


# Every split in float32; bf16 once per case (its partial sums round separately, as on GPUs).
PARALLEL_PARAMS = [
    pytest.param(case, split, id=f"{case.id}-{split}")
    for case in PARALLEL_CASES for split in SPLITS
    if case.dtype == torch.float32 or split in ("tp2", "ep2_round_robin")
]


@pytest.mark.parametrize(("case", "split"), PARALLEL_PARAMS)
def test_ranks_sum_to_single_layer(case: LayerCase, split: str) -> None:
    """Each rank loads the same full checkpoint; the sum of the partial outputs (what the
    all-reduce computes) equals one unsplit layer. Down biases are counted once."""
    ckpt = make_checkpoint(case)
    x, logits = make_batch(case)
    full = build(case, ckpt)(x, logits)
    partial_sum = sum(build(case, ckpt, p)(x, logits).double() for p in SPLITS[split])
    assert_close_rel(partial_sum, full, case.dtype)


@pytest.mark.parametrize("placement", ("linear", "round_robin"))
def test_ep_rank_loads_only_its_experts(placement: str) -> None:
    case = LAYER_CASES[0]
    ckpt = make_checkpoint(case)
    for rank in range(2):
        layer = case.layer(ParallelConfig(ep_size=2, ep_rank=rank, placement=placement))
        owned = {e for e in range(8) if (e // 4 == rank if placement == "linear" else e % 2 == rank)}
        accepted = {e for e in range(8) if layer.load_expert_weight(e, "down", ckpt.experts[e]["down"])}
        assert accepted == owned
        assert set(layer.local_to_global.tolist()) == owned
        want_map = torch.full((8,), -1, dtype=torch.int32)
        want_map[layer.local_to_global] = torch.arange(4, dtype=torch.int32)
        assert torch.equal(layer.expert_map, want_map)
        assert layer.w13_weight.shape == (4, 2 * case.intermediate, case.hidden)
        # load_weights consumes the other rank's names too (nobody else will load them).
        named = _named(ckpt, "mlp", HF_NAMES)
        assert layer.load_weights(named) == {n for n, _ in named}


def test_tp_rank_holds_its_slice() -> None:
    case = dataclasses.replace(LAYER_CASES[0], has_bias=True)
    ckpt = make_checkpoint(case)
    half = case.intermediate // 2
    for rank in range(2):
        layer = build(case, ckpt, ParallelConfig(tp_size=2, tp_rank=rank))
        cols = slice(rank * half, (rank + 1) * half)
        e = ckpt.experts[5]
        assert torch.equal(layer.w13_weight[5], torch.cat([e["gate"][cols], e["up"][cols]]))
        assert torch.equal(layer.w2_weight[5], e["down"][:, cols])
        assert torch.equal(layer.w13_bias[5], torch.cat([e["gate_bias"][cols], e["up_bias"][cols]]))
        assert torch.equal(layer.w2_bias[5], e["down_bias"] if rank == 0 else torch.zeros(case.hidden))


# Errors ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadLoad:
    id: str
    case: LayerCase
    call: Callable[[FusedMoE], object]
    match: str
    error: type[Exception] = ValueError


BASE = LAYER_CASES[0]
RELU2 = next(c for c in LAYER_CASES if c.activation == "relu2_no_mul")
BAD_LOADS = [
    BadLoad("wrong_gate_shape", BASE, lambda m: m.load_expert_weight(3, "gate_proj", torch.randn(48, 65)),
            r"expert 3 gate_proj: checkpoint tensor has shape \(48, 65\), expected \(48, 64\)"),
    BadLoad("transposed_down", BASE, lambda m: m.load_expert_weight(6, "w2", torch.randn(48, 64)),
            r"expert 6 w2: checkpoint tensor has shape \(48, 64\), expected \(64, 48\)"),
    BadLoad("wrong_bias_shape", RELU2, lambda m: m.load_expert_weight(1, "down_bias", torch.randn(48)),
            r"expert 1 down_bias: checkpoint tensor has shape \(48,\), expected \(64,\)"),
    BadLoad("unknown_shard", BASE, lambda m: m.load_expert_weight(0, "w4", torch.randn(48, 64)),
            r"unknown shard 'w4'; expected one of \["),
    BadLoad("expert_out_of_range", BASE, lambda m: m.load_expert_weight(8, "up", torch.randn(48, 64)),
            r"expert_id=8 outside \[0, 8\)"),
    BadLoad("gate_on_non_gated", RELU2, lambda m: m.load_expert_weight(0, "gate_proj", torch.randn(48, 64)),
            r"activation 'relu2_no_mul' is not gated"),
    BadLoad("bias_without_has_bias", BASE, lambda m: m.load_expert_weight(0, "down_bias", torch.randn(64)),
            r"'down_bias': the layer was built with has_bias=False"),
    BadLoad("hf_name_bad_shape", BASE,
            lambda m: m.load_weights([("model.layers.0.mlp.experts.2.up_proj.weight", torch.randn(64, 48))]),
            r"expert 2 up_proj: checkpoint tensor has shape \(64, 48\), expected \(48, 64\)"),
]


@pytest.mark.parametrize("bad", BAD_LOADS, ids=lambda b: b.id)
def test_load_rejects(bad: BadLoad) -> None:
    layer = bad.case.layer()
    with pytest.raises(bad.error, match=bad.match):
        bad.call(layer)


@pytest.mark.parametrize(
    ("parallel", "skip", "match"),
    [
        (None, {(2, "up"), (5, "down")}, r"\[\(2, 'up'\), \(5, 'down'\)\]"),
        (ParallelConfig(ep_size=2, ep_rank=1, placement="round_robin"), {(3, "gate")}, r"\[\(3, 'gate'\)\]"),
    ],
    ids=("ep1", "ep2_round_robin"),
)
def test_missing_weights_detected(parallel, skip: set, match: str) -> None:
    case = BASE
    ckpt = make_checkpoint(case)
    layer = case.layer(parallel)
    for e, shards in enumerate(ckpt.experts):
        for shard, tensor in shards.items():
            if (e, shard) not in skip:
                layer.load_expert_weight(e, shard, tensor)
    with pytest.raises(RuntimeError, match=r"checkpoint tensors never loaded \(expert, shard\): " + match):
        layer.process_weights_after_loading()


def test_missing_up_on_non_gated_detected() -> None:
    ckpt = make_checkpoint(RELU2)
    layer = RELU2.layer()
    for e, shards in enumerate(ckpt.experts):
        for shard, tensor in shards.items():
            if (e, shard) != (4, "up"):
                layer.load_expert_weight(e, shard, tensor)
    with pytest.raises(RuntimeError, match=r"\[\(4, 'up'\)\]"):
        layer.process_weights_after_loading()


def test_weights_never_written_raise_before_any_compute() -> None:
    """A full-precision layer whose weights were neither loaded nor written (torch.empty) raises
    at its first forward, naming (expert, shard); EP names global experts; a non-gated layer has
    no gate shard."""
    layer = BASE.layer()
    with pytest.raises(RuntimeError, match=r"neither loaded nor written \(expert, shard\): \[\(0, 'down'\), "
                                           r"\(0, 'gate'\), \(0, 'up'\), \(1, 'down'\)"):
        layer(torch.randn(3, BASE.hidden), torch.randn(3, BASE.num_experts))
    assert layer._kernel is None  # nothing ran
    layer = BASE.layer(ParallelConfig(ep_size=2, ep_rank=1, placement="round_robin"))
    with pytest.raises(RuntimeError, match=rf"\[\(1, 'down'\), \(1, 'gate'\), \(1, 'up'\), \(3, 'down'\).* "
                                           rf"\({3 * BASE.num_experts // 2} in all\)"):
        layer.process_weights_after_loading()
    layer = RELU2.layer()
    with torch.no_grad():
        layer.w2_weight.normal_()
    with pytest.raises(RuntimeError, match=r"\[\(0, 'up'\), \(1, 'up'\)") as err:
        layer.process_weights_after_loading()
    assert "gate" not in str(err.value) and "down" not in str(err.value)


def test_a_deep_copy_keeps_the_never_written_check() -> None:
    """copy.deepcopy of a never-written layer raises as the original does (nn.Parameter's deep copy
    drops Python attributes: the layer carries its marks over); a copy of a written layer runs,
    equal to the original; the copy's parameters are its own."""
    layer = BASE.layer()
    twin = copy.deepcopy(layer)
    with pytest.raises(RuntimeError, match=r"neither loaded nor written"):
        twin(torch.randn(3, BASE.hidden), torch.randn(3, BASE.num_experts))
    with torch.no_grad():
        layer.w13_weight.normal_(std=0.05)
        layer.w2_weight.normal_(std=0.05)
    twin = copy.deepcopy(layer)
    assert twin.w13_weight.data_ptr() != layer.w13_weight.data_ptr()
    x, logits = torch.randn(3, BASE.hidden), torch.randn(3, BASE.num_experts)
    assert torch.equal(twin(x, logits), layer(x, logits))


@pytest.mark.parametrize("how", ["data_copy", "state_dict", "init", "assigned", "some_experts"])
def test_weights_written_directly_are_not_reported(how: str) -> None:
    """Every way of writing the parameters directly counts as written (no loader involved); a
    write that covers some experts names the others."""
    layer = BASE.layer()
    w13 = torch.randn(layer.w13_weight.shape) / BASE.hidden**0.5
    w2 = torch.randn(layer.w2_weight.shape) / BASE.intermediate**0.5
    with torch.no_grad():
        if how == "data_copy":
            layer.w13_weight.data.copy_(w13)
            layer.w2_weight.data.copy_(w2)
        elif how == "state_dict":
            layer.load_state_dict({"w13_weight": w13, "w2_weight": w2}, strict=False)
        elif how == "init":
            torch.nn.init.normal_(layer.w13_weight, std=0.05)
            torch.nn.init.normal_(layer.w2_weight, std=0.05)
        elif how == "assigned":
            layer.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
            layer.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        else:
            layer.w13_weight[1:].copy_(w13[1:])
            layer.w2_weight.copy_(w2)
            with pytest.raises(RuntimeError, match=r"\[\(0, 'gate'\), \(0, 'up'\)\] \(2 in all\)"):
                layer.process_weights_after_loading()
            return
    out = layer(torch.randn(3, BASE.hidden), torch.randn(3, BASE.num_experts))
    assert out.isfinite().all()


def test_loading_after_processing_raises() -> None:
    ckpt = make_checkpoint(BASE)
    layer = build(BASE, ckpt)
    with pytest.raises(RuntimeError, match=r"weights were already processed for backend 'cpu'"):
        layer.load_expert_weight(0, "up", ckpt.experts[0]["up"])


@pytest.mark.parametrize(
    ("x_dtype", "num_experts", "match"),
    [
        (torch.float32, 7, r"router_logits have 7 experts, the layer has 8"),
        (torch.bfloat16, 8, r"hidden_states dtype torch.bfloat16 differs from the layer's torch.float32"),
    ],
    ids=("logits_experts", "x_dtype"),
)
def test_forward_rejects(x_dtype: torch.dtype, num_experts: int, match: str) -> None:
    layer = build(BASE, make_checkpoint(BASE))
    x, logits = make_batch(BASE)
    with pytest.raises(ValueError, match=match):
        layer(x.to(x_dtype), logits[:, :num_experts])


@pytest.mark.parametrize(
    ("parallel", "match"),
    [
        (dict(tp_size=5), r"intermediate_size=48 is not divisible by tp_size=5"),
        (dict(ep_size=3), r"num_experts=8 is not divisible by ep_size=3"),
        (dict(ep_size=2, ep_rank=2), r"ep_rank=2 must be in \[0, ep_size=2\)"),
    ],
    ids=("tp5", "ep3", "ep_rank"),
)
def test_bad_parallel_config(parallel: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BASE.layer(ParallelConfig(**parallel))


@pytest.mark.parametrize("scheme", ["fp8_w8a8_block", "int8_w8a8", "int4_w4a16_g32", "mxfp4_w4a16", "nvfp4"])
def test_layer_online_quantization(scheme):
    """quant=<scheme>: full-precision checkpoint in, quantized payload + scales after processing,
    forward equal to fused_experts on the same quantized weights."""
    from fusedmoe import fused_experts
    from fusedmoe.quant.weights import quantize_weights

    E, K, H, I = 6, 2, 128, 64
    gen = torch.Generator().manual_seed(31)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    layer = FusedMoE(E, K, H, I, params_dtype=torch.float32, quant=scheme)
    for e in range(E):
        layer.load_expert_weight(e, "gate_proj", w13[e, :I])
        layer.load_expert_weight(e, "up_proj", w13[e, I:])
        layer.load_expert_weight(e, "down_proj", w2[e])
    assert layer.process_weights_after_loading().name == "emulation"
    q13, q2, params = quantize_weights(w13, w2, scheme)
    assert torch.equal(layer.w13_weight, q13) and torch.equal(layer.w13_scale, params.w13_scale)
    x = torch.randn(9, H, generator=gen)
    logits = torch.randn(9, E, generator=gen)
    weights, ids = layer.route(x, logits)
    out = layer(x, logits)
    assert torch.allclose(out, fused_experts(x, q13, q2, weights, ids, quant=params), rtol=1e-6, atol=1e-6)


def test_layer_static_activation_scheme_refused():
    with pytest.raises(NotImplementedError, match="static activation scales need calibration"):
        FusedMoE(4, 2, 64, 32, params_dtype=torch.float32, quant="fp8_w8a8_tensor_static")


def _processed_cpu_layer() -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    layer = FusedMoE(4, 2, 32, 16, params_dtype=torch.float32)
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.normal_()
    x, logits = torch.randn(3, 32), torch.randn(3, 4)
    layer(x, logits)  # processes on the CPU: the cpu backend
    assert layer.selection.name == "cpu"
    return layer, x, logits


def test_moved_after_processing_to_a_device_another_backend_runs_raises(monkeypatch) -> None:
    """Weights laid out for one device's backend, then moved where the oracle picks another: a
    clear error before any kernel, naming both devices and both verdicts."""
    from fusedmoe import layer as layer_mod
    from fusedmoe.platform import Platform

    layer, x, logits = _processed_cpu_layer()
    layer.to("meta")
    monkeypatch.setattr(layer_mod.Platform, "for_device",
                        staticmethod(lambda device: Platform("cuda", (9, 0), device_name="NVIDIA H100")))
    with pytest.raises(RuntimeError, match=r"processed its weights on cpu for backend 'cpu', but they are now "
                                           r"on meta, where the oracle selects 'triton'"):
        layer(x.to("meta"), logits.to("meta"))


def test_moved_after_processing_where_no_backend_runs_raises() -> None:
    layer, x, logits = _processed_cpu_layer()
    layer.to("meta")  # an out-of-tree device: nothing registered runs there
    with pytest.raises(RuntimeError, match=r"now on meta, where the oracle selects no backend \(No Unquantized"):
        layer(x.to("meta"), logits.to("meta"))


def test_moved_after_processing_where_the_same_backend_runs_is_kept(monkeypatch) -> None:
    """A move to a device whose platform selects the same backend (another GPU of a kind, there and
    back) keeps the processed weights and kernel; the layer then runs as before."""
    from fusedmoe import layer as layer_mod

    layer, x, logits = _processed_cpu_layer()
    want = layer(x, logits)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    kernel = layer._kernel
    cpu_platform = layer_mod.Platform.for_device("cpu")
    layer.to("meta")
    monkeypatch.setattr(layer_mod.Platform, "for_device", staticmethod(lambda device: cpu_platform))
    layer._check_moved()
    assert layer._processed_device == torch.device("meta") and layer._kernel is kernel
    monkeypatch.undo()
    layer.to_empty(device="cpu")  # back (meta holds no values: they are loaded again)
    layer.load_state_dict(state)
    torch.testing.assert_close(layer(x, logits), want, rtol=0, atol=0)
    assert layer._kernel is kernel and layer._processed_device == torch.device("cpu")


def test_forward_checks_leading_dimensions() -> None:
    layer, x, logits = _processed_cpu_layer()
    with pytest.raises(ValueError, match=r"hidden_states \(2, 3, 32\) and router_logits \(3, 2, 4\) must be "
                                         r"\[..., hidden\] and \[..., experts\] with the same leading dimensions"):
        layer(torch.randn(2, 3, 32), torch.randn(3, 2, 4))
    with pytest.raises(ValueError, match=r"hidden_states \(\) and router_logits \(4,\)"):
        layer(torch.tensor(1.0), torch.randn(4))
    want = layer(x, logits)
    out = layer(x.reshape(1, 3, 32), logits.reshape(1, 3, 4))  # the same leading dims: fine
    torch.testing.assert_close(out.reshape(3, 32), want, rtol=0, atol=0)
    out = layer(x.reshape(1, 3, 32), logits)  # logits of the flattened input: fine, shaped as the input
    assert out.shape == (1, 3, 32)
    torch.testing.assert_close(out.reshape(3, 32), want, rtol=0, atol=0)


@pytest.mark.parametrize("expert_id, match", [
    (torch.tensor(1.0), r"expert_id must be an integer, got a torch.float32 tensor of shape \(\)"),
    (torch.tensor([1, 2]), r"expert_id must be an integer, got a torch.int64 tensor of shape \(2,\)"),
    (1.5, r"expert_id must be an integer, got 1.5 \(float\)"),
    (True, r"expert_id must be an integer, got True \(bool\)"),
    ("1", r"expert_id must be an integer, got '1' \(str\)"),
])
def test_load_expert_weight_rejects_non_integer_ids(expert_id, match) -> None:
    """A float or tensor id matched no expert and loaded nothing, silently (returned False, as for
    an expert on another rank)."""
    layer = FusedMoE(4, 2, 32, 16, params_dtype=torch.float32)
    with pytest.raises(TypeError, match=match):
        layer.load_expert_weight(expert_id, "gate", torch.randn(16, 32))


def test_load_expert_weight_takes_integral_ids_of_any_kind() -> None:
    import numpy as np

    layer = FusedMoE(4, 2, 32, 16, params_dtype=torch.float32)
    for expert_id in (1, np.int64(2), torch.tensor(3, dtype=torch.int32)):
        w = torch.randn(16, 32)
        assert layer.load_expert_weight(expert_id, "gate", w)
        torch.testing.assert_close(layer.w13_weight[int(expert_id), :16], w, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"shard must be a str such as 'gate_proj', got NoneType"):
        layer.load_expert_weight(0, None, torch.randn(16, 32))
    with pytest.raises(TypeError, match=r"the 'gate' tensor of expert 0 must be a torch.Tensor, got list"):
        layer.load_expert_weight(0, "gate", [[0.0] * 32] * 16)


def test_inplace_layer_keeps_a_new_output_for_an_expanded_input() -> None:
    """FusedMoE(inplace=True) writes into hidden_states where it can; an expanded view (its rows
    share memory) gets a new output instead of a copy_ error after the compute."""
    torch.manual_seed(5)
    layer = FusedMoE(4, 2, 32, 16, params_dtype=torch.float32, inplace=True)
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.normal_()
    row, logits = torch.randn(1, 32), torch.randn(3, 4)
    expanded = row.expand(3, 32)
    out = layer(expanded, logits)
    assert out.data_ptr() != expanded.data_ptr()
    torch.testing.assert_close(out, layer(expanded.contiguous(), logits), rtol=0, atol=0)
    torch.testing.assert_close(expanded, row.expand(3, 32), rtol=0, atol=0)


def test_meta_device_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"FusedMoE cannot be built on the meta device: its expert-placement "
                                         r"buffers are computed at construction"):
        FusedMoE(4, 2, 32, 16, device="meta")


@pytest.mark.parametrize("kwargs, match", [
    ({"scoring_func": "relu"}, r"scoring_func='relu'; expected 'softmax' or 'sigmoid'"),
    ({"use_grouped_topk": True}, r"use_grouped_topk=True needs num_expert_group and topk_group"),
    ({"use_grouped_topk": True, "num_expert_group": 3, "topk_group": 1},
     r"num_experts=8 is not divisible by num_expert_group=3"),
    ({"num_expert_group": 2, "topk_group": 1}, r"num_expert_group/topk_group are only used with use_grouped_topk=True"),
    ({"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2, "group_score": "mean"},
     r"group_score='mean'; expected one of \('max', 'top2_sum'\) or None"),
    ({"group_score": "max"}, r"group_score='max' ranks expert groups: it is only used with use_grouped_topk=True"),
    ({"group_score": "max", "custom_routing_function": dbrx_routing},
     r"group_score ranks expert groups of the grouped top-k; a custom_routing_function routes on its own"),
])
def test_routing_arguments_are_checked_at_construction(kwargs, match) -> None:
    """Routing arguments fail when the layer is built, naming the argument (a bad scoring_func
    was reported as routing_method='relu_topk'; grouping errors waited for the first forward)."""
    with pytest.raises(ValueError, match=match):
        FusedMoE(8, 2, 32, 16, params_dtype=torch.float32, **kwargs)


def test_backend_name_and_quant_groups_are_checked_at_construction() -> None:
    """An unknown backend name and an int4 group that does not tile H waited for the first forward."""
    from fusedmoe import BackendRequestError

    with pytest.raises(BackendRequestError, match=r"backend='nope' is not supported for Unquantized MoE"):
        FusedMoE(4, 2, 96, 64, params_dtype=torch.bfloat16, backend="nope")
    with pytest.raises(ValueError, match=r"int4_w4a16_g64 has one scale per 64 inputs, but w13's K = 96"):
        FusedMoE(4, 2, 96, 64, params_dtype=torch.bfloat16, quant="int4_w4a16_g64")
    with pytest.raises(ValueError, match=r"int4_w4a16_g64 has one scale per 64 inputs, but w2's K = 32"):
        FusedMoE(4, 2, 128, 64, params_dtype=torch.bfloat16, quant="int4_w4a16_g64",
                 parallel=ParallelConfig(tp_size=2))


def test_cpu_layer_imports_neither_triton_nor_dynamo() -> None:
    """README: the CPU path never imports triton. torch._dynamo (~1 s of import, and it imports
    triton) stays out too: nothing at import, in an eager CPU forward or in the routing rule
    explain prints may pull it in."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from fusedmoe import FusedMoE, fused_moe\n"
        "layer = FusedMoE(8, 2, 64, 32, params_dtype=torch.float32)\n"
        "with torch.no_grad():\n"
        "    [p.normal_() for p in layer.parameters()]\n"
        "layer.process_weights_after_loading()\n"
        "layer(torch.randn(3, 64), torch.randn(3, 8))\n"
        "fused_moe(torch.randn(3, 64), layer.w13_weight, layer.w2_weight, torch.randn(3, 8), 2)\n"
        "from fusedmoe.routing import routing_path\n"
        "assert routing_path('cuda', 256, 8, True, 8, 4) is None  # explain's rule for a described GPU\n"
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
