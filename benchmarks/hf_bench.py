"""One transformers MoE block at a real model's layer size, bf16 on a GPU: fusedmoe against
transformers' own experts implementations.

    modes   eager | batched_mm | grouped_mm      transformers' experts (router and shared in HF)
            fusedmoe                             experts_implementation="fusedmoe" (experts only)
            patch                                fusedmoe.hf.patch: router + experts + shared fused
    timing  the block's forward on x [1, T, H], 4 block copies rotated (decode reads HBM, not L2),
            median of CUDA-event timings, every mode launched eagerly (as transformers runs it);
            with --graph also "patch+graph": the patched blocks replayed as one CUDA graph
            (transformers' eager experts sync the host and cannot be captured)
    check   each mode's output against eager's: relative error (bf16 agreement at this size)

Sizes are the presets' (`fusedmoe.presets`, per-GPU intermediate = intermediate / bench_tp).
Usage (GPU):  python benchmarks/hf_bench.py [--families mixtral,qwen3_moe,deepseek_v3,gpt_oss,llama4_text]
              [--tokens 1,16,256,4096] [--out benchmarks/results/DATE_DEVICE_COMMIT_hf]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys
from importlib import import_module

import torch

import fusedmoe.hf as fh
from fusedmoe.presets import get_preset

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


def time_blocks(blocks, x, *, graph: bool, iters: int = 20) -> float:
    """Median seconds per block call, rotating over the copies; eager launches or one CUDA graph."""
    def run():
        for block in blocks:
            block(x)

    with torch.no_grad():
        run()  # warm-up: Triton JIT, tile lookup, transformers' lazy kernels
        torch.cuda.synchronize()
        if not graph:
            return _events_median(run, iters) / len(blocks)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        g.replay()
        torch.cuda.synchronize()
        return _events_median(g.replay, iters) / len(blocks)


def first_output(out):
    return out[0] if isinstance(out, tuple) else out


def bench_family(family: str, tokens_list, device, *, copies: int, graph: bool) -> list[dict]:
    fam, preset, inter, config, blocks = make_blocks(family, copies, device)
    modes = ["patch", "patch+graph"] if graph else ["patch"]
    if fam.layout not in ("transposed", "dbrx"):  # experts classes transformers dispatches
        modes[:0] = ["eager", "batched_mm", "grouped_mm"]
        if fam.layout in ("fused", "up_only"):  # the hook reads these layouts as they are
            modes.insert(3, "fusedmoe")
    else:
        modes.insert(0, "eager")
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for tokens in tokens_list:
        x = torch.randn(1, tokens, preset.hidden_size, device=device, generator=gen, dtype=torch.bfloat16)
        results, ref, these = {}, None, []
        for mode in modes:
            row = dict(family=fam.name, preset=preset.name, experts=preset.num_experts, top_k=preset.top_k,
                       hidden=preset.hidden_size, intermediate=inter, tokens=tokens, mode=mode)
            try:
                if mode.startswith("patch") and not fh.is_patched(blocks):
                    fh.patch(blocks)
                elif mode != "eager" or "batched_mm" in modes:
                    config._experts_implementation = mode
                with torch.no_grad():
                    out = first_output(blocks[0](x)).float()
                if ref is None:
                    ref = out
                t = time_blocks(blocks, x, graph=mode == "patch+graph")
                row.update(us=t * 1e6, rel_err=((out - ref).norm() / ref.norm()).item())
                results[mode] = t
            except Exception as exc:  # a mode that cannot run here is a row with its reason
                row.update(us=float("nan"), error=f"{type(exc).__name__}: {exc}"[:200])
            finally:
                if mode == modes[-1] and fh.is_patched(blocks):
                    fh.unpatch(blocks)
            these.append(row)
        for row in these:
            if row["mode"] in results:
                row["speedup_vs_eager"] = results.get("eager", float("nan")) / results[row["mode"]]
                row["speedup_vs_grouped_mm"] = results.get("grouped_mm", float("nan")) / results[row["mode"]]
        rows += these
    del blocks
    torch.cuda.empty_cache()
    return rows


def format_rows(rows) -> str:
    head = (f"{'family':12} {'M':>5} {'mode':11} {'us':>10} {'rel_err':>9} "
            f"{'vs eager':>9} {'vs grouped_mm':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['family']:12} {r['tokens']:>5} {r['mode']:11}  error: {r['error']}")
            continue
        lines.append(
            f"{r['family']:12} {r['tokens']:>5} {r['mode']:11} {r['us']:>10.1f} "
            f"{r['rel_err']:>9.2e} {r.get('speedup_vs_eager', float('nan')):>8.2f}x "
            f"{r.get('speedup_vs_grouped_mm', float('nan')):>12.2f}x"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--copies", type=int, default=4, help="block copies rotated per timing (>= 4)")
    parser.add_argument("--graph", action="store_true",
                        help="add a patch+graph row: the patched blocks replayed as a CUDA graph")
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
