"""fused_experts against an independent float64 loop written from the spec (semantics.md 2-3).

The loop below shares no code with fusedmoe: no fusedmoe.reference, no fusedmoe.activations.
It runs per token and per slot; every path (fused_experts_ref, backends torch / cpu / auto) is
compared with it on the cases of `cases.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from cases import (
    BASE,
    TOLERANCES,
    Case,
    Inputs,
    assert_close_rel,
    check_scale,
    experts_cases,
    low_precision_cases,
    make_inputs,
    rel_errors,
)
from fusedmoe import MoEConfig, Platform, explain, fused_experts, fused_experts_ref, select_backend
from fusedmoe.activations import ACTIVATIONS
from fusedmoe.backends import REGISTRY

EXPERTS_CASES = experts_cases()
LOW_PRECISION_CASES = low_precision_cases()
# grouped_mm (torch's grouped GEMM) also runs on CPU tensors: tested when registered.
OPTIONAL_BACKENDS = tuple(n for n in ("grouped_mm",) if n in REGISTRY)
KERNEL_BACKENDS = ("torch", "cpu", *OPTIONAL_BACKENDS)
IMPLS = ("ref", "torch", "cpu", "auto", *OPTIONAL_BACKENDS)


def _grouped_mm_refuses(case: Case) -> bool:
    itemsize = torch.tensor([], dtype=case.dtype).element_size()
    return any(n * itemsize % 16 for n in (case.hidden, case.intermediate))


def impl_case_params(impls, cases) -> list:
    """(impl, case) pairs; grouped_mm skips sizes it refuses (test_grouped_mm_refuses_unaligned)."""
    return [pytest.param(impl, case, id=f"{impl}-{case.id}")
            for case in cases for impl in impls
            if not (impl == "grouped_mm" and _grouped_mm_refuses(case))]


@pytest.mark.skipif("grouped_mm" not in REGISTRY, reason="no grouped_mm backend")
def test_grouped_mm_refuses_unaligned():
    """torch's grouped GEMM needs 16-byte row strides: the oracle refuses, the kernel never runs."""
    from fusedmoe import BackendRequestError

    gen = torch.Generator().manual_seed(0)
    h, i = 65, 37
    x = torch.randn(4, h, generator=gen)
    w13, w2 = torch.randn(3, 2 * i, h, generator=gen), torch.randn(3, h, i, generator=gen)
    weights, ids = torch.rand(4, 2, generator=gen), torch.randint(0, 3, (4, 2), generator=gen)
    with pytest.raises(BackendRequestError, match="16-byte-aligned rows: hidden=65"):
        fused_experts(x, w13, w2, weights, ids, backend="grouped_mm")


# The independent reference --------------------------------------------------------------------
def _sigmoid(z: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-z))


def _silu(z: torch.Tensor) -> torch.Tensor:
    return z * _sigmoid(z)


def _gelu_erf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def _gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def spec_activation(h: torch.Tensor, case: Case) -> torch.Tensor:
    """act(h) for one slot, h [G] float64, as semantics.md section 3 writes it."""
    name, limit = case.activation, case.swiglu_limit
    if name == "silu_no_mul":
        return _silu(h)
    if name == "gelu_no_mul":
        return _gelu_erf(h)
    if name == "relu2_no_mul":
        return torch.clamp(h, min=0.0) ** 2
    inter = h.shape[0] // 2
    gate, up = h[:inter], h[inter:]  # [gate | up] halves
    if name == "swigluoai":
        limit = 7.0 if limit is None else limit
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
        return (up + 1.0) * gate * _sigmoid(case.swiglu_alpha * gate)
    if limit is not None:  # clamped SwiGLU (DeepSeek-V4 style) on any gated activation
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    act = {"silu": _silu, "gelu": _gelu_erf, "gelu_tanh": _gelu_tanh}[name]
    return act(gate) * up


def spec_experts(inp: Inputs) -> torch.Tensor:
    """out [T, H] float64, one token and one slot at a time (semantics.md section 2)."""
    case = inp.case
    f64 = functools.partial(torch.Tensor.to, dtype=torch.float64)
    x, w13, w2 = f64(inp.x), f64(inp.w13), f64(inp.w2)
    num_tokens, hidden = x.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for t in range(num_tokens):
        for k in range(inp.topk_ids.shape[1]):
            expert = int(inp.topk_ids[t, k])
            if not 0 <= expert < case.num_experts:
                continue  # out-of-range id: the slot contributes zero
            local = expert if inp.expert_map is None else int(inp.expert_map[expert])
            if local < 0:
                continue  # expert lives on another rank
            w = float(inp.topk_weights[t, k])
            x_t = w * x[t] if case.apply_router_weight_on_input else x[t]
            h = w13[local] @ x_t
            if inp.w13_bias is not None:
                h = h + f64(inp.w13_bias[local])
            y = w2[local] @ spec_activation(h, case)
            if inp.w2_bias is not None:
                y = y + f64(inp.w2_bias[local])
            out[t] += y if case.apply_router_weight_on_input else w * y
    return out


@functools.cache
def expected(case: Case) -> tuple[Inputs, torch.Tensor]:
    """(inputs, float64 spec output), computed once per case; tests must not mutate them."""
    inp = make_inputs(case)
    ref = spec_experts(inp)
    if case.expert_map is None or ref.any():  # all-zero only where every slot is off-rank
        check_scale(ref)
    return inp, ref


def run(impl: str, inp: Inputs, **overrides) -> torch.Tensor:
    args = (inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids)
    if impl == "ref":
        return fused_experts_ref(*args, **{**inp.ref_kwargs, **overrides})
    return fused_experts(*args, backend=impl, **{**inp.kwargs, **overrides})


# Correctness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", EXPERTS_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", ("ref", "torch"))
def test_float64_reference_paths(impl: str, case: Case) -> None:
    inp, ref = expected(case)
    out = run(impl, inp.to(torch.float64))
    assert out.dtype == torch.float64
    assert_close_rel(out, ref, torch.float64, what=impl)


@pytest.mark.parametrize(("impl", "case"), impl_case_params(IMPLS, EXPERTS_CASES))
def test_float32(impl: str, case: Case) -> None:
    inp, ref = expected(case)
    out = run(impl, inp)
    assert out.dtype == case.dtype
    assert_close_rel(out, ref, case.dtype, what=impl)


@pytest.mark.parametrize(("impl", "case"), impl_case_params(IMPLS, LOW_PRECISION_CASES))
def test_low_precision(impl: str, case: Case) -> None:
    inp, ref = expected(case)
    out = run(impl, inp)
    assert out.dtype == case.dtype
    assert_close_rel(out, ref, case.dtype, what=impl)


@pytest.mark.parametrize(
    "dtype", (torch.float32, torch.bfloat16, torch.float16), ids=lambda d: str(d)[6:]
)
@pytest.mark.parametrize(
    "case", (BASE, BASE.replace(expert_map="missing", has_bias=True, activation="swigluoai")),
    ids=lambda c: c.id,
)
def test_auto_selects_cpu_on_cpu_tensors(case: Case, dtype: torch.dtype) -> None:
    case = case.replace(dtype=dtype)
    inp, _ = expected(case)
    config = MoEConfig(
        case.num_experts, case.top_k, case.hidden, case.intermediate, dtype=dtype,
        activation=case.activation, has_bias=case.has_bias, has_expert_map=case.expert_map is not None,
    )
    platform = Platform.for_device(inp.x.device)
    assert platform.kind == "cpu"
    assert select_backend(config, platform).name == "cpu"
    assert explain(config, platform).chosen == "cpu"
    assert torch.equal(run("auto", inp), run("cpu", inp))


def test_every_activation_is_covered() -> None:
    assert {c.activation for c in EXPERTS_CASES} == set(ACTIVATIONS)


def test_empty_batch_returns_0_by_h() -> None:
    inp, _ = expected(BASE.replace(num_tokens=0))
    for impl in IMPLS:
        out = run(impl, inp)
        assert out.shape == (0, BASE.hidden) and out.dtype == inp.x.dtype, impl


# The cases discriminate: each feature case differs from its twin by > 10x the float32 tolerance.
DISCRIMINATING = [
    (BASE.replace(activation="gelu_tanh"), BASE.replace(activation="gelu")),
    (BASE.replace(swiglu_limit=0.75), BASE),
    (BASE.replace(activation="swigluoai", swiglu_alpha=1.3, swiglu_limit=0.9),
     BASE.replace(activation="swigluoai")),
    (BASE.replace(activation="swigluoai", swiglu_alpha=1.3, swiglu_limit=0.9),
     BASE.replace(activation="swigluoai", swiglu_limit=0.9)),
    (BASE.replace(top_k=1, apply_router_weight_on_input=True), BASE.replace(top_k=1)),
]


@pytest.mark.parametrize(("case", "twin"), DISCRIMINATING, ids=lambda c: c.id)
def test_cases_discriminate(case: Case, twin: Case) -> None:
    """Guard the data: the spec output changes with the feature (same tensors, other option)."""
    inp, ref = expected(case)
    other = spec_experts(dataclasses.replace(inp, case=twin))
    fro, _ = rel_errors(other, ref)
    assert fro > 10 * TOLERANCES[torch.float32].rel_fro, f"{case.id} vs {twin.id}: {fro:.2e}"


# Buffers, determinism ----------------------------------------------------------------------------
INPLACE_CASES = [BASE, BASE.replace(has_bias=True, expert_map="missing"),
                 BASE.replace(dtype=torch.bfloat16), BASE.replace(num_tokens=0)]


@pytest.mark.parametrize("case", INPLACE_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", (*KERNEL_BACKENDS, "auto"))
def test_inplace_writes_into_hidden_states(backend: str, case: Case) -> None:
    inp, ref = expected(case)
    x = inp.x.clone()
    out = fused_experts(x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, backend=backend,
                        inplace=True, **inp.kwargs)
    assert out is x
    assert_close_rel(x, ref, case.dtype, what="hidden_states after inplace")


@pytest.mark.parametrize("case", INPLACE_CASES[:3], ids=lambda c: c.id)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_out_of_place_leaves_inputs_untouched(backend: str, case: Case) -> None:
    inp, _ = expected(case)
    tensors = [t for t in (inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, inp.w13_bias,
                           inp.w2_bias, inp.expert_map) if t is not None]
    before = [t.clone() for t in tensors]
    out = run(backend, inp)
    assert all(out.data_ptr() != t.data_ptr() for t in tensors)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize(
    "case", (EXPERTS_CASES[-1], EXPERTS_CASES[-1].replace(dtype=torch.bfloat16)), ids=lambda c: c.id
)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_deterministic(backend: str, case: Case) -> None:
    inp, _ = expected(case)
    assert torch.equal(run(backend, inp), run(backend, inp))


@pytest.mark.parametrize("inplace", (False, True), ids=("out_of_place", "inplace"))
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_row_strided_hidden_states(backend: str, inplace: bool) -> None:
    """x may be a column slice of a wider buffer (row stride > H, unit column stride); in place,
    only the slice is written: the NaN poison in the other columns survives."""
    inp, ref = expected(BASE)
    wide = torch.full((BASE.num_tokens, BASE.hidden + 7), float("nan"))
    wide[:, : BASE.hidden] = inp.x
    x = wide[:, : BASE.hidden]
    assert x.stride() == (BASE.hidden + 7, 1)
    out = fused_experts(x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, backend=backend,
                        inplace=inplace, **inp.kwargs)
    assert_close_rel(out, ref, torch.float32)
    assert wide[:, BASE.hidden :].isnan().all()
    if inplace:
        assert out.data_ptr() == wide.data_ptr()
        assert torch.equal(wide[:, : BASE.hidden], out)


# Ids ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", (BASE, BASE.replace(expert_map="missing")), ids=lambda c: c.id)
@pytest.mark.parametrize("backend", (*KERNEL_BACKENDS, "ref"))
def test_out_of_range_ids_contribute_zero_without_validation(backend: str, case: Case) -> None:
    """validate=False: ids -1, E, -2**31, 2**31-1 drop their slot instead of crashing."""
    inp, _ = expected(case)
    E = case.num_experts
    ids = inp.topk_ids.clone()
    ids[0, 0], ids[1, 1], ids[2, 0], ids[3, 1] = -1, E, -(2**31), 2**31 - 1
    ids[4, :] = torch.tensor([E, -1])  # token 4 has no valid slot: its row must be exactly 0
    bad = dataclasses.replace(inp, topk_ids=ids)
    ref = spec_experts(bad)
    if backend == "ref":
        out = fused_experts_ref(bad.x, bad.w13, bad.w2, bad.topk_weights, ids, **bad.ref_kwargs)
    else:
        out = run(backend, bad, validate=False)
    assert_close_rel(out, ref, torch.float32)
    assert not out[4].any()


@pytest.mark.parametrize("backend", (*KERNEL_BACKENDS, "ref"))
def test_expert_map_past_the_local_experts_contributes_zero_without_validation(backend: str) -> None:
    """validate=False: an expert_map entry past the local experts (which validation reports) drops
    the slots routed to it on every backend instead of indexing past w13."""
    inp, _ = expected(BASE.replace(expert_map="missing"))
    bad_map = inp.expert_map.clone()
    held = int((bad_map >= 0).nonzero()[0])
    bad_map[held] = inp.w13.shape[0] + 6
    spec = spec_experts(dataclasses.replace(inp, expert_map=torch.where(bad_map > inp.w13.shape[0], -1, bad_map)))
    out = run(backend, dataclasses.replace(inp, expert_map=bad_map), **({} if backend == "ref" else {"validate": False}))
    assert_close_rel(out, spec, torch.float32)


ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("backend", (*KERNEL_BACKENDS, "auto"))
def test_id_and_weight_dtypes(backend: str, id_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """HF passes int64 ids and bf16 or fp32 weights; vLLM int32 ids and fp32 weights."""
    inp, _ = expected(BASE)
    mixed = dataclasses.replace(inp, topk_ids=inp.topk_ids.to(id_dtype),
                      topk_weights=inp.topk_weights.to(weight_dtype))
    ref = spec_experts(mixed)  # on the rounded routing weights
    out = run(backend, mixed)
    assert out.dtype == torch.float32
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.parametrize("backend", (*KERNEL_BACKENDS, "ref"))
def test_non_contiguous_routing_tensors(backend: str) -> None:
    """topk_ids / topk_weights as transposed views of [K, T] buffers."""
    inp, ref = expected(BASE)
    ids = inp.topk_ids.t().contiguous().t()
    weights = inp.topk_weights.t().contiguous().t()
    assert not ids.is_contiguous() and not weights.is_contiguous()
    views = dataclasses.replace(inp, topk_ids=ids, topk_weights=weights)
    if backend == "ref":
        out = fused_experts_ref(views.x, views.w13, views.w2, weights, ids, **views.ref_kwargs)
    else:
        out = run(backend, views)
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_repeated_id_in_a_row_counts_twice(backend: str) -> None:
    """Slots are independent terms of the sum, even when a row names one expert twice."""
    inp, _ = expected(BASE)
    ids = inp.topk_ids.clone()
    ids[:, 1] = ids[:, 0]
    dup = dataclasses.replace(inp, topk_ids=ids)
    assert_close_rel(run(backend, dup), spec_experts(dup), torch.float32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_global_num_experts_defaults_to_expert_map_length(backend: str) -> None:
    inp, ref = expected(BASE.replace(expert_map="missing", has_bias=True))
    out = run(backend, inp, global_num_experts=None)
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_int64_expert_map(backend: str) -> None:
    inp, ref = expected(BASE.replace(expert_map="missing"))
    wide = dataclasses.replace(inp, expert_map=inp.expert_map.long())
    assert_close_rel(run(backend, wide), ref, torch.float32)


def test_backend_knob_change_takes_effect_between_calls(monkeypatch):
    """fused_experts caches its kernel per config, but a changed FUSEDMOE_BACKEND selects again."""
    from fusedmoe.backends.torch_ref import TorchExperts

    gen = torch.Generator().manual_seed(70)
    x = torch.randn(3, 32, generator=gen)
    w13, w2 = torch.randn(4, 32, 32, generator=gen) / 6, torch.randn(4, 32, 16, generator=gen) / 4
    weights, ids = torch.rand(3, 2, generator=gen), torch.tensor([[0, 1], [2, 3], [1, 2]])
    fused_experts(x, w13, w2, weights, ids)  # cpu
    calls = []
    real = TorchExperts.apply
    monkeypatch.setattr(TorchExperts, "apply", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    monkeypatch.setenv("FUSEDMOE_BACKEND", "torch")
    fused_experts(x, w13, w2, weights, ids)
    assert calls == [1]


# torch.compile of the functional API ----------------------------------------------------------
def _compile_problem(seed: int):
    from fusedmoe import select_experts

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 64, generator=gen)
    w13, w2 = torch.randn(5, 96, 64, generator=gen) / 8, torch.randn(5, 64, 48, generator=gen) / 7
    b13, b2 = torch.randn(5, 96, generator=gen), torch.randn(5, 64, generator=gen)
    w, ids = select_experts(x, torch.randn(7, 6, generator=gen), 2)
    expert_map = torch.tensor([0, 1, -1, 2, 3, 4], dtype=torch.int32)
    return x, w13, w2, b13, b2, w, ids, expert_map


def test_fused_experts_compiles_fullgraph() -> None:
    """torch.compile(fullgraph=True) of fused_experts records the custom op fusedmoe::fused_experts
    (config and oracle stay outside the trace): the eager result, with biases, an expert_map,
    changing scalars and in place."""
    torch._dynamo.reset()
    x, w13, w2, b13, b2, w, ids, expert_map = _compile_problem(71)
    kwargs = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2, expert_map=expert_map, global_num_experts=6)
    compiled = torch.compile(lambda alpha, limit: fused_experts(x, w13, w2, w, ids, swiglu_alpha=alpha,
                                                                swiglu_limit=limit, **kwargs),
                             fullgraph=True, backend="aot_eager")
    for alpha, limit in ((1.702, 7.0), (1.5, 5.0), (1.2, None)):
        want = fused_experts(x, w13, w2, w, ids, swiglu_alpha=alpha, swiglu_limit=limit, **kwargs)
        assert torch.equal(compiled(alpha, limit), want)
    want = fused_experts(x, w13, w2, w, ids, **kwargs)
    h = x.clone()
    out = torch.compile(lambda h_: fused_experts(h_, w13, w2, w, ids, inplace=True, **kwargs),
                        fullgraph=True, backend="aot_eager")(h)
    assert torch.equal(h, want) and torch.equal(out, want)


def test_fused_experts_compiles_fullgraph_quantized() -> None:
    """A quantized call (emulation on CPU) through the op: QuantParams travel as the scheme's
    name and its tensors."""
    from fusedmoe.quant.weights import quantize_weights

    torch._dynamo.reset()
    *_, w, ids, _ = _compile_problem(72)  # ids over 6 experts
    gen = torch.Generator().manual_seed(74)
    q13, q2, params = quantize_weights(torch.randn(6, 96, 128, generator=gen) / 8,
                                       torch.randn(6, 128, 48, generator=gen) / 7, "int8_w8a8")
    x = torch.randn(7, 128, generator=gen).bfloat16()
    want = fused_experts(x, q13, q2, w, ids, quant=params)
    got = torch.compile(lambda x_: fused_experts(x_, q13, q2, w, ids, quant=params), fullgraph=True,
                        backend="aot_eager")(x)
    assert torch.equal(got, want)


def test_fused_experts_bad_shapes_fail_the_trace() -> None:
    """The shape checks run while tracing (the op's fake kernel would take any shape): a bad w2
    fails torch.compile with the error naming it, before any graph runs."""
    torch._dynamo.reset()
    x, w13, w2, _, _, w, ids, _ = _compile_problem(75)
    bad_w2 = w2[:, :-1].contiguous()
    graphs = []

    def backend(gm, example_inputs):  # reached only by a trace that finished
        graphs.append(gm)
        return gm.forward

    with pytest.raises(Exception, match=r"hidden size mismatch: hidden_states \[7, 64\]"):
        torch.compile(lambda: fused_experts(x, w13, bad_w2, w, ids), fullgraph=True, backend=backend)()
    assert graphs == []


def test_fused_experts_opcheck() -> None:
    from fusedmoe.api import fused_experts_op, fused_experts_out_op

    x, w13, w2, b13, b2, w, ids, expert_map = _compile_problem(73)
    args = (x, w13, w2, w, ids, b13, b2, expert_map, 6, "silu", False, None, None, None, None, None, None, None,
            None, None, "auto", 1.702, None, None, "standard")
    torch.library.opcheck(fused_experts_op, args)
    torch.library.opcheck(fused_experts_out_op, (*args, torch.empty_like(x)))
