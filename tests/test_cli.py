"""The command line: explain (table and JSON, described platforms), demo on the CPU, env, errors."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedmoe.cli import main, source_digest


def test_explain_preset_on_described_platform(capsys):
    rc = main(["explain", "--model", "deepseek-v3", "--quant", "fp8_w8a8_block", "--platform", "cuda:9.0",
               "--packages", "deep_gemm"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("FP8 MoE on cuda sm90 +deep_gemm, tp=8 (standard layout): chosen deepgemm (via auto)")
    assert "flashinfer_cutlass" in out and "the flashinfer package is not installed" in out


@pytest.mark.parametrize("argv, line", [
    (["--model", "deepseek-v3", "--platform", "cuda:9.0"],
     "routing: one Triton launch (moe_routing_kernel); torch.compile traces keep the torch ops"),
    (["--model", "deepseek-v3", "--platform", "rocm:9.4"], "routing: one Triton launch (moe_routing_kernel)"),
    (["--model", "qwen3-30b-a3b", "--platform", "cpu"], "routing: the torch ops (cpu tensors)"),
    (["--experts", "2048", "--hidden", "64", "--intermediate", "32", "--top-k", "4", "--platform", "cuda:9.0"],
     "routing: the torch ops (E=2048 > 1024 (one token's scores in one program))"),
])
def test_explain_says_how_the_layer_routes(argv, line, capsys, monkeypatch):
    """explain names the routing path select_experts takes there (the preset's grouping included)."""
    main(["explain", *argv])
    assert line in capsys.readouterr().out
    monkeypatch.setenv("FUSEDMOE_TRITON_ROUTING", "0")
    main(["explain", "--model", "deepseek-v3", "--platform", "cuda:9.0", "--json"])
    assert json.loads(capsys.readouterr().out)["routing"] == "routing: the torch ops (FUSEDMOE_TRITON_ROUTING=0)"


def test_explain_reads_a_checkpoint_config(tmp_path, capsys):
    """--checkpoint-config: the experts' scheme from a checkpoint's config.json (GPTQ here), then the
    oracle on it; JSON names it; a format fusedmoe cannot run, a missing file, or --quant beside it
    exits 2 with the reason."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}}))
    argv = ["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--checkpoint-config", str(config)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {config}: its experts load as quant='int4_w4a16_g128', prequantized=True" in out
    assert "Int4 MoE on cuda sm90: chosen triton" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint_scheme"] == "int4_w4a16_g128"
    awq = tmp_path / "awq.json"
    awq.write_text(json.dumps({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}))
    for bad, why in (([str(awq)], "awq: version='gemv'"),
                     ([str(tmp_path / "none.json")], "No such file or directory"),
                     ([str(config), "--quant", "fp8_w8a8_block"], "give --quant or --checkpoint-config, not both")):
        assert main(["explain", "--model", "qwen3-30b-a3b", "--checkpoint-config", *bad]) == 2
        assert why in capsys.readouterr().err


def test_explain_every_scheme(capsys):
    """`fusedmoe explain --quant S` for every scheme: on Hopper (no vendor packages) our Triton
    kernels, marlin for NVFP4 W4A4 and MXFP4 W4A8 (weight-only execution, the seeds' Marlin rows,
    with the note saying so); off-GPU the emulation."""
    from fusedmoe.quant.scheme import SCHEMES

    for scheme in SCHEMES:
        for platform, want in (("cuda:9.0", "marlin" if scheme in ("nvfp4", "mxfp4_w4a8") else "triton"),
                               ("cpu", "emulation")):
            assert main(["explain", "--model", "qwen3-30b-a3b", "--quant", scheme, "--platform", platform,
                         "--json"]) == 0, (scheme, platform)
            data = json.loads(capsys.readouterr().out)
            assert data["chosen"] == want, (scheme, platform, data["chosen"])
    assert main(["explain", "--model", "qwen3-30b-a3b", "--quant", "nvfp4", "--platform", "cuda:9.0"]) == 0
    assert "weight-only" in capsys.readouterr().out


def test_explain_json_with_parallel_config(capsys):
    rc = main(["explain", "--experts", "64", "--hidden", "2048", "--intermediate", "1408", "--top-k", "6",
               "--ep", "2", "--dp", "2", "--platform", "cuda:9.0", "--packages", "flashinfer", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["chosen"] == "triton"
    assert data["config"]["parallel"]["ep_size"] == 2 and data["config"]["parallel"]["dp_size"] == 2
    verdicts = {v["name"]: v for v in data["verdicts"]}
    assert "not available with data parallelism" in verdicts["flashinfer_cutlass"]["reason"]


def test_explain_shows_the_split_and_batched_dispatch(capsys):
    rc = main(["explain", "--model", "qwen3-30b-a3b", "--ep", "4", "--dp", "2", "--dispatch",
               "alltoall_batched", "--platform", "cuda:9.0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("Unquantized MoE on cuda sm90, ep=4 dp=2 (alltoall_batched dispatch, batched layout): "
                          "chosen batched_triton (via auto)")
    rc = main(["explain", "--model", "qwen3-30b-a3b", "--ep", "2", "--platform", "cuda:9.0",
               "--packages", "flashinfer", "--json"])
    assert rc == 0
    env_cutlass = {v["name"]: v for v in json.loads(capsys.readouterr().out)["verdicts"]}["flashinfer_cutlass"]
    assert "opt-in" in env_cutlass["reason"]  # EP without DP: only the opt-in stands in its way


def test_explain_says_whether_the_ep_forward_captures_in_a_cuda_graph(capsys):
    """The dispatch decides: all-gather at a fixed capacity captures, the others read sizes back."""
    base = ["explain", "--model", "deepseek-v3", "--ep", "8", "--dp", "8", "--platform", "cuda:9.0"]
    assert main([*base, "--dispatch", "allgather", "--max-num-tokens", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "cuda graphs: capturable (allgather dispatch at a fixed capacity, max_num_tokens=128 a rank)"
    for dispatch, why in (("alltoall", "the alltoall dispatch exchanges its split sizes"),
                          ("allgather", "the all-gather exchanges its row counts")):
        assert main([*base, "--dispatch", dispatch, "--json"]) == 0
        note = json.loads(capsys.readouterr().out)["cuda_graphs"]
        assert note.startswith(f"not capturable: {why} through the host"), note
    assert main(["explain", "--model", "deepseek-v3", "--platform", "cuda:9.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cuda_graphs"] is None  # no EP: nothing to say


def test_explain_tokens_shows_the_triton_path_tiles_and_why(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the plan is for this machine's device
    rc = main(["explain", "--model", "deepseek-v3", "--platform", "cuda:9.0", "--tokens", "1,4,64"])
    out = capsys.readouterr().out
    assert rc == 0
    plan = out[out.index("triton plan on cpu (no GPU here"):]
    assert re.search(r"M=1 +direct: gemm1 .*\+ gemm2; gemm1 \[16, ", plan)
    assert "one token: always direct" in plan and "few slots, experts rarely repeated" in plan  # M=4
    assert re.search(r"M=64 +aligned: align \+ gemm1 .*\+ gemm2 \+ reduce", plan) and "why: 512 slots > 64" in plan
    # why the aligned path: each rule names its number; W8A8; the knob; marlin's weight-only twin
    rc = main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--tokens", "1,2", "--json"])
    plan = json.loads(capsys.readouterr().out)["triton_plan"]
    # one token: direct, GEMM2 spreading the 8 slots over 4 programs per tile (+ their combine)
    assert rc == 0 and plan[0]["path"] == "direct" and plan[0]["launches"] == "gemm1 + gemm2 + combine"
    assert plan[0]["gemm2"]["tile"][1] == 32 and plan[0]["gemm2"]["tile"][5] == 4
    assert plan[1]["path"] == "aligned" and plan[1]["gemm1"]["tile"][0] == 16
    assert plan[1]["why"] == "128 direct GEMM2 programs at 32-wide tiles < 1.2 x 132 SMs"
    main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", "fp8_w8a8_block",
          "--tokens", "1"])
    assert re.search(r"M=1 +direct: quantize x \+ gemm1 .*\+ quantize a \+ gemm2", capsys.readouterr().out)
    # per-token codes: the direct GEMM1 quantizes x itself, but where it reads > 128M weights (Mixtral)
    main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", "int8_w8a8", "--tokens", "1"])
    assert re.search(r"M=1 +direct: gemm1 \(quantizes x\) \+ gemm2 \(quantizes a\)", capsys.readouterr().out)
    main(["explain", "--model", "mixtral-8x7b", "--platform", "cuda:9.0", "--quant", "int8_w8a8", "--tokens", "1"])
    assert re.search(r"M=1 +direct: quantize x \+ gemm1 .*\+ quantize a \+ gemm2", capsys.readouterr().out)
    with monkeypatch.context() as m:  # SWAP_AB shows per GEMM (here forced: no sm90 GPU on this machine)
        m.setenv("FUSEDMOE_TRITON_SWAP_AB", "force")
        main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", "fp8_w8a8_block",
              "--tokens", "64", "--json"])
        swapped = json.loads(capsys.readouterr().out)["triton_plan"][0]
        assert swapped["gemm1"]["swap_ab"] and swapped["gemm2"]["swap_ab"]
        main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", "fp8_w8a8_block",
              "--tokens", "64"])
        assert "swapped: w^T @ a^T" in capsys.readouterr().out
    main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", "fp8_w8a8_block",
          "--tokens", "64", "--json"])
    assert not json.loads(capsys.readouterr().out)["triton_plan"][0]["gemm1"]["swap_ab"]  # the rule: CPU here
    with monkeypatch.context() as m:  # TMA descriptors (forced: no sm90 GPU here): W8A8 codes, not weight-only
        m.setenv("FUSEDMOE_TRITON_TMA", "force")
        for quant, want in (("int8_w8a8", ("w", "a+w")), ("fp8_w8a8_block", ("w", "a+w")),
                            ("int8_w8a16", (None, None))):
            main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", quant,
                  "--tokens", "4096", "--json"])
            plan = json.loads(capsys.readouterr().out)["triton_plan"][0]
            assert (plan["gemm1"]["tma"], plan["gemm2"]["tma"]) == want, (quant, plan)
        m.setenv("FUSEDMOE_TRITON_GEMM2_ROWS", "force")  # the row-stationary GEMM2 keeps its pointer loads
        main(["explain", "--model", "qwen3-235b-a22b", "--platform", "cuda:9.0", "--quant", "int8_w8a8",
              "--tokens", "4096", "--json"])
        plan = json.loads(capsys.readouterr().out)["triton_plan"][0]
        assert plan["gemm2"]["rows"] and (plan["gemm1"]["tma"], plan["gemm2"]["tma"]) == ("w", None), plan
    main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", "fp8_w8a8_tensor",
          "--tokens", "1"])
    out = capsys.readouterr().out
    assert re.search(r"M=1 +aligned: align \+ amax x \+ quantize x \+ gemm1 .*\+ quantize a \+ gemm2 \+ reduce", out)
    assert "why: fp8_w8a8_tensor quantizes with one scale per expert" in out
    assert "fp8 accumulator: chained: one accumulator across K" in out  # per-tensor / channel fp8 only
    with monkeypatch.context() as m:
        m.setenv("FUSEDMOE_FP8_ACCUMULATE", "promoted")
        main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", "fp8_w8a8_channel",
              "--tokens", "1,64", "--json"])
        plans = json.loads(capsys.readouterr().out)["triton_plan"]
        assert [p["fp8_accumulate"].split(":")[0] for p in plans] == ["promoted", "promoted"]
    for quant in ("fp8_w8a8_block", "int8_w8a8"):
        main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--quant", quant, "--tokens", "1"])
        assert "fp8 accumulator" not in capsys.readouterr().out
    monkeypatch.setenv("FUSEDMOE_TRITON_DIRECT", "0")
    main(["explain", "--model", "deepseek-v3", "--platform", "cuda:9.0", "--tokens", "1"])
    assert "why: FUSEDMOE_TRITON_DIRECT=0" in capsys.readouterr().out
    monkeypatch.setenv("FUSEDMOE_TRITON_DIRECT", "force")
    main(["explain", "--model", "mixtral-8x7b", "--platform", "cuda:9.0", "--quant", "nvfp4", "--tokens", "16"])
    out = capsys.readouterr().out
    assert "chosen marlin" in out and "M=16     direct" in out and "why: FUSEDMOE_TRITON_DIRECT=force" in out
    main(["explain", "--model", "deepseek-v3", "--tokens", "1"])  # the CPU backend: no Triton plan
    assert "triton plan: the chosen backend (cpu) does not run the contiguous Triton kernels" in capsys.readouterr().out
    assert main(["explain", "--model", "deepseek-v3", "--tokens", "1,x"]) == 2
    assert "--tokens '1,x': expected comma-separated integers" in capsys.readouterr().err


def test_explain_batch_invariant(capsys):
    """--batch-invariant: the triton rows serve it with one plan at every token count; a W8A8
    scheme has no backend, and the triton row says why."""
    rc = main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--packages", "triton",
               "--batch-invariant", "--tokens", "1,4096"])
    out = capsys.readouterr().out
    assert rc == 0 and "chosen triton" in out
    plans = [line for line in out.splitlines() if line.strip().startswith("M=")]
    assert len(plans) == 2 and all("aligned" in line and "batch-invariant" in line for line in plans)
    assert plans[0].split("aligned")[1] == plans[1].split("aligned")[1]  # the same tiles at M=1 and 4096
    rc = main(["explain", "--model", "qwen3-30b-a3b", "--platform", "cuda:9.0", "--packages", "triton",
               "--quant", "fp8_w8a8_block", "--batch-invariant", "--json"])
    verdicts = {v["name"]: v for v in json.loads(capsys.readouterr().out)["verdicts"]}
    assert rc == 1 and "not batch-invariant here" in verdicts["triton"]["reason"]


def test_explain_ep_not_dividing_experts(capsys):
    rc = main(["explain", "--model", "mixtral-8x7b", "--ep", "3"])
    assert rc == 2
    assert "num_experts=8 is not divisible by ep_size=3 (8 % 3 = 2)" in capsys.readouterr().err


def test_explain_nothing_qualifies_exits_1(capsys):
    rc = main(["explain", "--experts", "8", "--hidden", "256", "--intermediate", "128", "--top-k", "2",
               "--quant", "fp8_w8a8_block", "--platform", "cuda:7.0"])
    out = capsys.readouterr().out
    assert rc == 1 and "No FP8 MoE backend supports the deployment configuration" in out


def test_explain_bad_arguments(capsys):
    assert main(["explain", "--experts", "8"]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["explain", "--model", "gpt-9"]) == 2
    assert "unknown model preset 'gpt-9'" in capsys.readouterr().err
    assert main(["explain", "--model", "mixtral-8x7b", "--backend", "bogus", "--platform", "cpu"]) == 1
    assert "backend='bogus' is not supported" in capsys.readouterr().out


def test_demo_on_cpu(capsys):
    rc = main(["demo", "--model", "deepseek-v3", "--tokens", "8", "--scale", "16", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "backend      cpu (via auto)" in out and "(ok, tolerance" in out


def test_demo_list(capsys):
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-20b",
                 "gpt-oss-120b", "llama-4-maverick", "kimi-k2", "glm-4.5-air"):
        assert name in out


def test_env_json(capsys):
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["platform"]["kind"] in ("cpu", "cuda", "rocm", "xpu")
    assert "FUSEDMOE_BACKEND" in data["knobs"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_and_tune_need_a_gpu(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["tune", "--model", "qwen3-30b-a3b"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["tune", "--model", "qwen3-30b-a3b", "--quant", "fp8_w8a8_block"]) == 2
    assert "fusedmoe tune: error: fusedmoe tune times GPU kernels and needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["fp9", "fp8_w8a8_channel_static"])
def test_tune_quant_refuses_schemes_triton_does_not_run(capsys, scheme):
    assert main(["tune", "--model", "qwen3-30b-a3b", "--quant", scheme]) == 2
    err = capsys.readouterr().err
    assert f"fusedmoe tune: error: --quant '{scheme}': tune takes a scheme the triton backend runs (" in err
    assert "fp8_w8a8_block" in err and "mxfp4_w4a16" in err


def test_tune_bias_is_for_explicit_shapes(capsys):
    """--bias with --model is refused before any GPU check: the preset decides its biases."""
    assert main(["tune", "--model", "gpt-oss-120b", "--bias"]) == 2
    assert "--bias is for an explicit shape; --model gpt-oss-120b times its preset's biases (with them)" in \
        capsys.readouterr().err


def test_tune_refuses_a_bad_min_gain_and_search(capsys):
    """--min-gain is a fraction and --jobs at least 1, checked before any GPU check; --search
    names descent or grid."""
    assert main(["tune", "--model", "qwen3-30b-a3b", "--min-gain", "3"]) == 2
    assert "--min-gain 3.0: a fraction in [0, 1)" in capsys.readouterr().err
    assert main(["tune", "--model", "qwen3-30b-a3b", "--jobs", "0"]) == 2
    assert "--jobs 0: at least 1" in capsys.readouterr().err
    assert main(["tune", "--model", "qwen3-30b-a3b", "--seed", "-1"]) == 2
    assert "--seed -1 must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--model", "qwen3-30b-a3b", "--search", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_bench_quant_bytes_and_refusals(capsys):
    from fusedmoe.bench import quant_backend, quant_bytes

    assert quant_bytes(None) == (2.0, 2.0)
    assert quant_bytes("fp8_w8a8_channel") == (1.0, 1.0) == quant_bytes("int8_w8a8")
    assert quant_bytes("fp8_w8a8_block") == (1.0 + 4 / 16384, 1.0)
    assert quant_bytes("int4_w4a16_g32") == (0.5 + 2 / 32, 2.0)
    assert quant_bytes("mxfp4_w4a16") == (0.5 + 1 / 32, 2.0)
    assert quant_bytes("nvfp4_w4a16") == (0.5 + 1 / 16, 2.0)
    assert quant_bytes("fp8_w8a16") == (1.0, 2.0) == quant_bytes("int8_w8a16")
    # marlin's schemes: the weight-only bytes of their twins, timed on marlin
    assert quant_bytes("nvfp4") == quant_bytes("nvfp4_w4a16") and quant_bytes("mxfp4_w4a8") == quant_bytes("mxfp4_w4a16")
    assert quant_backend("nvfp4") == "marlin" == quant_backend("mxfp4_w4a8") and quant_backend("int4_w4a16_g32") == "triton"
    assert main(["bench", "--quant", "nvfp4"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["tune", "--model", "qwen3-30b-a3b", "--quant", "nvfp4"]) == 2
    out, err = capsys.readouterr()
    assert "marlin runs it weight-only; tuning nvfp4_w4a16" in out and "needs a CUDA device" in err
    assert main(["bench", "--quant", "fp9"]) == 2
    assert "not a known quantization scheme" in capsys.readouterr().err
    # a preset the scheme cannot quantize (gpt-oss: H = I = 2880 against g128) is left out and said,
    # before any GPU work; with nothing left, refused
    from fusedmoe.bench import preset_quant_reason
    from fusedmoe.presets import get_preset

    assert preset_quant_reason(get_preset("gpt-oss-120b"), "int4_w4a16_g128") == (
        "int4_w4a16_g128 has one scale per 128 inputs, but w13's K = 2880 is not a multiple of 128 (2880 % 128 = 64)")
    assert preset_quant_reason(get_preset("gpt-oss-120b"), "int4_w4a16_g32") is None
    assert preset_quant_reason(get_preset("mixtral-8x7b"), "int4_w4a16_g128") is None
    assert preset_quant_reason(get_preset("gpt-oss-120b"), None) is None
    assert main(["bench", "--quant", "int4_w4a16_g128", "--presets", "gpt-oss-120b,mixtral-8x7b"]) == 2
    err = capsys.readouterr().err
    assert "skipping gpt-oss-120b: int4_w4a16_g128 has one scale per 128 inputs" in err and "needs a CUDA device" in err
    assert main(["bench", "--quant", "int4_w4a16_g128", "--presets", "gpt-oss-120b,gpt-oss-20b"]) == 2
    assert "--quant int4_w4a16_g128 cannot quantize any preset asked for" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g32", "fp8_w8a8_tensor_static",
                                    "fp8_w8a8_block", "int8_w8a8"])
def test_bench_copies_are_quantize_weights(scheme):
    """bench._quantized_copy gives quantize_weights' payloads and scales (E = 19; quantize_weights
    bounds its temporaries itself, a chunk of experts at a time: tests/test_quant.py), the static
    activation scales once, int4's group scales in bf16."""
    import torch

    from fusedmoe.bench import _quantized_copy
    from fusedmoe.quant.weights import quantize_weights

    gen = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(19, 64, 128, generator=gen), torch.randn(19, 128, 32, generator=gen)
    q13, q2, _, _, params = _quantized_copy(w13, w2, None, None, scheme)
    amax = (torch.tensor(6.0), torch.tensor(10.0)) if scheme.endswith("_static") else None
    r13, r2, want = quantize_weights(w13, w2, scheme, activation_amax=amax)
    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731 (no CPU fp8 equal)
    assert torch.equal(bits(q13), bits(r13)) and torch.equal(bits(q2), bits(r2))
    for name in ("w13_scale", "w2_scale", "a13_scale", "a2_scale", "w13_global_scale", "w2_global_scale"):
        got, ref = getattr(params, name), getattr(want, name)
        assert (got is None) == (ref is None), name
        if got is not None:  # int4's group scales are stored bf16 (as bench counts their bytes)
            assert torch.equal(bits(got), bits(ref.to(got.dtype))), name


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "fusedmoe", "explain", "--model", "qwen3-30b-a3b",
                          "--platform", "cpu"], capture_output=True, text=True, check=True).stdout
    assert "chosen cpu" in out


def test_bench_check_cell_holds_outputs_to_their_schemes_bound():
    """`fusedmoe bench --check` (bench.check_cell): the relative error against the cell's reference
    and the fuzz's bound for the scheme; the table marks a mismatch and lists its reason, and
    `mismatched` (the exit status) counts it but not a row left unchecked."""
    import torch

    from fusedmoe import bench
    from fusedmoe.bench import Row, check_cell, format_table, mismatched

    cpu = torch.device("cpu")
    ref = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    close = (ref * (1 + 2**-9)).to(torch.bfloat16)  # ~1u of bf16: within the unquantized bound (4u)
    err, why = check_cell(close, ref, None, cpu)
    assert why is None and 1e-4 < err < 2**-8
    dropped = close.clone()
    dropped[5] = 0  # one token's row left unwritten
    err, why = check_cell(dropped, ref, None, cpu)
    assert err > 0.1 and why.startswith("relative error") and "tol 1.6e-02" in why
    # 1.8%: beyond bf16's unquantized bound (4u = 1.6e-2), within an activation-quantized scheme's (2e-2)
    three = (ref * 1.018).to(torch.bfloat16)
    assert check_cell(three, ref, None, cpu)[1] is not None
    assert check_cell(three, ref, "fp8_w8a8_block", cpu)[1] is None
    assert check_cell(three, ref, "mxfp4_w4a16", cpu)[1] is not None  # weight-only: bf16 activations' bound
    rows = [Row("p", "triton", 16, 8, 10.0, 1.0, 100.0, 50.0, "memory", rel_err=err, mismatch=why),
            Row("p", "marlin", 16, 8, 12.0, 1.0, 100.0, 40.0, "memory", rel_err=2e-3),
            Row("p", "torch", 16, 8, 90.0, 0.1, 10.0, 5.0, "memory", rel_err=1e-3)]
    table = format_table(rows, ())
    assert table.splitlines()[0].endswith("check")
    assert f"{err:.1e}!" in table and "1.0e-03" in table and "p triton M=16: relative error" in table
    assert mismatched(rows) == rows[:1]
    assert "check" not in format_table([dataclasses.replace(rows[2], rel_err=None)], ())
    assert bench.mismatched([rows[2]]) == []


def test_bench_check_repeats_a_deterministic_call_bit_for_bit():
    """`bench --check` (bench.repeat_mismatch): a deterministic backend's checked call must give
    its first output bit for bit over CHECK_RUNS runs; one run off in one element's last bit is a
    race, named by its run."""
    import torch

    from fusedmoe.backends import REGISTRY
    from fusedmoe.bench import CHECK_RUNS, repeat_mismatch

    first = torch.randn(8, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    runs = []

    def call(off_at=None):
        runs.append(1)
        out = first.clone()
        if len(runs) == off_at:
            out.view(torch.int16)[2, 3] ^= 1  # one ulp
        return out

    assert CHECK_RUNS >= 4 and repeat_mismatch(call, first) is None and len(runs) == CHECK_RUNS - 1
    runs.clear()
    why = repeat_mismatch(lambda: call(off_at=3), first)
    assert why == f"run 4 of {CHECK_RUNS} gave another output bitwise (1 of 8 rows differ): the backend is " \
        "deterministic, so a race", why
    assert REGISTRY["triton"].deterministic and REGISTRY["batched_triton"].deterministic


@pytest.mark.parametrize("quant", [None, "mxfp4_w4a16", "fp8_w8a8_block"], ids=str)
def test_bench_check_reference_is_the_float32_reference_or_emulation(quant):
    """bench._cell_reference on small CPU tensors: the float32 reference of the bf16 weights, or the
    emulation backend on the checkpoint-layout codes, each with the preset's activation and router
    weight placement (gpt-oss: swigluoai and biases); a backend's output holds to its bound."""
    import torch

    from fusedmoe.api import fused_experts
    from fusedmoe.bench import _cell_reference, _quantized_copy, check_cell, random_expert_weights
    from fusedmoe.presets import get_preset
    from fusedmoe.routing import select_experts

    preset, gen, cpu = get_preset("gpt-oss-120b"), torch.Generator().manual_seed(3), torch.device("cpu")
    w13, w2, b13, b2 = random_expert_weights(8, 128, 128, preset.activation, device=cpu, dtype=torch.bfloat16,
                                             generator=gen, bias=True)
    x = torch.randn(16, 128, generator=gen).to(torch.bfloat16)
    topk_w, topk_ids = select_experts(x, torch.randn(16, 8, generator=gen), 4)
    copy = (w13, w2, b13, b2) if quant is None else _quantized_copy(w13, w2, b13, b2, quant, prepare=False)
    ref = _cell_reference(preset, x, topk_w, topk_ids, copy)
    kw = dict(activation=preset.activation, w13_bias=b13, w2_bias=b2)
    if quant is None:
        assert ref.dtype == torch.float32
        err, why = check_cell(fused_experts(x, w13, w2, topk_w, topk_ids, backend="torch", **kw), ref, None, cpu)
        assert why is None and err < 2e-2, (err, why)
    else:  # emulation itself, on codes near the float weights (quantization error, not garbage)
        assert torch.equal(ref, fused_experts(x, copy[0], copy[1], topk_w, topk_ids, quant=copy[4],
                                              backend="emulation", **kw))
        float_ref = _cell_reference(preset, x, topk_w, topk_ids, (w13, w2, b13, b2))
        assert 1e-3 < check_cell(ref, float_ref, quant, cpu)[0] < 0.2
    assert ref.abs().max() > 0.1  # not a test on zeros


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4_w4a8"])
def test_bench_check_reference_of_a_weight_only_execution(quant):
    """`marlin` runs NVFP4 W4A4 / MXFP4 W4A8 weight-only; bench --check holds it to the emulation
    of the weight-only twin on the same codes (bench.weight_only_copy): the float32 reference on
    the dequantized weights, activations unquantized, which the W4A4 emulation is not."""
    import torch

    from fusedmoe.api import fused_experts
    from fusedmoe.bench import (
        _cell_reference,
        _quantized_copy,
        random_expert_weights,
        weight_only_copy,
    )
    from fusedmoe.presets import get_preset
    from fusedmoe.quant.weights import dequantize_weight
    from fusedmoe.reference import fused_experts_ref
    from fusedmoe.routing import select_experts

    preset, gen, cpu = get_preset("qwen3-30b-a3b"), torch.Generator().manual_seed(5), torch.device("cpu")
    w13, w2, b13, b2 = random_expert_weights(8, 128, 64, preset.activation, device=cpu, dtype=torch.bfloat16,
                                             generator=gen)
    x = torch.randn(16, 128, generator=gen).to(torch.bfloat16)
    topk_w, topk_ids = select_experts(x, torch.randn(16, 8, generator=gen), 4)
    copy = _quantized_copy(w13, w2, b13, b2, quant, prepare=False)
    twin = weight_only_copy(copy)
    assert twin[4].scheme.name == quant.split("_")[0] + "_w4a16" and twin[4].a13_scale is None
    assert twin[0] is copy[0] and twin[4].w13_scale is copy[4].w13_scale  # the same codes and scales
    ref = _cell_reference(preset, x, topk_w, topk_ids, twin)
    p = copy[4]
    d13 = dequantize_weight(copy[0], p.w13_scale, p.scheme, p.w13_global_scale)
    d2 = dequantize_weight(copy[1], p.w2_scale, p.scheme, p.w2_global_scale)
    by_hand = fused_experts_ref(x.float(), d13, d2, topk_w, topk_ids, activation=preset.activation)
    assert ((ref.float() - by_hand).norm() / by_hand.norm()).item() < 1e-2
    w4a4 = fused_experts(x, copy[0], copy[1], topk_w, topk_ids, quant=p, backend="emulation",
                         activation=preset.activation)
    assert ((w4a4.float() - by_hand).norm() / by_hand.norm()).item() > 2e-2  # activations rounded there
    assert ref.abs().max() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("quant,backends", [(None, "triton,batched_triton,torch"), ("mxfp4_w4a16", "triton"),
                                            ("fp8_w8a8_block", "triton"), ("nvfp4", "marlin")], ids=str)
def test_bench_check_on_the_gpu(tmp_path, quant, backends):
    """`fusedmoe bench --check` on a GPU: every timed output is checked against its reference and
    within its bound (rc 0), marlin's weight-only NVFP4 W4A4 against its weight-only twin's emulation."""
    _bench_check(tmp_path, "qwen3-30b-a3b", "1,64", quant, backends)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["int4_w4a16_g32", "int4_w4a16_g64", "int4_w4a16_g128", "int4_w4a16_g32_zp",
                                   "int4_w4a16_g128_zp", "mxfp4_w4a16", "nvfp4_w4a16"])
def test_bench_check_of_4bit_weights_at_mixtral_on_the_gpu(tmp_path, quant):
    """`fusedmoe bench --check` of each 4-bit weight-only scheme at Mixtral's shape (I = 14336:
    fragments for every one of them) on its packaged plans, M = 1 (direct), 16 and 256: the cells
    where a fragment decode that loaded int4 g64 / g128 scales once a row group computed wrong
    results (H200, Triton 3.6) while test_gpu_wo.py's smaller shapes passed."""
    _bench_check(tmp_path, "mixtral-8x7b", "1,16,256", quant, "triton")


def _bench_check(tmp_path, preset: str, tokens: str, quant: str | None, backends: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = tmp_path / "rows.json"
    argv = ["bench", "--presets", preset, "--tokens", tokens, "--backends", backends, "--check",
            "--json", str(path)] + (["--quant", quant] if quant else [])
    assert main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    cells = len(tokens.split(",")) * len(backends.split(","))
    assert len(rows) == cells and not any(r["error"] for r in rows), rows
    for r in rows:
        # 0 is a pass: fp8 block's one-token output has matched its emulation bit for bit (H200)
        assert r["mismatch"] is None and 0 <= r["rel_err"] < 2e-2, r
    for b in backends.split(","):  # the reference is not the timed kernel itself: some row differs
        assert any(r["rel_err"] > 0 for r in rows if r["backend"] == b), rows


def test_bench_check_is_for_one_device(capsys):
    assert main(["bench", "--check", "--ep", "2"]) == 2
    assert "--check is for the one-device benchmark" in capsys.readouterr().err


def test_bench_tp_splits_the_presets(capsys):
    """--tp N: each preset at that split of its intermediate size, renamed PRESET/tpN where the
    split is not its benchmark one; refused (before any GPU check) where N does not divide I, is
    below 1, or comes with --ep. --seed is refused likewise below 0 or with --ep."""
    from fusedmoe.cli import _split_presets
    from fusedmoe.presets import get_preset

    ds, mix = get_preset("deepseek-v3"), get_preset("mixtral-8x7b")
    one, same = _split_presets([ds, mix], 1)
    assert (one.name, one.bench_tp, one.intermediate_size // one.bench_tp) == ("deepseek-v3/tp1", 1, 2048)
    assert same is mix  # already its benchmark split
    assert _split_presets([ds], 8)[0] is ds
    assert main(["bench", "--presets", "mixtral-8x7b,deepseek-v3", "--tp", "3"]) == 2
    assert "--tp 3 does not divide the intermediate size of mixtral-8x7b (I = 14336), deepseek-v3 (I = 2048)" \
        in capsys.readouterr().err
    assert main(["bench", "--tp", "0"]) == 2
    assert "--tp 0 must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--tp", "2", "--ep", "2"]) == 2
    assert "--tp is for the one-device benchmark" in capsys.readouterr().err
    assert main(["bench", "--seed", "-1"]) == 2
    assert "--seed -1 must be >= 0" in capsys.readouterr().err
    assert main(["bench", "--seed", "3", "--ep", "2"]) == 2
    assert "--seed is for the one-device benchmark" in capsys.readouterr().err


def test_bench_cell_inputs_do_not_depend_on_the_cells_before():
    """Each (seed, tokens) cell draws from its own generator: the same draws alone or after other
    cells, different draws for another token count or seed; one draw of tokens and routing per
    weight copy, each its own."""
    from fusedmoe.bench import cell_draws, cell_generator
    from fusedmoe.presets import get_preset

    def draw(seed, tokens):
        return torch.randn(tokens, 8, generator=cell_generator(seed, tokens, "cpu"))

    alone = draw(0, 256)
    for before in (1, 16, 1024):
        draw(0, before)
        assert torch.equal(draw(0, 256), alone)
    assert not torch.equal(draw(0, 255)[:255], alone[:255])
    assert not torch.equal(draw(1, 256), alone)

    mix = get_preset("mixtral-8x7b")
    draws = cell_draws(mix, 64, 4, 0, "cpu", torch.bfloat16)
    cell_draws(mix, 16, 4, 0, "cpu", torch.bfloat16)
    again = cell_draws(mix, 64, 4, 0, "cpu", torch.bfloat16)
    assert len(draws) == 4
    for (x, logits, w, ids), (x2, logits2, w2, ids2) in zip(draws, again, strict=True):
        assert torch.equal(logits, logits2) and torch.equal(w, w2)
        assert x.shape == (64, mix.hidden_size) and x.dtype == torch.bfloat16 and logits.shape == (64, 8)
        assert ids.shape == w.shape == (64, 2) and torch.equal(x, x2) and torch.equal(ids, ids2)
        assert torch.allclose(w.sum(-1), torch.ones(64))  # renormalised top-2
    assert len({tuple(d[3].flatten().tolist()) for d in draws}) == 4  # four routings
    ds = get_preset("deepseek-v3")  # --routing: the preset's grouped top-k on the same logits
    plain, routed = cell_draws(ds, 8, 1, 0, "cpu", torch.bfloat16)[0], \
        cell_draws(ds, 8, 1, 0, "cpu", torch.bfloat16, dict(ds.routing))[0]
    assert torch.equal(plain[1], routed[1]) and routed[3].shape == (8, ds.top_k)

def test_bench_check_and_time_reports_error_and_repeatability():
    import torch

    from fusedmoe.bench import check_and_time

    ref = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    us, err, same = check_and_time([lambda: ref * 1.01], ref, timed=False)
    assert us is None and abs(err - 0.01) < 1e-6 and same
    calls = iter([ref, ref + 1])  # two calls that differ: not repeatable
    assert check_and_time([lambda: next(calls)], ref, timed=False) == (None, 0.0, False)
    # poison: on around the two checked calls, off after them (a buffer the variant never writes
    # keeps its NaN, so the error shows it)
    state, seen = {"on": False}, []
    buf = ref.clone()

    def variant():
        seen.append(state["on"])
        return buf

    def poison(on):
        state["on"] = on
        if on:
            buf.fill_(float("nan"))

    us, err, same = check_and_time([variant], ref, timed=False, poison=poison)
    assert seen == [True, True] and not state["on"] and math.isnan(err)


def test_decode_cells_draw_weights_once_per_shape():
    import torch

    from fusedmoe.bench import decode_cells

    cells = list(decode_cells({"tiny": (6, 2, 16, 8, "silu", 2)}, [1, 3], torch.device("cpu"), torch.float32))
    assert [c.tokens for c in cells] == [1, 3] and len(cells[0].weights) == 2
    assert cells[0].weights is cells[1].weights and cells[1].topk_ids.shape == (3, 2)
    out = cells[1].library(True)[0]
    assert callable(out) and len(cells[1].per_copy(lambda *a: a[0])) == 2
    assert cells[0].tolerance == 2e-3


def test_balanced_ids_and_aligned_gemm2_cases():
    """balanced_ids: every expert T*k/E slots, distinct experts per token; aligned_gemm2_cases
    (the GEMM2 prototypes' harness, fp16 in the interpreter): the library's GEMM2 reproduces the
    case's ref, and check() catches a variant that leaves rows of y unwritten."""
    import torch

    from fusedmoe.backends.triton.tiles import TileConfig
    from fusedmoe.bench import aligned_gemm2_cases, balanced_ids

    ids = balanced_ids(12, 3, 6, torch.device("cpu"))
    assert torch.equal(torch.bincount(ids.flatten(), minlength=6), torch.full((6,), 6))
    assert all(len(set(row.tolist())) == 3 for row in ids)
    tiles = (TileConfig(16, 16, 32, 4, 1), TileConfig(16, 32, 16, 4, 1))
    cases = list(aligned_gemm2_cases({"tiny": (6, 2, 64, 48, "silu", 2)}, [24], torch.device("cpu"), torch.float16,
                                     tiles=tiles, balanced=True))
    (case,) = cases
    assert case.tokens == 24 and len(case.w2s) == 2 and case.flops == 2 * 24 * 2 * 64 * 48
    assert int(case.L.num_rows) == 6 * 16  # 8 slots per expert: one 16-row block each
    us, err, same = case.check(case.library(), timed=False)
    assert us is None and err == 0.0 and same
    _, err, _ = case.check(case.calls(lambda L, w: None), timed=False)  # writes nothing: y stays NaN
    assert math.isnan(err)


def test_bench_roofline_takes_the_8bit_ceiling_for_w8a8():
    from fusedmoe.bench import Ceilings, quant_operand, roofline
    from fusedmoe.presets import get_preset

    assert quant_operand(None) is None and quant_operand("mxfp4_w4a16") is None
    assert quant_operand("fp8_w8a16") is None  # weight-only: bf16 math
    assert quant_operand("fp8_w8a8_block") == "fp8" and quant_operand("int8_w8a8") == "int8"
    p = get_preset("mixtral-8x7b")
    ceil = Ceilings("test", bandwidth=4e12, bf16_flops=8e14, fp8_flops=1.6e15, int8_flops=1.5e15)
    _, flops, t_bf16, bound = roofline(p, 4096, 8, 14336, ceil)
    assert bound == "compute" and t_bf16 == flops / 8e14
    _, _, t_fp8, _ = roofline(p, 4096, 8, 14336, ceil, 1.0, 1.0, "fp8")
    assert t_fp8 == flops / 1.6e15
    unmeasured = Ceilings("test", bandwidth=4e12, bf16_flops=8e14)
    assert unmeasured.peak("int8") == 8e14  # no 8-bit rate measured: bf16's


def test_bench_ep_gloo_smoke(tmp_path, capsys):
    """fusedmoe bench --ep 2 on the CPU: two gloo ranks started by the command itself."""
    out = tmp_path / "ep.json"
    rc = main(["bench", "--ep", "2", "--device", "cpu", "--scale", "64", "--tokens", "0,5",
               "--presets", "qwen3-30b-a3b", "--iters", "2", "--dispatch", "allgather", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "qwen3-30b-a3b/64" in text and "allgather" in text
    data = json.loads(out.read_text())
    assert data["meta"]["ep"] == 2
    assert data["meta"]["source"] == source_digest()
    rows = data["rows"]
    assert [r["tokens_per_rank"] for r in rows] == [0, 5]
    assert all(r["backend"] == "cpu" and r["us"] > 0 for r in rows)
    assert rows[0]["speedup"] is None and rows[1]["us_one_device"] > 0
    assert all(r["us_sequential"] is None for r in rows)


def test_bench_ep_shared_expert_gloo_smoke(capsys):
    """--shared: every row also times the shared expert in sequence (FUSEDMOE_SHARED_OVERLAP=0)."""
    rc = main(["bench", "--ep", "2", "--device", "cpu", "--scale", "64", "--tokens", "3",
               "--presets", "deepseek-v3", "--iters", "2", "--shared"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "seq. us" in text and "overlap" in text


def test_source_digest_names_the_package_code(tmp_path, monkeypatch):
    # results carry the digest of the code that produced them (a copied tree's .git may be behind)
    import shutil

    import fusedmoe
    from fusedmoe import cli

    digest = source_digest()
    assert len(digest) == 12 and int(digest, 16) >= 0 and source_digest() == digest
    copy = tmp_path / "fusedmoe"
    shutil.copytree(Path(fusedmoe.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cli, "__file__", str(copy / "cli.py"))
    assert source_digest() == digest  # the same files elsewhere: the same digest
    (copy / "routing.py").write_text((copy / "routing.py").read_text() + "\n# changed\n")
    assert source_digest() != digest
    assert cli._commit() == "unknown"  # not a git checkout


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--ep", "2", "--backends", "triton,torch"], r"--ep runs one backend \(or auto\), got --backends triton,torch"),
        (["--ep", "2", "--quant", "fp8_w8a8_block"], r"--ep benchmarks unquantized layers"),
        (["--ep", "2", "--presets", "nope"], r"nope"),
        (["--ep", "0"], r"--ep 0 must be >= 1"),
        (["--shared"], r"--shared times shared experts .* give --ep N > 1"),
        (["--graph"], r"--graph times the expert-parallel call .* give --ep N > 1 --dispatch allgather"),
        (["--ep", "2", "--graph"], r"needs dispatch='allgather' on cuda: the all-to-all dispatches read"),
        (["--ep", "2", "--graph", "--dispatch", "allgather"], r"needs dispatch='allgather' on cuda"),
        (["--ep", "2", "--routing"], r"--routing is for the one-device benchmark"),
    ],
    ids=("two_backends", "quant", "preset", "ep0", "shared_without_ep", "graph_without_ep",
         "graph_alltoall", "graph_on_cpu", "routing_with_ep"),
)
def test_bench_ep_bad_arguments(argv, match, capsys):
    assert main(["bench", "--device", "cpu", *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_bench_backends_all_is_what_runs_here_for_the_scheme(monkeypatch):
    """`--backends all`: the backends this machine runs for the scheme bench gives each (the
    quantized one or the bf16 baseline); batched rows included (bench times them in their
    layout), nothing for another platform."""
    from fusedmoe.cli import _bench_backends
    from fusedmoe.platform import Platform

    h100 = Platform("cuda", (9, 0), device_name="NVIDIA H100", has_triton=True)
    monkeypatch.setattr(Platform, "current", staticmethod(lambda: h100))
    assert _bench_backends("all") == ["torch", "batched_torch", "triton", "batched_triton", "grouped_mm"]
    assert "marlin" in _bench_backends("all", "nvfp4") and "batched_marlin" in _bench_backends("all", "nvfp4")
    assert "marlin" not in _bench_backends("all", "int4_w4a16_g32")  # pending there: triton runs it
    assert "triton" not in _bench_backends("all", "nvfp4")  # it refuses W4A4; marlin runs it
    monkeypatch.setattr(Platform, "current", staticmethod(lambda: Platform("cpu")))
    assert _bench_backends("all") == ["torch", "batched_torch", "cpu", "grouped_mm"]
    with pytest.raises(ValueError, match="unknown backends"):
        _bench_backends("triton,nope")


def test_bench_progress_counts_every_cell(monkeypatch, capsys):
    """The [n/N] counter advances per (preset, M, backend) cell, not per preset."""
    import torch

    from fusedmoe import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "measure_ceilings", lambda eight_bit=False: bench.Ceilings("fake", 4e12, 8e14))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake", raising=False)

    def fake_preset(preset, backends, tokens_list, ceilings, *, progress, **kw):
        rows = []
        for t in tokens_list:
            for b in backends:
                progress(f"{preset.name} M={t} {b}")
                rows.append(bench.Row(preset.name, b, t, 1, 1.0, 1.0, 1.0, 50.0, "memory"))
        return rows

    monkeypatch.setattr(bench, "bench_preset", fake_preset)
    assert main(["bench", "--presets", "mixtral-8x7b,qwen3-30b-a3b", "--tokens", "1,4", "--backends",
                 "triton,torch", "--commit", "x"]) == 0
    captured = capsys.readouterr()
    assert re.findall(r"\[\s*(\d+)/8\]", captured.err) == [str(i) for i in range(1, 9)]
    assert "routing excluded" in captured.out


def test_bench_routing_flag_reaches_every_preset(monkeypatch, capsys, tmp_path):
    """--routing and --seed reach bench_preset; the header and the JSON metadata say so."""
    import json

    import torch

    from fusedmoe import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "measure_ceilings", lambda eight_bit=False: bench.Ceilings("fake", 4e12, 8e14))
    seen = []

    def fake_preset(preset, backends, tokens_list, ceilings, *, routing=False, seed=0, **kw):
        seen.append((preset.name, routing, seed))
        return [bench.Row(preset.name, "triton", 1, 1, 1.0, 1.0, 1.0, 50.0, "memory")]

    monkeypatch.setattr(bench, "bench_preset", fake_preset)
    out = tmp_path / "rows.json"
    assert main(["bench", "--presets", "deepseek-v3,qwen3-30b-a3b", "--tokens", "1", "--backends", "triton",
                 "--routing", "--seed", "7", "--commit", "x", "--json", str(out)]) == 0
    assert seen == [("deepseek-v3", True, 7), ("qwen3-30b-a3b", True, 7)]
    header = capsys.readouterr().out.splitlines()[0]
    assert "routing included, seed 7" in header and "batch-invariant" not in header
    meta = json.loads(out.read_text())["meta"]
    assert meta["routing"] == "included" and meta["batch_invariant"] is False and meta["seed"] == 7
    # FUSEDMOE_BATCH_INVARIANT=1 times the fixed plans: the header and the metadata say so
    monkeypatch.setenv("FUSEDMOE_BATCH_INVARIANT", "1")
    assert main(["bench", "--presets", "qwen3-30b-a3b", "--tokens", "1", "--backends", "triton", "--commit", "x",
                 "--json", str(out)]) == 0
    assert "; batch-invariant plans (FUSEDMOE_BATCH_INVARIANT=1)" in capsys.readouterr().out.splitlines()[0]
    assert json.loads(out.read_text())["meta"]["batch_invariant"] is True
    # --quant none is the unquantized bench, as explain reads it (it once reached get_scheme(None).name)
    seen.clear()
    assert main(["bench", "--presets", "qwen3-30b-a3b", "--tokens", "1", "--backends", "triton", "--commit", "x",
                 "--quant", "none", "--json", str(out)]) == 0
    assert seen == [("qwen3-30b-a3b", False, 0)] and json.loads(out.read_text())["meta"]["quant"] is None
    assert "runs none" not in capsys.readouterr().out
