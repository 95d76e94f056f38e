"""Shared experts (DeepSeek, Qwen2-MoE): a dense gated MLP every token goes through, added to the
routed experts' output.

    s(x) = down(act(gate_proj(x)) * up_proj(x))            (* sigmoid(x @ shared_expert_gate) if gated)
    out  = routed(x) + s(x)

Weights `gate_up [2I, H]` (gate rows first), `down [H, I]`, optional `gate [1, H]`; the math runs in
the weights' dtype with the activation in fp32, as the `cpu` backend's experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fusedmoe import knobs
from fusedmoe.activations import apply_activation, is_gated

_NAME = re.compile(r"(?:^|\.)(shared_experts?|shared_expert_gate)(?:\.(gate_proj|up_proj|down_proj))?\.weight$")


class SharedExperts(nn.Module):
    """The shared MLP, replicated on every rank (each rank computes it for its own tokens)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 gate: bool = False, params_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"shared experts: {name}={value!r} must be a positive int")
        if not is_gated(activation):
            raise ValueError(f"shared experts are a gated MLP; activation {activation!r} is not gated")
        factory = dict(dtype=params_dtype or torch.get_default_dtype(), device=device)
        self.activation = activation
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        # NaN until loaded or assigned: a part never written makes the output NaN, not whatever the
        # allocator left there
        nan = float("nan")
        self.gate_up = nn.Parameter(torch.full((2 * intermediate_size, hidden_size), nan, **factory),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.full((hidden_size, intermediate_size), nan, **factory), requires_grad=False)
        self.gate = (nn.Parameter(torch.full((1, hidden_size), nan, **factory), requires_grad=False)
                     if gate else None)
        self._loaded: set[str] = set()

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H] in x's dtype."""
        parts = {"gate_proj", "up_proj", "down_proj"} | ({"gate"} if self.gate is not None else set())
        if self._loaded and self._loaded != parts:  # nothing loaded: assigned directly
            raise RuntimeError(f"shared-expert tensors never loaded: {sorted(parts - self._loaded)}")
        dtype = self.gate_up.dtype
        h = F.linear(x_TH.to(dtype), self.gate_up).float()
        a = apply_activation(h, self.activation)
        y = F.linear(a.to(dtype), self.down).float()
        if self.gate is not None:
            y = y * torch.sigmoid(F.linear(x_TH.to(dtype), self.gate).float())
        return y.to(x_TH.dtype)

    def load(self, part: str, tensor: torch.Tensor) -> None:
        """part: gate_proj [I, H], up_proj [I, H], down_proj [H, I] or gate (shared_expert_gate [1, H])."""
        i, h = self.intermediate_size, self.hidden_size
        targets = {"gate_proj": (self.gate_up[:i], (i, h)), "up_proj": (self.gate_up[i:], (i, h)),
                   "down_proj": (self.down, (h, i))}
        if self.gate is not None:
            targets["gate"] = (self.gate, (1, h))
        if part not in targets:
            raise ValueError(f"unknown shared-expert tensor {part!r}; expected one of {sorted(targets)}")
        target, shape = targets[part]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"shared experts {part}: tensor has shape {tuple(tensor.shape)}, expected {shape}")
        with torch.no_grad():
            target.copy_(tensor)
        self._loaded.add(part)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`...shared_experts.{gate,up,down}_proj.weight` (DeepSeek), `...shared_expert.*` and
        `...shared_expert_gate.weight` (Qwen2-MoE); returns the names used."""
        used = set()
        for name, tensor in named_tensors:
            m = _NAME.search(name)
            if m is None:
                continue
            self.load("gate" if m.group(1) == "shared_expert_gate" else m.group(2), tensor)
            used.add(name)
        return used


def run_overlapped(shared: SharedExperts, x_TH: torch.Tensor, routed) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed(), shared(x)): on CUDA the shared MLP runs on a side stream while `routed` (dispatch,
    experts, combine: mostly communication waits under EP) runs on the current one; elsewhere, or
    with FUSEDMOE_SHARED_OVERLAP=0, or while torch.compile traces (the side stream is not traced),
    in sequence."""
    if not x_TH.is_cuda or torch.compiler.is_compiling() or knobs.get("SHARED_OVERLAP") is False:
        return routed(), shared(x_TH)
    main = torch.cuda.current_stream(x_TH.device)
    side = _side_stream(x_TH.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        s = shared(x_TH)
    x_TH.record_stream(side)
    out = routed()
    main.wait_stream(side)
    s.record_stream(main)
    return out, s


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
