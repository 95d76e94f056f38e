"""GPU coverage of the quantized schemes past tests/test_gpu_quant.py and tests/test_gpu_wo.py:
the batched layout on every preset shape, the presets' full shapes the weight-only schemes had
not run, W8A8 with gpt-oss's swigluoai, NVFP4 W4A4 / MXFP4 W4A8 (marlin on Hopper) on preset
shapes, and the edge cases those files left out (top_k = E, odd H and I, offsets past 2^31 for
every W8A8 scheme). Every comparison also bounds the worst row (`gpu_checks.close`), and every
CUDA graph is replayed on changed inputs (`gpu_checks.replay_on_new_inputs`), not only on the captured ones.

Skipped without CUDA. Run on the device machine: `bash scripts/test_gpu.sh tests/test_gpu_quant_coverage.py`.
"""

from __future__ import annotations

import functools

import pytest
import torch

import test_gpu_quant as w8
import test_gpu_wo as wo
from fusedmoe import MoEConfig, Platform, fused_experts, select_backend
from fusedmoe.oracle import BackendRequestError
from gpu_checks import close, poison_allocator, replay_on_new_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


REFUSED = (BackendRequestError, ValueError, NotImplementedError)  # a call the oracle refuses raises one of these


def triton_takes(E, K, H, I, scheme) -> bool:
    """Whether the oracle lets `triton` take this shape (biases on) for the scheme on this GPU; a
    refusal names its reason."""
    config = MoEConfig(E, K, H, I, dtype=torch.bfloat16, quant=scheme, has_bias=True, backend="triton")
    try:
        select_backend(config, Platform.for_device(torch.device("cuda")))
    except BackendRequestError as refused:
        assert str(refused)
        return False
    return True


# -- W8A8 ----------------------------------------------------------------------------------------

@pytest.mark.bigmem
@pytest.mark.parametrize("shape", [s for s in w8.SHAPES if s != "qwen3-30b-like"])  # Qwen3-30B: test_gpu_quant
@pytest.mark.parametrize("scheme", w8.W8A8)
def test_w8a8_batched_layout_on_presets(scheme, shape):
    """dispatch -> batched_triton -> combine on each preset shape: against the contiguous path and
    emulation, worst row bounded, replayed in a CUDA graph on new inputs."""
    E, K, H, I = w8.SHAPES[shape]
    x, q13, q2, params, _, _, w, ids = w8.make(64, E, K, H, I, scheme, seed=21)
    tol = w8.tol_emulation(scheme)
    kw = dict(quant=params, backend="triton", activation_format="batched")
    poison_allocator()
    out = fused_experts(x, q13, q2, w, ids, **kw)
    contiguous = fused_experts(x, q13, q2, w, ids, quant=params, backend="triton")
    emulated = fused_experts(x, q13, q2, w, ids, quant=params, backend="emulation")
    for ref in (contiguous, emulated):
        close(out, ref, tol)
    replay_on_new_inputs(lambda: fused_experts(x, q13, q2, w, ids, **kw), x, w, ids, E,
                         lambda: fused_experts(x, q13, q2, w, ids, quant=params, backend="emulation"), tol)


MORE_FULL_SHAPES = [  # scheme, T, E, K, H, I, activation, biases: presets' full shapes test_gpu_quant's FULL_SHAPES lacks
    ("fp8_w8a8_tensor", 16, 256, 8, 7168, 256, "silu", False),  # DeepSeek-V3 TP8
    ("fp8_w8a8_tensor_static", 4, 256, 8, 7168, 256, "silu", False),
    ("fp8_w8a8_tensor_static", 64, 128, 4, 2880, 2880, "swigluoai", True),  # gpt-oss-120b
    ("fp8_w8a8_channel", 256, 128, 4, 2880, 2880, "swigluoai", True),
    ("fp8_w8a8_block", 1, 128, 4, 2880, 2880, "swigluoai", True),
    ("int8_w8a8", 33, 128, 4, 2880, 2880, "swigluoai", True),
]


@pytest.mark.bigmem
@pytest.mark.parametrize("case", MORE_FULL_SHAPES,
                         ids=[f"{c[0]}-T{c[1]}-E{c[2]}-H{c[4]}-{c[6]}" for c in MORE_FULL_SHAPES])
def test_w8a8_more_full_shapes(case):
    """The packaged plans on full preset shapes (gpt-oss's with its swigluoai and biases) against
    emulation, worst row bounded, deterministic."""
    scheme, T, E, K, H, I, activation, bias = case
    x, q13, q2, params, b13, b2, w, ids = w8.make(T, E, K, H, I, scheme, seed=T + 3, bias=bias)
    kw = dict(quant=params, w13_bias=b13, w2_bias=b2, activation=activation)
    poison_allocator()
    out = fused_experts(x, q13, q2, w, ids, backend="triton", **kw)
    emulated = fused_experts(x, q13, q2, w, ids, backend="emulation", **kw)
    close(out, emulated, w8.tol_emulation(scheme))
    assert torch.equal(out, fused_experts(x, q13, q2, w, ids, backend="triton", **kw))


@pytest.mark.parametrize("scheme", w8.W8A8)
def test_w8a8_swigluoai_against_the_reference(scheme):
    """gpt-oss's activation with biases on a gpt-oss-like shape, against emulation and the
    reference on dequantized weights (test_gpu_quant.check)."""
    E, K, H, I = w8.SHAPES["gpt-oss-like"]
    for tokens in (1, 33):
        w8.check(*w8.make(tokens, E, K, H, I, scheme, seed=tokens + 40, bias=True), activation="swigluoai")


@pytest.mark.parametrize("scheme", w8.W8A8)
def test_w8a8_top_k_equals_experts_and_odd_sizes(scheme):
    """top_k = E (every expert gets every token), and H = 65, I = 37: run and checked where the
    oracle lets `triton` take the shape, else refused with a named reason before any launch."""
    w8.check(*w8.make(40, 8, 8, 256, 128, scheme, seed=50, bias=True))
    E, K, H, I = 6, 3, 65, 37
    made = w8.make(29, E, K, H, I, scheme, seed=51, bias=True)
    if triton_takes(E, K, H, I, scheme):
        w8.check(*made)
        return
    x, q13, q2, params, b13, b2, w, ids = made
    with pytest.raises(REFUSED):
        fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="triton")


@pytest.mark.bigmem
@pytest.mark.parametrize("scheme", ["fp8_w8a8_channel", "int8_w8a8", "fp8_w8a8_tensor"])
def test_w8a8_int32_offsets_every_scheme(scheme):
    """T*K*H = 100000 * 6 * 4096 > 2^31 (test_gpu_quant runs fp8 block and static per-tensor):
    per-token schemes checked on the first and last rows alone (their rows are independent);
    dynamic per-tensor fp8 on those rows of one emulation of the whole batch (its scale sees every row)."""
    T, E, K, H, I = 100_000, 8, 6, 4096, 128
    x, q13, q2, params, _, _, w, ids = w8.make(T, E, K, H, I, scheme, seed=52)
    poison_allocator(1 << 30)
    out = fused_experts(x, q13, q2, w, ids, quant=params, backend="triton")
    rows = torch.cat([torch.arange(0, 100), torch.arange(T - 100, T)]).cuda()
    if scheme == "fp8_w8a8_tensor":
        emulated = fused_experts(x, q13, q2, w, ids, quant=params, backend="emulation")[rows]
    else:
        emulated = fused_experts(x[rows], q13, q2, w[rows], ids[rows], quant=params, backend="emulation")
    close(out[rows], emulated, w8.tol_emulation(scheme))


# -- weight-only -------------------------------------------------------------------------------

# the layouts a FusedMoE layer runs on Hopper (4-bit as fragments) and the 8-bit codes
WO_DEFAULT = ["fp8_w8a16", "int8_w8a16", "int4_w4a16_g32:fragments", "int4_w4a16_g64:fragments",
              "int4_w4a16_g128:fragments", "mxfp4_w4a16:fragments", "nvfp4_w4a16:fragments",
              "int4_w4a16_g32_zp:fragments", "int4_w4a16_g64_zp:fragments", "int4_w4a16_g128_zp:fragments"]


def _g128_refuses(scheme: str, H: int) -> bool:
    return "_g128" in scheme and H % 128 != 0


@pytest.mark.bigmem
@pytest.mark.parametrize("shape", [s for s in wo.SHAPES if s != "mixtral-like"])  # Mixtral: test_gpu_wo
@pytest.mark.parametrize("scheme", WO_DEFAULT)
def test_wo_batched_layout_on_presets(scheme, shape):
    """dispatch -> batched_triton (weight-only) -> combine on each preset shape with its activation
    and biases: against the contiguous path and emulation, worst row bounded, replayed in a CUDA
    graph on new inputs."""
    E, K, H, I, activation, bias = wo.SHAPES[shape]
    if _g128_refuses(scheme, H):
        pytest.skip(f"H = {H} is not a multiple of the group 128 (quantize_weights refuses it)")
    q13, q2, params, b13, b2 = wo.make_weights(E, H, I, scheme, seed=22, bias=bias)
    x, w, ids = wo.make_tokens(64, E, K, H, seed=22)
    common = dict(quant=params, w13_bias=b13, w2_bias=b2, activation=activation)
    poison_allocator()
    out = fused_experts(x, q13, q2, w, ids, backend="triton", activation_format="batched", **common)
    for ref in (fused_experts(x, q13, q2, w, ids, backend="triton", **common),
                fused_experts(x, q13, q2, w, ids, backend="emulation", **common)):
        close(out, ref, wo.TOL)
    # one token, and every token on one expert
    single = fused_experts(x[:1], q13, q2, w[:1], ids[:1], backend="triton", activation_format="batched", **common)
    close(single, fused_experts(x[:1], q13, q2, w[:1], ids[:1], backend="emulation", **common), wo.TOL)
    one = torch.full_like(ids[:, :1], E - 1)
    got = fused_experts(x, q13, q2, w[:, :1], one, backend="triton", activation_format="batched", **common)
    close(got, fused_experts(x, q13, q2, w[:, :1], one, backend="emulation", **common), wo.TOL)
    replay_on_new_inputs(
        lambda: fused_experts(x, q13, q2, w, ids, backend="triton", activation_format="batched", **common),
        x, w, ids, E, lambda: fused_experts(x, q13, q2, w, ids, backend="emulation", **common), wo.TOL)


FULL_PRESETS = {  # E, K, H, I, activation, bias: the presets' whole shapes
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu", False),
    "deepseek-v3-tp8": (256, 8, 7168, 256, "silu", False),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai", True),
}


@pytest.mark.bigmem
@pytest.mark.parametrize("preset", list(FULL_PRESETS))
@pytest.mark.parametrize("scheme", ["int4_w4a16_g32:fragments", "mxfp4_w4a16:fragments", "nvfp4_w4a16:fragments"])
def test_wo_full_preset_shapes(scheme, preset):
    """The 4-bit formats as the layer lays them, on the presets' whole shapes (test_gpu_wo's
    preset-like shapes cut Mixtral's I and DeepSeek-V3's / gpt-oss's experts): the packaged plans
    at decode and prefill-like M against emulation, worst row bounded, deterministic."""
    E, K, H, I, activation, bias = FULL_PRESETS[preset]
    q13, q2, params, b13, b2 = wo.make_weights(E, H, I, scheme, seed=23, bias=bias)
    common = dict(quant=params, w13_bias=b13, w2_bias=b2, activation=activation)
    for tokens in (1, 16, 256):
        x, w, ids = wo.make_tokens(tokens, E, K, H, seed=tokens + 23)
        poison_allocator()
        out = fused_experts(x, q13, q2, w, ids, backend="triton", **common)
        emulated = fused_experts(x, q13, q2, w, ids, backend="emulation", **common)
        close(out, emulated, wo.TOL)
        assert torch.equal(out, fused_experts(x, q13, q2, w, ids, backend="triton", **common)), tokens


@pytest.mark.parametrize("scheme", WO_DEFAULT)
def test_wo_top_k_equals_experts(scheme):
    """top_k = E: every expert gets every token (the group sizes keep H and I even: 4-bit codes
    pack two a byte and group scales need H and I multiples of the group)."""
    q13, q2, params, b13, b2 = wo.make_weights(8, 256, 128, scheme, seed=53, bias=True)
    x, w, ids = wo.make_tokens(40, 8, 8, 256, seed=53)
    wo.check(x, q13, q2, params, b13, b2, w, ids)


@pytest.mark.parametrize("scheme", ["fp8_w8a16", "int8_w8a16"])
def test_wo_8bit_odd_sizes(scheme):
    """H = 65, I = 37 with 8-bit weight-only codes: run and checked where the oracle lets `triton`
    take the shape, else refused with a named reason before any launch."""
    E, K, H, I = 6, 3, 65, 37
    q13, q2, params, b13, b2 = wo.make_weights(E, H, I, scheme, seed=54, bias=True)
    x, w, ids = wo.make_tokens(29, E, K, H, seed=54)
    if triton_takes(E, K, H, I, scheme):
        wo.check(x, q13, q2, params, b13, b2, w, ids)
        return
    with pytest.raises(REFUSED):
        fused_experts(x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2, backend="triton")


@pytest.mark.bigmem
@pytest.mark.parametrize("scheme", ["int4_w4a16_g32:fragments", "mxfp4_w4a16:fragments", "int8_w8a16"])
def test_wo_int32_offsets(scheme):
    """T*K*H = 100000 * 6 * 4096 > 2^31 bf16 activations through the weight-only kernels: the
    first and last rows against emulation of those rows (weight-only rows are independent)."""
    T, E, K, H, I = 100_000, 8, 6, 4096, 128
    q13, q2, params, _, _ = wo.make_weights(E, H, I, scheme, seed=55)
    x, w, ids = wo.make_tokens(T, E, K, H, seed=55)
    poison_allocator(1 << 30)
    out = fused_experts(x, q13, q2, w, ids, quant=params, backend="triton")
    rows = torch.cat([torch.arange(0, 100), torch.arange(T - 100, T)]).cuda()
    emulated = fused_experts(x[rows], q13, q2, w[rows], ids[rows], quant=params, backend="emulation")
    close(out[rows], emulated, wo.TOL)


# -- NVFP4 W4A4 and MXFP4 W4A8 (marlin on Hopper) ------------------------------------------------

@pytest.mark.bigmem
@pytest.mark.parametrize("shape", ["qwen3-30b", "gpt-oss-like", "deepseek-v3-tp8-like"])
@pytest.mark.parametrize("scheme,twin", [("nvfp4", "nvfp4_w4a16"), ("mxfp4_w4a8", "mxfp4_w4a16")])
def test_marlin_on_presets(scheme, twin, shape):
    """The schemes Hopper runs weight-only (the seeds' Marlin rows) on preset shapes with their
    activation and biases, both layouts, M = 1 / 33 / 512 and every token on one expert, against the
    weight-only twin's emulation; replayed in a CUDA graph on new inputs."""
    from fusedmoe.quant import QuantParams

    E, K, H, I, activation, bias = wo.SHAPES[shape]
    q13, q2, params, b13, b2 = wo.make_weights(E, H, I, scheme, seed=24, bias=bias)
    twin_params = QuantParams(twin, params.w13_scale, params.w2_scale, w13_global_scale=params.w13_global_scale,
                              w2_global_scale=params.w2_global_scale)
    for tokens in (1, 33, 512):
        x, w, ids = wo.make_tokens(tokens, E, K, H, seed=tokens + 24)
        cases = [(w, ids), (w[:, :1], torch.full_like(ids[:, :1], 1))]
        for ww, ii in cases:
            want = fused_experts(x, q13, q2, ww, ii, quant=twin_params, w13_bias=b13, w2_bias=b2,
                                 activation=activation, backend="emulation")
            for backend, layout in (("marlin", "standard"), ("batched_marlin", "batched")):
                poison_allocator()
                out = fused_experts(x, q13, q2, ww, ii, quant=params, w13_bias=b13, w2_bias=b2,
                                    activation=activation, backend=backend, activation_format=layout)
                close(out, want, wo.TOL)
    x, w, ids = wo.make_tokens(48, E, K, H, seed=25)
    for backend, layout in (("marlin", "standard"), ("batched_marlin", "batched")):
        run = functools.partial(fused_experts, x, q13, q2, w, ids, quant=params, w13_bias=b13, w2_bias=b2,
                                activation=activation, backend=backend, activation_format=layout)
        replay_on_new_inputs(run, x, w, ids, E,
                             lambda: fused_experts(x, q13, q2, w, ids, quant=twin_params, w13_bias=b13,
                                                   w2_bias=b2, activation=activation, backend="emulation"),
                             wo.TOL)
