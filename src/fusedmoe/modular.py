"""The modular kernel: prepare/finalize (dispatch/combine tokens) around an experts computation.

    out = finalize(experts.apply(*prepare(x, topk_weights, topk_ids)))

`Experts` owns permute -> GEMM1 -> activation -> GEMM2 -> weighted top-k reduction for the
experts of this rank, so its output is already [T, H]. `PrepareFinalize` owns token movement:
`LocalPrepareFinalize` (one rank, no communication) is the base case; expert-parallel dispatch
subclasses it. Weight layout changes a backend wants happen once, in `Experts.process_weights`.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from fusedmoe.config import MoEConfig
from fusedmoe.quant.params import QuantParams

# Legend: T tokens, H hidden, I intermediate (per partition), G = 2I (gated) or I, E global
# experts, L local experts, K top-k.


@dataclass
class ExpertWeights:
    """The tensors of the local experts, in the canonical layout unless a backend re-laid them.

    w13 [L, G, H] (rows [0, I) gate, [I, 2I) up), w2 [L, H, I], biases [L, G] and [L, H].
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    quant: QuantParams | None = None

    def replace(self, **changes) -> ExpertWeights:
        return replace(self, **changes)


class Experts(abc.ABC):
    """Computes out[t] = sum_k w[t,k] * expert(ids[t,k])(x[t]) over this rank's experts.

    Slots whose id is outside [0, E) or maps to -1 in expert_map contribute exactly zero.
    """

    layout: ClassVar[str] = "standard"
    supports_inplace: ClassVar[bool] = True

    def __init__(self, config: MoEConfig):
        self.config = config

    def process_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """Once after loading: return the weights in the layout `apply` expects."""
        return weights

    @abc.abstractmethod
    def apply(
        self,
        x_TH: torch.Tensor,
        weights: ExpertWeights,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        *,
        expert_map_E: torch.Tensor | None,
        out_TH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return [T, H] in x's dtype (written into out_TH when given)."""


class BatchedExperts(Experts):
    """Experts on per-local-expert buffers: y[e, j] = expert_e(x[e, j]) for j < num_tokens[e].

    No routed weights and no reduction: the combine step owns both.
    """

    layout: ClassVar[str] = "batched"
    supports_inplace: ClassVar[bool] = False

    @abc.abstractmethod
    def apply_batched(
        self, x_LMH: torch.Tensor, num_tokens_L: torch.Tensor, weights: ExpertWeights, *,
        num_slots: int = 0, top_k: int = 1,
    ) -> torch.Tensor:
        """Return [L, max_tokens, H]; rows past num_tokens[e] are zero. Rows of x past the count
        may hold anything (dispatch buffers are not cleared): they are never read.

        num_slots: at most how many buffer rows the dispatch filled (its slots; 0: unknown, every
        row may be live) and top_k the routing's: they pick tiles for the live rows instead of
        L * max_tokens (a buffer sized for the worst case), never the work or the result."""

    def apply(self, *args, **kwargs):
        raise TypeError(
            f"{type(self).__name__} takes per-expert buffers: run it through ModularMoE with a "
            "batched prepare/finalize"
        )


@dataclass
class StandardDispatch:
    """What a standard-layout dispatch hands the experts (rows, their routing, the expert_map to
    read the ids with) and `handle`, which only the same prepare/finalize's combine reads."""

    x_TH: torch.Tensor
    topk_weights_TK: torch.Tensor
    topk_ids_TK: torch.Tensor
    expert_map_E: torch.Tensor | None
    handle: object = None


class PrepareFinalize:
    """Token movement around the experts. The base class is one rank: nothing moves.

    dispatch -> StandardDispatch; combine(experts' output, its handle) -> [T, H]. Subclasses
    that move tokens override dispatch/combine; one-rank ones may override prepare/finalize.
    """

    layout: ClassVar[str] = "standard"

    def prepare(
        self, x_TH: torch.Tensor, topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x_TH, topk_weights_TK, topk_ids_TK

    def finalize(self, out_TH: torch.Tensor) -> torch.Tensor:
        return out_TH

    def dispatch(self, x_TH, topk_weights_TK, topk_ids_TK, expert_map_E) -> StandardDispatch:
        x, w, ids = self.prepare(x_TH, topk_weights_TK, topk_ids_TK)
        return StandardDispatch(x, w, ids, expert_map_E)

    def combine(self, y_TH: torch.Tensor, handle: object) -> torch.Tensor:
        return self.finalize(y_TH)


LocalPrepareFinalize = PrepareFinalize


@dataclass
class BatchedHandle:
    """What `dispatch` did, for `combine`: each slot's buffer row e*M + j (-1: not run here) and
    the routing weights [T, K]."""

    dest_N: torch.Tensor
    topk_weights_TK: torch.Tensor

    @property
    def num_slots(self) -> int:
        """The (token, k) slots dispatched: at most this many buffer rows are live."""
        return self.dest_N.numel()

    @property
    def top_k(self) -> int:
        return self.topk_weights_TK.shape[1]


class BatchedLocalPrepareFinalize:
    """One rank, batched layout: scatter slots into [L, max_tokens, H] buffers, combine weighted.

        dispatch: x_b[e, j] = x[token] (* w if router weight on input) for the j-th slot of e
        combine:  out[t] = sum_k w[t, k] * y_b[e(t,k), j(t,k)]    (fp32, slot order: deterministic)
    max_tokens defaults to T: a token reaches an expert at most once when its ids are distinct,
    as routing guarantees; rows beyond max_tokens are dropped, and reported when validating.
    CUDA tensors take Triton kernels (`backends.triton.batched`: ~6 launches), CPU tensors and
    torch.compile traces the torch ops below; the same rows, counts and sums. Rows of x_b past a
    count are not written.
    """

    def __init__(self, num_global_experts: int, *, weight_on_input: bool,
                 max_tokens: int | None = None, validate: bool | None = None):
        self.num_global = num_global_experts
        self.weight_on_input = weight_on_input
        self.max_tokens = max_tokens
        self.validate = validate

    def dispatch(self, x_TH, topk_weights_TK, topk_ids_TK, expert_map_E, num_local: int):
        from fusedmoe.validation import should_validate

        self.num_local = num_local
        max_tokens = self.max_tokens or x_TH.shape[0]
        if x_TH.is_cuda and not torch.compiler.is_compiling():  # compiled: the torch ops, which Inductor fuses
            from fusedmoe.backends.triton.batched import batched_dispatch

            x_b, num_tokens_L, dest_N, raw = batched_dispatch(
                x_TH, topk_weights_TK, topk_ids_TK, expert_map_E, self.num_global, num_local, max_tokens,
                self.weight_on_input)
        else:
            x_b, num_tokens_L, dest_N, raw = self._dispatch_torch(x_TH, topk_weights_TK, topk_ids_TK,
                                                                  expert_map_E, max_tokens)
        if should_validate(self.validate, x_TH) and num_local and topk_ids_TK.numel():
            worst = int(raw.max())
            if worst > max_tokens:
                raise ValueError(
                    f"an expert receives {worst} slots but the batched buffers hold max_tokens="
                    f"{max_tokens} (repeated ids within a token's top-k?)"
                )
        return x_b, num_tokens_L, BatchedHandle(dest_N, topk_weights_TK)

    def _dispatch_torch(self, x_TH, topk_weights_TK, topk_ids_TK, expert_map_E, max_tokens):
        num_tokens, hidden = x_TH.shape
        top_k = topk_ids_TK.shape[1]
        slots = sort_slots(topk_ids_TK, expert_map_E, self.num_global, self.num_local)
        local_N, order, counts = slots.local_N, slots.order_N, slots.counts
        start = torch.cumsum(counts, 0) - counts
        row_sorted = torch.arange(local_N.numel(), device=x_TH.device) - start[local_N[order]]
        row_N = torch.empty_like(row_sorted).scatter_(0, order, row_sorted)
        valid_N = (local_N < self.num_local) & (row_N < max_tokens)
        dest_N = torch.where(valid_N, local_N * max_tokens + row_N, -1)
        token_N = torch.arange(num_tokens * top_k, device=x_TH.device) // top_k
        rows = x_TH[token_N]
        if self.weight_on_input:
            rows = (rows.float() * topk_weights_TK.flatten().float().unsqueeze(-1)).to(x_TH.dtype)
        # Not cleared: the experts read rows j < count only. Slots that do not run here write a
        # spare last row, so nothing reads the buffer before it is written.
        x_flat = torch.empty(self.num_local * max_tokens + 1, hidden, dtype=x_TH.dtype, device=x_TH.device)
        x_flat.index_put_((torch.where(valid_N, dest_N, self.num_local * max_tokens),), rows)
        x_b = x_flat[:-1].view(self.num_local, max_tokens, hidden)
        raw = counts[: self.num_local]
        return x_b, raw.clamp(max=max_tokens).to(torch.int32), dest_N, raw

    def combine(self, y_LMH: torch.Tensor, handle: BatchedHandle) -> torch.Tensor:
        h = handle
        if y_LMH.is_cuda and not torch.compiler.is_compiling():
            from fusedmoe.backends.triton.batched import batched_combine

            return batched_combine(y_LMH, h.dest_N, h.topk_weights_TK, self.weight_on_input)
        valid = h.dest_N >= 0
        y_N = y_LMH.reshape(-1, y_LMH.shape[-1])[h.dest_N.clamp(min=0)].float()
        weight_N = h.topk_weights_TK.flatten().float()
        scale = torch.where(valid, torch.ones_like(weight_N) if self.weight_on_input else weight_N,
                            torch.zeros_like(weight_N))
        y_N = torch.where(valid.unsqueeze(-1), y_N * scale.unsqueeze(-1), torch.zeros((), device=y_N.device))
        num_tokens, top_k = h.topk_weights_TK.shape
        return y_N.view(num_tokens, top_k, y_LMH.shape[-1]).sum(dim=1).to(y_LMH.dtype)


# Custom ops in eager calls -------------------------------------------------------------------
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tracing() -> bool:
    """A torch.compile / export trace or a dispatch mode (fake, functional, proxy) is active:
    custom ops must be called as ops (their fake kernels give the shapes)."""
    return torch.compiler.is_compiling() or bool(torch._C._len_torch_dispatch_stack())


def traced_experts(backend: str, config: MoEConfig, x_TH: torch.Tensor, weights: ExpertWeights,
                   topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor, expert_map_E: torch.Tensor | None,
                   out_TH: torch.Tensor | None) -> torch.Tensor:
    """An `Experts.apply` without a custom op of its own, while tracing: the call as
    `fusedmoe::fused_experts` naming `backend` (whose body selects that backend and runs it
    eagerly), so a layer on the torch or emulation backend compiles with fullgraph=True."""
    from fusedmoe.api import fused_experts

    y = fused_experts(
        x_TH, weights.w13, weights.w2, topk_weights_TK, topk_ids_TK, activation=config.activation,
        apply_router_weight_on_input=config.apply_router_weight_on_input, expert_map=expert_map_E,
        global_num_experts=config.num_experts, w13_bias=weights.w13_bias, w2_bias=weights.w2_bias,
        quant=weights.quant, backend=backend, swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit, inplace=out_TH is x_TH,
    )
    if out_TH is not None and y is not out_TH:
        out_TH.copy_(y)
        return out_TH
    return y


def call_op(op, impl: Callable, *args, **kwargs):
    """op(*args, **kwargs), or impl (the op's own body) directly in plain eager calls: no
    torch.compile / export trace, no dispatch mode (fake, functional, proxy), only plain tensors,
    and no input that autograd would need (the op then raises on backward; impl would not).
    The op's dispatch (autograd wrapper, dynamo guard) costs ~50 us of host time per call that an
    eager decode step pays for nothing (CPU host, launches stubbed: docs/perf-notes.md)."""
    if tracing():
        return op(*args, **kwargs)
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or (grad and a.requires_grad)):
            return op(*args, **kwargs)
    return impl(*args, **kwargs)


def experts_ops(name: str, impl: Callable[..., torch.Tensor]):
    """`impl` (annotated, returning a new [T, H] tensor, taking an `out=` keyword) as two custom
    ops with one signature: `fusedmoe::<name>` (functional) and `fusedmoe::<name>_out`, the same
    arguments with `out` (which it writes; may be x: the seeds' in-place mode) after the required
    ones. Schemas are inferred from `impl`'s annotations; both ops have fake kernels.
    """
    params = [p for n, p in inspect.signature(impl).parameters.items() if n != "out"]
    required = [p for p in params if p.default is inspect.Parameter.empty]
    defaulted = [p for p in params if p.default is not inspect.Parameter.empty]
    out_param = inspect.Parameter("out", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)

    def functional(*args, **kwargs):
        return impl(*args, **kwargs)

    def with_out(*args, **kwargs) -> None:
        bound = with_out.__signature__.bind(*args, **kwargs)
        out = bound.arguments.pop("out")
        impl(**bound.arguments, out=out)

    for fn, ps, ret in ((functional, params, torch.Tensor), (with_out, required + [out_param] + defaulted, None)):
        fn.__signature__ = inspect.Signature(ps, return_annotation=ret)
        fn.__annotations__ = {p.name: p.annotation for p in ps} | {"return": ret}
        fn.__name__ = fn.__qualname__ = name if fn is functional else f"{name}_out"
    op = torch.library.custom_op(f"fusedmoe::{name}", functional, mutates_args=())
    op.register_fake(lambda x, *args, **kwargs: torch.empty_like(x))
    out_op = torch.library.custom_op(f"fusedmoe::{name}_out", with_out, mutates_args=("out",))
    out_op.register_fake(lambda *args, **kwargs: None)
    return op, out_op


class ModularMoE:
    """prepare -> experts -> finalize (standard layout) or dispatch -> experts -> combine (batched)."""

    def __init__(self, prepare_finalize, experts: Experts):
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    def __call__(
        self,
        x_TH: torch.Tensor,
        weights: ExpertWeights,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        *,
        expert_map_E: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> torch.Tensor:
        if self.experts.layout == "batched":
            pf = self.prepare_finalize
            x_b, counts, handle = pf.dispatch(x_TH, topk_weights_TK, topk_ids_TK, expert_map_E,
                                              weights.w13.shape[0])
            y_b = self.experts.apply_batched(x_b, counts, weights, num_slots=handle.num_slots, top_k=handle.top_k)
            out = pf.combine(y_b, handle)
            return x_TH.copy_(out) if inplace else out
        pf = self.prepare_finalize
        d = pf.dispatch(x_TH, topk_weights_TK, topk_ids_TK, expert_map_E)
        out = x_TH if inplace and self.experts.supports_inplace and d.x_TH is x_TH else None
        if d.x_TH.shape[0] == 0:  # a rank may receive no rows; kernels are not launched on none
            y = d.x_TH.new_zeros(0, x_TH.shape[1])
        else:
            y = self.experts.apply(d.x_TH, weights, d.topk_weights_TK, d.topk_ids_TK,
                                   expert_map_E=d.expert_map_E, out_TH=out)
        y = pf.combine(y, d.handle)
        return x_TH.copy_(y) if inplace and y is not x_TH else y


def make_modular(config: MoEConfig, experts: Experts) -> ModularMoE:
    """The one-rank modular kernel for `experts`, in the layout it takes."""
    if experts.layout == "batched":
        pf = BatchedLocalPrepareFinalize(config.num_experts, weight_on_input=config.apply_router_weight_on_input,
                                         max_tokens=config.max_num_tokens)
        return ModularMoE(pf, experts)
    return ModularMoE(LocalPrepareFinalize(), experts)


def local_slots(
    topk_ids_TK: torch.Tensor, expert_map_E: torch.Tensor | None, num_global_experts: int,
    num_local_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(local expert index [T, K] int64, valid mask [T, K]) for every (token, slot).

    Ids outside [0, E), ids that expert_map sends to -1 and (given num_local_experts) ids it sends
    past the local experts are invalid (they contribute zero; validation reports the last two as
    errors where it runs); their local index is 0 so that indexing with it stays in bounds.
    """
    ids = topk_ids_TK.long()
    valid = (ids >= 0) & (ids < num_global_experts)
    local = torch.where(valid, ids, torch.zeros_like(ids))
    if expert_map_E is not None:
        local = expert_map_E.long()[local]
        valid &= local >= 0
        if num_local_experts is not None:
            valid &= local < num_local_experts
        local = torch.where(valid, local, torch.zeros_like(local))
    return local, valid


@dataclass
class SortedSlots:
    """The N = T*K slots grouped by local expert (stable: equal experts keep slot order).

    local_N [N]: local expert per slot (L for slots that run elsewhere or are invalid);
    order_N [N]: slot indices sorted by local_N; counts [L+1]: slots per local expert, the last
    entry counting the slots that do not run here; token_N [N]: the token of each sorted slot.
    """

    local_N: torch.Tensor
    order_N: torch.Tensor
    counts: torch.Tensor
    token_N: torch.Tensor


def sort_slots(
    topk_ids_TK: torch.Tensor, expert_map_E: torch.Tensor | None, num_global_experts: int,
    num_local_experts: int,
) -> SortedSlots:
    """Group slots by local expert with device ops only (no host sync)."""
    local_TK, valid_TK = local_slots(topk_ids_TK, expert_map_E, num_global_experts, num_local_experts)
    local_N = torch.where(valid_TK, local_TK, num_local_experts).flatten()
    order_N = torch.sort(local_N, stable=True).indices
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=local_N.device)
    counts.scatter_add_(0, local_N, torch.ones_like(local_N))
    return SortedSlots(local_N, order_N, counts, order_N // topk_ids_TK.shape[1])
