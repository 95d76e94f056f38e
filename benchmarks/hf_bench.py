"""One transformers MoE block at a real model's layer size, bf16 on a GPU: fusedmoe against
transformers' own experts implementations, each launched eagerly and replayed as a CUDA graph.

    modes   eager | batched_mm | grouped_mm      transformers' experts (router and shared in HF)
            fusedmoe                             experts_implementation="fusedmoe" (experts only)
            patch                                fusedmoe.hf.patch: router + experts + shared fused
            patch-cg                             patch(cuda_graphs=True): launched eagerly, each
                                                 block replays its own CUDA graph per input shape
                                                 (up to 64 tokens; longer inputs run as patch)
            MODE+graph (--graph)                 the same blocks captured once and replayed as one
                                                 CUDA graph: batched_mm, grouped_mm (written to
                                                 be capturable: histc, not bincount),
                                                 fusedmoe, patch; eager only where it is
                                                 transformers' one implementation (experts not
                                                 dispatched: Llama-4). A mode that cannot be
                                                 captured (a host sync) is a row with the reason.
    timing  the block's forward on x [1, T, H], 4 block copies rotated (decode reads HBM, not L2),
            median of CUDA-event timings (a graph replay covers the copies; us is per block)
    speedup like with like: eager-launched rows against transformers' eager-launched modes,
            +graph rows against transformers' +graph rows; vs eager, vs grouped_mm, and vs the
            fastest transformers mode of the same launch (best_hf names it; in `generate`
            transformers itself runs grouped_mm for prefill and batched_mm for decode)
    check   each mode's output against eager's (a +graph row: the replayed output): relative
            error, bf16 agreement at this size

Sizes are the presets' (`fusedmoe.presets`, per-GPU intermediate = intermediate / bench_tp).
Usage (GPU):  python benchmarks/hf_bench.py [--families mixtral,qwen3_moe,deepseek_v3,gpt_oss,llama4_text]
              [--tokens 1,16,256,4096] [--graph] [--out benchmarks/results/DATE_DEVICE_COMMIT_hf]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import statistics
import sys
from importlib import import_module

import torch

import fusedmoe.hf as fh
from fusedmoe.hf.layouts import LAYOUTS
from fusedmoe.presets import get_preset

GRAPH = "+graph"
HF_MODES = ("eager", "batched_mm", "grouped_mm")  # transformers' experts implementations

# family -> (preset, config keywords of that preset's shape). Shared experts as the real models.
SHAPES = {
    "mixtral": ("mixtral-8x7b", lambda p, i: dict(
        hidden_size=p.hidden_size, intermediate_size=i, num_local_experts=p.num_experts,
        num_experts_per_tok=p.top_k)),
    "qwen3_moe": ("qwen3-30b-a3b", lambda p, i: dict(
        hidden_size=p.hidden_size, moe_intermediate_size=i, num_experts=p.num_experts,
        num_experts_per_tok=p.top_k, norm_topk_prob=True)),
    "deepseek_v3": ("deepseek-v3", lambda p, i: dict(
        hidden_size=p.hidden_size, moe_intermediate_size=i, n_routed_experts=p.num_experts,
        num_experts_per_tok=p.top_k, n_group=8, topk_group=4, n_shared_experts=1,
        routed_scaling_factor=2.5)),
    "gpt_oss": ("gpt-oss-120b", lambda p, i: dict(
        hidden_size=p.hidden_size, intermediate_size=i, num_local_experts=p.num_experts,
        num_experts_per_tok=p.top_k)),
    "llama4_text": ("llama-4-maverick", lambda p, i: dict(
        hidden_size=p.hidden_size, intermediate_size=i, intermediate_size_mlp=i,
        num_local_experts=p.num_experts, num_experts_per_tok=p.top_k)),
}


class CaptureError(RuntimeError):
    """A CUDA graph capture failed; the message gives the first error (inside it, or at its end)."""


def modes_for(fam: fh.Family, *, graph: bool) -> list[str]:
    """The family's modes in table order: eager-launched ones, then (graph) the +graph ones."""
    dispatched = LAYOUTS[fam.layout].dispatched  # experts classes transformers dispatches
    hf = list(HF_MODES) if dispatched else ["eager"]
    hook = ["fusedmoe"] if fam.layout in ("fused", "up_only") else []  # read as they are
    modes = [*hf, *hook, "patch", "patch-cg"]
    if graph:
        # transformers' eager experts loop over the hit experts (`nonzero`: a host sync); tried
        # only where it is transformers' one implementation, as its graph baseline.
        captured = [m for m in hf if m != "eager"] if dispatched else hf
        modes += [m + GRAPH for m in (*captured, *hook, "patch")]
    return modes


def run_order(modes: list[str]) -> list[str]:
    """Execution order: every transformers and hook mode before `patch` changes the blocks."""
    return sorted(modes, key=lambda m: m.startswith("patch"))


def launch(mode: str) -> str:
    return "graph" if mode.endswith(GRAPH) else "eager"


def add_speedups(rows: list[dict]) -> None:
    """Speed-ups of one (family, tokens) group's rows, each against transformers' modes of the
    same launch: eager rows vs eager rows, +graph rows vs +graph rows (nan where that baseline
    did not run)."""
    for kind in ("eager", "graph"):
        suffix = GRAPH if kind == "graph" else ""
        timed = {r["mode"]: r["us"] for r in rows if launch(r["mode"]) == kind and "error" not in r}
        hf = {m: timed[m + suffix] for m in HF_MODES if m + suffix in timed}
        best = min(hf, key=hf.get) if hf else None
        for r in rows:
            if launch(r["mode"]) != kind or "error" in r:
                continue
            r["speedup_vs_eager"] = hf.get("eager", math.nan) / r["us"]
            r["speedup_vs_grouped_mm"] = hf.get("grouped_mm", math.nan) / r["us"]
            r["speedup_vs_best_hf"] = hf[best] / r["us"] if best else math.nan
            r["best_hf"] = best + suffix if best else ""


def make_blocks(family: str, copies: int, device: torch.device, seed: int = 0):
    """`copies` MoE blocks of the family at its preset's size, bf16, random weights (std 1/sqrt(H))."""
    fam = fh.family(family)
    preset_name, keywords = SHAPES[family]
    preset = get_preset(preset_name)
    inter = preset.intermediate_size // preset.bench_tp
    from fusedmoe.hf.models import tiny_config

    config = tiny_config(fam, **keywords(preset, inter))
    block_cls = getattr(import_module(fam.module_path), fam.block)
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = []
    for _ in range(copies):
        with torch.device(device):
            block = block_cls(config).to(torch.bfloat16).eval()
        with torch.no_grad():
            for t in list(block.parameters()) + list(block.buffers()):
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, device=device, generator=gen) / preset.hidden_size**0.5)
        blocks.append(block)
    return fam, preset, inter, config, torch.nn.ModuleList(blocks)


def _events_median(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def capture(fn):
    """(CUDA graph of fn(), fn's output in the graph's memory); raises CaptureError with the
    first error inside the capture (a host sync, a pageable copy, an allocation failure)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream: lazy allocations, cuBLAS workspaces
        torch.cuda.synchronize()
        graph.capture_begin()
        try:
            out = fn()
        except Exception as exc:
            # The capture is invalid already; capture_end only ends it (and says so).
            with contextlib.suppress(RuntimeError):
                graph.capture_end()
            raise CaptureError(f"capture failed: {type(exc).__name__}: {exc}") from exc
        try:
            graph.capture_end()
        except RuntimeError as exc:
            raise CaptureError(f"capture failed at its end: {exc}") from exc
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def time_blocks(blocks, x, *, graph: bool, iters: int = 20) -> tuple[float, torch.Tensor]:
    """(median seconds per block call rotating over the copies, the first block's output);
    eager launches, or one CUDA graph of all copies (the output then from its replay)."""
    def run():
        return [first_output(block(x)) for block in blocks]

    with torch.no_grad():
        out = run()[0].float()  # warm-up: Triton JIT, tile lookup, transformers' lazy kernels
        torch.cuda.synchronize()
        if not graph:
            return _events_median(run, iters) / len(blocks), out
        g, outs = capture(run)
        g.replay()
        out = outs[0].float()  # a copy outside the graph's memory pool
        return _events_median(g.replay, iters) / len(blocks), out


def first_output(out):
    return out[0] if isinstance(out, tuple) else out


def bench_family(family: str, tokens_list, device, *, copies: int, graph: bool) -> list[dict]:
    fam, preset, inter, config, blocks = make_blocks(family, copies, device)
    modes = modes_for(fam, graph=graph)
    dispatched = "batched_mm" in modes
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for tokens in tokens_list:
        x = torch.randn(1, tokens, preset.hidden_size, device=device, generator=gen, dtype=torch.bfloat16)
        ref, these = None, []
        patched_graphs = None  # how the blocks are patched now: None (not), False, True (cuda_graphs)
        for mode in run_order(modes):
            impl = mode.removesuffix(GRAPH)
            row = dict(family=fam.name, preset=preset.name, experts=preset.num_experts, top_k=preset.top_k,
                       hidden=preset.hidden_size, intermediate=inter, tokens=tokens, mode=mode,
                       launch=launch(mode))
            try:
                if impl in ("patch", "patch-cg"):
                    if patched_graphs is not None and patched_graphs != (impl == "patch-cg"):
                        fh.unpatch(blocks)
                        patched_graphs = None
                    if patched_graphs is None:
                        fh.patch(blocks, cuda_graphs=impl == "patch-cg")
                        patched_graphs = impl == "patch-cg"
                elif dispatched:
                    config._experts_implementation = impl
                t, out = time_blocks(blocks, x, graph=mode.endswith(GRAPH))
                if mode == "eager":  # runs first: every row's reference
                    ref = out
                err = math.nan if ref is None else ((out - ref).norm() / ref.norm()).item()
                row.update(us=t * 1e6, rel_err=err)
            except Exception as exc:  # a mode that cannot run here is a row with its reason
                reason = " ".join(str(exc).split())  # CUDA errors span lines
                row.update(us=math.nan, error=f"{type(exc).__name__}: {reason}"[:200])
            these.append(row)
        if fh.is_patched(blocks):
            fh.unpatch(blocks)
        these.sort(key=lambda r: modes.index(r["mode"]))
        add_speedups(these)
        rows += these
    del blocks
    torch.cuda.empty_cache()
    return rows


def _times(x) -> str:
    """A speed-up as "1.23x", "-" where the row has no such baseline (nan / missing)."""
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"


def format_rows(rows) -> str:
    head = (f"{'family':12} {'M':>5} {'mode':16} {'us':>10} {'rel_err':>9} "
            f"{'vs eager':>9} {'vs grouped_mm':>13} {'vs best HF':>11}  best HF")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['family']:12} {r['tokens']:>5} {r['mode']:16}  error: {r['error']}")
            continue
        lines.append(
            f"{r['family']:12} {r['tokens']:>5} {r['mode']:16} {r['us']:>10.1f} "
            f"{r['rel_err']:>9.2e} {_times(r.get('speedup_vs_eager')):>9} "
            f"{_times(r.get('speedup_vs_grouped_mm')):>13} "
            f"{_times(r.get('speedup_vs_best_hf')):>11}  {r.get('best_hf', '')}"
        )
    lines.append("speed-ups: eager-launched rows against transformers' eager-launched modes, "
                 "+graph rows against its +graph modes")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--families", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--copies", type=int, default=4, help="block copies rotated per timing (>= 4)")
    parser.add_argument("--graph", action="store_true",
                        help="add the MODE+graph rows: each mode's blocks replayed as one CUDA graph "
                             "(transformers' modes too, where they capture)")
    parser.add_argument("--out", default=None, help="write OUT.txt, OUT.csv and OUT.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_bench.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    import transformers

    from fusedmoe.cli import _commit, source_digest

    meta = dict(device=torch.cuda.get_device_name(device), commit=_commit(), source=source_digest(),
                torch=torch.__version__,
                transformers=transformers.__version__, date=datetime.date.today().isoformat(),
                dtype="bfloat16", copies=args.copies, graph=args.graph)
    rows = []
    for family in args.families.split(","):
        print(f"... {family}", file=sys.stderr)
        rows += bench_family(family, [int(t) for t in args.tokens.split(",")], device,
                             copies=args.copies, graph=args.graph)
    text = "# " + json.dumps(meta) + "\n" + format_rows(rows)
    print(text)
    if args.out:
        with open(args.out + ".txt", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        keys = sorted({k for r in rows for k in r})
        with open(args.out + ".csv", "w", newline="") as f:
            f.write("# " + json.dumps(meta) + "\n")
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
