"""Registers, spills, shared memory and SASS mix of the kernels a preset's call would launch,
compiled for sm90 on this machine (no GPU needed; `fusedmoe.backends.triton.kernel_report`).

    python benchmarks/kernel_report.py --presets mixtral-8x7b --tokens 1,4096 [--quant fp8_w8a8_block]
        [--device-name "NVIDIA H200"] [--tiles 128,64,128,8,3/128,64,128,8,3 [--direct]] [--json out.json]
    python benchmarks/kernel_report.py --diff old.json new.json     # e.g. two trees' reports
    python benchmarks/kernel_report.py ... --loop     # + each GEMM's K loop: instructions per step, mix,
                                                      #   and its hazards (spills, serialized wgmma)
    python benchmarks/kernel_report.py ... --ttgir DIR   # + each GEMM's TTGIR, locations and value names
                                                      #   dropped: `diff -r` two trees' DIRs for what compiles differently

The plan (path, tiles) is the one the library would pick for the preset's problem on an sm90 GPU
of 132 SMs with --device-name's packaged tuned table (default NVIDIA H200; 'none': the tile
rules alone); --tiles overrides it (gemm1/gemm2). The kernels are recorded from a call on CPU
tensors with the preset's H and I and two experts, quantized as `process_weights` lays them out,
with the GPU's launch decisions (TMA descriptors, the PTX weight decode: `as_on_gpu`), so every
constexpr and stride specialisation is the real call's. Registers and SASS
come from this machine's Triton and ptxas: compare variants here, time them on the GPU.
Programs per SM: min(65536 registers / (regs rounded up to 8, the allocation unit, x threads),
228 KiB / (shared + the 1 KiB the driver reserves a program)), at most 32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from fusedmoe import knobs  # noqa: E402
from fusedmoe.backends.triton import kernel_report  # noqa: E402
from fusedmoe.backends.triton.tiles import TileConfig, tile_mode  # noqa: E402
from fusedmoe.bench import preset_quant_reason  # noqa: E402
from fusedmoe.presets import get_preset  # noqa: E402
from fusedmoe.quant.scheme import get_scheme  # noqa: E402

KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K", "SPLIT", "QUANT", "DIRECT",
        "FUSE_AQ", "W_DESC", "A_DESC", "PTX_DECODE", "SWAP_AB", "BLOCK_I", "NUM_STAGES", "SPLIT_N", "PERSISTENT",
        "RS_SYNC", "ONE_DOT", "GROUP_M")
# moe_gemm2_rows_kernel names its K extent BLOCK_I (the whole I) and its stages NUM_STAGES (tl.range's)
TILE_ALIASES = {"BLOCK_K": "BLOCK_I", "num_stages": "NUM_STAGES"}


def table_triton(device_name: str) -> str | None:
    """The Triton version `device_name`'s first tuned table (`tuning.table_paths`) was tuned with,
    or None without one."""
    from fusedmoe.backends.triton import tuning

    paths = tuning.table_paths(device_name)
    return (str(json.loads(paths[0].read_text()).get("triton", "")) or None) if paths else None


def as_on_gpu(device_name: str | None) -> torch.device:
    """Make the tile and launch rules decide as on an sm90 GPU of 132 SMs (named `device_name`:
    its tuned table serves, as on the GPU running the Triton it was tuned with, whatever this
    machine's Triton is; None: the heuristic alone) for CPU tensors: TMA descriptors where their
    rules allow, the PTX weight decode for bf16. Returns the device to plan for."""
    from fusedmoe.backends.triton import experts, quant, tuning, weight_only

    tuning._device_name = lambda d: device_name or "no tuned table"
    tuned_with = table_triton(device_name) if device_name else None
    if tuned_with:  # tables load only under the Triton (major.minor) they were tuned with
        tuning._triton_version = lambda: tuned_with
    for module in (experts, quant, weight_only):
        module._num_sms = lambda d: 132
    experts._sm90 = lambda index: True
    quant._sm90_gpu = lambda d: True  # SWAP_AB's rule
    torch.cuda.current_device = lambda: 0
    weight_only.ptx_decode = lambda x: x.dtype == torch.bfloat16
    weight_only.rs_sync = lambda x: knobs.get("TRITON_RS_SYNC") is not False  # as on a GPU
    return torch.device("cuda")


def parse_tiles(text: str) -> tuple[TileConfig, TileConfig]:
    """--tiles: "GEMM1/GEMM2", each as a tuned table writes it (TileConfig.as_list), e.g.
    16,64,128,4,4,1,null,8,false,true. ValueError / TypeError name what does not parse."""
    from fusedmoe.backends.triton.tuning import _tile

    parts = text.split("/")
    if len(parts) != 2:
        raise ValueError(f"{len(parts)} tiles given, want GEMM1/GEMM2")
    t1, t2 = (_tile(json.loads(f"[{t}]")) for t in parts)
    return t1, t2


def plan(problem, scheme, device: torch.device, tiles: tuple | None,
         direct: bool = False) -> tuple[bool, TileConfig, TileConfig]:
    """(direct?, gemm1 tile, gemm2 tile) the library picks (or --tiles, on the aligned path unless
    --direct)."""
    from fusedmoe.backends.triton import experts

    if tiles:
        return direct, *tiles
    return experts.choose_plan(problem, scheme, device)


def record(preset, tokens: int, scheme, dtype, direct: bool, t1: TileConfig, t2: TileConfig):
    """The launches of one call with the preset's H, I and biases, two experts, the given plan."""
    from fusedmoe.backends.triton.experts import triton_experts
    from fusedmoe.backends.triton.quant import triton_quant_experts
    from fusedmoe.backends.triton.weight_only import prepare_weights
    from fusedmoe.modular import ExpertWeights
    from fusedmoe.quant.weights import quantize_weights

    E, K, H = 2, preset.top_k, preset.hidden_size
    inter = preset.intermediate_size // preset.bench_tp
    gated = preset.activation not in ("relu2_no_mul",)
    rows = 2 * inter if gated else inter
    x = torch.zeros(tokens, H, dtype=dtype)
    ids = (torch.arange(tokens * K) % E).view(tokens, K).to(torch.int32)
    w = torch.full((tokens, K), 1.0 / K)
    w13, w2 = torch.zeros(E, rows, H, dtype=dtype), torch.zeros(E, H, inter, dtype=dtype)
    b13, b2 = (torch.zeros(E, rows, dtype=dtype), torch.zeros(E, H, dtype=dtype)) if preset.has_bias else (None, None)
    common = (b13, b2, None, E, preset.activation, False, 1.702, None)
    with kernel_report.recording() as calls:
        if scheme is None:
            triton_experts(x, w13, w2, w, ids, *common, tiles=(t1, t2), direct=direct)
        else:
            static = (1.0, 1.0) if scheme.name.endswith("_static") else None  # static activation scales
            q13, q2, params = quantize_weights(w13, w2, scheme, activation_amax=static)  # as bench: the dtype's scales
            weights = prepare_weights(ExpertWeights(q13, q2, quant=params))
            p = weights.quant
            triton_quant_experts(x, weights.w13, weights.w2, w, ids, *common, scheme, p.w13_scale, p.w2_scale,
                                 p.a13_scale, p.a2_scale, tiles=(t1, t2), w13_global_scale=p.w13_global_scale,
                                 w2_global_scale=p.w2_global_scale, direct=direct or None,
                                 w13_zero=p.w13_zero, w2_zero=p.w2_zero)
    return calls


def diff(old_path: str, new_path: str) -> int:
    """Per cell and kernel of two reports: registers, spill stack, instructions, global loads and
    programs per SM, old -> new."""
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    cell = lambda r: (r["preset"], r["tokens"], r["path"], r["kernel"])  # noqa: E731
    by_cell = {cell(r): r for r in new["rows"]}
    print(f"Triton {old['triton']} -> {new['triton']} ({old['quant'] or old['dtype']})")
    print(f"{'preset':16} {'M':>5} {'kernel':24} {'regs':>10} {'stack':>9} {'instr':>13} {'LDG':>9} {'/SM':>6}")
    for a in old["rows"]:
        b = by_cell.get(cell(a))
        if b is None:
            print(f"{a['preset']:16} {a['tokens']:>5} {a['kernel']:24} (not in {new_path})")
            continue
        print(f"{a['preset']:16} {a['tokens']:>5} {a['kernel']:24} {a['regs']:>4} -> {b['regs']:<3} "
              f"{a['stack']:>3} -> {b['stack']:<3} {a['instructions']:>5} -> {b['instructions']:<5} "
              f"{a['opcodes']['LDG']:>3} -> {b['opcodes']['LDG']:<3} {a['programs_per_sm']:>2} -> {b['programs_per_sm']}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,64,4096")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--device-name", default="NVIDIA H200",
                    help="plan with this GPU's packaged tuned table ('none': the heuristic alone)")
    ap.add_argument("--tiles", default=None,
                    help="gemm1/gemm2 tiles as a tuned table lists them (the aligned path; --direct: the direct one), e.g. "
                         "128,64,128,8,3/128,64,128,8,3 or 16,64,128,4,4,1,null,8,false,true/16,128,64,4,4")
    ap.add_argument("--direct", action="store_true",
                    help="with --tiles: run them on the direct decode path (GEMM1 by slot, GEMM2 with the top-k sum)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--loop", action="store_true",
                    help="also print each GEMM's longest loop (its K step): instructions and opcode mix")
    ap.add_argument("--ttgir", default=None, metavar="DIR",
                    help="write each GEMM kernel's TTGIR (locations and value names dropped) to DIR/<preset>_M<tokens>_<kernel>.ttgir")
    ap.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"), default=None,
                    help="compare two --json reports of the same cells (e.g. two source trees) and exit")
    args = ap.parse_args(argv)
    try:
        tiles = parse_tiles(args.tiles) if args.tiles else None
    except (ValueError, TypeError) as exc:  # json's errors are ValueErrors
        ap.error(f"--tiles {args.tiles!r}: {exc}")
    if args.diff:
        return diff(*args.diff)
    reason = kernel_report.unavailable()
    if reason:
        print(f"cannot compile for sm90 here: {reason}", file=sys.stderr)
        return 2
    import triton

    from fusedmoe.activations import is_gated
    from fusedmoe.backends.triton.experts import GemmProblem

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    scheme = get_scheme(args.quant)
    tile_mode(scheme)  # a scheme the Triton GEMMs run, or a clear error
    rows = []
    device = as_on_gpu(None if args.device_name.lower() == "none" else args.device_name)
    with knobs.override(TRITON_TMA="force"):  # sm90: descriptors where tma_reasons allows
        for name in args.presets.split(","):
            preset = get_preset(name)
            if args.quant and (why := preset_quant_reason(preset, args.quant)):  # as fusedmoe bench
                print(f"kernel_report: skipping {name}: {why}", file=sys.stderr)
                continue
            for tokens in map(int, args.tokens.split(",")):
                inter = preset.intermediate_size // preset.bench_tp
                problem = GemmProblem(tokens * preset.top_k, preset.num_experts, preset.hidden_size, inter,
                                      preset.top_k, is_gated(preset.activation), dtype)
                direct, t1, t2 = plan(problem, scheme, device, tiles, args.direct)
                for call in record(preset, tokens, scheme, dtype, direct, t1, t2):
                    if not call.name.startswith("moe_gemm"):
                        continue
                    compiled = kernel_report.compile_call(call)
                    u = kernel_report.usage(compiled)
                    if args.ttgir:
                        os.makedirs(args.ttgir, exist_ok=True)
                        with open(os.path.join(args.ttgir, f"{name}_M{tokens}_{call.name}.ttgir"), "w") as f:
                            f.write(kernel_report.plain_ttgir(compiled.asm["ttgir"]))
                    threads = 32 * call.kwargs.get("num_warps", 4)
                    per_sm = kernel_report.programs_per_sm(u["regs"], threads, u["shared"])
                    rows.append({"preset": name, "tokens": tokens, "path": "direct" if direct else "aligned",
                                 "kernel": call.name, **{k: call.kwargs[k] for k in KEYS if k in call.kwargs},
                                 **u, "programs_per_sm": per_sm})
    name = None if args.device_name.lower() == "none" else args.device_name
    tuned_with = table_triton(name) if name else None
    source = f"{name}'s tuned table (Triton {tuned_with})" if tuned_with else "the heuristic"
    print(f"sm90 compile with Triton {triton.__version__} ({args.quant or args.dtype}); plans: {source}")
    print(f"{'preset':16} {'M':>5} {'path':7} {'kernel':26} {'tile (m,n,k,w,s)':22} {'regs':>4} {'stack':>5} "
          f"{'smem':>7} {'/SM':>3} {'instr':>6}  key opcodes")
    for r in rows:
        tile = ",".join(str(r.get(k, r.get(TILE_ALIASES.get(k, k), "-")))
                        for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
        tile += ",p" if r.get("PERSISTENT") else ""  # a persistent launch (TileConfig.persistent)
        tile += ",1dot" if r.get("ONE_DOT") else ""  # gate and up as one dot (TileConfig.one_dot)
        tile += f",x{r['SPLIT_K']}" if r.get("SPLIT_K", 1) > 1 else ""  # GEMM1's K split (TileConfig.split_k)
        tile += f",x{r['SPLIT']}" if r.get("SPLIT", 1) > 1 else ""  # the direct GEMM2's slot shares
        ops = " ".join(f"{k}={v}" for k, v in r["opcodes"].items() if v)
        print(f"{r['preset']:16} {r['tokens']:>5} {r['path']:7} {r['kernel']:26} {tile:22} {r['regs']:>4} "
              f"{r['stack']:>5} {r['shared']:>7} {r['programs_per_sm']:>3} {r['instructions']:>6}  {ops}")
        if args.loop:
            loop = r["loop"]
            mix = " ".join(f"{k}={v}" for k, v in list(loop["opcodes"].items())[:16])
            print(f"{'':16} {'':>5} {'':7} {'  its longest loop (the K step)':47} {loop['instructions']:>27}  {mix}")
            for hazard in kernel_report.loop_hazards(loop):
                print(f"{'':16} {'':>5} {'':7}   ! {hazard}")
        for hazard in r.get("asm_pack", []):  # printed with or without --loop: a wrong decode
            print(f"{'':16} {'':>5} {'':7}   ! {hazard} (kernel_report.asm_pack_hazards)")
        if r["wgmma_rs"] and max(r["wgmma_waits"], default=0) > 0:  # printed with or without --loop: a race
            print(f"{'':16} {'':>5} {'':7}   ! register-operand wgmma left in flight (waits {r['wgmma_waits']}): "
                  "the race kernels._rs_sync closes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "quant": args.quant, "dtype": args.dtype, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
