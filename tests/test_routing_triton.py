"""`moe_routing_kernel` (one launch for select_experts on CUDA) against the float64 spec router of
test_routing.py: under the Triton interpreter on CPU tensors here, on the GPU against the torch
ops (`gpu` tests). Plus when `select_experts` takes it."""

from __future__ import annotations

import os
import random
import zlib
from types import SimpleNamespace

import pytest
import torch

from fusedmoe import knobs, select_experts
from fusedmoe.backends.triton.routing import triton_select_experts
from fusedmoe.routing import ROUTING_KERNEL_MAX_EXPERTS, _triton_routing, routing_kernel_unsupported
from test_routing import ROUTING_CASES, RoutingCase, _grouped, assert_routing_matches, spec_route

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel's tests: GPU, else the interpreter
needs_triton_here = pytest.mark.skipif(not (INTERPRETED or torch.cuda.is_available()),
                                       reason="needs a GPU or TRITON_INTERPRET=1")

EXTRA_CASES = [
    RoutingCase("softmax_e1000_top8", 5, 1000, 8),  # E padded to 1024, the padding never picked
    RoutingCase("softmax_top32", 4, 64, 32),
    RoutingCase("sigmoid_bias_e257", 6, 257, 4, scoring_func="sigmoid", bias="random"),
    _grouped("grouped_bias_one_expert_groups", 7, 8, 2, 8, 4, scoring_func="sigmoid", bias="random"),
    _grouped("grouped_all_groups_kept", 7, 32, 8, 4, 4, scoring_func="sigmoid", bias="random"),
    _grouped("grouped_top_k_fills_the_kept_groups", 7, 16, 8, 4, 2, scoring_func="sigmoid", bias="random"),
]


def _kernel_case(case: RoutingCase, device: str = "cpu"):
    hidden, logits, bias = case.inputs()
    logits = logits.to(device)
    bias = None if bias is None else bias.to(device)
    kw = case.kwargs(bias)
    if routing_kernel_unsupported(case.num_experts, case.top_k, case.use_grouped_topk, case.num_expert_group,
                           case.topk_group):
        pytest.skip("the kernel does not take this configuration (select_experts keeps the torch ops)")
    return logits, bias, kw, hidden


@needs_triton_here
@pytest.mark.parametrize("case", ROUTING_CASES + EXTRA_CASES, ids=lambda c: c.name)
def test_kernel_matches_spec(case: RoutingCase) -> None:
    logits, bias, kw, _ = _kernel_case(case, DEV)
    weights, ids = triton_select_experts(logits, case.top_k, **kw)
    ref_ids, ref_weights = spec_route(logits.cpu(), case.top_k, **case.spec_kwargs(None if bias is None else bias.cpu()))
    assert_routing_matches(weights.cpu(), ids.cpu(), ref_ids, ref_weights, num_experts=case.num_experts,
                           top_k=case.top_k, sorted_by_weight=case.sorted_by_weight)


@needs_triton_here
def test_kernel_reads_strided_logits_and_ignores_poisoned_outputs() -> None:
    """Logits as a column slice of a wider tensor (stride(0) != E); the outputs start as garbage."""
    g = torch.Generator().manual_seed(zlib.crc32(b"strided"))
    wide = torch.randn(9, 40, generator=g).to(DEV)
    logits = wide[:, 3:35]
    weights, ids = triton_select_experts(logits, 4, renormalize=True, scoring_func="softmax",
                                         use_grouped_topk=False, num_expert_group=None, topk_group=None,
                                         e_score_correction_bias=None, routed_scaling_factor=1.0)
    ref_ids, ref_weights = spec_route(logits.cpu(), 4)
    assert_routing_matches(weights.cpu(), ids.cpu(), ref_ids, ref_weights, num_experts=32, top_k=4, sorted_by_weight=True)


@needs_triton_here
def test_kernel_ties_and_minus_inf_give_distinct_lowest_ids() -> None:
    """Equal scores pick the lower id first; a row whose scores are all -inf after the group mask
    would leave argmax on taken ids: the kernel takes the lowest free ids instead (distinct). (The
    interpreter's argmax breaks ties to the left whatever `tie_break_left` says: the GPU run of
    this test checks the kernel's own.)"""
    logits = torch.zeros(2, 8, device=DEV)
    logits[1] = torch.tensor([0.0, 5.0, 5.0, 1.0, 5.0, 0.0, 0.0, 0.0])
    weights, ids = triton_select_experts(logits, 3, renormalize=True, scoring_func="softmax",
                                         use_grouped_topk=False, num_expert_group=None, topk_group=None,
                                         e_score_correction_bias=None, routed_scaling_factor=1.0)
    assert ids.tolist() == [[0, 1, 2], [1, 2, 4]]
    torch.testing.assert_close(weights.cpu(), torch.full((2, 3), 1 / 3))
    minus_inf = torch.full((1, 8), float("-inf"), device=DEV)  # softmax of all -inf is NaN: sigmoid gives 0s
    weights, ids = triton_select_experts(minus_inf, 3, renormalize=False, scoring_func="sigmoid",
                                         use_grouped_topk=False, num_expert_group=None, topk_group=None,
                                         e_score_correction_bias=torch.full((8,), float("-inf"), device=DEV),
                                         routed_scaling_factor=1.0)
    assert ids.tolist() == [[0, 1, 2]] and weights.tolist() == [[0.0, 0.0, 0.0]]


@needs_triton_here
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("grouped", [False, True])
def test_kernel_ids_stay_distinct_and_in_range_on_non_finite_logits(poison: str, grouped: bool) -> None:
    """Unvalidated NaN / Inf logits (FUSEDMOE_VALIDATE off on a GPU) make the scores NaN or -inf;
    the weights are then undefined, but the ids are what the experts' kernels index with: each
    row's stay in [0, E) and distinct, whatever the scores."""
    g = torch.Generator().manual_seed(zlib.crc32(f"nonfinite-{poison}-{grouped}".encode()))
    e, k = 64, 8
    logits = torch.randn(6, e, generator=g)
    logits[0, 5] = float(poison)  # one poisoned score
    logits[1] = float(poison)  # a whole row
    logits[2, ::3] = float(poison)  # a third of the row, across groups
    bias = torch.randn(e, generator=g) if grouped else None
    weights, ids = triton_select_experts(logits.to(DEV), k, renormalize=True,
                                         scoring_func="sigmoid" if grouped else "softmax",
                                         use_grouped_topk=grouped, num_expert_group=8 if grouped else None,
                                         topk_group=2 if grouped else None,
                                         e_score_correction_bias=None if bias is None else bias.to(DEV),
                                         routed_scaling_factor=1.0)
    ids = ids.cpu()
    assert ids.dtype == torch.int32 and bool(((ids >= 0) & (ids < e)).all()), ids
    assert all(len(set(row.tolist())) == k for row in ids), ids
    # the rows without a poisoned logit route as the spec router does
    ref_ids, ref_weights = spec_route(logits[3:], k, scoring_func="sigmoid" if grouped else "softmax", bias=bias,
                                      num_expert_group=8 if grouped else None, topk_group=2 if grouped else None)
    assert_routing_matches(weights[3:].cpu(), ids[3:], ref_ids, ref_weights, num_experts=e, top_k=k,
                           sorted_by_weight=True)


@needs_triton_here
def test_kernel_matches_spec_on_random_configurations() -> None:
    """Seeded random configurations the rule accepts (E 2-1000, top_k 1-32, DeepSeek groups
    ranked by either group score,
    correction bias, centred or below every score so the picks order negative keys, softmax /
    sigmoid, renormalisation, scaling, 1-4 tokens) against the float64 spec router. Unit-scale logits: large ones saturate sigmoid scores into fp32 ties, where the
    kernel takes the lower id and float64 still tells them apart."""
    rng = random.Random(zlib.crc32(b"random-routing-configurations"))
    g = torch.Generator().manual_seed(zlib.crc32(b"random-routing-draws"))
    checked = 0
    while checked < 24:
        e = rng.choice([2, 3, 8, 16, 60, 64, 128, 160, 256, 257, 384, 512, 1000])
        k = rng.randint(1, min(e, 32))
        groups = topk_group = None
        splits = [n for n in (2, 4, 8, 16) if e % n == 0 and (e // n) & (e // n - 1) == 0]
        if splits and rng.random() < 0.4:
            groups = rng.choice(splits)
            topk_group = rng.randint(-(-k // (e // groups)), groups)  # enough kept experts for top_k
        if routing_kernel_unsupported(e, k, groups is not None, groups, topk_group):
            continue
        scoring = rng.choice(["softmax", "sigmoid"])
        shift = rng.choice([None, 0.0, -1.0])  # no bias, a centred one, one below every score
        bias = None if shift is None else torch.randn(e, generator=g) * 0.3 + shift
        renormalize, scale = rng.random() < 0.7, rng.choice([1.0, 2.5])
        group_score = rng.choice([None, "max", "top2_sum"]) if groups else None
        logits = torch.randn(rng.randint(1, 4), e, generator=g)
        weights, ids = triton_select_experts(
            logits.to(DEV), k, renormalize=renormalize, scoring_func=scoring, use_grouped_topk=groups is not None,
            num_expert_group=groups, topk_group=topk_group,
            e_score_correction_bias=None if bias is None else bias.to(DEV), routed_scaling_factor=scale,
            group_score=group_score)
        ref_ids, ref_weights = spec_route(logits, k, scoring_func=scoring, renormalize=renormalize, bias=bias,
                                          num_expert_group=groups, topk_group=topk_group,
                                          routed_scaling_factor=scale, group_score=group_score)
        assert_routing_matches(weights.cpu(), ids.cpu(), ref_ids, ref_weights, num_experts=e, top_k=k,
                               sorted_by_weight=True)
        checked += 1


@needs_triton_here
def test_kernel_no_tokens() -> None:
    weights, ids = triton_select_experts(torch.randn(0, 16, device=DEV), 2, renormalize=True, scoring_func="softmax",
                                         use_grouped_topk=False, num_expert_group=None, topk_group=None,
                                         e_score_correction_bias=None, routed_scaling_factor=1.0)
    assert weights.shape == (0, 2) and ids.shape == (0, 2) and ids.dtype == torch.int32


def test_routing_unsupported_reasons() -> None:
    assert routing_kernel_unsupported(256, 8, True, 8, 4) is None
    assert routing_kernel_unsupported(384, 8, True, 1, 1) is None  # one group: plain top-k
    assert "E=2048 > 1024" in routing_kernel_unsupported(2 * ROUTING_KERNEL_MAX_EXPERTS, 8, False, None, None)
    assert "top_k=33 > 32" in routing_kernel_unsupported(64, 33, False, None, None)
    assert "powers of two" in routing_kernel_unsupported(160, 6, True, 8, 3)  # DeepSeek-V2: 20 a group
    assert "powers of two" in routing_kernel_unsupported(96, 6, True, 3, 2)


def test_select_experts_takes_the_kernel_only_on_cuda_eager_and_supported(monkeypatch) -> None:
    cuda = SimpleNamespace(device=torch.device("cuda", 0))  # only the logits' device type is read
    assert _triton_routing(cuda, 64, 8, False, None, None)
    assert _triton_routing(cuda, 384, 8, True, 1, 1)  # one group: plain top-k
    assert not _triton_routing(cuda, 160, 6, True, 8, 3)  # unsupported groups
    with knobs.override(TRITON_ROUTING=False):
        assert not _triton_routing(cuda, 64, 8, False, None, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not _triton_routing(cuda, 64, 8, False, None, None)
    monkeypatch.undo()
    assert not _triton_routing(torch.empty(2, 64), 64, 8, False, None, None)  # CPU tensors: torch ops


@pytest.mark.gpu
@pytest.mark.parametrize("case", ROUTING_CASES + EXTRA_CASES, ids=lambda c: c.name)
def test_gpu_select_experts_runs_the_kernel_and_matches_spec(case: RoutingCase, monkeypatch) -> None:
    """On the GPU select_experts takes the kernel where it can (counted) and matches the spec
    router either way."""
    import fusedmoe.backends.triton.routing as triton_routing

    launched = []
    real = triton_routing.triton_select_experts
    monkeypatch.setattr(triton_routing, "triton_select_experts", lambda *a, **k: launched.append(1) or real(*a, **k))
    hidden, logits, bias = case.inputs()
    weights, ids = select_experts(hidden.cuda(), logits.cuda(), case.top_k,
                                  **case.kwargs(None if bias is None else bias.cuda()))
    supported = routing_kernel_unsupported(case.num_experts, case.top_k, case.use_grouped_topk, case.num_expert_group,
                                    case.topk_group) is None
    assert len(launched) == (1 if supported else 0)
    ref_ids, ref_weights = spec_route(logits, case.top_k, **case.spec_kwargs(bias))
    assert_routing_matches(weights.cpu(), ids.cpu(), ref_ids, ref_weights, num_experts=case.num_experts,
                           top_k=case.top_k, sorted_by_weight=case.sorted_by_weight)


@pytest.mark.gpu
def test_gpu_routing_kernel_in_a_cuda_graph() -> None:
    hidden = torch.randn(16, 32, device="cuda")
    logits = torch.randn(16, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.3
    kw = dict(scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=8, topk_group=4,
              e_score_correction_bias=bias, routed_scaling_factor=2.5)
    for _ in range(2):
        select_experts(hidden, logits, 8, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, i = select_experts(hidden, logits, 8, **kw)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    want_w, want_i = select_experts(hidden, logits, 8, **kw)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(w, want_w, rtol=0, atol=0)


def test_fake_cuda_tensors_take_the_torch_ops() -> None:
    """Under fake tensors (torch.export, shape propagation) the routing of CUDA tensors is the
    torch ops, which fake tensors run; the Triton launch would need real memory. Runs without a
    GPU: fake CUDA tensors need none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, logits = torch.empty(4, 8, device="cuda"), torch.empty(4, 16, device="cuda")
        weights, ids = select_experts(x, logits, 2)
        biased = select_experts(x, logits, 2, scoring_func="sigmoid",
                                e_score_correction_bias=torch.empty(16, device="cuda"))
    assert weights.shape == ids.shape == biased[1].shape == (4, 2) and ids.dtype == torch.int32


_COMPILE_FOR_SM90 = """
import json, sys, torch
from fusedmoe.backends.triton import kernel_report, routing
why = kernel_report.unavailable()
if why:
    print(json.dumps({"skip": why})); sys.exit(0)
with kernel_report.recording(only=("moe_routing_kernel",)) as calls:
    for e, k, groups, topk_group, sigmoid in json.loads(sys.argv[1]):
        bias = torch.randn(e) if sigmoid else None
        routing.triton_select_experts(torch.randn(3, e), k, renormalize=True,
                                      scoring_func="sigmoid" if sigmoid else "softmax",
                                      use_grouped_topk=groups > 1, num_expert_group=groups, topk_group=topk_group,
                                      e_score_correction_bias=bias, routed_scaling_factor=2.5)
calls[-1].kwargs.update(PDL=True, launch_pdl=True)  # as a CUDA launch on sm90 takes it
rows = []
for call in calls:
    use = kernel_report.usage(kernel_report.compile_call(call))
    rows.append({"BLOCK_E": call.kwargs["BLOCK_E"], "regs": use["regs"], "stack": use["stack"],
                 "SHFL": use["all_opcodes"].get("SHFL", 0), "REDUX": use["all_opcodes"].get("REDUX", 0)})
print(json.dumps(rows))
"""


def test_kernel_compiles_for_sm90():
    """The interpreter runs what the GPU compiler refuses (a plain global in a kernel did), so the
    kernel is compiled here for sm90 (Triton's ptxas, no GPU): each kind of configuration the rule
    lets through, from one warp (E <= 256) to four (E = 1024), the PDL form included, without
    spilling."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    configs = [(8, 2, 0, 0, False), (128, 8, 0, 0, False), (256, 8, 8, 4, True), (384, 8, 1, 1, True),
               (1000, 8, 0, 0, False), (64, 32, 0, 0, True)]
    root = Path(__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root / "src"), env.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, json.dumps(configs)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    if isinstance(rows, dict):
        pytest.skip(rows["skip"])
    assert [r["BLOCK_E"] for r in rows] == [8, 128, 256, 512, 1024, 64]
    for row in rows:
        assert row["stack"] == 0 and 0 < row["regs"] <= 128, row
