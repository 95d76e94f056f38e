"""Expert, data and tensor parallelism on real process groups: 2 and 4 gloo ranks on the CPU.

One launch per world size runs every case of that size (`dist_cases.py`) on fresh random
weights and tokens; each case is then its own test. Launches are bounded (a hang fails, it
does not block). Logic that needs no process group (configs, placement) is tested directly.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from dist_cases import DistCase, random_cases, run_capture, run_cases, run_errors
from fusedmoe import MoEConfig, ParallelConfig, Platform, select_backend
from fusedmoe.distributed import ExpertPlacement, MoEGroups
from fusedmoe.launch import LaunchError, launch
from quant_problems import CODE_FLIP_ROWS, CODE_FLIP_TOL

TIMEOUT_S = 90.0
F32_TOL = 2e-5  # float32 end to end: ids are exact, sums differ only in order
BF16_TOL = 3e-2  # bf16 output and intermediates against the fp32 reference (8 mantissa bits)
# Quantized cases against the same layer unsplit: each expert's GEMM1 sees another batch of rows
# split than unsplit, so an activation may flip a code (quant_problems.assert_close_up_to_code_flips;
# seen: 4.1e-4 in one row, fp8 block, seed 2180344183).

C = DistCase
CASES_2 = [
    C("ep2_dp2_a2a_random", 2, dp=2, ep=2, tokens=(7, 4)),
    C("ep2_dp2_a2a_skewed", 2, dp=2, ep=2, tokens=(7, 4), routing="skewed", hot_rank=0),
    C("ep2_dp2_a2a_rank_without_tokens", 2, dp=2, ep=2, tokens=(5, 0)),
    C("ep2_dp2_a2a_no_tokens", 2, dp=2, ep=2, tokens=(0, 0)),
    C("ep2_dp2_a2a_round_robin_bias", 2, dp=2, ep=2, tokens=(6, 3), placement="round_robin",
      bias=True, activation="swigluoai"),
    C("ep2_dp2_a2a_weight_on_input", 2, dp=2, ep=2, tokens=(5, 6), top_k=1, weight_on_input=True),
    C("ep2_dp2_allgather_random", 2, dp=2, ep=2, tokens=(7, 4), dispatch="allgather"),
    C("ep2_dp2_allgather_rank_without_tokens", 2, dp=2, ep=2, tokens=(0, 3), dispatch="allgather",
      routing="skewed", hot_rank=1),
    C("ep2_dp2_allgather_capacity", 2, dp=2, ep=2, tokens=(7, 4), dispatch="allgather", max_num_tokens=8),
    C("ep2_dp2_allgather_capacity_full_and_empty", 2, dp=2, ep=2, tokens=(0, 6), dispatch="allgather",
      max_num_tokens=6, routing="skewed", hot_rank=0, bias=True),
    C("ep2_replicated_allgather_capacity_int8_on_wire", 2, ep=2, tokens=(7,), dispatch="allgather",
      max_num_tokens=4, quant="int8_w8a8", backend="auto"),
    C("ep2_dp2_batched_random", 2, dp=2, ep=2, tokens=(7, 4), dispatch="alltoall_batched",
      backend="torch"),
    C("ep2_dp2_batched_skewed_round_robin", 2, dp=2, ep=2, tokens=(3, 8), routing="skewed",
      hot_rank=1, dispatch="alltoall_batched", placement="round_robin", backend="torch"),
    C("ep2_dp2_batched_weight_on_input_capped", 2, dp=2, ep=2, tokens=(5, 4), top_k=1,
      weight_on_input=True, dispatch="alltoall_batched", backend="torch", max_num_tokens=8),
    C("ep2_replicated_tokens_a2a", 2, ep=2, tokens=(7,)),
    C("ep2_replicated_tokens_allgather", 2, ep=2, tokens=(7,), dispatch="allgather"),
    C("ep2_replicated_one_token", 2, ep=2, tokens=(1,), routing="skewed", hot_rank=1),
    C("tp2", 2, tp=2, tokens=(5,), bias=True),
    C("dp2_no_ep", 2, dp=2, tokens=(3, 6)),
    C("ep2_relu2_no_mul", 2, dp=2, ep=2, tokens=(4, 5), activation="relu2_no_mul", bias=True),
    C("ep2_dp2_a2a_shared_expert", 2, dp=2, ep=2, tokens=(6, 0), shared=True),
    C("ep2_replicated_batched_shared_expert", 2, ep=2, tokens=(5,), shared=True,
      dispatch="alltoall_batched", backend="torch"),
    C("ep2_dp2_a2a_eplb_skewed", 2, dp=2, ep=2, tokens=(9, 6), routing="skewed", hot_rank=1,
      redundant=2),
    C("ep2_dp2_a2a_fp8_channel_on_wire", 2, dp=2, ep=2, tokens=(7, 4), quant="fp8_w8a8_channel",
      backend="auto"),
    C("ep2_dp2_a2a_fp8_block_on_wire", 2, dp=2, ep=2, tokens=(5, 6), quant="fp8_w8a8_block",
      hidden=160, inter=128, backend="auto"),
    C("ep2_dp2_allgather_int8_on_wire", 2, dp=2, ep=2, tokens=(3, 8), quant="int8_w8a8",
      dispatch="allgather", backend="auto"),
    C("ep2_dp2_a2a_int8_not_on_wire", 2, dp=2, ep=2, tokens=(3, 8), quant="int8_w8a8",
      quantize_dispatch=False, backend="auto"),
    C("ep2_dp2_a2a_bf16", 2, dp=2, ep=2, tokens=(9, 5), dtype=torch.bfloat16),
    C("ep2_dp2_batched_bf16_shared", 2, dp=2, ep=2, tokens=(4, 7), dtype=torch.bfloat16,
      dispatch="alltoall_batched", backend="auto", shared=True),
    C("ep2_dp2_batched_eplb", 2, dp=2, ep=2, tokens=(5, 8), routing="skewed", hot_rank=0,
      redundant=4, dispatch="alltoall_batched", backend="torch"),
]
CASES_4 = [
    C("ep4_dp4_a2a_random", 4, dp=4, ep=4, tokens=(5, 0, 3, 9)),
    C("ep4_dp4_a2a_skewed", 4, dp=4, ep=4, tokens=(5, 2, 3, 9), routing="skewed", hot_rank=3),
    C("ep4_dp4_a2a_no_tokens", 4, dp=4, ep=4, tokens=(0, 0, 0, 0)),
    C("ep4_dp4_allgather_random", 4, dp=4, ep=4, tokens=(5, 0, 3, 9), dispatch="allgather"),
    C("ep4_dp4_batched_round_robin", 4, dp=4, ep=4, tokens=(6, 1, 0, 3), placement="round_robin",
      dispatch="alltoall_batched", backend="auto"),
    C("ep4_dp2_a2a_replicas", 4, dp=2, ep=4, tokens=(7, 2)),
    C("ep4_dp1_allgather", 4, ep=4, tokens=(9,), dispatch="allgather", routing="skewed", hot_rank=2),
    C("ep2_tp2_dp2_a2a_bias", 4, tp=2, dp=2, ep=2, tokens=(5, 3), bias=True),
    C("ep2_tp2_dp2_allgather", 4, tp=2, dp=2, ep=2, tokens=(4, 0), dispatch="allgather"),
    C("ep4_dp2_allgather_capacity_replicas", 4, dp=2, ep=4, tokens=(9, 3), dispatch="allgather",
      max_num_tokens=5, shared=True),
    C("ep2_tp2_batched", 4, tp=2, dp=2, ep=2, tokens=(3, 6), dispatch="alltoall_batched",
      backend="torch"),
    C("dp2_tp2_no_ep", 4, tp=2, dp=2, tokens=(4, 3), bias=True),
    C("tp4", 4, tp=4, tokens=(5,)),
    C("ep2_tp2_allgather_shared_expert", 4, tp=2, ep=2, tokens=(7,), dispatch="allgather", shared=True),
    C("ep4_dp4_a2a_eplb_skewed_bias", 4, dp=4, ep=4, tokens=(3, 8, 0, 6), routing="skewed",
      hot_rank=2, redundant=4, bias=True),
    C("ep2_tp2_allgather_eplb", 4, tp=2, dp=2, ep=2, tokens=(6, 5), routing="skewed", hot_rank=0,
      redundant=2, dispatch="allgather"),
]


# NCCL on two GPUs: bf16 through the auto-selected Triton backends (contiguous and batched).
GPU_CASES = [
    dataclasses.replace(c, name=f"gpu_{c.name}", tokens=tuple(t * 37 for t in c.tokens), experts=16,
                        hidden=256, inter=128, backend="auto", dtype=torch.bfloat16)
    for c in CASES_2 if c.max_num_tokens is None
]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# Random splits on top of the cases above: fresh every run; a failure prints the whole case.
FUZZ_SEED = _seed()
FUZZ = {2: random_cases(2, 10, FUZZ_SEED), 4: random_cases(4, 8, FUZZ_SEED + 1)}


@pytest.fixture(scope="module")
def results() -> dict[int, tuple[int, list[dict]]]:
    out = {}
    for world, cases in ((2, CASES_2 + FUZZ[2]), (4, CASES_4 + FUZZ[4])):
        seed = _seed()
        out[world] = (seed, launch(run_cases, world, args=(cases, seed), timeout_s=TIMEOUT_S))
    return out


# Schemes whose activations may cross the wire quantized (dynamic per-row scales): (code width
# of a row, scale groups of a row) for a case's hidden size.
WIRE_SCHEMES = {"fp8_w8a8_channel": lambda h: 1, "fp8_w8a8_block": lambda h: -(-h // 128),
                "int8_w8a8": lambda h: 1}


def _check_wire(case: DistCase, wire: list, where: str) -> None:
    """What send_rows moved: codes (uint8, H wide) and fp32 scales where the scheme quantizes
    dispatch, else rows in the activation dtype. Replicated tokens without EP move no rows."""
    if not wire:
        assert case.ep == 1 or sum(case.tokens) == 0, f"{where}: no rows crossed the wire"
        return
    if case.quant in WIRE_SCHEMES and case.quantize_dispatch:
        want = {("uint8", (case.hidden,)), ("float32", (WIRE_SCHEMES[case.quant](case.hidden),))}
    else:
        want = {(str(case.dtype).removeprefix("torch."), (case.hidden,))}
    assert {(d, tuple(s)) for d, s in wire} == want, f"{where}: moved {wire}, want {sorted(want)}"


def _check_host_reads(case: DistCase, reads: list[str], where: str) -> None:
    """The all-gather dispatch with a fixed capacity reads nothing back to the host (CUDA-graph
    capturable); the all-to-all dispatches exchange their split sizes through it."""
    capturable = case.dispatch == "allgather" and case.max_num_tokens is not None
    if capturable:
        assert reads == [], f"{where}: dispatch / combine read {reads} back to the host"
    elif case.ep > 1 and case.dispatch != "allgather":
        assert "tolist" in reads, f"{where}: expected the split sizes through the host, saw {reads}"


@pytest.mark.parametrize("case", CASES_2 + CASES_4 + FUZZ[2] + FUZZ[4], ids=lambda c: c.name)
def test_split_layer_equals_reference(case: DistCase, results) -> None:
    seed, by_rank = results[case.world]
    for rank, per_case in enumerate(by_rank):
        r = per_case[case.name]
        where = f"{case} rank {rank} (seed {seed})"
        assert r["shape"] == r["want_shape"], where
        if case.quant:
            assert r["rows_off"] <= CODE_FLIP_ROWS, f"{where}: {r['rows_off']} rows off, relative error {r['rel_err']:.2e}"
            assert r["rel_err"] < CODE_FLIP_TOL, f"{where}: relative error {r['rel_err']:.2e}"
        else:
            tol = F32_TOL if case.dtype == torch.float32 else BF16_TOL
            assert r["rel_err"] < tol, f"{where}: relative error {r['rel_err']:.2e}"
        assert r["rerun_equal"], f"{where}: a second forward differs bitwise"
        assert r["local_experts"] == (case.experts + case.redundant) // case.ep, where
        if case.routing == "skewed" and r["routed_owners"] and not case.redundant:
            assert r["routed_owners"] == [case.hot_rank], where
        _check_wire(case, r["wire"], where)
        _check_host_reads(case, r["host_reads"], where)
        if case.redundant:
            assert r["rel_err_after_rebalance"] < F32_TOL, f"{where}: after rebalancing {r['rel_err_after_rebalance']:.2e}"
            assert r["physical_to_logical"] == by_rank[0][case.name]["physical_to_logical"], where
            if case in CASES_2 + CASES_4:  # skewed on purpose: the placement must move
                assert r["changed"], where


@pytest.mark.parametrize("case", [c for c in CASES_2 + CASES_4 if c.redundant], ids=lambda c: c.name)
def test_eplb_replicates_the_hot_rank_experts_across_ranks(case: DistCase, results) -> None:
    """Skewed routing sends every token to the hot rank's experts: after rebalancing, the
    redundant slots hold replicas of them, spread over more than one rank."""
    from fusedmoe.eplb import PhysicalPlacement

    _, by_rank = results[case.world]
    p2l = by_rank[0][case.name]["physical_to_logical"]
    placement = PhysicalPlacement(case.experts, case.ep, p2l)
    hot = set(range(case.hot_rank * case.experts // case.ep, (case.hot_rank + 1) * case.experts // case.ep))
    counts = placement.replica_counts()
    assert sum(counts[e] for e in hot) >= len(hot) + case.redundant - 1, counts
    assert all(any(e in hot for e in placement.local_logical(r)) for r in range(case.ep)), p2l


def test_misconfigured_group_refused() -> None:
    msgs = launch(run_errors, 2, args=(_seed(),), timeout_s=TIMEOUT_S)
    for rank, m in enumerate(msgs):
        assert "the process group has 2 ranks but" in m["world_mismatch"], m
        assert "= 4" in m["world_mismatch"]
        assert f"this process is rank {rank} of the group but the config says rank {1 - rank}" in m["rank_mismatch"]
        assert "num_experts=6 is not divisible by ep_size=4 (6 % 4 = 2)" in m["experts_not_divisible"]


def _hang(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 0:  # rank 1 never joins: the launch must time out, not block
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def test_launch_times_out_on_a_hang() -> None:
    with pytest.raises(LaunchError, match=r"timed out after 8 s"):
        launch(_hang, 2, timeout_s=8)


def _raise(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")


def test_launch_reports_a_rank_error() -> None:
    with pytest.raises(LaunchError, match=r"rank 1 refuses"):
        launch(_raise, 2, timeout_s=30)


# No process group needed ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(ep_size=4, dp_size=3), r"ep_size=4 is not a multiple of dp_size=3 \(4 % 3 = 1\)"),
        (dict(ep_size=4, ep_rank=3, dp_size=2, dp_rank=0),
         r"dp_rank=0 but ep_rank=3 belongs to DP rank 1 \(ep_rank // \(ep_size / dp_size\) = 3 // 2\)"),
        (dict(dispatch="deepep"), r"dispatch='deepep'; expected one of \['alltoall', 'alltoall_batched', 'allgather'\]"),
        (dict(tp_size=0), r"tp_size=0 must be >= 1"),
        (dict(ep_size=2.0), r"ep_size=2.0 must be an int"),
    ],
    ids=("ep_not_multiple_of_dp", "dp_rank_mismatch", "dispatch", "tp0", "float_size"),
)
def test_parallel_config_rejects(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_for_rank_grid() -> None:
    grid = [ParallelConfig.for_rank(r, tp_size=2, dp_size=2, ep_size=4) for r in range(8)]
    assert [(p.ep_rank, p.tp_rank, p.dp_rank) for p in grid] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 1), (2, 1, 1), (3, 0, 1), (3, 1, 1)]
    assert all(p.rank == r and p.world_size == 8 and p.token_replicas == 2 for r, p in enumerate(grid))
    with pytest.raises(ValueError, match=r"rank=8 must be in \[0, 8\) \(max\(ep_size=4, dp_size=2\) x tp_size=2 = 8 ranks\)"):
        ParallelConfig.for_rank(8, tp_size=2, dp_size=2, ep_size=4)


def test_batched_dispatch_needs_batched_format() -> None:
    parallel = ParallelConfig(ep_size=2, dispatch="alltoall_batched")
    assert parallel.use_batched_activation_format
    assert not ParallelConfig(ep_size=1, dispatch="alltoall_batched").use_batched_activation_format
    with pytest.raises(ValueError, match=r"dispatch='alltoall_batched' with ep_size=2 delivers per-expert "
                                         r"buffers: activation_format must be 'batched', not 'standard'"):
        MoEConfig(8, 2, 16, 16, parallel=parallel)
    config = MoEConfig(8, 2, 16, 16, parallel=parallel, activation_format="batched")
    assert config.num_local_experts == 4
    assert select_backend(config, Platform("cpu")).name == "batched_torch"
    assert select_backend(config.replace(dtype=torch.bfloat16), Platform("cuda", (9, 0))).name == "batched_triton"


@pytest.mark.parametrize("placement", ("linear", "round_robin"))
@pytest.mark.parametrize("ep", (1, 2, 4, 8))
def test_placement_owns_each_expert_once(placement: str, ep: int) -> None:
    p = ExpertPlacement.create(8, ParallelConfig(ep_size=ep, placement=placement))
    seen = torch.cat([p.local_to_global(r) for r in range(ep)])
    assert sorted(seen.tolist()) == list(range(8))
    for r in range(ep):
        m = p.expert_map(r)
        held = p.local_to_global(r)
        assert torch.equal(m[held], torch.arange(8 // ep, dtype=torch.int32))
        assert int((m >= 0).sum()) == 8 // ep
        want = [g for g in range(8) if (g // (8 // ep) if placement == "linear" else g % ep) == r]
        assert held.tolist() == want


def test_placement_rejects() -> None:
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep_size=4 \(6 % 4 = 2\)"):
        ExpertPlacement.create(6, ParallelConfig(ep_size=4))
    with pytest.raises(ValueError, match=r"every EP rank must hold 4 / 2 = 2 experts; .*\{0: 3, 1: 1\}"):
        ExpertPlacement(2, (0, 0, 0, 1))
    with pytest.raises(ValueError, match=r"expert owners must be in \[0, ep_size=2\); got \(expert, owner\) \[\(1, 2\)\]"):
        ExpertPlacement(2, (0, 2, 1, 1))


def test_groups_need_an_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized"):
        MoEGroups(ParallelConfig(ep_size=2))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_split_layer_equals_reference() -> None:
    seed = _seed()
    by_rank = launch(run_cases, 2, args=(GPU_CASES, seed, "cuda"), backend="nccl", timeout_s=300)
    bad = []
    for rank, per_case in enumerate(by_rank):
        for case in GPU_CASES:
            r = per_case[case.name]
            after = r.get("rel_err_after_rebalance", 0.0)
            print(f"rank {rank} {case.name}: rel_err {r['rel_err']:.2e} after rebalance {after:.2e} "
                  f"rerun_equal {r['rerun_equal']} wire {r['wire']}")
            if r["shape"] != r["want_shape"] or max(r["rel_err"], after) >= BF16_TOL or not r["rerun_equal"]:
                bad.append((case.name, rank, r))
            try:
                _check_wire(case, r["wire"], case.name)
            except AssertionError as exc:
                bad.append((case.name, rank, str(exc)))
    assert not bad, f"seed {seed}: {bad}"


@pytest.mark.parametrize("scheme", ("fp8_w8a8_channel", "fp8_w8a8_block", "int8_w8a8"))
def test_rows_on_the_wire_dequantize_to_what_the_experts_see(scheme: str) -> None:
    """Codes + scales sent instead of rows: dequantized, they are the experts' own fake-quantized
    input, and quantizing that again gives the same values (the receiver's experts do)."""
    from fusedmoe.distributed import dequantize_rows, quantize_rows, wire_key
    from fusedmoe.quant.activations import fake_quantize_activation

    config = MoEConfig(8, 2, 200, 64, dtype=torch.float32, quant=scheme, parallel=ParallelConfig(ep_size=2))
    key = wire_key(config)
    assert key is config.quant.activation
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(9, 200, generator=gen) * torch.rand(9, 1, generator=gen) * 10
    x[3] = 0.0  # an all-zero row
    codes, scale = quantize_rows(x, key)
    assert codes.dtype == torch.uint8 and codes.shape == (9, 200)
    assert scale.shape == (9, 2 if key.granularity == "group" else 1)
    got = dequantize_rows(codes, scale, key, torch.float32)
    want = fake_quantize_activation(x, key)
    assert torch.equal(got, want)
    assert torch.equal(fake_quantize_activation(got, key), want)


def test_wire_stays_in_the_activation_dtype_otherwise() -> None:
    from fusedmoe.distributed import wire_key

    ep2 = ParallelConfig(ep_size=2)
    assert wire_key(MoEConfig(8, 2, 64, 64, parallel=ep2)) is None  # unquantized
    assert wire_key(MoEConfig(8, 2, 64, 64, quant="fp8_w8a8_tensor", parallel=ep2)) is None  # batch-wide scale
    assert wire_key(MoEConfig(8, 2, 64, 64, quant="int4_w4a16_g32", parallel=ep2)) is None  # weight-only
    off = ParallelConfig(ep_size=2, quantize_dispatch=False)
    assert wire_key(MoEConfig(8, 2, 64, 64, quant="fp8_w8a8_channel", parallel=off)) is None


def test_parallel_config_repr_round_trips() -> None:
    p = ParallelConfig.for_rank(5, tp_size=2, dp_size=2, ep_size=4, dispatch="allgather")
    p = dataclasses.replace(p, quantize_dispatch=False)
    assert eval(repr(p), {"ParallelConfig": ParallelConfig}) == p


CASES_8 = [
    C("tp2_ep4_dp2_a2a_bias", 8, tp=2, dp=2, ep=4, tokens=(7, 4), bias=True),
    C("tp2_ep4_dp2_allgather", 8, tp=2, dp=2, ep=4, tokens=(5, 0), dispatch="allgather"),
    C("tp2_ep4_dp2_batched_eplb", 8, tp=2, dp=2, ep=4, tokens=(6, 9), dispatch="alltoall_batched",
      backend="auto", redundant=4, routing="skewed", hot_rank=1),
]


@pytest.mark.slow
def test_eight_ranks_tp_and_replica_subgroups() -> None:
    """tp 2 x ep 4 with dp 2: TP, EP and token-replica sub-groups all at once (~15 s on 2 cores)."""
    seed = _seed()
    by_rank = launch(run_cases, 8, args=(CASES_8, seed), timeout_s=180)
    for rank, per_case in enumerate(by_rank):
        for case in CASES_8:
            r = per_case[case.name]
            where = f"{case} rank {rank} (seed {seed})"
            assert r["shape"] == r["want_shape"] and r["rerun_equal"], where
            assert max(r["rel_err"], r.get("rel_err_after_rebalance", 0.0)) < F32_TOL, where


def test_batched_dispatch_refuses_rows_past_its_buffers(monkeypatch) -> None:
    """max_num_tokens fixes the batched buffers at max_num_tokens x outer ranks rows per local
    expert: a rank handed more tokens than that gets a named error, not an out-of-bounds write.
    The all-to-all is stubbed: what arrives is 9 rows for local expert 1."""
    from fusedmoe.distributed import AllToAllBatchedPrepareFinalize

    parallel = ParallelConfig(dp_size=2, dp_rank=0, ep_size=2, ep_rank=0)
    pf = AllToAllBatchedPrepareFinalize.__new__(AllToAllBatchedPrepareFinalize)
    pf.config = MoEConfig(4, 1, 8, 8, max_num_tokens=4, parallel=parallel)
    pf.parallel = parallel
    ids_R = torch.full((9,), 1, dtype=torch.int32)
    monkeypatch.setattr(pf, "_send", lambda x, w, ids: (torch.randn(9, 8), ids_R, None))
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"received 9 rows but the batched buffers hold max_num_tokens=4 x 2 ranks = 8"):
        pf.dispatch(torch.randn(9, 8), torch.ones(9, 1), torch.ones(9, 1, dtype=torch.int32), expert_map, 2)


def test_allgather_capacity_refuses_more_rows_before_communicating() -> None:
    """With max_num_tokens the all-gather dispatch pads every rank to it; a rank holding more rows
    gets a named error before any collective (the stub group would fail one)."""
    from types import SimpleNamespace

    from fusedmoe.distributed import AllGatherPrepareFinalize

    parallel = ParallelConfig(dp_size=2, dp_rank=0, ep_size=2, ep_rank=0, dispatch="allgather")
    pf = AllGatherPrepareFinalize.__new__(AllGatherPrepareFinalize)
    pf.config = MoEConfig(4, 1, 8, 8, max_num_tokens=4, parallel=parallel)
    pf.parallel = parallel
    pf.groups = SimpleNamespace(outer=object(), replicas=None, tp=None)
    pf.wire = None
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dispatches 5 tokens but max_num_tokens=4"):
        pf.dispatch(torch.randn(5, 8), torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.int32), expert_map)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_allgather_capacity_graph() -> None:
    """EP=2 over NCCL with the fixed-capacity all-gather: an eager call makes no host sync, and a
    captured call replayed on new inputs equals the eager call bitwise and the reference."""
    seed = _seed()
    by_rank = launch(run_capture, 2, args=(seed,), backend="nccl", timeout_s=300)
    for rank, r in enumerate(by_rank):
        where = f"rank {rank} (seed {seed})"
        print(where, r)
        assert r["sync_error"] == "", f"{where}: an eager call synced with the host: {r['sync_error']}"
        for i, rep in enumerate(r["replays"]):
            assert rep["equal_eager"], f"{where}: replay {i} differs from the eager call"
            assert rep["rel_err"] < BF16_TOL, f"{where}: replay {i} relative error {rep['rel_err']:.2e}"


@pytest.mark.gpu
def test_allgather_capacity_graph_one_gpu_loopback(monkeypatch) -> None:
    """One GPU stands in for EP rank 0 of 2 (a 'fake' process group: the all-gather hands back this
    rank's rows for both ranks, the reduce-scatter keeps this rank's own partial sums). The
    fixed-capacity forward with the Triton experts makes no host sync, is captured in a CUDA graph,
    and its replays on new inputs equal eager calls bitwise and the reference over this rank's
    experts. NCCL inside the graph: test_nccl_allgather_capacity_graph (2 GPUs)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fusedmoe.distributed as fd

    def gather(out, inp, group=None):
        out.view(2, *inp.shape).copy_(inp.unsqueeze(0).expand(2, *inp.shape))

    def scatter(out, inp, group=None):
        out.copy_(inp.view(2, *out.shape)[0])

    monkeypatch.setattr(fd, "_all_gather", gather)
    monkeypatch.setattr(fd, "_reduce_scatter", scatter)
    seed = _seed()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        r = run_capture(0, 2, seed, local_only=True)
    finally:
        dist.destroy_process_group()
    print(r)
    assert r["sync_error"] == "", f"seed {seed}: an eager call synced with the host: {r['sync_error']}"
    for i, rep in enumerate(r["replays"]):
        assert rep["equal_eager"], f"seed {seed}: replay {i} differs from the eager call"
        assert rep["rel_err"] < BF16_TOL, f"seed {seed}: replay {i} relative error {rep['rel_err']:.2e}"
