"""Batch invariance (`MoEConfig.batch_invariant`, FUSEDMOE_BATCH_INVARIANT=1): a token's output
does not depend on the other tokens of the call, bitwise.

The `triton` and `batched_triton` records claim it for the unquantized and weight-only schemes
(`experts.batch_invariant_tiles`: one aligned plan at every token count); the oracle keeps every
other record, and their W8A8 schemes, out with the reason. The kernels' logic runs here under
the Triton interpreter; on a GPU the `gpu`-marked test runs the same check in bf16.
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fusedmoe import MoEConfig
from fusedmoe.backends import REGISTRY
from fusedmoe.oracle import explain
from fusedmoe.platform import Platform

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HOPPER = Platform(kind="cuda", capability=(9, 0), packages=("triton",), has_triton=True)
T, E, K, H, I = 24, 5, 2, 64, 96  # noqa: E741  (E and I not powers of two; I a multiple of 32 for the 4-bit groups)


def _subsets(tokens: int) -> tuple[list[int], ...]:
    """Sub-batches of the tokens: one token, a few from the middle, a reordered half, all of them."""
    return [7], [3, 4, 5], list(range(tokens - 1, -1, -2)), list(range(tokens))


def _problem(dtype, device, seed=0, tokens=T, hidden=H):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, hidden, generator=gen) / hidden**0.5).to(device)
    w2 = (torch.randn(E, I, hidden, generator=gen).transpose(1, 2).contiguous() / I**0.5).to(device)
    b13 = torch.randn(E, 2 * I, generator=gen).to(device, dtype)
    b2 = torch.randn(E, hidden, generator=gen).to(device, dtype)
    logits = torch.randn(tokens, E, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), K)
    ids[0] = ids[1]  # two tokens on the same experts
    return x, w13, w2, b13, b2, weights.to(device, dtype), ids.to(device)


def _rows_agree(run, x, weights, ids) -> bool:
    """run(x, weights, ids) on each subset of the tokens gives bitwise the full call's rows."""
    full = run(x, weights, ids)
    return all(torch.equal(run(x[rows], weights[rows], ids[rows]), full[rows]) for rows in _subsets(x.shape[0]))


def test_the_oracle_serves_batch_invariance_with_triton_only():
    claimed = sorted(name for name, b in REGISTRY.items() if b.batch_invariant)
    assert claimed == ["batched_triton", "triton"]
    for quant in (None, "int4_w4a16_g32", "mxfp4_w4a16", "nvfp4_w4a16"):
        config = MoEConfig(E, K, H, I, quant=quant, batch_invariant=True)
        assert explain(config, HOPPER).chosen == "triton", quant
        assert explain(config.replace(batch_invariant=False), HOPPER).chosen is not None
        assert explain(config.replace(activation_format="batched"), HOPPER).chosen == "batched_triton", quant
    e = explain(MoEConfig(E, K, H, I, quant="fp8_w8a8_block", batch_invariant=True), HOPPER)
    assert e.chosen is None
    reason = {v.name: v.reason for v in e.verdicts}["triton"]
    assert "fp8_w8a8_block is not batch-invariant here" in reason and "by the token count" in reason
    batched = explain(MoEConfig(E, K, H, I, quant="int8_w8a8", activation_format="batched", batch_invariant=True),
                      HOPPER)
    assert batched.chosen is None
    assert "int8_w8a8 is not batch-invariant here" in {v.name: v.reason for v in batched.verdicts}["batched_triton"]
    # on the CPU nothing claims it: a clear error rather than a silently batch-dependent result
    cpu = explain(MoEConfig(E, K, H, I, batch_invariant=True), Platform(kind="cpu"))
    assert cpu.chosen is None
    assert {v.name: v.reason for v in cpu.verdicts}["cpu"] == "it is not batch-invariant (batch_invariant requested)"


def test_a_layer_asks_for_it():
    """FusedMoE(batch_invariant=True) carries the request to the oracle: on the CPU no backend
    claims it, and processing says so (naming the reason per backend)."""
    from fusedmoe import FusedMoE
    from fusedmoe.errors import NoBackendError

    layer = FusedMoE(E, K, H, I, batch_invariant=True)
    assert layer.config.batch_invariant
    with torch.no_grad():
        layer.w13_weight.normal_()
        layer.w2_weight.normal_()
    with pytest.raises(NoBackendError, match="not batch-invariant"):
        layer.process_weights_after_loading()
    assert not FusedMoE(E, K, H, I).config.batch_invariant


def test_the_environment_knob_asks_the_oracle_and_the_experts(monkeypatch):
    from fusedmoe.backends.triton.experts import TritonExperts

    monkeypatch.setenv("FUSEDMOE_BATCH_INVARIANT", "1")
    config = MoEConfig(E, K, H, I, quant="fp8_w8a8_channel")
    assert explain(config, HOPPER).chosen is None
    assert explain(config.replace(quant=None), HOPPER).chosen == "triton"
    assert TritonExperts(config.replace(quant=None)).batch_invariant
    monkeypatch.delenv("FUSEDMOE_BATCH_INVARIANT")
    assert not TritonExperts(config.replace(quant=None)).batch_invariant
    assert TritonExperts(config.replace(quant=None, batch_invariant=True)).batch_invariant


def _interpreter():
    if torch.cuda.is_available():
        pytest.skip("interpreter test (CPU); the GPU runs test_batch_invariant_rows_on_the_gpu")
    pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_unquantized_rows_do_not_depend_on_the_batch(dtype):
    """Every subset of the tokens gives bitwise the rows of the whole call with batch_invariant;
    the default plan (the direct path for a few tokens, tiles by token count) does not, which is
    what makes the check able to fail here."""
    _interpreter()
    from fusedmoe.backends.triton.experts import triton_experts

    x, w13, w2, b13, b2, weights, ids = _problem(dtype, torch.device("cpu"))
    w13, w2 = w13.to(dtype), w2.to(dtype)

    def run(invariant):
        return lambda x, weights, ids: triton_experts(x, w13, w2, weights, ids, b13, b2, None, E, "silu", False,
                                                      1.702, None, batch_invariant=invariant)

    assert _rows_agree(run(True), x, weights, ids)
    assert not _rows_agree(run(False), x, weights, ids)


@pytest.mark.parametrize("case", ["clamped_swigluoai_expert_map", "weight_on_input_top1", "top_k_all_no_mul"])
def test_rows_do_not_depend_on_the_batch_with_every_feature(case):
    """The features the triton record applies keep the rows batch-invariant: the clamped
    swigluoai activation with an expert_map that leaves some experts to other ranks, the router
    weight on the input at top_k 1, and every expert for every token with a non-gated activation."""
    _interpreter()
    from fusedmoe.backends.triton.experts import triton_experts

    x, w13, w2, b13, b2, weights, ids = _problem(torch.float32, torch.device("cpu"), seed=2)
    activation, limit, on_input, expert_map = "swigluoai", 7.0, False, None
    if case == "clamped_swigluoai_expert_map":
        expert_map = torch.tensor([0, -1, 1, 2, -1], dtype=torch.int32)  # experts 1 and 4 on other ranks
        w13, w2, b13, b2 = w13[:3], w2[:3], b13[:3], b2[:3]
    elif case == "weight_on_input_top1":
        activation, limit, on_input = "silu", None, True
        weights, ids = weights[:, :1], ids[:, :1]
    else:  # every expert for every token; relu2_no_mul takes w13's first I rows
        activation, limit = "relu2_no_mul", None
        weights, ids = torch.topk(torch.randn(T, E, generator=torch.Generator().manual_seed(3)).softmax(-1), E)
        w13, b13 = w13[:, :I].contiguous(), b13[:, :I].contiguous()

    def run(x, weights, ids):
        return triton_experts(x, w13, w2, weights, ids, b13, b2, expert_map, E, activation, on_input, 1.702, limit,
                              batch_invariant=True)

    assert _rows_agree(run, x, weights, ids)


@pytest.mark.parametrize("quant", ["int4_w4a16_g32", "mxfp4_w4a16"])
def test_weight_only_rows_do_not_depend_on_the_batch(quant):
    _interpreter()
    from fusedmoe.backends.triton.experts import TritonExperts
    from fusedmoe.modular import ExpertWeights
    from fusedmoe.quant.weights import quantize_weights

    x, w13, w2, b13, b2, weights, ids = _problem(torch.float32, torch.device("cpu"), seed=1)
    q13, q2, params = quantize_weights(w13, w2, quant)
    config = MoEConfig(E, K, H, I, dtype=torch.float32, quant=quant, has_bias=True, batch_invariant=True)
    experts = TritonExperts(config)
    w = experts.process_weights(ExpertWeights(q13, q2, b13, b2, quant=params))

    def run(x, weights, ids):
        return experts.apply(x, w, weights, ids, expert_map_E=None)

    assert _rows_agree(run, x, weights, ids)
    experts.batch_invariant = False
    assert not _rows_agree(run, x, weights, ids)


@pytest.mark.parametrize("quant", [None, "int4_w4a16_g32"], ids=str)
def test_batched_layout_rows_do_not_depend_on_the_batch(quant):
    """The batched layout (per-expert buffers, the expert-parallel dispatch's) through its
    one-rank dispatch and combine: a token's output is the whole call's, bitwise, whatever else
    is dispatched with it (the buffers' sizes and the rows' places in them change); without
    batch_invariant the plan follows the counts and the same check fails."""
    _interpreter()
    from fusedmoe.backends.triton.experts import BatchedTritonExperts
    from fusedmoe.modular import ExpertWeights, make_modular
    from fusedmoe.quant.weights import quantize_weights

    # enough tokens (and K) that the plan by counts changes between one token and all of them
    x, w13, w2, b13, b2, weights, ids = _problem(torch.float32, torch.device("cpu"), seed=4, tokens=160, hidden=512)
    params = None
    if quant is not None:
        w13, w2, params = quantize_weights(w13, w2, quant)
    config = MoEConfig(E, K, 512, I, dtype=torch.float32, quant=quant, has_bias=True, activation_format="batched",
                       batch_invariant=True)
    experts = BatchedTritonExperts(config)
    w = experts.process_weights(ExpertWeights(w13, w2, b13, b2, quant=params))
    kernel = make_modular(config, experts)

    def run(x, weights, ids):
        return kernel(x, w, weights, ids)

    assert experts.batch_invariant and _rows_agree(run, x, weights, ids)
    experts.batch_invariant = False
    assert not _rows_agree(run, x, weights, ids)


def test_batch_invariance_refuses_what_it_cannot_keep():
    _interpreter()
    from fusedmoe.backends.triton.experts import triton_experts
    from fusedmoe.backends.triton.quant import triton_quant_experts
    from fusedmoe.quant.weights import quantize_weights

    x, w13, w2, b13, b2, weights, ids = _problem(torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="the direct decode path is not batch-invariant"):
        triton_experts(x, w13, w2, weights, ids, None, None, None, E, "silu", False, 1.702, None,
                       direct=True, batch_invariant=True)
    q13, q2, p = quantize_weights(w13, w2, "int8_w8a8")
    with pytest.raises(ValueError, match="int8_w8a8 path is not batch-invariant .*by the token count"):
        triton_quant_experts(x, q13, q2, weights, ids, None, None, None, E, "silu", False, 1.702, None,
                             "int8_w8a8", p.w13_scale, p.w2_scale, p.a13_scale, p.a2_scale, batch_invariant=True)
    from fusedmoe.backends.triton.quant import triton_batched_quant_experts

    buffers, counts = x.view(4, 6, H), torch.tensor([6, 0, 3, 1])
    with pytest.raises(ValueError, match="int8_w8a8 path is not batch-invariant"):
        triton_batched_quant_experts(buffers, counts, q13[:4], q2[:4], None, None, "silu", 1.702, None, "int8_w8a8",
                                     p.w13_scale[:4], p.w2_scale[:4], p.a13_scale, p.a2_scale, batch_invariant=True)


def test_batch_invariant_plans_by_token_count(monkeypatch):
    """Which plan a batch-invariant call runs (nothing launches): bf16 unquantized on a Hopper
    GPU the aligned plan of its own token count with GEMM1 unsplit (the direct path never);
    4-bit weight-only in bf16 there one plan with N tiles narrowed at decode; other GPUs, fp16,
    the CPU, 8-bit weight-only and the batched layout one plan at every count."""
    from fusedmoe.backends.triton import experts as ex
    from fusedmoe.backends.triton import quant as quant_mod
    from fusedmoe.backends.triton import tuning
    from fusedmoe.backends.triton import weight_only as wo_mod
    from fusedmoe.quant.scheme import get_scheme

    monkeypatch.setattr(tuning, "_device_name", lambda device: "NVIDIA H200")  # its packaged table's entries
    for mod in (ex, quant_mod, wo_mod):
        monkeypatch.setattr(mod, "_num_sms", lambda device: 132)
    monkeypatch.setattr(ex, "_sm90", lambda index: True)
    monkeypatch.setattr(ex, "device_capability", lambda index: (9, 0))  # a Hopper GPU, where it was measured
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # tables are read for CUDA devices only
    ex.clear_tile_caches()

    def problem(tokens, dtype=torch.bfloat16):
        return ex.GemmProblem(tokens * 8, 128, 2048, 768, 8, True, dtype)

    for tokens in (1, 16, 1024, 4096):
        direct, t1, t2 = ex.plan_tiles(problem(tokens), None, cuda, None, None, True)
        a1, a2 = ex.fit_k(*ex._aligned_tiles(problem(tokens), None, cuda), problem(tokens))
        assert not direct and (t1, t2) == (dataclasses.replace(a1, split_k=1), a2), tokens
    assert ex.plan_tiles(problem(1), None, cuda, None, None, False)[0]  # the default plan at one token: direct
    assert ex.plan_tiles(problem(1), None, cuda, None, None, True)[1].block_m == 16  # not the 1024-token tile
    assert ex.plan_tiles(problem(1), None, cuda, None, None, True)[1:] != \
        ex.plan_tiles(problem(4096), None, cuda, None, None, True)[1:]
    fixed = [(torch.float16, None, cuda), (torch.bfloat16, None, cpu), (torch.bfloat16, "mxfp4_w4a16", cpu),
             (torch.bfloat16, "fp8_w8a16", cuda), (torch.float16, "int4_w4a16_g32", cuda)]
    for dtype, quant, device in fixed:
        plans = {ex.plan_tiles(problem(t, dtype), get_scheme(quant), device, None, None, True) for t in (1, 16, 4096)}
        assert len(plans) == 1 and not ex.per_count_invariant(problem(1, dtype), get_scheme(quant), device), \
            (dtype, quant, device)
    # int4 (either layout), and mxfp4 / nvfp4 in the checkpoint layout, in bf16 on a GPU: the fixed
    # plan's rows, K steps and warps at every count, its N tiles narrowed at decode until two
    # programs per SM (or 64 wide)
    from fusedmoe import knobs

    def narrowed_fixed(quant, **env):
        with knobs.override(**env):
            ex.clear_tile_caches()
            one, many = (ex.plan_tiles(problem(t), get_scheme(quant), cuda, None, None, True)[1:] for t in (1, 4096))
            for a, b in zip(one, many, strict=True):
                assert dataclasses.replace(a, block_n=b.block_n) == b and a.split_k == 1, (quant, env)
            assert one[0].block_n == 64 < many[0].block_n, quant  # GEMM1 at one token: 8 x 768 / 64 = 96 programs
            assert ex.narrow_invariant(problem(1), get_scheme(quant), cuda) and \
                not ex.narrow_invariant(problem(1), get_scheme(quant), cpu)
            assert ex.per_count_tiles(problem(1), get_scheme(quant), cuda) is None, (quant, env)

    for fragments in (True, "all", False):
        narrowed_fixed("int4_w4a16_g32", TRITON_W4_FRAGMENTS=fragments)
    for quant in ("mxfp4_w4a16", "nvfp4_w4a16"):
        narrowed_fixed(quant, TRITON_W4_FRAGMENTS=False)
    ex.clear_tile_caches()
    # mxfp4 / nvfp4 as fragments: the aligned plan of each count, GEMM1 unsplit and both N tiles
    # narrowed, where both tiles run 4 warps; an 8-warp plan (here M=4096's) falls back to the
    # narrowed fixed plan
    for quant in ("mxfp4_w4a16", "nvfp4_w4a16"):
        scheme, runs = get_scheme(quant), {}
        for t in (1, 16, 256, 4096):
            a1, a2 = ex._aligned_tiles(problem(t), scheme, cuda)
            plan = ex.plan_tiles(problem(t), scheme, cuda, None, None, True)
            by_count = ex.per_count_tiles(problem(t), scheme, cuda)
            if a1.num_warps == a2.num_warps == ex.NARROW_WARPS:
                want = ex.fit_k(ex._narrowed(dataclasses.replace(a1, split_k=1), problem(t), 768, cuda),
                                ex._narrowed(a2, problem(t), 2048, cuda), problem(t))
                assert by_count is not None and plan == (False, *want), (quant, t)
            else:
                fixed = ex._fixed_invariant_tiles(problem(t), scheme, cuda)
                assert by_count is None and plan[1].block_m == fixed[0].block_m, (quant, t)
            runs[t] = plan
        assert runs[1][1].block_m == 16 and runs[1][1].split_k == 1, quant  # its own rows, one K pass
        # the packaged M=4096 entry runs 8 warps: the fixed plan, as the other layouts'
        assert ex._aligned_tiles(problem(4096), scheme, cuda)[0].num_warps == 8, quant
        assert runs[4096][1:] == ex.fit_k(*ex._fixed_invariant_tiles(problem(4096), scheme, cuda), problem(4096))
        assert runs[1][1].block_m < ex._fixed_invariant_tiles(problem(1), scheme, cuda)[0].block_m, quant
    # 8-warp tiles (128-row blocks) are not narrowed: a narrower N tile changed rows there (GPU fuzz
    # seed 500199's shape: mxfp4, not gated, 46 experts, 7 per token)
    few = ex.GemmProblem(7, 46, 64, 640, 7, False, torch.bfloat16)
    one, many = (ex.plan_tiles(dataclasses.replace(few, num_slots=7 * t), get_scheme("mxfp4_w4a16"), cuda, None,
                               None, True)[1:] for t in (1, 2295))
    assert many[0].num_warps == 8 and many[0].block_n == 128  # 2295 tokens: the fixed plan, not narrowed
    few1 = dataclasses.replace(few, num_slots=7)  # one token: its own plan, at 4 warps
    assert one == ex.fit_k(*ex.per_count_tiles(few1, get_scheme("mxfp4_w4a16"), cuda), few1)
    assert one[0].num_warps == one[1].num_warps == 4
    monkeypatch.setattr(ex, "device_capability", lambda index: (10, 0))  # not measured there: one plan
    ex.clear_tile_caches()
    for quant in (None, "mxfp4_w4a16"):
        assert len({ex.plan_tiles(problem(t), get_scheme(quant), cuda, None, None, True) for t in (1, 4096)}) == 1
    monkeypatch.setattr(ex, "device_capability", lambda index: (9, 0))
    ex.clear_tile_caches()
    batched = {ex.batched_invariant_tiles(problem(t), scheme=None, device=cuda, top_k=8) for t in (1, 16, 4096)}
    assert len(batched) == 1
    plan = ex.describe_plan(problem(1), None, cuda, True)  # explain --batch-invariant --tokens 1
    assert plan["path"] == "aligned" and "the aligned plan of this token count" in plan["why"]
    assert plan["gemm1"]["source"].endswith("in one K pass") and "K pass" not in plan["gemm2"]["source"]
    assert "one aligned plan at every token count" in ex.describe_plan(problem(1, torch.float16), None, cuda,
                                                                      True)["why"]
    # explain on a machine without the GPU says what a Hopper GPU runs instead
    assert ex.describe_plan(problem(1), None, cpu, True)["why"].endswith(
        "; on a Hopper GPU: the aligned plan of each token count, GEMM1 unsplit")
    assert ex.describe_plan(problem(1), get_scheme("nvfp4_w4a16"), cpu, True)["why"].endswith(
        "; on a Hopper GPU: the aligned plan of each token count, GEMM1 unsplit (where both tiles run 4 warps; "
        "else its N tiles narrowed at decode)")
    assert ex.describe_plan(problem(1), get_scheme("int4_w4a16_g32"), cpu, True)["why"].endswith(
        "; on a Hopper GPU: its N tiles narrowed at decode")
    assert "Hopper" not in ex.describe_plan(problem(1, torch.float16), None, cpu, True)["why"]
    narrowed = ex.describe_plan(problem(1), get_scheme("int4_w4a16_g32"), cuda, True)
    assert "its N tiles narrowed at decode" in narrowed["why"] and narrowed["gemm1"]["source"].endswith("for this M")
    by_count = ex.describe_plan(problem(1), get_scheme("mxfp4_w4a16"), cuda, True)
    assert "the aligned plan of this token count" in by_count["why"] and "(at 4 warps)" in by_count["why"]
    assert by_count["gemm1"]["source"].endswith("in one K pass, N narrowed for this M")
    assert "its N tiles narrowed" in ex.describe_plan(problem(4096), get_scheme("mxfp4_w4a16"), cuda, True)["why"]
    ex.clear_tile_caches()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["standard", "batched"])
@pytest.mark.parametrize("quant", [None, "mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g32"], ids=str)
def test_batch_invariant_rows_on_the_gpu(quant, layout):
    """bf16 on the GPU (its tensor cores, TMA where planned) at Qwen3-30B's shape, whose token
    counts have tuned entries: each token's row of a batch of 1-1024 tokens bitwise equals its
    row in the batch of 4096. Unquantized in the standard layout each count runs its own aligned
    plan (`per_count_invariant`), so this checks that those plans agree; the rest run one plan.
    Without batch_invariant the standard layout's one-token call (the direct path) differs: the
    check can fail."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from fusedmoe.backends.triton.experts import BatchedTritonExperts, TritonExperts
    from fusedmoe.modular import ExpertWeights, make_modular
    from fusedmoe.quant.weights import quantize_weights

    device, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    tokens, experts, top_k, hidden, inter = 4096, 128, 8, 2048, 768
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=device, generator=gen) / inter**0.5
    weights, ids = torch.topk(torch.randn(tokens, experts, device=device, generator=gen).softmax(-1), top_k)
    weights = weights.to(torch.bfloat16)
    config = MoEConfig(experts, top_k, hidden, inter, quant=quant, activation_format=layout, batch_invariant=True)
    impl = (TritonExperts if layout == "standard" else BatchedTritonExperts)(config)
    if quant is None:
        w = ExpertWeights(w13.to(torch.bfloat16), w2.to(torch.bfloat16))
    else:
        q13, q2, params = quantize_weights(w13.to(torch.bfloat16), w2.to(torch.bfloat16), quant)
        w = impl.process_weights(ExpertWeights(q13, q2, quant=params))
    kernel = make_modular(config, impl)
    subsets = [[0], [5, 6, 7, 8], list(range(1, 64, 3)), list(range(tokens - 1, 3839, -1)),
               list(range(1000, 2024))]

    def agree() -> list[int]:
        full = kernel(x, w, weights, ids)
        bad = []
        for rows in subsets:
            rows = torch.tensor(rows, device=device)
            if not torch.equal(kernel(x[rows], w, weights[rows], ids[rows]), full[rows]):
                bad.append(rows.numel())
        return bad

    assert agree() == [], (quant, layout)
    if layout == "standard":
        impl.batch_invariant = False
        assert 1 in agree(), quant
