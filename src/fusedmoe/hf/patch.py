"""`patch(model)` / `unpatch(model)`: run whole transformers MoE blocks (router, experts, shared
experts) through fusedmoe.

    for each block of a known family:  experts re-laid out in place (FAMILIES[...].layout),
                                       block.__class__ -> FusedMoE<Block> (forward below)
    forward(x) = shared(x) + fused_experts(x, w13, w2, *select_experts(x, router_logits(x)))

The block keeps its submodules, parameter names and return convention (tuples for gpt-oss and
Llama-4); state-dict hooks keep the checkpoint format for families whose tensors were converted.

`patch(model, cuda_graphs=True)` also replays each block as a CUDA graph per input shape
(`_BlockGraphs`): for models run eagerly, as transformers runs them, where one block's host
work (routing ops, checks, kernel launches: ~0.5-1 ms) outweighs its GPU work at decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusedmoe.hf.experts import (
    ExpertsMath,
    UnsupportedModel,
    activation_of,
    experts_math,
    quant_params,
    run_experts,
)
from fusedmoe.hf.families import (
    FAMILIES,
    ROUTINGS,
    Family,
    hash_table_of,
    router_linear,
    router_logits,
    score_fn_of,
    top_k_of,
)
from fusedmoe.hf.layouts import LAYOUTS, Layout

_STATE = "_fusedmoe_patch"


# patch(model, cuda_graphs=True): inputs of at most this many tokens are replayed as graphs
# (decode; longer inputs amortise the host work over their GPU work, and every new length
# would be a new capture).
GRAPH_MAX_TOKENS = 64
GRAPH_MAX_SHAPES = 32  # graphs kept per block; inputs of further shapes run eagerly


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph, or None: this input cannot be captured (runs eagerly)
    x: torch.Tensor | None  # the static input the graph reads
    out: Any  # the block's output in the graph's memory (a tensor or a tuple of them)
    weights: tuple  # data pointers of the block's parameters and buffers when it was captured


@dataclass
class _BlockGraphs:
    """One patched block's CUDA graphs, one per input (shape, strides, dtype, device).

    An input runs eagerly the first time it is seen (Triton compiles, the tile plan is chosen),
    is captured the second time and replayed from then on: copied into the static input, one
    graph launch, outputs cloned (a later replay overwrites the graph's). Eager instead when
    gradients are enabled, in training mode, under torch.compile or another capture, with
    FUSEDMOE_VALIDATE (its checks read the device), while transformers collects router logits,
    for inputs of more than `max_tokens` tokens, past GRAPH_MAX_SHAPES shapes, or off the GPU;
    an input whose forward cannot be captured runs eagerly from then on. A graph whose weights
    moved (new storage: `.to()`, a reload into new tensors) is captured again; weights changed
    in place are read as they are. A block's graphs share one memory pool per device: they
    replay one at a time on the caller's stream, and every captured output stays referenced.
    """

    max_tokens: int
    graphs: dict = field(default_factory=dict)
    seen: set = field(default_factory=set)
    pools: dict = field(default_factory=dict)

    def run(self, block: nn.Module, hidden_states: torch.Tensor):
        """The block's output through its graph for this input, or None (run it eagerly)."""
        if not self._eligible(block, hidden_states):
            return None
        key = (tuple(hidden_states.shape), hidden_states.stride(), hidden_states.dtype, hidden_states.device,
               torch.is_inference_mode_enabled())  # a static input made in inference mode stays there
        weights = tuple(t.data_ptr() for t in (*block.parameters(), *block.buffers()))
        entry = self.graphs.get(key)
        if entry is not None and entry.weights != weights:
            del self.graphs[key]  # the weights moved: capture again
            entry = None
        if entry is None:
            if key not in self.seen:
                self.seen.add(key)
                return None
            if len(self.graphs) >= GRAPH_MAX_SHAPES:
                return None
            entry = self.graphs[key] = self._capture(block, hidden_states, weights)
        if entry.graph is None:
            return None
        entry.x.copy_(hidden_states)
        entry.graph.replay()
        return _clone(entry.out)

    def _eligible(self, block: nn.Module, x: torch.Tensor) -> bool:
        from fusedmoe import knobs

        if not x.is_cuda or block.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        if x.numel() // x.shape[-1] > self.max_tokens or torch.cuda.is_current_stream_capturing():
            return False
        return not knobs.get("VALIDATE") and not _collecting_router_logits()

    def _capture(self, block: nn.Module, hidden_states: torch.Tensor, weights: tuple) -> _Graph:
        device = hidden_states.device
        if device not in self.pools:
            self.pools[device] = torch.cuda.graph_pool_handle()
        x = hidden_states.clone()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                _fused_forward_eager(block, x)  # warm-up on the capture stream
            torch.cuda.current_stream(device).wait_stream(stream)
            with torch.cuda.graph(graph, pool=self.pools[device], stream=stream):
                out = _fused_forward_eager(block, x)
        except RuntimeError:  # something in the forward cannot be captured: this input runs eagerly
            torch.cuda.synchronize(device)
            return _Graph(None, None, None, weights)
        return _Graph(graph, x, out, weights)


def _clone(out):
    return tuple(_clone(o) for o in out) if isinstance(out, tuple) else out.clone()


def _find_collector():
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


# transformers' ContextVar of the outputs being collected (output_router_logits=True, ...), or None
# for a transformers without output capturing: looked up once, at import, so a traced forward reads
# a module constant (a functools.cache'd lookup made Dynamo warn on every compiled block).
_COLLECTOR = _find_collector()


def _collecting_router_logits() -> bool:
    collector = _COLLECTOR
    collected = collector.get() if collector is not None else None
    return collected is not None and "router_logits" in collected


@dataclass
class _PatchState:
    family: Family
    original_class: type
    layout: Layout
    math: ExpertsMath
    hooks: tuple
    graphs: _BlockGraphs | None = None


def block_family(module: nn.Module) -> Family | None:
    """The family whose MoE block `module` is (by class name and module), else None."""
    cls = type(module)
    for fam in FAMILIES:
        if cls.__name__ == fam.block and cls.__module__ == fam.module_path:
            return fam
    return None


def patch(model: nn.Module, *, cuda_graphs: bool | int = False) -> list[tuple[str, str]]:
    """Run every MoE block of `model` through fusedmoe; returns [(module name, family)] patched.

    Raises UnsupportedModel (naming the missing feature) before changing anything when a block
    cannot be expressed, and ValueError when the model has no MoE block fusedmoe knows.
    Already patched blocks are left as they are. Inference only: training-time jitter and
    sampling routers are refused at run time.

    cuda_graphs: replay each block as a CUDA graph per input shape for inputs of at most
    GRAPH_MAX_TOKENS tokens (an int: at most that many), under torch.no_grad / inference_mode in
    eval mode (`_BlockGraphs`). For eagerly run models at decode; torch.compile users capture the
    whole model instead (mode="reduce-overhead").
    """
    if isinstance(cuda_graphs, bool):
        max_graph_tokens = GRAPH_MAX_TOKENS if cuda_graphs else 0
    elif isinstance(cuda_graphs, int) and cuda_graphs > 0:
        max_graph_tokens = cuda_graphs
    else:
        raise ValueError(f"cuda_graphs must be a bool or a positive token count, got {cuda_graphs!r}")
    found: list[tuple[str, nn.Module, Family]] = []
    already = 0
    for name, module in model.named_modules():
        if hasattr(module, _STATE):
            already += 1
            continue
        fam = block_family(module)
        if fam is None:
            continue
        if fam.refused:
            raise UnsupportedModel(f"{fam.name} ({name}: {fam.block}): {fam.refused}")
        found.append((name, module, fam))
    if not found and not already:
        supported = sorted(f.name for f in FAMILIES if not f.refused)
        raise ValueError(
            f"{type(model).__name__} has no MoE block fusedmoe.hf.patch knows; supported families: "
            f"{supported}"
        )
    plans = [(name, module, fam, _plan(module, fam)) for name, module, fam in found]  # checks first
    for _name, module, fam, math in plans:
        _patch_block(module, fam, math, _BlockGraphs(max_graph_tokens) if max_graph_tokens else None)
    return [(name, fam.name) for name, _, fam, _ in plans]


def unpatch(model: nn.Module) -> int:
    """Undo `patch`: original classes and weight layouts; returns the number of blocks restored."""
    count = 0
    for module in model.modules():
        state = getattr(module, _STATE, None)
        if state is None:
            continue
        experts = state.family.experts_of(module)
        for hook in state.hooks:
            hook.remove()
        state.layout.restore(experts)
        module.__class__ = state.original_class
        delattr(module, _STATE)
        count += 1
    return count


def is_patched(module: nn.Module) -> bool:
    return any(hasattr(m, _STATE) for m in module.modules())


def _plan(block: nn.Module, fam: Family) -> ExpertsMath:
    """Everything that can refuse the block, checked before any tensor moves."""
    experts = fam.experts_of(block)
    router = getattr(block, fam.router)
    top_k_of(block, router)
    if fam.routing == "llama4":
        _check_llama4(block, router)
    if fam.routing == "score_bias":
        score_fn_of(fam, router)
    if fam.routing == "cohere2" and router.expert_selection_fn not in ("softmax", "sigmoid"):
        raise UnsupportedModel(f"{fam.name}: expert_selection_fn={router.expert_selection_fn!r} is not supported")
    if fam.shared_combine and getattr(block, fam.shared_combine) not in ("sum", "average"):
        raise UnsupportedModel(
            f"{fam.name}: {fam.shared_combine}={getattr(block, fam.shared_combine)!r} is not supported"
        )
    if not LAYOUTS[fam.layout].fp8:
        w13 = LAYOUTS[fam.layout].source(experts)
        if w13 is None or not w13.is_floating_point() or w13.element_size() < 2:
            what = type(experts).__name__ if w13 is None else str(w13.dtype)
            raise UnsupportedModel(
                f"{fam.name} ({fam.block}): quantized experts ({what}) in the {fam.layout} layout are "
                "not supported; patch reads bf16/fp16/fp32 expert weights only in this layout"
            )
    if fam.layout == "gpt_oss":
        return ExpertsMath("swigluoai", float(experts.alpha), float(experts.limit))
    if fam.layout == "dbrx":
        return ExpertsMath(activation_of(experts.mlp.activation_fn, gated=True, where=fam.block))
    if fam.layout == "transposed":
        return ExpertsMath(activation_of(experts.act_fn, gated=True, where=fam.block))
    if fam.layout == "jetmoe":
        return ExpertsMath(activation_of(experts.activation, gated=True, where=fam.block))
    return experts_math(experts)


def _check_llama4(block: nn.Module, router: nn.Module) -> None:
    if router.top_k != 1:
        raise UnsupportedModel(
            f"Llama-4 with num_experts_per_tok={router.top_k}: the router weight is applied to the "
            "input, which fusedmoe supports for top_k == 1 only"
        )


_PATCHED_CLASSES: dict[type, type] = {}


def _patched_class(cls: type) -> type:
    if cls not in _PATCHED_CLASSES:
        _PATCHED_CLASSES[cls] = type(f"FusedMoE{cls.__name__}", (cls,), {
            "forward": _fused_forward, "__module__": __name__, "_fusedmoe_original": cls,
        })
    return _PATCHED_CLASSES[cls]


def _patch_block(block: nn.Module, fam: Family, math: ExpertsMath, graphs: _BlockGraphs | None) -> None:
    experts = fam.experts_of(block)
    layout = LAYOUTS[fam.layout]
    layout.adopt(experts)
    hooks: tuple = ()
    if layout.converts:
        hooks = (
            experts.register_state_dict_post_hook(
                lambda module, state_dict, prefix, local_metadata: layout.save(module, state_dict, prefix)
            ),
            experts.register_load_state_dict_pre_hook(
                lambda module, state_dict, prefix, *rest: layout.load(module, state_dict, prefix)
            ),
        )
    original = type(block)
    block.__class__ = _patched_class(original)
    setattr(block, _STATE, _PatchState(fam, original, layout, math, hooks, graphs))


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    graphs = getattr(self, _STATE).graphs
    if graphs is not None and not args and not kwargs:
        out = graphs.run(self, hidden_states)
        if out is not None:
            return out
    return _fused_forward_eager(self, hidden_states, *args, **kwargs)


def _fused_forward_eager(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    state: _PatchState = getattr(self, _STATE)
    fam = state.family
    if self.training:
        _check_training(self, fam)
    shape = hidden_states.shape
    router = getattr(self, fam.router)
    # [..., H] as the router's weight reads it (Ernie-4.5-VL's modality block hands its blocks the
    # values of its tokens flattened, [N * H])
    x_TH = hidden_states.reshape(-1, router_linear(fam, router).weight.shape[-1])
    logits_TE = router_logits(fam, router, x_TH)  # Inkling: [T, E + S], the shared experts' last
    n_shared = int(getattr(router, fam.shared_logits)) if fam.shared_logits else 0
    if hash_table_of(fam, router) is None:  # transformers records no hash router's logits
        _record_router_logits(router, logits_TE[:, : logits_TE.shape[-1] - n_shared])  # what its router returns
    top_k = top_k_of(self, router)
    token_ids = kwargs.get("input_ids") if fam.hash_table else None
    weights_TK, ids_TK, *shared_weights = ROUTINGS[fam.routing](fam, self, router, x_TH, logits_TE, top_k, token_ids)

    experts = fam.experts_of(self)
    w13, w2, b13, b2 = state.layout.tensors(experts)
    x_in = self.fc1_latent_proj(x_TH) if fam.latent else x_TH
    identity = bool(fam.identity_experts) and getattr(experts, fam.identity_experts) > 0
    out_TH = run_experts(
        experts, x_in, ids_TK, weights_TK, w13, w2, state.math, w13_bias=b13, w2_bias=b2,
        quant=quant_params(experts) if state.layout.fp8 else None,
        apply_router_weight_on_input=fam.routing == "llama4", placeholders=identity,
    )
    if identity:  # LongCat-Flash: ids >= E (skipped above) are identity experts, x * weight
        weight_T1 = (weights_TK.float() * (ids_TK >= w13.shape[0])).sum(dim=-1, keepdim=True)
        out_TH = out_TH + (x_TH.float() * weight_T1).to(out_TH.dtype)
    if fam.latent:
        out_TH = self.fc2_latent_proj(out_TH)
    shared = getattr(self, fam.shared, None) if fam.shared else None  # optional (Cohere2-MoE)
    if shared is not None:
        # Inkling: the shared experts weighted by the router (in x's dtype, as transformers)
        shared_TH = shared(x_TH, shared_weights[0].to(x_TH.dtype)) if shared_weights else shared(x_TH)
        if fam.shared_gate:
            shared_TH = torch.sigmoid(getattr(self, fam.shared_gate)(x_TH)) * shared_TH
        out_TH = shared_TH + out_TH
        if fam.shared_combine and getattr(self, fam.shared_combine) == "average":
            out_TH = out_TH / 2
    if fam.post_norm:  # A.X-K1: a norm over the block's output (the hidden dimension)
        out_TH = getattr(self, fam.post_norm)(out_TH)
    if fam.output_bias:  # JetMoE
        out_TH = out_TH + getattr(self, fam.output_bias)
    if fam.output == "with_logits":  # Llama-4: ([T, H], router logits [T, E])
        return out_TH, logits_TE
    if fam.output == "flat_with_logits":  # Ernie-4.5-VL: ([T * H], [T * E]), as its modality block assigns them
        return out_TH.flatten(), logits_TE.flatten()
    out = out_TH.view(shape)
    if fam.output == "with_scores":  # gpt-oss: (out, top-k routing weights [T, K])
        return out, weights_TK.to(logits_TE.dtype)
    return out


def _record_router_logits(router: nn.Module, logits_TE: torch.Tensor) -> None:
    """With output_router_logits=True transformers collects the router's logits through a hook
    on the router module, which a patched block does not call: hand it ours (the same values).
    Only where such a hook sits on the router: a model that records them from a module around
    the block (Ernie-4.5-VL: the modality block around the patched text and vision blocks, whose
    own hook still runs) would count them twice."""
    collector = _COLLECTOR
    if collector is None:  # a transformers without output capturing: nothing collects
        return
    if torch.compiler.is_compiling() and not getattr(collector, "compiling", False):
        # Traced without transformers' collector set inside the compiled region (e.g. a block
        # compiled on its own): its ContextVar.get does not trace on torch 2.11's Dynamo, and
        # nothing in this region collects.
        return
    collected = collector.get()
    if collected is not None and "router_logits" in collected and _captured(router):
        collected["router_logits"].append(logits_TE)


def _captured(module: nn.Module) -> bool:
    """Whether transformers' output capturing hooked `module` (its hooks are functions of the
    collector's module)."""
    capturing = type(_COLLECTOR).__module__
    return any(getattr(hook, "__module__", None) == capturing for hook in module._forward_hooks.values())


def _check_training(block: nn.Module, fam: Family) -> None:
    if fam.routing == "sparsemixer":
        raise UnsupportedModel("PhiMoE in training mode samples experts (SparseMixer); call model.eval()")
    if fam.jitter and getattr(block, fam.jitter, 0):
        raise UnsupportedModel(f"{fam.name} in training mode adds router jitter noise; call model.eval()")
