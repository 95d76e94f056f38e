"""`fusedmoe` command line: explain | demo | env.

    fusedmoe explain --model deepseek-v3 --quant fp8_w8a8_block --ep 8
    fusedmoe explain --experts 64 --hidden 2048 --intermediate 1024 --top-k 6 --platform cuda:9.0 --packages flashinfer
    fusedmoe demo [--model qwen3-30b-a3b] [--tokens 64]
    fusedmoe env [--json]
"""

from __future__ import annotations

import argparse
import json
import platform as pyplatform
import statistics
import sys
import time

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
                      help="divide hidden/intermediate by this (default: fit ~256 MB of weights on CPU)")
    demo.add_argument("--list", action="store_true", help="list the model presets and exit")
    env = sub.add_parser("env", help="versions, device, optional backend packages, FUSEDMOE_* knobs")
    env.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        return {"explain": cmd_explain, "demo": cmd_demo, "env": cmd_env}[args.command](args)
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
    p.add_argument("--bias", action="store_true", default=None)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--swiglu-limit", type=float, default=None)
    p.add_argument("--format", choices=("standard", "batched"), default="standard",
                   help="activation format (batched = per-expert buffers, e.g. DeepEP low-latency)")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--platform", default=None,
                   help="describe another machine: KIND[:MAJOR.MINOR], e.g. cuda:9.0, rocm:9.4, cpu")
    p.add_argument("--packages", default=None,
                   help="with --platform: comma-separated importable packages (flashinfer,deep_gemm,...)")
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

    parallel = dict(dp_size=args.dp, ep_size=args.ep)
    common = dict(
        dtype=DTYPES[args.dtype], quant=args.quant, lora=args.lora, swiglu_limit=args.swiglu_limit,
        activation_format=args.format, backend=args.backend,
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

    result = explain(_config_from_args(args), _platform_from_args(args))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.table())
        if result.error:
            print("\n" + result.error.splitlines()[0])
    return 0 if result.chosen else 1


# demo --------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from fusedmoe.layer import FusedMoE
    from fusedmoe.oracle import explain
    from fusedmoe.platform import Platform
    from fusedmoe.presets import PRESETS, get_preset

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

    times = []
    for _ in range(3 if device.type == "cpu" else 20):
        _sync(device)
        t0 = time.perf_counter()
        layer(x, logits)
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    flops = 6 * args.tokens * model.top_k * model.hidden_size * model.intermediate_size
    print(f"\n  backend      {selection.name} (via {selection.via})")
    print(f"  rel. error   {err:.2e} vs a float64 reference ({'ok' if err < tol else 'TOO LARGE'}, tolerance {tol:.0e})")
    print(f"  time         {t * 1e3:.2f} ms per forward (median of {len(times)}, routing included)")
    print(f"  throughput   {args.tokens / t:,.0f} tokens/s, {flops / t / 1e9:,.1f} GFLOP/s")
    return 0 if err < tol else 1


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


if __name__ == "__main__":
    raise SystemExit(main())
