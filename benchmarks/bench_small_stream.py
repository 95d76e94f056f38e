"""How fast can a GPU read the bytes of one decode call at all? (H100/H200)

    python benchmarks/bench_small_stream.py [--presets a,b] [--json out.json]

The issue-3 roofline divides a call's bytes by the bandwidth of a multi-GB stream (4.25 TB/s on
an H200). A decode call reads 10-250 MB, and a stream that short pays its launch, the first loads'
latency and the last wave's tail once per kernel; a fused MoE layer also reads in (at least) two
dependent phases: GEMM2's input is all of GEMM1's output. This measures, with the benchmark's
method (CUDA-graph replay, median, buffers rotated so L2 holds none of them):

    read S MB          the best pure read of S MB in one launch over program counts, block sizes
                       and warps (`fusedmoe.bench_kernels.stream_read_kernel`, grid-strided)
    preset M=1         two reads back to back in one graph, sized as the call's GEMM1 weights
                       (top_k experts x 2I x H) and GEMM2 weights (x H x I): the floor for the two
                       dependent weight streams, and one read of both: the floor with no boundary

and prints each as µs, TB/s and % of the multi-GB ceiling, so M=1's % of roofline can be read
against what a pure stream of the same bytes reaches.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from fusedmoe.bench import measure_ceilings, preset_shapes, time_rotated
from fusedmoe.bench_kernels import stream_read_kernel

CONFIGS = [(p, b, w) for p, b, w in itertools.product((1, 2, 4, 8), (2048, 4096, 8192), (4, 8))]


def buffers(nbytes: int, device) -> list[torch.Tensor]:
    """Enough bf16 copies of nbytes that rotating over them defeats L2 (>= 4, >= 256 MB in all)."""
    copies = max(4, -(-(256 << 20) // nbytes))
    return [torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16) for _ in range(copies)]


def reader(sms: int, device):
    partial = torch.empty(8 * sms, device=device, dtype=torch.float32)

    def read(x, cfg):
        per_sm, block, warps = cfg
        stream_read_kernel[(per_sm * sms,)](x, partial, x.numel(), BLOCK=block, num_warps=warps)

    return read


def best_read(read, bufs, configs=CONFIGS) -> tuple[float, tuple]:
    """(median seconds per read, config) of the fastest config."""
    best = None
    for cfg in configs:
        t = time_rotated([lambda x=x, c=cfg: read(x, c) for x in bufs], iters=20)
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,llama-4-maverick,gpt-oss-120b,mixtral-8x7b")
    parser.add_argument("--sizes", default="4,8,16,31,50,75,100,200,400", help="MB of the plain reads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bw = ceilings.bandwidth
    print(f"{ceilings.device}: {bw / 1e12:.2f} TB/s (multi-GB), torch {torch.__version__}, triton {triton.__version__}")
    read = reader(sms, device)
    rows = []
    for mb in (float(s) for s in args.sizes.split(",")):
        nbytes = int(mb * 1e6) // 16 * 16
        t, cfg = best_read(read, buffers(nbytes, device))
        rows.append(dict(kind="read", mb=mb, us=t * 1e6, tbs=nbytes / t / 1e12, pct=100 * nbytes / bw / t, config=cfg))
        print(f"read {mb:6.1f} MB  {t * 1e6:8.2f} us  {nbytes / t / 1e12:5.2f} TB/s  {100 * nbytes / bw / t:5.1f}% "
              f"(programs/SM, block, warps {cfg})", flush=True)
    for name, (_, K, H, inter, _) in preset_shapes(args.presets).items():
        g1 = K * 2 * inter * H * 2
        g2 = K * H * inter * 2
        b1, b2 = buffers(g1, device), buffers(g2, device)
        t1, c1 = best_read(read, b1)
        _, c2 = best_read(read, b2)
        pairs = list(zip(b1, itertools.cycle(b2)))
        t12 = time_rotated([lambda x=x, y=y, c1=c1, c2=c2: (read(x, c1), read(y, c2)) for x, y in pairs], iters=20)
        t_one, _ = best_read(read, buffers(g1 + g2, device))
        roof = (g1 + g2) / bw
        rows.append(dict(kind="preset", preset=name, gemm1_mb=g1 / 1e6, gemm2_mb=g2 / 1e6, two_reads_us=t12 * 1e6,
                         one_read_us=t_one * 1e6, roof_us=roof * 1e6, pct_two=100 * roof / t12,
                         pct_one=100 * roof / t_one))
        print(f"{name:18s} M=1 weights {g1 / 1e6:6.1f} + {g2 / 1e6:6.1f} MB: roof {roof * 1e6:7.2f} us; two reads "
              f"{t12 * 1e6:7.2f} us ({100 * roof / t12:5.1f}% of roof); one read {t_one * 1e6:7.2f} us "
              f"({100 * roof / t_one:5.1f}%)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=ceilings.device, bandwidth=bw, torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
