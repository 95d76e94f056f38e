"""`fusedmoe tune`'s launch glue on the CPU, through the Triton interpreter (fp32, small sizes).

The tuner times GEMM1 and GEMM2 of each path apart (tune._gemms); run once and reduced, they
give bitwise what the experts op gives with the same tiles. Timing itself needs a GPU.
Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # these build CPU tensors for the interpreter
    pytest.skip("interpreter tests (CPU)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fusedmoe import select_experts  # noqa: E402
from fusedmoe.backends.triton.experts import launch_reduce, triton_experts  # noqa: E402
from fusedmoe.backends.triton.quant import triton_quant_experts  # noqa: E402
from fusedmoe.backends.triton.tiles import TileConfig  # noqa: E402
from fusedmoe.quant.scheme import get_scheme  # noqa: E402
from fusedmoe.quant.weights import quantize_weights  # noqa: E402
from fusedmoe.tune import _gemms  # noqa: E402

T, E, K, H, I = 5, 4, 2, 128, 64  # noqa: E741
# (GEMM1 tile the intermediate is made with, another GEMM1 tile, GEMM2 tile)
TILES = {
    None: ((16, 64, 32, 4, 1), (16, 32, 64, 4, 1, 2), (16, 64, 64, 4, 1)),
    "fp8_w8a8_block": ((16, 128, 64, 4, 1), (16, 64, 64, 4, 1, 2), (16, 64, 128, 4, 1)),  # fused 1x128 epilogue
    "fp8_w8a8_tensor": ((16, 64, 64, 4, 1), (16, 32, 64, 4, 1), (16, 64, 64, 4, 1)),
    "int4_w4a16_g32": ((16, 64, 32, 4, 1), (16, 32, 64, 4, 1), (16, 64, 64, 4, 1)),
}


@pytest.mark.parametrize("quant", list(TILES), ids=[str(q) for q in TILES])
def test_tuner_gemms_match_the_experts_op(quant):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    weights, ids = select_experts(x, torch.randn(T, E, generator=gen), K)
    scheme = get_scheme(quant)
    copies = []
    for _ in range(2):
        w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
        copies.append((w13, w2, None) if scheme is None else quantize_weights(w13, w2, scheme))
    fill, other, tile2 = (TileConfig(*t) for t in TILES[quant])
    gemm1, gemm2, launch = _gemms(scheme, copies, x, weights, ids, E, I, "silu", fill)
    gemm1(1, other)  # a timed GEMM1: GEMM2 keeps reading the intermediate `fill` made
    gemm2(0, tile2)
    out = torch.empty_like(x)
    launch_reduce(launch, out)
    q13, q2, params = copies[0]
    if scheme is None:
        ref = triton_experts(x, q13, q2, weights, ids, None, None, None, E, "silu", False, 1.702, None,
                             tiles=(fill, tile2))
    else:
        ref = triton_quant_experts(x, q13, q2, weights, ids, None, None, None, E, "silu", False, 1.702,
                                   None, scheme, params.w13_scale, params.w2_scale, params.a13_scale,
                                   params.a2_scale, tiles=(fill, tile2),
                                   w13_global_scale=params.w13_global_scale,
                                   w2_global_scale=params.w2_global_scale)
    assert torch.equal(out, ref)
