"""Test cases as data: the `Case` record, its input builder and the tolerance table.

    case = Case(num_tokens=33, num_experts=8, top_k=2, hidden=64, intermediate=48)
    inp = make_inputs(case)                        # fresh random tensors, seeded by the case
    out = fused_experts(inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, **inp.kwargs)
    assert_close_rel(out, ref, case.dtype)         # relative Frobenius + relative max error

Legend: T tokens, H hidden, I intermediate, G = 2I (gated) or I, E global experts, L local
experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

from fusedmoe.activations import GATED, SWIGLUOAI_ALPHA

ROUTINGS = ("uniform", "one_expert", "empty_expert")
EXPERT_MAPS = (None, "missing")


@dataclass(frozen=True)
class Case:
    """One experts problem.

    routing: "uniform" (K distinct random experts per token), "one_expert" (every token also
    picks expert E-1), "empty_expert" (expert E//2 gets no token). expert_map="missing": the
    experts e with e % 3 == 1 live on another rank (-1); the others are local, in shuffled order.
    """

    num_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: torch.dtype = torch.float32
    activation: str = "silu"
    has_bias: bool = False
    apply_router_weight_on_input: bool = False
    expert_map: str | None = None
    routing: str = "uniform"
    swiglu_alpha: float = SWIGLUOAI_ALPHA
    swiglu_limit: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r}; expected one of {ROUTINGS}")
        if self.expert_map not in EXPERT_MAPS:
            raise ValueError(f"expert_map={self.expert_map!r}; expected one of {EXPERT_MAPS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} outside [1, num_experts={self.num_experts}]")
        if self.routing == "empty_expert" and self.top_k >= self.num_experts:
            raise ValueError("empty_expert routing needs top_k < num_experts")
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError("apply_router_weight_on_input needs top_k == 1")

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    @property
    def w13_rows(self) -> int:
        return 2 * self.intermediate if self.gated else self.intermediate

    @property
    def id(self) -> str:
        parts = [
            f"T{self.num_tokens}", f"E{self.num_experts}", f"K{self.top_k}",
            f"H{self.hidden}", f"I{self.intermediate}", str(self.dtype).removeprefix("torch."),
            self.activation,
        ]
        if self.has_bias:
            parts.append("bias")
        if self.apply_router_weight_on_input:
            parts.append("w_on_input")
        if self.expert_map:
            parts.append(f"map_{self.expert_map}")
        if self.routing != "uniform":
            parts.append(self.routing)
        if self.swiglu_alpha != SWIGLUOAI_ALPHA:
            parts.append(f"alpha{self.swiglu_alpha}")
        if self.swiglu_limit is not None:
            parts.append(f"limit{self.swiglu_limit}")
        if self.seed:
            parts.append(f"seed{self.seed}")
        return "-".join(parts)

    def replace(self, **changes) -> Case:
        return dataclasses.replace(self, **changes)


@dataclass
class Inputs:
    """Tensors for one case. w13/w2/biases hold the L local experts; topk_ids are global."""

    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [L, G, H]
    w2: torch.Tensor  # [L, H, I]
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int32
    w13_bias: torch.Tensor | None  # [L, G]
    w2_bias: torch.Tensor | None  # [L, H]
    expert_map: torch.Tensor | None  # [E] int32, -1 = not local
    case: Case

    @property
    def kwargs(self) -> dict:
        """Keyword arguments of `fused_experts` / `fused_experts_ref` besides the 5 tensors."""
        c = self.case
        return dict(
            activation=c.activation,
            apply_router_weight_on_input=c.apply_router_weight_on_input,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            expert_map=self.expert_map,
            global_num_experts=c.num_experts,
            swiglu_alpha=c.swiglu_alpha,
            swiglu_limit=c.swiglu_limit,
        )

    @property
    def ref_kwargs(self) -> dict:
        """The same for `fusedmoe.fused_experts_ref`, whose tensor names carry shape suffixes."""
        kw = self.kwargs
        return dict(
            activation=kw["activation"],
            apply_router_weight_on_input=kw["apply_router_weight_on_input"],
            w13_bias_LG=kw["w13_bias"],
            w2_bias_LH=kw["w2_bias"],
            expert_map_E=kw["expert_map"],
            global_num_experts=kw["global_num_experts"],
            swiglu_alpha=kw["swiglu_alpha"],
            swiglu_limit=kw["swiglu_limit"],
        )

    def to(self, dtype: torch.dtype) -> Inputs:
        """The same values in another float dtype (ids, routing weights and map unchanged)."""

        def cast(t):
            return None if t is None else t.to(dtype)

        return dataclasses.replace(
            self, x=cast(self.x), w13=cast(self.w13), w2=cast(self.w2),
            w13_bias=cast(self.w13_bias), w2_bias=cast(self.w2_bias),
        )


def case_seed(case: Case) -> int:
    """A stable per-case seed (Python's hash() is salted per process)."""
    return zlib.crc32(case.id.encode()) ^ case.seed


def make_inputs(case: Case) -> Inputs:
    """Fresh random inputs for `case`, drawn in float32 then rounded to case.dtype.

    Weights are scaled by 1/sqrt(fan_in) so h, a and the output are O(1) whatever H and I.
    Routing weights are drawn from [0.2, 1.0]: never zero, never normalized.
    """
    g = torch.Generator().manual_seed(case_seed(case))
    T, E, K, H = case.num_tokens, case.num_experts, case.top_k, case.hidden

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    if case.expert_map == "missing":
        local_globals = [e for e in range(E) if e % 3 != 1]  # experts 1, 4, 7, ... live elsewhere
        order = torch.randperm(len(local_globals), generator=g).tolist()  # shuffled local slots
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        for local, glob in zip(order, local_globals, strict=True):
            expert_map[glob] = local
        num_local = len(local_globals)
    else:
        expert_map, num_local = None, E

    x = randn(T, H)
    w13 = randn(num_local, case.w13_rows, H, scale=H**-0.5)
    w2 = randn(num_local, H, case.intermediate, scale=case.intermediate**-0.5)
    w13_bias = randn(num_local, case.w13_rows, scale=0.5) if case.has_bias else None
    w2_bias = randn(num_local, H, scale=0.5) if case.has_bias else None
    topk_ids = _route(case, g)
    topk_weights = torch.rand(T, K, generator=g) * 0.8 + 0.2

    inp = Inputs(x, w13, w2, topk_weights, topk_ids.to(torch.int32), w13_bias, w2_bias,
                 expert_map, case)
    return inp.to(case.dtype)


def _route(case: Case, g: torch.Generator) -> torch.Tensor:
    """topk_ids [T, K] int64 with distinct ids per row, shaped by case.routing."""
    T, E, K = case.num_tokens, case.num_experts, case.top_k
    if case.routing == "empty_expert":
        # Expert E // 2 (a middle one, so neither the first nor the last segment) gets nothing.
        pool = torch.tensor([e for e in range(E) if e != E // 2])
    else:
        pool = torch.arange(E)
    ids = pool[torch.rand(T, len(pool), generator=g).argsort(dim=1)[:, :K]]  # a random K-subset
    if case.routing == "one_expert" and T:
        # Every token picks expert `hot` (the last one, E-1) in a random slot.
        hot = E - 1
        for t in range(T):
            row = ids[t]
            if hot not in row.tolist():
                row[int(torch.randint(K, (1,), generator=g))] = hot
    return ids


# Tolerances ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """rel_fro bounds ||out - ref||_F / ||ref||_F; rel_max bounds max|out - ref| / max|ref|."""

    rel_fro: float
    rel_max: float


# u = unit roundoff (2^-p for a p-bit significand): fp32 6.0e-8, fp16 4.9e-4, bf16 3.9e-3.
# The cpu backend rounds four times in the activation dtype (h = x @ w13.T, the input of GEMM2,
# y = a @ w2.T, the output); independent roundings of RMS u/sqrt(3) add up to ~1.2u in the
# relative Frobenius norm. Measured on these cases (cpu backend, worst case relu2_no_mul, whose
# square doubles relative errors): bf16 4.3e-3 = 1.1u Frobenius, 4.9e-3 = 1.3u max; fp16
# 5.5e-4 = 1.1u, 8.6e-4 = 1.8u. Bounds: 4u Frobenius, 6u max (2-3x headroom). Paths that round
# only the output (fused_experts_ref, torch backend) measure <= 0.45u.
# fp32: accumulation over H, I <= 256 measures <= 4e-7; 1e-5 is the usual fp32 bound and
# still fails on any bf16/tf32 step (>= 5e-4).
# fp64: only the float64 reference paths run in it; 1e-12 fails on any fp32 step (~1e-7).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rel_fro=1e-12, rel_max=1e-11),
    torch.float32: Tolerance(rel_fro=1e-5, rel_max=2e-5),
    torch.float16: Tolerance(rel_fro=4 * 2.0**-11, rel_max=6 * 2.0**-11),
    torch.bfloat16: Tolerance(rel_fro=4 * 2.0**-8, rel_max=6 * 2.0**-8),
}


def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, relative max error) of out against ref, in float64."""
    diff = out.double() - ref.double()
    ref64 = ref.double()
    return (
        (diff.norm() / ref64.norm()).item(),
        (diff.abs().max() / ref64.abs().max()).item(),
    )


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, what: str = "") -> None:
    """out matches ref within TOLERANCES[dtype]: same shape, all finite, small relative error.

    An all-zero ref (every slot dropped) demands an exactly zero out.
    """
    label = f"{what}: " if what else ""
    assert tuple(out.shape) == tuple(ref.shape), f"{label}shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{label}non-finite values in output"
    if out.numel() == 0:
        return
    if not ref.abs().max().item():
        assert not out.abs().max().item(), f"{label}reference is all zero but output is not"
        return
    tol = TOLERANCES[dtype]
    fro, mx = rel_errors(out, ref)
    assert fro <= tol.rel_fro and mx <= tol.rel_max, (
        f"{label}relative error {fro:.3e} (Frobenius, tol {tol.rel_fro:.1e}), "
        f"{mx:.3e} (max, tol {tol.rel_max:.1e}) for {dtype}"
    )


def check_scale(t: torch.Tensor) -> None:
    """Guard against vacuous data: test outputs must be O(1), not ~0."""
    if t.numel():
        rms = t.double().pow(2).mean().sqrt().item()
        assert 1e-2 < rms < 1e2, f"test data out of scale: rms {rms:.3e}"


# Builders --------------------------------------------------------------------------------------
BASE = Case(num_tokens=33, num_experts=8, top_k=2, hidden=64, intermediate=48)


def experts_cases() -> list[Case]:
    """Logic coverage of fused_experts, float32: edge shapes, every activation, every feature."""
    b = BASE
    return [
        b,
        b.replace(num_tokens=0),
        b.replace(num_tokens=1),
        b.replace(num_tokens=1, top_k=1),
        b.replace(routing="empty_expert"),
        b.replace(routing="one_expert"),
        b.replace(routing="one_expert", top_k=1),
        b.replace(num_experts=6, top_k=6),  # top_k == E
        b.replace(num_experts=7, top_k=1),
        b.replace(num_experts=10, top_k=6),  # top-6, E not a power of two
        b.replace(hidden=65, intermediate=37),  # odd H and I
        b.replace(hidden=65, intermediate=37, activation="relu2_no_mul"),
        b.replace(num_tokens=3, num_experts=64, top_k=8),  # sparse decode: T*K < E
        *[b.replace(activation=a) for a in ("gelu", "gelu_tanh", "swigluoai")],
        *[b.replace(activation=a) for a in ("silu_no_mul", "gelu_no_mul", "relu2_no_mul")],
        b.replace(activation="swigluoai", swiglu_alpha=1.3, swiglu_limit=0.9),
        b.replace(activation="silu", swiglu_limit=0.75),
        b.replace(activation="gelu_tanh", swiglu_limit=0.75),
        b.replace(has_bias=True),
        b.replace(has_bias=True, activation="swigluoai"),
        b.replace(has_bias=True, activation="relu2_no_mul"),
        b.replace(expert_map="missing"),
        b.replace(expert_map="missing", num_experts=7, top_k=3, has_bias=True),
        # The hot expert E-1 = 7 lives on another rank: every token loses one slot; with top-1
        # the output is exactly zero.
        b.replace(expert_map="missing", routing="one_expert"),
        b.replace(expert_map="missing", routing="one_expert", top_k=1),
        b.replace(top_k=1, apply_router_weight_on_input=True),
        # With b13 != 0, weighting the input differs from weighting GEMM1's output (vLLM).
        b.replace(top_k=1, apply_router_weight_on_input=True, has_bias=True),
        b.replace(top_k=1, apply_router_weight_on_input=True, expert_map="missing"),
        b.replace(num_tokens=96, num_experts=16, top_k=4, hidden=256, intermediate=160),
    ]


def low_precision_cases() -> list[Case]:
    """The cases that matter for bf16/fp16 numerics (run in both)."""
    b = BASE
    base = [
        b,
        b.replace(hidden=65, intermediate=37),
        b.replace(routing="one_expert"),
        b.replace(has_bias=True, activation="swigluoai"),
        b.replace(activation="relu2_no_mul"),
        b.replace(activation="gelu"),
        b.replace(swiglu_limit=0.75),
        b.replace(expert_map="missing", has_bias=True),
        b.replace(top_k=1, apply_router_weight_on_input=True, has_bias=True),
        b.replace(num_tokens=96, num_experts=16, top_k=4, hidden=256, intermediate=160),
    ]
    return [c.replace(dtype=d) for d in (torch.bfloat16, torch.float16) for c in base]
