"""Routing in one Triton launch: router logits [T, E] -> (weights float32 [T, K], ids int32 [T, K]).

The same math as `fusedmoe.routing.select_experts` (softmax or sigmoid scores in float32, the
correction bias on selection only, DeepSeek's grouped top-k, renormalisation, the routed scaling
factor), which on a GPU is ~8 small torch launches (float cast, softmax, top-k, gather, sum,
add, divide, int cast; DeepSeek-V3's groups add ~8 more) where vLLM runs one fused kernel.

`moe_routing_kernel`: one program per token holds the token's E scores in registers (E padded to
a power of two), picks the kept groups, then the top_k experts, one at a time (ties to the lower
id; ids come out best first, as torch.topk(sorted=True) gives them), and writes the weights after
renormalising. Each pick is two 32-bit reductions (`_first_max`: the largest key, then the lowest
position holding it), which a warp does in one `redux.sync` each, on the scores as order-keeping
integers (`_ordered_key`); taken and padded positions hold a key below every score's, -inf's
included, so a row whose open scores are all -inf still gets its lowest free ids, distinct.
(Against `tl.argmax` with a max and a min for the all -inf case, ~20 shuffles a pick: H200, in a
CUDA graph, Qwen3-30B M=1 3.5 -> 1.9 us, DeepSeek-V3 M=4096 16.9 -> 8.5, Kimi-K2 M=4096 37.1 ->
13.5; `benchmarks/results/2026-11-28_h200_routing_two_reductions_ab.txt`.)
On sm90+ it joins the experts' programmatic-dependent-launch chain: it waits for the kernel before
it (`_pdl_wait`) and, once its weights and ids are stored, lets the next kernel launch
(`_pdl_release`): the experts' first launch (`launch_pdl`, waiting in its own `gdc_wait` until
routing's writes are visible) no longer starts after routing has retired. H200, layer decode with
routing (`fusedmoe bench --routing`, A/B in one session): M=1 -0.3 to -6.1% on five presets, M=4-16
up to -3%, no cell slower; releasing at the program's start instead gained another 0.2-0.6 us at
M=1 but cost Llama-4 M=16 4 us (`benchmarks/results/2026-11-28_h200_routing_pdl_ab.txt`).

`fusedmoe.routing.routing_kernel_unsupported(...)` says why a configuration stays on the torch
path (None: this kernel runs it): E over `ROUTING_KERNEL_MAX_EXPERTS`, top_k over
`ROUTING_KERNEL_MAX_TOP_K`, groups that do not split E into powers of two. (The rule lives there,
without triton, so `select_experts` and `fusedmoe explain` answer on any machine.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedmoe.backends.triton.experts import pdl
from fusedmoe.backends.triton.kernels import _pdl_release, _pdl_wait
from fusedmoe.backends.triton.launcher import launch
from fusedmoe.routing import resolve_group_score

# below every score's key, -inf's included: taken and padded positions
_NO_KEY = tl.constexpr(-(2**31))


@triton.jit
def _ordered_key(x):
    """float32 -> int32 in the same order: the bits, a negative's magnitude bits flipped (-0 made
    +0 first, as the comparisons of floats equate them)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _first_max(key, positions, NONE: tl.constexpr, AXIS: tl.constexpr):
    """The lowest position holding the largest key along AXIS (argmax, ties to the left), by two
    integer reductions instead of argmax's (value, index) shuffles."""
    if AXIS == 0:
        return tl.min(tl.where(key == tl.max(key, 0), positions, NONE), 0)
    else:
        return tl.min(tl.where(key == tl.max(key, 1)[:, None], positions, NONE), 1)


@triton.jit
def moe_routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_experts, stride_lt, stride_le, routed_scaling_factor,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, PDL: tl.constexpr = False, TOP2_GROUPS: tl.constexpr = False,
):
    """One token: weights[t, :TOP_K], ids[t, :TOP_K]. GROUPS > 0: grouped top-k over GROUPS
    contiguous groups of BLOCK_E // GROUPS experts (BLOCK_E == num_experts then), keeping the
    TOPK_GROUP best (group score: with TOP2_GROUPS the sum of its two best selection scores,
    else its best; `routing.resolve_group_score`)."""
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + t * stride_lt + offs * stride_le, mask=valid, other=float("-inf"))
    logits = logits.to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.exp(logits - tl.max(logits, 0))
        shifted = tl.where(valid, shifted, 0.0)
        scores = shifted / tl.sum(shifted, 0)
    select_on = scores
    if HAS_BIAS:
        select_on = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0)
    # (padded positions: never picked, their keys are _NO_KEY below; groups have none)

    if GROUPS > 0:
        PER_GROUP: tl.constexpr = BLOCK_E // GROUPS
        grouped = tl.reshape(select_on, (GROUPS, PER_GROUP))
        members = tl.reshape(offs, (GROUPS, PER_GROUP)) % PER_GROUP
        best = tl.max(grouped, 1)
        if TOP2_GROUPS and PER_GROUP > 1:  # DeepSeek-V3 noaux_tc, Mistral-4: the group's two best
            first = _first_max(_ordered_key(grouped), members, PER_GROUP, 1)
            rest = tl.where(members == first[:, None], float("-inf"), grouped)
            group_scores = best + tl.max(rest, 1)
        else:  # DeepSeek-V2 group_limited_greedy: the group's best
            group_scores = best
        group_ids = tl.arange(0, GROUPS)
        group_keys = _ordered_key(group_scores)
        kept = group_ids < 0
        for _ in tl.static_range(TOPK_GROUP):
            g = _first_max(group_keys, group_ids, GROUPS, 0)
            kept = kept | (group_ids == g)
            group_keys = tl.where(group_ids == g, _NO_KEY, group_keys)
        select_on = tl.reshape(tl.where(kept[:, None], grouped, float("-inf")), (BLOCK_E,))

    k_offs = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    keys = tl.where(valid, _ordered_key(select_on), _NO_KEY)
    for i in range(TOP_K):
        e = _first_max(keys, offs, BLOCK_E, 0)
        keys = tl.where(offs == e, _NO_KEY, keys)
        w = tl.sum(tl.where(offs == e, scores, 0.0), 0)
        top_w = tl.where(k_offs == i, w, top_w)
        top_i = tl.where(k_offs == i, e.to(tl.int32), top_i)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, 0) + 1e-20)
    top_w = top_w * routed_scaling_factor
    out = t * TOP_K + k_offs
    tl.store(weights_ptr + out, top_w, mask=k_offs < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=k_offs < TOP_K)
    _pdl_release(PDL)


def triton_select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str,
    use_grouped_topk: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    group_score: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts`' result from one `moe_routing_kernel` launch; inputs already validated
    (`fusedmoe.routing`), the configuration one `routing_kernel_unsupported` accepts."""

    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    bias = None
    if e_score_correction_bias is not None:
        bias = e_score_correction_bias.to(device=device, dtype=torch.float32).contiguous()
    groups = num_expert_group if use_grouped_topk and num_expert_group > 1 else 0
    block_e = triton.next_power_of_2(num_experts)
    launch(moe_routing_kernel, (num_tokens,),
        router_logits, weights if bias is None else bias, weights, ids,
        num_experts, router_logits.stride(0), router_logits.stride(1), float(routed_scaling_factor),
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e,
        SIGMOID=scoring_func == "sigmoid", HAS_BIAS=bias is not None, RENORMALIZE=bool(renormalize),
        GROUPS=groups, TOPK_GROUP=topk_group if groups else 0,
        TOP2_GROUPS=bool(groups) and resolve_group_score(group_score, bias is not None) == "top2_sum",
        num_warps=1 if block_e <= 256 else (2 if block_e <= 512 else 4), **pdl(device),
    )
    return weights, ids
