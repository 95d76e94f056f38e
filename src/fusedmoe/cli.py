"""`fusedmoe` command line: explain | demo | bench | tune | fuzz | env.

    fusedmoe explain --model deepseek-v3 --quant fp8_w8a8_block --ep 8 [--dp 8] [--dispatch alltoall_batched]
    fusedmoe explain --experts 64 --hidden 2048 --intermediate 1024 --top-k 6 --platform cuda:9.0 --packages flashinfer
    fusedmoe explain --model deepseek-v3 --tokens 1,64,4096    # + the Triton path, tiles and TMA per M
    fusedmoe demo [--model qwen3-30b-a3b] [--tokens 64]
    fusedmoe demo --hf mixtral [--tokens 64] [--new-tokens 8]     (needs transformers: pip install -e .[hf])
    fusedmoe bench [--presets qwen3-30b-a3b] [--tokens 1,16,256] [--backends triton,grouped_mm] [--csv out.csv]
                   [--quant fp8_w8a8_block]
    torchrun --nproc-per-node 2 -m fusedmoe bench --ep 2 [--dispatch allgather [--graph]]   (or without torchrun)
    fusedmoe bench --ep 2 --device cpu --scale 32 --tokens 4                     (gloo smoke test)
    fusedmoe tune --model qwen3-30b-a3b [--tokens 1,16,256] [--out DIR] [--quant fp8_w8a8_block]
                  [--search descent|grid] [--min-gain 0.03] [--jobs 14]   (processes compiling each step's tiles)
    fusedmoe fuzz [--cases 200] [--seed 0] [--profile ci|cpu|cpu-triton|gpu] [--device cpu|cuda]
                  [--backends triton,emulation] [--json out.json]     (exit 1 on any failure)
                  [--jobs 16] [--time-limit 540]      (worker processes; no case starts after 540 s)
    fusedmoe fuzz --replay SEED --profile cpu                         (one case, every backend)
    fusedmoe env [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform as pyplatform
import statistics
import sys
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusedmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _explain_parser(sub.add_parser("explain", help="show which backend runs a MoE config, and why"))
    demo = sub.add_parser("demo", help="run a real model's MoE layer, check it against the reference")
    demo.add_argument("--model", default="qwen3-30b-a3b", help="model preset (see --list)")
    demo.add_argument("--tokens", type=int, default=64, help="tokens in the batch (default 64)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="default: bf16 on GPU, fp32 on CPU")
    demo.add_argument("--device", default=None, help="default: cuda if available else cpu")
    demo.add_argument("--scale", type=int, default=None,
                      help="divide hidden/intermediate by this (default: fit ~256 MB of weights on CPU); "
                           "with --hf: multiply the family's tiny sizes (default 2 on CPU, 16 on GPU)")
    demo.add_argument("--list", action="store_true", help="list the model presets (with --hf: families) and exit")
    demo.add_argument("--hf", default=None, metavar="FAMILY",
                      help="a transformers MoE family (mixtral, qwen3_moe, deepseek_v3, gpt_oss, ...): "
                           "a small random model, patched by fusedmoe.hf, against transformers")
    demo.add_argument("--new-tokens", type=int, default=8, help="with --hf: greedy tokens generated")
    demo.add_argument("--checkpoint", default=None, metavar="DIR",
                      help="a Hugging Face checkpoint directory (config.json + safetensors): one MoE layer of it "
                           "(fusedmoe.checkpoint.load_moe_layer) against the same layer loaded as the reference "
                           "(fp32 on the CPU: emulation for a quantized scheme; on a CPU device both run that "
                           "same math), and timed")
    demo.add_argument("--layer", type=int, default=None, help="with --checkpoint: the layer (default: the first MoE one)")
    env = sub.add_parser("env", help="versions, device, optional backend packages, FUSEDMOE_* knobs")
    env.add_argument("--json", action="store_true")
    bench = sub.add_parser("bench", help="time backends on model presets (CUDA graphs, rotated weights)")
    bench.add_argument("--presets", default=None, help="comma-separated preset names (default: the 5 targets)")
    bench.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,4,16,64,256,1024,4096)")
    bench.add_argument("--backends", default=None,
                       help="comma-separated backends, or 'all' for every one that runs here (default "
                            "triton,grouped_mm,torch; with --ep: one backend, default auto)")
    bench.add_argument("--copies", type=int, default=4, help="weight copies rotated per replay (>= 4)")
    bench.add_argument("--quant", default=None,
                       help="a W8A8 or weight-only scheme for triton (fp8_w8a8_block, int8_w8a8, "
                            "int4_w4a16_g32, mxfp4_w4a16, ...): bytes at the quantized width; other "
                            "backends stay bf16 as the baseline")
    bench.add_argument("--csv", default=None, help="write rows as CSV")
    bench.add_argument("--json", default=None, help="write rows and metadata as JSON")
    bench.add_argument("--plot", default=None, help="write a PNG of %% of roofline per preset")
    bench.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse HEAD)")
    bench.add_argument("--ep", type=int, default=1,
                       help="expert-parallel ranks: time the layer split over N ranks (tokens per rank) "
                            "against one device; under torchrun N must equal its world size, else the "
                            "ranks are started here")
    bench.add_argument("--dispatch", choices=("alltoall", "alltoall_batched", "allgather"), default="alltoall",
                       help="with --ep: how tokens reach the experts' ranks")
    bench.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="with --ep: cuda (nccl) or cpu (gloo smoke test, fp32)")
    bench.add_argument("--scale", type=int, default=1,
                       help="with --ep: divide hidden/intermediate sizes by this (smoke tests)")
    bench.add_argument("--iters", type=int, default=20, help="with --ep: timed iterations per shape")
    bench.add_argument("--shared", action="store_true",
                       help="with --ep: add a shared expert (a routed expert's size) and also time it "
                            "in sequence instead of overlapped with the dispatch / combine")
    bench.add_argument("--tp", type=int, default=None,
                       help="time every preset at this tensor-parallel split of its intermediate size instead "
                            "of its benchmark split (DeepSeek-V3 8, Llama-4 8, Qwen3-235B 4, ...); a changed "
                            "split names the rows PRESET/tpN")
    bench.add_argument("--seed", type=int, default=0,
                       help="seed of the weights and of each cell's tokens and routing (a cell's draws depend "
                            "on (seed, M) alone); another seed times another routing of the same shapes")
    bench.add_argument("--check", action="store_true",
                       help="after timing, compare each output with a reference on the same weights (the float32 "
                            "reference; emulation for a quantized scheme) under the fuzz's bounds, and a deterministic backend's "
                            "output over 8 runs bit for bit (a race); exit 1 on a mismatch")
    bench.add_argument("--routing", action="store_true",
                       help="time each call with its routing (select_experts with the preset's routing "
                            "on fixed logits, then the experts), as a layer's forward runs it; the "
                            "roofline stays the experts'")
    bench.add_argument("--graph", action="store_true",
                       help="with --ep and --dispatch allgather: run each M at a fixed capacity of M "
                            "tokens a rank and also time the call captured in a CUDA graph")
    tune = sub.add_parser("tune", help="search Triton tiles for a shape on this GPU, write the table")
    tune.add_argument("--model", default=None, help="a model preset (its benchmark TP split and biases)")
    tune.add_argument("--experts", type=int)
    tune.add_argument("--hidden", type=int)
    tune.add_argument("--intermediate", type=int, help="per-GPU intermediate size")
    tune.add_argument("--top-k", type=int)
    tune.add_argument("--activation", default=None)
    tune.add_argument("--bias", action="store_true",
                      help="with an explicit shape: time the GEMMs with biases (a --model takes its preset's)")
    tune.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    tune.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    tune.add_argument("--quant", default=None,
                      help="tune the triton GEMMs of a W8A8 or weight-only scheme (fp8_w8a8_block, "
                           "int8_w8a8, int4_w4a16_g32, mxfp4_w4a16, ...) on quantized weights")
    tune.add_argument("--out", default=None, help="folder (default: FUSEDMOE_TUNED_DIR, else the packaged tables)")
    tune.add_argument("--search", choices=("descent", "grid"), default="descent",
                      help="descent: coordinate descent from the heuristic's tiles; grid: time every tile of "
                           "tune.GRID at each block_m first (minutes per token count), then descend")
    tune.add_argument("--min-gain", type=float, default=0.03,
                      help="write an entry only when it beats the plan that runs now by this fraction")
    tune.add_argument("--seed", type=int, default=0,
                      help="seed of each token count's routing draws, as `fusedmoe bench --seed` draws them "
                           "(the tuner times the routings the bench times at the same seed)")
    tune.add_argument("--jobs", type=int, default=1,
                      help="worker processes compiling each batch of tiles before they are timed "
                           "(tune.CompilePool; the same entries, found sooner); 1: none")
    fuzz = sub.add_parser("fuzz", help="random problems, every backend that accepts them, vs the float64 reference")
    fuzz.add_argument("--cases", type=int, default=200, help="number of cases (seeds --seed .. --seed + N - 1)")
    fuzz.add_argument("--seed", type=int, default=0, help="first seed")
    fuzz.add_argument("--replay", type=int, default=None, metavar="SEED",
                      help="run the one case of SEED and print every backend's result")
    fuzz.add_argument("--profile", default=None,
                      help="size limits: ci, cpu, cpu-triton, gpu (default: gpu on cuda, else cpu)")
    fuzz.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    fuzz.add_argument("--backends", default=None, help="comma-separated backends (default: every one accepted)")
    fuzz.add_argument("--batch-invariance", action=argparse.BooleanOptionalAction, default=None,
                      help="also run each backend that serves batch invariance with it, checking that sub-batches "
                           "give bitwise the whole call's rows (NAME[batch-invariant]; default: on for cuda)")
    fuzz.add_argument("--no-interpreter", action="store_true",
                      help="on cpu: skip the Triton kernels under the Triton interpreter")
    fuzz.add_argument("--json", default=None, help="write the per-backend counts and failures as JSON")
    fuzz.add_argument("--jobs", type=int, default=1,
                      help="worker processes (spawned, sharing the device), each taking the next seed "
                           "(default 1: in this process)")
    fuzz.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                      help="start no case after SECONDS; the report counts the cases that ran and lists "
                           "the seeds that did not")
    args = parser.parse_args(argv)
    if getattr(args, "quant", None) in ("none", "unquantized", ""):
        args.quant = None  # as get_scheme reads it: every command takes "none" for unquantized
    try:
        return {"explain": cmd_explain, "demo": cmd_demo, "env": cmd_env,
                "bench": cmd_bench, "tune": cmd_tune, "fuzz": cmd_fuzz}[args.command](args)
    except (ValueError, NotImplementedError) as exc:
        print(f"fusedmoe {args.command}: error: {exc}", file=sys.stderr)
        return 2


# explain -----------------------------------------------------------------------------------------
def _explain_parser(p: argparse.ArgumentParser) -> None:
    from fusedmoe.quant.scheme import SCHEMES

    p.add_argument("--model", help="a model preset (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, ...)")
    p.add_argument("--experts", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--activation", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--quant", default=None, choices=["none", *sorted(SCHEMES)])
    p.add_argument("--checkpoint-config", default=None, metavar="PATH",
                   help="instead of --quant: a pre-quantized checkpoint's config.json (or ModelOpt's "
                        "hf_quant_config.json); its experts' scheme is read from it (quant.scheme_from_config)")
    p.add_argument("--bias", action="store_true", default=None)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a token's output independent of the rest of the batch (as FUSEDMOE_BATCH_INVARIANT=1)")
    p.add_argument("--swiglu-limit", type=float, default=None)
    p.add_argument("--format", choices=("standard", "batched"), default=None,
                   help="activation format (batched = per-expert buffers, e.g. DeepEP low-latency); "
                        "default: batched for --dispatch alltoall_batched with --ep > 1, else standard")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dispatch", choices=("alltoall", "alltoall_batched", "allgather"), default="alltoall",
                   help="how tokens reach the experts' ranks under EP (default alltoall)")
    p.add_argument("--placement", choices=("linear", "round_robin"), default="linear")
    p.add_argument("--max-num-tokens", type=int, default=None,
                   help="with --ep: the most tokens a rank dispatches per call (fixed batched buffers; the "
                        "allgather dispatch at that capacity is CUDA-graph capturable)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--platform", default=None,
                   help="describe another machine: KIND[:MAJOR.MINOR], e.g. cuda:9.0, rocm:9.4, cpu")
    p.add_argument("--packages", default=None,
                   help="with --platform: comma-separated importable packages (flashinfer,deep_gemm,...)")
    p.add_argument("--tokens", default=None,
                   help="comma-separated token counts: also show the Triton path (direct or aligned), "
                        "tiles (tuned or heuristic) and TMA loads this machine's GPU would run, and why")
    p.add_argument("--json", action="store_true")


def _platform_from_args(args):
    from fusedmoe.platform import Platform

    if args.platform is None:
        if args.packages is not None:
            raise ValueError("--packages needs --platform")
        return Platform.current()
    kind, _, cap = args.platform.partition(":")
    capability = None
    if cap:
        try:
            major, minor = cap.split(".")
            capability = (int(major), int(minor))
        except ValueError:
            raise ValueError(f"--platform {args.platform!r}: capability must look like 9.0") from None
    packages = tuple(p for p in (args.packages or "").split(",") if p)
    return Platform(kind, capability, packages=packages)


def _config_from_args(args):
    from fusedmoe.config import MoEConfig, ParallelConfig
    from fusedmoe.presets import get_preset

    parallel = dict(dp_size=args.dp, ep_size=args.ep, dispatch=args.dispatch, placement=args.placement)
    fmt = args.format
    if fmt is None:
        fmt = "batched" if args.ep > 1 and args.dispatch == "alltoall_batched" else "standard"
    common = dict(
        dtype=DTYPES[args.dtype], quant=args.quant, lora=args.lora, swiglu_limit=args.swiglu_limit,
        activation_format=fmt, backend=args.backend, max_num_tokens=args.max_num_tokens,
        batch_invariant=args.batch_invariant,
    )
    if args.activation:
        common["activation"] = args.activation
    if args.bias is not None:
        common["has_bias"] = args.bias
    if args.model:
        preset = get_preset(args.model)
        tp = args.tp if args.tp is not None else (preset.bench_tp if args.ep == 1 else 1)
        return preset.config(parallel=ParallelConfig(tp_size=tp, **parallel), **common)
    missing = [f"--{n}" for n, v in (("experts", args.experts), ("hidden", args.hidden),
               ("intermediate", args.intermediate), ("top-k", args.top_k)) if v is None]
    if missing:
        raise ValueError(f"give --model NAME or all of --experts --hidden --intermediate --top-k (missing {missing})")
    return MoEConfig(args.experts, args.top_k, args.hidden, args.intermediate,
                     parallel=ParallelConfig(tp_size=args.tp or 1, **parallel), **common)


def cmd_explain(args) -> int:
    from fusedmoe.oracle import explain

    checkpoint = None
    if args.checkpoint_config is not None:
        from fusedmoe.quant.checkpoint_config import (
            checkpoint_format_from_config,
            scheme_from_config,
        )

        if args.quant is not None:
            raise ValueError("give --quant or --checkpoint-config, not both")
        try:
            checkpoint_json = json.loads(Path(args.checkpoint_config).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--checkpoint-config {args.checkpoint_config}: {exc}") from None
        args.quant = scheme_from_config(checkpoint_json)
        fmt = checkpoint_format_from_config(checkpoint_json)
        checkpoint = (f"checkpoint {args.checkpoint_config}: its experts load as quant={args.quant!r}, prequantized=True"
                      + (f", checkpoint_format={fmt!r}" if fmt else ""))
    config = _config_from_args(args)
    platform = _platform_from_args(args)
    result = explain(config, platform)
    plans = triton_plans(config, result.chosen, _tokens(args.tokens)) if args.tokens else None
    routing = _routing_line(args, config, platform)
    if args.json:
        data = result.to_dict()
        if plans is not None:
            data["triton_plan"] = plans
        data["routing"] = routing
        if checkpoint is not None:
            data["checkpoint_scheme"] = args.quant
        print(json.dumps(data, indent=2, default=str))
    else:
        if checkpoint is not None:
            print(checkpoint + "\n")
        print(result.table())
        if result.error:
            print("\n" + result.error.splitlines()[0])
        print("\n" + routing)
        if plans is not None:
            print("\n" + format_plans(plans))
    return 0 if result.chosen else 1


# Backends whose contiguous layout runs the Triton experts kernels (marlin: its weight-only twin).
_TRITON_PLAN_BACKENDS = ("triton", "marlin")


def _tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--tokens {text!r}: expected comma-separated integers") from None
    if not tokens or min(tokens) < 1:
        raise ValueError(f"--tokens {text!r}: token counts must be >= 1")
    return tokens


def _routing_line(args, config, platform) -> str:
    """How select_experts routes this layer on the platform (--model: the preset's routing; else
    plain top-k)."""
    from fusedmoe.presets import get_preset
    from fusedmoe.routing import routing_path

    routing = dict(get_preset(args.model).routing) if args.model else {}
    device_type = "cuda" if platform.kind == "rocm" else platform.kind  # ROCm tensors are "cuda" ones
    why = routing_path(device_type, config.num_experts, config.top_k, routing.get("use_grouped_topk", False),
                       routing.get("num_expert_group"), routing.get("topk_group"))
    if why is None:
        return "routing: one Triton launch (moe_routing_kernel); torch.compile traces keep the torch ops"
    return f"routing: the torch ops ({why})"


def triton_plans(config, chosen: str | None, tokens: list[int]) -> list[dict] | dict:
    """Per token count, the Triton experts path `describe_plan` gives for the chosen backend on
    this machine's device (CUDA if there is one, else the CPU, whose tile rules assume 132 SMs and
    read no tuned table); a dict with the reason when no Triton path runs this config."""
    from fusedmoe.backends.triton.experts import GemmProblem, describe_plan, wants_batch_invariance
    from fusedmoe.backends.triton.marlin import weight_only_twin

    if chosen not in _TRITON_PLAN_BACKENDS:
        return {"none": f"the chosen backend ({chosen}) does not run the contiguous Triton kernels"}
    scheme = config.quant
    if chosen == "marlin":
        scheme = weight_only_twin(scheme)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    invariant = chosen == "triton" and wants_batch_invariance(config)  # as TritonExperts decides
    plans = []
    for t in tokens:
        problem = GemmProblem(t * config.top_k, config.num_local_experts, config.hidden_size,
                              config.intermediate_size_per_partition, config.top_k, config.gated, config.dtype)
        plan = describe_plan(problem, scheme, device, invariant)
        plans.append({"tokens": t, "device": str(device), **{
            k: ({**v, "tile": v["tile"].as_list()} if isinstance(v, dict) else v)
            for k, v in plan.items()}})
    return plans


def format_plans(plans: list[dict] | dict) -> str:
    if isinstance(plans, dict):
        return "triton plan: " + plans["none"]
    device = plans[0]["device"]
    where = device if device != "cpu" else "cpu (no GPU here: the tile rules assume 132 SMs, no tuned table, no TMA)"
    lines = [f"triton plan on {where} (tile = block_m, block_n, block_k, warps, stages, split_k, then where set "
             "swap_ab, group_m, persistent, one_dot; a direct gemm2's split_k is its slot shares per token):"]
    for p in plans:
        gemms = []
        for name in ("gemm1", "gemm2"):
            g = p[name]
            tma = f", TMA {g['tma']}" if g["tma"] else ""
            swap = ", swapped: w^T @ a^T, one stage fewer" if g.get("swap_ab") else ""
            rows = f", {g['rows']}" if g.get("rows") else ""
            tile = g["tile"]
            persistent = ", persistent: programs stride over the tiles" if len(tile) > 8 and tile[8] else ""
            one_dot = ", gate and up in one dot" if len(tile) > 9 and tile[9] else ""
            gemms.append(f"{name} {tile} ({g['source']}{tma}{swap}{rows}{persistent}{one_dot})")
        lines.append(f"  M={p['tokens']:<6d} {p['path']}: {p['launches']}; {'; '.join(gemms)}")
        lines.append(f"           why: {p['why']}")
        if p.get("fp8_accumulate"):
            lines.append(f"           fp8 accumulator: {p['fp8_accumulate']}")
        if p.get("w4_layout"):
            lines.append(f"           4-bit weights: {p['w4_layout']}")
    return "\n".join(lines)


# demo --------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from fusedmoe.layer import FusedMoE
    from fusedmoe.oracle import explain
    from fusedmoe.platform import Platform
    from fusedmoe.presets import PRESETS, get_preset

    if args.hf is not None:
        return _demo_hf(args)
    if args.checkpoint is not None:
        return _demo_checkpoint(args)
    if args.list:
        for p in PRESETS.values():
            print(f"{p.name:18} E={p.num_experts:<4} k={p.top_k:<2} H={p.hidden_size:<5} "
                  f"I={p.intermediate_size:<6} {p.activation:10} {p.model}")
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    preset = get_preset(args.model)
    scale = args.scale
    if scale is None:
        budget = 256 * 2**20 if device.type == "cpu" else 8 * 2**30
        scale = 1
        while preset.scaled(scale).weight_bytes(dtype) > budget:
            scale *= 2
    model = preset.scaled(scale)
    print(f"fusedmoe demo: {preset.name} ({preset.model}) MoE layer"
          + (f", hidden/intermediate divided by {scale} to fit" if scale > 1 else ""))
    print(f"  E={model.num_experts} top_k={model.top_k} H={model.hidden_size} I={model.intermediate_size} "
          f"activation={model.activation} routing={model.routing} tokens={args.tokens} "
          f"dtype={str(dtype).replace('torch.', '')} device={device}")

    platform = Platform.for_device(device)
    layer_kwargs = dict(
        params_dtype=dtype, activation=model.activation, has_bias=model.has_bias,
        has_correction_bias=model.has_correction_bias,
        apply_router_weight_on_input=model.apply_router_weight_on_input, **model.routing,
    )
    explanation = explain(model.config(dtype=dtype, tp=1), platform)
    backend = "auto"
    print()
    print(_short_table(explanation))
    if explanation.chosen is None:
        print(f"\n  no backend qualifies on {platform} yet; running the torch reference instead")
        backend = "torch"

    gen = torch.Generator(device="cpu").manual_seed(0)
    layer = FusedMoE(model.num_experts, model.top_k, model.hidden_size, model.intermediate_size,
                     backend=backend, device=device, **layer_kwargs)
    with torch.no_grad():
        for p in layer.parameters():
            fan_in = p.shape[-1]
            p.copy_((torch.randn(p.shape, generator=gen) / fan_in**0.5).to(p.dtype))
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.copy_(torch.randn(model.num_experts, generator=gen) * 0.1)
    selection = layer.process_weights_after_loading()
    x = torch.randn(args.tokens, model.hidden_size, generator=gen).to(device, dtype)
    logits = torch.randn(args.tokens, model.num_experts, generator=gen).to(device, torch.float32)

    out = layer(x, logits)
    ref = _reference(layer, x, logits)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]

    t, runs = _median_s(lambda: layer(x, logits), device)
    flops = 6 * args.tokens * model.top_k * model.hidden_size * model.intermediate_size
    print(f"\n  backend      {selection.name} (via {selection.via})")
    print(f"  rel. error   {err:.2e} vs a float64 reference ({'ok' if err < tol else 'TOO LARGE'}, tolerance {tol:.0e})")
    print(f"  time         {t * 1e3:.2f} ms per forward (median of {runs}, routing included)")
    print(f"  throughput   {args.tokens / t:,.0f} tokens/s, {flops / t / 1e9:,.1f} GFLOP/s")
    return 0 if err < tol else 1


def _median_s(fn, device: torch.device) -> tuple[float, int]:
    """(median seconds of fn() over 3 runs on a CPU, 20 on a GPU, synchronized; the run count)."""
    times = []
    for _ in range(3 if device.type == "cpu" else 20):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def _demo_checkpoint(args) -> int:
    from fusedmoe.bench import check_cell
    from fusedmoe.checkpoint import first_moe_layer, load_moe_layer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    layer = first_moe_layer(args.checkpoint) if args.layer is None else args.layer
    moe = load_moe_layer(args.checkpoint, layer, device=device, params_dtype=dtype)
    scheme = moe.moe.config.quant
    ref = load_moe_layer(args.checkpoint, layer, device="cpu", params_dtype=torch.float32,
                         backend="torch" if scheme is None else "emulation")
    c = moe.moe.config
    print(f"fusedmoe demo --checkpoint {args.checkpoint}: layer {layer} of {moe.model_type}")
    print(f"  E={c.num_experts} top_k={c.top_k} H={c.hidden_size} I={c.intermediate_size} "
          f"quant={scheme or 'none'} activation={c.activation} shared={moe.moe.shared_experts is not None} "
          f"tokens={args.tokens} dtype={str(dtype).replace('torch.', '')} device={device}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.tokens, c.hidden_size, generator=gen).to(dtype)
    with torch.no_grad():
        out = moe(x.to(device))
        want = ref(x.float())
    # the output in its own dtype: check_cell's tolerance is the dtype's (float32's for a float() copy)
    err, why = check_cell(out.cpu(), want, None if scheme is None else scheme.name, torch.device(device))
    with torch.no_grad():
        t, runs = _median_s(lambda: moe(x.to(device)), device)
    print(f"\n  backend      {moe.moe.selection.name} (via {moe.moe.selection.via})")
    print(f"  rel. error   {err:.2e} vs the same layer in fp32 ({'reference' if scheme is None else 'emulation'}) "
          f"on the CPU: {'ok' if why is None else why}")
    print(f"  time         {t * 1e3:.2f} ms per forward (median of {runs}, router and routing included)")
    return 0 if why is None else 1


def _demo_hf(args) -> int:
    try:
        from fusedmoe.hf.demo import list_families, run_demo
    except ImportError as exc:
        raise ValueError(f"--hf needs transformers ({exc}); pip install -e '.[hf]'") from None
    if args.list:
        print(list_families())
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    scale = args.scale or (2 if device.type == "cpu" else 16)
    try:
        return run_demo(args.hf, tokens=args.tokens, new_tokens=args.new_tokens, dtype=dtype,
                        device=device, scale=scale)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def _reference(layer, x, logits):
    from fusedmoe.reference import fused_experts_ref

    w, ids = layer.route(x, logits)
    return fused_experts_ref(
        x.double().cpu(), layer.w13_weight.double().cpu(), layer.w2_weight.double().cpu(),
        w.double().cpu(), ids.cpu(), activation=layer.config.activation,
        apply_router_weight_on_input=layer.config.apply_router_weight_on_input,
        w13_bias_LG=None if layer.w13_bias is None else layer.w13_bias.double().cpu(),
        w2_bias_LH=None if layer.w2_bias is None else layer.w2_bias.double().cpu(),
        swiglu_alpha=layer.config.swiglu_alpha, swiglu_limit=layer.config.swiglu_limit,
    ).to(x.device)


def _short_table(explanation) -> str:
    lines = explanation.table().splitlines()
    keep = [lines[0], lines[1], lines[2]]
    keep += [line for line in lines[3:] if line.split()[2] != "-"]  # the family's candidates
    return "\n".join("  " + line for line in keep)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# bench -------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from fusedmoe import bench, knobs
    from fusedmoe.presets import get_preset

    if args.check and args.ep > 1:
        raise ValueError("--check is for the one-device benchmark (the expert-parallel tests check --ep's outputs)")
    if args.routing and args.ep > 1:
        raise ValueError("--routing is for the one-device benchmark (--ep times the layer, routing included)")
    if args.tp is not None and args.ep > 1:
        raise ValueError("--tp is for the one-device benchmark (--ep splits the experts, not their sizes)")
    if args.seed != 0 and args.ep > 1:
        raise ValueError("--seed is for the one-device benchmark (--ep draws each rank's tokens from its rank)")
    if args.seed < 0:
        raise ValueError(f"--seed {args.seed} must be >= 0")
    if args.ep > 1:
        return cmd_bench_ep(args)
    if args.ep < 1:
        raise ValueError(f"--ep {args.ep} must be >= 1")
    presets = [get_preset(p) for p in (args.presets.split(",") if args.presets else bench.TARGET_PRESETS)]
    if args.tp is not None:
        presets = _split_presets(presets, args.tp)
    if args.shared:
        raise ValueError("--shared times shared experts against expert-parallel communication: give --ep N > 1")
    if args.graph:
        raise ValueError("--graph times the expert-parallel call captured in a CUDA graph: give --ep N > 1 "
                         "--dispatch allgather (`fusedmoe bench` always replays graphs)")
    bench.quant_bytes(args.quant)  # a scheme neither triton nor marlin runs fails before any GPU work
    # presets the scheme cannot quantize are left out, said, before any GPU work (not stopped at
    # their weight build with the rows timed so far unprinted)
    skipped = {p.name: why for p in presets if (why := bench.preset_quant_reason(p, args.quant))}
    for name, why in skipped.items():
        print(f"fusedmoe bench: skipping {name}: {why}", file=sys.stderr)
    presets = [p for p in presets if p.name not in skipped]
    if not presets:
        raise ValueError(f"--quant {args.quant} cannot quantize any preset asked for (above)")
    quant_backend = bench.quant_backend(args.quant)
    if args.backends is None:
        args.backends = f"{quant_backend},grouped_mm,torch"
    if not torch.cuda.is_available():
        raise ValueError("fusedmoe bench times GPU kernels and needs a CUDA device")
    if args.copies < 4:
        raise ValueError(f"--copies {args.copies}: rotate at least 4 weight copies so decode does not time L2")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(bench.DEFAULT_TOKENS)
    backends = _bench_backends(args.backends, args.quant)
    operand = bench.quant_operand(args.quant)
    ceilings = bench.measure_ceilings(eight_bit=operand is not None)
    meta = _bench_meta(ceilings, args.commit)
    meta["quant"] = args.quant
    meta["routing"] = "included" if args.routing else "excluded"
    meta["seed"] = args.seed
    meta["batch_invariant"] = knobs.get("BATCH_INVARIANT") is True  # plans that keep rows' bits (docs/reliability.md)
    eight = ""
    if operand is not None:
        rate = ceilings.peak(operand)
        meta[f"{operand}_TFLOPs"] = rate / 1e12
        eight = f", {rate / 1e12:.0f} {operand} TFLOP/s (the compute ceiling of this run)"
    print(f"{meta['device']}: {ceilings.bandwidth / 1e12:.2f} TB/s, {ceilings.bf16_flops / 1e12:.0f} bf16 TFLOP/s"
          f"{eight} (measured); torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, source {meta['source']}"
          + (f"; {quant_backend} runs {args.quant}" if args.quant else "")
          + f"; routing {meta['routing']}, seed {args.seed}"
          + ("; batch-invariant plans (FUSEDMOE_BATCH_INVARIANT=1)" if meta["batch_invariant"] else ""), flush=True)
    rows = []
    total = len(presets) * len(tokens) * len(backends)
    started = itertools.count(1)

    def progress(label: str) -> None:
        print(f"\r[{next(started):>3}/{total}] {label:<50}", end="", file=sys.stderr, flush=True)

    for preset in presets:
        rows += bench.bench_preset(preset, backends, tokens, ceilings, copies=args.copies, progress=progress,
                                   quant=args.quant, routing=args.routing, check=args.check, seed=args.seed)
    print(file=sys.stderr)
    print(bench.format_table(rows, [b for b in ("torch", "grouped_mm") if b in backends]))
    if args.csv:
        _write_csv(args.csv, rows, meta)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [r.__dict__ for r in rows]}, f, indent=1)
    if args.plot:
        _plot(args.plot, rows, meta)
    bad = bench.mismatched(rows)
    if bad:
        print(f"--check: {len(bad)} of {len(rows)} outputs beyond their bound (above)", file=sys.stderr)
    return 1 if bad else 0


def _split_presets(presets: list, tp: int) -> list:
    """`fusedmoe bench --tp`: each preset at tensor-parallel split `tp` (its intermediate size over
    tp ranks), renamed PRESET/tpN where that is not its benchmark split; a ValueError naming the
    presets whose intermediate size tp does not divide."""
    if tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1")
    bad = [f"{p.name} (I = {p.intermediate_size})" for p in presets if p.intermediate_size % tp]
    if bad:
        raise ValueError(f"--tp {tp} does not divide the intermediate size of {', '.join(bad)}")
    return [p if p.bench_tp == tp else dataclasses.replace(p, bench_tp=tp, name=f"{p.name}/tp{tp}") for p in presets]


def cmd_bench_ep(args) -> int:
    from fusedmoe import bench, bench_ep
    from fusedmoe.presets import get_preset

    if args.quant:
        raise ValueError("--ep benchmarks unquantized layers; drop --quant")
    backend = args.backends or "auto"
    if "," in backend:
        raise ValueError(f"--ep runs one backend (or auto), got --backends {backend}")
    presets = tuple(args.presets.split(",")) if args.presets else bench.TARGET_PRESETS
    for name in presets:
        get_preset(name)  # unknown names fail before any rank starts
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (1, 16, 256, 1024)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    spec = bench_ep.EpBenchSpec(presets, tokens, args.dispatch, args.device, dtype, args.scale,
                                args.iters, backend, shared=args.shared, graph=args.graph)
    rows = bench_ep.run(spec, args.ep)
    launched = bench_ep._torchrun_rank()
    if launched is not None and launched[0] != 0:
        return 0  # under torchrun only rank 0 reports
    print(bench_ep.format_rows(rows))
    meta = {"ep": args.ep, "dispatch": args.dispatch, "device": _device_name(args.device),
            "torch": torch.__version__, "commit": args.commit or _commit(), "source": source_digest(), "date": time.strftime("%Y-%m-%d")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            f.write("# " + " ".join(f"{k}={v}" for k, v in meta.items()) + "\n")
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["preset"])
            writer.writeheader()
            writer.writerows(rows)
    return 0


def _device_name(kind: str) -> str:
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return pyplatform.processor() or pyplatform.machine()


def _commit() -> str:
    """HEAD's short id, "+dirty" when the package's sources differ from it (a copied tree whose
    .git is behind reads as dirty), "unknown" outside a git checkout."""
    import subprocess

    src = str(Path(__file__).parent)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=src).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                               check=True, cwd=src).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def source_digest() -> str:
    """sha256 (12 hex digits) over the fusedmoe package's .py files (relative path and bytes, in
    path order): which code produced a result, whatever git says on the machine that ran it.
    For a commit: check it out and run `python -c "from fusedmoe.cli import source_digest;
    print(source_digest())"`."""
    import hashlib

    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _bench_backends(spec: str, quant: str | None = None) -> list[str]:
    from fusedmoe.backends import REGISTRY

    if spec == "all":
        # every backend this machine runs for the scheme bench gives it (quantized or the bf16
        # baseline); a preset one cannot run is a row with its reason
        from fusedmoe.bench import bench_scheme
        from fusedmoe.platform import Platform

        platform = Platform.current()
        return [name for name, b in REGISTRY.items()
                if platform.kind in b.kinds and all(platform.has(p) for p in b.packages)
                and (platform.has_triton or not b.needs_triton)
                and bench_scheme(name, quant) in b.schemes - b.pending_schemes]
    names = [b.strip() for b in spec.split(",") if b.strip()]
    unknown = [b for b in names if b not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; known: {sorted(REGISTRY)}")
    return names


def _bench_meta(ceilings, commit: str | None) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": ceilings.device, "bandwidth_TBps": ceilings.bandwidth / 1e12,
            "bf16_TFLOPs": ceilings.bf16_flops / 1e12, "torch": torch.__version__,
            "triton": triton_version, "cuda": torch.version.cuda, "commit": commit or _commit(),
            "source": source_digest(), "date": time.strftime("%Y-%m-%d")}


def _write_csv(path: str, rows, meta: dict) -> None:
    import csv

    with open(path, "w", newline="") as f:
        f.write("# " + " ".join(f"{k}={v}" for k, v in meta.items()) + "\n")
        writer = csv.writer(f)
        writer.writerow(["preset", "backend", "tokens", "experts_touched", "us", "tflops", "gbps",
                         "roof_pct", "bound", "speedup_vs_torch", "speedup_vs_grouped_mm", "error", "rel_err",
                         "mismatch"])
        for r in rows:
            writer.writerow([r.preset, r.backend, r.tokens, r.experts_touched, f"{r.us:.2f}",
                             f"{r.tflops:.2f}", f"{r.gbps:.1f}", f"{r.roof_pct:.1f}", r.bound,
                             f"{r.speedup_vs.get('torch', float('nan')):.2f}",
                             f"{r.speedup_vs.get('grouped_mm', float('nan')):.2f}", r.error or "",
                             "" if r.rel_err is None else f"{r.rel_err:.3e}", r.mismatch or ""])


def _plot(path: str, rows, meta: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from exc
    presets = sorted({r.preset for r in rows})
    fig, axes = plt.subplots(1, len(presets), figsize=(4 * len(presets), 3.5), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        for backend in sorted({r.backend for r in rows}):
            pts = [(r.tokens, r.roof_pct) for r in rows if r.preset == preset and r.backend == backend and not r.error]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_title(preset)
        ax.set_xlabel("tokens")
        ax.set_ylim(0, max([100.0] + [r.roof_pct for r in rows if not r.error]) * 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("% of roofline")
    axes[0][0].legend()
    fig.suptitle(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# tune --------------------------------------------------------------------------------------------
def cmd_tune(args) -> int:
    from fusedmoe import knobs
    from fusedmoe.backends.triton.marlin import WEIGHT_ONLY_TWIN
    from fusedmoe.backends.triton.quant import W8A8_SCHEMES
    from fusedmoe.backends.triton.tuning import PACKAGED
    from fusedmoe.backends.triton.weight_only import WEIGHT_ONLY_SCHEMES
    from fusedmoe.presets import get_preset
    from fusedmoe.tune import CompilePool, progress_printer

    runs = sorted(W8A8_SCHEMES | WEIGHT_ONLY_SCHEMES)
    if args.quant in WEIGHT_ONLY_TWIN:  # marlin runs these on the twin's kernels and tiles
        print(f"--quant {args.quant}: marlin runs it weight-only; tuning {WEIGHT_ONLY_TWIN[args.quant]}")
        args.quant = WEIGHT_ONLY_TWIN[args.quant]
    if args.quant is not None and args.quant not in runs:  # fails before any GPU work
        raise ValueError(f"--quant {args.quant!r}: tune takes a scheme the triton backend runs ({', '.join(runs)}) "
                         f"or marlin runs weight-only ({', '.join(sorted(WEIGHT_ONLY_TWIN))})")
    if args.model and args.bias:  # before the device check: a wrong command line says so anywhere
        raise ValueError(f"--bias is for an explicit shape; --model {args.model} times its preset's biases "
                         f"({'with' if get_preset(args.model).has_bias else 'without'} them)")
    if not 0 <= args.min_gain < 1:
        raise ValueError(f"--min-gain {args.min_gain}: a fraction in [0, 1) (0.03 writes entries 3% faster)")
    if args.seed < 0:
        raise ValueError(f"--seed {args.seed} must be >= 0")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: at least 1 (1 compiles each tile when it is first timed)")
    if not torch.cuda.is_available():
        raise ValueError("fusedmoe tune times GPU kernels and needs a CUDA device")
    if args.model:
        p = get_preset(args.model)
        shape = dict(experts=p.num_experts, hidden=p.hidden_size, inter=p.intermediate_size // p.bench_tp,
                     top_k=p.top_k, activation=args.activation or p.activation, bias=p.has_bias)
    else:
        missing = [f"--{n}" for n, v in (("experts", args.experts), ("hidden", args.hidden),
                   ("intermediate", args.intermediate), ("top-k", args.top_k)) if v is None]
        if missing:
            raise ValueError(f"give --model NAME or all of --experts --hidden --intermediate --top-k (missing {missing})")
        shape = dict(experts=args.experts, hidden=args.hidden, inter=args.intermediate, top_k=args.top_k,
                     activation=args.activation or "silu", bias=args.bias)
    tokens = [int(t) for t in args.tokens.split(",")]
    folder = args.out or knobs.get("TUNED_DIR") or PACKAGED
    progress = progress_printer(4 * len(tokens))  # up to 3 block_m of the aligned path + the direct one
    written = []
    pool = CompilePool(args.jobs, **shape, dtype=DTYPES[args.dtype], quant=args.quant) if args.jobs > 1 else None
    try:
        for count in tokens:  # written after each token count, so an interrupted run keeps its work
            written += [p for p in [_tune_count(args, shape, count, progress, folder, pool)] if p is not None]
    finally:
        if pool is not None:
            pool.close()
    if written:
        print(f"wrote {len(written)} entries to {written[-1]}")
    return 0


def _tune_count(args, shape: dict, count: int, progress, folder, pool) -> Path | None:
    """`fusedmoe tune` at one token count: the table file its entry went to (None: no entry)."""
    from fusedmoe.tune import tune_shape, write_table

    failed = len(pool.errors) if pool is not None else 0
    turned_down = []  # a search result the whole calls did not confirm
    entries = tune_shape(**shape, tokens_list=[count], dtype=DTYPES[args.dtype], quant=args.quant,
                         progress=progress, search=args.search, min_gain=args.min_gain, compile_pool=pool,
                         log=turned_down.append, seed=args.seed)
    print(file=sys.stderr)
    if pool is not None and len(pool.errors) > failed:  # a tile out of resources fails there and here alike
        print(f"M={count:>5}: {len(pool.errors) - failed} tiles did not run in the --jobs workers; the tuner "
              f"compiled each itself or skipped it (the first: {pool.errors[failed]})", file=sys.stderr)
    if not entries:
        print(turned_down[0] if turned_down else
              f"M={count:>5}: the plan that runs now (the heuristic, or the tuned entry serving this shape) "
              f"is within {args.min_gain:.1%} of the best config found; nothing written")
        return None
    e = entries[0]
    table = f", tuned table {e['table_us']:8.1f} us" if "table_us" in e else ""
    calls = f", table {e['table_call_us']:.1f}" if "table_call_us" in e else ""
    print(f"M={count:>5}: {e['path']:>7} {e['us']:8.1f} us (heuristic {e['heuristic_path']} "
          f"{e['heuristic_us']:8.1f} us{table})  gemm1 {e['gemm1']}  gemm2 {e['gemm2']}; whole call "
          f"{e['call_us']:.1f} us (heuristic {e['heuristic_call_us']:.1f}{calls})", flush=True)
    return write_table(entries, folder)


# env ---------------------------------------------------------------------------------------------
def cmd_env(args) -> int:
    import numpy

    from fusedmoe import __version__, knobs
    from fusedmoe.platform import KNOWN_PACKAGES, Platform

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    platform = Platform.current()
    info = {
        "fusedmoe": __version__,
        "python": pyplatform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "numpy": numpy.__version__,
        "cuda_runtime": torch.version.cuda,
        "platform": {"kind": platform.kind, "capability": platform.capability,
                     "device": platform.device_name, "sms": platform.num_sms,
                     "has_triton": platform.has_triton},
        "packages": {p: platform.has(p) for p in KNOWN_PACKAGES},
        "knobs": {name: value for name, value, _ in knobs.describe()},
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("fusedmoe", "python", "torch", "triton", "numpy", "cuda_runtime"):
        print(f"{key:14} {info[key] or '-'}")
    print(f"{'platform':14} {platform}")
    print(f"{'packages':14} " + ", ".join(f"{p}={'yes' if v else 'no'}" for p, v in info["packages"].items()))
    print("knobs:")
    for name, value, doc in knobs.describe():
        print(f"  {name:28} {value or '(unset)':10} {doc}")
    return 0



# fuzz --------------------------------------------------------------------------------------------
def cmd_fuzz(args) -> int:
    from fusedmoe import fuzz

    profile = args.profile or ("gpu" if args.device == "cuda" else "cpu")
    if profile not in fuzz.PROFILES:
        raise ValueError(f"--profile {profile!r}; expected one of {sorted(fuzz.PROFILES)}")
    backends = None if args.backends is None else [b.strip() for b in args.backends.split(",") if b.strip()]
    interpreter = not args.no_interpreter
    if interpreter and args.device == "cpu" and not fuzz._interpreter_active():
        print("note: TRITON_INTERPRET is not set: triton[interpreter] and batched_triton[interpreter] "
              "do not run (set TRITON_INTERPRET=1 before starting to include them)")
    if args.replay is not None:
        case = fuzz.draw_case(args.replay, profile)
        print(f"seed {case.seed} ({profile}): {case.describe()}")
        result = fuzz.run_case(case, args.device, backends=backends, interpreter=interpreter,
                               invariance=args.batch_invariance)
        if not result.outcomes:
            print("  no backend accepts this case here")
        for o in result.outcomes:
            print(f"  {o.backend:<28} {o.status:<8} {o.seconds * 1e3:8.1f} ms  {o.detail or ''}".rstrip())
        return 1 if result.failures else 0

    def on_failure(result) -> None:
        for o in result.failures:
            print(f"FAIL seed {result.case.seed} {o.backend} {o.status}: {o.detail}\n"
                  f"     {result.case.describe()}\n     replay: "
                  f"{fuzz.replay_command(result.case, args.device, args.batch_invariance)}",
                  flush=True)

    report = fuzz.fuzz(args.cases, args.seed, profile=profile, device=args.device, backends=backends,
                       interpreter=interpreter, on_failure=on_failure, jobs=args.jobs,
                       time_limit=args.time_limit, progress=sys.stderr, invariance=args.batch_invariance)
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report.to_dict(), "torch": torch.__version__, "host": pyplatform.node()}, f, indent=1)
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
