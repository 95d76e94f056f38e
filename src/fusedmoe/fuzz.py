"""Fuzzing every backend against the float64 reference: seed -> random problem -> each backend.

    case = draw_case(seed, profile)          # sizes, routing skew, dtype, activation, features, scheme
    result = run_case(case, device)          # every backend the oracle accepts, vs fused_experts_ref (fp64)
    report = fuzz(cases, seed, profile)      # counts per backend; `fusedmoe fuzz --replay SEED` re-runs one
    report = fuzz(..., jobs=16, time_limit=540)  # spawned workers share the seeds; stop starting at 540 s

A case is a pure function of (seed, profile): any failure replays from the seed it prints.
Backends are those whose record accepts the problem on the device's platform (`Backend.check`);
on CPU the Triton kernels also run through the Triton interpreter (fp32/fp16, small problems),
checked against a described Hopper platform. Quantized problems compare against the reference
on dequantized weights, with the scheme's activation fake-quantization applied in the same
places as `emulation` (the float64 reference otherwise). Legend: T tokens, H hidden,
I intermediate, E experts, L local experts, K top-k.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import random
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TextIO

import torch

from fusedmoe import knobs
from fusedmoe.activations import ACTIVATIONS, GATED, w13_rows
from fusedmoe.backends import REGISTRY, load_plugins
from fusedmoe.backends.emulation import activation_transform
from fusedmoe.config import MoEConfig
from fusedmoe.modular import ExpertWeights, make_modular
from fusedmoe.platform import Platform
from fusedmoe.quant.scheme import SCHEMES, get_scheme
from fusedmoe.quant.weights import dequantize_weights, quantize_weights
from fusedmoe.reference import fused_experts_ref

ROUTINGS = ("uniform", "zipf", "one_expert", "empty_experts")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INTERPRETER = "[interpreter]"
INTERPRETER_TRITON = "triton" + INTERPRETER
INVARIANT = "[batch-invariant]"  # a runner that also checks sub-batches bitwise (`_invariant`)


@dataclass(frozen=True)
class Profile:
    """Size limits of drawn problems. max_*: inclusive upper bounds; large_experts: E drawn from
    these with probability 0.1 (E up to 512)."""

    name: str
    max_tokens: int
    max_hidden: int
    max_inter: int
    max_experts: int
    large_experts: tuple[int, ...]
    interpreter_max_slots: int  # Triton interpreter only when T*K and H, I are this small
    interpreter_max_dim: int
    max_weight_elements: int = 1 << 26  # E * 3 * I * H: H and I halve until under it (then group rounding)
    # The batched layout holds [L, T, max(H, 2I)] buffers (max_tokens = T): larger problems are
    # not run on batched backends (E=512, T=8192, H=4096 alone is 34 GB in bf16).
    max_batched_elements: int = 1 << 62


PROFILES = {
    # CI: pytest subset; the interpreter runs small problems (~0.1-1 s each).
    "ci": Profile("ci", 48, 160, 96, 64, (257, 512), 64, 128),
    # The long CPU run: ~45 cases a second on one core (10,000 in 220 s), no interpreter.
    "cpu": Profile("cpu", 96, 192, 128, 64, (257, 384, 512), 0, 0),
    # CPU with the interpreter on every problem it accepts.
    "cpu-triton": Profile("cpu-triton", 48, 128, 96, 32, (257,), 96, 128),
    # GPU: production-like sizes.
    "gpu": Profile("gpu", 8192, 4096, 2048, 256, (257, 384, 512), 0, 0, max_weight_elements=1 << 28,
                   max_batched_elements=1 << 30),
}


@dataclass(frozen=True)
class FuzzCase:
    """One drawn problem. expert_map: local expert ids (None = all local); quant: scheme name."""

    seed: int
    profile: str
    num_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    dtype: str
    activation: str
    routing: str
    bias: bool
    local_experts: tuple[int, ...] | None
    weight_on_input: bool
    quant: str | None
    swiglu_limit: float | None
    ids_dtype: str
    strided_routing: bool = False  # ids / weights as column views of a wider [T, 2K] (a caller's slice)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        em = "" if self.local_experts is None else f" L={len(self.local_experts)}"
        feats = [f for f, on in (("bias", self.bias), ("weight_on_input", self.weight_on_input),
                                 ("strided_routing", self.strided_routing)) if on]
        if self.swiglu_limit is not None:
            feats.append(f"limit={self.swiglu_limit:g}")
        return (f"T={self.num_tokens} E={self.num_experts}{em} K={self.top_k} H={self.hidden} "
                f"I={self.inter} {self.dtype} {self.activation} {self.routing} "
                f"{self.quant or 'unquantized'} ids={self.ids_dtype} {' '.join(feats)}").rstrip()

    def config(self, layout: str = "standard") -> MoEConfig:
        return MoEConfig(
            self.num_experts, self.top_k, self.hidden, self.inter, dtype=self.torch_dtype,
            activation=self.activation, has_bias=self.bias, quant=self.quant,
            swiglu_limit=self.swiglu_limit, apply_router_weight_on_input=self.weight_on_input,
            has_expert_map=self.local_experts is not None, activation_format=layout,
        )


def draw_case(seed: int, profile: str = "ci") -> FuzzCase:
    """The problem of `seed` under `profile` (deterministic: the same seed, the same case)."""
    p = PROFILES[profile]
    r = random.Random(seed)
    num_experts = r.choice(p.large_experts) if r.random() < 0.1 else r.randint(1, p.max_experts)
    top_k = min(num_experts, 16, _log_uniform(r, 1, 16))
    u = r.random()
    num_tokens = 0 if u < 0.05 else 1 if u < 0.2 else _log_uniform(r, 2, p.max_tokens)
    quant = None if r.random() < 0.4 else r.choice(sorted(SCHEMES))
    activation = r.choice(ACTIVATIONS)
    hidden = _log_uniform(r, 1, p.max_hidden)
    inter = _log_uniform(r, 1, p.max_inter)
    if r.random() < 0.5:  # half the cases aligned (grouped_mm needs 16-byte rows), half odd
        hidden, inter = _round_up(hidden, 16), _round_up(inter, 16)
    while num_experts * 3 * inter * hidden > p.max_weight_elements and max(hidden, inter) > 16:
        hidden, inter = max(1, hidden // 2), max(1, inter // 2)
    if quant is not None:  # group schemes need K a multiple of the group (H for w13, I for w2)
        key = SCHEMES[quant].weight
        multiple = key.group if key.granularity == "group" else 1
        hidden = _round_up(hidden, multiple)
        inter = _round_up(inter, multiple)
    dtype = r.choice(sorted(DTYPES))
    local = None
    if r.random() < 0.2 and num_experts > 1:
        count = r.randint(1, num_experts - 1)
        local = tuple(sorted(r.sample(range(num_experts), count)))
    limit = None
    if activation in GATED and r.random() < 0.2:
        limit = round(r.uniform(0.25, 8.0), 3)
    return FuzzCase(
        seed=seed, profile=profile, num_tokens=num_tokens, num_experts=num_experts, top_k=top_k,
        hidden=hidden, inter=inter, dtype=dtype, activation=activation, routing=r.choice(ROUTINGS),
        bias=r.random() < 0.3, local_experts=local,
        weight_on_input=top_k == 1 and r.random() < 0.3, quant=quant, swiglu_limit=limit,
        ids_dtype="int64" if r.random() < 0.2 else "int32",
        strided_routing=r.random() < 0.2,  # drawn last: the earlier fields of every seed stay as they were
    )


def _log_uniform(r: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.exp(r.uniform(math.log(lo), math.log(hi + 1))))))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Inputs -------------------------------------------------------------------------------------------
@dataclass
class Problem:
    x_TH: torch.Tensor
    weights: ExpertWeights           # what the backends take (quantized payloads for a scheme)
    w13_LGH: torch.Tensor            # float32 weights as the math sees them (dequantized)
    w2_LHI: torch.Tensor
    topk_weights_TK: torch.Tensor
    topk_ids_TK: torch.Tensor
    expert_map_E: torch.Tensor | None
    w13_full_LGH: torch.Tensor | None = None  # float32 weights before quantization (quantized cases)
    w2_full_LHI: torch.Tensor | None = None


def make_problem(case: FuzzCase, device: str | torch.device = "cpu") -> Problem:
    """Random tensors of `case` (seeded by it), on `device`."""
    g = torch.Generator().manual_seed(case.seed)
    T, E, K, H, I = case.num_tokens, case.num_experts, case.top_k, case.hidden, case.inter
    dtype = case.torch_dtype
    L = E if case.local_experts is None else len(case.local_experts)
    G = w13_rows(case.activation, I)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(L, G, H, generator=g) / math.sqrt(H)
    w2 = torch.randn(L, H, I, generator=g) / math.sqrt(I)
    b13 = torch.randn(L, G, generator=g) * 0.1 if case.bias else None
    b2 = torch.randn(L, H, generator=g) * 0.1 if case.bias else None
    ids = _route(case, g)
    if case.weight_on_input:
        topk_w = torch.rand(T, K, generator=g) * 0.5 + 0.5
    else:
        topk_w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    expert_map = None
    if case.local_experts is not None:
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[list(case.local_experts)] = torch.arange(L, dtype=torch.int32)
    x = x.to(dtype)
    b13 = None if b13 is None else b13.to(dtype)
    b2 = None if b2 is None else b2.to(dtype)
    if case.quant is None:
        w13, w2 = w13.to(dtype), w2.to(dtype)
        weights = ExpertWeights(w13, w2, b13, b2)
        d13, d2 = w13.float(), w2.float()
    else:
        amax = _activation_amax(case, x, w13, w2, b13, b2, topk_w, ids, expert_map)
        q13, q2, params = quantize_weights(w13, w2, case.quant, activation_amax=amax)
        weights = ExpertWeights(q13, q2, b13, b2, params)
        d13, d2 = dequantize_weights(q13, q2, params)
    ids = ids.to(getattr(torch, case.ids_dtype))
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    if case.strided_routing:  # the same values, every other column of wider tensors (after the move)
        return Problem(to(x), _weights_to(weights, device), to(d13), to(d2), _strided(to(topk_w)), _strided(to(ids)),
                       to(expert_map), *((None, None) if case.quant is None else (to(w13), to(w2))))
    full = (None, None) if case.quant is None else (to(w13), to(w2))
    return Problem(to(x), _weights_to(weights, device), to(d13), to(d2), to(topk_w), to(ids), to(expert_map), *full)


def _weights_to(weights: ExpertWeights, device) -> ExpertWeights:
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ExpertWeights(*(to(t) for t in (weights.w13, weights.w2, weights.w13_bias, weights.w2_bias)),
                         _quant_to(weights.quant, device))


def _strided(t_TK: torch.Tensor) -> torch.Tensor:
    """t's values as columns 0, 2, ... of a [T, 2K] tensor (a strided view; the odd columns junk)."""
    wide = torch.stack([t_TK, torch.full_like(t_TK, -7)], dim=2).reshape(t_TK.shape[0], 2 * t_TK.shape[1])
    return wide[:, ::2]


def _route(case: FuzzCase, g: torch.Generator) -> torch.Tensor:
    """ids [T, K]: K distinct experts per token, skewed by case.routing."""
    T, E, K = case.num_tokens, case.num_experts, case.top_k
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32)
    if case.routing == "zipf":  # expert popularity ~ 1 / rank^1.2, ranks shuffled
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        p = p[torch.randperm(E, generator=g)]
        return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g).int()
    pool = torch.arange(E)
    if case.routing == "empty_experts":  # a third of the experts (at least K) receive every token
        pool = torch.randperm(E, generator=g)[: max(K, E // 3)]
    ids = pool[torch.rand(T, len(pool), generator=g).argsort(dim=1)[:, :K]]
    if case.routing == "one_expert":  # every token picks expert `hot`
        hot = int(torch.randint(E, (1,), generator=g))
        has = (ids == hot).any(dim=1)
        slot = torch.randint(K, (T,), generator=g)
        ids[~has, slot[~has]] = hot
    return ids.int()


def _activation_amax(case, x, w13, w2, b13, b2, topk_w, ids, expert_map):
    """Static activation scales (fp8 tensor-static, nvfp4 input global): calibrated on the problem
    (x's amax over all experts, the intermediate's per expert), as a checkpoint's would be."""
    scheme = SCHEMES[case.quant]
    if scheme.activation is None or (scheme.activation.dynamic and scheme.activation.dtype != "nvfp4"):
        return None
    L = w13.shape[0]
    x_amax, a_amax = torch.zeros(()), torch.ones(L)

    def record(t, e, which):
        if which == "x":
            x_amax.copy_(torch.maximum(x_amax, t.abs().amax()))
        elif t.numel():
            a_amax[e] = t.abs().amax().clamp_min(1e-6)
        return t

    fused_experts_ref(x, w13, w2, topk_w, ids, activation=case.activation,
                      apply_router_weight_on_input=case.weight_on_input, expert_map_E=expert_map,
                      global_num_experts=case.num_experts, w13_bias_LG=b13, w2_bias_LH=b2,
                      swiglu_limit=case.swiglu_limit,
                      input_transform=lambda t, e: record(t, e, "x"),
                      intermediate_transform=lambda t, e: record(t, e, "a"))
    return x_amax.clamp_min(1e-6), a_amax


def _quant_to(quant, device):
    if quant is None:
        return None
    moved = {f: (v.to(device) if isinstance(v, torch.Tensor) else v) for f, v in vars(quant).items()}
    return type(quant)(**moved)


def reference(case: FuzzCase, p: Problem, *, magnitude: bool = False,
              weight_only: bool = False, round_weighted_input: bool = False) -> torch.Tensor:
    """float64 fused_experts_ref on the dequantized weights; W8A8/W4A4 schemes fake-quantize the
    activations (float32 rounding, as emulation; the intermediate rounded to the activation dtype
    first, as the kernels store it) at GEMM1's and GEMM2's inputs, unless
    weight_only (backends with `weight_only_execution` keep activations in 16 bits).

    magnitude=True: sum_k |w| * (|a| @ |w2[e]|^T + |b2[e]|) instead, the size of the terms the
    output sums (>= |out|; much larger where GEMM2 or the top-k sum cancels).
    round_weighted_input=True (router weight on input): x * w is rounded to the activation dtype
    before GEMM1's input quantization, as the batched dispatch hands the experts x * w in the
    activation dtype. Quantizing after that rounding moves ~1% of the fp8 codes (bf16: 2^-9
    relative against fp8's 2^-4 half-step), a few percent of error the scheme's tolerance is
    not meant to absorb (GPU fuzz seeds 1317, 1446, 1905, 2228).
    """
    hooks = [None, None]
    scheme = get_scheme(case.quant)
    if scheme is not None and scheme.activation is not None and not weight_only:
        q = p.weights.quant
        # the intermediate as emulation: stored in the activation dtype, then quantized
        hooks = [_f64(activation_transform(scheme.activation, q.a13_scale)),
                 _f64(activation_transform(scheme.activation, q.a2_scale, round_to=case.torch_dtype))]
    if round_weighted_input and case.weight_on_input:
        hooks[0] = _rounded_first(hooks[0], case.torch_dtype)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    w2, b2, topk_w = d(p.w2_LHI), d(p.weights.w2_bias), p.topk_weights_TK
    if magnitude:
        w2, b2, topk_w = w2.abs(), None if b2 is None else b2.abs(), topk_w.abs()
        inner = hooks[1]
        hooks[1] = lambda t, e: (t if inner is None else inner(t, e)).abs()
    return fused_experts_ref(
        p.x_TH.double(), p.w13_LGH.double(), w2, topk_w, p.topk_ids_TK,
        activation=case.activation, apply_router_weight_on_input=case.weight_on_input,
        expert_map_E=p.expert_map_E, global_num_experts=case.num_experts,
        w13_bias_LG=d(p.weights.w13_bias), w2_bias_LH=b2,
        swiglu_limit=case.swiglu_limit, input_transform=hooks[0], intermediate_transform=hooks[1],
    )


def _rounded_first(transform, dtype: torch.dtype):
    def rounded(t: torch.Tensor, e: int) -> torch.Tensor:
        r = t.to(dtype).double()
        return r if transform is None else transform(r, e)

    return rounded


def _f64(transform):
    return lambda t, e: transform(t, e).double()


# Tolerances ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """rel_fro bounds ||out - ref||_F / ||ref||_F; rel_max bounds max|out - ref| / max|ref|."""

    rel_fro: float
    rel_max: float


# u = unit roundoff: fp32 6.0e-8, fp16 4.9e-4, bf16 3.9e-3. Unquantized and weight-only paths
# round the input, GEMM1's output, the intermediate and the output in the activation dtype:
# ~1.2u Frobenius (tests/cases.py measures 1.1u, worst relu2_no_mul); bounds 4u / 8u with the
# max taken over up to 96 x 192 outputs. fp32: accumulation over H, I <= 4096 stays < 1e-6.
# Quantized activations (W8A8, W4A4, W4A8): the backend computes GEMM1 in fp32/fp16, the
# reference in float64; an input within that difference of a code boundary rounds to the other
# code (fp8: one step = 2^-3 relative; int8: amax/127). Measured on 2,000 cpu-profile cases
# (emulation, fp32): fro <= 3e-7 without a flip, <= 2e-3 with one; the bounds allow a few flips
# and still fail on a wrong scale or a dropped expert (>= 1e-1).
_U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
UNQUANTIZED = {d: Tolerance(max(4 * u, 1e-5), max(8 * u, 2e-5)) for d, u in _U.items()}
ACTIVATION_QUANTIZED = {d: Tolerance(max(4 * u, 2e-2), max(8 * u, 1e-1)) for d, u in _U.items()}


# fp8 codes with per-tensor / per-channel scales on sm90 sum K in one chained wgmma accumulator
# (the default, `FUSEDMOE_FP8_ACCUMULATE` unset or chained), whose limited-precision adds move
# GEMM1's output by up to ~1e-2 at long K; more intermediate codes then round the other way.
# GPU fuzz seed 111150 (float32, H = 2992, I = 16): 2.3e-2 chained, within 2e-2 promoted. The GPU
# tests hold these schemes to 3e-2 against emulation (docs/quantization.md); so does the fuzz.
CHAINED_FP8 = Tolerance(3e-2, 1e-1)


SMALL_OUTPUT = 64


def tolerance(case: FuzzCase, *, chained_fp8: bool = False) -> Tolerance:
    """The bounds `case` is held to; chained_fp8: its fp8 GEMMs chain one accumulator across K on
    this device (`chains_fp8`)."""
    return scheme_tolerance(get_scheme(case.quant), case.torch_dtype, chained_fp8=chained_fp8)


def scheme_tolerance(scheme, dtype: torch.dtype, *, chained_fp8: bool = False) -> Tolerance:
    """The bounds an output of `scheme` (a QuantScheme or None) in `dtype` is held to against its
    reference (`tolerance`; `fusedmoe bench --check`)."""
    table = UNQUANTIZED if scheme is None or scheme.activation is None else ACTIVATION_QUANTIZED
    tol = table[dtype]
    if chained_fp8 and _chained_fp8_scheme(scheme):
        tol = Tolerance(max(tol.rel_fro, CHAINED_FP8.rel_fro), max(tol.rel_max, CHAINED_FP8.rel_max))
    return tol


def _chained_fp8_scheme(scheme) -> bool:
    """A W8A8 scheme whose fp8 GEMMs may chain (`quant.fp8_accumulation` names one mode for it)."""
    from fusedmoe.backends.triton.quant import fp8_accumulation

    return scheme is not None and scheme.activation is not None and fp8_accumulation(scheme) is not None


def chains_fp8(case: FuzzCase, device: torch.device) -> bool:
    """Whether the case's Triton fp8 GEMMs run with one chained accumulator on `device`: an sm90
    GPU (Triton lets wgmma accumulate fp8 products imprecisely there), an fp8 per-tensor /
    per-channel W8A8 scheme, and FUSEDMOE_FP8_ACCUMULATE not promoted."""
    return scheme_chains_fp8(get_scheme(case.quant), device)


def scheme_chains_fp8(scheme, device: torch.device) -> bool:
    """`chains_fp8` for a QuantScheme (or None)."""
    if device.type != "cuda" or not _chained_fp8_scheme(scheme):
        return False
    from fusedmoe.backends.triton.quant import fp8_accumulation

    return torch.cuda.get_device_capability(device)[0] == 9 and fp8_accumulation(scheme) == "chained"


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance,
            magnitude: torch.Tensor | None = None) -> str | None:
    """None if out matches ref within tol, else the reason (shape, non-finite, error figures).
    An all-zero ref (every slot dropped) demands an exactly zero out.

    Fewer than SMALL_OUTPUT values do not average their roundings, and one of them may be a sum
    that cancels (T=2, H=1, K=12 in bf16: 3.2e-2 relative): with `magnitude` (the reference's
    term sizes) such outputs are held to the max bound relative to the terms instead.
    """
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out = out.detach().cpu().double()
    ref = ref.cpu()
    if not torch.isfinite(out).all():
        return f"{int((~torch.isfinite(out)).sum())} non-finite values (the reference has none)"
    if out.numel() == 0:
        return None
    ref_max = ref.abs().max().item()
    if ref_max == 0:
        return None if out.abs().max().item() == 0 else "the reference is all zero but the output is not"
    diff = out - ref
    small = out.numel() < SMALL_OUTPUT
    if small and magnitude is not None:
        mx = (diff.abs().max() / magnitude.cpu().abs().max()).item()
        if mx <= tol.rel_max:
            return None
        return f"error {mx:.3e} relative to the largest term (tol {tol.rel_max:.1e}, {out.numel()} outputs)"
    fro = (diff.norm() / ref.norm()).item()
    mx = (diff.abs().max() / ref_max).item()
    # The Frobenius bound assumes independent roundings averaging over many outputs; a handful
    # (T=2, H=1: 2 values, measured 4.9u in fp16) is held to the max bound instead.
    fro_tol = tol.rel_max if small else tol.rel_fro
    if fro <= fro_tol and mx <= tol.rel_max:
        return None
    return f"relative error {fro:.3e} (Frobenius, tol {fro_tol:.1e}), {mx:.3e} (max, tol {tol.rel_max:.1e})"


# Backends -----------------------------------------------------------------------------------------
Runner = Callable[[FuzzCase, Problem], torch.Tensor]


def _interpreter_active() -> bool:
    """Triton runs in its interpreter (TRITON_INTERPRET=1, read by triton): CPU tensors work."""
    try:
        import triton.knobs
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)


def candidates(case: FuzzCase, device: torch.device, *, interpreter: bool = True,
               invariance: bool | None = None) -> dict[str, Runner]:
    """{backend name: runner} for every backend whose record accepts the case on this device.
    invariance (None: on CUDA devices): also `name[batch-invariant]` for every record that serves
    `MoEConfig.batch_invariant` and accepts the case with it (and, on the CPU, its interpreted
    Triton kernels as `name[interpreter][batch-invariant]`)."""
    if invariance is None:
        invariance = device.type == "cuda"
    load_plugins()
    platform = Platform.for_device(device)
    prof = PROFILES[case.profile]
    out: dict[str, Runner] = {}
    layouts = ["standard"]
    if _num_local(case) * case.num_tokens * max(case.hidden, 2 * case.inter) <= prof.max_batched_elements:
        layouts.append("batched")
    for layout in layouts:
        config = case.config(layout)
        for name, record in REGISTRY.items():
            if record.layout == layout and record.check(config, platform) is None:
                out[name] = _api_runner(name, layout)
            if (invariance and device.type != "cpu" and record.layout == layout and record.batch_invariant
                    and record.check(config.replace(batch_invariant=True), platform) is None):
                out[name + INVARIANT] = _invariant(name, layout)
    if (interpreter and device.type == "cpu" and _interpreter_active() and case.dtype != "bfloat16"
            and case.num_tokens * case.top_k <= prof.interpreter_max_slots
            and max(case.hidden, case.inter) <= prof.interpreter_max_dim):
        hopper = Platform("cuda", (9, 0), has_triton=True)
        # The batched layout computes [L, T] buffer rows: kept to 4x the slot bound (~1 s).
        batched_ok = case.num_experts * case.num_tokens <= 4 * prof.interpreter_max_slots
        for name, record in REGISTRY.items():  # fusedmoe's own Triton kernels
            if not (record.impl or "").startswith("fusedmoe.backends.triton."):
                continue
            if record.layout == "batched" and not batched_ok:
                continue
            if record.check(case.config(record.layout), hopper) is None:
                out[f"{name}{INTERPRETER}"] = _interpreted(name, record.layout)
            if invariance and record.batch_invariant and \
                    record.check(case.config(record.layout).replace(batch_invariant=True), hopper) is None:
                out[f"{name}{INTERPRETER}{INVARIANT}"] = _invariant(name, record.layout)
    return out


def _num_local(case: FuzzCase) -> int:
    return case.num_experts if case.local_experts is None else len(case.local_experts)


def record_name(runner: str) -> str:
    """The backend record a runner name stands for ("triton[interpreter][batch-invariant]" -> "triton")."""
    return runner.split("[", 1)[0]


def _api_runner(name: str, layout: str) -> Runner:
    def run(case: FuzzCase, p: Problem) -> torch.Tensor:
        from fusedmoe.api import fused_experts

        w = p.weights
        return fused_experts(
            p.x_TH, w.w13, w.w2, p.topk_weights_TK, p.topk_ids_TK, activation=case.activation,
            apply_router_weight_on_input=case.weight_on_input, expert_map=p.expert_map_E,
            global_num_experts=case.num_experts, w13_bias=w.w13_bias, w2_bias=w.w2_bias,
            quant=w.quant, backend=name, swiglu_limit=case.swiglu_limit, activation_format=layout,
        )

    return run


def _interpreted(name: str, layout: str) -> Runner:
    """The Triton backend's experts on CPU tensors (TRITON_INTERPRET=1), behind the same modular
    kernel fused_experts builds, on the weights as its `process_weights` lays them for a layer
    (group-major int4 / nvfp4 scales, mxfp4 in fragment order where the shapes allow); the API
    runners pass them as stored."""

    def run(case: FuzzCase, p: Problem) -> torch.Tensor:
        if case.num_tokens == 0:
            return p.x_TH.new_empty(0, case.hidden)
        kernel, weights = _layer_kernel(name, case.config(layout), p)
        return kernel(p.x_TH, weights, p.topk_weights_TK, p.topk_ids_TK, expert_map_E=p.expert_map_E)

    return run


def _layer_kernel(name: str, config: MoEConfig, p: Problem):
    """(the modular kernel fused_experts builds around `name`'s experts for `config`, the
    problem's weights as its `process_weights` lays them for a layer)."""
    experts = REGISTRY[name].load_impl()(config)
    return make_modular(config, experts), experts.process_weights(p.weights)


class BatchInvarianceError(AssertionError):
    """A sub-batch's rows differ bitwise from the same tokens' rows in the whole call."""


def invariance_subsets(num_tokens: int) -> list[list[int]]:
    """The sub-batches `_invariant` checks: the first token alone, the last three, every other
    token in reverse order (distinct sets only)."""
    subsets = [[0], list(range(max(0, num_tokens - 3), num_tokens)), list(range(num_tokens - 1, -1, -2))]
    seen, out = set(), []
    for rows in subsets:
        if rows and tuple(rows) not in seen and len(rows) < num_tokens:
            seen.add(tuple(rows))
            out.append(rows)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # NaNs compare by their bits


def _invariant(name: str, layout: str) -> Runner:
    """The backend's experts with `MoEConfig.batch_invariant` (behind the modular kernel, on its
    `process_weights` layout, as `_interpreted`): the whole call's output, checked against the
    reference by run_case, after each of `invariance_subsets` gave bitwise its tokens' rows of
    it (a BatchInvarianceError otherwise)."""

    def run(case: FuzzCase, p: Problem) -> torch.Tensor:
        if case.num_tokens == 0:
            return p.x_TH.new_empty(0, case.hidden)
        kernel, weights = _layer_kernel(name, case.config(layout).replace(batch_invariant=True), p)
        full = kernel(p.x_TH, weights, p.topk_weights_TK, p.topk_ids_TK, expert_map_E=p.expert_map_E)
        for rows in invariance_subsets(case.num_tokens):
            index = torch.tensor(rows, device=p.x_TH.device)
            part = kernel(p.x_TH[index], weights, p.topk_weights_TK[index], p.topk_ids_TK[index],
                          expert_map_E=p.expert_map_E)
            if not torch.equal(_bits(part), _bits(full[index])):
                bad = int((_bits(part).view(len(rows), -1) != _bits(full[index]).view(len(rows), -1)).any(1).sum())
                raise BatchInvarianceError(
                    f"{bad} of the {len(rows)} rows of sub-batch {_span(sorted(rows), 4)} differ bitwise from the same "
                    f"tokens' rows in the whole call of {case.num_tokens} (batch_invariant=True)")
        return full

    return run


def repeat_differs(first: torch.Tensor, again: torch.Tensor, run: str = "a second run") -> str | None:
    """Why a deterministic backend's later output `again` is not its first bit for bit (NaNs by
    their bits), or None; `run` names the later run in the reason. Used by run_case, `fusedmoe
    bench --check` and the tuner (`bench.repeat_mismatch`)."""
    if again.shape == first.shape and torch.equal(_bits(again), _bits(first)):
        return None
    if again.shape != first.shape:
        return f"{run} gave shape {tuple(again.shape)} after {tuple(first.shape)}"
    rows = (_bits(again).view(first.shape[0], -1) != _bits(first).view(first.shape[0], -1)).any(1)
    return (f"{run} gave another output bitwise ({int(rows.sum())} of {first.shape[0]} rows differ): "
            "the backend is deterministic, so a race")


# Running ------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    backend: str
    status: str  # ok | mismatch | error
    detail: str | None = None
    seconds: float = 0.0


@dataclass
class CaseResult:
    case: FuzzCase
    outcomes: list[Outcome]

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != "ok"]


def run_case(case: FuzzCase, device: str | torch.device = "cpu", *, backends: Sequence[str] | None = None,
             interpreter: bool = True, invariance: bool | None = None, repeat: bool | None = None) -> CaseResult:
    """Run every accepted backend (or those named) on `case` and compare with the reference.

    A backend raising on a problem its record accepts is a failure ("error"), as is a mismatch;
    so is a batch-invariant runner whose sub-batches' rows differ (`candidates`' invariance), and
    (repeat; default: on a GPU) a deterministic backend whose second run's output differs bitwise
    from its first (a race: the 4-bit fragment GEMMs' in-flight wgmma computed wrong rows on some
    runs only, kernels._rs_sync).
    """
    device = torch.device(device)
    repeat = device.type == "cuda" if repeat is None else repeat
    runners = candidates(case, device, interpreter=interpreter, invariance=invariance)
    if backends is not None:
        runners = {n: r for n, r in runners.items() if n in backends or record_name(n) in backends}
    if not runners:  # nothing to compare: skip building the problem and the reference
        return CaseResult(case, [])
    p = _retrying_oom(lambda: make_problem(case, device), device)
    refs: dict[tuple[bool, bool, bool], torch.Tensor] = {}  # (weight_only, rounded, magnitude) -> reference

    def ref_for(weight_only: bool, rounded: bool, magnitude: bool = False) -> torch.Tensor:
        key = (weight_only, rounded, magnitude)
        if key not in refs:
            refs[key] = reference(case, p, magnitude=magnitude, weight_only=weight_only,
                                  round_weighted_input=rounded)
        return refs[key]

    tol = tolerance(case, chained_fp8=chains_fp8(case, device))
    outcomes = []
    for name, runner in runners.items():
        start = time.perf_counter()
        record = REGISTRY[record_name(name)]
        weight_only = record.weight_only_execution
        # The batched dispatch writes x * w into the activation-dtype buffers it hands the
        # experts (as vLLM's prepare does); a scheme quantizing activations then rounds that.
        rounded = record.layout == "batched" and case.weight_on_input
        try:
            out = _retrying_oom(lambda: runner(case, p), device)  # noqa: B023 - called at once
            ref = _retrying_oom(lambda: ref_for(weight_only, rounded), device)  # noqa: B023
            reason = compare(out, ref, tol)
            if reason is not None and 0 < out.numel() < SMALL_OUTPUT and out.shape == ref.shape:
                reason = compare(out, ref, tol, ref_for(weight_only, rounded, magnitude=True))
            if reason is None and repeat and record.deterministic and out.numel():
                reason = repeat_differs(out, _retrying_oom(lambda: runner(case, p), device))  # noqa: B023
            status = "ok" if reason is None else "mismatch"
        except Exception as exc:  # noqa: BLE001 - a crash is a finding, recorded with its text
            reason, status = f"{type(exc).__name__}: {exc}", "error"
        outcomes.append(Outcome(name, status, reason, time.perf_counter() - start))
    if device.type == "cuda":  # the next case (or another worker on this GPU) gets the memory back
        del p, refs
    lost = context_lost(device)
    if lost is not None:
        outcomes.append(Outcome(WORKER, "error", f"{CONTEXT_LOST}: {lost}"))
    elif device.type == "cuda":
        torch.cuda.empty_cache()
    return CaseResult(case, outcomes)


CONTEXT_LOST = "the CUDA context was lost during this case"


def context_lost(device: torch.device) -> str | None:
    """Why the CUDA context of `device` can no longer run kernels (an illegal memory access or
    another sticky error left it unusable), or None. One tiny kernel and a synchronization: every
    later case in this process would fail with the same error, so a run stops or replaces the
    process (`fuzz`), rather than reporting one fault as a failure of every later case."""
    if device.type != "cuda":
        return None
    try:
        probe = torch.ones(1, device=device)
        probe.add_(1)
        torch.cuda.synchronize(device)
        return None
    except Exception as exc:  # noqa: BLE001 - any error here means the context is unusable
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _context_was_lost(result: CaseResult) -> bool:
    return any(o.backend == WORKER and o.detail and o.detail.startswith(CONTEXT_LOST) for o in result.outcomes)


OOM_RETRIES = 3


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)


def _retrying_oom(fn: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """fn(); on CUDA, an out-of-memory error is retried (after freeing the cache and a wait) up to
    OOM_RETRIES times: with --jobs, other workers' cases share the GPU, and their peak is not
    this backend's defect. An OOM that persists is reported as the error it is."""
    for attempt in range(OOM_RETRIES + 1):
        try:
            return fn()
        except Exception as exc:
            if device.type != "cuda" or attempt == OOM_RETRIES or not _is_oom(exc):
                raise
        gc.collect()
        torch.cuda.empty_cache()
        time.sleep(2.0 * (attempt + 1))
    raise AssertionError("unreachable")


@dataclass
class BackendTally:
    cases: int = 0
    mismatches: int = 0
    errors: int = 0
    seconds: float = 0.0


@dataclass
class Report:
    profile: str
    device: str
    first_seed: int
    cases: int = 0
    seconds: float = 0.0
    per_backend: dict[str, BackendTally] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    skipped_backends: int = 0  # cases no backend ran (0 unless --backends narrows the set)
    requested: int | None = None  # cases asked for (None: as many as were added)
    jobs: int = 1
    stopped: str | None = None  # why cases were left unstarted ("time limit 600 s")
    seeds: list[int] = field(default_factory=list)  # the seeds that ran, ascending

    def add(self, result: CaseResult) -> None:
        self.cases += 1
        self.seeds.append(result.case.seed)
        if not result.outcomes:
            self.skipped_backends += 1
        for o in result.outcomes:
            t = self.per_backend.setdefault(o.backend, BackendTally())
            t.cases += 1
            t.seconds += o.seconds
            t.mismatches += o.status == "mismatch"
            t.errors += o.status == "error"
            if o.status != "ok":
                self.failures.append({"seed": result.case.seed, "backend": o.backend, "status": o.status,
                                      "detail": o.detail, "case": asdict(result.case)})

    @property
    def seeds_not_run(self) -> list[int]:
        """Seeds of the requested range that did not run (the run was cut short)."""
        if self.requested is None:
            return []
        ran = set(self.seeds)
        return [s for s in range(self.first_seed, self.first_seed + self.requested) if s not in ran]

    def table(self) -> str:
        not_run = self.seeds_not_run
        count = f"{self.cases} of {self.requested}" if not_run else f"{self.cases}"
        jobs = f", {self.jobs} jobs" if self.jobs > 1 else ""
        lines = [f"fuzz: {count} cases (profile {self.profile}, device {self.device}, seeds "
                 f"{_span(self.seeds)}{jobs}) in {self.seconds:.1f} s"]
        if not_run:
            lines.append(f"cut short ({self.stopped or 'stopped'}): {len(not_run)} seeds not run: {_span(not_run)}")
        width = max([28, *map(len, self.per_backend)])
        lines.append(f"{'backend':<{width}} {'cases':>7} {'mismatch':>8} {'error':>6} {'seconds':>8}")
        for name, t in sorted(self.per_backend.items()):
            lines.append(f"{name:<{width}} {t.cases:>7} {t.mismatches:>8} {t.errors:>6} {t.seconds:>8.1f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """seeds_run / seeds_not_run: inclusive [first, last] ranges."""
        return {"profile": self.profile, "device": self.device, "first_seed": self.first_seed,
                "cases": self.cases, "requested": self.cases if self.requested is None else self.requested,
                "jobs": self.jobs, "seconds": round(self.seconds, 1), "stopped": self.stopped,
                "seeds_run": _ranges(self.seeds), "seeds_not_run": _ranges(self.seeds_not_run),
                "per_backend": {k: asdict(v) for k, v in sorted(self.per_backend.items())},
                "failures": self.failures, "cases_without_backend": self.skipped_backends}


def _ranges(seeds: Sequence[int]) -> list[list[int]]:
    """Ascending seeds as inclusive [first, last] runs: [0, 1, 2, 5] -> [[0, 2], [5, 5]]."""
    out: list[list[int]] = []
    for s in seeds:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _span(seeds: Sequence[int], most: int = 8) -> str:
    runs = [f"{a}..{b}" if b > a else f"{a}" for a, b in _ranges(seeds)]
    if not runs:
        return "none"
    more = f", ... ({len(runs) - most} more runs)" if len(runs) > most else ""
    return ", ".join(runs[:most]) + more


class _Progress:
    """A line on `stream` at most every `every` seconds, so a killed run shows how far it got."""

    def __init__(self, stream: TextIO | None, total: int, every: float, start: float, jobs: int) -> None:
        self.stream, self.total, self.every, self.start, self.jobs = stream, total, every, start, jobs
        self.last = start
        self.failures = 0

    def due(self, now: float) -> float | None:
        """Seconds until the next line (None: never)."""
        return None if self.stream is None else max(0.0, self.last + self.every - now)

    def tick(self, done: int, now: float) -> None:
        if self.stream is None or now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        jobs = f", {self.jobs} jobs" if self.jobs > 1 else ""
        print(f"fuzz: {done}/{self.total} cases, {self.failures} failures, {elapsed:.0f} s "
              f"({done / max(elapsed, 1e-9):.2f} cases/s{jobs})", file=self.stream, flush=True)


def fuzz(cases: int, first_seed: int = 0, *, profile: str = "ci", device: str = "cpu",
         backends: Sequence[str] | None = None, interpreter: bool = True,
         on_failure: Callable[[CaseResult], None] | None = None, jobs: int = 1,
         time_limit: float | None = None, progress: TextIO | None = None, progress_every: float = 30.0,
         worker_setup: Callable[[], None] | None = None, invariance: bool | None = None) -> Report:
    """Run seeds first_seed .. first_seed + cases - 1; tally per backend.

    jobs > 1: that many spawned worker processes, the next free one taking the next seed; results
    are added in seed order, so the report equals the serial one but for the seconds. Workers get
    os.environ, sys.path, Triton's interpreter setting and `knobs.override` values, not other
    in-process changes (monkeypatches, registered backends): `worker_setup`, a picklable function,
    runs in each worker before its first case for those. A case that kills its worker, or raises
    outside the backends (serially: the exception propagates), is a WORKER error under its seed.
    So is a case after which the CUDA context cannot run kernels (`context_lost`: an illegal memory
    access is sticky): its worker is replaced, or, serially, the run stops there (report.stopped).
    time_limit: no case starts after that many seconds; report.stopped says so, report.seeds lists
    the seeds that ran (cases under way finish; in parallel those still running STOP_GRACE_S later
    are stopped and count as not run). progress: a stream (stderr) that gets a line every
    `progress_every` seconds. on_failure is called as each failing case completes. invariance:
    the batch-invariant runners (`candidates`; None: on CUDA devices).
    """
    if cases < 0 or jobs < 1:
        raise ValueError(f"cases={cases}, jobs={jobs}: expected cases >= 0 and jobs >= 1")
    if time_limit is not None and not time_limit >= 0:
        raise ValueError(f"time_limit={time_limit}: expected seconds >= 0 (or None for no limit)")
    report = Report(profile, str(device), first_seed, requested=cases, jobs=jobs)
    start = time.perf_counter()
    deadline = None if time_limit is None else start + time_limit
    seeds = range(first_seed, first_seed + cases)
    meter = _Progress(progress, cases, progress_every, start, jobs)
    stop_reason = None if time_limit is None else f"time limit {time_limit:g} s"
    if jobs == 1:
        for seed in seeds:
            if deadline is not None and time.perf_counter() >= deadline:
                report.stopped = stop_reason
                break
            result = run_case(draw_case(seed, profile), device, backends=backends, interpreter=interpreter,
                              invariance=invariance)
            report.add(result)
            meter.failures += len(result.failures)
            if result.failures and on_failure is not None:
                on_failure(result)
            meter.tick(report.cases, time.perf_counter())
            if _context_was_lost(result):  # every later case would fail with the same error
                report.stopped = (f"the CUDA context was lost at seed {seed} (a new process is needed: "
                                  "--jobs 2 or more replaces a worker that loses it)")
                break
    else:
        job = _Job(profile, str(device), None if backends is None else tuple(backends), interpreter,
                   _interpreter_active(), tuple(knobs.overrides().items()),
                   max(1, torch.get_num_threads() // jobs), worker_setup, invariance)
        _run_parallel(report, seeds, job, jobs, deadline, stop_reason, on_failure, meter)
    report.seconds = time.perf_counter() - start
    return report


# Worker processes ---------------------------------------------------------------------------------
WORKER = "(worker)"  # the pseudo-backend of a case that killed its worker or raised outside the backends
STOP_GRACE_S = 60.0  # after the time limit, how long cases under way may still take (GPU: 1-4 s each)


@dataclass(frozen=True)
class _Job:
    """What a spawned worker needs to run a seed as the parent would (nothing else is shared)."""

    profile: str
    device: str
    backends: tuple[str, ...] | None
    interpreter: bool
    triton_interpret: bool  # the parent's Triton interpreter setting (TRITON_INTERPRET or set in-process)
    knob_overrides: tuple[tuple[str, object], ...]
    threads: int  # torch CPU threads per worker: the parent's / jobs, so N workers do not oversubscribe
    setup: Callable[[], None] | None
    invariance: bool | None = None


def _worker(conn: Connection, job: _Job) -> None:
    """Worker process: sends "ready", then one CaseResult per seed received, until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    torch.set_num_threads(job.threads)
    if job.triton_interpret != _interpreter_active():  # set in-process in the parent, not by env
        import triton.knobs

        triton.knobs.runtime.interpret = job.triton_interpret
    if job.setup is not None:
        job.setup()
    if job.device.startswith("cuda"):
        # Many workers share the GPU: segments that grow and shrink leave less reserved-but-unused
        # memory behind than fixed blocks (H200, 12 workers: 3-4 GB of ~11 GB each otherwise).
        # Read when this process first allocates on the GPU; a setting of the user's stands.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with knobs.override(**dict(job.knob_overrides)):
        conn.send("ready")
        while True:
            try:
                seed = conn.recv()
            except EOFError:  # the parent is gone
                return
            if seed is None:
                return
            case = draw_case(seed, job.profile)
            try:
                result = run_case(case, job.device, backends=job.backends, interpreter=job.interpreter,
                                  invariance=job.invariance)
            except Exception as exc:  # noqa: BLE001 - recorded under the seed; the other seeds go on
                result = CaseResult(case, [Outcome(WORKER, "error", f"outside the backends: {type(exc).__name__}: {exc}")])
                lost = context_lost(torch.device(job.device))  # the fault may have been outside the backends
                if lost is not None:
                    result.outcomes.append(Outcome(WORKER, "error", f"{CONTEXT_LOST}: {lost}"))
            if _context_was_lost(result):  # no later case could run here: the parent starts a new worker
                conn.send(_Retiring(result))
                return
            conn.send(result)


@dataclass
class _Retiring:
    """A worker's last result: it exits after sending it (its CUDA context was lost)."""

    result: CaseResult


@dataclass
class _WorkerState:
    process: BaseProcess
    ready: bool = False
    seed: int | None = None  # the case under way


def _run_parallel(report: Report, seeds: range, job: _Job, jobs: int, deadline: float | None,
                  stop_reason: str | None, on_failure: Callable[[CaseResult], None] | None,
                  meter: _Progress) -> None:
    """Hand `seeds` in ascending order to `jobs` spawned workers; add their results to `report`
    in seed order. Stops handing out at `deadline`; replaces a worker that dies during a case."""
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be initialized again in a forked child
    todo = deque(seeds)
    results: dict[int, CaseResult] = {}
    workers: dict[Connection, _WorkerState] = {}

    def start() -> None:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_worker, args=(child, job), daemon=True, name="fusedmoe-fuzz")
        process.start()
        child.close()  # the worker's end lives in the worker only: its death reads as EOF here
        workers[parent] = _WorkerState(process)

    def finished(result: CaseResult) -> None:
        results[result.case.seed] = result
        meter.failures += len(result.failures)
        if result.failures and on_failure is not None:
            on_failure(result)

    def hand_out(conn: Connection) -> None:
        w = workers[conn]
        w.seed = todo.popleft() if todo and not expired else None
        try:
            conn.send(w.seed)
        except OSError:  # it died: the EOF that follows retires it
            if w.seed is not None:
                todo.appendleft(w.seed)
            w.seed = None

    expired = False  # past the deadline: no more seeds handed out
    started = False  # a worker got as far as its first case
    for _ in range(min(jobs, len(todo))):
        start()
    try:
        while workers:
            now = time.perf_counter()
            meter.tick(len(results), now)  # also while every worker is busy (compiling)
            if deadline is not None and not expired and now >= deadline:
                expired = True
                if todo:
                    report.stopped = stop_reason
            if expired and now >= deadline + STOP_GRACE_S:
                running = sum(w.seed is not None for w in workers.values())
                if running:
                    report.stopped = (f"{stop_reason}; {running} cases still running "
                                      f"{STOP_GRACE_S:g} s later were stopped")
                break
            waits = [meter.due(now)]
            if deadline is not None:
                waits.append(max(0.0, deadline + (STOP_GRACE_S if expired else 0.0) - now))
            waits = [t for t in waits if t is not None]
            for conn in wait(list(workers), timeout=min(waits) + 0.01 if waits else None):
                w = workers[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del workers[conn]
                    conn.close()
                    w.process.join()
                    code = w.process.exitcode
                    if not w.ready:  # not replaced: a worker that cannot start would loop
                        if started:
                            continue
                        raise RuntimeError(f"a fuzz worker exited before its first case (exit code {code}); "
                                           "its error is printed above") from None
                    if w.seed is not None:
                        finished(CaseResult(draw_case(w.seed, job.profile), [Outcome(
                            WORKER, "error", f"the worker process died during this case (exit code {code})")]))
                    if todo and not expired:
                        start()
                    continue
                if isinstance(message, _Retiring):  # it exits next: its EOF starts a replacement
                    finished(message.result)
                    w.seed = None
                    continue
                if message == "ready":
                    w.ready = started = True
                else:
                    finished(message)
                hand_out(conn)
    finally:
        for w in workers.values():
            w.process.terminate()
        for w in workers.values():
            w.process.join()
    if todo and report.stopped is None:
        report.stopped = "no worker process left (replacements exited before their first case)"
    for seed in sorted(results):
        report.add(results[seed])


def replay_command(case: FuzzCase, device: str = "cpu", invariance: bool | None = None) -> str:
    flag = "" if invariance is None else " --batch-invariance" if invariance else " --no-batch-invariance"
    return f"fusedmoe fuzz --replay {case.seed} --profile {case.profile} --device {device}{flag}"
