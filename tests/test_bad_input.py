"""Bad inputs raise a clear ValueError/TypeError naming the offending value, before any kernel runs.

Every test here runs with the experts kernels replaced by `raise AssertionError("kernel ran")`
(conftest's `no_kernel`), so an error that only surfaces inside a kernel fails the test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from fusedmoe import BackendRequestError, fused_experts, fused_moe, select_experts
from fusedmoe.backends import REGISTRY

T, E, K, H, I = 5, 4, 2, 32, 24  # noqa: E741 (legend: tokens, experts, top-k, hidden, intermediate)

pytestmark = pytest.mark.usefixtures("no_kernel")  # conftest: any experts kernel that runs fails


@dataclass
class Call:
    """One fused_experts call; `with_` swaps tensors or keyword arguments."""

    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    kwargs: dict = field(default_factory=dict)

    def with_(self, **changes) -> Call:
        kwargs = {k: changes.pop(k) for k in list(changes) if k not in self.__dataclass_fields__}
        return dataclasses.replace(self, **changes, kwargs={**self.kwargs, **kwargs})

    def run(self) -> torch.Tensor:
        return fused_experts(self.x, self.w13, self.w2, self.topk_weights, self.topk_ids, **self.kwargs)


def good_call() -> Call:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    return Call(
        x=torch.randn(T, H, generator=g),
        w13=torch.randn(E, 2 * I, H, generator=g) * H**-0.5,
        w2=torch.randn(E, H, I, generator=g) * I**-0.5,
        topk_weights=torch.rand(T, K, generator=g) + 0.1,
        topk_ids=ids,
    )


def _set_id(value: int) -> Callable[[Call], Call]:
    def mutate(c: Call) -> Call:
        ids = c.topk_ids.clone()
        ids[3, 1] = value
        return c.with_(topk_ids=ids)

    return mutate


def _expert_map(values: list[int], dtype=torch.int32) -> Callable[[Call], Call]:
    return lambda c: c.with_(expert_map=torch.tensor(values, dtype=dtype))


def _all_on_meta(c: Call) -> Call:
    return Call(*(t.to("meta") for t in (c.x, c.w13, c.w2, c.topk_weights, c.topk_ids)), c.kwargs)


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, transposed strides (last two dims)."""
    view = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert view.shape == t.shape and not view.is_contiguous()
    return view


def _inference_copy(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


@dataclass(frozen=True)
class Bad:
    id: str
    mutate: Callable[[Call], Call]
    match: str
    error: type[Exception] = ValueError


BAD_EXPERTS = [
    # ranks
    Bad("x_3d", lambda c: c.with_(x=c.x.reshape(1, T, H)),
        r"hidden_states must be 2-D, got shape \(1, 5, 32\)"),
    Bad("w13_2d", lambda c: c.with_(w13=c.w13[0]), r"w13 must be 3-D, got shape \(48, 32\)"),
    Bad("w2_2d", lambda c: c.with_(w2=c.w2[0]), r"w2 must be 3-D, got shape \(32, 24\)"),
    Bad("ids_1d", lambda c: c.with_(topk_ids=c.topk_ids[:, 0]),
        r"topk_ids must be 2-D, got shape \(5,\)"),
    # sizes
    Bad("w13_hidden", lambda c: c.with_(w13=torch.randn(E, 2 * I, H + 1)),
        r"hidden size mismatch: hidden_states \[5, 32\], w13 \(4, 48, 33\)"),
    Bad("w2_hidden", lambda c: c.with_(w2=torch.randn(E, H + 1, I)),
        r"hidden size mismatch: .* w2 \(4, 33, 24\) \(expected \[E, 32, I\]\)"),
    Bad("w13_rows_gated", lambda c: c.with_(w13=torch.randn(E, 2 * I + 2, H)),
        r"w13 has 50 rows per expert but gated activation 'silu' with intermediate size 24 "
        r"\(w2 \(4, 32, 24\)'s last dimension\) needs 48"),
    Bad("w13_rows_no_mul", lambda c: c.with_(activation="relu2_no_mul"),
        r"w13 has 48 rows per expert but non-gated activation 'relu2_no_mul' with intermediate "
        r"size 24 \(w2 \(4, 32, 24\)'s last dimension\) needs 24"),
    Bad("w2_experts", lambda c: c.with_(w2=c.w2[:3].contiguous()), r"w13 has 4 experts but w2 has 3"),
    Bad("ids_weights_shape", lambda c: c.with_(topk_weights=torch.rand(T, K + 1)),
        r"topk_ids \(5, 2\) and topk_weights \(5, 3\) must both be \[5, top_k\]"),
    Bad("top_k_zero", lambda c: c.with_(topk_ids=c.topk_ids[:, :0], topk_weights=c.topk_weights[:, :0]),
        r"topk_ids \(5, 0\) has no slots: top_k must be >= 1"),
    Bad("ids_rows", lambda c: c.with_(topk_ids=c.topk_ids[:4], topk_weights=c.topk_weights[:4]),
        r"topk_ids \(4, 2\) and topk_weights \(4, 2\) must both be \[5, top_k\]"),
    Bad("top_k_gt_e", lambda c: c.with_(topk_ids=torch.zeros(T, E + 1, dtype=torch.int32),
                                       topk_weights=torch.rand(T, E + 1)),
        r"top_k=5 exceeds the number of experts \(4\)"),
    Bad("w13_bias_shape", lambda c: c.with_(w13_bias=torch.randn(E, I)),
        r"w13_bias has shape \(4, 24\), expected \(4, 48\)"),
    Bad("w2_bias_shape", lambda c: c.with_(w2_bias=torch.randn(E, H + 1)),
        r"w2_bias has shape \(4, 33\), expected \(4, 32\)"),
    # dtypes
    Bad("weights_bf16_x_fp32", lambda c: c.with_(w13=c.w13.bfloat16()),
        r"unquantized weights must match hidden_states dtype torch.float32; got w13 torch.bfloat16"),
    Bad("x_int", lambda c: c.with_(x=c.x.to(torch.int32)),
        r"hidden_states dtype torch.int32 is not one of"),
    Bad("ids_float", lambda c: c.with_(topk_ids=c.topk_ids.float()),
        r"topk_ids must be int32 or int64, got torch.float32"),
    Bad("ids_int16", lambda c: c.with_(topk_ids=c.topk_ids.to(torch.int16)),
        r"topk_ids must be int32 or int64, got torch.int16"),
    Bad("weights_int", lambda c: c.with_(topk_weights=c.topk_ids.long()),
        r"topk_weights must be floating point, got torch.int64"),
    Bad("not_a_tensor", lambda c: c.with_(w13=c.w13.numpy()),
        r"w13 must be a torch.Tensor, got ndarray", TypeError),
    Bad("quant_not_params", lambda c: c.with_(quant={"scheme": "fp8"}),
        r"quant must be a fusedmoe.QuantParams or None, got dict", TypeError),
    # id values (CPU tensors are always validated)
    Bad("id_minus_1", _set_id(-1), r"topk_ids contains -1, outside \[0, 4\)"),
    Bad("id_eq_e", _set_id(E), r"topk_ids contains 4, outside \[0, 4\)"),
    Bad("id_validate_true", lambda c: _set_id(E)(c).with_(validate=True),
        r"topk_ids contains 4, outside \[0, 4\)"),
    # expert_map
    Bad("expert_map_float", _expert_map([0, 1, 2, 3], torch.float32),
        r"expert_map must be a 1-D int32/int64 tensor, got torch.float32 shape \(4,\)"),
    Bad("expert_map_2d", lambda c: c.with_(expert_map=torch.arange(E, dtype=torch.int32).reshape(2, 2)),
        r"expert_map must be a 1-D int32/int64 tensor, got torch.int32 shape \(2, 2\)"),
    Bad("expert_map_length", lambda c: _expert_map([0, 1, 2, 3, -1, -1])(c).with_(global_num_experts=8),
        r"expert_map has 6 entries but global_num_experts=8"),
    Bad("expert_map_value_too_big", _expert_map([0, 1, 4, 3]),
        r"expert_map values must be -1 or in \[0, 4\), found 4"),
    Bad("expert_map_value_below_minus_1", _expert_map([0, -2, 2, 3]),
        r"expert_map values must be -1 or in \[0, 4\), found -2"),
    Bad("global_experts_without_map", lambda c: c.with_(global_num_experts=8),
        r"global_num_experts=8 differs from the 4 experts in w13 but no expert_map"),
    # features
    Bad("weight_on_input_top2", lambda c: c.with_(apply_router_weight_on_input=True),
        r"apply_router_weight_on_input=True needs top_k == 1, got top_k=2"),
    Bad("unknown_activation", lambda c: c.with_(activation="swish"),
        r"activation='swish' is not supported; expected one of \['silu'"),
    Bad("swiglu_limit_non_gated",
        lambda c: c.with_(activation="silu_no_mul", w13=torch.randn(E, I, H), swiglu_limit=1.5),
        r"swiglu_limit=1.5 needs a gated activation, not 'silu_no_mul'"),
    # in place into a tensor that cannot take it: refused before any compute
    Bad("inplace_expanded", lambda c: c.with_(x=c.x[:1].expand(T, H), inplace=True),
        r"inplace=True cannot write into hidden_states: its elements share memory \(shape \(5, 32\), "
        r"strides \(0, 1\)"),
    Bad("inplace_requires_grad", lambda c: c.with_(x=c.x.clone().requires_grad_(), inplace=True),
        r"inplace=True cannot write into hidden_states: autograd tracks it"),
    Bad("inplace_inference_tensor", lambda c: c.with_(x=_inference_copy(c.x), inplace=True),
        r"inplace=True cannot write into hidden_states: it is an inference tensor"),
    # argument types (a truthy string was taken as True; a list failed inside)
    Bad("inplace_not_bool", lambda c: c.with_(inplace="no"), r"inplace='no' must be a bool", TypeError),
    Bad("weight_on_input_not_bool", lambda c: c.with_(apply_router_weight_on_input="no"),
        r"apply_router_weight_on_input='no' must be a bool", TypeError),
    Bad("validate_not_bool", lambda c: c.with_(validate="no"), r"validate='no' must be True, False or None",
        TypeError),
    Bad("w13_bias_not_a_tensor", lambda c: c.with_(w13_bias=[[0.0] * 2 * I] * E),
        r"w13_bias must be a torch.Tensor or None, got list", TypeError),
    Bad("global_experts_float", lambda c: c.with_(global_num_experts=4.0),
        r"global_num_experts=4.0 must be an int or None", TypeError),
    Bad("swiglu_alpha_str", lambda c: c.with_(activation="swigluoai", swiglu_alpha="1.7"),
        r"swiglu_alpha='1.7' must be a finite number"),
    Bad("swiglu_alpha_nan", lambda c: c.with_(activation="swigluoai", swiglu_alpha=float("nan")),
        r"swiglu_alpha=nan must be a finite number"),
    Bad("swiglu_limit_str", lambda c: c.with_(swiglu_limit="7"), r"swiglu_limit='7' must be a finite number"),
    Bad("swiglu_alpha_list", lambda c: c.with_(activation="swigluoai", swiglu_alpha=[1.7]),  # unhashable
        r"swiglu_alpha=\[1.7\] must be a finite number"),
    # strides
    Bad("w13_non_contiguous", lambda c: c.with_(w13=_non_contiguous(c.w13)), r"w13 must be contiguous"),
    Bad("w2_non_contiguous", lambda c: c.with_(w2=_non_contiguous(c.w2)), r"w2 must be contiguous"),
    Bad("x_column_strided", lambda c: c.with_(x=_non_contiguous(c.x)),
        r"hidden_states must be contiguous"),
    # devices ("meta" stands in for a second device)
    Bad("w13_on_meta", lambda c: c.with_(w13=c.w13.to("meta")),
        r"w13 is on meta but hidden_states is on cpu"),
    Bad("ids_on_meta", lambda c: c.with_(topk_ids=c.topk_ids.to("meta")),
        r"topk_ids is on meta but hidden_states is on cpu"),
    Bad("x_on_meta", lambda c: c.with_(x=c.x.to("meta")), r"w13 is on cpu but hidden_states is on meta"),
    Bad("expert_map_on_meta", lambda c: c.with_(expert_map=torch.arange(E, dtype=torch.int32, device="meta")),
        r"expert_map is on meta but hidden_states is on cpu"),
    Bad("bias_on_meta", lambda c: c.with_(w2_bias=torch.zeros(E, H, device="meta")),
        r"w2_bias is on meta but hidden_states is on cpu"),
    # backends
    Bad("unknown_backend", lambda c: c.with_(backend="nope"),
        r"backend='nope' is not supported for .* Expected one of \[.*'cpu'.*'torch'.*\]"),
    Bad("float64_auto", lambda c: c.with_(x=c.x.double(), w13=c.w13.double(), w2=c.w2.double()),
        r"float64 hidden_states are only supported with backend='torch'"),
    Bad("float64_cpu", lambda c: c.with_(x=c.x.double(), w13=c.w13.double(), w2=c.w2.double(), backend="cpu"),
        r"float64 hidden_states are only supported with backend='torch'"),
    Bad("cpu_backend_off_cpu", lambda c: _all_on_meta(c).with_(backend="cpu"),
        r"backend cpu does not support the deployment configuration since it runs on cpu, not oot"),
]


@pytest.mark.parametrize("bad", BAD_EXPERTS, ids=lambda b: b.id)
def test_fused_experts_rejects(bad: Bad) -> None:
    call = bad.mutate(good_call())
    with pytest.raises(bad.error, match=bad.match):
        call.run()


def test_backend_request_error_is_a_value_error() -> None:
    with pytest.raises(BackendRequestError):
        good_call().with_(backend="nope").run()
    assert issubclass(BackendRequestError, ValueError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_backend_on_cuda_tensors() -> None:
    call = good_call()
    cuda = Call(*(t.cuda() for t in (call.x, call.w13, call.w2, call.topk_weights, call.topk_ids)),
                {"backend": "cpu"})
    with pytest.raises(ValueError, match=r"backend cpu .* it runs on cpu, not cuda"):
        cuda.run()


@pytest.mark.parametrize("backend", ("auto", "cpu", "torch", *(n for n in ("grouped_mm",) if n in REGISTRY)))
def test_the_kernel_patch_bites(backend: str) -> None:
    """Positive control for the fixture: a good call reaches the (patched) kernel."""
    with pytest.raises(AssertionError, match="kernel ran"):
        good_call().with_(backend=backend).run()


# Routing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadRouting:
    id: str
    kwargs: dict
    match: str
    logits: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    top_k: int = K
    num_experts: int = E
    error: type[Exception] = ValueError


def _poison(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def mutate(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[2, 1] = value
        return logits

    return mutate


def _wrong_shape_router(hidden_states, gating_output, topk, renormalize):
    tokens = gating_output.shape[0]
    return torch.rand(tokens, topk + 1), torch.zeros(tokens, topk + 1, dtype=torch.long)


def _float_ids_router(hidden_states, gating_output, topk, renormalize):
    w, ids = torch.topk(gating_output, topk)
    return w, ids.float()


def _ids_router(value: int, dtype=torch.int64):
    def route(hidden_states, gating_output, topk, renormalize):
        w, ids = torch.topk(gating_output, topk)
        ids = ids.to(dtype)
        ids[3, 1] = value
        return w, ids

    return route


def _none_router(hidden_states, gating_output, topk, renormalize):
    return None


GROUPED = dict(use_grouped_topk=True, scoring_func="sigmoid")

BAD_ROUTING = [
    BadRouting("top_k_gt_e", {}, r"top_k=5 exceeds the number of experts \(4\)", top_k=5),
    BadRouting("top_k_zero", {}, r"top_k=0 must be a positive int", top_k=0),
    BadRouting("nan_logits", {},
               r"router_logits contain NaN/Inf \(first at token 2, expert 1\)", _poison(float("nan"))),
    BadRouting("inf_logits", {},
               r"router_logits contain NaN/Inf \(first at token 2, expert 1\)", _poison(float("inf"))),
    BadRouting("neg_inf_logits", {},
               r"router_logits contain NaN/Inf \(first at token 2, expert 1\)", _poison(float("-inf"))),
    BadRouting("unknown_scoring", {"scoring_func": "softplus"},
               r"scoring_func='softplus'; expected 'softmax' or 'sigmoid'"),
    BadRouting("logits_int", {},
               r"router_logits must be floating point, got torch.int64", lambda t: t.long()),
    BadRouting("logits_3d", {},
               r"router_logits must be 2-D \[tokens, experts\], got shape \(1, 5, 4\)", lambda t: t[None]),
    BadRouting("logits_tokens", {},
               r"hidden_states shape \(5, 32\) does not match router_logits shape \(4, 4\)", lambda t: t[:4]),
    BadRouting("logits_on_meta", {},
               r"hidden_states on cpu but router_logits on meta", lambda t: t.to("meta")),
    BadRouting("bias_shape", {"e_score_correction_bias": torch.zeros(3), "scoring_func": "sigmoid"},
               r"e_score_correction_bias has shape \(3,\), expected \(4,\)"),
    BadRouting("groups_not_dividing", {**GROUPED, "num_expert_group": 4, "topk_group": 2},
               r"num_experts=10 is not divisible by num_expert_group=4", num_experts=10),
    BadRouting("topk_group_gt_groups", {**GROUPED, "num_expert_group": 4, "topk_group": 5},
               r"topk_group=5 must be in \[1, num_expert_group=4\]", num_experts=8),
    BadRouting("topk_group_zero", {**GROUPED, "num_expert_group": 4, "topk_group": 0},
               r"topk_group=0 must be in \[1, num_expert_group=4\]", num_experts=8),
    BadRouting("grouped_without_groups", GROUPED,
               r"use_grouped_topk=True needs num_expert_group and topk_group"),
    BadRouting("top_k_gt_kept_experts", {**GROUPED, "num_expert_group": 4, "topk_group": 2},
               r"top_k=5 exceeds the experts left after group selection \(topk_group=2 x 2 experts per group = 4\)",
               top_k=5, num_experts=8),
    BadRouting("groups_without_grouped", {"num_expert_group": 2, "topk_group": 1},
               r"num_expert_group/topk_group are only used with use_grouped_topk=True"),
    BadRouting("custom_wrong_shape", {"custom_routing_function": _wrong_shape_router},
               r"custom_routing_function returned weights \(5, 3\) and ids \(5, 3\), expected \(5, 2\) each"),
    BadRouting("custom_float_ids", {"custom_routing_function": _float_ids_router},
               r"custom_routing_function returned ids of dtype torch.float32, expected integers"),
    # int64 ids past int32 would wrap into range on the cast: checked before it
    BadRouting("custom_id_past_int32", {"custom_routing_function": _ids_router(2**32 + 1)},
               r"custom_routing_function returned id 4294967297 at token 3, slot 1: outside \[0, 4\)"),
    BadRouting("custom_id_eq_e", {"custom_routing_function": _ids_router(E, torch.int32)},
               r"custom_routing_function returned id 4 at token 3, slot 1: outside \[0, 4\)"),
    BadRouting("custom_id_negative", {"custom_routing_function": _ids_router(-1)},
               r"custom_routing_function returned id -1 at token 3, slot 1: outside \[0, 4\)"),
    BadRouting("custom_returns_none", {"custom_routing_function": _none_router},
               r"custom_routing_function must return \(weights, ids\), got NoneType", error=TypeError),
    BadRouting("bias_nan", {"e_score_correction_bias": torch.tensor([0.0, float("nan"), 0.0, 0.0]),
                            "scoring_func": "sigmoid"},
               r"e_score_correction_bias contains NaN/Inf \(first at expert 1: nan\)"),
    BadRouting("bias_not_a_tensor", {"e_score_correction_bias": [0.0] * E, "scoring_func": "sigmoid"},
               r"e_score_correction_bias must be a tensor, got list", error=TypeError),
    BadRouting("scaling_nan", {"routed_scaling_factor": float("nan")},
               r"routed_scaling_factor=nan must be a finite number"),
    BadRouting("scaling_str", {"routed_scaling_factor": "2.5"}, r"routed_scaling_factor='2.5' must be a finite number"),
    BadRouting("groups_float", {**GROUPED, "num_expert_group": 2.0, "topk_group": 1},
               r"num_expert_group=2.0 must be an int", error=TypeError),
    BadRouting("logits_list", {}, r"router_logits must be a torch.Tensor, got list", lambda t: t.tolist(),
               error=TypeError),
]


@pytest.mark.parametrize("entry", ("select_experts", "fused_moe"))
@pytest.mark.parametrize("bad", BAD_ROUTING, ids=lambda b: b.id)
def test_routing_rejects(bad: BadRouting, entry: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    logits = bad.logits(torch.randn(T, bad.num_experts, generator=g))
    with pytest.raises(bad.error, match=bad.match):
        if entry == "select_experts":
            select_experts(x, logits, bad.top_k, **bad.kwargs)
        else:
            w13 = torch.randn(bad.num_experts, 2 * I, H, generator=g)
            w2 = torch.randn(bad.num_experts, H, I, generator=g)
            fused_moe(x, w13, w2, logits, bad.top_k, **bad.kwargs)


@pytest.mark.parametrize("where", ("w13", "expert_map", "global_num_experts"))
def test_fused_moe_rejects_router_of_another_width(where: str) -> None:
    """Logits scoring 6 experts for an 8-expert layer would route over experts 0-5 only."""
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, 6, generator=g)
    w13, w2 = torch.randn(8, 2 * I, H, generator=g), torch.randn(8, H, I, generator=g)
    kwargs = {}
    if where != "w13":  # 4 of 8 global experts held here
        w13, w2 = w13[:4].contiguous(), w2[:4].contiguous()
        kwargs = {"expert_map": torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)}
        if where == "global_num_experts":
            kwargs["global_num_experts"] = 8
    with pytest.raises(ValueError, match=r"router_logits \(5, 6\) score 6 experts but the layer has 8"):
        fused_moe(x, w13, w2, logits, K, **kwargs)


@pytest.mark.parametrize("scheme", ("int8_w8a16", "mxfp4_w4a16"))
@pytest.mark.parametrize("mismatch", ("gated_w2_of_width_g", "no_mul_w2_of_width_g_over_2"))
def test_quantized_w2_width_follows_the_activation(scheme: str, mismatch: str) -> None:
    """Quantized w2 must be I = G / 2 wide for a gated activation and G for a non-gated one (it
    passed either, and the mismatch surfaced as a matmul error after dequantization)."""
    from fusedmoe.quant import quantize_weights

    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, 64, generator=g)
    i = 64 if mismatch == "gated_w2_of_width_g" else 32
    w13, w2 = torch.randn(E, 64, 64, generator=g), torch.randn(E, 64, i, generator=g)
    q13, q2, params = quantize_weights(w13, w2, scheme)
    activation = "silu" if mismatch == "gated_w2_of_width_g" else "relu2_no_mul"
    rule = "a gated activation" if activation == "silu" else "a non-gated activation"
    c = good_call()
    with pytest.raises(ValueError, match=rf"w2 has shape .* \(I = .*: {rule}\) for {scheme}"):
        fused_experts(x, q13, q2, c.topk_weights, c.topk_ids, quant=params, activation=activation)


@pytest.mark.parametrize("value", (0.0, float("nan"), -1.0))
def test_static_activation_scales_must_be_positive_and_finite(value: float) -> None:
    """A zero a13_scale quantized every activation to 0 (fp8 static: all-zero output), NaN / a
    negative one poisoned it; checked with the other values where validation runs."""
    import dataclasses as dc

    from fusedmoe.quant import quantize_weights

    g = torch.Generator().manual_seed(6)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    q13, q2, params = quantize_weights(w13, w2, "fp8_w8a8_tensor_static", activation_amax=(4.0, 4.0))
    params = dc.replace(params, a13_scale=torch.full_like(params.a13_scale, value))
    c = good_call()
    with pytest.raises(ValueError, match=r"quant.a13_scale holds .*: static activation scales must be finite and > 0"):
        fused_experts(c.x, q13, q2, c.topk_weights, c.topk_ids, quant=params)


@pytest.mark.parametrize("amax", (float("nan"), -4.0, 0.0))
def test_quantize_weights_rejects_bad_activation_amax(amax: float) -> None:
    from fusedmoe.quant import quantize_weights

    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with pytest.raises(ValueError, match=r"activation_amax for GEMM1 must be finite and > 0"):
        quantize_weights(w13, w2, "fp8_w8a8_tensor_static", activation_amax=(amax, 4.0))


def test_quantize_weights_rejects_mismatched_hidden() -> None:
    from fusedmoe.quant import quantize_weights

    with pytest.raises(ValueError, match=r"w13 \(4, 48, 32\) and w2 \(4, 33, 24\) disagree on H \(32 against 33\)"):
        quantize_weights(torch.randn(E, 2 * I, H), torch.randn(E, H + 1, I), "int8_w8a16")


def _dequantize_case(scheme: str):
    from fusedmoe.quant import quantize_weights

    q13, _, params = quantize_weights(torch.randn(E, 64, 64), torch.randn(E, 64, 32), scheme)
    return q13, params


@pytest.mark.parametrize("scheme, change, match", [
    ("int8_w8a16", lambda q, s, g: (q.float(), s, g), r"q has dtype torch.float32, expected torch.int8 for int8_w8a16"),
    ("int8_w8a16", lambda q, s, g: (q[0], s, g), r"q must be 3-D \[E, N, K\], got shape \(64, 64\)"),
    ("int8_w8a16", lambda q, s, g: (q, s[:, :-1], g), r"scale has shape \(4, 63\), expected \(4, 64\)"),
    ("int4_w4a16_g32", lambda q, s, g: (q[..., :-4], s, g), r"one scale per 32 inputs, but q's K = 56 is not a multiple of 32"),
    ("nvfp4_w4a16", lambda q, s, g: (q, s, g[:-1]), r"global_scale has shape \(3,\), expected \(4,\)"),
    ("mxfp4_w4a16", lambda q, s, g: (q, s.float(), g), r"scale has dtype torch.float32, expected torch.uint8"),
    ("fp8_w8a16", lambda q, s, g: (list(q), s, g), r"q must be a tensor, got list"),
], ids=("payload_dtype", "payload_rank", "scale_shape", "group", "global_scale", "scale_dtype", "not_a_tensor"))
def test_dequantize_weight_rejects(scheme: str, change, match: str) -> None:
    """dequantize_weight (the public helper) checks the payload and its scales as fused_experts
    does, naming the offending tensor, before any decode."""
    from fusedmoe.quant import dequantize_weight

    q13, params = _dequantize_case(scheme)
    q, scale, global_scale = change(q13, params.w13_scale, params.w13_global_scale)
    with pytest.raises((ValueError, TypeError), match=match):
        dequantize_weight(q, scale, scheme, global_scale)


@pytest.mark.parametrize("change, match", [
    (lambda c: c.with_(topk_ids=c.topk_ids[:4], topk_weights=c.topk_weights[:4]),
     r"fused_experts_ref: topk_ids \(4, 2\) and topk_weights \(4, 2\) must both be \[5, top_k\]"),
    (lambda c: c.with_(topk_ids=c.topk_ids.float()), r"fused_experts_ref: topk_ids must be integers, got torch.float32"),
    (lambda c: c.with_(w13=torch.randn(E, 2 * I, H + 1)),
     r"fused_experts_ref: w13 \(4, 48, 33\) and w2 \(4, 32, 24\) do not fit hidden_states \(5, 32\)"),
    (lambda c: c.with_(w13=torch.randn(E, 2 * I + 1, H)), r"expected w13 \[E, 48, 32\], w2 \[E, 32, 24\]"),
    (lambda c: c.with_(x=c.x[0]), r"fused_experts_ref: hidden_states must be a 2-D tensor, got shape \(32,\)"),
])
def test_reference_rejects_inputs_that_do_not_fit(change, match) -> None:
    """The public reference checks shapes and kinds (it gave zero rows for missing ids rows, took
    float ids, and failed inside a matmul); dtypes may differ and ids may be out of range there."""
    from fusedmoe import fused_experts_ref

    c = change(good_call())
    with pytest.raises(ValueError, match=match):
        fused_experts_ref(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, **c.kwargs)


def test_fused_moe_rejects_unknown_keyword() -> None:
    c = good_call()
    with pytest.raises(TypeError, match=r"fused_moe got unexpected keyword arguments \['renormalise'\]"):
        fused_moe(c.x, c.w13, c.w2, torch.randn(T, E), K, renormalise=True)


def test_custom_ids_out_of_range_unvalidated_never_wrap_into_range() -> None:
    """validate=False (the GPU default) skips the range scan: an int64 id past int32 becomes -1 (a
    slot that contributes zero), not the in-range id the int32 cast would wrap it to."""
    x, logits = torch.randn(T, H), torch.randn(T, E)
    weights, ids = select_experts(x, logits, K, custom_routing_function=_ids_router(2**32 + 1), validate=False)
    assert ids.dtype == torch.int32 and int(ids[3, 1]) == -1
    _, want = torch.topk(logits, K)
    assert torch.equal(ids[torch.arange(T) != 3], want[torch.arange(T) != 3].int())


def test_nan_logits_pass_with_validate_false() -> None:
    """validate=False skips the NaN scan (the GPU default); routing then does not raise."""
    logits = _poison(float("nan"))(torch.randn(T, E))
    weights, ids = select_experts(torch.randn(T, H), logits, K, validate=False)
    assert ids.shape == (T, K)


def test_expert_map_duplicate_local_slot_rejected():
    """Each local expert is owned by exactly one global id."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 32, generator=gen)
    w13, w2 = torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 16, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]], dtype=torch.int32)
    expert_map = torch.tensor([0, 1, 1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="two global experts to the same local expert"):
        fused_experts(x, w13, w2, torch.rand(4, 2, generator=gen), ids, expert_map=expert_map,
                      global_num_experts=4)
