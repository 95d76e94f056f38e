"""TMA descriptor loads of the Triton GEMMs: the eligibility predicate and the tile rule on the CPU,
the descriptor path itself under the Triton interpreter (FUSEDMOE_TRITON_TMA=force, fp16), and
the sm90 compile of both kernels (bulk tensor loads + wgmma in the PTX) where Triton's CUDA
backend is installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cases import Case, assert_close_rel, make_inputs  # noqa: E402
from fusedmoe import MoEConfig, fused_experts_ref, knobs  # noqa: E402
from fusedmoe.backends.triton import experts  # noqa: E402
from fusedmoe.backends.triton.experts import GemmProblem, tma_planned, tma_reasons  # noqa: E402
from fusedmoe.backends.triton.tiles import TileConfig, check_tile, heuristic  # noqa: E402
from fusedmoe.quant.scheme import get_scheme  # noqa: E402

interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (CPU tensors)")
TILE = TileConfig(64, 32, 32, 4, 2)  # the smallest BLOCK_M on descriptors; 32-wide N and K tails


# The predicate ---------------------------------------------------------------------------------
def _w(L=3, rows=80, K=64, dtype=torch.float16):
    return torch.zeros(L, rows, K, dtype=dtype)


REASONS = [
    # id, knob, tile, w, w_rows, a, quant_args, (A reason, W reason) as regexes (None: descriptor)
    ("eligible", "force", TILE, _w(), 80, torch.zeros(256, 64, dtype=torch.float16), None, (None, None)),
    ("gemm1-rows-gathered", "force", TILE, _w(), 80, None, None, ("gathered by token", None)),
    ("knob-off", False, TILE, _w(), 80, None, None, ("TRITON_TMA=0",) * 2),
    ("cpu-by-default", None, TILE, _w(), 80, None, None, ("cpu tensors: TMA is a CUDA sm90",) * 2),
    ("weight-only", "force", TILE, _w(dtype=torch.int8), 80, None, {"QUANT": 4}, ("weight-only .*QUANT=4",) * 2),
    # W8A8 codes (kernels.Q_CHANNEL / Q_BLOCK): int8 and e4m3 operands, rows of one byte an element
    ("w8a8-int8", "force", TILE, _w(dtype=torch.int8), 80, torch.zeros(256, 64, dtype=torch.int8), {"QUANT": 2},
     (None, None)),
    ("w8a8-fp8", "force", TILE, _w(dtype=torch.float8_e4m3fn), 80, torch.zeros(256, 64, dtype=torch.float8_e4m3fn),
     {"QUANT": 3}, (None, None)),
    ("w8a8-rows-of-40-bytes", "force", TILE, _w(K=40, dtype=torch.int8), 80, torch.zeros(256, 40, dtype=torch.int8),
     {"QUANT": 2}, ("row stride 40 x 1 B = 40 B",) * 2),
    ("w8a8-uint8", "force", TILE, _w(dtype=torch.uint8), 80, None, {"QUANT": 2}, ("gathered", "dtype torch.uint8")),
    ("split-k", "force", TileConfig(64, 32, 32, 4, 2, 2), _w(), 80, None, None, ("split_k=2",) * 2),
    ("decode-tile", "force", TileConfig(32, 32, 32), _w(), 80, None, None, ("block_m=32 < 64",) * 2),
    ("fp32", "force", TILE, _w(dtype=torch.float32), 80, None, None, ("gathered", "dtype torch.float32")),
    ("odd-k", "force", TILE, _w(K=37), 80, torch.zeros(256, 37, dtype=torch.float16), None,
     ("row stride 37 x 2 B = 74 B",) * 2),
    ("k-last-not-contiguous", "force", TILE, _w(K=80, rows=64).transpose(1, 2), 80, None, None,
     ("gathered", "last dim not contiguous")),
    ("experts-not-one-run", "force", TILE, _w(rows=96)[:, :80], 80, None, None,
     ("gathered", "not one evenly strided run of rows")),
    ("misaligned-base", "force", TILE, torch.zeros(3 * 80 * 64 + 1, dtype=torch.float16)[1:].view(3, 80, 64),
     80, None, None, ("gathered", "base address .* not 16-byte aligned")),
    ("box-too-wide", "force", TileConfig(64, 512, 32), _w(), 80, None, None,
     ("gathered", r"box \[512, 32\] outside")),
    ("box-inner-8-bytes", "force", TileConfig(64, 32, 4), _w(), 80, None, None, ("gathered", r"box \[32, 4\]")),
    ("rows-per-expert", "force", TILE, _w(), 40, None, None, ("gathered", r"not \[L, 40, K\]")),
]


@pytest.mark.parametrize("case", REASONS, ids=[c[0] for c in REASONS])
def test_tma_reasons(case):
    _, knob, tile, w, w_rows, a, quant_args, want = case
    with knobs.override(TRITON_TMA=knob):
        got = tma_reasons(tile, w, w_rows, a, quant_args)
    for reason, pattern in zip(got, want, strict=True):
        if pattern is None:
            assert reason is None
        else:
            assert reason is not None and re.search(pattern, reason), (reason, pattern)


def test_tma_device_rule(monkeypatch):
    """CUDA devices: sm90+ only, unless forced; FUSEDMOE_TRITON_TMA parses 0/1/force."""
    monkeypatch.setattr(experts, "device_capability", lambda index: (8, 0))
    monkeypatch.setattr(experts, "_sm90", lambda index: False)
    assert "compute capability (8, 0) < (9, 0)" in experts._tma_device_reason(torch.device("cuda", 0))
    with knobs.override(TRITON_TMA="force"):
        assert experts._tma_device_reason(torch.device("cuda", 0)) is None
    monkeypatch.setattr(experts, "_sm90", lambda index: True)
    assert experts._tma_device_reason(torch.device("cuda", 0)) is None
    for raw, value in (("0", False), ("off", False), ("1", True), ("Force", "force"), ("", None)):
        monkeypatch.setenv("FUSEDMOE_TRITON_TMA", raw)
        assert knobs.get("TRITON_TMA") == value
    monkeypatch.setenv("FUSEDMOE_TRITON_TMA", "maybe")
    with pytest.raises(ValueError, match="FUSEDMOE_TRITON_TMA='maybe'.*'force'"):
        knobs.get("TRITON_TMA")


def test_tma_planned_follows_the_predicate():
    qwen3 = GemmProblem(32768, 128, 2048, 768, 8, True, torch.bfloat16)
    cpu = torch.device("cpu")
    assert tma_planned(qwen3, cpu) == (None, None)
    with knobs.override(TRITON_TMA="force"):
        assert tma_planned(qwen3, cpu) == ("w", "a+w")
        odd = GemmProblem(32768, 128, 2048, 769, 8, True, torch.bfloat16)
        assert tma_planned(odd, cpu) == ("w", None)  # a / w2 rows of 1538 B
        assert tma_planned(GemmProblem(32768, 128, 2048, 768, 8, True, torch.float32), cpu) == (None, None)
        # W8A8: one-byte codes (I = 776: bf16 rows of 1552 B, code rows of 776 B)
        int8, w4 = get_scheme("int8_w8a8"), get_scheme("int4_w4a16_g32")
        assert tma_planned(qwen3, cpu, int8) == ("w", "a+w")
        odd8 = GemmProblem(32768, 128, 2048, 776, 8, True, torch.bfloat16)
        assert tma_planned(odd8, cpu) == ("w", "a+w") and tma_planned(odd8, cpu, int8) == ("w", None)
        assert tma_planned(qwen3, cpu, w4) == (None, None)  # weight-only: pointer loads
    with knobs.override(TRITON_TMA=False):
        assert tma_planned(qwen3, cpu) == (None, None)


# The tile rule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,args,tma,want", [
    # M=4096 (benchmarks/bench_tma_gemm.py cells): gemm1 weights only, gemm2 sorted rows + weights
    ("qwen3-gemm1", (32768, 128, 768, 2048, True), "w", TileConfig(128, 64, 64, 8, 3)),
    ("qwen3-gemm2", (32768, 128, 2048, 768, False), "a+w", TileConfig(128, 128, 64, 8, 3)),
    ("deepseek-gemm2", (32768, 256, 7168, 256, False), "a+w", TileConfig(128, 128, 64, 8, 3)),
    ("mixtral-gemm1", (8192, 8, 14336, 4096, True), "w", TileConfig(128, 64, 64, 8, 3)),
    ("mixtral-gemm2", (8192, 8, 4096, 14336, False), "a+w", TileConfig(128, 128, 64, 4, 4)),
    ("mixtral-gemm2-m2048", (4096, 8, 4096, 14336, False), "a+w", TileConfig(128, 128, 64, 8, 3)),
    # pointer loads and the other tiles: as before
    ("qwen3-gemm2-pointers", (32768, 128, 2048, 768, False), None, TileConfig(128, 128, 64, 8, 4)),
    ("qwen3-gemm1-pointers", (32768, 128, 768, 2048, True), None, TileConfig(128, 64, 64, 4, 4)),
    ("block-m-64", (8192, 128, 2048, 768, False), "a+w", TileConfig(64, 128, 64, 4, 4)),
    ("decode", (8, 128, 2048, 768, False), "a+w", heuristic(8, 128, 2048, 768, torch.bfloat16, gated=False)),
])
def test_heuristic_tiles_for_descriptors(name, args, tma, want):
    slots, experts_, n, k, gated = args
    tile = heuristic(slots, experts_, n, k, torch.bfloat16, gated=gated, tma=tma)
    assert tile == want
    assert check_tile(tile, dtype=torch.bfloat16, operands=2 if gated else 1, allow_split=gated) is None


def test_heuristic_rejects_unknown_tma():
    with pytest.raises(ValueError, match=r"tma='a' must be None or one of \('w', 'a\+w'\)"):
        heuristic(32768, 128, 768, 2048, torch.bfloat16, gated=True, tma="a")


# The descriptor path under the interpreter ----------------------------------------------------------
ALL = ("w13", "a", "w2")
BASE = Case(num_tokens=12, num_experts=5, top_k=2, hidden=72, intermediate=40, dtype=torch.float16)
# H = 72: gemm1's last K step past H (zero fill), gemm2's last H tile into the next expert's rows;
# I = 40: gemm1's last N tile (gate into up rows, up into the next expert), gemm2's K tail.
TMA_CASES = [
    (BASE, ALL),
    (BASE.replace(intermediate=37), ("w13",)),  # odd I: a / w2 rows of 74 B stay on pointers
    (BASE.replace(routing="empty_expert", has_bias=True), ALL),
    (BASE.replace(num_experts=7, top_k=3, activation="gelu", has_bias=True), ALL),
    (BASE.replace(activation="relu2_no_mul", has_bias=True), ALL),
    (BASE.replace(top_k=1, activation="silu_no_mul", apply_router_weight_on_input=True), ALL),
    (BASE.replace(activation="swigluoai", expert_map="missing"), ALL),
]


def _spy_descriptors(monkeypatch, names: dict[int, str]) -> list[str]:
    """Record which operands the launchers build descriptors for (by the tensors' ids)."""
    built, real = [], experts._descriptor

    def spy(t, block):
        built.append(names.get(id(t), "a"))
        return real(t, block)

    monkeypatch.setattr(experts, "_descriptor", spy)
    return built


def _reference(inp):
    wide = inp.to(torch.float64)
    return fused_experts_ref(wide.x, wide.w13, wide.w2, inp.topk_weights, inp.topk_ids, **wide.ref_kwargs)


@interpreter
@pytest.mark.parametrize("case,operands", TMA_CASES, ids=[c.id for c, _ in TMA_CASES])
def test_descriptor_path_matches_reference(monkeypatch, case, operands):
    """Forced descriptors: within fp16 tolerance of fused_experts_ref, and bit-equal to pointer
    loads (the same products; only padding rows of gemm2's A differ, and they are never stored)."""
    inp = make_inputs(case)
    built = _spy_descriptors(monkeypatch, {id(inp.w13): "w13", id(inp.w2): "w2"})
    args = (inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, inp.w13_bias, inp.w2_bias,
            inp.expert_map, case.num_experts, case.activation, case.apply_router_weight_on_input,
            case.swiglu_alpha, case.swiglu_limit)
    outs = {}
    for mode in ("force", False):
        with knobs.override(TRITON_TMA=mode):
            outs[mode] = experts.triton_experts(*args, tiles=(TILE, TILE))
    assert sorted(built) == sorted(operands)
    assert_close_rel(outs["force"], _reference(inp), case.dtype, what="descriptors")
    assert torch.equal(outs["force"], outs[False])


@interpreter
def test_descriptor_path_batched_layout(monkeypatch):
    """The batched layout (aligned rows of every expert's buffer, an empty expert) through
    dispatch -> descriptors -> combine, against fused_experts_ref."""
    from fusedmoe.backends.triton.experts import BatchedTritonExperts
    from fusedmoe.modular import ExpertWeights, make_modular

    case = BASE.replace(num_tokens=20, routing="empty_expert", has_bias=True)
    inp = make_inputs(case)
    built = _spy_descriptors(monkeypatch, {id(inp.w13): "w13", id(inp.w2): "w2"})
    monkeypatch.setattr(experts, "choose_tiles", lambda problem, device: (TILE, TILE))
    config = MoEConfig(case.num_experts, case.top_k, case.hidden, case.intermediate, dtype=case.dtype,
                       has_bias=True, activation_format="batched")
    kernel = make_modular(config, BatchedTritonExperts(config))
    weights = ExpertWeights(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias)
    with knobs.override(TRITON_TMA="force"):
        out = kernel(inp.x, weights, inp.topk_weights, inp.topk_ids)
    assert sorted(built) == sorted(ALL)
    assert_close_rel(out, _reference(inp), case.dtype, what="batched descriptors")


# W8A8 codes through descriptors (kernels.Q_CHANNEL / Q_BLOCK) ------------------------------------
CODE_TILE = ((64, 32, 32, 4, 1), (64, 32, 32, 4, 1))
BLOCK_TILE = ((64, 128, 128, 4, 1), (64, 128, 128, 4, 1))  # one fp8 weight-scale block per K step and N tile
W8A8_CASES = [
    # H = 80: gemm1's last K step 16 wide (zero fill), gemm2's last H tile into the next expert's
    # rows; I = 48: gemm1's last N tile (gate into up rows), gemm2's K tail; E = 5, biases
    ("int8", "int8_w8a8", dict(T=20, E=5, K=2, H=80, I=48, bias=True, tiles=CODE_TILE)),
    ("int8-map-input", "int8_w8a8", dict(T=12, E=6, K=1, H=64, I=64, on_input=True, expert_map=True,
                                        tiles=CODE_TILE)),
    ("fp8-channel", "fp8_w8a8_channel", dict(T=20, E=5, K=2, H=80, I=48, bias=True, tiles=CODE_TILE)),
    ("fp8-tensor", "fp8_w8a8_tensor", dict(T=20, E=5, K=2, H=80, I=48, tiles=CODE_TILE)),
    # fp8 block: I = 160, a second N tile of 32 live columns (the up rows' scales straddle) and a
    # 32-wide second K step in gemm2
    ("fp8-block", "fp8_w8a8_block", dict(T=20, E=5, K=2, H=256, I=160, bias=True, tiles=BLOCK_TILE)),
]


@interpreter
@pytest.mark.parametrize("name,scheme,shape", W8A8_CASES, ids=[c[0] for c in W8A8_CASES])
def test_w8a8_descriptor_path_matches_pointer_loads(monkeypatch, name, scheme, shape):
    """Forced descriptors over W8A8 codes (w13, w2 and gemm2's sorted code rows): bit for bit the
    pointer loads' output (the same codes reach the same MMAs; padding rows are never stored),
    and the emulation backend's up to a flipped code of the dynamically quantized intermediate."""
    from fusedmoe.backends.emulation import EmulationExperts
    from quant_problems import Case as QCase
    from quant_problems import assert_close_up_to_code_flips, problem, run

    config, x, w, weights, ids, expert_map = problem(QCase(name, **shape), scheme, torch.float32)
    built = _spy_descriptors(monkeypatch, {id(w.w13): "w13", id(w.w2): "w2"})
    outs = {}
    for mode in ("force", False):
        with knobs.override(TRITON_TMA=mode, TRITON_GEMM2_ROWS=False):
            outs[mode] = run(config, x, w, weights, ids, expert_map, shape["tiles"], direct=False)
    assert sorted(built) == sorted(ALL)
    assert torch.equal(outs["force"], outs[False])
    emulated = EmulationExperts(config).apply(x, w, weights, ids, expert_map_E=expert_map)
    assert_close_up_to_code_flips(outs["force"], emulated)


# The sm90 compile ------------------------------------------------------------------------------
def test_sm90_ptx_has_bulk_tensor_loads_and_wgmma():
    """Both kernels with their descriptor switches on compile for sm90 to TMA loads and wgmma
    (tests/tma_compile.py, in a process without the interpreter)."""
    root = Path(__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root / "src"), env.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, str(root / "tests" / "tma_compile.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    if "unavailable" in result:
        pytest.skip(f"no sm90 compile here: {result['unavailable']}")
    assert result == {
        "moe_gemm1_kernel": {"bulk_tensor": True, "wgmma": True, "a_desc": False, "w_desc": True},
        "moe_gemm2_kernel": {"bulk_tensor": True, "wgmma": True, "a_desc": True, "w_desc": True},
    }
