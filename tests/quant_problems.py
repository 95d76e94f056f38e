"""Quantized experts problems shared by the Triton W8A8 and weight-only interpreter tests.

    config, x, weights, topk_w, ids, expert_map = problem(Case(...), scheme, dtype)
    out = run(config, x, weights, topk_w, ids, expert_map, tiles)        # triton_quant_experts
    ref = dequantized_reference(config, x, weights, topk_w, ids, expert_map)
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from unittest import mock

import torch

from fusedmoe import MoEConfig, fused_experts_ref, select_experts
from fusedmoe.backends.triton.quant import triton_quant_experts
from fusedmoe.backends.triton.tiles import TileConfig
from fusedmoe.modular import ExpertWeights
from fusedmoe.quant.weights import dequantize_weights, quantize_weights

CODE_FLIP_ROWS, CODE_FLIP_TOL = 2, 1e-2


@contextlib.contextmanager
def int4_fragment_minimum(minimum: dict[int, int]):
    """weight_only.INT4_FRAGMENTS_MIN_INTER with `minimum`'s groups replaced (e.g. {32: 2048}: g32's
    rule before the sixty-sixth session), the memoized tile choices cleared on entry and exit (they
    remember the layout a problem plans for, which the table decides)."""
    from fusedmoe.backends.triton import weight_only
    from fusedmoe.backends.triton.experts import clear_tile_caches

    clear_tile_caches()
    try:
        with mock.patch.dict(weight_only.INT4_FRAGMENTS_MIN_INTER, minimum):
            yield
    finally:
        clear_tile_caches()


def code_flip_stats(out, want) -> tuple[int, float]:
    """(rows of out off want by more than 2e-5 of want's max, the largest such error / max)."""
    assert out.shape == want.shape, (out.shape, want.shape)
    if want.numel() == 0:
        return 0, 0.0
    row_err = (out.float() - want.float()).abs().amax(-1) / want.abs().max().clamp_min(1e-30)
    return int((row_err > 2e-5).sum()), float(row_err.max())


def assert_close_up_to_code_flips(out, want, *, max_rows: int = CODE_FLIP_ROWS, tol: float = CODE_FLIP_TOL) -> None:
    """out == want in fp32, except where a dynamically quantized activation flipped a code.

    Two computations of one quantized layer that batch an expert's rows differently (EP splits,
    replicas) sum GEMM1 in another order (~1e-6 apart); a value that close to a rounding boundary
    takes the neighbouring code, one step off, moving one token's row by ~5e-4 of the output's
    max. At most `max_rows` rows may differ by more than 2e-5 of that max, none by `tol`; a wrong
    scale or weight moves most rows by O(1).
    """
    off, err = code_flip_stats(out, want)
    assert off <= max_rows and err < tol, f"{off} rows off, max relative error {err:.2e}"


def rel_err(out, ref):
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@dataclass(frozen=True)
class Case:
    id: str
    T: int = 6
    E: int = 4
    K: int = 2
    H: int = 128
    I: int = 64
    activation: str = "silu"
    bias: bool = False
    on_input: bool = False
    expert_map: bool = False
    tiles: tuple[tuple, tuple] | None = ((16, 64, 64, 4, 1), (16, 128, 64, 4, 1))


def problem(case: Case, scheme: str, dtype: torch.dtype):
    """Random weights quantized with `scheme` (static activation scales calibrated on the
    problem itself), routed tokens; expert_map keeps experts 0, 2, 4, ... on this rank."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.id}{scheme}".encode()))
    rows = case.I if case.activation.endswith("no_mul") else 2 * case.I
    num_local, expert_map = case.E, None
    if case.expert_map:
        local = list(range(0, case.E, 2))
        num_local = len(local)
        expert_map = torch.full((case.E,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(num_local, dtype=torch.int32)
    x = torch.randn(case.T, case.H, generator=gen).to(dtype)
    w13 = torch.randn(num_local, rows, case.H, generator=gen) / case.H**0.5
    w2 = torch.randn(num_local, case.H, case.I, generator=gen) / case.I**0.5
    b13 = torch.randn(num_local, rows, generator=gen).to(dtype) * 0.1 if case.bias else None
    b2 = torch.randn(num_local, case.H, generator=gen).to(dtype) * 0.1 if case.bias else None
    weights, ids = select_experts(x, torch.randn(case.T, case.E, generator=gen), case.K,
                                  renormalize=not case.on_input)
    if scheme.endswith("_zp"):  # asymmetric int4: rows off centre, so the zero points span their range
        w13 += torch.rand(num_local, rows, 1, generator=gen) * 2 / case.H**0.5
        w2 -= torch.rand(num_local, case.H, 1, generator=gen) * 2 / case.I**0.5
    amax = None
    if scheme.endswith("static"):  # calibrate: x's amax over all experts, a's per expert
        amax = (torch.zeros(()), torch.ones(num_local))

        def record(name):
            def hook(t, e):
                if name == "x":
                    amax[0].copy_(torch.maximum(amax[0], t.abs().amax()))
                else:
                    amax[1][e] = t.abs().amax()
                return t
            return hook

        fused_experts_ref(x, w13, w2, weights, ids, activation=case.activation,
                          apply_router_weight_on_input=case.on_input, expert_map_E=expert_map,
                          global_num_experts=case.E, w13_bias_LG=b13, w2_bias_LH=b2,
                          input_transform=record("x"), intermediate_transform=record("a"))
    q13, q2, params = quantize_weights(w13, w2, scheme, activation_amax=amax)
    config = MoEConfig(case.E, case.K, case.H, case.I, dtype=dtype, activation=case.activation,
                       has_bias=case.bias, quant=scheme, apply_router_weight_on_input=case.on_input,
                       has_expert_map=case.expert_map)
    return config, x, ExpertWeights(q13, q2, b13, b2, params), weights, ids, expert_map


def run(config, x, w, weights, ids, expert_map, tiles=None, out=None, direct=None):
    p = w.quant
    return triton_quant_experts(
        x, w.w13, w.w2, weights, ids, w.w13_bias, w.w2_bias, expert_map, config.num_experts,
        config.activation, config.apply_router_weight_on_input, config.swiglu_alpha,
        config.swiglu_limit, p.scheme.name, p.w13_scale, p.w2_scale, p.a13_scale, p.a2_scale,
        tiles=None if tiles is None else tuple(TileConfig(*t) for t in tiles), out=out,
        w13_global_scale=p.w13_global_scale, w2_global_scale=p.w2_global_scale, direct=direct,
        w13_zero=p.w13_zero, w2_zero=p.w2_zero,
    )


def dequantized_reference(config, x, w, weights, ids, expert_map):
    d13, d2 = dequantize_weights(w.w13, w.w2, w.quant)
    return fused_experts_ref(
        x.double(), d13.double(), d2.double(), weights, ids, activation=config.activation,
        apply_router_weight_on_input=config.apply_router_weight_on_input, expert_map_E=expert_map,
        global_num_experts=config.num_experts, swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        w13_bias_LG=None if w.w13_bias is None else w.w13_bias.double(),
        w2_bias_LH=None if w.w2_bias is None else w.w2_bias.double(),
    )


def division_rows(k: int, dtype: str, group: int | None = None, *, device="cpu", seed: int = 0) -> torch.Tensor:
    """Rows whose codes test the quantizer's division x / scale bit for bit: three rows per
    exponent e from -100 to 100, each with amax m * 2^e (m random in [1, 2)), so the scales fall
    both inside and outside the [2^-64, 2^64] range the kernels divide by a reciprocal in
    (quant_kernels._div_scale); the amax in every group (`group`), so each group's scale is the
    row's; the other values on and up to 3 ulps either side of the rounding ties at that scale
    (int8: n + 1/2; fp8: midpoints of neighbouring e4m3 values), and negative zeros."""
    from fusedmoe.quant.formats import FP8_MAX, INT_RANGE, absmax_scale

    gen = torch.Generator().manual_seed(seed)
    qmax = FP8_MAX if dtype == "fp8" else INT_RANGE[8][1]
    if dtype == "fp8":
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
        ties = (grid[:-1] + grid[1:]) / 2
    else:
        ties = torch.arange(0, 127).float() + 0.5
    rows = []
    for e in (-100, -70, -64, -40, -3, 0, 7, 40, 64, 70, 100):
        for _ in range(3):
            amax = (1 + torch.rand(1, generator=gen)) * 2.0**e
            near = [ties * absmax_scale(amax, qmax)]  # the scale the kernels compute from amax
            for _ in range(3):
                near = [near[0].nextafter(near[0] * 2), *near, near[-1].nextafter(near[-1] * 0)]
            vals = torch.cat(near)
            row = vals[torch.randint(0, vals.numel(), (k,), generator=gen)]
            row = torch.where(torch.rand(k, generator=gen) < 0.5, row, -row).clamp(-amax.item(), amax.item())
            row[1::7] = -0.0  # a zero quotient keeps its sign (an e4m3 code's sign bit)
            row[:: group or k] = amax.item()
            rows.append(row)
    return torch.stack(rows).to(device)
