"""Every FUSEDMOE_* environment variable, in one place. Nobody else reads os.environ.

Each knob is typed, defaulted and documented; `override(...)` scopes values for tests. Env
knobs only say what an argument could say: an explicit argument always wins.

Tri-state knobs (USE_FLASHINFER, USE_DEEP_GEMM, USE_AITER) are None when unset, False for
0/false/no/off (exclude those backends) and True for 1/true/yes/on (require them).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

PREFIX = "FUSEDMOE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _tristate(name: str, raw: str) -> bool | None:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{PREFIX}{name}={raw!r}: expected one of {list(_TRUE + _FALSE)}")


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"{PREFIX}{name}={raw!r}: expected one of {list(choices)}")
        return value

    return parse


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _on_off_or(word: str) -> Callable[[str, str], bool | str]:
    """A tristate that also takes `word` (returned as the string itself)."""
    def parse(name: str, raw: str) -> bool | str:
        if raw.strip().lower() == word:
            return word
        try:
            return _tristate(name, raw)
        except ValueError:
            raise ValueError(f"{PREFIX}{name}={raw!r}: expected one of {list(_TRUE + _FALSE) + [word]}") from None
    return parse


def _multiple_of(step: int) -> Callable[[str, str], int]:
    """A non-negative integer, a multiple of `step`."""
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            value = -1
        if value < 0 or value % step:
            raise ValueError(f"{PREFIX}{name}={raw!r}: expected a non-negative multiple of {step}")
        return value
    return parse


_on_off_force = _on_off_or("force")
_on_off_all = _on_off_or("all")


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("BACKEND", _text, None,
             "Force one backend by name when the call/layer says backend='auto'."),
        Knob("USE_FLASHINFER", _tristate, None,
             "FlashInfer MoE backends: unset = scheme default (opt-in for unquantized), 0 = exclude, "
             "1 = require (error if none supports the config)."),
        Knob("FLASHINFER_MODE", _choice("latency", "throughput", "masked_gemm"), None,
             "With USE_FLASHINFER=1: latency -> flashinfer_trtllm, throughput -> flashinfer_cutlass, "
             "masked_gemm -> flashinfer_cutedsl."),
        Knob("USE_DEEP_GEMM", _tristate, None,
             "DeepGEMM backends: unset = auto, 0 = exclude, 1 = require."),
        Knob("USE_AITER", _tristate, None,
             "ROCm AITER backend: unset/0 = off (opt-in, as upstream), 1 = require."),
        Knob("ALLOW_CUTLASS", _tristate, None,
             "Let auto-selection consider the cutlass grouped-GEMM backends for FP8 (default: only "
             "when the config sets allow_cutlass; NVFP4 considers them always, as the seeds do)."),
        Knob("BATCH_INVARIANT", _tristate, None,
             "Only select backends whose output does not depend on the batch composition "
             "(triton: aligned tile plans that keep each row's bits, docs/reliability.md)."),
        Knob("VALIDATE", _tristate, None,
             "Run input checks that need a device-to-host sync (id ranges, NaN logits) on GPU tensors."),
        Knob("TUNED_DIR", _text, None,
             "Folder searched for tuned tile tables before the packaged ones."),
        Knob("TUNED_PACKAGED", _tristate, None,
             "Read the tuned tables packaged with fusedmoe: unset/1 = yes (after FUSEDMOE_TUNED_DIR's), "
             "0 = only FUSEDMOE_TUNED_DIR's, so the heuristic runs where that folder has no entry "
             "(an A/B of the heuristic on shapes the packaged tables cover)."),
        Knob("TUNED_SIBLINGS", _tristate, None,
             "Where this GPU's tuned tables have no entry for a shape and scheme, use a sibling's: "
             "the aligned entries of a scheme whose GEMMs are the same kernels (per-tensor fp8 takes "
             "per-channel fp8's), or a sibling GPU's table (same architecture, SM count, shared memory "
             "and L2: H100 SXM and H200): unset/1 = on, 0 = own entries only."),
        Knob("PDL", _tristate, None,
             "Programmatic dependent launch of the Triton MoE kernels (sm90+: each launch overlaps "
             "the previous kernel's tail): unset/1 = on where the GPU and Triton support it, 0 = off."),
        Knob("TRITON_RS_SYNC", _tristate, None,
             "The 4-bit fragment GEMMs' dots, whose weight operand is a register tile: unset/1 = each "
             "waits for its wgmma before the next K step's decode (kernels._rs_sync: the in-flight "
             "form is a read-after-write hazard with Triton 3.6 on Hopper, triton-lang/triton#9433, "
             "that computed wrong rows), 0 = Triton's in-flight form (to measure it; may be wrong)."),
        Knob("TRITON_LAUNCHER", _tristate, None,
             "Launches of the Triton kernels (fusedmoe.backends.triton.launcher; host time, so eager "
             "calls gain, graph replays do not): unset/1 = a "
             "repeat of an argument key calls the compiled kernel's launcher directly (Triton's "
             "per-launch Python skipped), 0 = through Triton's JITFunction.run every time."),
        Knob("TRITON_REPLAY", _tristate, None,
             "Eager calls of the Triton experts (fusedmoe.backends.triton.replay; host time): unset/1 = "
             "from the third call with the same argument signature, the launches recorded on the "
             "second are replayed with this call's addresses (the tile choice, argument assembly "
             "and launch keys skipped), 0 = the full path every call."),
        Knob("TRITON_TMA", _on_off_force, None,
             "TMA tensor descriptors for the large-M unquantized Triton GEMMs (weights; gemm2's sorted "
             "rows too): unset/1 = where eligible on sm90+, 0 = off (pointer loads), force = wherever "
             "the tensors and tile allow, on any device (the interpreter tests)."),
        Knob("TRITON_ROUTING", _tristate, None,
             "select_experts on CUDA tensors in one Triton launch (fusedmoe.backends.triton.routing) "
             "where the configuration allows it: unset/1 = yes, 0 = the torch ops. Never while tracing "
             "(torch.compile, export) or under a dispatch mode such as fake tensors (the torch ops "
             "run there), nor for a custom routing function; `fusedmoe explain` names the path."),
        Knob("TRITON_W4_FRAGMENTS", _on_off_all, None,
             "4-bit weights re-laid in wgmma fragment order by the triton backend's process_weights "
             "(fusedmoe.quant.fragments): unset/1 = mxfp4, nvfp4 and int4 (g32 / g64 / g128, asymmetric "
             "*_zp too) where the shapes and scales allow (int4 from weight_only.INT4_FRAGMENTS_MIN_INTER, "
             "every size since the decode loads its scales as words: 1.0-2.1x the checkpoint layout's "
             "speed on an H200), all = every int4 group, 0 = keep the checkpoint layout. Tuned "
             "entries serve the layout they were timed on."),
        Knob("TRITON_W4_SCALE_PAD", _multiple_of(32), None,
             "Bytes of padding after each 16-row block's scale run of the 4-bit fragment layout where "
             "the run is a power of two bytes >= 1 KB (fusedmoe.quant.fragments."
             "scale_run: runs a power of two apart queue every program's scale loads on the same "
             "memory channels): unset = 128, 0 = none (scales contiguous), else a multiple of 32 (rounded up "
             "to whole scale chunks: 32-128 bytes by format)."),
        Knob("TRITON_DIRECT", _on_off_force, None,
             "The Triton decode path without alignment (GEMM1 reads each slot's expert from the ids, "
             "GEMM2 sums a token's slots): unset/1 = for few slots with rarely repeated experts, "
             "0 = never (align, GEMMs, reduce), force = whenever top_k <= 16."),
        Knob("TRITON_SWAP_AB", _on_off_force, None,
             "W8A8 GEMMs over row blocks under 64 rows compute w^T @ a^T (the weights as the MMA's "
             "64+ row side, so Hopper's wgmma takes fp8 codes): unset/1 = fp8 block-scaled GEMMs of "
             "the aligned path with N tiles >= 64 on sm90, 0 = never, force = every W8A8 launch on any "
             "device (the interpreter tests)."),
        Knob("TRITON_GEMM2_ROWS", _on_off_force, None,
             "W8A8 GEMM2 of the aligned path as row-stationary programs (each loads its row block's "
             "codes once and streams w2 over a share of the N tiles; the same output bit for bit) "
             "where I fits one tile (<= 256; fp8 block 129-256; fp8 per row chained): unset/1 = "
             "64+ row blocks over 4096+ slots on sm90, 0 = never, force = wherever I fits (any device: "
             "the interpreter tests)."),
        Knob("FP8_ACCUMULATE", _choice("chained", "promoted"), None,
             "fp8 W8A8 GEMMs with per-tensor / per-channel weight scales (Triton): unset/chained = one "
             "accumulator across K (Hopper's fp8 MMA keeps ~14 bits in it; vLLM's choice), promoted = "
             "each K step's product added in fp32 (closer to emulation, slower at large M). Block "
             "scales always promote (their scale changes along K)."),
        Knob("SHARED_OVERLAP", _tristate, None,
             "Shared experts on a CUDA side stream while the routed experts (dispatch, experts, "
             "combine) run: unset/1 = on, 0 = in sequence after them (`fusedmoe bench --ep N "
             "--shared` times both)."),
        Knob("MXFP4_ACTIVATION", _choice("bf16", "mxfp8"), None,
             "MXFP4 rows allowed: only those computing with these activations (bf16: weight-only "
             "execution or mxfp4_w4a16; mxfp8: mxfp4_w4a8 with MXFP8 activations, e.g. FlashInfer on "
             "SM100); no row left is a NoBackendError."),
        Knob("REQUIRE_HF", _tristate, None,
             "Tests only: tests/test_hf.py fails instead of skipping when transformers does not "
             "import (scripts/test.sh, hence CI, sets 1)."),
    )
}

_overrides: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "fusedmoe_knob_overrides", default=None
)


def get(name: str) -> Any:
    """The knob's value: a scoped override, else the parsed environment variable, else default.

    Under torch.compile the value read while tracing is a constant of the graph (dynamo cannot
    trace the override's ContextVar; a knob changed later does not recompile)."""
    scoped = _overrides.get()
    if scoped is not None and name in scoped:
        value = scoped[name]
    else:
        raw = _raw(name)
        if raw is None:
            value = KNOBS[name].default
        else:
            value = _parsed.get((name, raw), _UNPARSED)
            if value is _UNPARSED:
                value = KNOBS[name].default if raw.strip() == "" else KNOBS[name].parse(name, raw)
                if len(_parsed) < 256:
                    _parsed[(name, raw)] = value
    reads = _reads
    if reads is not None and reads[0] == threading.get_ident():
        reads[1].setdefault(name, value)
    return value


_reads: tuple[int, dict[str, Any]] | None = None  # `reading`: (its thread's id, the knobs read)


@contextlib.contextmanager
def reading():
    """Collect {name: value} of every knob this thread reads inside (the first value read of
    each): what a code path depended on (fusedmoe.backends.triton.replay checks them before a
    replay). One at a time."""
    global _reads
    if _reads is not None:
        raise RuntimeError("knobs.reading() is already collecting")
    reads: dict[str, Any] = {}
    _reads = (threading.get_ident(), reads)
    try:
        yield reads
    finally:
        _reads = None


# get() runs several times per eager call (eight for the oracle's cache key alone), so it reads
# os.environ's own dict by a pre-encoded key (what os.environ.get does after encoding the key on
# every call), where this Python has one, and keeps each (name, raw value)'s parse; the values
# come from os.environ at every call all the same (monkeypatch.setenv, os.environ[...] = ...).
_UNPARSED = object()
_parsed: dict[tuple[str, str], Any] = {}
_encoded: dict[str, Any] = {}


def _raw(name: str) -> str | None:
    env = os.environ
    data = getattr(env, "_data", None)
    if data is None or not hasattr(env, "encodekey"):
        return env.get(PREFIX + name)
    key = _encoded.get(name)
    if key is None:
        key = _encoded[name] = env.encodekey(PREFIX + name)
    raw = data.get(key)
    return None if raw is None else env.decodevalue(raw)


# torch.compiler.assume_constant_result(get), without its import of torch._dynamo (~1 s, and it
# imports triton) when fusedmoe is imported: the marker that decorator sets. Dynamo then calls
# get while tracing and keeps the value (tests/test_oracle.py checks it under fullgraph).
get._dynamo_marked_constant = True


def is_set(name: str) -> bool:
    return get(name) is not None


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Scope knob values (None = as if unset), e.g. `with knobs.override(USE_FLASHINFER=False):`."""
    for name in values:
        if name not in KNOBS:
            raise KeyError(f"unknown knob {name!r}; known: {sorted(KNOBS)}")
    merged = dict(_overrides.get() or {})
    merged.update(values)
    token = _overrides.set(merged)
    try:
        yield
    finally:
        _overrides.reset(token)


def overrides() -> dict[str, Any]:
    """The scoped values in effect (what `override` set), to re-apply in another process."""
    return dict(_overrides.get() or {})


def describe() -> list[tuple[str, str, str]]:
    """(variable, current raw value, doc) for every knob, for `fusedmoe env`."""
    return [(PREFIX + k.name, os.environ.get(PREFIX + k.name, ""), k.doc) for k in KNOBS.values()]
