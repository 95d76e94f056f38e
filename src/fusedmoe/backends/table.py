"""The built-in backend table and the priority order per scheme family.

Requirements follow the backends the seeds select among (vLLM's fused-MoE oracle): FlashInfer
TRTLLM/CUTLASS/CuteDSL/b12x, ROCm AITER, DeepGEMM, CUTLASS grouped GEMM, Marlin, XPU, TPU and
out-of-tree platforms, plus fusedmoe's own: `torch` (the reference), `cpu`, `emulation`, `triton`.
Records for packages fusedmoe does not ship point at adapters in `fusedmoe.backends.external`.
"""

from __future__ import annotations

import torch

from fusedmoe.backends import (
    ALL_ACTIVATIONS,
    ALL_DTYPES,
    ALL_FEATURES,
    QUANTIZED_SCHEMES,
    Backend,
    register_backend,
)
from fusedmoe.config import MoEConfig
from fusedmoe.platform import KINDS, Platform

HALF = frozenset((torch.float16, torch.bfloat16))
GPU = frozenset(("cuda", "rocm"))
FP8_W8A8 = frozenset(("fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "fp8_w8a8_block"))
FP8_ALL = FP8_W8A8 | {"fp8_w8a16"}
INT4 = frozenset(f"int4_w4a16_g{g}{zp}" for g in (32, 64, 128) for zp in ("", "_zp"))  # symmetric and asymmetric
WEIGHT_ONLY = frozenset(("fp8_w8a16", "int8_w8a16", "mxfp4_w4a16", "nvfp4_w4a16")) | INT4
FI_ACTS = frozenset(("silu", "relu2_no_mul", "swigluoai"))
EXT = "fusedmoe.backends.external:"


def _unquantized_needs_ep_without_dp(config: MoEConfig, platform: Platform) -> str | None:
    # The seeds enable FlashInfer CUTLASS for bf16 only with expert parallelism and no DP.
    if config.quant is None:
        if not config.parallel.use_ep:
            return "for unquantized MoE it needs expert parallelism (ep_size > 1)"
        if config.parallel.use_dp:
            return "for unquantized MoE it is not available with data parallelism (dp_size > 1)"
    return None


def _fi_cutlass_scheme_capability(config: MoEConfig, platform: Platform) -> str | None:
    cap = platform.capability or (0, 0)
    name = "unquantized" if config.quant is None else config.quant.name
    if name in ("fp8_w8a8_block", "mxfp4_w4a16") and cap[0] != 9:
        return f"{name} runs only on SM90 (got {platform.capability_str})"
    if name in ("nvfp4", "mxfp4_w4a8") and cap < (10, 0):
        return f"{name} needs device capability >= 10.0 (got {platform.capability_str})"
    return None


W8A8_NOT_BATCH_INVARIANT = ("its W8A8 paths pick x's quantization launch (quant.fuse_x_quantization) and "
                            "GEMM2's kernel (quant.gemm2_rows) by the token count")


def _batch_invariant_weights(config: MoEConfig, platform: Platform) -> str | None:
    # triton's unquantized and weight-only paths run aligned plans whose rows do not depend on the
    # batch when asked (experts.batch_invariant_tiles); its W8A8 paths decide launches by the token count
    if config.batch_invariant and config.quant is not None and not config.quant.weight_only:
        return f"{config.quant.name} is not batch-invariant here: {W8A8_NOT_BATCH_INVARIANT} (batch_invariant requested)"
    return None


def _linear_ep_only(config: MoEConfig, platform: Platform) -> str | None:
    # Kernels that place experts from (ep_rank, ep_size) cannot follow an arbitrary expert_map.
    if config.has_expert_map:
        return "it places experts by (ep_rank, ep_size) and cannot take an arbitrary expert_map"
    if config.parallel.use_ep and config.parallel.placement != "linear":
        return f"it needs linear expert placement, not {config.parallel.placement!r}"
    return None


def _fp4_cutlass_ep(config: MoEConfig, platform: Platform) -> str | None:
    if config.quant is not None and config.quant.name == "nvfp4" and config.parallel.ep_size != 1:
        return "its NVFP4 path needs ep_size == 1"
    return None


# The marlin rows run NVFP4 W4A4 and MXFP4 W4A8 weight-only. Plain weight-only schemes run on
# the triton row (the same kernels); FP8 needs sm89+ for the Triton fp8 decode, where the
# triton row runs FP8 W8A8 itself (Marlin's FP8 role is pre-sm89 GPUs, software decode).
MARLIN_PENDING = FP8_ALL | WEIGHT_ONLY
MARLIN_NOTE = ("fusedmoe's marlin runs nvfp4 and mxfp4_w4a8 weight-only; weight-only schemes run "
               "on the triton row with the same kernels, FP8 needs a software fp8 decode for "
               "pre-sm89 GPUs that is not written")


def _gated_only_hidden_multiple(multiple: int):
    def check(config: MoEConfig, platform: Platform) -> str | None:
        if config.hidden_size % multiple or config.intermediate_size_per_partition % multiple:
            return (
                f"hidden_size={config.hidden_size} and intermediate_size_per_partition="
                f"{config.intermediate_size_per_partition} must be multiples of {multiple}"
            )
        return None

    return check


def _grouped_mm_requirements(config: MoEConfig, platform: Platform) -> str | None:
    from fusedmoe.backends.grouped_mm import grouped_mm_available

    if not grouped_mm_available():
        return "this torch has no grouped_mm"
    if platform.kind == "cuda":
        if not platform.capability_at_least(9, 0):
            return f"torch's CUDA grouped_mm needs device capability >= 9.0, got {platform.capability_str}"
        if config.dtype != torch.bfloat16:
            return f"torch's CUDA grouped_mm takes bfloat16, not {config.dtype}"
    itemsize = config.dtype.itemsize
    sizes = (config.hidden_size, config.intermediate_size_per_partition)
    if any(n * itemsize % 16 for n in sizes):
        return (
            f"grouped_mm needs 16-byte-aligned rows: hidden={sizes[0]} and intermediate={sizes[1]} "
            f"must be multiples of {16 // itemsize} for {config.dtype}"
        )
    return None


def _oot_plugin_missing(config: MoEConfig, platform: Platform) -> str | None:
    return (
        "out-of-tree platforms bring their own backend: register it with "
        "fusedmoe.register_backend(...) or the 'fusedmoe.backends' entry-point group"
    )


BUILTIN: tuple[Backend, ...] = (
    # fusedmoe's own ---------------------------------------------------------------------------
    Backend(
        "torch", "PyTorch reference: fp32 accumulation, any device, every feature (explicit only)",
        kinds=frozenset(KINDS), schemes=frozenset(("unquantized",)), dtypes=ALL_DTYPES,
        features=ALL_FEATURES, auto=False, deterministic=True,
        aliases=("reference", "ref"), twin="batched_torch",
        impl="fusedmoe.backends.torch_ref:TorchExperts",
    ),
    Backend(
        "batched_torch", "PyTorch reference on per-expert buffers (batched layout; auto off-GPU)",
        kinds=frozenset(KINDS), schemes=frozenset(("unquantized",)), dtypes=ALL_DTYPES,
        layout="batched", features=frozenset(("bias", "clamp", "weight_on_input", "eplb")),
        deterministic=True, twin="torch", aliases=("batched_reference",),
        impl="fusedmoe.backends.torch_ref:BatchedTorchExperts",
    ),
    Backend(
        "cpu", "CPU path: slots sorted by expert, one matmul per expert segment",
        kinds=frozenset(("cpu",)), schemes=frozenset(("unquantized",)), dtypes=ALL_DTYPES,
        features=ALL_FEATURES - {"routed_scaling"}, deterministic=True,
        impl="fusedmoe.backends.cpu:CpuExperts",
    ),
    Backend(
        "emulation", "Dequantize weights, fake-quantize activations, run the reference",
        kinds=frozenset(KINDS), schemes=QUANTIZED_SCHEMES, dtypes=ALL_DTYPES,
        features=ALL_FEATURES - {"routed_scaling"}, deterministic=True,
        impl="fusedmoe.backends.emulation:EmulationExperts",
    ),
    Backend(
        "triton", "fusedmoe Triton kernels, contiguous (sorted-token) layout",
        kinds=GPU,
        # Weight-only: activations unquantized, weights dequantized in registers. NVFP4 W4A4
        # and MXFP4 W4A8 are not here: this row applies a scheme's activation quantization
        # or refuses it; the marlin row runs them weight-only (16-bit activations).
        schemes=frozenset(("unquantized", "int8_w8a8")) | FP8_W8A8 | WEIGHT_ONLY,
        scheme_capability=tuple((s, (8, 9)) for s in sorted(FP8_W8A8 | {"fp8_w8a16"}))
        + (("int8_w8a8", (7, 5)),),
        features=ALL_FEATURES - {"routed_scaling"}, dtypes=ALL_DTYPES, needs_triton=True,
        twin="batched_triton", deterministic=True, batch_invariant=True,
        extra_checks=(_batch_invariant_weights,),
        impl="fusedmoe.backends.triton.experts:TritonExperts",
    ),
    Backend(
        "batched_triton", "fusedmoe Triton kernels, batched [E, max_tokens, H] layout",
        # int8_w8a8 / int8_w8a16 run here too, but the seeds' INT8 order has no batched row:
        # explicit only. The 4-bit weight-only schemes follow `triton` in their orders.
        kinds=GPU, schemes=frozenset(("unquantized", "int8_w8a8")) | FP8_W8A8 | WEIGHT_ONLY, layout="batched",
        scheme_capability=tuple((s, (8, 9)) for s in sorted(FP8_W8A8 | {"fp8_w8a16"}))
        + (("int8_w8a8", (7, 5)),),
        features=frozenset(("bias", "clamp", "weight_on_input", "eplb")), dtypes=ALL_DTYPES,
        needs_triton=True, twin="triton", deterministic=True, batch_invariant=True,
        extra_checks=(_batch_invariant_weights,),
        impl="fusedmoe.backends.triton.experts:BatchedTritonExperts",
    ),
    Backend(
        "grouped_mm", "PyTorch grouped GEMM over slots sorted by expert (the baseline users write)",
        kinds=frozenset(("cuda", "cpu")), schemes=frozenset(("unquantized",)), dtypes=ALL_DTYPES,
        features=ALL_FEATURES - {"routed_scaling", "lora"}, deterministic=True,
        extra_checks=(_grouped_mm_requirements,),
        impl="fusedmoe.backends.grouped_mm:GroupedMMExperts",
    ),
    # FlashInfer -------------------------------------------------------------------------------
    # EPLB ("eplb" feature): every backend that takes router ids from outside runs on physical
    # slots. Not: fused routers (flashinfer_trtllm: ids never leave the kernel) and the seeds'
    # XPU path (NotImplementedError upstream), nor TPU.
    Backend(
        "flashinfer_trtllm", "FlashInfer TensorRT-LLM MoE (fused router; SM100)",
        kinds=frozenset(("cuda",)), min_capability=(10, 0), max_capability=(11, 0),
        schemes=frozenset(("unquantized", "fp8_w8a8_tensor", "fp8_w8a8_tensor_static",
                           "fp8_w8a8_block", "nvfp4", "mxfp4_w4a16", "mxfp4_w4a8")),
        activations=frozenset(("silu", "relu2_no_mul", "swigluoai")), dtypes=HALF,
        features=frozenset(("clamp", "bias", "expert_map", "routed_scaling")),
        packages=("flashinfer",), group="flashinfer", monolithic=True,
        routing_methods=frozenset(("softmax_topk", "sigmoid_topk", "grouped_topk", "llama4")),
        impl=EXT + "FlashInferTrtllmExperts",
    ),
    Backend(
        "flashinfer_cutlass", "FlashInfer CUTLASS fused MoE (SM90/100/120)",
        kinds=frozenset(("cuda",)), min_capability=(9, 0),
        schemes=frozenset(("unquantized", "fp8_w8a8_tensor", "fp8_w8a8_tensor_static",
                           "fp8_w8a8_block", "nvfp4", "mxfp4_w4a16", "mxfp4_w4a8")),
        activations=FI_ACTS, dtypes=HALF, features=frozenset(("bias", "expert_map", "eplb")),
        packages=("flashinfer",), group="flashinfer",
        extra_checks=(_fi_cutlass_scheme_capability, _unquantized_needs_ep_without_dp, _linear_ep_only),
        impl=EXT + "FlashInferCutlassExperts",
    ),
    Backend(
        "flashinfer_cutedsl", "FlashInfer CuteDSL masked grouped GEMM (NVFP4, SM100)",
        kinds=frozenset(("cuda",)), min_capability=(10, 0), max_capability=(11, 0),
        schemes=frozenset(("nvfp4",)), activations=frozenset(("silu",)), dtypes=HALF,
        features=frozenset(("expert_map", "eplb")), packages=("flashinfer",), group="flashinfer",
        twin="flashinfer_cutedsl_batched", impl=EXT + "FlashInferCuteDslExperts",
    ),
    Backend(
        "flashinfer_cutedsl_batched", "FlashInfer CuteDSL masked grouped GEMM, batched layout",
        kinds=frozenset(("cuda",)), min_capability=(10, 0), max_capability=(11, 0),
        schemes=frozenset(("nvfp4",)), layout="batched", activations=frozenset(("silu",)),
        dtypes=HALF, packages=("flashinfer",), group="flashinfer",
        twin="flashinfer_cutedsl", impl=EXT + "FlashInferCuteDslExperts",
    ),
    Backend(
        "flashinfer_b12x", "FlashInfer b12x NVFP4 MoE for SM12x (opt-in: CUTLASS SM121 MMA guard)",
        kinds=frozenset(("cuda",)), min_capability=(12, 0), max_capability=(13, 0),
        schemes=frozenset(("nvfp4",)), activations=frozenset(("silu",)), dtypes=HALF,
        packages=("flashinfer",), group="flashinfer", auto=False,
        impl=EXT + "FlashInferB12xExperts",
    ),
    # ROCm AITER -------------------------------------------------------------------------------
    Backend(
        "aiter", "ROCm AITER fused MoE (opt-in with FUSEDMOE_USE_AITER=1)",
        kinds=frozenset(("rocm",)),
        schemes=frozenset(("unquantized", "fp8_w8a8_tensor", "fp8_w8a8_tensor_static",
                           "fp8_w8a8_channel", "fp8_w8a8_block", "mxfp4_w4a16")),
        activations=frozenset(("silu", "gelu", "swigluoai")), dtypes=HALF,
        features=frozenset(("bias", "expert_map", "weight_on_input", "eplb")),
        packages=("aiter",), group="aiter", impl=EXT + "AiterExperts",
    ),
    # DeepGEMM ---------------------------------------------------------------------------------
    Backend(
        "deepgemm", "DeepGEMM FP8 block-scaled grouped GEMM (contiguous)",
        kinds=frozenset(("cuda",)), min_capability=(9, 0), max_capability=(11, 0),
        schemes=frozenset(("fp8_w8a8_block",)), activations=frozenset(("silu",)),
        dtypes=frozenset((torch.bfloat16,)), features=frozenset(("expert_map", "eplb")),
        packages=("deep_gemm",), group="deep_gemm", twin="batched_deepgemm",
        aliases=("deep_gemm",), extra_checks=(_gated_only_hidden_multiple(128),),
        impl=EXT + "DeepGemmExperts",
    ),
    Backend(
        "batched_deepgemm", "DeepGEMM FP8 masked grouped GEMM (batched)",
        kinds=frozenset(("cuda",)), min_capability=(9, 0), max_capability=(11, 0),
        schemes=frozenset(("fp8_w8a8_block",)), layout="batched", activations=frozenset(("silu",)),
        dtypes=frozenset((torch.bfloat16,)), packages=("deep_gemm",), group="deep_gemm",
        twin="deepgemm", aliases=("batched_deep_gemm",),
        extra_checks=(_gated_only_hidden_multiple(128),), impl=EXT + "DeepGemmExperts",
    ),
    # CUTLASS grouped GEMM ---------------------------------------------------------------------
    Backend(
        "cutlass", "CUTLASS grouped GEMM (FP8 per-tensor/per-channel; NVFP4 on SM100+)",
        kinds=frozenset(("cuda",)), min_capability=(9, 0),
        schemes=frozenset(("fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "nvfp4")),
        scheme_capability=(("nvfp4", (10, 0)),),
        activations=frozenset(("silu", "gelu", "swigluoai")), dtypes=HALF,
        features=frozenset(("expert_map", "eplb")), packages=("cutlass",), group="cutlass",
        twin="batched_cutlass", aliases=("vllm_cutlass",), extra_checks=(_fp4_cutlass_ep,),
    ),
    Backend(
        "batched_cutlass", "CUTLASS grouped GEMM, batched layout",
        kinds=frozenset(("cuda",)), min_capability=(9, 0),
        schemes=frozenset(("fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel")),
        layout="batched", activations=frozenset(("silu", "gelu", "swigluoai")), dtypes=HALF,
        packages=("cutlass",), group="cutlass", twin="cutlass", aliases=("batched_vllm_cutlass",),
    ),
    # Weight-only (the seeds' Marlin rows): fusedmoe serves them with its Triton weight-only
    # kernels for the schemes that also quantize activations (backends/triton/marlin.py); the
    # plain weight-only schemes run on the triton row, which has the same kernels.
    Backend(
        "marlin", "Weight-only execution (Marlin's role): 4/8-bit weights dequantized in "
        "registers, 16-bit activations; fusedmoe's Triton weight-only kernels",
        kinds=frozenset(("cuda",)), min_capability=(7, 5),
        schemes=FP8_ALL | WEIGHT_ONLY | {"nvfp4", "mxfp4_w4a8"},
        pending_schemes=MARLIN_PENDING, pending_note=MARLIN_NOTE,
        features=frozenset(("bias", "clamp", "expert_map", "lora", "weight_on_input", "eplb")),
        dtypes=HALF, needs_triton=True, twin="batched_marlin", deterministic=True,
        weight_only_execution=True,
        impl="fusedmoe.backends.triton.marlin:MarlinExperts",
    ),
    Backend(
        "batched_marlin", "Weight-only execution (Marlin's role), batched layout",
        kinds=frozenset(("cuda",)), min_capability=(7, 5), layout="batched",
        schemes=FP8_ALL | WEIGHT_ONLY | {"nvfp4", "mxfp4_w4a8"},
        pending_schemes=MARLIN_PENDING, pending_note=MARLIN_NOTE,
        features=frozenset(("bias", "clamp", "weight_on_input", "eplb")), dtypes=HALF,
        needs_triton=True, twin="marlin", deterministic=True, weight_only_execution=True,
        impl="fusedmoe.backends.triton.marlin:BatchedMarlinExperts",
    ),
    # Platform backends ------------------------------------------------------------------------
    Backend(
        "xpu", "Intel XPU fused MoE (IPEX GatedMLPMOE)",
        kinds=frozenset(("xpu",)),
        schemes=frozenset(("unquantized", "fp8_w8a8_tensor", "fp8_w8a16", "mxfp4_w4a16")),
        activations=frozenset(("silu", "gelu", "swigluoai")), dtypes=HALF,
        features=frozenset(("expert_map",)), packages=("intel_extension_for_pytorch",),
        extra_checks=(_linear_ep_only,), impl=EXT + "XpuExperts",
    ),
    Backend(
        "tpu", "TPU fused MoE (tpu_inference)",
        kinds=frozenset(("tpu",)), schemes=frozenset(("unquantized",)),
        activations=frozenset(("silu", "gelu", "swigluoai")), dtypes=HALF | {torch.float32},
        features=frozenset(("expert_map", "bias")), packages=("tpu_inference",),
        impl=EXT + "TpuExperts",
    ),
    Backend(
        "oot", "Out-of-tree platform's own MoE op (supplied by a plugin)",
        kinds=frozenset(("oot",)), schemes=frozenset(("unquantized",)) | QUANTIZED_SCHEMES,
        activations=ALL_ACTIVATIONS, dtypes=ALL_DTYPES, features=ALL_FEATURES,
        extra_checks=(_oot_plugin_missing,),
    ),
)

# Priority order per scheme family (first supported wins). Entries are (backend, kinds where it
# may be auto-selected; None = wherever it runs). Explicit-only backends (auto=False) never
# appear here. `emulation` is auto-selected on GPUs only for NVFP4 (as the seeds); elsewhere it
# is the CPU's path for every quantized scheme.
OFF_GPU = frozenset(("cpu", "xpu", "tpu", "oot"))
_PLATFORM_TAIL = (("xpu", None), ("cpu", None), ("tpu", None), ("oot", None))

PRIORITY: dict[str, tuple[tuple[str, frozenset[str] | None], ...]] = {
    "unquantized": (
        ("flashinfer_trtllm", None), ("flashinfer_cutlass", None), ("aiter", None),
        ("triton", None), ("batched_triton", None), *_PLATFORM_TAIL, ("grouped_mm", None),
        ("batched_torch", OFF_GPU),  # the CPU's batched layout (EP with alltoall_batched)
    ),
    "fp8": (
        ("aiter", None), ("flashinfer_trtllm", None), ("flashinfer_cutlass", None),
        ("deepgemm", None), ("batched_deepgemm", None), ("cutlass", None),
        ("batched_cutlass", None), ("triton", None), ("batched_triton", None),
        ("marlin", None), ("batched_marlin", None), ("xpu", None), ("oot", None),
        ("emulation", OFF_GPU),
    ),
    "int8": (("triton", None), ("marlin", None), ("oot", None), ("emulation", OFF_GPU)),
    "int4": (
        ("marlin", None), ("batched_marlin", None), ("triton", None), ("batched_triton", None),
        ("oot", None), ("emulation", OFF_GPU),
    ),
    "nvfp4": (
        ("flashinfer_trtllm", None), ("flashinfer_cutedsl", None),
        ("flashinfer_cutedsl_batched", None), ("flashinfer_cutlass", None), ("cutlass", None),
        ("triton", None), ("batched_triton", None), ("marlin", None), ("batched_marlin", None),
        ("oot", None), ("emulation", None),
    ),
    "mxfp4": (
        ("flashinfer_trtllm", None), ("aiter", None), ("triton", None), ("batched_triton", None),
        ("flashinfer_cutlass", None), ("marlin", None), ("batched_marlin", None), ("xpu", None),
        ("oot", None), ("emulation", OFF_GPU),
    ),
}

# Families where FlashInfer is opt-in (FUSEDMOE_USE_FLASHINFER=1), as upstream does for bf16.
FLASHINFER_OPT_IN = frozenset(("unquantized",))
# Families whose auto order skips the cutlass group unless allow_cutlass / FUSEDMOE_ALLOW_CUTLASS=1:
# the seeds' allow_vllm_cutlass is an FP8 argument; NVFP4 keeps VLLM_CUTLASS ahead of Marlin.
CUTLASS_OPT_IN = frozenset(("fp8",))
# FUSEDMOE_FLASHINFER_MODE -> backend.
FLASHINFER_MODES = {
    "latency": "flashinfer_trtllm",
    "throughput": "flashinfer_cutlass",
    "masked_gemm": "flashinfer_cutedsl",
}

for _record in BUILTIN:
    register_backend(_record)
