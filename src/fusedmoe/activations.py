"""Expert activations: names, shapes and the reference formulas.

Gated activations read h = x @ w13.T as [gate | up] halves (rows 0..I-1 of w13 are the gate,
rows I..2I-1 the up projection) and return [.., I]; non-gated ones (`*_no_mul`) take h [.., I]
whole. Formulas are evaluated in float32 (or wider) from the GEMM accumulator:

    silu          silu(g) * u
    gelu          gelu_erf(g) * u                      (exact erf form, as F.gelu)
    gelu_tanh     gelu_tanh(g) * u
    swigluoai     g = min(g, L); u = clamp(u, -L, L); (u + 1) * g * sigmoid(alpha * g)
    silu_no_mul   silu(h)
    gelu_no_mul   gelu_erf(h)
    relu2_no_mul  relu(h) ** 2

`swiglu_limit` L on silu/gelu/gelu_tanh clamps before the product (DeepSeek-V4 style):
g = min(g, L), u = clamp(u, -L, L). swigluoai always clamps (default L = 7.0, alpha = 1.702).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATED = ("silu", "gelu", "gelu_tanh", "swigluoai")
NON_GATED = ("silu_no_mul", "gelu_no_mul", "relu2_no_mul")
ACTIVATIONS = GATED + NON_GATED

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; expected one of {list(ACTIVATIONS)}")
    return name


def is_gated(name: str) -> bool:
    return check_activation(name) in GATED


def w13_rows(name: str, intermediate_size: int) -> int:
    """Rows of w13 per expert: 2I for gated activations, I otherwise."""
    return 2 * intermediate_size if is_gated(name) else intermediate_size


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[.., g0, u0, g1, u1, ..] -> [.., g0, g1, .., u0, u1, ..] along dim (one copy): gate and up
    rows or columns interleaved (gpt-oss checkpoints, OpenAI's triton_kernels) to the gate half
    then the up half that `apply_activation` and the kernels read."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def interleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `deinterleave_gate_up`."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def apply_activation(
    h: torch.Tensor,
    name: str,
    *,
    swiglu_alpha: float = SWIGLUOAI_ALPHA,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """act(h) for h [..., 2I] (gated) or [..., I] (non-gated), in h's dtype (call it on fp32)."""
    if not is_gated(name):
        if name == "silu_no_mul":
            return F.silu(h)
        if name == "gelu_no_mul":
            return F.gelu(h)
        return torch.relu(h).square()  # relu2_no_mul
    i = h.shape[-1] // 2
    g, u = h[..., :i], h[..., i:]
    if name == "swigluoai":
        limit = SWIGLUOAI_LIMIT if swiglu_limit is None else swiglu_limit
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * g * torch.sigmoid(swiglu_alpha * g)
    if swiglu_limit is not None:
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(min=-swiglu_limit, max=swiglu_limit)
    if name == "silu":
        return F.silu(g) * u
    if name == "gelu":
        return F.gelu(g) * u
    return F.gelu(g, approximate="tanh") * u  # gelu_tanh
