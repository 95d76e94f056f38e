"""Each scheme's own error (emulation against the full-precision layer) stays where
docs/quantization.md says (`fusedmoe.quant.accuracy.EXPECTED`), at another size and seed; a
wrong scale is far outside it."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.quant.accuracy import EXPECTED, global_diff, measure, rel_fro
from fusedmoe.quant.scheme import SCHEMES


def test_every_scheme_has_a_documented_figure():
    assert set(EXPECTED) == set(SCHEMES)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_scheme_error_matches_the_documented_figure(scheme):
    a = measure(scheme, tokens=64, hidden=512, inter=256, seed=1)
    rel, diff = EXPECTED[scheme]
    assert 0.75 * rel <= a.out_rel <= 1.25 * rel, a
    assert 0.5 * diff <= a.out_diff <= 1.5 * diff, a
    # global difference ~ half the squared relative error when the error is noise-like
    assert 0.3 * a.out_rel**2 <= a.out_diff <= a.out_rel**2, a
    if SCHEMES[scheme].activation is None:  # weight-only: no activation rounding at all
        assert a.act_rel < 1e-5, a
    else:
        assert a.act_rel > 1e-2, a


def test_metrics_catch_scale_and_sign():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 32, generator=gen)
    noise = 1e-2 * torch.randn(64, 32, generator=gen)
    assert rel_fro(ref + noise, ref) == pytest.approx(1e-2, rel=0.1)
    assert global_diff(ref + noise, ref) == pytest.approx(0.5e-4, rel=0.2)
    assert global_diff(2 * ref, ref) == pytest.approx(0.2)  # a doubled scale
    assert global_diff(-ref, ref) == pytest.approx(2.0)
    assert global_diff(ref, ref) == 0.0


def test_a_wrong_weight_scale_is_far_outside_the_band():
    from fusedmoe import fuzz
    from fusedmoe.api import fused_experts
    from fusedmoe.reference import fused_experts_ref

    case = fuzz.FuzzCase(seed=3, profile="cpu", num_tokens=32, num_experts=4, top_k=2, hidden=256, inter=128,
                         dtype="float32", activation="silu", routing="uniform", bias=False, local_experts=None,
                         weight_on_input=False, quant="int4_w4a16_g32", swiglu_limit=None, ids_dtype="int32")
    p = fuzz.make_problem(case)
    q = p.weights.quant
    q.w2_scale = q.w2_scale * 2
    out = fused_experts(p.x_TH, p.weights.w13, p.weights.w2, p.topk_weights_TK, p.topk_ids_TK, quant=q,
                        backend="emulation")
    full = fused_experts_ref(p.x_TH.double(), p.w13_full_LGH.double(), p.w2_full_LHI.double(),
                             p.topk_weights_TK, p.topk_ids_TK)
    assert rel_fro(out, full) > 4 * EXPECTED["int4_w4a16_g32"][0]
