"""The oracle, walked rule by rule on fake platforms (no GPU needed).

Each Case is (config, platform, env) -> expected backend name, or expected error class + regex.
The `kernels` fixture stands in fusedmoe's own GPU kernels (triton, marlin, cutlass records
get an implementation) so the seeds' rules can be walked independently of which kernels have
landed; `test_current_gpu_kernels_reported_missing` pins down today's honest state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedmoe
from fusedmoe import (
    Backend,
    BackendRequestError,
    MoEConfig,
    NoBackendError,
    ParallelConfig,
    Platform,
    explain,
    select_backend,
)
from fusedmoe import oracle as oracle_mod
from fusedmoe.backends import REGISTRY, load_plugins, register_backend, unregister_backend
from fusedmoe.backends.table import PRIORITY
from fusedmoe.quant.scheme import SCHEMES

OWN_KERNELS = ("triton", "batched_triton", "marlin", "batched_marlin", "cutlass", "batched_cutlass")
STAND_IN = "fusedmoe.backends.torch_ref:TorchExperts"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FUSEDMOE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def kernels():
    saved = {n: REGISTRY[n] for n in OWN_KERNELS}
    for record in saved.values():
        stand_in = dataclasses.replace(record, impl=record.impl or STAND_IN, pending_schemes=frozenset())
        register_backend(stand_in, replace=True)
    yield
    for record in saved.values():
        register_backend(record, replace=True)


def cfg(**kw) -> MoEConfig:
    base = dict(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408)
    base.update(kw)
    return MoEConfig(**base)


EP2 = ParallelConfig(ep_size=2)
EP2_DP2 = ParallelConfig(ep_size=2, dp_size=2)
H100 = Platform("cuda", (9, 0))
H100_FI = Platform("cuda", (9, 0), packages=("flashinfer",))
H100_FI_DG = Platform("cuda", (9, 0), packages=("flashinfer", "deep_gemm"))
H100_DG = Platform("cuda", (9, 0), packages=("deep_gemm",))
H100_CUTLASS = Platform("cuda", (9, 0), packages=("cutlass",))
A100 = Platform("cuda", (8, 0))
V100 = Platform("cuda", (7, 0))
B200_FI = Platform("cuda", (10, 0), packages=("flashinfer",))
B200_FI_CUTLASS = Platform("cuda", (10, 0), packages=("flashinfer", "cutlass"))
B200_CUTLASS = Platform("cuda", (10, 0), packages=("cutlass",))
SPARK_FI = Platform("cuda", (12, 1), packages=("flashinfer",))
MI300 = Platform("rocm", (9, 4))
MI300_AITER = Platform("rocm", (9, 4), packages=("aiter",))
CPU = Platform("cpu")
XPU_IPEX = Platform("xpu", packages=("intel_extension_for_pytorch",))
XPU = Platform("xpu")
TPU = Platform("tpu", packages=("tpu_inference",))
OOT = Platform("oot")


@dataclass(frozen=True)
class Case:
    id: str
    config: MoEConfig
    platform: Platform
    expect: str | None = None  # backend name, or None when an error is expected
    error: type[Exception] | None = None
    match: str = ""
    env: dict = field(default_factory=dict)
    via: str | None = None


CASES = [
    # --- unquantized: platform ladder ----------------------------------------------------------
    Case("unq-cuda-triton", cfg(), H100, "triton", via="auto"),
    Case("unq-cuda-fi-opt-in", cfg(parallel=EP2), H100_FI, "triton"),
    Case("unq-rocm-triton", cfg(), MI300, "triton"),
    Case("unq-rocm-aiter-opt-in", cfg(), MI300_AITER, "triton"),
    Case("unq-rocm-aiter-on", cfg(), MI300_AITER, "aiter", env={"USE_AITER": "1"}, via="FUSEDMOE_USE_AITER"),
    Case("unq-rocm-aiter-missing", cfg(), MI300, None, BackendRequestError, "aiter package is not installed",
         env={"USE_AITER": "1"}),
    Case("unq-rocm-aiter-off", cfg(), MI300_AITER, "triton", env={"USE_AITER": "0"}),
    Case("unq-cpu", cfg(), CPU, "cpu"),
    Case("unq-cpu-fp32", cfg(dtype=torch.float32), CPU, "cpu"),
    Case("unq-xpu", cfg(), XPU_IPEX, "xpu"),
    Case("unq-xpu-no-ipex", cfg(), XPU, None, NoBackendError, "intel_extension_for_pytorch package is not installed"),
    Case("unq-tpu", cfg(), TPU, "tpu"),
    Case("unq-oot-no-plugin", cfg(), OOT, None, NoBackendError, "register it with fusedmoe.register_backend"),
    # --- unquantized: FlashInfer knobs -------------------------------------------------------
    Case("unq-fi-cutlass-ep", cfg(parallel=EP2), H100_FI, "flashinfer_cutlass",
         env={"USE_FLASHINFER": "1"}, via="FUSEDMOE_USE_FLASHINFER"),
    Case("unq-fi-cutlass-needs-ep", cfg(), H100_FI, None, NoBackendError,
         "Found FUSEDMOE_USE_FLASHINFER=1, but no FlashInfer Unquantized MoE backend", env={"USE_FLASHINFER": "1"}),
    Case("unq-fi-cutlass-not-with-dp", cfg(parallel=EP2_DP2), H100_FI, None, NoBackendError,
         "not available with data parallelism", env={"USE_FLASHINFER": "1"}),
    Case("unq-fi-trtllm-sm100", cfg(), B200_FI, "flashinfer_trtllm", env={"USE_FLASHINFER": "1"}),
    Case("unq-fi-mode-throughput", cfg(parallel=EP2), B200_FI, "flashinfer_cutlass",
         env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "throughput"}, via="FUSEDMOE_FLASHINFER_MODE"),
    Case("unq-fi-mode-latency-hopper", cfg(), H100_FI, None, BackendRequestError,
         r"flashinfer_trtllm does not support the deployment configuration since it needs device capability >= 10.0",
         env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "latency"}),
    Case("unq-fi-off", cfg(parallel=EP2), H100_FI, "triton", env={"USE_FLASHINFER": "0"}),
    Case("unq-fi-trtllm-routing", cfg(routing_method="custom"), B200_FI, None, NoBackendError,
         "does not implement routing method 'custom'", env={"USE_FLASHINFER": "1"}),
    Case("unq-fi-trtllm-routed-scale", cfg(routed_scaling_factor=2.5, routing_method="grouped_topk"), B200_FI,
         "flashinfer_trtllm", env={"USE_FLASHINFER": "1"}),
    # --- explicit requests ---------------------------------------------------------------------
    Case("req-unknown", cfg(backend="bogus"), H100, None, BackendRequestError,
         r"backend='bogus' is not supported for Unquantized MoE. Expected one of \[.*'triton'"),
    Case("req-wrong-scheme", cfg(backend="deepgemm"), H100_DG, None, BackendRequestError,
         "not supported for Unquantized MoE"),
    Case("req-unavailable", cfg(backend="flashinfer_trtllm"), H100_FI, None, BackendRequestError,
         r"Unquantized MoE backend flashinfer_trtllm does not support the deployment configuration since it needs device capability >= 10.0"),
    Case("req-torch-on-cuda", cfg(backend="torch"), H100, "torch", via="argument"),
    Case("req-alias", cfg(backend="reference"), H100, "torch"),
    Case("req-env", cfg(), H100, "torch", env={"BACKEND": "torch"}, via="FUSEDMOE_BACKEND"),
    Case("req-argument-beats-env", cfg(backend="cpu"), CPU, "cpu", env={"BACKEND": "torch"}, via="argument"),
    Case("req-beats-knobs", cfg(backend="triton"), H100_FI, "triton", env={"USE_FLASHINFER": "1"}),
    Case("req-cpu-on-cuda", cfg(backend="cpu"), H100, None, BackendRequestError, "it runs on cpu, not cuda"),
    Case("req-fi-cutlass-ep", cfg(backend="flashinfer_cutlass", parallel=EP2), H100_FI, "flashinfer_cutlass"),
    # --- grouped_mm: the PyTorch baseline, after every kernel in the order -------------------------
    Case("grouped-mm-request", cfg(backend="grouped_mm"), H100, "grouped_mm"),
    Case("grouped-mm-cpu", cfg(backend="grouped_mm", dtype=torch.float32), CPU, "grouped_mm"),
    Case("grouped-mm-fp16-cuda", cfg(backend="grouped_mm", dtype=torch.float16), H100, None,
         BackendRequestError, "torch's CUDA grouped_mm takes bfloat16"),
    Case("grouped-mm-ampere", cfg(backend="grouped_mm"), A100, None, BackendRequestError,
         "needs device capability >= 9.0"),
    Case("grouped-mm-unaligned", cfg(backend="grouped_mm", hidden_size=2050), H100, None,
         BackendRequestError, "16-byte-aligned rows"),
    # --- activation format: batched -> batched twin ----------------------------------------------
    Case("batched-auto", cfg(activation_format="batched"), H100, "batched_triton"),
    Case("batched-request-twin", cfg(activation_format="batched", backend="triton"), H100, "batched_triton"),
    Case("batched-no-twin", cfg(activation_format="batched", backend="cpu"), CPU, None, BackendRequestError,
         "takes the standard activation format, but the config uses batched"),
    # batched buffers arrive already dispatched to local experts: no expert_map needed
    Case("batched-ep", cfg(activation_format="batched", parallel=EP2), H100, "batched_triton"),
    Case("batched-explicit-map", cfg(activation_format="batched", has_expert_map=True), H100, None,
         NoBackendError, "does not apply an expert_map"),
    # --- LoRA forces Triton ----------------------------------------------------------------------
    Case("lora-beats-flashinfer", cfg(lora=True, parallel=EP2), H100_FI, "triton", env={"USE_FLASHINFER": "1"},
         via="lora"),
    Case("lora-request-refused", cfg(lora=True, parallel=EP2, backend="flashinfer_cutlass"), H100_FI, None,
         BackendRequestError, "does not apply LoRA"),
    Case("lora-fp8", cfg(lora=True, quant="fp8_w8a8_block"), H100_FI_DG, "triton"),
    Case("lora-int8", cfg(lora=True, quant="int8_w8a8"), A100, "triton"),
    # --- SwiGLU clamp ------------------------------------------------------------------------------
    Case("clamp-request-refused", cfg(swiglu_limit=7.0, backend="flashinfer_cutlass", parallel=EP2), H100_FI,
         None, BackendRequestError,
         r"swiglu_limit=7.0, but the explicitly requested backend='flashinfer_cutlass' does not apply the SwiGLU clamp. Use one of \["),
    Case("clamp-auto-fi-required", cfg(swiglu_limit=7.0, parallel=EP2), H100_FI, None, NoBackendError,
         "does not apply the SwiGLU clamp", env={"USE_FLASHINFER": "1"}),
    Case("clamp-triton", cfg(swiglu_limit=7.0), H100, "triton"),
    # --- numerics features ---------------------------------------------------------------------------
    Case("bias-fi-cutlass", cfg(has_bias=True, parallel=EP2, backend="flashinfer_cutlass"), H100_FI,
         "flashinfer_cutlass"),
    Case("weight-on-input-fi", cfg(top_k=1, apply_router_weight_on_input=True, parallel=EP2), H100_FI, None,
         NoBackendError, "router weight on the input", env={"USE_FLASHINFER": "1"}),
    Case("expert-map-fi-cutlass", cfg(has_expert_map=True, parallel=EP2, backend="flashinfer_cutlass"), H100_FI,
         None, BackendRequestError, "cannot take an arbitrary expert_map"),
    Case("round-robin-fi-cutlass", cfg(parallel=ParallelConfig(ep_size=2, placement="round_robin"),
                                       backend="flashinfer_cutlass"), H100_FI,
         None, BackendRequestError, "needs linear expert placement"),
    Case("non-gated-deepgemm", cfg(activation="relu2_no_mul", quant="fp8_w8a8_block", backend="deepgemm"),
         H100_DG, None, BackendRequestError, "supports only gated activations"),
    Case("batch-invariant", cfg(), CPU, None, NoBackendError, "not batch-invariant", env={"BATCH_INVARIANT": "1"}),
    Case("batch-invariant-flashinfer-required", cfg(parallel=EP2), H100_FI, None, NoBackendError,
         "flashinfer_cutlass: it is not batch-invariant", env={"BATCH_INVARIANT": "1", "USE_FLASHINFER": "1"}),
    Case("batch-invariant-mxfp4-triton", cfg(quant="mxfp4_w4a16", parallel=EP2), H100_FI, "triton",
         env={"BATCH_INVARIANT": "1"}),
    Case("batch-invariant-batched", cfg(quant="int4_w4a16_g32", activation_format="batched", batch_invariant=True),
         H100, "batched_triton"),
    Case("batch-invariant-fp8-block", cfg(quant="fp8_w8a8_block"), H100_FI_DG, None, NoBackendError,
         "fp8_w8a8_block is not batch-invariant here: its W8A8 paths pick", env={"BATCH_INVARIANT": "1"}),
    # --- FP8 ------------------------------------------------------------------------------------------
    Case("fp8-block-fi-first", cfg(quant="fp8_w8a8_block"), H100_FI_DG, "flashinfer_cutlass"),
    Case("fp8-block-deepgemm", cfg(quant="fp8_w8a8_block"), H100_DG, "deepgemm"),
    Case("fp8-block-fi-off", cfg(quant="fp8_w8a8_block"), H100_FI_DG, "deepgemm", env={"USE_FLASHINFER": "0"}),
    Case("fp8-block-all-off", cfg(quant="fp8_w8a8_block"), H100_FI_DG, "triton",
         env={"USE_FLASHINFER": "0", "USE_DEEP_GEMM": "0"}),
    Case("fp8-block-batched", cfg(quant="fp8_w8a8_block", activation_format="batched"), H100_DG, "batched_deepgemm"),
    Case("fp8-block-batched-no-deepgemm", cfg(quant="fp8_w8a8_block", activation_format="batched"), H100,
         "batched_triton"),
    Case("fp8-tensor-batched", cfg(quant="fp8_w8a8_tensor", activation_format="batched"), H100, "batched_triton"),
    Case("fp8-deepgemm-forced", cfg(quant="fp8_w8a8_block"), H100_FI_DG, "deepgemm",
         env={"USE_FLASHINFER": "0", "USE_DEEP_GEMM": "1"}, via="FUSEDMOE_USE_DEEP_GEMM"),
    Case("fp8-deepgemm-forced-tensor", cfg(quant="fp8_w8a8_tensor"), H100_DG, None, BackendRequestError,
         "FP8 MoE backend deepgemm does not support the deployment configuration since it does not support the fp8_w8a8_tensor scheme",
         env={"USE_DEEP_GEMM": "1"}),
    Case("fp8-deepgemm-forced-missing", cfg(quant="fp8_w8a8_block"), H100, None, BackendRequestError,
         "deep_gemm package is not installed", env={"USE_DEEP_GEMM": "1"}),
    Case("fp8-fi-masked-gemm", cfg(quant="fp8_w8a8_block"), H100_FI, None, BackendRequestError,
         r"FlashInfer mode 'masked_gemm' \(flashinfer_cutedsl\) is not supported for FP8 MoE",
         env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "masked_gemm"}),
    Case("fp8-fi-required-missing", cfg(quant="fp8_w8a8_block"), H100, None, NoBackendError,
         "Found FUSEDMOE_USE_FLASHINFER=1, but no FlashInfer FP8 MoE backend", env={"USE_FLASHINFER": "1"}),
    Case("fp8-fi-trtllm-b200", cfg(quant="fp8_w8a8_block"), B200_FI, "flashinfer_trtllm"),
    Case("fp8-fi-mode-latency", cfg(quant="fp8_w8a8_block"), B200_FI, "flashinfer_trtllm",
         env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "latency"}),
    Case("fp8-fi-mode-throughput", cfg(quant="fp8_w8a8_block"), H100_FI_DG, "flashinfer_cutlass",
         env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "throughput"}),
    Case("fp8-fi-mode-latency-hopper", cfg(quant="fp8_w8a8_block"), H100_FI, None, BackendRequestError,
         "flashinfer_trtllm", env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "latency"}),
    Case("fp8-fi-cutlass-block-not-b200", cfg(quant="fp8_w8a8_block", backend="flashinfer_cutlass"), B200_FI,
         None, BackendRequestError, "runs only on SM90"),
    Case("fp8-ampere-marlin", cfg(quant="fp8_w8a8_channel"), A100, "marlin"),
    Case("fp8-request-marlin", cfg(quant="fp8_w8a8_block", backend="marlin"), H100_DG, "marlin"),
    Case("fp8-rocm-aiter", cfg(quant="fp8_w8a8_tensor"), MI300_AITER, "aiter", env={"USE_AITER": "1"}),
    Case("fp8-rocm-triton", cfg(quant="fp8_w8a8_tensor"), MI300_AITER, "triton"),
    Case("fp8-cutlass-needs-allow", cfg(quant="fp8_w8a8_channel"), H100_CUTLASS, "triton"),
    Case("fp8-cutlass-allowed", cfg(quant="fp8_w8a8_channel", allow_cutlass=True), H100_CUTLASS, "cutlass"),
    Case("fp8-cutlass-env", cfg(quant="fp8_w8a8_channel"), H100_CUTLASS, "cutlass", env={"ALLOW_CUTLASS": "1"}),
    Case("fp8-cutlass-batched", cfg(quant="fp8_w8a8_channel", allow_cutlass=True, activation_format="batched"),
         H100_CUTLASS, "batched_cutlass"),
    Case("fp8-request-unknown", cfg(quant="fp8_w8a8_block", backend="aiter2"), H100, None, BackendRequestError,
         r"backend='aiter2' is not supported for FP8 MoE. Expected one of \[.*'deepgemm'"),
    Case("fp8-cpu-emulation", cfg(quant="fp8_w8a8_block"), CPU, "emulation"),
    Case("fp8-xpu", cfg(quant="fp8_w8a8_tensor"), XPU_IPEX, "xpu"),
    Case("fp8-no-backend-on-gpu", cfg(quant="fp8_w8a8_block"), V100, None, NoBackendError,
         "No FP8 MoE backend supports the deployment configuration"),
    # --- INT8 --------------------------------------------------------------------------------------------
    Case("int8-triton", cfg(quant="int8_w8a8"), A100, "triton"),
    Case("int8-too-old", cfg(quant="int8_w8a8"), V100, None, NoBackendError, "No Int8 MoE backend supports"),
    Case("int8-request-unknown", cfg(quant="int8_w8a8", backend="deepgemm"), A100, None, BackendRequestError,
         r"not supported for Int8 MoE. Expected one of \["),
    Case("int8-batched-no-twin", cfg(quant="int8_w8a8", activation_format="batched"), A100, None, NoBackendError,
         "No Int8 MoE backend"),
    Case("int8-cpu", cfg(quant="int8_w8a8"), CPU, "emulation"),
    Case("int8-w8a16", cfg(quant="int8_w8a16"), A100, "triton"),
    # --- NVFP4 -------------------------------------------------------------------------------------------
    Case("nvfp4-trtllm", cfg(quant="nvfp4"), B200_FI, "flashinfer_trtllm"),
    Case("nvfp4-clamp-trtllm", cfg(quant="nvfp4", swiglu_limit=10.0), B200_FI, "flashinfer_trtllm"),
    # the seeds keep only FI_TRTLLM under a clamp (so Hopper raises); marlin applies the clamp (docs/oracle.md)
    Case("nvfp4-clamp-hopper-marlin", cfg(quant="nvfp4", swiglu_limit=10.0), H100_FI, "marlin"),
    Case("nvfp4-clamp-request-marlin", cfg(quant="nvfp4", swiglu_limit=10.0, backend="marlin"), H100_FI, "marlin"),
    Case("nvfp4-clamp-request-refused", cfg(quant="nvfp4", swiglu_limit=10.0, backend="flashinfer_cutlass"),
         B200_FI, None, BackendRequestError, r"Use one of \[.*'flashinfer_trtllm'"),
    Case("nvfp4-clamp-mode-refused", cfg(quant="nvfp4", swiglu_limit=10.0), B200_FI, None, BackendRequestError,
         r"selected via FUSEDMOE_FLASHINFER_MODE \(flashinfer_cutlass\) does not apply the SwiGLU clamp",
         env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "throughput"}),
    Case("nvfp4-cutedsl-batched-request", cfg(quant="nvfp4", activation_format="batched",
                                              backend="flashinfer_cutedsl"), B200_FI, "flashinfer_cutedsl_batched"),
    Case("nvfp4-cutedsl-mode-batched", cfg(quant="nvfp4", activation_format="batched"), B200_FI,
         "flashinfer_cutedsl_batched", env={"USE_FLASHINFER": "1", "FLASHINFER_MODE": "masked_gemm"}),
    Case("nvfp4-fi-off", cfg(quant="nvfp4"), B200_FI, "marlin", env={"USE_FLASHINFER": "0"}),
    Case("nvfp4-fi-required-missing", cfg(quant="nvfp4"), H100_FI, None, NoBackendError,
         "Found FUSEDMOE_USE_FLASHINFER=1, but no FlashInfer NvFp4 MoE backend", env={"USE_FLASHINFER": "1"}),
    Case("nvfp4-hopper", cfg(quant="nvfp4"), H100_FI, "marlin"),
    Case("nvfp4-b12x-explicit-only", cfg(quant="nvfp4"), SPARK_FI, "flashinfer_cutlass"),
    Case("nvfp4-b12x-request", cfg(quant="nvfp4", backend="flashinfer_b12x"), SPARK_FI, "flashinfer_b12x"),
    # the seeds' allow_vllm_cutlass is FP8's: NVFP4 takes VLLM_CUTLASS in auto without it
    Case("nvfp4-vllm-cutlass-auto", cfg(quant="nvfp4"), B200_CUTLASS, "cutlass"),
    Case("nvfp4-fi-off-vllm-cutlass", cfg(quant="nvfp4"), B200_FI_CUTLASS, "cutlass", env={"USE_FLASHINFER": "0"}),
    Case("nvfp4-vllm-cutlass-ep-marlin", cfg(quant="nvfp4", parallel=EP2), B200_CUTLASS, "marlin"),
    Case("nvfp4-cutlass-ep", cfg(quant="nvfp4", allow_cutlass=True, parallel=EP2, backend="cutlass"),
         B200_FI_CUTLASS, None, BackendRequestError, "NVFP4 path needs ep_size == 1"),
    Case("nvfp4-cpu", cfg(quant="nvfp4"), CPU, "emulation"),
    Case("nvfp4-emulation-on-gpu", cfg(quant="nvfp4"), V100, "emulation"),
    Case("nvfp4-w4a16-hopper-triton", cfg(quant="nvfp4_w4a16"), H100_FI, "triton"),
    Case("nvfp4-w4a16-b200-triton", cfg(quant="nvfp4_w4a16"), B200_FI, "triton"),
    # --- MXFP4 / INT4 ---------------------------------------------------------------------------------------
    Case("mxfp4-hopper", cfg(quant="mxfp4_w4a16", activation="swigluoai", has_bias=True), H100_FI, "triton"),
    # gpt-oss order: AITER ahead of Triton on ROCm (opt-in, as upstream), FI_CUTLASS bf16 on SM90 on request
    Case("mxfp4-rocm-triton", cfg(quant="mxfp4_w4a16", activation="swigluoai", has_bias=True), MI300_AITER, "triton"),
    Case("mxfp4-rocm-aiter", cfg(quant="mxfp4_w4a16", activation="swigluoai", has_bias=True), MI300_AITER, "aiter",
         env={"USE_AITER": "1"}),
    Case("mxfp4-hopper-flashinfer-cutlass", cfg(quant="mxfp4_w4a16", activation="swigluoai", has_bias=True), H100_FI,
         "flashinfer_cutlass", env={"USE_FLASHINFER": "1"}),
    Case("mxfp4-b200-trtllm", cfg(quant="mxfp4_w4a16", activation="swigluoai", has_bias=True), B200_FI,
         "flashinfer_trtllm"),
    Case("mxfp4-marlin-batched", cfg(quant="mxfp4_w4a16", activation_format="batched", backend="marlin"), A100,
         "batched_marlin"),
    # FUSEDMOE_MXFP4_ACTIVATION filters the rows by the activations they compute with
    Case("mxfp4-w4a8-b200-mxfp8", cfg(quant="mxfp4_w4a8", activation="swigluoai"), B200_FI, "flashinfer_trtllm"),
    Case("mxfp4-w4a8-b200-ask-bf16", cfg(quant="mxfp4_w4a8", activation="swigluoai"), B200_FI, "marlin",
         env={"MXFP4_ACTIVATION": "bf16"}),
    Case("mxfp4-w4a8-hopper-ask-mxfp8", cfg(quant="mxfp4_w4a8", activation="swigluoai"), H100_FI, None,
         NoBackendError, "marlin: runs mxfp4_w4a8 with bf16 activations", env={"MXFP4_ACTIVATION": "mxfp8"}),
    Case("mxfp4-w4a16-ask-mxfp8", cfg(quant="mxfp4_w4a16", activation="swigluoai"), B200_FI, None,
         NoBackendError, "flashinfer_trtllm: runs mxfp4_w4a16 with bf16 activations", env={"MXFP4_ACTIVATION": "mxfp8"}),
    Case("mxfp4-w4a8-ask-bf16-then-flashinfer", cfg(quant="mxfp4_w4a8", activation="swigluoai"), B200_FI, None,
         NoBackendError, "FUSEDMOE_USE_FLASHINFER=1", env={"MXFP4_ACTIVATION": "bf16", "USE_FLASHINFER": "1"}),
    Case("int4-marlin", cfg(quant="int4_w4a16_g32"), H100, "marlin"),
    Case("int4-request-triton", cfg(quant="int4_w4a16_g64", backend="triton"), H100, "triton"),
    Case("fp8-w8a16-hopper-triton", cfg(quant="fp8_w8a16"), H100_FI_DG, "triton"),
    Case("fp8-w8a16-ampere-marlin", cfg(quant="fp8_w8a16"), A100, "marlin"),
    Case("int4-cpu", cfg(quant="int4_w4a16_g128"), CPU, "emulation"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule(case: Case, kernels, monkeypatch):
    for name, value in case.env.items():
        monkeypatch.setenv("FUSEDMOE_" + name, value)
    if case.error is not None:
        with pytest.raises(case.error, match=case.match):
            select_backend(case.config, case.platform)
        result = explain(case.config, case.platform)
        assert result.chosen is None and result.error
        return
    selection = select_backend(case.config, case.platform)
    assert selection.name == case.expect
    if case.via is not None:
        assert selection.via == case.via
    # the winner really supports the config, and explain agrees with select
    assert REGISTRY[selection.name].check(case.config, case.platform) is None or case.env
    result = explain(case.config, case.platform)
    assert result.chosen == case.expect
    statuses = {v.name: v.status for v in result.verdicts}
    assert statuses[case.expect] == "chosen"
    assert sum(s == "chosen" for s in statuses.values()) == 1


def test_error_classes_are_value_and_not_implemented_errors():
    assert issubclass(BackendRequestError, ValueError)
    assert issubclass(NoBackendError, NotImplementedError)


def test_current_gpu_kernels_reported_missing():
    """Kernels fusedmoe has not written yet are reported as such, not pretended."""
    assert select_backend(cfg(), H100).name == "triton"
    w8a8 = ("fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "fp8_w8a8_block")
    for scheme in w8a8:  # no FlashInfer / DeepGEMM / CUTLASS installed: the seeds fall to Triton
        assert select_backend(cfg(quant=scheme), H100).name == "triton"
    assert select_backend(cfg(quant="fp8_w8a8_block"), H100_DG).name == "deepgemm"  # ahead of it
    assert select_backend(cfg(quant="fp8_w8a8_channel"), H100_FI_DG).name == "triton"  # neither has it
    assert select_backend(cfg(quant="int8_w8a8"), A100).name == "triton"
    assert select_backend(cfg(quant="fp8_w8a8_block", backend="triton"), H100_DG).name == "triton"
    with pytest.raises(NoBackendError, match="triton: fp8_w8a8_channel needs device capability >= 8.9"):
        select_backend(cfg(quant="fp8_w8a8_channel"), A100)
    # weight-only: marlin's rows (ahead for int4) have no kernel yet, so the Triton one runs
    for scheme in ("int4_w4a16_g128", "int8_w8a16", "fp8_w8a16", "mxfp4_w4a16", "nvfp4_w4a16"):
        assert select_backend(cfg(quant=scheme), H100).name == "triton", scheme
    with pytest.raises(NoBackendError, match="triton: fp8_w8a16 needs device capability >= 8.9"):
        select_backend(cfg(quant="fp8_w8a16"), A100)
    # NVFP4 W4A4 and MXFP4 W4A8 on Hopper: marlin's row, weight-only execution as the seeds'
    # Marlin (16-bit activations); triton applies a scheme's activation quantization or refuses
    for scheme in ("nvfp4", "mxfp4_w4a8"):
        assert select_backend(cfg(quant=scheme), H100).name == "marlin", scheme
        assert select_backend(cfg(quant=scheme, activation_format="batched"), H100).name == "batched_marlin"
        assert f"it does not support the {scheme} scheme" in REGISTRY["triton"].check(cfg(quant=scheme), H100)
        assert REGISTRY["marlin"].weight_only_execution and not REGISTRY["triton"].weight_only_execution
    assert select_backend(cfg(quant="nvfp4"), V100).name == "emulation"  # marlin needs 7.5
    # ... and says so wherever the choice is shown
    note = "marlin runs nvfp4 weight-only: activations stay bfloat16 (the scheme's nvfp4/group16/dynamic"
    assert note in select_backend(cfg(quant="nvfp4"), H100).note
    assert f"note: {note}" in explain(cfg(quant="nvfp4"), H100).table().splitlines()[1]
    assert note in explain(cfg(quant="nvfp4"), H100).to_dict()["note"]
    assert select_backend(cfg(quant="int4_w4a16_g32"), H100).note is None
    assert explain(cfg(quant="nvfp4"), V100).to_dict()["note"] is None
    reason = REGISTRY["marlin"].check(cfg(quant="int4_w4a16_g32"), H100)
    assert "does not cover the int4_w4a16_g32 scheme yet" in reason and "triton row" in reason
    with pytest.raises(BackendRequestError, match="fusedmoe.s implementation does not cover the fp8_w8a8_channel"):
        select_backend(cfg(quant="fp8_w8a8_channel", backend="marlin"), H100)
    assert select_backend(cfg(activation_format="batched"), H100).name == "batched_triton"
    for scheme in ("fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "fp8_w8a8_block"):
        assert select_backend(cfg(activation_format="batched", quant=scheme), H100).name == "batched_triton"
    # INT8 batched: the seeds' order has no batched row (auto fails), a request for triton runs its twin
    assert select_backend(cfg(activation_format="batched", quant="int8_w8a8", backend="triton"),
                          A100).name == "batched_triton"
    with pytest.raises(NoBackendError, match="batched_triton: fp8_w8a8_block needs device capability >= 8.9"):
        select_backend(cfg(activation_format="batched", quant="fp8_w8a8_block"), A100)
    # weight-only in the batched layout: the 4-bit orders list batched_triton after triton (fp8
    # W8A16 takes the FP8 order's row); INT8 W8A16, like INT8 W8A8, by request only
    for scheme in ("int4_w4a16_g128", "mxfp4_w4a16", "nvfp4_w4a16", "fp8_w8a16"):
        assert select_backend(cfg(activation_format="batched", quant=scheme), H100).name == "batched_triton"
    assert select_backend(cfg(activation_format="batched", quant="int8_w8a16", backend="triton"),
                          A100).name == "batched_triton"
    assert select_backend(cfg(backend="torch"), H100).name == "torch"


def test_no_backend_error_lists_every_candidate():
    with pytest.raises(NoBackendError) as info:
        select_backend(cfg(quant="fp8_w8a8_block"), V100)
    names = {v.name for v in info.value.verdicts}
    auto_fp8 = {n for n, kinds in PRIORITY["fp8"] if kinds is None or "cuda" in kinds}
    assert names == auto_fp8
    for v in info.value.verdicts:
        assert v.reason and f"{v.name}: {v.reason}" in str(info.value)


def test_explain_covers_every_registered_backend(kernels):
    result = explain(cfg(quant="fp8_w8a8_block"), H100_FI_DG)
    assert {v.name for v in result.verdicts} == set(REGISTRY)
    for v in result.verdicts:
        assert v.status in ("chosen", "supported", "rejected")
        assert (v.status == "rejected") == bool(v.reason and v.status != "supported")
    table = result.table()
    for name in REGISTRY:
        assert name in table
    import json

    data = json.loads(json.dumps(result.to_dict(), default=str))
    assert data["chosen"] == "flashinfer_cutlass"
    assert data["config"]["quant"] == "fp8_w8a8_block"


def test_explicit_only_backends_are_never_auto_selected():
    for family, entries in PRIORITY.items():
        for name, _ in entries:
            assert REGISTRY[name].auto, f"{name} is explicit-only but listed in the {family} order"
    assert not REGISTRY["flashinfer_b12x"].auto and not REGISTRY["torch"].auto


def test_every_scheme_has_a_family_order():
    for scheme in SCHEMES.values():
        assert scheme.family in PRIORITY
        assert any(scheme.name in REGISTRY[n].schemes for n, _ in PRIORITY[scheme.family]), scheme.name


def test_logging_once(caplog, kernels):
    oracle_mod._logged.clear()
    caplog.set_level(logging.DEBUG, logger="fusedmoe")
    for _ in range(3):
        select_backend(cfg(quant="fp8_w8a8_block"), H100_DG)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    debugs = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(infos) == 1
    assert infos[0].getMessage().startswith("Using deepgemm FP8 MoE backend (via auto) out of potential backends: [")
    assert any(m.startswith("FP8 MoE backend flashinfer_cutlass does not support the deployment configuration "
                            "since the flashinfer package is not installed.") for m in debugs)
    assert len(debugs) == len(set(debugs))


def test_bad_knob_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FUSEDMOE_USE_FLASHINFER", "maybe")
    with pytest.raises(ValueError, match="FUSEDMOE_USE_FLASHINFER='maybe'"):
        select_backend(cfg(), CPU)


def test_knobs_override_scope():
    from fusedmoe import knobs

    with knobs.override(BACKEND="torch"):
        assert select_backend(cfg(), CPU).name == "torch"
    assert select_backend(cfg(), CPU).name == "cpu"


# Plugins ---------------------------------------------------------------------------------------------
def _plugin(name: str, **kw) -> Backend:
    base = dict(kinds=frozenset(("oot",)), schemes=frozenset(("unquantized",)), impl=STAND_IN, plugin=True)
    base.update(kw)
    return Backend(name, "test plugin", **base)


def test_register_backend_plugin_wins_on_its_platform():
    register_backend(_plugin("my_npu"))
    try:
        sel = select_backend(cfg(), OOT)
        assert sel.name == "my_npu"
        assert sel.experts.__name__ == "TorchExperts"
        assert select_backend(cfg(), CPU).name == "cpu"  # other platforms unaffected
    finally:
        unregister_backend("my_npu")
    with pytest.raises(NoBackendError):
        select_backend(cfg(), OOT)


def test_entry_point_plugins_load_and_broken_ones_are_skipped(caplog):
    class EP:
        def __init__(self, name, obj):
            self.name, self.obj = name, obj

        def load(self):
            if isinstance(self.obj, Exception):
                raise self.obj
            return self.obj

    eps = [EP("good", lambda: [_plugin("ep_backend", plugin=False)]), EP("broken", ImportError("no module x"))]
    with caplog.at_level(logging.WARNING, logger="fusedmoe"):
        added = load_plugins(eps)
    try:
        assert added == ["ep_backend"]
        assert REGISTRY["ep_backend"].plugin
        assert select_backend(cfg(), OOT).name == "ep_backend"
        assert "backend plugin 'broken' failed to load: no module x" in caplog.text
    finally:
        unregister_backend("ep_backend")


def test_duplicate_registration_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_backend(REGISTRY["cpu"])


def test_backend_record_validation():
    with pytest.raises(ValueError, match="unknown features"):
        _plugin("x", features=frozenset(("magic",)))
    with pytest.raises(ValueError, match="unknown platform kinds"):
        _plugin("x", kinds=frozenset(("quantum",)))
    with pytest.raises(ValueError, match="lowercase"):
        _plugin("X")


def test_platform_validation():
    with pytest.raises(ValueError, match="kind='gpu'"):
        Platform("gpu")
    with pytest.raises(ValueError, match="capability"):
        Platform("cuda", (9,))
    assert Platform("cuda", (9, 0)).has_triton and not Platform("cpu").has_triton


def test_real_platform_is_consistent():
    platform = Platform.current()
    assert platform.kind in ("cuda", "rocm", "xpu", "cpu")
    assert Platform.for_device("cpu").kind == "cpu"


# Property: a chosen backend always supports the config ------------------------------------------
PLATFORMS = [H100, H100_FI_DG, A100, V100, B200_FI_CUTLASS, SPARK_FI, MI300_AITER, CPU, XPU_IPEX, TPU, OOT]
SCHEME_NAMES = [None, *SCHEMES]


@st.composite
def configs(draw):
    num_experts = draw(st.sampled_from([8, 16, 60, 128, 256]))
    activation = draw(st.sampled_from(fusedmoe.activations.ACTIVATIONS))
    gated = activation in fusedmoe.activations.GATED
    top_k = draw(st.integers(1, min(8, num_experts)))
    weight_on_input = draw(st.booleans()) and top_k == 1
    ep = draw(st.sampled_from([1, 2, 4]))
    return MoEConfig(
        num_experts, top_k, draw(st.sampled_from([1024, 2880, 7168])), draw(st.sampled_from([256, 768, 2048])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        activation=activation,
        has_bias=draw(st.booleans()),
        quant=draw(st.sampled_from(SCHEME_NAMES)),
        parallel=ParallelConfig(ep_size=ep, dp_size=draw(st.sampled_from([1, 2])),
                                placement=draw(st.sampled_from(["linear", "round_robin"]))),
        lora=draw(st.booleans()),
        swiglu_limit=draw(st.sampled_from([None, 7.0])) if gated else None,
        activation_format=draw(st.sampled_from(["standard", "batched"])),
        apply_router_weight_on_input=weight_on_input,
        has_expert_map=draw(st.booleans()),
        routing_method=draw(st.sampled_from(["softmax_topk", "grouped_topk", "custom"])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        allow_cutlass=draw(st.booleans()),
    )


ENVS = st.fixed_dictionaries({
    "USE_FLASHINFER": st.sampled_from([None, "0", "1"]),
    "FLASHINFER_MODE": st.sampled_from([None, "latency", "throughput", "masked_gemm"]),
    "USE_DEEP_GEMM": st.sampled_from([None, "0", "1"]),
    "USE_AITER": st.sampled_from([None, "0", "1"]),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=configs(), platform=st.sampled_from(PLATFORMS), env=ENVS)
def test_chosen_backend_supports_config(config, platform, env, kernels):
    from fusedmoe import knobs

    values = {k: (None if v is None else knobs.KNOBS[k].parse(k, v)) for k, v in env.items()}
    with knobs.override(**values):
        try:
            sel = select_backend(config, platform)
        except (NoBackendError, BackendRequestError) as exc:
            assert str(exc)
            return
    record = REGISTRY[sel.name]
    assert record.check(config, platform) is None
    assert record.layout == config.activation_format
    if config.lora:
        assert "lora" in record.features
    if config.swiglu_limit is not None:
        assert "clamp" in record.features
    if sel.via == "auto" or sel.via == "lora":
        assert record.auto


def test_knobs_read_inside_a_fullgraph_compile(monkeypatch):
    """Forward paths read knobs (shared-expert overlap, routing, validation): under
    torch.compile(fullgraph=True) the read is a trace-time constant, not a graph break."""
    from fusedmoe import knobs

    monkeypatch.setenv("FUSEDMOE_SHARED_OVERLAP", "0")

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return x + 1 if knobs.get("SHARED_OVERLAP") is False else x * 2

    with knobs.override(TRITON_ROUTING=False):
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))


def test_explain_names_the_cutlass_opt_in(kernels):
    """explain says why FP8 skips the cutlass rows (allow_cutlass is FP8's switch, as the seeds'
    allow_vllm_cutlass), and NVFP4 on a B200 with cutlass and no FlashInfer chooses cutlass."""
    reasons = {v.name: v.reason for v in explain(cfg(quant="fp8_w8a8_channel"), H100_CUTLASS).verdicts}
    assert "FP8 cutlass backends need allow_cutlass=True (FUSEDMOE_ALLOW_CUTLASS=1)" in reasons["cutlass"]
    assert explain(cfg(quant="nvfp4"), B200_CUTLASS).chosen == "cutlass"
