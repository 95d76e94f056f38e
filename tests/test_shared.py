"""Shared experts (DeepSeek / Qwen2-MoE): the dense MLP added to the routed output, its loading,
and its place in partial-sum (no process group) splits. Multi-process cases: test_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe.shared import SharedExperts

E, K, H, I, IS = 8, 2, 32, 24, 40


def _weights(gen):
    return dict(
        w13=torch.randn(E, 2 * I, H, generator=gen) / H**0.5,
        w2=torch.randn(E, H, I, generator=gen) / I**0.5,
        gate_proj=torch.randn(IS, H, generator=gen) / H**0.5,
        up_proj=torch.randn(IS, H, generator=gen) / H**0.5,
        down_proj=torch.randn(H, IS, generator=gen) / IS**0.5,
        gate=torch.randn(1, H, generator=gen),
    )


def _layer(w, *, gate: bool, shared: bool = True, parallel: ParallelConfig | None = None) -> FusedMoE:
    se = SharedExperts(H, IS, gate=gate, params_dtype=torch.float32) if shared else None
    layer = FusedMoE(E, K, H, I, params_dtype=torch.float32, parallel=parallel, shared_experts=se)
    named = []
    for e in range(E):
        named += [(f"mlp.experts.{e}.gate_proj.weight", w["w13"][e, :I]),
                  (f"mlp.experts.{e}.up_proj.weight", w["w13"][e, I:]),
                  (f"mlp.experts.{e}.down_proj.weight", w["w2"][e])]
    prefix = "mlp.shared_expert" if gate else "mlp.shared_experts"
    named += [(f"{prefix}.{n}.weight", w[n]) for n in ("gate_proj", "up_proj", "down_proj")]
    if gate:
        named.append(("mlp.shared_expert_gate.weight", w["gate"]))
    used = layer.load_weights(named)
    assert used == {n for n, _ in named if shared or "shared" not in n}
    return layer


@pytest.mark.parametrize("gate", (False, True), ids=("deepseek", "qwen2_moe"))
def test_layer_adds_shared_mlp(gate: bool) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = _weights(gen)
    x, logits = torch.randn(13, H, generator=gen), torch.randn(13, E, generator=gen)
    routed = _layer(w, gate=gate, shared=False)(x, logits)
    out = _layer(w, gate=gate)(x, logits)
    s = F.linear(F.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T), w["down_proj"])
    if gate:
        s = s * torch.sigmoid(x @ w["gate"].T)
    torch.testing.assert_close(out, routed + s, rtol=1e-5, atol=1e-5)
    assert (out - routed).abs().max() > 1e-3  # the shared term is not negligible here


@pytest.mark.parametrize("split", ("ep2", "tp2", "ep2_tp2"))
def test_partial_sums_count_shared_once(split: str) -> None:
    """Without a process group the caller sums the ranks' outputs: one rank adds the MLP."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = _weights(gen)
    x, logits = torch.randn(9, H, generator=gen), torch.randn(9, E, generator=gen)
    full = _layer(w, gate=True)(x, logits)
    ep, tp = (2 if "ep2" in split else 1), (2 if "tp2" in split else 1)
    ranks = [ParallelConfig(tp_size=tp, tp_rank=t, ep_size=ep, ep_rank=r) for r in range(ep) for t in range(tp)]
    total = sum(_layer(w, gate=True, parallel=p)(x, logits) for p in ranks)
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_zero_tokens() -> None:
    w = _weights(torch.Generator().manual_seed(0))
    assert _layer(w, gate=True)(torch.zeros(0, H), torch.zeros(0, E)).shape == (0, H)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: SharedExperts(H, 0), r"shared experts: intermediate_size=0 must be a positive int"),
        (lambda: SharedExperts(H, IS, activation="relu2_no_mul"), r"activation 'relu2_no_mul' is not gated"),
        (lambda: SharedExperts(H, IS).load("down_proj", torch.zeros(IS, H)),
         r"shared experts down_proj: tensor has shape \(40, 32\), expected \(32, 40\)"),
        (lambda: SharedExperts(H, IS).load("gate", torch.zeros(1, H)),
         r"unknown shared-expert tensor 'gate'; expected one of \['down_proj', 'gate_proj', 'up_proj'\]"),
    ],
    ids=("size", "activation", "shape", "gate_without_gate"),
)
def test_shared_rejects(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_partly_loaded_shared_refused() -> None:
    se = SharedExperts(H, IS, gate=True)
    se.load("gate_proj", torch.zeros(IS, H))
    se.load("down_proj", torch.zeros(H, IS))
    with pytest.raises(RuntimeError, match=r"shared-expert tensors never loaded: \['gate', 'up_proj'\]"):
        se(torch.zeros(2, H))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_switch_gpu(monkeypatch) -> None:
    """The shared MLP goes to the side stream unless FUSEDMOE_SHARED_OVERLAP=0; both give the
    same sum."""
    from fusedmoe import knobs, shared

    se = SharedExperts(64, 32, params_dtype=torch.float32, device="cuda")
    with torch.no_grad():
        se.gate_up.normal_(std=0.1)
        se.down.normal_(std=0.1)
    x = torch.randn(5, 64, device="cuda")
    overlapped = shared.run_overlapped(se, x, lambda: x * 2)
    real = shared._side_stream
    monkeypatch.setattr(shared, "_side_stream", lambda device: pytest.fail("side stream with overlap off"))
    with knobs.override(SHARED_OVERLAP=False):
        in_sequence = shared.run_overlapped(se, x, lambda: x * 2)
    monkeypatch.setattr(shared, "_side_stream", real)
    torch.cuda.synchronize()
    for a, b in zip(overlapped, in_sequence, strict=True):
        assert torch.equal(a, b)


def test_never_loaded_shared_mlp_gives_nan() -> None:
    """Storage nothing was loaded or assigned into starts as NaN: the output says so (it held
    whatever the allocator left before)."""
    from fusedmoe.shared import SharedExperts

    shared = SharedExperts(16, 8, gate=True)
    assert shared(torch.randn(3, 16)).isnan().all()
