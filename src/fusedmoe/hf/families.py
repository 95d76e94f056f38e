"""One record per transformers MoE family: where its block is, how it routes, how it stores experts.

    block forward = shared(x) [x sigmoid(shared_gate(x))] + experts(route(router_logits(x)))

Routing kinds (`ROUTINGS`), each a call of `fusedmoe.select_experts` on the block's router:
    softmax_renorm      softmax -> top-k -> renormalize           Mixtral, MiniMax, Hunyuan, Granite, gpt-oss,
                                                                  Qwen3-VL-MoE, Qwen3.5-MoE, JetMoE, Aria
    softmax_norm_topk   ... renormalize iff router.norm_topk_prob  Qwen2/3-MoE, Qwen3-Next, Qwen4-Exp, OLMoE,
                                                                  Mellum, Lara-Mini, FlexOlmo, Qwen3-Omni-MoE
    softmax             softmax -> top-k                          Jamba
    deepseek_v2         softmax, greedy | group max, x scale      DeepSeek-V2 (and DeepSeek-OCR-2, Unlimited-OCR)
    grouped_sigmoid     sigmoid + bias, grouped top-k, x scale     DeepSeek-V3 (and V3.2, dots.llm1, GLM-4.7-Flash,
                        (ungrouped where num_group is None;       GLM-MoE-DSA, Solar-Open, EXAONE-MoE, MiMo-V2-Flash,
                        the scale: Family.weight_scale, else      A.X-K2, Bailing-Hybrid), GLM-4-MoE, HY-V4(-VL), Nemotron-H,
                        the router's routed_scaling_factor)       Beam
    grouped_softmax     softmax, top-2-sum groups, x scale        Mistral-4, Mistral-Large-4
    cohere2             top-k of logits, softmax over k | sigmoid  Cohere2-MoE
    sigmoid_bias        sigmoid + bias select, renormalize [x scale]  MiniMax-M2/M3, HY-V3, AFMoE, Laguna
    sigmoid_topk        sigmoid [+ bias], renorm iff norm_topk_prob [x scale]  LFM2-MoE, Flint
                        (both: bias and scale where Family.selection_bias / weight_scale say)
    score_bias          score_fn + bias select | the token's hash    DeepSeek-V4 (custom)
                        row, renormalize, x scale (score_fn: sqrtsoftplus | sigmoid)
    softmax_bias        softmax + bias select, x scale             LongCat-Flash (bias, scale: Family fields)
    softmax_bias_clamp  softmax + bias select, / clamp(sum, min)   Ernie-4.5-MoE, Ernie-4.5-VL-MoE (custom)
    logit_bias_sigmoid  logits + bias select, sigmoid(picked)      Kolibri-1 (custom)
    sigmoid_shared_sink sigmoid + bias select; the picked and the  Inkling (custom)
                        shared experts' sigmoids normalized
                        together, x scale (Family.shared_logits)
    sparsemixer         SparseMixer-v2 top-2 (inference)           PhiMoE (custom)
    pnorm               softmax -> top-k -> / p-norm               DBRX (custom)
    llama4              sigmoid top-1, weight on the input         Llama-4
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fusedmoe.hf.experts import UnsupportedModel
from fusedmoe.routing import select_experts


@dataclass(frozen=True)
class Family:
    """A transformers MoE block and how fusedmoe runs it.

    `refused` names the feature fusedmoe lacks; such a family is listed but never patched.
    `tiny` holds config keyword arguments of a small random model (tests, `fusedmoe demo --hf`).
    """

    name: str
    model_type: str
    module: str  # transformers.models.<module>.modeling_<module>
    block: str  # class name of the MoE block
    config: str = ""  # config class name in `transformers`
    routing: str = "softmax_renorm"
    layout: str = "fused"
    router: str = "gate"  # block attribute holding the router
    router_linear: str = ""  # router attribute holding the Linear ("" = the router itself)
    router_fp32: bool = False  # logits computed in float32 from float32 weights
    experts: str = "experts"  # block attribute holding the experts ("": the block itself, JetMoE)
    shared: str = ""  # block attribute of a shared-expert MLP added to the output
    shared_gate: str = ""  # Linear(H, 1): shared output x sigmoid(shared_gate(x))
    latent: bool = False  # Nemotron-H fc1/fc2_latent_proj around the experts
    post_norm: str = ""  # block attribute of a norm applied to the block's output (A.X-K1)
    router_softcap: str = ""  # router attribute: cap > 0 makes the logits cap * tanh(logits / cap), float32
    router_no_bias: bool = False  # the router's forward ignores its Linear's bias (LongCat-Flash)
    # where the sigmoid routings find the selection bias and the weights' scale: "name" on the block,
    # "router.name" on the router ("" none)
    selection_bias: str = ""
    weight_scale: str = ""
    shared_combine: str = ""  # block attribute: "sum" or "average" of routed and shared (Cohere2-MoE)
    # router attribute: token id -> its experts [vocab, K]; a router holding it picks by the block's
    # input_ids, and transformers records no router logits for it (DeepSeek-V4's hash layers)
    hash_table: str = ""
    # router attribute: the number S of trailing router logits that score the shared experts
    # (Inkling); the routing then returns their weights [T, S] too, the shared module takes them
    shared_logits: str = ""
    output_bias: str = ""  # block attribute of a [H] bias added to the block's output (JetMoE)
    # experts attribute: that many experts after the routed ones return their input, x weight
    # (LongCat-Flash's zero-computation experts)
    identity_experts: str = ""
    # tensor | with_scores (gpt-oss) | with_logits (Llama-4) | flat_with_logits (Ernie-4.5-VL: both flattened)
    output: str = "tensor"
    jitter: str = ""  # block/router attribute with training-time jitter noise
    refused: str = ""
    tiny: Mapping = field(default_factory=dict, compare=False, hash=False)

    @property
    def module_path(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"

    def experts_of(self, block: torch.nn.Module) -> torch.nn.Module:
        """The module holding the block's experts."""
        return getattr(block, self.experts) if self.experts else block


_ATTN = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
_E4 = dict(_ATTN, intermediate_size=32, num_experts_per_tok=2)
# DeepSeek-style configs: routed experts with a shared one, multi-head latent attention (whose
# every head has its keys), the DSA indexer's sizes
_ROUTED8 = dict(_E4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1)
_MLA_KV = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
_MLA = dict(_MLA_KV, q_lora_rank=24)
_INDEX = dict(index_n_heads=2, index_head_dim=16, index_topk=4)
# Gemma-4's decoder layer calls its router and experts inline: nothing for patch() to replace
_NO_BLOCK = ("no MoE block module: the decoder layer routes its residual (the router's own RMSNorm, scale, "
             "per_expert_scale) and runs the experts on pre_feedforward_layernorm_2 of it, beside a dense MLP; "
             "patch() replaces whole blocks (experts_implementation='fusedmoe' runs the experts)")
# DeepSeek-V2's MoE with multi-head attention, and a small SAM vision encoder (the OCR models)
_OCR_TEXT = dict(_ROUTED8, routed_scaling_factor=1.5, mlp_layer_types=["dense", "sparse"], bos_token_id=1,
                 eos_token_id=2)
_OCR_SAM = dict(hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                patch_size=16, window_size=2, global_attn_indexes=[0], downsample_channels=[16, 32])


FAMILIES: tuple[Family, ...] = (
    Family("Mixtral", "mixtral", "mixtral", "MixtralSparseMoeBlock", "MixtralConfig",
           jitter="jitter_noise", tiny=dict(_E4, num_local_experts=4)),
    Family("MiniMax", "minimax", "minimax", "MiniMaxSparseMoeBlock", "MiniMaxConfig",
           jitter="jitter_noise",
           tiny=dict(_E4, num_local_experts=4, head_dim=16, layer_types=["full_attention"] * 2)),
    Family("MiniMax-M2", "minimax_m2", "minimax_m2", "MiniMaxM2SparseMoeBlock", "MiniMaxM2Config",
           routing="sigmoid_bias", selection_bias="e_score_correction_bias", jitter="jitter_noise",
           tiny=dict(_E4, num_local_experts=8, head_dim=16)),
    # MiniMax-M2's routing x the block's routed_scaling_factor; a dense shared expert; experts in SwiGLU-OAI
    # (gpt-oss's clamped activation on concatenated gate/up halves)
    Family("MiniMax-M3-VL", "minimax_m3_vl_text", "minimax_m3_vl", "MiniMaxM3VLSparseMoeBlock",
           "MiniMaxM3VLTextConfig", routing="sigmoid_bias", selection_bias="router.e_score_correction_bias",
           weight_scale="routed_scaling_factor", shared="shared_experts",
           tiny=dict(_E4, num_local_experts=8, head_dim=16, rotary_dim=8, shared_intermediate_size=48,
                     dense_intermediate_size=64, routed_scaling_factor=2.0, swiglu_limit=0.5,
                     mlp_layer_types=["sparse", "sparse"], layer_types=["minimax_m3_sparse", "full_attention"],
                     index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=1,
                     pad_token_id=1, bos_token_id=None, eos_token_id=2)),
    Family("Qwen2-MoE", "qwen2_moe", "qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeConfig",
           routing="softmax_norm_topk", shared="shared_expert", shared_gate="shared_expert_gate",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, num_experts=4)),
    Family("Qwen3-MoE", "qwen3_moe", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeConfig",
           routing="softmax_norm_topk",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                     head_dim=16, norm_topk_prob=True)),
    Family("Qwen3-Next", "qwen3_next", "qwen3_next", "Qwen3NextSparseMoeBlock", "Qwen3NextConfig",
           routing="softmax_norm_topk", shared="shared_expert", shared_gate="shared_expert_gate",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, num_experts=4, head_dim=16,
                     layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)),
    Family("Qwen4-Exp", "qwen4_exp_text", "qwen4_exp", "Qwen4ExpTextSparseMoeBlock",  # Qwen3-Next's block
           "Qwen4ExpTextConfig", routing="softmax_norm_topk", shared="shared_expert",
           shared_gate="shared_expert_gate",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, num_experts=4, head_dim=16,
                     layer_types=["linear_attention", "indexed_attention"], linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                     indexer_compress_ratio=2)),
    # Qwen3-MoE's block with renormalization always on, in the text model of a vision-language model
    Family("Qwen3-VL-MoE", "qwen3_vl_moe_text", "qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock",
           "Qwen3VLMoeConfig",
           tiny=dict(text_config=dict(_E4, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                      head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[2, 3, 3])),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                        out_hidden_size=64, deepstack_visual_indexes=[0]),
                     # outside the tiny vocabulary: text-only prompts never hold them
                     image_token_id=1000, video_token_id=1001, vision_start_token_id=1002)),
    # Qwen3-MoE's block in the thinker's text model of an any-to-any model
    Family("Qwen3-Omni-MoE", "qwen3_omni_moe_text", "qwen3_omni_moe", "Qwen3OmniMoeThinkerTextSparseMoeBlock",
           "Qwen3OmniMoeThinkerConfig", routing="softmax_norm_topk",
           tiny=dict(text_config=dict(_E4, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                      head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[2, 3, 3])),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                        out_hidden_size=64, deepstack_visual_indexes=[0]),
                     audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32,
                                       output_dim=64, downsample_hidden_size=16),
                     # outside the tiny vocabulary: text-only prompts never hold them
                     image_token_id=1000, video_token_id=1001, audio_token_id=1002, audio_start_token_id=1003,
                     vision_start_token_id=1004)),
    # Qwen3-Next's block in the talker's text model (no class runs it from token ids: tested on embeddings)
    Family("Qwen3-Omni-MoE talker", "qwen3_omni_moe_talker_text", "qwen3_omni_moe",
           "Qwen3OmniMoeTalkerTextSparseMoeBlock", "Qwen3OmniMoeTalkerTextConfig", routing="softmax_norm_topk",
           shared="shared_expert", shared_gate="shared_expert_gate",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                     num_experts=4, head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                      mrope_section=[2, 3, 3]))),
    Family("Qwen3.5-MoE", "qwen3_5_moe_text", "qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock",
           "Qwen3_5MoeTextConfig", shared="shared_expert", shared_gate="shared_expert_gate",
           tiny=dict(_E4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                     head_dim=16, layer_types=["linear_attention", "full_attention"],
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4)),
    Family("Mellum", "mellum", "mellum", "MellumSparseMoeBlock", "MellumConfig",  # Qwen3-MoE's block
           routing="softmax_norm_topk",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                     head_dim=16, norm_topk_prob=True)),
    Family("Lara-Mini", "lara_mini", "lara_mini", "LaraMiniSparseMoeBlock", "LaraMiniConfig",
           routing="softmax_norm_topk", router_fp32=True, shared="shared_expert",
           tiny=dict(_E4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                     head_dim=16, layer_types=["linear_attention", "full_attention"],
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4, eos_token_id=2)),
    Family("FlexOlmo", "flex_olmo", "flex_olmo", "FlexOlmoSparseMoeBlock", "FlexOlmoConfig",
           routing="softmax_norm_topk",
           tiny=dict(_E4, num_experts=4, pad_token_id=1, bos_token_id=None, eos_token_id=2)),
    Family("LFM2-MoE", "lfm2_moe", "lfm2_moe", "Lfm2MoeSparseMoeBlock", "Lfm2MoeConfig",
           routing="sigmoid_topk", selection_bias="expert_bias", weight_scale="router.routed_scaling_factor",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_dense_layers=1,
                     routed_scaling_factor=1.5, layer_types=["conv", "full_attention"])),
    Family("Kolibri-1", "kolibri1", "kolibri1", "Kolibri1SparseMoeBlock", "Kolibri1Config",
           routing="logit_bias_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                     num_experts=8, head_dim=16, norm_topk_prob=True)),
    Family("Laguna", "laguna", "laguna", "LagunaSparseMoeBlock", "LagunaConfig",
           routing="sigmoid_bias", router_softcap="router_logit_softcapping",
           selection_bias="router.e_score_correction_bias", weight_scale="routed_scaling_factor",
           shared="shared_experts",
           tiny=dict(_E4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                     head_dim=16, layer_types=["full_attention"] * 2, num_attention_heads_per_layer=[4, 4],
                     mlp_layer_types=["dense", "sparse"], moe_routed_scaling_factor=1.5,
                     moe_router_logit_softcapping=2.0)),
    Family("Cohere2-MoE", "cohere2_moe", "cohere2_moe", "Cohere2MoeSparseMoeBlock", "Cohere2MoeConfig",
           routing="cohere2", shared="shared_experts", shared_combine="shared_expert_combination_strategy",
           tiny=dict(_E4, num_experts=8, num_shared_experts=1, head_dim=16, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"],
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Family("Flint", "flint", "flint", "FlintSparseMoeBlock", "FlintConfig",
           routing="sigmoid_topk", router_fp32=True, shared="shared_expert",
           tiny=dict(_E4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                     head_dim=16, norm_topk_prob=True, mlp_only_layers=[], sliding_window=8,
                     layer_types=["full_attention", "sliding_attention"])),
    Family("HY-V3", "hy_v3", "hy_v3", "HYV3MoE", "HYV3Config",
           routing="sigmoid_bias", selection_bias="e_score_correction_bias",
           weight_scale="router.router_scaling_factor", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, moe_intermediate_size=32, num_local_experts=8, num_shared_experts=1, head_dim=16,
                     router_scaling_factor=2.5)),
    Family("AFMoE", "afmoe", "afmoe", "AfmoeSparseMoeBlock", "AfmoeConfig",
           routing="sigmoid_bias", selection_bias="expert_bias", weight_scale="router.route_scale",
           router="router", router_linear="gate", shared="shared_experts",
           tiny=dict(_E4, moe_intermediate_size=32, num_experts=8, num_shared_experts=1, head_dim=16,
                     route_scale=2.5)),
    Family("Inkling", "inkling_text", "inkling", "InklingMoE", "InklingTextConfig",
           routing="sigmoid_shared_sink", router_fp32=True, shared="shared_experts",
           shared_logits="n_shared_experts",
           tiny=dict(_E4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, route_scale=2.0,
                     head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                     sliding_window_size=8, d_rel=4, rel_extent=16, local_layer_ids=[0],
                     logits_mup_width_multiplier=1.0, bos_token_id=1, eos_token_id=2)),
    Family("OLMoE", "olmoe", "olmoe", "OlmoeSparseMoeBlock", "OlmoeConfig",
           routing="softmax_norm_topk", tiny=dict(_E4, num_experts=4)),
    Family("DeepSeek-V2", "deepseek_v2", "deepseek_v2", "DeepseekV2Moe", "DeepseekV2Config",
           routing="deepseek_v2", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                     n_shared_experts=1, first_k_dense_replace=0, topk_method="group_limited_greedy",
                     n_group=4, topk_group=2, routed_scaling_factor=1.5, kv_lora_rank=16,
                     q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # DeepSeek-V2's block, router and experts (the sources match) in the text model of an OCR model
    Family("DeepSeek-OCR-2", "deepseek_ocr2_text", "deepseek_ocr2", "DeepseekOcr2TextMoe", "DeepseekOcr2Config",
           routing="deepseek_v2", router_fp32=True, shared="shared_experts",
           tiny=dict(text_config=dict(_OCR_TEXT, topk_method="group_limited_greedy", n_group=4, topk_group=2),
                     vision_config=dict(sam_config=_OCR_SAM, encoder_config=dict(
                         hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2)),
                     image_token_id=1000)),  # outside the tiny vocabulary
    Family("Unlimited-OCR", "unlimited_ocr_text", "unlimited_ocr", "UnlimitedOcrTextMoe", "UnlimitedOcrConfig",
           routing="deepseek_v2", router_fp32=True, shared="shared_experts",
           tiny=dict(text_config=dict(_OCR_TEXT, sliding_window=8),  # greedy: no groups
                     vision_config=dict(sam_config=_OCR_SAM, encoder_config=dict(
                         hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)),
                     image_token_id=1000)),  # outside the tiny vocabulary
    Family("DeepSeek-V3", "deepseek_v3", "deepseek_v3", "DeepseekV3MoE", "DeepseekV3Config",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # DeepSeek-V3's block, router and experts as they are (transformers' copies: the sources match)
    Family("DeepSeek-V3.2", "deepseek_v32", "deepseek_v32", "DeepseekV32MoE", "DeepseekV32Config",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_ROUTED8, **_MLA, **_INDEX, first_k_dense_replace=1, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5)),
    Family("dots.llm1", "dots1", "dots1", "Dots1MoE", "Dots1Config",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_ROUTED8, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, head_dim=16)),
    Family("GLM-4.7-Flash", "glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLiteMoE", "Glm4MoeLiteConfig",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_ROUTED8, **_MLA, first_k_dense_replace=1, n_group=1, topk_group=1,
                     routed_scaling_factor=1.8)),
    Family("GLM-MoE-DSA", "glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaMoE", "GlmMoeDsaConfig",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_ROUTED8, **_MLA, **_INDEX, first_k_dense_replace=1, n_group=1, topk_group=1,
                     routed_scaling_factor=2.5)),
    Family("Solar-Open", "solar_open", "solar_open", "SolarOpenMoE", "SolarOpenConfig",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                     n_group=1, topk_group=1, routed_scaling_factor=1.5, head_dim=16)),
    Family("EXAONE-MoE", "exaone_moe", "exaone_moe", "ExaoneMoeSparseMoEBlock", "ExaoneMoeConfig",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                     num_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                     routed_scaling_factor=2.5, head_dim=16)),
    Family("MiMo-V2-Flash", "mimo_v2_flash", "mimo_v2_flash", "MiMoV2FlashMoE", "MiMoV2FlashConfig",
           routing="grouped_sigmoid", router_fp32=True,
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                     n_group=1, topk_group=1, routed_scaling_factor=1.5, head_dim=16, v_head_dim=16)),
    # GLM-4-MoE's router and block; experts clamp before silu(gate) * up (swiglu_limit)
    Family("HY-V4", "hy_v4", "hy_v4", "HYV4MoE", "HYV4Config",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_ROUTED8, **_INDEX, n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=16,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, swiglu_limit=0.5,
                     num_key_value_heads=4, pad_token_id=1, bos_token_id=None, eos_token_id=2,
                     mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention"] * 2)),
    # sqrt(softplus) (or sigmoid) scores with a selection bias, no groups; the first layers pick by
    # token id (hash_moe); experts and shared expert clamped by swiglu_limit
    Family("DeepSeek-V4", "deepseek_v4", "deepseek_v4", "DeepseekV4SparseMoeBlock", "DeepseekV4Config",
           routing="score_bias", selection_bias="router.e_score_correction_bias",
           weight_scale="router.routed_scaling_factor", hash_table="tid2eid", shared="shared_experts",
           tiny=dict(_ATTN, num_key_value_heads=1, head_dim=32, q_lora_rank=24, moe_intermediate_size=32,
                     n_routed_experts=8, num_experts_per_tok=2, swiglu_limit=0.5, o_groups=2, o_lora_rank=16,
                     **_INDEX, sliding_window=8, hc_mult=2, mlp_layer_types=["hash_moe", "moe"],
                     layer_types=["sliding_attention", "compressed_sparse_attention"])),
    Family("Mistral-4", "mistral4", "mistral4", "Mistral4MoE", "Mistral4Config",
           routing="grouped_softmax", shared="shared_experts",
           tiny=dict(_ROUTED8, **_MLA, n_group=4, topk_group=2, routed_scaling_factor=1.5, head_dim=16)),
    Family("Mistral-Large-4", "mistral_large4_text", "mistral_large4", "MistralLarge4TextMoE",
           "MistralLarge4Config", routing="grouped_softmax", router_fp32=True, shared="shared_experts",
           tiny=dict(text_config=dict(_ROUTED8, **_MLA_KV, **_INDEX, n_group=4, topk_group=2,
                                      routed_scaling_factor=1.5, head_dim=16, first_k_dense_replace=0,
                                      bos_token_id=1, eos_token_id=2,
                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                     vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, head_dim=16),
                     image_token_index=1000)),  # outside the tiny vocabulary
    Family("dots.note-3", "dots3_note_text", "dots3_note", "Dots3NoteTextMoE", "Dots3NoteTextConfig",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",  # DeepSeek-V3's router
           tiny=dict(_ROUTED8, **_MLA, **_INDEX, shared_experts_intermediate_size=48, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, head_dim=16, sliding_window=8, layer_types=["indexed_attention", "sliding_attention"],
                     mlp_layer_types=["dense", "sparse"], pad_token_id=1, bos_token_id=None, eos_token_id=2)),
    Family("GLM-5-Next", "glm5_next_text", "glm5_next", "Glm5NextTextMoE", "Glm5NextConfig",  # DeepSeek-V3's block
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",  # experts: clamped silu
           tiny=dict(text_config=dict(_ROUTED8, **dict(_MLA, qk_rope_head_dim=0, qk_nope_head_dim=16), **_INDEX,
                                      n_group=4, topk_group=2, routed_scaling_factor=2.5, head_dim=0, linear_head_dim=16,
                                      linear_num_heads=4, swiglu_limit=0.5, index_kpool=4, pad_token_id=1,
                                      layer_types=["linear_attention", "indexed_attention"],
                                      mlp_layer_types=["sparse", "sparse"]),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                        out_hidden_size=64, projection_intermediate_size=64),
                     # outside the tiny vocabulary: text-only prompts never hold them
                     image_token_id=1000, video_token_id=1001, image_start_token_id=1002,
                     image_end_token_id=1003, video_start_token_id=1004, video_end_token_id=1005)),
    Family("Kimi-Linear", "kimi_linear", "kimi_linear", "KimiLinearMoE", "KimiLinearConfig",  # DeepSeek-V3's block
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_token=2, num_shared_experts=1, num_expert_group=4, topk_group=2,
                     routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                     v_head_dim=16, linear_head_dim=16, linear_num_heads=4,
                     layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"],
                     pad_token_id=1, bos_token_id=None, eos_token_id=2)),
    Family("A.X-K1", "axk1", "axk1", "AXK1MoE", "AXK1Config",  # DeepSeek-V3's block, then a norm
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts", post_norm="post_mlp_layernorm",
           tiny=dict(_ROUTED8, **_MLA, first_k_dense_replace=1, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5)),
    Family("A.X-K2", "axk2", "axk2", "AXK2MoE", "AXK2Config",  # DeepSeek-V3's block, groups optional
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_ROUTED8, **_MLA, **_INDEX, first_k_dense_replace=1, routed_scaling_factor=2.5)),
    Family("Bailing-Hybrid", "bailing_hybrid", "bailing_hybrid", "BailingHybridMoE",  # DeepSeek-V3's block
           "BailingHybridConfig", routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, **_MLA_KV, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                     n_shared_experts=1, q_lora_rank=None, head_dim=16, n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, num_mtp_layers=0,
                     layer_types=["linear_attention", "full_attention"], pad_token_id=1, eos_token_id=2)),
    Family("Beam", "beam", "beam", "BeamMoE", "BeamConfig",  # DeepSeek-V3's router, the scale on the output
           routing="grouped_sigmoid", router_fp32=True, weight_scale="routed_scaling_factor",
           tiny=dict(_E4, moe_intermediate_size=32, num_experts=8, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, head_dim=16, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])),
    Family("GLM-4-MoE", "glm4_moe", "glm4_moe", "Glm4MoeMoE", "Glm4MoeConfig",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(_E4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                     n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
                     head_dim=16, routed_scaling_factor=1.5)),
    Family("GLM-4.5V", "glm4v_moe_text", "glm4v_moe", "Glm4vMoeTextMoE", "Glm4vMoeConfig",  # GLM-4-MoE's block
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(text_config=dict(_E4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                      n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
                                      routed_scaling_factor=1.5,
                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                           partial_rotary_factor=0.5, mrope_section=[1, 1, 2])),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                        out_hidden_size=64),
                     # outside the tiny vocabulary: text-only prompts never hold them
                     image_token_id=1000, video_token_id=1001, image_start_token_id=1002,
                     image_end_token_id=1003, video_start_token_id=1004, video_end_token_id=1005)),
    # HY-V4's block (HY-V4's router, its clamped experts) in the text model of a vision-language model
    Family("HY-V4-VL", "hy_v4_vl_text", "hy_v4_vl", "HYV4VLMoE", "HYV4VLConfig",
           routing="grouped_sigmoid", router_fp32=True, shared="shared_experts",
           tiny=dict(text_config=dict(_ROUTED8, **_INDEX, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, q_lora_rank=24,
                                      kv_lora_rank=16, swiglu_limit=0.5, pad_token_id=1, bos_token_id=None,
                                      eos_token_id=2, mlp_layer_types=["dense", "sparse"],
                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                           mrope_section=[2, 1, 1])),
                     vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, out_hidden_size=64),
                     image_token_id=1000, video_token_id=1001)),  # outside the tiny vocabulary
    Family("Nemotron-H", "nemotron_h", "nemotron_h", "NemotronHMoE", "NemotronHConfig",
           routing="grouped_sigmoid", router_fp32=True, layout="up_only", shared="shared_experts",
           latent=True,
           tiny=dict(_ATTN, layers_block_type=["attention", "moe"], intermediate_size=64,
                     moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                     n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     head_dim=16, routed_scaling_factor=1.5, use_mamba_kernels=False)),
    Family("gpt-oss", "gpt_oss", "gpt_oss", "GptOssMLP", "GptOssConfig",
           layout="gpt_oss", router="router", output="with_scores",
           tiny=dict(_E4, num_local_experts=4, head_dim=16, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"])),
    Family("GraniteMoE", "granitemoe", "granitemoe", "GraniteMoeMoE", "GraniteMoeConfig",
           router="router", tiny=dict(_E4, num_local_experts=4)),
    Family("GraniteMoE-SWA", "granitemoe_swa", "granitemoe_swa", "GraniteMoeSWAMoE", "GraniteMoeSWAConfig",
           router="router",
           tiny=dict(_E4, num_local_experts=4, sliding_window=8,
                     layer_types=["full_attention", "sliding_attention"], layer_rope_theta=[10000.0] * 2)),
    Family("GraniteMoE-Shared", "granitemoeshared", "granitemoeshared", "GraniteMoeSharedMoE",
           "GraniteMoeSharedConfig", router="router",
           tiny=dict(_E4, num_local_experts=4, shared_intermediate_size=48)),
    Family("GraniteMoE-Hybrid", "granitemoehybrid", "granitemoehybrid", "GraniteMoeHybridMoE",
           "GraniteMoeHybridConfig", router="router",
           tiny=dict(_E4, num_local_experts=4, shared_intermediate_size=48,
                     layer_types=["attention", "attention"])),
    # zero-computation experts: ids >= n_routed_experts return their input x weight; the router's
    # classifier bias (router_bias) is never applied by its forward
    Family("LongCat-Flash", "longcat_flash", "longcat_flash", "LongcatFlashMoE", "LongcatFlashConfig",
           routing="softmax_bias", layout="longcat", router="router", router_linear="classifier",
           router_fp32=True, router_no_bias=True, selection_bias="router.e_score_correction_bias",
           weight_scale="router.routed_scaling_factor", identity_experts="zero_expert_num",
           tiny=dict(_ROUTED8, **_MLA, num_hidden_layers=4, num_experts_per_tok=3, head_dim=8,  # 2 layers
                     zero_expert_num=2, routed_scaling_factor=1.5)),
    # experts held by the block (JetMoeParallelExperts), a bias added to the block's output; its
    # mixture-of-attention experts (JetMoeMoA) are attention, left to transformers
    Family("JetMoE", "jetmoe", "jetmoe", "JetMoeMoE", "JetMoeConfig",
           layout="jetmoe", router="router", router_linear="layer", experts="", output_bias="bias",
           tiny=dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
                     intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=128)),
    Family("PhiMoE", "phimoe", "phimoe", "PhimoeSparseMoeBlock", "PhimoeConfig",
           routing="sparsemixer", router="router", jitter="input_jitter_noise",
           tiny=dict(_E4, num_local_experts=4)),
    Family("Jamba", "jamba", "jamba", "JambaSparseMoeBlock", "JambaConfig",
           routing="softmax", router="router",
           tiny=dict(_E4, num_experts=4, attn_layer_period=1, attn_layer_offset=0,
                     expert_layer_period=1, expert_layer_offset=0, use_mamba_kernels=False)),
    Family("Hunyuan-MoE", "hunyuan_v1_moe", "hunyuan_v1_moe", "HunYuanMoEV1Moe", "HunYuanMoEV1Config",
           router_linear="wg", shared="shared_mlp",
           tiny=dict(_ATTN, intermediate_size=32, num_experts=4, moe_topk=2, head_dim=16)),
    Family("Ernie-4.5-MoE", "ernie4_5_moe", "ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock",
           "Ernie4_5_MoeConfig", routing="softmax_bias_clamp", router_fp32=True, shared="shared_experts",
           tiny=dict(_ATTN, intermediate_size=64, moe_intermediate_size=32, moe_num_experts=4,
                     moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0, head_dim=16)),
    # Ernie-4.5-MoE's routing in each of the text and vision blocks of a modality block, which keeps the
    # split of the tokens by moe_mm_token_type_ids and the shared experts (transformers' code)
    Family("Ernie-4.5-VL-MoE", "ernie4_5_vl_moe_text", "ernie4_5_vl_moe", "Ernie4_5_VLMoeSparseMoeBlock",
           "Ernie4_5_VLMoeConfig", routing="softmax_bias_clamp", router_fp32=True, output="flat_with_logits",
           tiny=dict(text_config=dict(_ATTN, intermediate_size=64, moe_intermediate_size=[32, 48], moe_num_experts=4,
                                      moe_k=2, moe_num_shared_experts=1, mlp_layer_types=["sparse", "sparse"],
                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                           mrope_section=[3, 3, 2])),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2),
                     # outside the tiny vocabulary: text-only prompts never hold them
                     image_token_id=1000, video_token_id=1001, image_start_token_id=1002,
                     image_end_token_id=1003, video_start_token_id=1004, video_end_token_id=1005)),
    Family("Llama-4", "llama4_text", "llama4", "Llama4TextMoe", "Llama4TextConfig",
           routing="llama4", layout="transposed", router="router", shared="shared_expert",
           output="with_logits",
           tiny=dict(_ATTN, intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4,
                     num_experts_per_tok=1, head_dim=16)),
    # Mixtral's routing (top-k of the logits, softmax over k), shared experts, experts stored transposed
    Family("Aria", "aria_text", "aria", "AriaTextMoELayer", "AriaTextConfig",
           layout="transposed", router="router", shared="shared_experts",
           tiny=dict(_E4, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2, head_dim=16)),
    Family("DBRX", "dbrx", "dbrx", "DbrxFFN", "DbrxConfig",
           routing="pnorm", layout="dbrx", router="router", router_linear="layer",
           tiny=dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=128,
                     # rope_theta and clip_qkv: DbrxAttention reads both unconditionally.
                     attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                     ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                                     moe_normalize_expert_weights=1.0))),
    # Listed so that patch() names the missing feature instead of skipping the blocks.
    Family("Step-3.7", "step3p5", "step3p7", "Step3p7SparseMoeBlock",
           refused="SwiGLU-step (the clamp after silu: min(silu(g), L) * clamp(u, -L, L), "
                   "swiglu_limits) is not an activation fusedmoe runs"),
    Family("Inkling-2", "inkling2_text", "inkling2", "Inkling2SparseMoeBlock",
           refused="softcapped SwiGLU (mlp_gate_softcap / mlp_up_softcap) is not supported"),
    Family("Inkling-2-Loop", "inkling2_loop_text", "inkling2_loop", "Inkling2LoopSparseMoeBlock",  # Inkling-2's
           refused="softcapped SwiGLU (mlp_gate_softcap / mlp_up_softcap) is not supported"),
    Family("OpenAI-Privacy-Filter", "openai_privacy_filter", "openai_privacy_filter", "OpenAIPrivacyFilterMLP",
           refused="experts that upcast every projection to float32 whatever the model's dtype are not "
                   "supported (a token-classification encoder; otherwise gpt-oss's block with concatenated "
                   "gate/up, weights / top_k and the output x top_k)"),
    Family("Muse-Spark", "muse_spark_text", "muse_spark", "MuseSparkMoE",
           refused="a norm after each expert (has_post_expert_norm) is not supported"),
    # Gemma-4's MoE (and DiffusionGemma's, a copy): found by the experts class, present only where the MoE is
    Family("Gemma-4", "gemma4_text", "gemma4", "Gemma4TextExperts",
           refused=_NO_BLOCK),
    Family("DiffusionGemma", "diffusion_gemma_text", "diffusion_gemma", "DiffusionGemmaTextExperts",
           refused=_NO_BLOCK),
    # patch refuses the block; its experts (ZayaExperts, top-1, the skip expert's weight zeroed by
    # the router) run through experts_implementation="fusedmoe", tested from this tiny config
    Family("ZAYA", "zaya", "zaya", "ZayaSparseMoeBlock", "ZayaConfig",
           refused="its router is an MLP (down_proj, norm, two GELU layers, out_proj) over a state "
                   "carried from the previous layer's router, with a skip expert; fusedmoe routes on "
                   "a linear router's logits (experts_implementation='fusedmoe' runs its experts)",
           tiny=dict(_ATTN, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1,
                     router_hidden_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Family("Doge", "doge", "doge", "DogeCDMoE",
           refused="product-key routing (CDMoE: top-k of sums of two half-key scores, on router logits "
                   "that transformers reshapes across tokens) over single-neuron experts (rows of "
                   "down_embed / up_embed) is not a routing or an experts layout fusedmoe runs"),
    Family("NLLB-MoE", "nllb_moe", "nllb_moe", "NllbMoeSparseMLP",
           refused="capacity-limited top-2 routing (tokens over expert capacity are dropped) is not "
                   "supported"),
    Family("SwitchTransformers", "switch_transformers", "switch_transformers",
           "SwitchTransformersSparseMLP",
           refused="capacity-limited top-1 routing (tokens over expert capacity are dropped) is not "
                   "supported"),
)

BY_NAME: dict[str, Family] = {f.name.lower(): f for f in FAMILIES}
BY_NAME.update({f.model_type: f for f in FAMILIES})


def family(name: str) -> Family:
    """A family by display name or model_type (case-insensitive)."""
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        names = sorted(f.model_type for f in FAMILIES if not f.refused)
        raise KeyError(f"unknown MoE family {name!r}; supported: {names}") from None


# Routing ------------------------------------------------------------------------------------------
# (family, block, router, x, logits, top_k, token_ids [T] | None) -> (weights, ids), + the shared
# experts' weights [T, S] where Family.shared_logits names their count; token_ids: the block's
# input_ids, read by hash routers only (`Family.hash_table`)
Route = Callable[[Family, torch.nn.Module, torch.nn.Module, torch.Tensor, torch.Tensor, int, torch.Tensor | None],
                 tuple[torch.Tensor, ...]]


def router_linear(fam: Family, router: torch.nn.Module) -> torch.nn.Module:
    """The module holding the router's weight [E, H] (and bias)."""
    return getattr(router, fam.router_linear) if fam.router_linear else router


def router_logits(fam: Family, router: torch.nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    """logits [T, E] = x @ W.T (+ b), in float32 where the family's router is float32; softcapped
    in float32 where the family's router caps them (Laguna: what its router returns, and routes on)."""
    linear = router_linear(fam, router)
    weight = linear.weight
    bias = None if fam.router_no_bias else getattr(linear, "bias", None)
    if fam.router_fp32:
        logits = F.linear(x_TH.float(), weight.float(), None if bias is None else bias.float())
    else:
        logits = F.linear(x_TH.to(weight.dtype), weight, bias)
    cap = float(getattr(router, fam.router_softcap)) if fam.router_softcap else 0.0
    if cap > 0.0:
        logits = torch.tanh(logits.float() / cap) * cap
    return logits


def top_k_of(block: torch.nn.Module, router: torch.nn.Module) -> int:
    for owner in (router, block):
        top_k = getattr(owner, "top_k", None)
        if isinstance(top_k, int):
            return top_k
    raise UnsupportedModel(f"{type(block).__name__}: no top_k on the block or its router")


def _softmax_renorm(fam, block, router, x, logits, top_k, token_ids):
    return select_experts(x, logits, top_k, renormalize=True)


def _softmax_norm_topk(fam, block, router, x, logits, top_k, token_ids):
    return select_experts(x, logits, top_k, renormalize=bool(router.norm_topk_prob))


def _softmax(fam, block, router, x, logits, top_k, token_ids):
    return select_experts(x, logits, top_k, renormalize=False)


def _deepseek_v2(fam, block, router, x, logits, top_k, token_ids):
    method = router.topk_method
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModel(f"DeepSeek-V2 topk_method={method!r} is not supported")
    grouped = method == "group_limited_greedy"
    return select_experts(
        x, logits, top_k, renormalize=False, use_grouped_topk=grouped,
        num_expert_group=router.num_group if grouped else None,
        topk_group=router.topk_group if grouped else None,
        routed_scaling_factor=float(router.routed_scaling_factor),
    )


def _grouped_sigmoid(fam, block, router, x, logits, top_k, token_ids):
    # DeepSeek-V3: groups ranked by the sum of their two best biased scores; over all experts where
    # the router has no groups (A.X-K2-Light: num_group None); x the router's routed_scaling_factor,
    # or the declared scale (Beam scales the block's output by its own: the same product)
    grouped = router.num_group is not None
    scale = _declared(block, router, fam.weight_scale or "router.routed_scaling_factor")
    return select_experts(
        x, logits, top_k, scoring_func="sigmoid", use_grouped_topk=grouped,
        num_expert_group=router.num_group if grouped else None, topk_group=router.topk_group if grouped else None,
        e_score_correction_bias=router.e_score_correction_bias,
        renormalize=bool(router.norm_topk_prob),
        routed_scaling_factor=float(scale),
    )


def _grouped_softmax(fam, block, router, x, logits, top_k, token_ids):
    # Mistral-4: softmax scores, groups ranked by the sum of their two best scores (no correction
    # bias), renormalize iff norm_topk_prob (Mistral-Large-4: always), x routed_scaling_factor.
    # transformers masks the other groups with 0.0 where select_experts uses -inf: the same pick,
    # every kept score being > 0.
    return select_experts(
        x, logits, top_k, scoring_func="softmax", use_grouped_topk=True,
        num_expert_group=router.num_group, topk_group=router.topk_group, group_score="top2_sum",
        renormalize=bool(getattr(router, "norm_topk_prob", True)),
        routed_scaling_factor=float(router.routed_scaling_factor),
    )


def _cohere2(fam, block, router, x, logits, top_k, token_ids):
    # Cohere2-MoE: top-k of the logits, then softmax over the k (= softmax_renorm) or sigmoid
    # (renormalized iff norm_topk_prob); expert_selection_fn is checked at patch time
    if router.expert_selection_fn == "softmax":
        return select_experts(x, logits, top_k, renormalize=True)
    return select_experts(x, logits, top_k, scoring_func="sigmoid", renormalize=bool(router.norm_topk_prob))


def _declared(block, router, path: str, *, optional: bool = False):
    """The value a Family field names ("name": the block's, "router.name": the router's; "": None)."""
    if not path:
        return None
    owner, name = (router, path.removeprefix("router.")) if path.startswith("router.") else (block, path)
    if optional:
        return getattr(owner, name, None)
    return getattr(owner, name)


def _sigmoid_bias(fam, block, router, x, logits, top_k, token_ids):
    # sigmoid + the declared selection bias, renormalize, x the declared scale: MiniMax-M2, HY-V3,
    # AFMoE, Laguna (on its softcapped logits: Family.router_softcap)
    scale = _declared(block, router, fam.weight_scale)
    return select_experts(
        x, logits, top_k, scoring_func="sigmoid", renormalize=True,
        e_score_correction_bias=_declared(block, router, fam.selection_bias),
        routed_scaling_factor=1.0 if scale is None else float(scale),
    )


def _sigmoid_topk(fam, block, router, x, logits, top_k, token_ids):
    # LFM2-MoE: the block's selection bias where it has one (use_expert_bias); renormalize iff
    # norm_topk_prob (transformers adds 1e-6 to the sum: <= 5e-7 relative on the weights); x its
    # scale. Flint: no bias, no scale.
    scale = _declared(block, router, fam.weight_scale)
    return select_experts(
        x, logits, top_k, scoring_func="sigmoid", renormalize=bool(router.norm_topk_prob),
        e_score_correction_bias=_declared(block, router, fam.selection_bias, optional=True),
        routed_scaling_factor=1.0 if scale is None else float(scale),
    )


def hash_table_of(fam: Family, router: torch.nn.Module) -> torch.Tensor | None:
    """The router's token id -> experts table where the family declares one and this router has it."""
    return getattr(router, fam.hash_table, None) if fam.hash_table else None


# transformers' router score functions by class -> float32 scores (DeepSeek-V4's score_fn)
_SCORE_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "SqrtSoftplusActivation": lambda lg: F.softplus(lg).sqrt(),
    "Sigmoid": torch.sigmoid,
}


def score_fn_of(fam: Family, router: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    name = type(router.score_fn).__name__
    if name not in _SCORE_FNS:
        raise UnsupportedModel(f"{fam.name}: router score function {name} is not one fusedmoe knows "
                               f"(supported: {sorted(_SCORE_FNS)})")
    return _SCORE_FNS[name]


def _score_bias(fam, block, router, x, logits, top_k, token_ids):
    # DeepSeek-V4: scores = score_fn(logits); ids = top-k of scores + the declared bias, or the
    # token's row of the hash table; weights = the picked scores, renormalized (transformers adds
    # 1e-20 to the sum), x the declared scale
    score = score_fn_of(fam, router)
    table = hash_table_of(fam, router)
    if table is not None and token_ids is None:
        raise UnsupportedModel(f"{fam.name}: a hash-routed block needs the block's input_ids (inputs_embeds alone "
                               "cannot be routed)")
    bias_E = None if table is not None else _declared(block, router, fam.selection_bias)
    scale = _declared(block, router, fam.weight_scale)

    def route(hidden, logits_TE, k, renormalize):
        p = score(logits_TE.float())
        if table is None:
            ids = torch.topk(p + bias_E.float(), k, dim=-1).indices
        else:
            ids = table[token_ids.reshape(-1)].long()
        w = p.gather(-1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20), ids

    return select_experts(x, logits, top_k, custom_routing_function=route,
                          routed_scaling_factor=1.0 if scale is None else float(scale))


def _softmax_bias(fam, block, router, x, logits, top_k, token_ids):
    # LongCat-Flash: softmax scores + the declared bias for selection, no renormalization, x the
    # declared scale; its identity experts are ids >= the routed count (Family.identity_experts)
    return select_experts(
        x, logits, top_k, scoring_func="softmax", renormalize=False,
        e_score_correction_bias=_declared(block, router, fam.selection_bias),
        routed_scaling_factor=float(_declared(block, router, fam.weight_scale)),
    )


def _softmax_bias_clamp(fam, block, router, x, logits, top_k, token_ids):
    bias_E = router.moe_statics.e_score_correction_bias.reshape(-1)
    norm_min = float(router.norm_min)

    def route(hidden, logits_TE, k, renormalize):
        p = torch.softmax(logits_TE.float(), dim=-1)
        ids = torch.topk(p + bias_E.float(), k, dim=-1).indices
        w = p.gather(-1, ids)
        return w / w.sum(dim=-1, keepdim=True).clamp(min=norm_min), ids

    return select_experts(x, logits, top_k, custom_routing_function=route)


def _logit_bias_sigmoid(fam, block, router, x, logits, top_k, token_ids):
    # Kolibri-1: select on the logits plus the bias, weight = sigmoid of the picked logits,
    # renormalize iff norm_topk_prob
    bias_E = router.e_score_correction_bias
    renorm = bool(router.norm_topk_prob)

    def route(hidden, logits_TE, k, renormalize):
        lg = logits_TE.float()
        ids = torch.topk(lg + bias_E.float(), k, dim=-1).indices
        w = lg.gather(-1, ids).sigmoid()
        return (w / w.sum(dim=-1, keepdim=True) if renorm else w), ids

    return select_experts(x, logits, top_k, custom_routing_function=route)


def _sigmoid_shared_sink(fam, block, router, x, logits, top_k, token_ids):
    # Inkling: logits [T, E + S], the last S scoring the shared experts. Select on sigmoid + the
    # bias over the E routed ones; the weights of the k picked and the S shared experts are their
    # sigmoids normalized together (as transformers: softmax of their logsigmoids), x route_scale x
    # global_scale. Returns (weights [T, K], ids [T, K], shared weights [T, S]).
    n_shared = int(getattr(router, fam.shared_logits))
    lg = logits.float()
    routed_TE, shared_TS = lg[:, :-n_shared], lg[:, -n_shared:]
    ids = torch.topk(routed_TE.sigmoid() + router.e_score_correction_bias.float(), top_k, dim=-1).indices
    log_p = F.logsigmoid(torch.cat((routed_TE.gather(-1, ids), shared_TS), dim=-1))
    w = torch.exp(log_p - torch.logsumexp(log_p, dim=-1, keepdim=True))
    w = w * float(router.route_scale) * router.global_scale.float()
    weights, ids = select_experts(x, routed_TE, top_k, custom_routing_function=lambda *_: (w[:, :top_k], ids))
    return weights, ids, w[:, top_k:]


def _sparsemixer(fam, block, router, x, logits, top_k, token_ids):
    if top_k != 2:
        raise UnsupportedModel(f"PhiMoE's SparseMixer routing picks exactly 2 experts, config asks {top_k}")
    eps2 = 2 * float(router.router_jitter_noise)

    def pick(scores, masked):
        # One SparseMixer-v2 step (inference): softmax over the experts within a relative margin of
        # the best remaining one; weight = that softmax at the best expert.
        best, ids = masked.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > eps2
        w = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1).gather(-1, ids)
        return w, ids

    def route(hidden, logits_TE, k, renormalize):
        # In the logits' dtype, as transformers: the margin test flips in bf16 otherwise (routing
        # differences gave 9e-2 relative error on bf16 logits, against 1e-2 for other families).
        scores = logits_TE
        w1, id1 = pick(scores, scores)
        w2, id2 = pick(scores, scores.scatter(-1, id1, float("-inf")))
        return torch.cat((w1, w2), dim=-1), torch.cat((id1, id2), dim=-1)

    return select_experts(x, logits, top_k, custom_routing_function=route)


def _pnorm(fam, block, router, x, logits, top_k, token_ids):
    p = block.moe_normalize_expert_weights

    def route(hidden, logits_TE, k, renormalize):
        w, ids = torch.topk(torch.softmax(logits_TE.float(), dim=-1), k, dim=-1)
        if p is not None:
            w = w / torch.norm(w, p=p, dim=-1, keepdim=True)
        return w, ids

    return select_experts(x, logits, top_k, custom_routing_function=route)


def _llama4(fam, block, router, x, logits, top_k, token_ids):
    # top_k == 1 is checked at patch time (the weight goes on the input).
    return select_experts(x, logits, top_k, scoring_func="sigmoid", renormalize=False)


ROUTINGS: dict[str, Route] = {
    "softmax_renorm": _softmax_renorm,
    "softmax_norm_topk": _softmax_norm_topk,
    "softmax": _softmax,
    "deepseek_v2": _deepseek_v2,
    "grouped_sigmoid": _grouped_sigmoid,
    "grouped_softmax": _grouped_softmax,
    "cohere2": _cohere2,
    "sigmoid_bias": _sigmoid_bias,
    "sigmoid_topk": _sigmoid_topk,
    "score_bias": _score_bias,
    "softmax_bias": _softmax_bias,
    "softmax_bias_clamp": _softmax_bias_clamp,
    "logit_bias_sigmoid": _logit_bias_sigmoid,
    "sigmoid_shared_sink": _sigmoid_shared_sink,
    "sparsemixer": _sparsemixer,
    "pnorm": _pnorm,
    "llama4": _llama4,
}
