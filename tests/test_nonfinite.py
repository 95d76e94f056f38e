"""NaN and Inf in hidden states propagate as IEEE arithmetic would, on every backend that runs
here (CPU backends and the Triton kernels under the interpreter): no crash, non-finite exactly
where the float64 reference is non-finite, every other output as close as usual. A poisoned
token never leaks into another token's output (sorted/padded rows, shared GEMM tiles)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fusedmoe import fuzz

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BASE = fuzz.FuzzCase(
    seed=11, profile="ci", num_tokens=9, num_experts=5, top_k=2, hidden=32, inter=16,
    dtype="float32", activation="silu", routing="one_expert", bias=True, local_experts=None,
    weight_on_input=False, quant=None, swiglu_limit=None, ids_dtype="int32",
)
CASES = {
    "fp32": BASE,
    "fp16": dataclasses.replace(BASE, dtype="float16"),
    "gelu_no_mul": dataclasses.replace(BASE, activation="gelu_no_mul", bias=False),
    # relu and the clamps: Triton's default min/max drop NaN (a NaN token came out finite)
    "relu2_no_mul": dataclasses.replace(BASE, activation="relu2_no_mul"),
    "swigluoai": dataclasses.replace(BASE, activation="swigluoai"),
    "silu_limit": dataclasses.replace(BASE, swiglu_limit=0.5),
    "expert_map": dataclasses.replace(BASE, local_experts=(0, 2, 4)),
    "weight_on_input": dataclasses.replace(BASE, top_k=1, weight_on_input=True),
    # Per-token activation scales: a poisoned token's scale is its own (per-tensor scales would
    # poison every token of the expert, as the arithmetic says; not tested here).
    # NaN amax used to give scale 1 and arbitrary int8 codes (finite garbage, 1.9e4).
    "int8_w8a8": dataclasses.replace(BASE, quant="int8_w8a8", hidden=64, inter=32, bias=False),
    "fp8_w8a8_channel": dataclasses.replace(BASE, quant="fp8_w8a8_channel", hidden=64, inter=32),
    "fp8_w8a8_block": dataclasses.replace(BASE, quant="fp8_w8a8_block", hidden=128, inter=128),
    "int4_w4a16": dataclasses.replace(BASE, quant="int4_w4a16_g32", dtype="float16", hidden=64, inter=32),
}
POISON = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


# NaN everywhere; +-Inf (inf - inf and inf * 0 inside the GEMMs and activations) on a subset.
PARAMS = [(name, "nan") for name in CASES] + [
    (name, poison) for name in ("fp32", "relu2_no_mul", "swigluoai", "int8_w8a8") for poison in ("inf", "-inf")]


@pytest.mark.parametrize("name,poison", PARAMS)
def test_non_finite_hidden_states_propagate(name, poison):
    _check_propagation(name, poison, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("name,poison", PARAMS)
def test_non_finite_hidden_states_propagate_on_gpu(name, poison):
    # bf16 too: the fp16 cases again in bfloat16 on the GPU kernels.
    _check_propagation(name, poison, torch.device("cuda"))
    if CASES[name].dtype == "float16":
        CASES[name + "_bf16"] = dataclasses.replace(CASES[name], dtype="bfloat16")
        _check_propagation(name + "_bf16", poison, torch.device("cuda"))


def _check_propagation(name, poison, device):
    case = CASES[name]
    p = fuzz.make_problem(case, device)
    p.x_TH[2, 5] = POISON[poison]   # one element of token 2
    p.x_TH[6, :] = POISON[poison]   # a whole token
    ref = fuzz.reference(case, p)
    bad_ref = ~torch.isfinite(ref)
    # Tokens 2 and 6 are entirely non-finite unless all their slots are dropped; no other is.
    assert not bad_ref[[0, 1, 3, 4, 5, 7, 8]].any() and bad_ref.any()
    runners = fuzz.candidates(case, device)
    assert {"cpu", "torch", "emulation", "triton"} & set(runners)
    tol = fuzz.tolerance(case)
    for backend, run in runners.items():
        out = run(case, p)
        assert out.shape == ref.shape
        bad_out = ~torch.isfinite(out)
        assert torch.equal(bad_out, bad_ref), f"{backend}: non-finite at {bad_out.nonzero().tolist()}"
        if poison == "nan":
            assert torch.equal(out.isnan(), ref.isnan()), backend
        good = ~bad_ref.any(dim=1)
        assert fuzz.compare(out[good], ref[good], tol) is None, backend


@pytest.mark.parametrize("poison", POISON)
def test_non_finite_routing_weight_stays_in_its_token(poison):
    # fused_experts takes the weights as given (select_experts rejects non-finite logits): the
    # poisoned slot's token is non-finite, the others are untouched.
    case = BASE
    p = fuzz.make_problem(case)
    p.topk_weights_TK[3, 1] = POISON[poison]
    ref = fuzz.reference(case, p)
    for backend, run in fuzz.candidates(case, torch.device("cpu")).items():
        out = run(case, p)
        assert torch.equal(~torch.isfinite(out), ~torch.isfinite(ref)), backend
        assert torch.isfinite(out[torch.arange(9) != 3]).all(), backend


def _check_per_tensor_spread(device):
    """Dynamic per-tensor FP8 shares one activation amax per expert: a NaN token makes every
    token routed to one of its experts NaN (the scheme's arithmetic, in emulation as in the
    Triton kernel's atomic_max amax); tokens on other experts stay finite."""
    case = dataclasses.replace(BASE, quant="fp8_w8a8_tensor", routing="uniform", num_experts=8,
                               hidden=64, inter=32, bias=False)
    p = fuzz.make_problem(case, device)
    p.x_TH[6, :] = float("nan")
    ref = fuzz.reference(case, p)
    ids = p.topk_ids_TK.long().cpu()
    shares = (ids[:, :, None] == ids[6][None, None, :]).any(dim=(1, 2))
    bad_ref = ref.isnan().any(dim=1).cpu()
    assert torch.equal(bad_ref, shares) and 1 < int(shares.sum()) < case.num_tokens, ids.tolist()
    runners = fuzz.candidates(case, device)
    assert runners
    for backend, run in runners.items():
        out = run(case, p)
        assert torch.equal(out.isnan(), ref.isnan()), f"{backend}: NaN at {out.isnan().any(dim=1).nonzero().tolist()}"
        good = ~bad_ref.to(out.device)
        assert fuzz.compare(out[good], ref[good], fuzz.tolerance(case)) is None, backend


def test_per_tensor_activation_scale_nan_spreads_over_its_experts():
    _check_per_tensor_spread(torch.device("cpu"))


@pytest.mark.gpu
def test_per_tensor_activation_scale_nan_spreads_over_its_experts_on_gpu():
    _check_per_tensor_spread(torch.device("cuda"))
