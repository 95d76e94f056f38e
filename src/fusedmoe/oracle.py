"""The oracle: one generic selection over the backend table, with a reason for every verdict.

    select_backend(config, platform) -> Selection (name, record, experts class)
    explain(config, platform)        -> Explanation (a Verdict for every registered backend)

Precedence, first match wins (the seeds' order, one engine for every scheme):
  1. capability filters on every path: LoRA, SwiGLU clamp, batched format (-> the batched
     twin), bias, router weight on input, expert_map, batch invariance;
  2. an explicit request: `config.backend`, else FUSEDMOE_BACKEND. Unknown name -> ValueError
     listing the names accepted for the scheme; a known one that cannot run -> ValueError with
     the reason;
  3. FUSEDMOE_USE_FLASHINFER (0 excludes, 1 requires; FUSEDMOE_FLASHINFER_MODE picks one),
     then FUSEDMOE_USE_DEEP_GEMM, then FUSEDMOE_USE_AITER (opt-in), each tri-state;
  4. the family's priority table (`fusedmoe.backends.table.PRIORITY`), plugins first.
Nothing qualifies -> NoBackendError (a NotImplementedError) listing every candidate's reason.
The winner is logged once at INFO, each rejection once at DEBUG.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from fusedmoe import backends as _backends
from fusedmoe import knobs
from fusedmoe.backends import REGISTRY, Backend, load_plugins, resolve_name
from fusedmoe.backends.table import CUTLASS_OPT_IN, FLASHINFER_MODES, FLASHINFER_OPT_IN, PRIORITY
from fusedmoe.config import MoEConfig
from fusedmoe.errors import BackendRequestError, NoBackendError
from fusedmoe.platform import Platform
from fusedmoe.quant.scheme import FAMILY_LABEL, SCHEMES

logger = logging.getLogger("fusedmoe")

CHOSEN, SUPPORTED, REJECTED = "chosen", "supported", "rejected"


@dataclass(frozen=True)
class Verdict:
    """One backend's standing for a config: chosen, supported (not chosen) or rejected (reason)."""

    name: str
    status: str
    reason: str | None = None
    priority: int | None = None  # position in the family's auto order; None = not auto-selected
    layout: str = "standard"
    summary: str = ""


@dataclass(frozen=True)
class Selection:
    """The chosen backend: `name`, its `backend` record and its `experts` implementation class."""

    name: str
    backend: Backend
    family: str
    verdicts: tuple[Verdict, ...] = field(default=(), compare=False, repr=False)
    via: str = "auto"  # auto | argument | FUSEDMOE_BACKEND | FUSEDMOE_USE_... | lora
    config: MoEConfig | None = field(default=None, compare=False, repr=False)

    @property
    def experts(self) -> type:
        return self.backend.load_impl()

    @property
    def note(self) -> str | None:
        """What the chosen backend does differently from the scheme's arithmetic, or None."""
        return execution_note(self.backend, self.config) if self.config is not None else None

    def __iter__(self):
        yield self.name
        yield self.experts


@dataclass(frozen=True)
class Explanation:
    config: MoEConfig
    platform: Platform
    verdicts: tuple[Verdict, ...]
    chosen: str | None
    error: str | None = None
    via: str | None = None

    def table(self) -> str:
        """A fixed-width table: one row per registered backend."""
        rows = [("backend", "status", "prio", "layout", "reason")]
        for v in self.verdicts:
            prio = "-" if v.priority is None else str(v.priority)
            rows.append((v.name, v.status, prio, v.layout, v.reason or ""))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:<{widths[3]}}  {r[4]}".rstrip()
            for r in rows
        ]
        lines.insert(1, "-" * max(len(line) for line in lines))
        head = f"{_label(self.config)} MoE on {self.platform}{_split(self.config)}: "
        notes = []
        if self.chosen:
            head += f"chosen {self.chosen} (via {self.via})"
            note = execution_note(REGISTRY[self.chosen], self.config)
            notes = [f"note: {note}"] if note else []
        else:
            head += "no backend: " + (self.error or "").splitlines()[0]
        graphs = graph_note(self.config)
        if graphs:
            notes.append(f"cuda graphs: {graphs}")
        return "\n".join([head, *notes, *lines])

    def to_dict(self) -> dict:
        return {
            "config": _config_dict(self.config),
            "platform": {
                "kind": self.platform.kind,
                "capability": self.platform.capability,
                "packages": list(self.platform.packages),
                "has_triton": self.platform.has_triton,
                "device_name": self.platform.device_name,
            },
            "chosen": self.chosen,
            "note": execution_note(REGISTRY[self.chosen], self.config) if self.chosen else None,
            "cuda_graphs": graph_note(self.config),
            "via": self.via,
            "error": self.error,
            "verdicts": [v.__dict__ for v in self.verdicts],
        }

    def __str__(self) -> str:
        return self.table()


def select_backend(config: MoEConfig, platform: Platform | None = None) -> Selection:
    """Choose the backend for `config` on `platform` (default: the real machine)."""
    platform = Platform.current() if platform is None else platform
    load_plugins()
    d = _decide_cached(config, platform, knob_state(), _backends.generation())
    for v in d.verdicts:
        if v.status == REJECTED and v.priority is not None:
            _log_once(logging.DEBUG, _rejection_message(config, v.name, v.reason))
    if d.error is not None:
        raise d.error.with_traceback(None)
    selection = Selection(d.chosen, REGISTRY[d.chosen], config.family, d.verdicts, d.via, config)
    _log_once(logging.INFO, _winner_message(config, selection))
    return selection


def explain(config: MoEConfig, platform: Platform | None = None) -> Explanation:
    """A verdict for every registered backend; never raises for an unselectable config."""
    platform = Platform.current() if platform is None else platform
    load_plugins()
    d = _decide_cached(config, platform, knob_state(), _backends.generation())
    error = None if d.error is None else str(d.error)
    return Explanation(config, platform, d.verdicts, d.chosen, error=error, via=d.via)


# Engine ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Decision:
    chosen: str | None
    via: str | None
    verdicts: tuple[Verdict, ...]
    error: Exception | None = None


def knob_state() -> tuple:
    """The FUSEDMOE_* values selection depends on (part of every cache key)."""
    names = ("BACKEND", "USE_FLASHINFER", "FLASHINFER_MODE", "USE_DEEP_GEMM", "USE_AITER",
             "ALLOW_CUTLASS", "BATCH_INVARIANT", "MXFP4_ACTIVATION")
    return tuple(knobs.get(n) for n in names)


@functools.lru_cache(maxsize=1024)
def _decide_cached(config: MoEConfig, platform: Platform, knobs_now: tuple, gen: int) -> _Decision:
    del gen  # part of the cache key only: registrations invalidate earlier decisions
    request, use_fi, fi_mode, use_dg, use_aiter, allow_cutlass, batch_invariant, mxfp4_act = knobs_now
    if batch_invariant:
        config = config.replace(batch_invariant=True)
    if allow_cutlass is not None:
        config = config.replace(allow_cutlass=allow_cutlass)
    checks = _checks(config, platform)
    try:
        chosen, via = _decide(config, platform, checks, request, use_fi, fi_mode, use_dg, use_aiter, mxfp4_act)
    except (BackendRequestError, NoBackendError) as exc:
        return _Decision(None, None, _verdicts(config, platform, checks), exc)
    return _Decision(chosen, via, _verdicts(config, platform, checks, chosen=chosen))


def _decide(config, platform, checks, request, use_fi, fi_mode, use_dg, use_aiter,
            mxfp4_act=None) -> tuple[str, str]:
    """(chosen name, via) or raise. Writes knob exclusions into `checks` for the verdicts."""
    order = _auto_order(config, platform)

    # 2. explicit request: the argument, else FUSEDMOE_BACKEND ------------------------------
    via = "argument"
    if config.backend != "auto":
        request = config.backend
    elif request:
        via = "FUSEDMOE_BACKEND"
    if request:
        name = _resolve_request(request, config)
        if config.needs_clamp and "clamp" not in REGISTRY[name].features:
            clamp_ok = sorted(n for n in _family_names(config) if "clamp" in REGISTRY[n].features)
            raise BackendRequestError(
                f"Model sets swiglu_limit={config.swiglu_limit}, but the explicitly requested "
                f"backend={request!r} does not apply the SwiGLU clamp. Use one of {clamp_ok} instead."
            )
        if checks[name]:
            raise BackendRequestError(_rejection_message(config, name, checks[name]))
        return name, via

    # 3. include / exclude / require knobs (LoRA narrows the choice before any knob) ---------
    if mxfp4_act is not None and config.family == "mxfp4":  # a filter every later knob obeys
        for name in order:
            runs = row_activation(REGISTRY[name], config)
            if runs != mxfp4_act:
                checks[name] = checks[name] or (f"runs {config.quant.name} with {runs} activations, "
                                                f"FUSEDMOE_MXFP4_ACTIVATION={mxfp4_act}")
    excluded: dict[str, str] = {}
    if not config.lora:
        forced = _apply_group_knobs(
            config, checks, order, excluded, use_fi, fi_mode, use_dg, use_aiter
        )
        if forced is not None:
            return forced
    if not config.allow_cutlass and config.family in CUTLASS_OPT_IN:
        for name in order:
            if REGISTRY[name].group == "cutlass":
                excluded[name] = (f"{FAMILY_LABEL[config.family]} cutlass backends need allow_cutlass=True "
                                  "(FUSEDMOE_ALLOW_CUTLASS=1)")
    for name, why in excluded.items():
        checks[name] = checks[name] or why

    # 4. the family's priority order -------------------------------------------------------
    for name in order:
        if checks[name] is None:
            return name, "lora" if config.lora else "auto"
    raise NoBackendError(
        f"No {_label(config)} MoE backend supports the deployment configuration "
        f"({_describe(config)}) on {platform}.",
        tuple(v for v in _verdicts(config, platform, checks) if v.priority is not None),
    )


def _apply_group_knobs(config, checks, order, excluded, use_fi, fi_mode, use_dg, use_aiter):
    """FUSEDMOE_USE_{FLASHINFER,DEEP_GEMM,AITER}: returns (name, via) when a knob forces one."""
    label = _label(config)
    batched = config.activation_format == "batched"

    def in_order(group: str) -> list[str]:
        return [n for n in order if REGISTRY[n].group == group]

    # FlashInfer: 0 excludes; 1 requires (the mode picks one); unset = default (opt-in for bf16).
    fi = in_order("flashinfer")
    if use_fi is False or (use_fi is None and config.family in FLASHINFER_OPT_IN):
        why = ("excluded by FUSEDMOE_USE_FLASHINFER=0" if use_fi is False
               else f"FlashInfer is opt-in for {label} MoE (set FUSEDMOE_USE_FLASHINFER=1)")
        for name in fi:
            excluded[name] = why
    elif use_fi is True:
        if fi_mode is not None:
            name = FLASHINFER_MODES[fi_mode]
            if batched and REGISTRY[name].twin:
                name = REGISTRY[name].twin
            if name not in _family_names(config):
                raise BackendRequestError(
                    f"FlashInfer mode {fi_mode!r} ({name}) is not supported for {label} MoE."
                )
            if config.needs_clamp and "clamp" not in REGISTRY[name].features:
                raise BackendRequestError(
                    f"Model sets swiglu_limit={config.swiglu_limit}, but the FlashInfer backend "
                    f"selected via FUSEDMOE_FLASHINFER_MODE ({name}) does not apply the SwiGLU clamp."
                )
            if checks[name]:
                raise BackendRequestError(_rejection_message(config, name, checks[name]))
            return name, "FUSEDMOE_FLASHINFER_MODE"
        for name in fi:
            if checks[name] is None:
                return name, "FUSEDMOE_USE_FLASHINFER"
        raise NoBackendError(
            f"Found FUSEDMOE_USE_FLASHINFER=1, but no FlashInfer {label} MoE backend supports "
            "the configuration.",
            tuple(Verdict(n, REJECTED, checks[n]) for n in fi)
            or (Verdict("flashinfer", REJECTED, f"no FlashInfer backend serves {label} MoE"),),
        )

    # DeepGEMM: 0 excludes; 1 forces the contiguous or batched one.
    dg = in_order("deep_gemm")
    if dg and use_dg is False:
        for name in dg:
            excluded[name] = "excluded by FUSEDMOE_USE_DEEP_GEMM=0"
    elif dg and use_dg is True:
        name = "batched_deepgemm" if batched else "deepgemm"
        if checks[name]:
            raise BackendRequestError(_rejection_message(config, name, checks[name]))
        return name, "FUSEDMOE_USE_DEEP_GEMM"

    # AITER: opt-in, as upstream (VLLM_ROCM_USE_AITER defaults off).
    ai = in_order("aiter")
    if ai and use_aiter is True:
        if checks["aiter"]:
            raise BackendRequestError(_rejection_message(config, "aiter", checks["aiter"]))
        return "aiter", "FUSEDMOE_USE_AITER"
    for name in ai:
        excluded[name] = ("excluded by FUSEDMOE_USE_AITER=0" if use_aiter is False
                          else "AITER is opt-in (set FUSEDMOE_USE_AITER=1)")
    return None


def _checks(config: MoEConfig, platform: Platform) -> dict[str, str | None]:
    return {name: record.check(config, platform) for name, record in REGISTRY.items()}


def _auto_order(config: MoEConfig, platform: Platform) -> list[str]:
    """Plugins first (registration order), then the family's table for this platform kind."""
    plugins = [n for n, r in REGISTRY.items() if r.plugin and r.auto]
    table = [
        name
        for name, kinds in PRIORITY[config.family]
        if name in REGISTRY and REGISTRY[name].auto and (kinds is None or platform.kind in kinds)
    ]
    return plugins + [n for n in table if n not in plugins]


def _family_names(config: MoEConfig) -> list[str]:
    """Backend names accepted in an explicit request for this config's scheme family."""
    family = config.family
    return [n for n, r in REGISTRY.items() if any(_scheme_family(s) == family for s in r.schemes)]


def _scheme_family(scheme: str) -> str:
    return "unquantized" if scheme == "unquantized" else SCHEMES[scheme].family


def check_backend_request(config: MoEConfig) -> None:
    """Raise BackendRequestError now if `config.backend` names no backend of its family (the
    platform-dependent verdicts wait for selection). FusedMoE calls it at construction."""
    if config.backend != "auto":
        load_plugins()
        _resolve_request(config.backend, config)


def _resolve_request(request: str, config: MoEConfig) -> str:
    accepted = _family_names(config)
    name = resolve_name(request)
    if name is None or name not in accepted:
        raise BackendRequestError(
            f"backend={request!r} is not supported for {_label(config)} MoE. "
            f"Expected one of {sorted(accepted)}."
        )
    twin = REGISTRY[name].twin
    if REGISTRY[name].layout != config.activation_format and twin and REGISTRY[twin].layout == config.activation_format:
        name = twin
    return name


def _verdicts(config, platform, checks, chosen: str | None = None) -> tuple[Verdict, ...]:
    order = _auto_order(config, platform)
    rank = {name: i + 1 for i, name in enumerate(order)}
    out = []
    for name, record in REGISTRY.items():
        reason = checks.get(name)
        if name == chosen:
            status, reason = CHOSEN, None
        elif reason:
            status = REJECTED
        else:
            status = SUPPORTED
            if not record.auto:
                reason = "explicit request only"
            elif name not in rank:
                reason = "not in this scheme's auto order on this platform"
        out.append(Verdict(name, status, reason, rank.get(name), record.layout, record.summary))
    out.sort(key=lambda v: (v.status != CHOSEN, v.priority is None, v.priority or 0, v.name))
    return tuple(out)


# Messages ---------------------------------------------------------------------------------------
def _label(config: MoEConfig) -> str:
    return FAMILY_LABEL[config.family]


def _describe(config: MoEConfig) -> str:
    quant = "unquantized" if config.quant is None else config.quant.name
    p = config.parallel
    return (
        f"E={config.num_experts} top_k={config.top_k} H={config.hidden_size} "
        f"I={config.intermediate_size_per_partition} {str(config.dtype).replace('torch.', '')} "
        f"{quant} {config.activation} {config.activation_format} tp={p.tp_size} dp={p.dp_size} "
        f"ep={p.ep_size}" + (f" dispatch={p.dispatch}" if p.use_ep else "")
    )


def _split(config: MoEConfig) -> str:
    """", tp=2 ep=4 dp=2 (alltoall dispatch, standard layout)" for a split config, else ""."""
    p = config.parallel
    sizes = [f"{k}={v}" for k, v in (("tp", p.tp_size), ("ep", p.ep_size), ("dp", p.dp_size)) if v > 1]
    if not sizes:
        return ""
    how = f"{p.dispatch} dispatch, " if p.use_ep else ""
    return f", {' '.join(sizes)} ({how}{config.activation_format} layout)"


def graph_note(config: MoEConfig) -> str | None:
    """Whether the expert-parallel forward can be captured in a CUDA graph (its dispatch decides),
    and why; None without EP (the one-rank forward always can)."""
    p = config.parallel
    if not p.use_ep:
        return None
    cap = config.max_num_tokens
    if p.dispatch == "allgather" and cap is not None:
        return f"capturable (allgather dispatch at a fixed capacity, max_num_tokens={cap} a rank)"
    why = ("the all-gather exchanges its row counts" if p.dispatch == "allgather"
           else f"the {p.dispatch} dispatch exchanges its split sizes")
    return f"not capturable: {why} through the host; dispatch='allgather' with max_num_tokens set is"


def row_activation(backend: Backend, config: MoEConfig) -> str:
    """The activation format a row computes `config`'s scheme with: the scheme's (e.g. mxfp8 for
    mxfp4_w4a8), or "bf16" for 16-bit activations (weight-only schemes, weight-only execution)."""
    scheme = config.quant
    if scheme is None or scheme.activation is None or backend.weight_only_execution:
        return "bf16"
    return scheme.activation.dtype


def execution_note(backend: Backend, config: MoEConfig) -> str | None:
    """How `backend` departs from `config`'s scheme arithmetic (weight-only execution of a
    scheme that quantizes activations), or None."""
    scheme = config.quant
    if not backend.weight_only_execution or scheme is None or scheme.activation is None:
        return None
    dtype = str(config.dtype).replace("torch.", "")
    return (f"{backend.name} runs {scheme.name} weight-only: activations stay {dtype} (the "
            f"scheme's {scheme.activation} activation quantization and input scales are not "
            "applied)")


def _winner_message(config: MoEConfig, sel: Selection) -> str:
    candidates = [v.name for v in sel.verdicts if v.priority is not None]
    note = execution_note(sel.backend, config)
    return (
        f"Using {sel.name} {_label(config)} MoE backend (via {sel.via}) out of potential "
        f"backends: {sorted(candidates, key=lambda n: next(v.priority for v in sel.verdicts if v.name == n))}."
        + (f" Note: {note}." if note else "")
    )


def _rejection_message(config: MoEConfig, name: str, reason: str | None) -> str:
    return (
        f"{_label(config)} MoE backend {name} does not support the deployment configuration "
        f"since {reason}."
    )


_logged: set[tuple[int, str]] = set()


def _log_once(level: int, message: str) -> None:
    if (level, message) in _logged:
        return
    _logged.add((level, message))
    logger.log(level, message)


def _config_dict(config: MoEConfig) -> dict:
    out = {}
    for f in config.__dataclass_fields__:
        value = getattr(config, f)
        if f == "quant":
            value = None if value is None else value.name
        elif f == "parallel":
            value = dict(value.__dict__)
        elif f == "dtype":
            value = str(value).replace("torch.", "")
        out[f] = value
    return out
