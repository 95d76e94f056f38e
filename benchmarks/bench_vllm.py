"""fusedmoe against vLLM's Triton fused-MoE kernel, on this GPU (H100/H200)

    python benchmarks/bench_vllm.py --vllm-src DIR [--presets a,b] [--tokens 1,4096]
                                    [--quant fp8_w8a8_block|fp8_w8a8_channel|int8_w8a8] [--split]
                                    [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/bench_vllm.py --vllm-src DIR --smoke   # harness check, CPU

DIR holds vLLM's `vllm/model_executor/layers/fused_moe/` (its `fused_moe.py` and `configs/`), e.g.
from the wheel: `pip download --no-deps vllm && unzip vllm-*.whl
'vllm/model_executor/layers/fused_moe/*' -d DIR`. vLLM itself is not imported (its package needs
its compiled ops, built for one torch release): this script compiles the file's Triton functions
`fused_moe_kernel` and `write_zeros_to_output` and its `get_default_config` from their source,
reads the tuned config JSON vLLM would read on this device (`E=..,N=..,device_name=..[,dtype=..]`,
the nearest M key), and launches the kernel the way `invoke_fused_moe_triton_kernel` does
(grid, EM, SWAP_AB for fp8 at BLOCK_M < 64 on sm90, no tensor descriptors, the naive one-token
block assignment where vLLM takes it). Nothing of vLLM is copied into fusedmoe.

Per cell, the same inputs and routing, CUDA-graph replay, median, >= 4 rotated weight copies:

    fusedmoe     `fused_experts(..., backend="triton")`: the whole call (alignment, activation,
                 quantization of activations, both GEMMs, top-k sum)
    vllm_gemms   vLLM's two `fused_moe_kernel` launches only: GEMM1 into [M, k, 2I] and GEMM2 (routed
                 weights) into [M, k, H]. Not timed: its `moe_align_block_size`, `silu_and_mul`,
                 activation quantization and `moe_sum` (CUDA ops in vLLM), so this is a lower bound
                 on vLLM's call, and fusedmoe is faster than vLLM's Triton MoE wherever it beats it.
    fusedmoe_gemms  the kernel-to-kernel counterpart: our GEMM launches alone on the plan the library
                 picks (`experts.choose_plan`), as `fusedmoe tune` times them (`tune._gemms`,
                 `_direct_gemms`): GEMM1 with its fused activation (W8A8: and the intermediate's
                 quantization), GEMM2 (the direct path's with the top-k sum), with the preset's
                 biases as vLLM's launches have them (the 2416cbc run left ours out); not the
                 alignment, x's quantization or the aligned path's top-k sum.

vLLM's GEMM outputs are checked against a float32 torch product of the same operands per slot
(relative error), so a mis-launched kernel shows instead of timing wrong work.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

from fusedmoe.activations import is_gated
from fusedmoe.backends.triton.quant import quantize_activation_ref
from fusedmoe.bench import (
    measure_ceilings,
    quant_operand,
    random_expert_weights,
    roofline,
    time_rotated,
)
from fusedmoe.quant.scheme import get_scheme

KERNEL_FILE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
CONFIG_DIR = "vllm/model_executor/layers/fused_moe/configs"
FUNCTIONS = ("write_zeros_to_output", "fused_moe_kernel", "get_default_config")
QUANTS = ("fp8_w8a8_block", "fp8_w8a8_channel", "int8_w8a8")  # the W8A8 schemes vLLM's kernel runs


def load_vllm(src: Path) -> types.SimpleNamespace:
    """vLLM's kernel and default-config function compiled from `src`'s fused_moe.py, stubs for the
    vLLM modules they name (envs, platform)."""
    path = src / KERNEL_FILE
    tree = ast.parse(path.read_text())
    found = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS}
    missing = set(FUNCTIONS) - set(found)
    if missing:
        raise SystemExit(f"{path}: no {sorted(missing)}: another vLLM layout; this script reads vLLM 0.33's")
    namespace = dict(
        __name__="vllm_fused_moe",  # Triton names a called @jit function by its module
        triton=triton, tl=tl, torch=torch, Any=object,
        envs=types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        current_platform=types.SimpleNamespace(is_rocm=lambda: False),
        should_moe_wna16_use_cuda=lambda *a: False,
        next_power_of_2=triton.next_power_of_2,
    )
    module = ast.Module(body=[found[name] for name in FUNCTIONS], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - vLLM's own source, read to benchmark it
    return types.SimpleNamespace(kernel=namespace["fused_moe_kernel"], default_config=namespace["get_default_config"],
                                 configs=src / CONFIG_DIR)


def device_file_name(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    return "NVIDIA_H200" if "H200" in name.split("_") else name  # vLLM's H200 family rule


def vllm_config(vllm, device, experts, inter, hidden, top_k, tokens, dtype: str | None, block) -> tuple[dict, str]:
    """(config, where it came from) as `try_get_optimal_moe_config` picks it: the tuned JSON for
    this device and shape (nearest M key), else `get_default_config`."""
    name = f"E={experts},N={inter},device_name={device_file_name(device)}"
    if dtype:
        name += f",dtype={dtype}"
    if block:
        name += f",block_shape=[{block[0]},{block[1]}]"
    path = vllm.configs / f"{name}.json"
    if path.exists():
        table = {int(k): v for k, v in json.loads(path.read_text()).items() if k != "triton_version"}
        return dict(table[min(table, key=lambda m: abs(m - tokens))]), path.name
    return dict(vllm.default_config(tokens, experts, inter, hidden, top_k, dtype, block)), "default"


def vllm_align(topk_ids: torch.Tensor, block_m: int, experts: int):
    """moe_align_block_size's outputs (sorted slot ids padded with numel per expert to block_m,
    the expert of each block, the padded total), built with torch outside the timed region."""
    flat = topk_ids.flatten().long()
    numel = flat.numel()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    size = numel + experts * (block_m - 1)
    if numel < experts:
        size = min(numel * block_m, size)
    sorted_ids = torch.full((size,), numel, dtype=torch.int32, device=flat.device)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    start = torch.cumsum(padded, 0) - padded
    rank = torch.arange(numel, device=flat.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    sorted_ids[start[e_sorted] + rank] = order.to(torch.int32)
    expert_ids = torch.zeros(triton.cdiv(size, block_m), dtype=torch.int32, device=flat.device)
    blocks = torch.repeat_interleave(torch.arange(experts, device=flat.device), padded // block_m)
    expert_ids[: blocks.numel()] = blocks.to(torch.int32)
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


def vllm_gemm(vllm, a, b, c, topk_weights, assignment, mul_routed, top_k, config, *, bias=None,
              a_scale=None, b_scale=None, block=None, fp8=False, int8=False, per_channel=False):
    """One fused_moe_kernel launch as invoke_fused_moe_triton_kernel makes it (fp8 / int8: W8A8
    codes; per_channel: per-row weight scales [E, N] and per-token activation scales [M, 1])."""
    sorted_ids, expert_ids, num_post = assignment
    m = a.size(0)
    config = dict(config)
    if sorted_ids is not None:
        em = sorted_ids.size(0)
        if m < config["BLOCK_SIZE_M"]:
            em = min(em, m * top_k * config["BLOCK_SIZE_M"])
    else:
        em = m * top_k * config["BLOCK_SIZE_M"]
    swap = fp8 and a.is_cuda and torch.cuda.get_device_capability(a.device) == (9, 0) \
        and config["BLOCK_SIZE_M"] < 64 and config["BLOCK_SIZE_N"] >= 64
    block_k = config.pop("BLOCK_SIZE_K")
    if block is not None:
        block_k = min(block_k, min(block))
    config["SPLIT_K"] = 1
    grid = (triton.cdiv(em, config["BLOCK_SIZE_M"]) * triton.cdiv(b.size(1), config["BLOCK_SIZE_N"]),)
    vllm.kernel[grid](
        a, b, c, bias, a_scale, b_scale, topk_weights, sorted_ids, expert_ids, num_post,
        b.size(1), b.size(2), em, m * top_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1), c.stride(2),
        a_scale.stride(0) if a_scale is not None and a_scale.ndim == 2 else 0,
        a_scale.stride(1) if a_scale is not None and a_scale.ndim == 2 else 0,
        b_scale.stride(0) if b_scale is not None else 0,
        b_scale.stride(2) if b_scale is not None and b_scale.ndim == 3 else 0,
        b_scale.stride(1) if b_scale is not None and b_scale.ndim >= 2 and b_scale.size(1) > 1 else 0,
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        0 if block is None else block[0], 0 if block is None else block[1],
        MUL_ROUTED_WEIGHT=mul_routed, top_k=top_k,
        compute_type=tl.bfloat16 if c.dtype == torch.bfloat16 else (tl.float16 if c.dtype == torch.float16 else tl.float32),
        use_fp8_w8a8=fp8, use_int8_w8a8=int8, use_int8_w8a16=False, per_channel_quant=per_channel,
        naive_block_assignment=sorted_ids is None, HAS_BIAS=bias is not None, BLOCK_SIZE_K=block_k,
        SWAP_AB=swap, USE_TD=False, **config,
    )


def dequant_block(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """[E, N, K] fp8 codes times their [E, N/bn, K/bk] block scales, in float32."""
    s = scale.repeat_interleave(block[0], 1)[:, : q.shape[1]].repeat_interleave(block[1], 2)[:, :, : q.shape[2]]
    return q.float() * s


class Cell:
    """One (preset, M): weights (rotated copies), inputs, routing, and both sides' calls."""

    def __init__(self, vllm, preset, tokens, *, device, dtype, copies, quant, gen):
        from fusedmoe.backends.triton.weight_only import prepare_weights
        from fusedmoe.modular import ExpertWeights
        from fusedmoe.quant.weights import quantize_weights
        from fusedmoe.routing import select_experts

        self.preset, self.tokens, self.quant = preset, tokens, quant
        E, K, H = preset.num_experts, preset.top_k, preset.hidden_size
        inter = preset.intermediate_size // preset.bench_tp
        self.inter = inter
        self.block = (128, 128) if quant == "fp8_w8a8_block" else None
        self.int8 = quant == "int8_w8a8"
        self.x = torch.randn(tokens, H, device=device, generator=gen).to(dtype)
        logits = torch.randn(tokens, E, device=device, generator=gen)
        on_input = preset.apply_router_weight_on_input
        self.topk_w, self.ids = select_experts(self.x, logits, K, renormalize=not on_input,
                                               scoring_func="sigmoid" if on_input else "softmax")
        self.copies = []
        for _ in range(copies):
            w13, w2, b13, b2 = random_expert_weights(E, H, inter, preset.activation, device=device, dtype=dtype,
                                                     generator=gen, bias=preset.has_bias)
            if quant:
                q13, q2, params = quantize_weights(w13, w2, quant)
                del w13, w2
                # vLLM reads the block scales as loaded ([E, N/128, K/128]); the layer's
                # process_weights prepares fusedmoe's copy for the triton backend
                s13, s2 = params.w13_scale.clone(), params.w2_scale.clone()
                ours = prepare_weights(ExpertWeights(q13, q2, b13, b2, params)).quant if q13.is_cuda else params
                self.copies.append(dict(w13=q13, w2=q2, b13=b13, b2=b2, s13=s13, s2=s2,
                                        ours=(q13, q2, b13, b2, ours)))
            else:
                self.copies.append(dict(w13=w13, w2=w2, b13=b13, b2=b2, ours=(w13, w2, b13, b2, None)))
        dtype_name = None if not quant else "int8_w8a8" if self.int8 else "fp8_w8a8"
        self.config, self.config_source = vllm_config(vllm, device, E, inter, H, K, tokens, dtype_name, self.block)
        naive = tokens * K * 4 <= E  # _prepare_expert_assignment
        self.assignment = ((None, self.ids.view(-1).to(torch.int32), None) if naive
                           else vllm_align(self.ids, self.config["BLOCK_SIZE_M"], E))
        if naive:
            self.assignment = (None, self.assignment[1],
                               torch.full((1,), self.ids.numel() * self.config["BLOCK_SIZE_M"], dtype=torch.int32,
                                          device=device))
        g = 2 * inter if is_gated(preset.activation) else inter
        self.cache1 = torch.empty(tokens, K, g, device=device, dtype=dtype)
        self.cache3 = torch.empty(tokens, K, H, device=device, dtype=dtype)
        # GEMM2's input: any finite intermediate of the right shape (the timing does not depend on it)
        self.inter_act = torch.randn(tokens * K, inter, device=device, generator=gen).to(dtype)
        if quant:  # vLLM's A operands: the scheme's activation codes (1x128 groups, or per token
            # with scales [M, 1]) as the library makes them, in torch
            key = get_scheme(quant).activation
            self.xq, self.xs = quantize_activation_ref(self.x, key)
            self.aq, self.as_ = quantize_activation_ref(self.inter_act, key)
        self.vllm = vllm

    def vllm_calls(self, which: str = "both"):
        """vLLM's GEMM launches per weight copy: "both", or "gemm1" / "gemm2" alone (--split)."""
        K = self.preset.top_k
        on_input = self.preset.apply_router_weight_on_input
        quant = self.quant is not None
        flags = dict(block=self.block, fp8=quant and not self.int8, int8=self.int8,
                     per_channel=quant and self.block is None)

        def run(c):
            a1 = self.xq if quant else self.x
            a2 = self.aq if quant else self.inter_act
            if which != "gemm2":
                vllm_gemm(self.vllm, a1, c["w13"], self.cache1, self.topk_w, self.assignment, on_input, K,
                          self.config, bias=c["b13"], a_scale=self.xs if quant else None, b_scale=c.get("s13"),
                          **flags)
            if which != "gemm1":
                vllm_gemm(self.vllm, a2, c["w2"], self.cache3, self.topk_w, self.assignment, not on_input, 1,
                          self.config, bias=c["b2"], a_scale=self.as_ if quant else None, b_scale=c.get("s2"),
                          **flags)
            return self.cache3

        return [lambda c=c: run(c) for c in self.copies]

    def fusedmoe_calls(self):
        from fusedmoe.api import fused_experts

        p = self.preset
        return [lambda o=c["ours"]: fused_experts(self.x, o[0], o[1], self.topk_w, self.ids, w13_bias=o[2],
                                                  w2_bias=o[3], quant=o[4], activation=p.activation, backend="triton",
                                                  apply_router_weight_on_input=p.apply_router_weight_on_input)
                for c in self.copies]

    def fusedmoe_gemm_calls(self, which: str = "both"):
        """Our GEMM launches alone on the library's plan (see the module docstring): "both", or
        "gemm1" / "gemm2" alone (--split; W8A8 GEMM1 with the intermediate's quantization)."""
        from fusedmoe.backends.triton.experts import GemmProblem, choose_plan
        from fusedmoe.tune import _direct_gemms, _gemms

        p, K = self.preset, self.preset.top_k
        scheme = get_scheme(self.quant)
        problem = GemmProblem(self.tokens * K, p.num_experts, p.hidden_size, self.inter, K, is_gated(p.activation),
                              self.x.dtype)
        direct, t1, t2 = choose_plan(problem, scheme, self.x.device)
        weights = [(c["ours"][0], c["ours"][1], c["ours"][4], c["ours"][2], c["ours"][3]) for c in self.copies]
        make = _direct_gemms if direct else _gemms
        gemm1, gemm2 = make(scheme, weights, self.x, self.topk_w, self.ids, p.num_experts, self.inter,
                            p.activation, t1)[:2]
        self.plan = ("direct" if direct else "aligned", t1, t2)
        return [lambda i=i: (which != "gemm2" and gemm1(i, t1), which != "gemm1" and gemm2(i, t2))
                for i in range(len(self.copies))]

    def check_vllm(self) -> float:
        """Largest relative error of vLLM's GEMM1 and GEMM2 outputs (copy 0) against float32 torch
        products of the same operands, over up to 64 slots."""
        c = self.copies[0]
        self.cache1.fill_(float("nan"))
        self.cache3.fill_(float("nan"))
        self.vllm_calls()[0]()
        K, on_input = self.preset.top_k, self.preset.apply_router_weight_on_input
        if self.block:
            w13, w2 = dequant_block(c["w13"], c["s13"], self.block), dequant_block(c["w2"], c["s2"], self.block)
            x = self.xq.float() * self.xs.repeat_interleave(128, 1)
            a = self.aq.float() * self.as_.repeat_interleave(128, 1)
        elif self.quant:
            w13, w2 = c["w13"].float() * c["s13"][..., None], c["w2"].float() * c["s2"][..., None]
            x, a = self.xq.float() * self.xs, self.aq.float() * self.as_
        else:
            w13, w2, x, a = c["w13"].float(), c["w2"].float(), self.x.float(), self.inter_act.float()
        worst = 0.0
        for slot in range(min(64, self.ids.numel())):
            t, e = slot // K, int(self.ids.view(-1)[slot])
            w = float(self.topk_w.view(-1)[slot])
            y1 = w13[e] @ x[t] + (c["b13"][e].float() if c["b13"] is not None else 0)
            y2 = w2[e] @ a[slot] + (c["b2"][e].float() if c["b2"] is not None else 0)
            y1, y2 = (y1 * w, y2) if on_input else (y1, y2 * w)
            for got, ref in ((self.cache1[t, slot % K], y1), (self.cache3[t, slot % K], y2)):
                worst = max(worst, ((got.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item())
        return worst


def smoke(vllm_src: Path) -> None:
    """Tiny fp32 shapes on the CPU (TRITON_INTERPRET=1): vLLM's launch in this harness, both block
    assignments, against the torch product."""
    from fusedmoe.presets import Preset

    vllm = load_vllm(vllm_src)
    gen = torch.Generator().manual_seed(0)
    # naive (1 * 2 * 4 <= 16) and aligned assignments; biases on both sides in two cases
    cases = ((1, 16, None, False), (5, 4, None, True), (5, 4, "fp8_w8a8_block", False),
             (5, 4, "fp8_w8a8_channel", False), (1, 16, "int8_w8a8", False), (5, 4, "int8_w8a8", True))
    for tokens, experts, quant, bias in cases:
        size = 128 if quant else 16
        p = Preset(name="smoke", model="smoke", num_experts=experts, top_k=2, hidden_size=2 * size,
                   intermediate_size=size, activation="silu", has_bias=bias)
        cell = Cell(vllm, p, tokens, device=torch.device("cpu"), dtype=torch.float32, copies=1, quant=quant,
                    gen=gen)
        cell.config = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=size, GROUP_SIZE_M=1, num_warps=4,
                           num_stages=1)
        if cell.assignment[0] is not None:
            cell.assignment = vllm_align(cell.ids, 16, experts)
        err = cell.check_vllm()
        for which in ("both", "gemm1", "gemm2"):  # our GEMMs alone launch on the library's plan (--split too)
            for call in cell.fusedmoe_gemm_calls(which) + cell.vllm_calls(which):
                call()
        print(f"smoke M={tokens} E={experts} {quant or 'fp32'}{' bias' if bias else ''} "
              f"{'naive' if cell.assignment[0] is None else 'aligned'}: vLLM GEMMs rel err {err:.2e}; "
              f"fusedmoe GEMMs ran ({cell.plan[0]})")
        assert err < (1e-3 if quant else 1e-4), err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-src", type=Path, required=True)
    parser.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,llama-4-maverick")
    parser.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--quant", choices=QUANTS, default=None)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes under TRITON_INTERPRET=1")
    parser.add_argument("--split", action="store_true",
                        help="also time each GEMM apart, vLLM's and ours (a line per cell; JSON: *_gemm1_us, *_gemm2_us)")
    args = parser.parse_args()
    if args.smoke or os.environ.get("TRITON_INTERPRET") == "1":
        smoke(args.vllm_src)
        return
    from fusedmoe.presets import get_preset

    vllm = load_vllm(args.vllm_src)
    device = torch.device("cuda")
    ceilings = measure_ceilings(device, eight_bit=args.quant is not None)
    operand = quant_operand(args.quant)
    w_bytes = 1.0 if args.quant else 2.0
    print(f"{torch.cuda.get_device_name()}: {ceilings.bandwidth / 1e12:.2f} TB/s, "
          f"{ceilings.peak(operand) / 1e12:.0f} {operand or 'bf16'} TFLOP/s; torch {torch.__version__}, "
          f"triton {triton.__version__}; scheme {args.quant or 'bf16'}")
    print(f"{'preset':<18}{'M':>6}{'fusedmoe us':>13}{'%roof':>7}{'vllm gemms us':>15}{'%roof':>7}"
          f"{'speedup':>9}{'our gemms us':>13}{'gemms':>9}{'vllm err':>10}  vllm config")
    rows = []
    for name in args.presets.split(","):
        preset = get_preset(name)
        gen = torch.Generator(device=device).manual_seed(0)
        for tokens in (int(t) for t in args.tokens.split(",")):
            cell = Cell(vllm, preset, tokens, device=device, dtype=torch.bfloat16, copies=args.copies,
                        quant=args.quant, gen=gen)
            touched = int(torch.unique(cell.ids).numel())
            _, _, t_roof, _ = roofline(preset, tokens, touched, cell.inter, ceilings, w_bytes, 2, operand)
            row = dict(preset=name, tokens=tokens, quant=args.quant, vllm_config=cell.config,
                       vllm_config_source=cell.config_source)
            try:
                row["vllm_rel_err"] = cell.check_vllm()
                row["vllm_gemms_us"] = time_rotated(cell.vllm_calls()) * 1e6
            except Exception as exc:  # noqa: BLE001 - a config vLLM cannot launch here is a row
                row["vllm_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            row["fusedmoe_us"] = time_rotated(cell.fusedmoe_calls()) * 1e6
            row["fusedmoe_gemms_us"] = time_rotated(cell.fusedmoe_gemm_calls()) * 1e6
            row["fusedmoe_plan"] = [cell.plan[0], cell.plan[1].as_list(), cell.plan[2].as_list()]
            if args.split and "vllm_gemms_us" in row:
                for which in ("gemm1", "gemm2"):
                    row[f"vllm_{which}_us"] = time_rotated(cell.vllm_calls(which)) * 1e6
                    row[f"fusedmoe_{which}_us"] = time_rotated(cell.fusedmoe_gemm_calls(which)) * 1e6
            for side in ("fusedmoe", "vllm_gemms", "fusedmoe_gemms"):
                if f"{side}_us" in row:
                    row[f"{side}_pct_roofline"] = 100 * t_roof / (row[f"{side}_us"] * 1e-6)
            if "vllm_gemms_us" in row:
                row["speedup"] = row["vllm_gemms_us"] / row["fusedmoe_us"]
                row["gemm_speedup"] = row["vllm_gemms_us"] / row["fusedmoe_gemms_us"]
                print(f"{name:<18}{tokens:>6}{row['fusedmoe_us']:>13.1f}{row['fusedmoe_pct_roofline']:>7.1f}"
                      f"{row['vllm_gemms_us']:>15.1f}{row['vllm_gemms_pct_roofline']:>7.1f}{row['speedup']:>8.2f}x"
                      f"{row['fusedmoe_gemms_us']:>13.1f}{row['gemm_speedup']:>8.2f}x"
                      f"{row['vllm_rel_err']:>10.1e}  {cell.config_source}", flush=True)
                if args.split:
                    print(f"{'':<24}split, us: vLLM gemm1 {row['vllm_gemm1_us']:.1f} gemm2 {row['vllm_gemm2_us']:.1f}"
                          f" | ours ({cell.plan[0]}) gemm1 {row['fusedmoe_gemm1_us']:.1f}"
                          f" gemm2 {row['fusedmoe_gemm2_us']:.1f}", flush=True)
            else:
                print(f"{name:<18}{tokens:>6}{row['fusedmoe_us']:>13.1f}  vLLM failed: {row['vllm_error']}", flush=True)
            rows.append(row)
            del cell
            torch.cuda.empty_cache()
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    bandwidth=ceilings.bandwidth, peak=ceilings.peak(operand), vllm_src=str(args.vllm_src))
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
