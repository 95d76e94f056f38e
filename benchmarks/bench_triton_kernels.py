"""fusedmoe against OpenAI's triton_kernels MoE (`matmul_ogs`), on this GPU (H100/H200)

    python benchmarks/bench_triton_kernels.py --tk-src DIR [--presets a,b] [--tokens 1,4096]
                                              [--w-layout kn|nk] [--no-persistent] [--json out.json]
                                              [--quant mxfp4_w4a16] [--tk-warps 4|8]

DIR is the folder that holds the `triton_kernels` package (OpenAI's, from the Triton repository's
`python/triton_kernels`, or the copy vLLM ships: `pip download --no-deps vllm && unzip
vllm-*.whl 'vllm/third_party/triton_kernels/*' -d X`, then DIR = X/vllm/third_party). It is
imported as it is; nothing of it is copied into fusedmoe. The calls are the ones vLLM's
`triton_kernel_fused_experts` makes on that package's `matmul_ogs` API (the 3.5 API: `routing`,
`RoutingData`, `GatherIndx` / `ScatterIndx`, `FusedActivation`).

Per cell, the same inputs and routing on both sides, bf16, CUDA-graph replay, median, >= 4 rotated
weight copies:

    fusedmoe     `fused_experts(..., backend="triton")`: the whole call (alignment, both GEMMs with
                 the fused activation, top-k sum).
    tk_gemms     triton_kernels' two `matmul_ogs` calls: GEMM1 gathering x's rows with the fused
                 SwiGLU, GEMM2 with the routing weights (gammas) scattered back to tokens and summed
                 over top_k (its `reduce_grouped` pass where top_k > 1). Not timed: its `routing`
                 (top-k and the sort into expert order, the metadata `matmul_ogs` reads), so this
                 is a lower bound on its call, and fusedmoe is faster wherever it beats it.
    tk_call      its `routing(logits, k)` (top-k, the sort into expert order, the metadata) plus the
                 two `matmul_ogs` calls.

Its weights are laid out as `matmul_ogs` reads them: w1 [E, H, 2I] with gate and up interleaved
along 2I (its SwiGLU takes column pairs), w2 [E, I, H]; `--w-layout kn` stores them N-contiguous
(its tests' layout), `nk` K-contiguous (fusedmoe's [E, N, K] memory, viewed transposed). Its
fused activation is gpt-oss's SwiGLU (alpha 1.702, clamp 7, `(u + 1)`), the only one it fuses;
for the silu presets this times the same work as silu(g) * u. Each side's output is checked
against fusedmoe's float32 torch reference of the layer with the activation it computes (relative
error), so a mis-launched call shows instead of timing wrong work.

`--quant mxfp4_w4a16`: both sides read the same mxfp4 weights (e2m1 codes, an e8m0 scale per 32
along K, from fusedmoe's `quantize_weights`), bf16 activations. fusedmoe runs them as its layer's
`process_weights` leaves them; matmul_ogs in the layout its Hopper path reads (vLLM's gpt-oss
set-up): the codes through `HopperMXValueLayout` (bit-twiddled and grouped per thread of the
wgmma operand, decoded in registers as the dot's left operand, the product transposed), the scales
through `HopperMXScaleLayout` with `--tk-warps` warps (which also sets its kernels' warps). The
reference is the float32 layer on the dequantized weights; % of roofline counts the weights at
their quantized width (0.53125 bytes each).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import types
from pathlib import Path

import torch
import triton

from fusedmoe.activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, interleave_gate_up, is_gated
from fusedmoe.bench import (
    measure_ceilings,
    quant_bytes,
    quant_operand,
    random_expert_weights,
    roofline,
    time_rotated,
)


def load_tk(src: Path):
    """OpenAI's triton_kernels from `src` (the folder holding the package): its matmul_ogs and
    routing modules, and the SwiGLU its GEMM1 fuses."""
    if not (src / "triton_kernels" / "matmul_ogs.py").is_file():
        raise SystemExit(f"{src}: no triton_kernels/matmul_ogs.py (this script reads the matmul_ogs API)")
    sys.path.insert(0, str(src))
    return types.SimpleNamespace(**{m: importlib.import_module(f"triton_kernels.{m}")
                                    for m in ("matmul_ogs", "routing", "swiglu", "topk")})


def as_kn(w: torch.Tensor, layout: str) -> torch.Tensor:
    """fusedmoe's [E, N, K] weight as matmul_ogs's [E, K, N]: N-contiguous (kn) or the same
    memory viewed transposed (nk)."""
    return w.transpose(1, 2).contiguous() if layout == "kn" else w.transpose(1, 2)


class Cell:
    """One (preset, M): weights (rotated copies), inputs, routing, both sides' calls."""

    def __init__(self, tk, preset, tokens, *, device, copies, layout, gen, quant=None, tk_warps=8):
        self.tk, self.preset, self.tokens, self.quant = tk, preset, tokens, quant
        E, K, H = preset.num_experts, preset.top_k, preset.hidden_size
        self.inter = inter = preset.intermediate_size // preset.bench_tp
        if not is_gated(preset.activation):
            raise SystemExit(f"{preset.name}: matmul_ogs fuses gated activations only")
        self.x = torch.randn(tokens, H, device=device, generator=gen).to(torch.bfloat16)
        self.logits = torch.randn(tokens, E, device=device, generator=gen)
        # its top-k (softmax over the k selected logits) is the routing of both sides; its path for
        # ids given to `routing` (expt_indx) made wrong routing weights in vLLM 0.33.0's copy
        topk_w, ids, self.bitmatrix = tk.topk.topk(self.logits, K, apply_softmax=True)
        self.topk_w, self.ids = topk_w.float(), ids.to(torch.int32)
        self.copies = []
        self.ref_pending = True  # the dequantized weights of copy 0 only
        for _ in range(copies):
            w13, w2, b13, b2 = random_expert_weights(E, H, inter, preset.activation, device=device,
                                                     dtype=torch.bfloat16, generator=gen, bias=preset.has_bias)
            tk_b1 = interleave_gate_up(b13, 1).float() if b13 is not None else None
            tk_b2 = b2.float() if b2 is not None else None
            if quant:
                self.copies.append(self._quantized(w13, w2, b13, b2, tk_b1, tk_b2, quant, tk_warps))
                continue
            tk_w1 = as_kn(interleave_gate_up(w13, 1), layout)
            self.copies.append(dict(ours=(w13, w2, b13, b2, None), tk=(tk_w1, as_kn(w2, layout), tk_b1, tk_b2, None)))
        self.routing = tk.routing.routing_from_bitmatrix(self.bitmatrix, topk_w, ids, E, K)
        mo = tk.matmul_ogs
        self.act = mo.FusedActivation(mo.FnSpecs("swiglu", tk.swiglu.swiglu_fn, ("alpha", "limit")),
                                      (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT), 2)

    def _quantized(self, w13, w2, b13, b2, tk_b1, tk_b2, quant, tk_warps):
        """One copy's mxfp4 weights: fusedmoe's (as its process_weights leaves them) and
        matmul_ogs's (the same codes and scales in its Hopper layouts), plus the dequantized
        float32 weights the reference reads."""
        from fusedmoe.backends.triton.weight_only import prepare_weights
        from fusedmoe.modular import ExpertWeights
        from fusedmoe.quant.weights import dequantize_weights, quantize_weights

        if quant != "mxfp4_w4a16":
            raise SystemExit(f"--quant {quant}: only mxfp4_w4a16 (matmul_ogs's Hopper weight-only format)")
        parts = [quantize_weights(w13[e:e + 8], w2[e:e + 8], quant) for e in range(0, w13.shape[0], 8)]
        q13, q2 = (torch.cat([p[i] for p in parts]) for i in (0, 1))  # by 8 experts: float32 temporaries
        params = dataclasses.replace(parts[0][2], **{f: torch.cat([getattr(p[2], f) for p in parts])
                                                      for f in ("w13_scale", "w2_scale")})
        ref = dequantize_weights(q13, q2, params) if self.ref_pending else None
        self.ref_pending = False
        ours = prepare_weights(ExpertWeights(q13, q2, b13, b2, params))
        tensor = importlib.import_module("triton_kernels.tensor")
        lay = importlib.import_module("triton_kernels.tensor_details.layout")
        mo = self.tk.matmul_ogs

        def tk_weight(q, s):  # [E, N, K/2] codes, [E, N, K/32] scales -> its [E, K, N] FP4 tensor
            value = tensor.convert_layout(tensor.wrap_torch_tensor(q.transpose(1, 2), dtype=tensor.FP4),
                                          lay.HopperMXValueLayout, mx_axis=1)
            scale = tensor.convert_layout(tensor.wrap_torch_tensor(s.transpose(1, 2)), lay.HopperMXScaleLayout,
                                          mx_axis=1, num_warps=tk_warps)
            return value, mo.PrecisionConfig(weight_scale=scale)

        w1, pc1 = tk_weight(interleave_gate_up(q13, 1), interleave_gate_up(params.w13_scale, 1))
        w2_tk, pc2 = tk_weight(q2, params.w2_scale)
        return dict(ours=(ours.w13, ours.w2, b13, b2, ours.quant), tk=(w1, w2_tk, tk_b1, tk_b2, (pc1, pc2)),
                    ref=ref)

    def tk_run(self, w, routing):
        mo = self.tk.matmul_ogs
        rdata, gather, scatter = routing
        w1, w2, b1, b2, pcs = w
        pc1, pc2 = pcs if pcs is not None else (None, None)
        inter = mo.matmul_ogs(self.x, w1, b1, rdata, gather_indx=gather, precision_config=pc1,
                              fused_activation=self.act)
        return mo.matmul_ogs(inter, w2, b2, rdata, scatter_indx=scatter, precision_config=pc2,
                             gammas=rdata.gate_scal)

    def tk_gemm_calls(self):
        return [lambda c=c: self.tk_run(c["tk"], self.routing) for c in self.copies]

    def tk_full_calls(self):
        K = self.preset.top_k
        return [lambda c=c: self.tk_run(c["tk"], self.tk.routing.routing(self.logits, K)) for c in self.copies]

    def fusedmoe_calls(self):
        from fusedmoe.api import fused_experts

        act = self.preset.activation
        return [lambda o=c["ours"]: fused_experts(self.x, o[0], o[1], self.topk_w, self.ids, w13_bias=o[2],
                                                  w2_bias=o[3], activation=act, backend="triton", quant=o[4])
                for c in self.copies]

    def check(self) -> dict:
        """Relative error of both sides' outputs (copy 0) against the float32 torch reference of the
        activation each computes: the preset's for fusedmoe, swigluoai for matmul_ogs."""
        from fusedmoe.api import fused_experts

        w13, w2, b13, b2, _ = self.copies[0]["ours"]
        if "ref" in self.copies[0]:  # quantized: the float32 layer on the dequantized weights
            w13, w2 = self.copies[0]["ref"]
        f = lambda t: None if t is None else t.float()  # noqa: E731
        out = {}
        for side, act, got in (("fusedmoe", self.preset.activation, self.fusedmoe_calls()[0]()),
                               ("tk", "swigluoai", self.tk_gemm_calls()[0]())):
            ref = fused_experts(self.x.float(), w13.float(), w2.float(), self.topk_w, self.ids, w13_bias=f(b13),
                                w2_bias=f(b2), activation=act, backend="torch")
            got = got.reshape(ref.shape).float()
            out[f"{side}_rel_err"] = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
        return out


def format_row(row: dict) -> str:
    def num(key, width, digits):
        return f"{row[key]:>{width}.{digits}f}" if key in row else f"{'-':>{width}}"

    def err(key):
        return f"{row[key]:>9.1e}" if key in row else f"{'':>9}"

    return (f"{row['preset']:<18}{row['tokens']:>6}{num('fusedmoe_us', 13, 1)}{num('fusedmoe_pct_roofline', 7, 1)}"
            f"{num('tk_gemms_us', 13, 1)}{num('tk_gemms_pct_roofline', 7, 1)}{num('speedup_vs_tk_gemms', 8, 2)}x"
            f"{num('tk_call_us', 12, 1)}{num('speedup_vs_tk_call', 8, 2)}x {err('fusedmoe_rel_err')}{err('tk_rel_err')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tk-src", type=Path, required=True)
    parser.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,llama-4-maverick")
    parser.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--w-layout", choices=("kn", "nk"), default="kn")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--no-persistent", action="store_true",
                        help="hold matmul_ogs to its non-persistent kernel (opt_flags constraint is_persistent=False)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quant", help="mxfp4_w4a16: both sides on the same mxfp4 weights (see above)")
    parser.add_argument("--tk-warps", type=int, default=8, choices=(4, 8),
                        help="warps of matmul_ogs's Hopper mxfp4 scale layout (and so of its kernels)")
    parser.add_argument("--profile-runs", type=int, default=0,
                        help="instead of timing: N eager runs of each side per cell (fusedmoe's call, then "
                             "matmul_ogs's two GEMMs) in NVTX ranges, for ncu; e.g. ncu --kernel-name "
                             "regex:'moe_gemm|_matmul_ogs' ... --profile-runs 3 --copies 1")
    args = parser.parse_args()
    from fusedmoe.presets import get_preset

    tk = load_tk(args.tk_src)
    if args.no_persistent:
        importlib.import_module("triton_kernels.matmul_ogs_details.opt_flags").update_opt_flags_constraints(
            {"is_persistent": False})
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    print(f"{torch.cuda.get_device_name()}: {ceilings.bandwidth / 1e12:.2f} TB/s, {ceilings.peak(None) / 1e12:.0f} "
          f"bf16 TFLOP/s; torch {torch.__version__}, triton {triton.__version__}; triton_kernels from {args.tk_src}, "
          f"weights {args.w_layout}{', non-persistent' if args.no_persistent else ''}")
    print(f"{'preset':<18}{'M':>6}{'fusedmoe us':>13}{'%roof':>7}{'tk gemms us':>13}{'%roof':>7}{'speedup':>9}"
          f"{'tk call us':>12}{'speedup':>9}{'err ours':>10}{'err tk':>9}")
    rows = []
    for name in args.presets.split(","):
        preset = get_preset(name)
        gen = torch.Generator(device=device).manual_seed(0)
        for tokens in (int(t) for t in args.tokens.split(",")):
            cell = Cell(tk, preset, tokens, device=device, copies=args.copies, layout=args.w_layout, gen=gen,
                        quant=args.quant, tk_warps=args.tk_warps)
            touched = int(torch.unique(cell.ids).numel())
            w_bytes, a_bytes = quant_bytes(args.quant)
            _, _, t_roof, _ = roofline(preset, tokens, touched, cell.inter, ceilings, w_bytes, a_bytes,
                                       quant_operand(args.quant))
            row = dict(preset=name, tokens=tokens, w_layout=args.w_layout, tk_persistent_allowed=not args.no_persistent,
                       quant=args.quant or "bf16")
            row.update(cell.check())
            if args.profile_runs:  # for a profiler (ncu --kernel-name ...): eager calls, no timing
                for _ in range(args.profile_runs):
                    for side, call in (("fusedmoe", cell.fusedmoe_calls()[0]), ("tk_gemms", cell.tk_gemm_calls()[0])):
                        torch.cuda.nvtx.range_push(side)
                        call()
                        torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()
                print(f"{name} M={tokens}: {args.profile_runs} eager runs of each side, "
                      f"rel err {row['fusedmoe_rel_err']:.1e} / {row['tk_rel_err']:.1e}", flush=True)
                continue
            row["fusedmoe_us"] = time_rotated(cell.fusedmoe_calls()) * 1e6
            for side, calls in (("tk_gemms", cell.tk_gemm_calls), ("tk_call", cell.tk_full_calls)):
                try:
                    row[f"{side}_us"] = time_rotated(calls()) * 1e6
                except Exception as exc:  # noqa: BLE001 - a call it cannot make (or capture) here is a row
                    row[f"{side}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            for side in ("fusedmoe", "tk_gemms", "tk_call"):
                if f"{side}_us" in row:
                    row[f"{side}_pct_roofline"] = 100 * t_roof / (row[f"{side}_us"] * 1e-6)
                    row[f"speedup_vs_{side}"] = row[f"{side}_us"] / row["fusedmoe_us"]
            print(format_row(row), flush=True)
            for k in ("tk_gemms_error", "tk_call_error"):
                if k in row:
                    print(f"{'':<24}{k}: {row[k]}", flush=True)
            rows.append(row)
            del cell
            torch.cuda.empty_cache()
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    bandwidth=ceilings.bandwidth, peak=ceilings.peak(None), tk_src=str(args.tk_src))
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
