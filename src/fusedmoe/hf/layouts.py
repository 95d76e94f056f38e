"""Expert weight layouts of transformers families -> fusedmoe's, converted in place at patch time.

    fused       gate_up_proj [E, 2I, H], down_proj [E, H, I]        already ours: nothing moves
    up_only     up_proj [E, I, H], down_proj [E, H, I]              already ours (non-gated)
    transposed  gate_up_proj [E, H, 2I], down_proj [E, I, H]        Llama-4, Aria: one transpose copy each
    gpt_oss     transposed, gate/up interleaved on 2I, + biases     gpt-oss: transpose + de-interleave
    dbrx        w1, v1, w2 each [E*I, H] (w2 used as a @ w2_e)     w1|v1 -> w13 [E, 2I, H], w2 -> [E, H, I]
    jetmoe      input_linear.weight [E, 2I, H], output_linear       ours, on the block: nothing moves
                .weight [E, H, I]
    longcat     gate_up_proj [E+Z, 2I, H], down_proj [E, H, I]      ours once the Z identity experts' unused
                                                                    gate_up rows are sliced off (a view)

A converted tensor replaces the original (`param.data = new`, or a new parameter for DBRX's fused
w13 with w1/v1 removed), so the model never holds two copies. State-dict hooks keep the
checkpoint format: `state_dict()` writes transformers' layout and `load_state_dict()` reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedmoe.activations import deinterleave_gate_up, interleave_gate_up


class Layout:
    """How one family stores its experts; `adopt` converts to ours in place, `restore` undoes it."""

    name = "fused"
    converts = False  # True when adopt() changes tensors (then state-dict hooks are needed)
    dispatched = True  # transformers dispatches the experts class (@use_experts_implementation)
    fp8 = True  # patch runs FP8 experts of this layout (quant_params); others are refused

    def tensors(self, experts: nn.Module):
        """(w13 [E, G, H], w2 [E, H, I], w13_bias | None, w2_bias | None) in fusedmoe's layout."""
        bias = getattr(experts, "has_bias", False)
        return (
            experts.gate_up_proj, experts.down_proj,
            experts.gate_up_proj_bias if bias else None, experts.down_proj_bias if bias else None,
        )

    def source(self, experts: nn.Module) -> torch.Tensor | None:
        """The gate/up (or up) weight as the family stores it, None when the module lacks it."""
        return getattr(experts, "gate_up_proj", None)

    def adopt(self, experts: nn.Module) -> None:
        """Convert the module's tensors to our layout in place."""

    def restore(self, experts: nn.Module) -> None:
        """Convert back to the family's layout in place."""

    def save(self, experts: nn.Module, state_dict: dict, prefix: str) -> None:
        """Rewrite this module's entries of a state dict into the family's layout."""

    def load(self, experts: nn.Module, state_dict: dict, prefix: str) -> None:
        """Rewrite a checkpoint's entries (family layout) into ours, before loading."""


class UpOnly(Layout):
    name = "up_only"
    fp8 = False

    def source(self, experts):
        return getattr(experts, "up_proj", None)

    def tensors(self, experts):
        bias = getattr(experts, "has_bias", False)
        return (
            experts.up_proj, experts.down_proj,
            experts.up_proj_bias if bias else None, experts.down_proj_bias if bias else None,
        )


def _transpose(w_EAB: torch.Tensor) -> torch.Tensor:
    return w_EAB.transpose(1, 2).contiguous()


class Transposed(Layout):
    """gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ w); gate/up concatenated or interleaved."""

    converts = True
    fp8 = False

    def __init__(self, interleaved: bool):
        self.interleaved = interleaved
        self.name = "gpt_oss" if interleaved else "transposed"
        self.dispatched = interleaved  # Llama-4's experts are called directly

    def _to_ours_gate_up(self, w_EHG: torch.Tensor) -> torch.Tensor:
        w_EGH = w_EHG.transpose(1, 2)
        return deinterleave_gate_up(w_EGH, 1) if self.interleaved else w_EGH.contiguous()

    def _to_hf_gate_up(self, w_EGH: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            w_EGH = interleave_gate_up(w_EGH, 1)
        return _transpose(w_EGH)

    def adopt(self, experts):
        with torch.no_grad():
            experts.gate_up_proj.data = self._to_ours_gate_up(experts.gate_up_proj.data)
            experts.down_proj.data = _transpose(experts.down_proj.data)
            if self.interleaved and getattr(experts, "gate_up_proj_bias", None) is not None:
                experts.gate_up_proj_bias.data = deinterleave_gate_up(experts.gate_up_proj_bias.data, 1)

    def restore(self, experts):
        with torch.no_grad():
            experts.gate_up_proj.data = self._to_hf_gate_up(experts.gate_up_proj.data)
            experts.down_proj.data = _transpose(experts.down_proj.data)
            if self.interleaved and getattr(experts, "gate_up_proj_bias", None) is not None:
                experts.gate_up_proj_bias.data = interleave_gate_up(experts.gate_up_proj_bias.data, 1)

    def save(self, experts, state_dict, prefix):
        state_dict[prefix + "gate_up_proj"] = self._to_hf_gate_up(state_dict[prefix + "gate_up_proj"])
        state_dict[prefix + "down_proj"] = _transpose(state_dict[prefix + "down_proj"])
        if self.interleaved and prefix + "gate_up_proj_bias" in state_dict:
            state_dict[prefix + "gate_up_proj_bias"] = interleave_gate_up(state_dict[prefix + "gate_up_proj_bias"], 1)

    def load(self, experts, state_dict, prefix):
        if prefix + "gate_up_proj" in state_dict:
            state_dict[prefix + "gate_up_proj"] = self._to_ours_gate_up(state_dict[prefix + "gate_up_proj"])
        if prefix + "down_proj" in state_dict:
            state_dict[prefix + "down_proj"] = _transpose(state_dict[prefix + "down_proj"])
        if self.interleaved and prefix + "gate_up_proj_bias" in state_dict:
            state_dict[prefix + "gate_up_proj_bias"] = deinterleave_gate_up(state_dict[prefix + "gate_up_proj_bias"], 1)


class Dbrx(Layout):
    """DbrxExperts: `mlp.w1` (gate), `mlp.v1` (up), `mlp.w2` (down, stored [I, H] per expert).

    Patched: `mlp.w13 [E, 2I, H]` replaces w1 and v1, `mlp.w2` becomes [E, H, I]. The hooks sit on
    `experts` and rewrite the `mlp.` entries.
    """

    name = "dbrx"
    converts = True
    dispatched = False
    fp8 = False

    def source(self, experts):
        return getattr(getattr(experts, "mlp", None), "w1", None)

    @staticmethod
    def _sizes(experts) -> tuple[int, int, int]:
        return experts.num_experts, experts.ffn_hidden_size, experts.hidden_size

    def tensors(self, experts):
        return experts.mlp.w13, experts.mlp.w2, None, None

    def adopt(self, experts):
        mlp = experts.mlp
        e, i, h = self._sizes(experts)
        with torch.no_grad():
            w13 = torch.cat((mlp.w1.data.view(e, i, h), mlp.v1.data.view(e, i, h)), dim=1)
            requires_grad = mlp.w1.requires_grad
            del mlp.w1, mlp.v1  # drop the originals before anything else allocates
            mlp.w13 = nn.Parameter(w13, requires_grad=requires_grad)
            mlp.w2.data = _transpose(mlp.w2.data.view(e, i, h))

    def restore(self, experts):
        mlp = experts.mlp
        e, i, h = self._sizes(experts)
        with torch.no_grad():
            w13 = mlp.w13.data
            w2 = mlp.w2
            del mlp.w13, mlp.w2
            requires_grad = w2.requires_grad
            # Registration order of the checkpoint: w1, v1, w2.
            mlp.w1 = nn.Parameter(w13[:, :i].reshape(e * i, h), requires_grad=requires_grad)
            mlp.v1 = nn.Parameter(w13[:, i:].reshape(e * i, h), requires_grad=requires_grad)
            del w13
            w2.data = w2.data.transpose(1, 2).reshape(e * i, h)
            mlp.w2 = w2

    def save(self, experts, state_dict, prefix):
        e, i, h = self._sizes(experts)
        w13 = state_dict.pop(prefix + "mlp.w13")
        w2 = state_dict.pop(prefix + "mlp.w2")
        state_dict[prefix + "mlp.w1"] = w13[:, :i].reshape(e * i, h)
        state_dict[prefix + "mlp.v1"] = w13[:, i:].reshape(e * i, h)
        state_dict[prefix + "mlp.w2"] = w2.transpose(1, 2).reshape(e * i, h)

    def load(self, experts, state_dict, prefix):
        keys = [prefix + "mlp." + n for n in ("w1", "v1", "w2")]
        if not all(k in state_dict for k in keys):
            return  # incomplete: let load_state_dict report the missing keys
        w1, v1, w2 = (state_dict.pop(k) for k in keys)
        e, i, h = self._sizes(experts)
        state_dict[prefix + "mlp.w13"] = torch.cat((w1.view(e, i, h), v1.view(e, i, h)), dim=1)
        state_dict[prefix + "mlp.w2"] = w2.view(e, i, h).transpose(1, 2)


class ParallelExperts(Layout):
    """JetMoE: the block holds `input_linear` / `output_linear` (JetMoeParallelExperts), whose
    `weight`s are [E, 2I, H] (gate rows first) and [E, H, I]."""

    name = "jetmoe"
    dispatched = False
    fp8 = False

    def tensors(self, block):
        return block.input_linear.weight, block.output_linear.weight, None, None

    def source(self, block):
        return getattr(getattr(block, "input_linear", None), "weight", None)


class IdentityTail(Layout):
    """LongCat-Flash: `gate_up_proj` has a row block for each of the E routed and Z identity
    experts, `down_proj` for the E routed ones only; the kernels read the first E of gate_up."""

    name = "longcat"
    dispatched = False
    fp8 = False

    def tensors(self, experts):
        return experts.gate_up_proj[: experts.down_proj.shape[0]], experts.down_proj, None, None


LAYOUTS: dict[str, Layout] = {
    "fused": Layout(),
    "up_only": UpOnly(),
    "transposed": Transposed(interleaved=False),
    "gpt_oss": Transposed(interleaved=True),
    "dbrx": Dbrx(),
    "jetmoe": ParallelExperts(),
    "longcat": IdentityTail(),
}
