"""Expert-parallel load balancing on one process: placements, replica routing, load statistics,
rebalancing that moves the weights, and the backends that refuse it. Across ranks (weights moved
by all-to-all): test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from fusedmoe import (
    FusedMoE,
    MoEConfig,
    ParallelConfig,
    Platform,
    fused_experts_ref,
    select_backend,
)
from fusedmoe.backends import REGISTRY
from fusedmoe.eplb import PhysicalPlacement, move_plan, rebalance, record_load, to_physical
from fusedmoe.errors import NoBackendError
from fusedmoe.quant import SCHEMES
from quant_problems import assert_close_up_to_code_flips

E, K, H, I = 8, 2, 32, 24


def _max_over_mean(placement: PhysicalPlacement, load: list[float]) -> float:
    counts = placement.replica_counts()
    per_rank = [sum(load[e] / counts[e] for e in placement.local_logical(r)) for r in range(placement.ep_size)]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def test_rebalance_replicates_the_hot_expert_and_evens_ranks() -> None:
    load = [1.0, 1, 1, 1, 1, 40, 20, 1]
    old = PhysicalPlacement.initial(E, 2, 2)  # slots (0..7, 0, 1): experts 5 and 6 on rank 1
    new = rebalance(load, 10, 2)
    assert new.replica_counts()[5] == 3 and sum(new.replica_counts()) == 10
    assert all(c >= 1 for c in new.replica_counts())
    assert 5 in new.local_logical(0) and 5 in new.local_logical(1)  # replicas spread over ranks
    assert _max_over_mean(old, load) > 1.8
    assert _max_over_mean(new, load) < 1.15
    assert rebalance(load, 10, 2) == new  # deterministic: every rank computes the same


def test_rebalance_uniform_without_redundancy_is_a_permutation() -> None:
    new = rebalance([5.0] * E, E, 4)
    assert sorted(new.physical_to_logical) == list(range(E))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: PhysicalPlacement.initial(8, 1, 2),
         r"num_experts=8 \+ num_redundant_experts=1 = 9 physical experts is not divisible by ep_size=2 \(9 % 2 = 1\)"),
        (lambda: PhysicalPlacement.initial(8, -1, 1), r"num_redundant_experts=-1 must be >= 0"),
        (lambda: PhysicalPlacement(4, 2, (0, 1, 2, 2)), r"logical experts without a physical slot: \[3\]"),
        (lambda: PhysicalPlacement(4, 2, (0, 1, 2, 4)), r"outside \[0, 4\): \[4\]"),
        (lambda: rebalance([1.0, 2.0], 3, 2), r"num_physical=3 is not divisible by ep_size=2"),
        (lambda: rebalance([1.0, -2.0], 2, 1), r"expert loads must be >= 0"),
    ],
    ids=("indivisible", "negative", "missing", "outside", "rebalance_indivisible", "negative_load"),
)
def test_placement_rejects(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_to_physical_takes_replicas_in_turn() -> None:
    p = PhysicalPlacement(3, 1, (0, 1, 2, 0, 0))
    table = p.logical_to_physical(3)
    assert table.tolist() == [[0, 3, 4], [1, -1, -1], [2, -1, -1]]
    counts = torch.tensor(p.replica_counts())
    ids = torch.tensor([[0, 1], [0, 2], [0, 5], [-1, 0]], dtype=torch.int32)
    phys = to_physical(ids, table, counts, 5)
    # expert 0 at (t, k) = (0, 0), (1, 0), (2, 0), (3, 1) -> replica (t + k) % 3 = 0, 1, 2, 1
    assert phys.tolist() == [[0, 1], [3, 2], [4, 5], [5, 3]] and phys.dtype == torch.int32
    load = torch.zeros(5, dtype=torch.int64)
    record_load(load, phys)
    assert load.tolist() == [1, 1, 1, 2, 1]
    empty = to_physical(torch.zeros(0, 2, dtype=torch.int64), table, counts, 5)
    assert empty.shape == (0, 2) and empty.dtype == torch.int64


def test_move_plan_sends_missing_experts_from_their_first_holder() -> None:
    old = PhysicalPlacement(4, 2, (0, 1, 2, 3))
    new = PhysicalPlacement(4, 2, (0, 3, 1, 2))
    assert move_plan(old, new, 0) == ([(0, 0)], [[], [1]], [[], [1]])
    assert move_plan(old, new, 1) == ([(1, 0)], [[1], []], [[0], []])


def _weights(gen):
    return torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5


def _layer(w13, w2, **kwargs) -> FusedMoE:
    layer = FusedMoE(E, K, H, I, params_dtype=torch.float32, **kwargs)
    for e in range(E):
        layer.load_expert_weight(e, "gate", w13[e, :I])
        layer.load_expert_weight(e, "up", w13[e, I:])
        layer.load_expert_weight(e, "down", w2[e])
    return layer


@pytest.mark.parametrize("backend", ("cpu", "torch"))
def test_layer_with_replicas_equals_reference_before_and_after_rebalance(backend: str) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    w13, w2 = _weights(gen)
    layer = _layer(w13, w2, enable_eplb=True, num_redundant_experts=3, backend=backend)
    assert layer.w13_weight.shape[0] == E + 3 and layer.logical_replica_count.tolist()[:3] == [2, 2, 2]
    x = torch.randn(40, H, generator=gen)
    logits = torch.randn(40, E, generator=gen)
    logits[:, 0] += 6.0  # expert 0 is hot
    w, ids = layer.route(x, logits)
    ref = fused_experts_ref(x, w13, w2, w, ids)
    out = layer(x, logits)
    assert (out - ref).abs().max() / ref.abs().max() < 2e-5
    load = layer.expert_load_view.clone()
    assert int(load.sum()) == 40 * K
    logical = torch.zeros(E, dtype=torch.int64).scatter_add_(0, torch.tensor(layer.eplb.physical_to_logical), load)
    assert torch.equal(logical, torch.bincount(ids.flatten().long(), minlength=E))
    assert load[0] >= 12 and load[8] >= 12  # expert 0's two replicas (slots 0 and 8) share it
    new = layer.rebalance_experts()
    assert new.replica_counts()[0] >= 3  # the hot expert got the redundant slots
    assert int(layer.expert_load_view.sum()) == 0
    assert layer.local_to_global.tolist() == list(new.physical_to_logical)
    for slot, e in enumerate(new.physical_to_logical):  # weights moved with their experts
        assert torch.equal(layer.w13_weight[slot], w13[e]) and torch.equal(layer.w2_weight[slot], w2[e])
    out = layer(x, logits)
    assert (out - ref).abs().max() / ref.abs().max() < 2e-5


def test_ep_rank_holds_its_physical_slots() -> None:
    w13, w2 = _weights(torch.Generator().manual_seed(1))
    layer = _layer(w13, w2, enable_eplb=True, num_redundant_experts=2,
                   parallel=ParallelConfig(ep_size=2, ep_rank=1))
    assert layer.local_to_global.tolist() == [5, 6, 7, 0, 1]
    assert layer.expert_map.tolist() == [-1] * 5 + [0, 1, 2, 3, 4]
    layer.process_weights_after_loading()
    assert torch.equal(layer.w13_weight[3], w13[0]) and torch.equal(layer.w2_weight[4], w2[1])
    with pytest.raises(RuntimeError, match=r"rebalancing moves experts between EP ranks: build the layer with group="):
        layer.rebalance_experts(torch.ones(E))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(num_redundant_experts=2), ValueError, r"num_redundant_experts=2 needs enable_eplb=True"),
        (dict(enable_eplb=True, parallel=ParallelConfig(ep_size=2, placement="round_robin")), ValueError,
         r"placement='round_robin' must be 'linear'"),
        (dict(enable_eplb=True, num_redundant_experts=1, parallel=ParallelConfig(ep_size=2)), ValueError,
         r"= 9 physical experts is not divisible by ep_size=2"),
    ],
    ids=("redundant_without_eplb", "round_robin", "indivisible"),
)
def test_layer_rejects(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FusedMoE(E, K, H, I, **kwargs)


def test_rebalance_needs_eplb() -> None:
    w13, w2 = _weights(torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match=r"rebalance_experts\(\) needs a layer built with enable_eplb=True"):
        _layer(w13, w2).rebalance_experts()
    assert _layer(w13, w2).expert_load_view is None


def test_backends_say_whether_they_balance() -> None:
    assert REGISTRY["triton"].supports_eplb and REGISTRY["batched_triton"].supports_eplb
    assert REGISTRY["cpu"].supports_eplb and REGISTRY["flashinfer_cutlass"].supports_eplb
    assert not REGISTRY["flashinfer_trtllm"].supports_eplb  # its router never hands out ids
    assert not REGISTRY["xpu"].supports_eplb
    config = MoEConfig(8, 2, 256, 128, enable_eplb=True)
    with pytest.raises(NoBackendError, match=r"xpu: it does not apply expert load balancing"):
        select_backend(config, Platform("xpu", packages=("intel_extension_for_pytorch",)))
    assert select_backend(config, Platform("cpu")).name == "cpu"


@pytest.mark.parametrize("scheme", ("fp8_w8a8_block", "int4_w4a16_g32"))
def test_quantized_experts_move_with_their_scales(scheme: str) -> None:
    """Rebalancing moves payloads and every scale buffer together: outputs equal the unbalanced
    quantized layer before and after (emulation backend on the CPU)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, i = 128, 128
    w13 = torch.randn(E, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(E, h, i, generator=gen) / i**0.5

    def build(**kw) -> FusedMoE:
        layer = FusedMoE(E, K, h, i, params_dtype=torch.float32, quant=scheme, **kw)
        for e in range(E):
            layer.load_expert_weight(e, "gate", w13[e, :i])
            layer.load_expert_weight(e, "up", w13[e, i:])
            layer.load_expert_weight(e, "down", w2[e])
        return layer

    plain, balanced = build(), build(enable_eplb=True, num_redundant_experts=2)
    x, logits = torch.randn(24, h, generator=gen), torch.randn(24, E, generator=gen)
    want = plain(x, logits)
    # Replicas split an expert's rows into two GEMMs: fp8 block activations may flip a code.
    flips = 2 if SCHEMES[scheme].activation is not None else 0
    assert_close_up_to_code_flips(balanced(x, logits), want, max_rows=flips)
    load = torch.tensor([1, 1, 1, 50, 1, 1, 30, 1])
    new = balanced.rebalance_experts(load)
    assert new.replica_counts()[3] >= 2 and new != PhysicalPlacement.initial(E, 2, 1)
    assert_close_up_to_code_flips(balanced(x, logits), want, max_rows=flips)
