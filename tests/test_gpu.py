"""GPU tests: every kernel against the reference on real shapes, edge cases, graphs, compile.

Skipped without CUDA. Run on the device machine: `pytest -m gpu tests/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

import fusedmoe
from fusedmoe import FusedMoE, MoEConfig, fused_experts, fused_experts_ref, select_experts
from fusedmoe.presets import PRESETS
from gpu_checks import capture, close, poison_allocator, rel_err, replayed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # fp32: TF32-free (ieee) dots


def make(T, E, K, H, I, dtype, *, act="silu", bias=False, seed=0, on_input=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = 2 * I if act in ("silu", "gelu", "gelu_tanh", "swigluoai") else I
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(E, rows, H, device="cuda", generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).to(dtype)
    b13 = torch.randn(E, rows, device="cuda", generator=gen).to(dtype) if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(dtype) if bias else None
    logits = torch.randn(T, E, device="cuda", generator=gen)
    w, ids = select_experts(x, logits, K, renormalize=not on_input)
    return x, w13, w2, b13, b2, w, ids


def ref_of(x, w13, w2, b13, b2, w, ids, **kw):
    return fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids,
                             w13_bias_LG=None if b13 is None else b13.float(),
                             w2_bias_LH=None if b2 is None else b2.float(), **kw)


SHAPES = ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "llama-4-maverick"]


@pytest.mark.bigmem
@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("dtype,tokens", [(torch.bfloat16, 1), (torch.bfloat16, 16), (torch.bfloat16, 300),
                                          (torch.float16, 1), (torch.float16, 300),
                                          (torch.float32, 1), (torch.float32, 300)])
def test_presets(name, dtype, tokens):
    p = PRESETS[name]
    inter = p.intermediate_size // p.bench_tp
    x, w13, w2, b13, b2, w, ids = make(tokens, p.num_experts, p.top_k, p.hidden_size, inter, dtype,
                                       act=p.activation, bias=p.has_bias, on_input=p.apply_router_weight_on_input)
    kw = dict(activation=p.activation, apply_router_weight_on_input=p.apply_router_weight_on_input)
    poison_allocator()
    out = fused_experts(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, backend="triton", **kw)
    close(out, ref_of(x, w13, w2, b13, b2, w, ids, **kw), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai", "relu2_no_mul", "silu_no_mul",
                                 "gelu_no_mul"])
def test_dtypes_and_activations(dtype, act):
    x, w13, w2, b13, b2, w, ids = make(77, 12, 3, 256, 192, dtype, act=act, bias=True, seed=1)
    poison_allocator()
    out = fused_experts(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, activation=act, backend="triton")
    close(out, ref_of(x, w13, w2, b13, b2, w, ids, activation=act), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,E,K,H,I", [(0, 8, 2, 128, 64), (1, 8, 2, 128, 64), (5, 7, 3, 65, 37),
                                       (33, 6, 6, 4096, 128), (9, 257, 8, 256, 96), (45, 5, 1, 97, 51)])
def test_edge_shapes(T, E, K, H, I, dtype):
    """M=0 and 1, odd H and I, top_k = E (33 x 6 of 6), E not a power of two (7, 257, 5), top_k = 1."""
    x, w13, w2, b13, b2, w, ids = make(T, E, K, H, I, dtype, seed=2)
    poison_allocator()
    out = fused_experts(x, w13, w2, w, ids, backend="triton")
    assert out.shape == (T, H)
    if T:
        close(out, ref_of(x, w13, w2, b13, b2, w, ids), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,top_k", [(500, 1), (3, 1), (200, 4)])
def test_all_tokens_one_expert_and_empty_experts(dtype, tokens, top_k):
    """Every slot on expert 11 (the others empty), at 1 and 4 slots a token (top_k 4: the same expert
    four times, summed with four weights); the direct decode path (3 tokens) and the aligned one."""
    x, w13, w2, _, _, w, ids = make(tokens, 16, top_k, 512, 256, dtype, seed=3)
    ids = torch.full_like(ids, 11)
    poison_allocator()
    out = fused_experts(x, w13, w2, w, ids, backend="triton")
    close(out, ref_of(x, w13, w2, None, None, w, ids), TOL[dtype])


def test_expert_map_and_out_of_range_ids():
    x, w13, w2, _, _, w, ids = make(64, 16, 4, 256, 128, torch.bfloat16, seed=4)
    expert_map = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    expert_map[1::2] = torch.arange(8, dtype=torch.int32, device="cuda")
    w13l, w2l = w13[:8].contiguous(), w2[:8].contiguous()
    out = fused_experts(x, w13l, w2l, w, ids, expert_map=expert_map, global_num_experts=16, backend="triton")
    ref = fused_experts_ref(x.float(), w13l.float(), w2l.float(), w, ids, expert_map_E=expert_map,
                            global_num_experts=16)
    close(out, ref, TOL[torch.bfloat16])
    bad = ids.clone()
    bad[::3, 0] = 99  # out of range, validation off: contributes zero, never read out of bounds
    out = fused_experts(x, w13, w2, w, bad, backend="triton", validate=False)
    keep = (bad < 16).float()
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w * keep, bad.clamp(max=15))
    close(out, ref, TOL[torch.bfloat16])
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="outside"):
        fused_experts(x, w13, w2, w, bad, backend="triton", validate=True)


@pytest.mark.bigmem
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int32_offset_overflow(dtype):
    """T*K*H = 100000 * 6 * 4096 > 2^31: row offsets must be 64-bit (fp32: 9.8 GB of slot rows)."""
    T, E, K, H, I = 100_000, 8, 6, 4096, 128
    x, w13, w2, _, _, w, ids = make(T, E, K, H, I, dtype, seed=5)
    poison_allocator()
    out = fused_experts(x, w13, w2, w, ids, backend="triton")
    rows = torch.cat([torch.arange(0, 100), torch.arange(T - 100, T)]).cuda()
    ref = ref_of(x[rows], w13, w2, None, None, w[rows], ids[rows])
    close(out[rows], ref, TOL[dtype])
    del out
    torch.cuda.empty_cache()


_PROCESS_RUN = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_gpu import make
from fusedmoe import fused_experts
x, w13, w2, _, _, w, ids = make({tokens}, 32, 4, 1024, 512, {dtype}, seed=7)
torch.save(fused_experts(x, w13, w2, w, ids, backend="triton").cpu(), {path!r})
"""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 200])
def test_deterministic_across_processes(dtype, tokens, tmp_path):
    """A fresh process (its own Triton launch state, allocator and addresses) computes bitwise the
    output this one does: the direct decode path (1 token) and the aligned one (200)."""
    import subprocess
    import sys
    from pathlib import Path

    x, w13, w2, _, _, w, ids = make(tokens, 32, 4, 1024, 512, dtype, seed=7)
    here = fused_experts(x, w13, w2, w, ids, backend="triton").cpu()
    path = tmp_path / "out.pt"
    code = _PROCESS_RUN.format(tests=str(Path(__file__).parent), tokens=tokens, dtype=f"torch.{str(dtype).split('.')[-1]}",
                               path=str(path))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    assert torch.equal(torch.load(path), here)


def test_deterministic_and_cuda_graph():
    x, w13, w2, _, _, w, ids = make(200, 32, 4, 1024, 512, torch.bfloat16, seed=6)
    first = fused_experts(x, w13, w2, w, ids, backend="triton")
    assert torch.equal(first, fused_experts(x, w13, w2, w, ids, backend="triton"))
    graph, static_out = capture(lambda: fused_experts(x, w13, w2, w, ids, backend="triton"))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, first)
    # new routing through the same graph
    w2_, ids2 = select_experts(x, torch.randn(200, 32, device="cuda"), 4)
    w.copy_(w2_)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    close(static_out, ref_of(x, w13, w2, None, None, w, ids), TOL[torch.bfloat16])


def test_layer_selects_triton_and_compiles():
    E, K, H, I = 16, 4, 512, 256
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer.w13_weight.normal_(0, H**-0.5)
        layer.w2_weight.normal_(0, I**-0.5)
    assert layer.process_weights_after_loading().name == "triton"
    x = torch.randn(37, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(37, E, device="cuda")
    eager = layer(x, logits)
    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(x, logits)
    assert rel_err(out, eager) < 1e-2
    w, ids = layer.route(x, logits)
    close(eager, ref_of(x, layer.w13_weight, layer.w2_weight, None, None, w, ids), TOL[torch.bfloat16])


def test_fused_experts_compiles():
    """fused_experts under torch.compile(fullgraph=True) on CUDA: the trace holds
    fusedmoe::fused_experts (its body picks the backend and launches the Triton kernels); the
    eager result bit for bit, in place too."""
    x, w13, w2, b13, b2, w, ids = make(37, 16, 4, 512, 256, torch.bfloat16, bias=True, seed=31)
    want = fused_experts(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2)
    compiled = torch.compile(lambda x_: fused_experts(x_, w13, w2, w, ids, w13_bias=b13, w2_bias=b2),
                             fullgraph=True)
    assert torch.equal(compiled(x), want)
    h = x.clone()
    torch.compile(lambda h_: fused_experts(h_, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, inplace=True),
                  fullgraph=True)(h)
    assert torch.equal(h, want)


def test_layer_with_shared_experts_compiles():
    """torch.compile(fullgraph=True) of a layer with shared experts on CUDA: the knob reads are
    trace-time constants and the side stream is left out of the trace (in sequence there)."""
    from fusedmoe.shared import SharedExperts

    E, K, H, I = 16, 4, 512, 256
    shared = SharedExperts(H, 384, gate=True, params_dtype=torch.bfloat16, device="cuda")
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, device="cuda", shared_experts=shared)
    with torch.no_grad():
        for p in (*layer.parameters(),):
            p.normal_(0, H**-0.5)
    layer.process_weights_after_loading()
    x = torch.randn(37, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(37, E, device="cuda")
    eager = layer(x, logits)
    out = torch.compile(layer, fullgraph=True)(x, logits)
    assert rel_err(out, eager) < 1e-2


def test_grouped_mm_backend():
    reason = fusedmoe.backends.REGISTRY["grouped_mm"].check(fusedmoe.MoEConfig(8, 2, 256, 128),
                                                            fusedmoe.Platform.current())
    if reason is not None:
        pytest.skip(f"grouped_mm unsupported here: {reason}")
    x, w13, w2, b13, b2, w, ids = make(70, 8, 2, 256, 128, torch.bfloat16, bias=True, seed=7)
    out = fused_experts(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, backend="grouped_mm")
    close(out, ref_of(x, w13, w2, b13, b2, w, ids), TOL[torch.bfloat16])


def test_opcheck_on_gpu():
    from fusedmoe.backends.triton.experts import triton_experts_op

    x, w13, w2, _, _, w, ids = make(9, 8, 2, 128, 64, torch.bfloat16, seed=8)
    torch.library.opcheck(triton_experts_op, (x, w13, w2, w, ids, None, None, None, 8, "silu", False, 1.702, None))


@pytest.mark.bigmem
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b"])
def test_batched_layout(name):
    p = PRESETS[name]
    x, w13, w2, b13, b2, w, ids = make(64, p.num_experts, p.top_k, p.hidden_size, p.intermediate_size // p.bench_tp,
                                       torch.bfloat16, act=p.activation, bias=p.has_bias, seed=9)
    kw = dict(activation=p.activation, w13_bias=b13, w2_bias=b2)
    poison_allocator()
    out = fused_experts(x, w13, w2, w, ids, activation_format="batched", **kw)
    ref = ref_of(x, w13, w2, b13, b2, w, ids, activation=p.activation)
    close(out, ref, TOL[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    fused_experts(x, w13, w2, w, ids, activation_format="batched", **kw)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static = fused_experts(x, w13, w2, w, ids, activation_format="batched", **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


def test_batched_sparse_counts():
    """Buffers far larger than the counts (EP dispatch sized for the worst case): only the live
    row blocks run; an empty expert, a full one, and rows past each count stay zero."""
    from fusedmoe.backends.triton.experts import triton_batched_experts

    gen = torch.Generator(device="cuda").manual_seed(13)
    L, M, H, I = 16, 512, 256, 192
    x = torch.randn(L, M, H, device="cuda", generator=gen).to(torch.bfloat16)
    counts = torch.randint(0, 40, (L,), device="cuda", generator=gen, dtype=torch.int32)
    counts[3], counts[7] = 0, M
    w13 = (torch.randn(L, 2 * I, H, device="cuda", generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(L, H, I, device="cuda", generator=gen) / I**0.5).to(torch.bfloat16)
    poison_allocator()
    y = triton_batched_experts(x, counts, w13, w2, None, None, "silu", 1.702, None)
    for e in range(L):
        n = int(counts[e])
        if n:
            h = x[e, :n].float() @ w13[e].float().T
            want = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[e].float().T
            close(y[e, :n], want, TOL[torch.bfloat16])
        assert (y[e, n:] == 0).all()


def test_in_place():
    x, w13, w2, b13, b2, w, ids = make(100, 16, 4, 512, 256, torch.bfloat16, bias=True, seed=10)
    ref = ref_of(x, w13, w2, b13, b2, w, ids)
    out = fused_experts(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, inplace=True)
    assert out.data_ptr() == x.data_ptr()
    close(x, ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("T,E,K,H,I,act,bias,operands", [
    (600, 8, 2, 1024, 512, "silu", False, 3),  # descriptors on w13, a and w2
    (300, 7, 3, 1000, 296, "gelu", True, 3),  # H % 64 = 40 and I % 64 = 40: K and N tails
    (300, 6, 2, 512, 333, "relu2_no_mul", True, 1),  # odd I: gemm2 stays on pointer loads
])
def test_tma_descriptor_loads(monkeypatch, T, E, K, H, I, act, bias, operands):
    """sm90+: the large-M tiles load through TMA descriptors (an expert left empty), against the
    reference and FUSEDMOE_TRITON_TMA=0, eagerly and replayed from a CUDA graph."""
    from fusedmoe import knobs
    from fusedmoe.backends.triton import experts
    from fusedmoe.backends.triton.tiles import TileConfig

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA descriptors need sm90+")
    x, w13, w2, b13, b2, _, _ = make(T, E, K, H, I, torch.bfloat16, act=act, bias=bias, seed=11)
    logits = torch.randn(T, E, device="cuda")
    logits[:, 1] = -1e4  # expert 1 gets no token
    w, ids = select_experts(x, logits, K)
    tiles = (TileConfig(128, 64, 64, 8, 3), TileConfig(128, 128, 64, 4, 4))
    built = []
    real = experts._descriptor
    monkeypatch.setattr(experts, "_descriptor", lambda t, block: built.append(block) or real(t, block))

    def run():
        return experts.triton_experts(x, w13, w2, w, ids, b13, b2, None, E, act, False, 1.702, None, tiles=tiles)

    out = run()
    assert len(built) == operands
    close(out, ref_of(x, w13, w2, b13, b2, w, ids, activation=act), TOL[torch.bfloat16])
    with knobs.override(TRITON_TMA=False):
        assert rel_err(out, run()) < 1e-2
    assert torch.equal(replayed(run), out)


def _off_and_on(x, w13, w2, w, ids, b13, b2, act: str, on_input: bool, tiles_of, **kw) -> dict:
    """{flag: triton_experts' output with tiles_of(flag)} for a tile flag off and on; the "on"
    call is also captured in a CUDA graph and replayed, bitwise its eager output."""
    from fusedmoe.backends.triton import experts

    outs = {}
    for flag in (False, True):
        tiles = tiles_of(flag)

        def run(tiles=tiles):
            return experts.triton_experts(x, w13, w2, w, ids, b13, b2, None, w13.shape[0], act, on_input, 1.702,
                                          None, tiles=tiles, **kw)

        outs[flag] = run()
        if flag:
            assert torch.equal(replayed(run), outs[True])
    return outs


@pytest.mark.parametrize("T,E,K,H,I,bias,on_input", [
    (2000, 7, 3, 1000, 296, True, False),  # K and N tails, an expert left empty, biases
    (4096, 128, 8, 2048, 768, False, False),  # Qwen3-30B's shape
    (1500, 16, 1, 5120, 256, True, True),  # the routed weight on the input
])
def test_persistent_gemm2(T, E, K, H, I, bias, on_input):
    """The persistent GEMM2 (TileConfig.persistent: one program per SM over every real tile, in a
    flattened loop) gives bitwise the tile-per-program launch's output, matches the reference,
    and replays from a CUDA graph (the tile count is read on the device)."""
    from fusedmoe.backends.triton.tiles import TileConfig

    x, w13, w2, b13, b2, _, _ = make(T, E, K, H, I, torch.bfloat16, bias=bias, seed=13)
    logits = torch.randn(T, E, device="cuda")
    logits[:, 1] = -1e4  # expert 1 gets no token
    w, ids = select_experts(x, logits, K, renormalize=not on_input)
    t1 = TileConfig(128, 64, 64, 8, 3)
    outs = _off_and_on(x, w13, w2, w, ids, b13, b2, "silu", on_input,
                       lambda p: (t1, TileConfig(128, 256, 64, 8, 3, persistent=p)))
    assert torch.equal(outs[False], outs[True])
    ref = ref_of(x, w13, w2, b13, b2, w, ids, apply_router_weight_on_input=on_input)
    close(outs[True], ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("T,E,K,H,I,bias,on_input,act,block_m", [
    (2000, 7, 3, 1000, 296, True, False, "swigluoai", 128),  # K and N tails, an expert left empty, biases
    (4096, 128, 8, 2048, 768, False, False, "silu", 128),  # Qwen3-30B's shape
    (1500, 16, 1, 5120, 256, True, True, "silu", 64),  # the routed weight on the input
    (300, 9, 2, 1000, 296, True, False, "gelu", 16),  # pointer loads (16-row blocks)
])
def test_one_dot_gemm1(T, E, K, H, I, bias, on_input, act, block_m):
    """The one-dot GEMM1 (TileConfig.one_dot: gate over up as one [2 * block_n]-wide operand, a
    3D TMA box from 64-row blocks) matches the two-dot launch and the reference, and replays
    from a CUDA graph."""
    from fusedmoe.backends.triton.tiles import TileConfig

    x, w13, w2, b13, b2, _, _ = make(T, E, K, H, I, torch.bfloat16, bias=bias, seed=17)
    logits = torch.randn(T, E, device="cuda")
    logits[:, 1] = -1e4  # expert 1 gets no token
    w, ids = select_experts(x, logits, K, renormalize=not on_input)
    t2 = TileConfig(block_m, 64, 64, 4, 3)
    wide = block_m > 16
    outs = _off_and_on(x, w13, w2, w, ids, b13, b2, act, on_input,
                       lambda o: (TileConfig(block_m, 128 if wide else 32, 64, 8 if wide else 4, 4, one_dot=o), t2))
    assert rel_err(outs[True], outs[False]) < 1e-3
    ref = ref_of(x, w13, w2, b13, b2, w, ids, activation=act, apply_router_weight_on_input=on_input)
    close(outs[True], ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("T,E,K,H,I,bias,on_input,act,one_dot,block_m", [
    (2000, 7, 3, 1000, 296, True, False, "swigluoai", True, 128),  # K and N tails, an empty expert, biases
    (4096, 256, 8, 7168, 256, False, False, "silu", True, 128),  # DeepSeek-V3 TP8's shape
    (4096, 128, 4, 2880, 2880, True, False, "swigluoai", True, 128),  # gpt-oss-120b's
    (1500, 16, 1, 5120, 256, True, True, "silu", True, 64),  # the routed weight on the input
    (2000, 7, 3, 1000, 296, True, False, "silu", False, 128),  # two dots
    (700, 9, 2, 1000, 296, True, False, "gelu_no_mul", False, 64),  # ungated
])
def test_persistent_gemm1(T, E, K, H, I, bias, on_input, act, one_dot, block_m):
    """The persistent GEMM1 (TileConfig.persistent on GEMM1: one program per SM over every real
    tile, in a flattened loop) gives bitwise the tile-per-program launch's output, one dot or
    two, gated or not, matches the reference, and replays from a CUDA graph (the tile count is
    read on the device)."""
    from fusedmoe.activations import is_gated
    from fusedmoe.backends.triton.tiles import TileConfig

    x, w13, w2, b13, b2, _, _ = make(T, E, K, H, I, torch.bfloat16, bias=bias, seed=19)
    if not is_gated(act):  # [E, I, H]
        w13, b13 = w13[:, :I].contiguous(), None if b13 is None else b13[:, :I].contiguous()
    logits = torch.randn(T, E, device="cuda")
    logits[:, 1] = -1e4  # expert 1 gets no token
    w, ids = select_experts(x, logits, K, renormalize=not on_input)
    t2 = TileConfig(block_m, 128, 64, 8, 3)
    outs = _off_and_on(x, w13, w2, w, ids, b13, b2, act, on_input,
                       lambda p: (TileConfig(block_m, 128 if one_dot else 64, 64, 8, 4, one_dot=one_dot, persistent=p),
                                  t2))
    assert torch.equal(outs[False], outs[True])
    ref = ref_of(x, w13, w2, b13, b2, w, ids, activation=act, apply_router_weight_on_input=on_input)
    close(outs[True], ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("T,bias,act", [(1, False, "silu"), (3, True, "swigluoai")])
def test_one_dot_gemm1_direct(T, bias, act):
    """The one-dot GEMM1 on the direct decode path (one slot per 16-row block, pointer loads)
    matches the two-dot launch and the reference, and replays from a CUDA graph."""
    from fusedmoe.backends.triton.tiles import TileConfig

    E, K, H, I = 9, 3, 1000, 296  # K and N tails
    x, w13, w2, b13, b2, _, _ = make(T, E, K, H, I, torch.bfloat16, bias=bias, seed=23)
    w, ids = select_experts(x, torch.randn(T, E, device="cuda"), K)
    t2 = TileConfig(16, 64, 128, 4, 3)
    outs = _off_and_on(x, w13, w2, w, ids, b13, b2, act, False,
                       lambda o: (TileConfig(16, 64, 128, 4, 3, one_dot=o), t2), direct=True)
    assert rel_err(outs[True], outs[False]) < 1e-3
    ref = ref_of(x, w13, w2, b13, b2, w, ids, activation=act)
    close(outs[True], ref, TOL[torch.bfloat16])


@pytest.mark.bigmem
@pytest.mark.parametrize("name", SHAPES)
def test_direct_decode_on_presets(name):
    """The direct decode path (no alignment, GEMM2 with the top-k sum) against the reference and
    the aligned path at decode sizes, eagerly and replayed from a CUDA graph."""
    from fusedmoe.backends.triton.experts import triton_experts

    p = PRESETS[name]
    inter = p.intermediate_size // p.bench_tp
    for tokens in (1, 4, 16):
        x, w13, w2, b13, b2, w, ids = make(tokens, p.num_experts, p.top_k, p.hidden_size, inter, torch.bfloat16,
                                           act=p.activation, bias=p.has_bias, seed=tokens,
                                           on_input=p.apply_router_weight_on_input)
        args = (x, w13, w2, w, ids, b13, b2, None, p.num_experts, p.activation, p.apply_router_weight_on_input,
                1.702, None)
        poison_allocator()
        out = triton_experts(*args, direct=True)
        ref = ref_of(x, w13, w2, b13, b2, w, ids, activation=p.activation,
                     apply_router_weight_on_input=p.apply_router_weight_on_input)
        close(out, ref, TOL[torch.bfloat16])
        close(out, triton_experts(*args, direct=False), TOL[torch.bfloat16])
        assert torch.equal(replayed(lambda: triton_experts(*args, direct=True)), out)  # noqa: B023


def test_direct_decode_expert_map_out_of_range_and_split_k():
    from fusedmoe.backends.triton.experts import triton_experts
    from fusedmoe.backends.triton.tiles import TileConfig

    E, K, H, I = 16, 4, 1024, 320
    x, w13, w2, b13, b2, w, _ = make(3, E, K, H, I, torch.bfloat16, bias=True, seed=21)
    ids = torch.tensor([[0, 3, 5, 15], [2, -1, 16, 7], [99, -3, 40, 17]], device="cuda", dtype=torch.int32)
    expert_map = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    expert_map[::2] = torch.arange(E // 2, dtype=torch.int32, device="cuda")
    local = expert_map >= 0
    for tiles in (None, (TileConfig(16, 32, 128, 4, 3, 4), TileConfig(16, 32, 128, 4, 3))):
        out = triton_experts(x, w13[local], w2[local], w, ids, b13[local], b2[local], expert_map, E, "silu", False,
                             1.702, None, tiles=tiles, direct=True)
        ref = fused_experts_ref(x.float(), w13[local].float(), w2[local].float(), w, ids, expert_map_E=expert_map,
                                global_num_experts=E, w13_bias_LG=b13[local].float(), w2_bias_LH=b2[local].float())
        close(out[:2], ref[:2], TOL[torch.bfloat16])
        assert (out[2] == 0).all()  # no slot of token 2 is local and in range


@pytest.mark.parametrize("path", ["aligned", "direct", "batched"])
def test_expert_map_entry_past_the_local_experts_is_never_read(path):
    """validate=False (the GPU default): an expert_map entry past the local experts drops its
    slots in the alignment, the direct GEMMs and the batched dispatch, instead of reading w13 /
    w2 past their last expert (an illegal address before)."""
    from fusedmoe.backends.triton.experts import triton_experts

    E, L, K, H, I = 16, 8, 4, 512, 256
    x, w13, w2, _, _, w, ids = make(24 if path != "direct" else 2, E, K, H, I, torch.bfloat16, seed=23)
    expert_map = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    expert_map[::2] = torch.arange(L, dtype=torch.int32, device="cuda")
    bad_map = expert_map.clone()
    bad_map[4] = L + 1000  # past the local experts by far
    ids[:, 0] = 4
    w13l, w2l = w13[::2].contiguous(), w2[::2].contiguous()
    want = fused_experts_ref(x.float(), w13l.float(), w2l.float(), w, ids,
                             expert_map_E=torch.where(bad_map >= L, -1, bad_map), global_num_experts=E)
    poison_allocator()
    if path == "batched":
        # the batched backend takes no expert_map (the oracle refuses it): its dispatch applies it
        from fusedmoe.backends.triton.experts import BatchedTritonExperts
        from fusedmoe.modular import ExpertWeights, make_modular

        config = MoEConfig(E, K, H, I, dtype=torch.bfloat16, activation_format="batched")
        out = make_modular(config, BatchedTritonExperts(config))(x, ExpertWeights(w13l, w2l), w, ids,
                                                                 expert_map_E=bad_map)
    else:
        out = triton_experts(x, w13l, w2l, w, ids, None, None, bad_map, E, "silu", False, 1.702, None,
                             direct=path == "direct")
    torch.cuda.synchronize()
    close(out, want, TOL[torch.bfloat16])


@pytest.mark.parametrize("n,experts", [(1, 8), (100, 128), (129, 128), (1000, 256), (1024, 60), (3000, 4096),
                                       (8192, 256), (65536, 128), (200_000, 256)])
@pytest.mark.parametrize("use_map", [False, True], ids=["no-map", "map"])
def test_alignments_equal_the_torch_sort(n, experts, use_map):
    """Every Triton alignment (compiled, also where `align` routes elsewhere) against align_torch, bit
    for bit: stable order, padding, dropped ids (-1, E), a run of one expert across chunks and an
    expert_map that drops every third expert."""
    from fusedmoe.backends.triton import experts as ex

    gen = torch.Generator(device="cuda").manual_seed(n + experts)
    ids = torch.randint(0, experts, (n,), device="cuda", generator=gen, dtype=torch.int32)
    ids[: n // 3] = ids[0]  # a long run of one expert across chunks
    ids[::97] = -1
    ids[5::101] = experts
    emap, num_local = None, experts
    if use_map:
        owned = torch.arange(experts, device="cuda") % 3 != 1
        emap = torch.where(owned, owned.cumsum(0) - 1, -1).int()
        num_local = int(owned.sum())
    paths = {"multi": ex._align_multi}
    if n <= 8192:
        paths["chunked"] = ex._align_chunked
    if n <= ex.ALIGN_SMALL_MAX_SLOTS:
        paths["small"] = ex._align_small
    for block_m in (16, 64):
        want = ex.align_torch(ids, emap, experts, num_local, block_m)
        routed = ex.align(ids, emap, experts, num_local, block_m)
        for name, fn in {**paths, "routed": lambda *a, r=routed: r}.items():
            got = fn(ids, emap, experts, num_local, block_m)
            torch.cuda.synchronize()
            for what, a, b in zip(("sorted_slot", "block_expert", "num_rows", "slot_ok"), got, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (name, block_m, what)


@pytest.mark.parametrize("quant", [None, "mxfp4_w4a16"])
def test_tune_compile_pool_workers_compile_every_tile(quant):
    """`fusedmoe tune --jobs`: the CompilePool's workers (spawned processes on this GPU) run
    every tile the search hands them that the tuner runs itself, and the search finds what it finds
    without them (a cost model times the tiles, so the two searches are comparable; both paths
    at one token, the aligned one at 40)."""
    from fusedmoe.tune import CompilePool, tune_shape

    costs = {"gemm1": lambda t: 30.0 - t.block_n / 16, "gemm2": lambda t: 30.0 - t.block_k / 16,
             "align": lambda t: 5.0, "direct gemm1": lambda t: 20.0 - t.block_n / 16,
             "direct gemm2": lambda t: 20.0 - t.num_stages,
             "call": lambda plan: 0.0}  # the whole calls run (on the GPU) and confirm the search

    failures = []

    def timer(kind, tile, fn):
        try:
            fn(0)  # the tuner's own launch (compiled here, or found in Triton's cache)
        except Exception:
            failures.append((kind, tile))
            raise
        return costs[kind](tile)

    shape = dict(experts=8, hidden=256, inter=128, top_k=2, quant=quant)
    with CompilePool(2, **shape) as pool:  # first: its workers compile into a cold cache
        pooled = tune_shape(**shape, tokens_list=[1], copies=2, timer=timer, compile_pool=pool)
    # a worker fails only on a tile the tuner cannot run either (out of shared memory, say)
    assert len(pool.errors) <= len(failures), pool.errors
    assert pooled == tune_shape(**shape, tokens_list=[1], copies=2, timer=timer) and pooled
