"""select_experts against an independent float64 router written from semantics.md section 4.

The spec router below works one token at a time on Python floats (sorted(), math.exp); it
shares no code with fusedmoe.routing. Ids are compared as sets per row with weights matched by
id (the order of tied ids is unspecified); softmax/sigmoid top-k must also return ids sorted by
weight. Random logits are N(0, 1) draws (no exact ties); property tests add adversarial ones.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cases import assert_close_rel
from fusedmoe import select_experts

NEG_INF = float("-inf")


# The independent router -----------------------------------------------------------------------
def spec_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    group_mask_value: float = NEG_INF,
    group_score: str | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """(ids, weights) per row: ids in selection order (best first), float64 weights.
    group_score: "top2_sum" / "max", None: "top2_sum" with a bias, "max" without."""
    top2_sum = (group_score or ("top2_sum" if bias is not None else "max")) == "top2_sum"
    all_ids, all_weights = [], []
    for row in logits.double().tolist():
        if scoring_func == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            total = sum(exps)
            scores = [e / total for e in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        select_on = scores if bias is None else [s + b for s, b in zip(scores, bias.tolist(), strict=True)]
        num_experts = len(row)
        if num_expert_group is not None:
            per_group = num_experts // num_expert_group
            groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(num_expert_group)]
            # DeepSeek-V3 (bias), Mistral-4: a group scores the sum of its two best; DeepSeek-V2: its best.
            best = [sorted((select_on[e] for e in members), reverse=True) for members in groups]
            group_scores = [sum(b[:2]) if top2_sum else b[0] for b in best]
            kept = sorted(range(num_expert_group), key=lambda g: group_scores[g], reverse=True)
            kept = set(kept[:topk_group])
            select_on = [
                v if e // per_group in kept else group_mask_value for e, v in enumerate(select_on)
            ]
        ids = sorted(range(num_experts), key=lambda e: select_on[e], reverse=True)[:top_k]
        weights = [scores[e] for e in ids]  # unbiased
        if renormalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        all_ids.append(ids)
        all_weights.append([w * routed_scaling_factor for w in weights])
    return all_ids, all_weights


def assert_routing_matches(weights, ids, ref_ids, ref_weights, *, num_experts: int, top_k: int,
                           sorted_by_weight: bool):
    num_tokens = len(ref_ids)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert tuple(weights.shape) == (num_tokens, top_k) and tuple(ids.shape) == (num_tokens, top_k)
    for t, row in enumerate(ids.tolist()):
        assert len(set(row)) == top_k, f"token {t}: repeated ids {row}"
        assert all(0 <= e < num_experts for e in row), f"token {t}: ids {row} outside [0, {num_experts})"
        assert set(row) == set(ref_ids[t]), f"token {t}: ids {sorted(row)} != spec {sorted(ref_ids[t])}"
        if sorted_by_weight:
            assert row == ref_ids[t], f"token {t}: ids {row} not in weight order {ref_ids[t]}"
    # Weights matched by id: put ours in the spec's id order.
    by_id = [dict(zip(r, w, strict=True)) for r, w in zip(ids.tolist(), weights.tolist(), strict=True)]
    aligned = torch.tensor([[by_id[t][e] for e in ref_ids[t]] for t in range(num_tokens)],
                           dtype=torch.float64).reshape(num_tokens, top_k)
    assert_close_rel(aligned, torch.tensor(ref_weights, dtype=torch.float64).reshape(num_tokens, top_k),
                     torch.float32, what="routing weights")


# Cases -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingCase:
    name: str
    num_tokens: int
    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    renormalize: bool = True
    use_grouped_topk: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    bias: str | None = None  # None | "random" | "negative" (every biased score < 0)
    routed_scaling_factor: float = 1.0
    logits_dtype: torch.dtype = torch.float32
    group_score: str | None = None

    @property
    def sorted_by_weight(self) -> bool:
        # Selection on unbiased scores: ids come out in descending weight order.
        return self.bias is None

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        g = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        hidden = torch.randn(self.num_tokens, 16, generator=g)
        logits = torch.randn(self.num_tokens, self.num_experts, generator=g).to(self.logits_dtype)
        bias = None
        if self.bias == "random":  # comparable to the spread of sigmoid scores: changes picks
            bias = torch.randn(self.num_experts, generator=g) * 0.3
        elif self.bias == "negative":  # sigmoid < 1, so every biased score is < 0
            bias = -1.0 - torch.rand(self.num_experts, generator=g)
        return hidden, logits, bias

    def kwargs(self, bias: torch.Tensor | None) -> dict:
        return dict(
            renormalize=self.renormalize, scoring_func=self.scoring_func,
            use_grouped_topk=self.use_grouped_topk, num_expert_group=self.num_expert_group,
            topk_group=self.topk_group, e_score_correction_bias=bias,
            routed_scaling_factor=self.routed_scaling_factor, group_score=self.group_score,
        )

    def spec_kwargs(self, bias: torch.Tensor | None) -> dict:
        return dict(
            scoring_func=self.scoring_func, renormalize=self.renormalize, bias=bias,
            num_expert_group=self.num_expert_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor, group_score=self.group_score,
        )


def _grouped(name, t, e, k, groups, keep, **kw) -> RoutingCase:
    return RoutingCase(name, t, e, k, use_grouped_topk=True, num_expert_group=groups, topk_group=keep, **kw)


ROUTING_CASES = [
    RoutingCase("mixtral_softmax_renorm", 37, 8, 2),
    RoutingCase("mixtral_bf16_logits", 37, 8, 2, logits_dtype=torch.bfloat16),
    RoutingCase("qwen2_no_renorm", 37, 60, 4, renormalize=False),
    RoutingCase("qwen3_renorm", 21, 128, 8),
    RoutingCase("olmoe_no_renorm", 21, 64, 8, renormalize=False),
    RoutingCase("softmax_top_k_eq_e", 9, 6, 6),
    RoutingCase("softmax_e7_top3", 13, 7, 3),
    RoutingCase("softmax_one_token", 1, 8, 2),
    RoutingCase("softmax_no_tokens", 0, 8, 2),
    RoutingCase("sigmoid_renorm", 29, 16, 4, scoring_func="sigmoid"),
    RoutingCase("sigmoid_no_renorm", 29, 16, 4, scoring_func="sigmoid", renormalize=False),
    RoutingCase("llama4_sigmoid_top1", 29, 16, 1, scoring_func="sigmoid", renormalize=False),
    RoutingCase("minimax_sigmoid_bias", 19, 256, 8, scoring_func="sigmoid", bias="random"),
    _grouped("deepseek_v3", 23, 256, 8, 8, 4, scoring_func="sigmoid", bias="random",
             routed_scaling_factor=2.5),
    _grouped("deepseek_v3_small", 31, 16, 4, 4, 2, scoring_func="sigmoid", bias="random",
             routed_scaling_factor=2.5),
    _grouped("deepseek_v3_negative_bias", 31, 32, 4, 4, 2, scoring_func="sigmoid",
             bias="negative", routed_scaling_factor=2.5),
    _grouped("deepseek_v3_no_renorm", 31, 16, 4, 4, 2, scoring_func="sigmoid", bias="random",
             renormalize=False),
    _grouped("kimi_k2_one_group", 11, 384, 8, 1, 1, scoring_func="sigmoid", bias="random",
             routed_scaling_factor=2.827),
    _grouped("deepseek_v2_group_limited_greedy", 23, 160, 6, 8, 3, renormalize=False,
             routed_scaling_factor=16.0),
    _grouped("deepseek_v2_small", 31, 12, 3, 4, 2, renormalize=False, routed_scaling_factor=2.5),
    # group_score given: Mistral-4 ranks groups by their two best softmax scores with no bias;
    # "max" over biased scores is the other pairing the default does not make
    _grouped("mistral4_top2_sum_no_bias", 37, 32, 4, 8, 2, routed_scaling_factor=1.5, group_score="top2_sum"),
    _grouped("biased_group_max", 37, 32, 4, 8, 2, scoring_func="sigmoid", bias="random", group_score="max"),
]


@pytest.mark.parametrize("case", ROUTING_CASES, ids=lambda c: c.name)
def test_select_experts_matches_spec(case: RoutingCase) -> None:
    hidden, logits, bias = case.inputs()
    weights, ids = select_experts(hidden, logits, case.top_k, **case.kwargs(bias))
    ref_ids, ref_weights = spec_route(logits, case.top_k, **case.spec_kwargs(bias))
    assert_routing_matches(weights, ids, ref_ids, ref_weights, num_experts=case.num_experts,
                           top_k=case.top_k, sorted_by_weight=case.sorted_by_weight)


def test_negative_bias_case_needs_minus_inf_masking() -> None:
    """Guard the data: all biased scores < 0, and masking dropped groups to 0 picks other ids."""
    case = next(c for c in ROUTING_CASES if c.bias == "negative")
    _, logits, bias = case.inputs()
    assert (torch.sigmoid(logits) + bias < 0).all()
    right, _ = spec_route(logits, case.top_k, **case.spec_kwargs(bias))
    wrong, _ = spec_route(logits, case.top_k, **case.spec_kwargs(bias), group_mask_value=0.0)
    assert any(set(a) != set(b) for a, b in zip(right, wrong, strict=True))


@pytest.mark.parametrize("name", ["mistral4_top2_sum_no_bias", "biased_group_max"])
def test_group_score_cases_pick_other_experts_than_the_default(name: str) -> None:
    """Guard the data: the group_score cases pick other ids than the default ranking would, so
    an ignored group_score fails them."""
    case = next(c for c in ROUTING_CASES if c.name == name)
    _, logits, bias = case.inputs()
    given, _ = spec_route(logits, case.top_k, **case.spec_kwargs(bias))
    default, _ = spec_route(logits, case.top_k, **{**case.spec_kwargs(bias), "group_score": None})
    assert any(set(a) != set(b) for a, b in zip(given, default, strict=True))


@pytest.mark.parametrize("kw, match", [
    (dict(use_grouped_topk=True, num_expert_group=4, topk_group=2, group_score="sum"), "group_score='sum'"),
    (dict(group_score="max"), r"group_score='max' ranks expert groups: it is only used with use_grouped_topk=True"),
    (dict(custom_routing_function=lambda x, lg, k, r: torch.topk(lg, k), group_score="max"), "custom_routing_function"),
])
def test_group_score_errors(kw, match) -> None:
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match=match):
        select_experts(logits, logits, 2, **kw)


def test_bias_selects_but_does_not_weight() -> None:
    """A huge bias on expert 5 puts it in every row; its weight stays the unbiased sigmoid."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(17, 8, generator=g)
    bias = torch.zeros(8)
    bias[5] = 10.0
    weights, ids = select_experts(logits, logits, 2, scoring_func="sigmoid", renormalize=False,
                                  e_score_correction_bias=bias)
    assert (ids == 5).any(dim=1).all()
    picked = weights[ids == 5]
    assert_close_rel(picked, torch.sigmoid(logits[:, 5]), torch.float32)


def test_biased_group_score_is_sum_of_top2_not_max() -> None:
    """Group 0 holds the single best score, group 1 the best pair: DeepSeek-V3 keeps group 1."""
    # sigmoid^-1 of the wanted scores; bias 0 so that scores are exactly these.
    scores = torch.tensor([[0.95, 0.05, 0.06, 0.07, 0.80, 0.75, 0.10, 0.11]])
    logits = torch.log(scores / (1 - scores))
    bias = torch.zeros(8)
    kw = dict(scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=2, topk_group=1,
              renormalize=False)
    _, ids = select_experts(logits, logits, 2, e_score_correction_bias=bias, **kw)
    assert set(ids[0].tolist()) == {4, 5}  # sum 1.55 > 1.02
    _, ids = select_experts(logits, logits, 2, **kw)  # no bias: DeepSeek-V2 uses the max
    assert set(ids[0].tolist()) == {0, 3}  # group 0 wins on 0.95


@pytest.mark.parametrize("p", (1.0, 2.0), ids=("l1", "l2"))
@pytest.mark.parametrize("renormalize", (True, False))
def test_custom_routing_function_dbrx(p: float, renormalize: bool) -> None:
    """DBRX: softmax -> top-k -> divide by the p-norm; ids returned as int64 by the function."""
    seen = []

    def dbrx_router(hidden_states, gating_output, topk, renorm):
        seen.append((hidden_states.shape, topk, renorm))
        probs = torch.softmax(gating_output.float(), dim=-1)
        w, ids = torch.topk(probs, topk, dim=-1)
        return w / w.norm(p=p, dim=-1, keepdim=True), ids

    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(19, 32, generator=g)
    logits = torch.randn(19, 16, generator=g)
    weights, ids = select_experts(hidden, logits, 4, renormalize=renormalize,
                                  custom_routing_function=dbrx_router, routed_scaling_factor=1.5)
    assert seen == [(hidden.shape, 4, renormalize)]
    ref_ids, probs = spec_route(logits, 4, renormalize=False)
    ref_weights = [[1.5 * w / sum(v**p for v in row) ** (1 / p) for w in row] for row in probs]
    assert_routing_matches(weights, ids, ref_ids, ref_weights, num_experts=16, top_k=4,
                           sorted_by_weight=True)


# Properties ------------------------------------------------------------------------------------
PROPERTY_SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None)


def _check_invariants(weights, ids, num_tokens, num_experts, top_k, total=None):
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert tuple(ids.shape) == (num_tokens, top_k) and tuple(weights.shape) == (num_tokens, top_k)
    assert ((ids >= 0) & (ids < num_experts)).all()
    assert all(len(set(r)) == top_k for r in ids.tolist())
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    if total is not None:
        assert_close_rel(weights.sum(-1), torch.full((num_tokens,), float(total)), torch.float32,
                         what="sum of weights")


@st.composite
def logits_and_k(draw, max_experts: int = 16):
    num_tokens = draw(st.integers(1, 6))
    num_experts = draw(st.integers(1, max_experts))
    # Wide range, exact ties and extreme values included (no NaN/Inf: those are rejected).
    values = st.one_of(st.floats(-30, 30, width=32), st.sampled_from([0.0, -30.0, 30.0, 1.0]))
    logits = draw(arrays(np.float32, (num_tokens, num_experts), elements=values))
    top_k = draw(st.integers(1, num_experts))
    return torch.from_numpy(logits), top_k


@PROPERTY_SETTINGS
@given(
    data=logits_and_k(),
    scoring_func=st.sampled_from(["softmax", "sigmoid"]),
    scale=st.sampled_from([1.0, 2.5]),
)
def test_property_topk_renormalized(data, scoring_func, scale) -> None:
    logits, top_k = data
    num_tokens, num_experts = logits.shape
    weights, ids = select_experts(logits, logits, top_k, scoring_func=scoring_func,
                                  renormalize=True, routed_scaling_factor=scale)
    _check_invariants(weights, ids, num_tokens, num_experts, top_k, total=scale)


@st.composite
def grouped_problem(draw):
    num_groups = draw(st.integers(1, 6))
    per_group = draw(st.integers(1, 6))
    topk_group = draw(st.integers(1, num_groups))
    top_k = draw(st.integers(1, topk_group * per_group))
    num_tokens = draw(st.integers(1, 5))
    num_experts = num_groups * per_group
    logits = draw(arrays(np.float32, (num_tokens, num_experts), elements=st.floats(-30, 30, width=32)))
    bias = draw(st.none() | arrays(np.float32, (num_experts,), elements=st.floats(-2, 2, width=32)))
    bias = None if bias is None else torch.from_numpy(bias)
    return torch.from_numpy(logits), top_k, num_groups, topk_group, bias


@PROPERTY_SETTINGS
@given(problem=grouped_problem(), scale=st.sampled_from([1.0, 2.5]))
def test_property_grouped_topk(problem, scale) -> None:
    logits, top_k, num_groups, topk_group, bias = problem
    num_tokens, num_experts = logits.shape
    weights, ids = select_experts(
        logits, logits, top_k, scoring_func="sigmoid", use_grouped_topk=True,
        num_expert_group=num_groups, topk_group=topk_group, e_score_correction_bias=bias,
        renormalize=True, routed_scaling_factor=scale,
    )
    _check_invariants(weights, ids, num_tokens, num_experts, top_k, total=scale)
    per_group = num_experts // num_groups
    for row in ids.tolist():
        assert len({e // per_group for e in row}) <= topk_group, f"ids {row} span > {topk_group} groups"


def test_select_experts_compiles_when_dynamo_makes_the_scaling_factor_symbolic() -> None:
    """A scaling factor that changes between compiles becomes a symbolic float under dynamo's
    automatic dynamic shapes; the argument check must not break the fullgraph trace."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    x, logits = torch.randn(6, 16, generator=gen), torch.randn(6, 8, generator=gen)
    compiled = torch.compile(lambda s: select_experts(x, logits, 2, routed_scaling_factor=s),
                             fullgraph=True, backend="eager")
    for scale in (1.0, 2.5, 0.75):
        want_w, want_ids = select_experts(x, logits, 2, routed_scaling_factor=scale)
        got_w, got_ids = compiled(scale)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)
