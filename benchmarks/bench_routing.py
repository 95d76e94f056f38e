"""`select_experts` on the GPU: the torch ops against `moe_routing_kernel` (one Triton launch).

    python benchmarks/bench_routing.py [--presets qwen3-30b-a3b,deepseek-v3,...] [--tokens 1,16,256,4096]

Per (preset routing, M), both ways in one process (FUSEDMOE_TRITON_ROUTING=0 / 1 through
`knobs.override`), in us a call:

- `graph`: the call captured in a CUDA graph, `--calls` calls in one graph, replayed and timed
  with CUDA events: the GPU's time (each small launch's ~2 us floor included);
- `host`: `--calls` eager calls back to back without synchronizing, divided by `--calls`: the
  host's cost of one call when it exceeds the GPU's.

Logits are fp32 N(0, 1) draws [M, E] (bf16 ones tie often at E = 128-384, and tied ids may come
out in either order) and a fresh N(0, 0.3) correction bias where the preset has one. Before
timing, both paths' results are compared: each row's sorted weights to float32 rounding (another
expert picked brings another weight), and the rows whose ids differ (ties) are counted.
"""

from __future__ import annotations

import argparse

import torch

from fusedmoe import knobs, select_experts
from fusedmoe.bench import host_us, time_rotated
from fusedmoe.presets import get_preset


def _graph_us(fn, calls: int) -> float:
    """GPU us a call: `calls` calls captured in one CUDA graph, the median of 5 replays."""
    return time_rotated([fn] * calls, iters=5) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,llama-4-maverick,kimi-k2")
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_routing.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; select_experts, us a call "
          "(graph: GPU time in a CUDA graph; host: eager, back to back)")
    print(f"{'preset':18} {'E':>4} {'k':>2} {'M':>5} {'torch graph':>12} {'triton graph':>13} {'torch host':>11} "
          f"{'triton host':>12} {'tied rows':>9}")
    for name in args.presets.split(","):
        p = get_preset(name)
        routing = dict(p.routing)
        for tokens in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            hidden = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = torch.randn(tokens, p.num_experts, device="cuda", generator=gen)
            bias = (0.3 * torch.randn(p.num_experts, device="cuda", generator=gen)) if p.has_correction_bias else None

            def call(hidden=hidden, logits=logits, bias=bias, k=p.top_k, routing=routing):
                return select_experts(hidden, logits, k, e_score_correction_bias=bias, **routing)

            row = []
            results = []
            for on in (False, True):
                with knobs.override(TRITON_ROUTING=on):
                    results.append(call())
                    row += [_graph_us(call, args.calls), host_us(call, args.calls)]
            (w0, i0), (w1, i1) = results
            # another expert picked would bring another weight: rows whose ids differ must be ties
            torch.testing.assert_close(w1.sort(-1).values, w0.sort(-1).values, rtol=2e-6, atol=1e-7)
            tied_rows = int((i0 != i1).any(-1).sum())
            print(f"{name:18} {p.num_experts:4d} {p.top_k:2d} {tokens:5d} {row[0]:12.1f} {row[2]:13.1f} "
                  f"{row[1]:11.1f} {row[3]:12.1f} {tied_rows:9d}", flush=True)


if __name__ == "__main__":
    main()
