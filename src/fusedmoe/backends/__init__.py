"""Backend records: what each experts implementation supports, declared as data.

A `Backend` states the platforms, capabilities, packages, schemes, layouts, activations and
numerics features it handles; `Backend.check(config, platform)` returns the first reason it
cannot run a config, or None. The oracle (`fusedmoe.oracle`) filters one ordered table of these
records; nothing else decides.

Out-of-tree backends join through `register_backend(...)` or the `fusedmoe.backends` entry-point
group (each entry point names a `Backend` or a callable returning one or several).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata

import torch

from fusedmoe.activations import ACTIVATIONS, GATED
from fusedmoe.config import ACTIVATION_DTYPES, MoEConfig
from fusedmoe.platform import KINDS, Platform
from fusedmoe.quant.scheme import SCHEMES

logger = logging.getLogger("fusedmoe")

# Numerics features a backend may apply. A config that needs one the backend lacks is rejected.
FEATURES = ("bias", "clamp", "weight_on_input", "expert_map", "lora", "routed_scaling", "eplb")
FEATURE_TEXT = {
    "bias": "expert biases (has_bias=True)",
    "clamp": "the SwiGLU clamp (swiglu_limit)",
    "weight_on_input": "router weight on the input (apply_router_weight_on_input=True)",
    "expert_map": "an expert_map (expert parallelism)",
    "lora": "LoRA",
    "routed_scaling": "routed_scaling_factor != 1 in its fused router",
    "eplb": "expert load balancing (enable_eplb=True: replicated physical experts)",
}
ALL_SCHEMES = frozenset(("unquantized", *SCHEMES))
QUANTIZED_SCHEMES = frozenset(SCHEMES)
ALL_FEATURES = frozenset(FEATURES)
ALL_ACTIVATIONS = frozenset(ACTIVATIONS)
ALL_DTYPES = frozenset(ACTIVATION_DTYPES)
GROUPS = ("flashinfer", "deep_gemm", "aiter", "cutlass")

Check = Callable[[MoEConfig, Platform], "str | None"]


@dataclass(frozen=True)
class Backend:
    """One experts implementation and everything it needs, as data.

    capability: inclusive lower bound, exclusive upper bound, on the platform's (major, minor);
    scheme_capability: extra lower bounds for particular schemes (e.g. int8 needs 7.5);
    group: the include/exclude knob that governs it (FUSEDMOE_USE_<GROUP>);
    auto: False = chosen only when requested by name;
    monolithic: fuses the router, so it must reproduce the routing method itself;
    twin: the same kernel in the other activation format (standard <-> batched);
    impl: "module:Class" of the experts implementation, None while fusedmoe has none;
    pending_schemes: schemes the backend is meant to serve that its implementation lacks so far
        (pending_note, when set, says why);
    weight_only_execution: runs schemes that quantize activations with 16-bit activations
        instead (weights dequantized in registers, as Marlin does); its result is the
        weight-only math, not the scheme's emulation.
    """

    name: str
    summary: str
    kinds: frozenset[str]
    schemes: frozenset[str]
    layout: str = "standard"
    activations: frozenset[str] = ALL_ACTIVATIONS
    features: frozenset[str] = frozenset()
    dtypes: frozenset[torch.dtype] = frozenset((torch.float16, torch.bfloat16))
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    scheme_capability: tuple[tuple[str, tuple[int, int]], ...] = ()
    packages: tuple[str, ...] = ()
    needs_triton: bool = False
    group: str | None = None
    auto: bool = True
    monolithic: bool = False
    routing_methods: frozenset[str] = frozenset()
    deterministic: bool = False
    batch_invariant: bool = False
    twin: str | None = None
    aliases: tuple[str, ...] = ()
    extra_checks: tuple[Check, ...] = field(default=(), compare=False)
    impl: str | None = None
    pending_schemes: frozenset[str] = frozenset()
    pending_note: str = ""
    weight_only_execution: bool = False
    plugin: bool = False

    def __post_init__(self) -> None:
        if self.name != self.name.lower():
            raise ValueError(f"backend name {self.name!r} must be lowercase")
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"backend {self.name}: unknown platform kinds {sorted(unknown)}")
        unknown = set(self.schemes) - ALL_SCHEMES
        if unknown:
            raise ValueError(f"backend {self.name}: unknown schemes {sorted(unknown)}")
        unknown = set(self.features) - ALL_FEATURES
        if unknown:
            raise ValueError(f"backend {self.name}: unknown features {sorted(unknown)}")
        if self.layout not in ("standard", "batched"):
            raise ValueError(f"backend {self.name}: layout {self.layout!r}")
        if self.group is not None and self.group not in GROUPS:
            raise ValueError(f"backend {self.name}: group {self.group!r} not in {GROUPS}")

    # -------------------------------------------------------------------------------------
    def check(self, config: MoEConfig, platform: Platform) -> str | None:
        """The first reason this backend cannot run `config` on `platform`, or None."""
        for rule in (
            self._check_platform,
            self._check_scheme,
            self._check_problem,
            self._check_features,
        ):
            reason = rule(config, platform)
            if reason:
                return reason
        for rule in self.extra_checks:
            reason = rule(config, platform)
            if reason:
                return reason
        if self.impl is None:
            return "fusedmoe has no implementation of it yet"
        return None

    def _check_platform(self, config: MoEConfig, platform: Platform) -> str | None:
        if platform.kind not in self.kinds:
            return f"it runs on {'/'.join(sorted(self.kinds))}, not {platform.kind}"
        if self.min_capability is not None or self.max_capability is not None:
            cap = platform.capability
            if cap is None:
                return "the platform reports no device capability"
            if self.min_capability is not None and cap < self.min_capability:
                return f"it needs device capability >= {_cap(self.min_capability)}, got {_cap(cap)}"
            if self.max_capability is not None and cap >= self.max_capability:
                return f"it needs device capability < {_cap(self.max_capability)}, got {_cap(cap)}"
        for package in self.packages:
            if not platform.has(package):
                return f"the {package} package is not installed"
        if self.needs_triton and not platform.has_triton:
            return "triton is not importable"
        return None

    def _check_scheme(self, config: MoEConfig, platform: Platform) -> str | None:
        scheme = "unquantized" if config.quant is None else config.quant.name
        if scheme not in self.schemes:
            return f"it does not support the {scheme} scheme"
        if scheme in self.pending_schemes:
            note = f" ({self.pending_note})" if self.pending_note else ""
            return f"fusedmoe's implementation does not cover the {scheme} scheme yet{note}"
        for name, cap in self.scheme_capability:
            if name == scheme and not platform.capability_at_least(*cap):
                return f"{scheme} needs device capability >= {_cap(cap)}, got {platform.capability_str}"
        return None

    def _check_problem(self, config: MoEConfig, platform: Platform) -> str | None:
        if not config.gated and not (self.activations - set(GATED)):
            return "it supports only gated activations"
        if config.activation not in self.activations:
            return f"it does not support activation {config.activation!r}"
        if config.dtype not in self.dtypes:
            return f"it does not support activation dtype {config.dtype}"
        if config.activation_format != self.layout:
            return (
                f"it takes the {self.layout} activation format, "
                f"but the config uses {config.activation_format}"
            )
        if self.monolithic and config.routing_method not in self.routing_methods:
            return f"its fused router does not implement routing method {config.routing_method!r}"
        return None

    def _check_features(self, config: MoEConfig, platform: Platform) -> str | None:
        needed = needed_features(config, monolithic=self.monolithic)
        for feature in FEATURES:
            if feature in needed and feature not in self.features:
                return f"it does not apply {FEATURE_TEXT[feature]}"
        if config.batch_invariant and not self.batch_invariant:
            return "it is not batch-invariant (batch_invariant requested)"
        return None

    @property
    def supports_eplb(self) -> bool:
        """Runs on physical expert slots with replicas (the router's ids mapped before it)."""
        return "eplb" in self.features

    def load_impl(self) -> type:
        """Import and return the experts implementation class."""
        if self.impl is None:
            raise NotImplementedError(f"backend {self.name!r} has no implementation in fusedmoe yet")
        module, _, attr = self.impl.partition(":")
        return getattr(importlib.import_module(module), attr)


def needed_features(config: MoEConfig, *, monolithic: bool = False) -> frozenset[str]:
    needed = set()
    if config.has_bias:
        needed.add("bias")
    if config.needs_clamp:
        needed.add("clamp")
    if config.apply_router_weight_on_input:
        needed.add("weight_on_input")
    if config.needs_expert_map:
        needed.add("expert_map")
    if config.lora:
        needed.add("lora")
    if monolithic and config.routed_scaling_factor != 1.0:
        needed.add("routed_scaling")
    if config.enable_eplb:
        needed.add("eplb")
    return frozenset(needed)


def _cap(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


# Registry ------------------------------------------------------------------------------------
REGISTRY: dict[str, Backend] = {}
ALIASES: dict[str, str] = {}
_plugins_loaded = False
_generation = 0  # bumped on every registration, so cached selections are dropped


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a backend record (out-of-tree plugins: set plugin=True; they are tried first)."""
    global _generation
    if backend.name in REGISTRY and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered (pass replace=True)")
    REGISTRY[backend.name] = backend
    for alias in backend.aliases:
        ALIASES[alias] = backend.name
    _generation += 1
    return backend


def unregister_backend(name: str) -> None:
    global _generation
    backend = REGISTRY.pop(name)
    for alias in backend.aliases:
        ALIASES.pop(alias, None)
    _generation += 1


def generation() -> int:
    return _generation


def load_plugins(entry_points: Iterable[metadata.EntryPoint] | None = None) -> list[str]:
    """Register backends advertised under the `fusedmoe.backends` entry-point group, once.

    A plugin that fails to load is logged with its error and skipped; it never breaks selection.
    """
    global _plugins_loaded
    if entry_points is None:
        if _plugins_loaded:
            return []
        _plugins_loaded = True
        entry_points = metadata.entry_points(group="fusedmoe.backends")
    added = []
    for ep in entry_points:
        try:
            obj = ep.load()
            records = obj() if callable(obj) and not isinstance(obj, Backend) else obj
            if isinstance(records, Backend):
                records = [records]
            if not isinstance(records, list | tuple):
                raise TypeError(f"expected a fusedmoe Backend or a list of them, got {type(records).__name__}")
            for record in records:  # all checked before any is registered
                if not isinstance(record, Backend):
                    raise TypeError(f"expected a fusedmoe Backend, got {type(record).__name__}")
            for record in records:
                register_backend(record if record.plugin else _as_plugin(record))
                added.append(record.name)
        except Exception as exc:  # a broken plugin must not break selection
            logger.warning("fusedmoe: backend plugin %r failed to load: %s", ep.name, exc)
    return added


def _as_plugin(record: Backend) -> Backend:
    import dataclasses

    return dataclasses.replace(record, plugin=True)


def resolve_name(name: str) -> str | None:
    name = name.strip().lower()
    if name in REGISTRY:
        return name
    return ALIASES.get(name)


from fusedmoe.backends import table as _table  # noqa: E402  (registers the built-in records)

del _table
