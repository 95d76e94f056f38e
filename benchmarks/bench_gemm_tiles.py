"""GEMM1 and GEMM2 of the Triton backend alone, on explicit tiles, over presets and token counts

    python benchmarks/bench_gemm_tiles.py --quant mxfp4_w4a16 --cells qwen3-30b-a3b:16,deepseek-v3:64 \
        --gemm1 16x64x64x4x4,16x64x64x4x4:one_dot --gemm2 16x64x64x4x4,16x128x128x4x3:persistent \
        [--programs 1,2,4] [--rounds 2] [--direct] [--json out.json]

Each GEMM is timed as `fusedmoe tune` times it (`tune._gemms`: the launch of one GEMM on weight copy
i of 4 rotated copies, quantized and laid out as the layer's process_weights leaves them; a
CUDA-graph replay, the median of 30), on uniform routing; --direct times the decode path's GEMMs
(`tune._direct_gemms`: GEMM1 by slot, GEMM2 by token with the top-k sum) instead. A tile is
BLOCK_M x BLOCK_N x BLOCK_K x warps x stages[x split_k], then any of ':persistent', ':one_dot'
(`TileConfig` fields). Persistent tiles run at each --programs value (programs per SM: the
launch's `PERSISTENT_PROGRAMS` / `W4_PERSISTENT_PROGRAMS`). The tiles of a GEMM alternate within
a round, and rounds repeat the whole list, so a drifting clock shows as spread, not as a
difference between tiles.

Checked per cell against the first tile of each list: GEMM2's output y bitwise (a persistent
launch runs the same tile body; 'maxdiff' is its largest difference), GEMM1's intermediate by
relative error (one_dot reorders nothing a row sees, but the dot shapes differ). TB/s counts the
experts the routing touches at the scheme's stored width (`bench.quant_bytes`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import fusedmoe.backends.triton.experts as experts_mod
from fusedmoe.backends.triton.tiles import TileConfig
from fusedmoe.bench import preset_shapes, quant_bytes
from fusedmoe.quant.scheme import get_scheme
from fusedmoe.routing import select_experts
from fusedmoe.tune import _direct_gemms, _gemms, _median_us, _weight_copy

FLAGS = ("persistent", "one_dot")


def parse_tile(text: str) -> TileConfig:
    """'16x64x64x4x4[x2][:persistent][:one_dot]' -> TileConfig."""
    size, *flags = text.split(":")
    unknown = set(flags) - set(FLAGS)
    if unknown:
        raise SystemExit(f"tile {text!r}: unknown flag(s) {sorted(unknown)}; choose from {FLAGS}")
    values = [int(v) for v in size.split("x")]
    if not 5 <= len(values) <= 6:
        raise SystemExit(f"tile {text!r}: BLOCK_M x BLOCK_N x BLOCK_K x warps x stages [x split_k]")
    return TileConfig(*values, **{f: True for f in flags})


def label(tile: TileConfig, programs: int | None) -> str:
    text = "x".join(str(v) for v in (tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages))
    text += f"x{tile.split_k}" if tile.split_k > 1 else ""
    text += "".join(f":{f}" for f in FLAGS if getattr(tile, f))
    return text + (f" P={programs}" if programs else "")


def variants(tiles: list[TileConfig], programs: list[int]) -> list[tuple[TileConfig, int | None]]:
    return [(t, p) for t in tiles for p in (programs if t.persistent else [None])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default=None, help="a weight-only or W8A8 scheme (default: bf16 weights)")
    ap.add_argument("--cells", required=True, help="preset:M, comma separated")
    ap.add_argument("--gemm1", default="", help="GEMM1 tiles, comma separated")
    ap.add_argument("--gemm2", default="", help="GEMM2 tiles, comma separated")
    ap.add_argument("--programs", default="1,2,4", help="programs per SM of the persistent tiles")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--direct", action="store_true", help="the direct (decode) path's GEMMs, block_m 16")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke run under TRITON_INTERPRET=1 (one eager call a copy, with --scale)")
    ap.add_argument("--scale", type=int, default=1, help="divide H and I by this (multiples of 64 kept)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="H of every cell instead of the preset's (e.g. 4032 / 4096 / 4160: whether a power-of-two "
                         "row-block stride of the fragment layout costs bandwidth)")
    ap.add_argument("--inter", type=int, default=None, help="I of every cell instead of the preset's")
    args = ap.parse_args()
    for flag, value in (("--hidden", args.hidden), ("--inter", args.inter)):
        if value is not None and (value < 64 or value % 64):
            raise SystemExit(f"{flag} {value}: a multiple of 64 (the 4-bit fragments' K and N unit)")
    device = torch.device(args.device)
    scheme = get_scheme(args.quant) if args.quant else None
    programs = [int(p) for p in args.programs.split(",")]
    lists = {kind: variants([parse_tile(t) for t in text.split(",") if t], programs)
             for kind, text in (("gemm1", args.gemm1), ("gemm2", args.gemm2))}
    name_of = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"{name_of}; torch {torch.__version__}; {args.quant or 'bf16'}")
    rows = []
    for cell in args.cells.split(","):
        name, tokens = cell.split(":")
        tokens = int(tokens)
        E, K, H, I, act = preset_shapes(name)[name]
        H, I = args.hidden or H, args.inter or I
        H, I = (max(64, v // args.scale // 64 * 64) for v in (H, I))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(0)
        weights = [_weight_copy(E, H, I, True, dtype, scheme, gen) for _ in range(4)]
        x = torch.randn(tokens, H, device=device, generator=gen).to(dtype)
        topk_w, ids = select_experts(x, torch.randn(tokens, E, device=device, generator=gen), K)
        first = next(iter(lists["gemm1"] or lists["gemm2"]))[0]
        if args.direct:
            gemm1, gemm2, launch, out = _direct_gemms(scheme, weights, x, topk_w, ids, E, I, act, first)
        else:
            (gemm1, gemm2, launch), out = _gemms(scheme, weights, x, topk_w, ids, E, I, act, first), None
        touched = int(torch.unique(ids).numel())
        per_weight = quant_bytes(args.quant)[0]
        nbytes = {"gemm1": touched * 2 * I * H * per_weight, "gemm2": touched * I * H * per_weight}
        gemm = {"gemm1": gemm1, "gemm2": gemm2}
        timed1 = gemm1.__defaults__[0]  # the launch the timed GEMM1 writes (tune._gemms keeps GEMM2's input apart)
        output = {"gemm1": timed1.a if hasattr(timed1, "a") else timed1.L.a,
                  "gemm2": launch.y if out is None else out}
        times: dict[tuple, list[float]] = {}
        checks: dict[tuple, str] = {}
        for kind, tiles in lists.items():
            reference = None
            for tile, p in tiles:
                set_programs(p)
                output[kind].fill_(float("nan"))
                gemm[kind](0, tile)
                out = output[kind].float().clone()
                if reference is None:
                    reference, checks[(kind, tile, p)] = out, "reference"
                elif kind == "gemm2":
                    diff = (out - reference).abs().nan_to_num(float("inf")).max().item()
                    checks[(kind, tile, p)] = f"maxdiff {diff:.1e}"
                else:  # the rows of the intermediate a GEMM1 writes (padding rows keep the poison)
                    live = torch.isfinite(reference).all(dim=1)
                    err = ((out[live] - reference[live]).norm() / reference[live].norm()).item()
                    checks[(kind, tile, p)] = f"rel err {err:.1e}"
        for _ in range(args.rounds):
            for kind, tiles in lists.items():
                for tile, p in tiles:
                    set_programs(p)
                    times.setdefault((kind, tile, p), []).append(
                        timer(lambda i, g=gemm[kind], t=tile: g(i, t), device))
        for (kind, tile, p), us in times.items():
            best = min(us)
            row = dict(preset=name, tokens=tokens, hidden=H, inter=I, gemm=kind, tile=label(tile, p), us=us,
                       tbps=nbytes[kind] / best / 1e6, check=checks[(kind, tile, p)])
            rows.append(row)
            print(f"{name:16} M={tokens:<5} H={H:<5} I={I:<5} {kind} {row['tile']:34} {' / '.join(f'{u:7.1f}' for u in us)} us  "
                  f"{row['tbps']:5.2f} TB/s  {row['check']}", flush=True)
        set_programs(None)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


DEFAULT_PROGRAMS = (experts_mod.PERSISTENT_PROGRAMS, experts_mod.W4_PERSISTENT_PROGRAMS)


def timer(fn, device: torch.device) -> float:
    """us per call of fn(i) over the 4 copies: the tuner's CUDA-graph median on a GPU, one eager
    pass on the CPU (a smoke run: the interpreter's time means nothing)."""
    if device.type == "cuda":
        return _median_us(fn, 4, iters=30)
    start = time.perf_counter()
    for i in range(4):
        fn(i)
    return (time.perf_counter() - start) / 4 * 1e6


def set_programs(programs: int | None) -> None:
    """Programs per SM of the next persistent launches (None: the library's own)."""
    one, w4 = DEFAULT_PROGRAMS if programs is None else (programs, programs)
    experts_mod.PERSISTENT_PROGRAMS, experts_mod.W4_PERSISTENT_PROGRAMS = one, w4


if __name__ == "__main__":
    main()
