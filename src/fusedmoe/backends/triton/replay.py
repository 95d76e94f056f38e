"""Replaying an eager call's Triton launches with the new call's addresses (host time).

An eager decode call of the `triton` experts spends most of its host time deciding, again, what
the previous call with the same shapes decided: the tile plan, every kernel argument (strides,
sizes, flags, constexprs) and each launch's key. `replayable(fn)` wraps a function that runs Triton
kernels through `fusedmoe.backends.triton.launcher.launch`:

- The signature of a call: each tensor argument's dtype, shape, strides and device, which tensor
  arguments share an address, and every other argument's value (plain values, `None`, tuples and
  frozen dataclasses such as tile configs); a call with anything else, or with a CPU tensor (the
  interpreter, whose launches take Triton's path), runs `fn` as it is.
- The first call of a signature runs `fn`. The second runs it while recording (unless the
  launcher is off or a launch hook is set: then a later call records): the launches, as
  the compiled kernels' launchers took them (`launcher.recording`); the knobs it read and their
  values (`knobs.reading`); the torch operations, under a dispatch mode, which may only allocate
  (`torch.empty` and kin; `torch.zeros`, `torch.full` and kin: such a fresh allocation is filled
  again on a replay, before any launch) or take views. Every pointer a launch passed must fall inside one
  tensor argument or one allocation; it is kept as (that source, offset). Anything else (another
  torch operation, a launch that took Triton's own path, a pointer from elsewhere, tensor
  arguments that overlap without sharing an address) makes the signature run `fn` as it is, with
  the reason kept (`plans()`), until a knob the refused call read has another value (a call with
  validation on syncs on the device: recorded again once it is off).
- The result (a tensor, or a tuple of tensors) must be tensor arguments, allocations, or views of
  them (kept as shape, strides and offset in that source: the batched layout returns [L*M, H]
  viewed [L, M, H]).
- Later calls of the signature replay: the recorded allocations are made again (those neither
  returned nor filled as parts of one scratch buffer, one allocation instead of one each: the
  launches need only their addresses), each pointer is the new source's address plus its offset,
  and the recorded launches run on the current stream with those addresses. A replay falls back
  to `fn` before launching anything when a knob it read has another value, a Triton launch hook
  is set, the current device differs, or a pointer's address modulo 128 differs from the
  recorded one (Triton specialises on 16-byte alignment).

Wrapped: `experts.triton_experts` (unquantized) and `quant.triton_quant_experts` (W8A8 and
weight-only; the quantized weights' metadata checks run inside it, so a replay skips them too),
and the batched layout's `experts.triton_batched_experts` and `quant.triton_batched_quant_experts`
(likewise), and the one-rank batched dispatch and combine around them (`batched`). The
expert-parallel all-to-all (`distributed`) runs its full path.

FUSEDMOE_TRITON_REPLAY=0 turns it off; so does FUSEDMOE_TRITON_LAUNCHER=0 (the knob is read while
recording). `clear()` forgets the plans (`experts.clear_tile_caches` calls it: tuned tables
written in this process change the tiles). At most `_MAX_PLANS` signatures per function, oldest
evicted. Only the thread that records is recorded.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedmoe import knobs
from fusedmoe.backends.triton import launcher

_MAX_PLANS = 128
_PLAIN = launcher._PLAIN  # the value types a launch key takes by value
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_MASK = 127  # addresses are compared modulo 128, as the launcher keys them
_POOL_ALIGN = 512  # the CUDA caching allocator's block alignment
_MIN_DEVICE = 0  # tensors on devices below this (get_device(): CPU is -1) run fn as it is (tests: -1)
_DATA_PTR = torch.Tensor.data_ptr
_ALL: list[Callable[[], None]] = []  # each replayable function's clear()
_state = {"on": True}


def _packets(*names: str) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


_ALLOCATIONS = _packets("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided")
# allocations filled with one value: the value, from the operation's arguments
_FILLED = {packet: value for names, value in (
    (("zeros", "zeros_like", "new_zeros"), lambda args: 0),
    (("ones", "ones_like", "new_ones"), lambda args: 1),
    (("full", "full_like"), lambda args: args[1]),
    (("new_full",), lambda args: args[2]),
) for packet in _packets(*names)}
_VIEWS = _packets("view", "_unsafe_view", "alias", "as_strided", "slice", "select", "t", "transpose",
                  "permute", "unsqueeze", "squeeze", "expand", "detach", "_reshape_alias", "reshape",
                  "unflatten", "flatten", "split", "split_with_sizes", "unbind", "chunk", "narrow")


class _Operations(TorchDispatchMode):
    """The torch operations of a recorded call: allocations kept (alive until the plan is built,
    so no two share memory) with their fill value (None: left empty), views allowed, anything else
    noted."""

    def __init__(self):
        super().__init__()
        self.allocations: list[torch.Tensor] = []
        self.fills: list[Any] = []
        self.other: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in _ALLOCATIONS:
            self.allocations.append(out)
            self.fills.append(None)
        elif packet in _FILLED and type(fill := _FILLED[packet](args)) in (int, float, bool):
            self.allocations.append(out)  # a fresh allocation: no earlier launch can have touched it
            self.fills.append(fill)
        elif packet not in _VIEWS and self.other is None:
            self.other = str(func)
        return out


class Allocation(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    fill: int | float | bool | None = None  # None: torch.empty


class Plan(NamedTuple):
    """A signature's recorded launches. `slots`: for each pointer of each launch, in order,
    (source, offset): source < number of tensor arguments is that argument, else an allocation."""

    launches: tuple[launcher.Launched, ...]
    allocations: tuple[Allocation, ...]
    slots: tuple[tuple[int, int], ...]
    residues: tuple[int, ...]
    knobs: tuple[tuple[str, Any], ...]
    device: int
    # the result: for each returned tensor (one, or each of a tuple: `many`), (its source index,
    # its view of that source: (shape, strides, element offset from the source's first element),
    # or None where it is the source itself)
    out: tuple[tuple[int, tuple[tuple[int, ...], tuple[int, ...], int] | None], ...]
    # The scratch: allocations neither returned nor filled share one byte buffer of `pool` bytes
    # (one torch.empty a replay instead of one each); `offsets`: each allocation's offset in it
    # (multiples of _POOL_ALIGN, so addresses keep their residues), -1 where it is a tensor of its own.
    pool: int
    offsets: tuple[int, ...]
    many: bool = False  # the function returns a tuple of tensors


class Refused(NamedTuple):
    reason: str
    knobs: tuple[tuple[str, Any], ...] = ()  # the knobs the refused call read: another value records again


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last) of t's elements (a zero-size tensor: its address only)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start + 1
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + span * t.element_size()


def _signature(args: tuple, kwargs: dict) -> tuple | None:
    """(signature, tensor arguments, their addresses), or None where an argument has no key."""
    parts: list = [len(args), *kwargs]
    tensors = []
    for v in (*args, *kwargs.values()):
        t = type(v)
        if t in _PLAIN:
            parts.append(t)
            parts.append(v)
        elif t in _TENSORS:
            device = v.get_device()
            if device < _MIN_DEVICE:  # a CPU tensor: the interpreter's launches, which take Triton's path
                return None
            tensors.append(v)
            parts.append((v.dtype, v.shape, v.stride(), device))
        elif t is tuple or (dataclasses.is_dataclass(v) and t.__dataclass_params__.frozen):
            try:
                hash(v)
            except TypeError:
                return None
            parts.append(t)
            parts.append(v)
        else:
            return None
    ptrs = list(map(_DATA_PTR, tensors))
    first: dict[int, int] = {}
    parts.append(tuple([first.setdefault(p, i) for i, p in enumerate(ptrs)]))  # shared addresses
    return tuple(parts), tensors, ptrs


def _build(out, launches: list, reads: dict, ops: _Operations, tensors: list) -> Plan | Refused:
    if ops.other is not None:
        return Refused(f"a torch operation other than allocations and views: {ops.other}")
    if any(launch is None for launch in launches):
        return Refused("a launch went through Triton's own path (a hook, the knob, an argument without a key)")
    sources = tensors + ops.allocations
    extents = [_extent(t) for t in sources]
    distinct = sorted(set(extents))  # tensor arguments that share an address share their extent too
    for (_, end), (start, _) in zip(distinct, distinct[1:], strict=False):
        if start < end:
            return Refused("tensor arguments overlap without sharing an address")
    for a in ops.allocations:
        if not a.is_contiguous():
            return Refused(f"an allocation is not contiguous ({tuple(a.shape)}, strides {a.stride()})")
    slots, residues = [], []
    for launch in launches:
        for j in launch.pointers:
            address = launch.values[j]
            if address == 0:
                slots.append((-1, 0))
                continue
            source = next((i for i, (s, e) in enumerate(extents) if s <= address < e), None)
            if source is None:
                return Refused(f"a pointer of {launch.kernel.name} is in no tensor argument or allocation")
            slots.append((source, address - extents[source][0]))
            residues.append(address & _MASK)
    many = type(out) is tuple
    results = []
    for o in out if many else (out,):
        found = _result(o, sources, extents)
        if found is None:
            return Refused("the result is neither a tensor argument, an allocation nor a view of one")
        results.append(found)
    devices = {launch.device for launch in launches}
    if len(devices) > 1:
        return Refused(f"launches on several devices {sorted(devices)}")
    allocations = tuple(Allocation(tuple(a.shape), a.dtype, a.device, fill)
                        for a, fill in zip(ops.allocations, ops.fills, strict=True))
    pool, offsets = _pool(allocations, {i - len(tensors) for i, _ in results})
    return Plan(tuple(launches), allocations, tuple(slots), tuple(residues), tuple(reads.items()),
                devices.pop() if devices else -1, tuple(results), pool, offsets, many)


def _result(out, sources: list, extents: list) -> tuple[int, tuple | None] | None:
    """(source index, view or None) of a returned tensor, or None where no source holds it."""
    if type(out) not in _TENSORS:
        return None
    # the same tensor: a dispatch mode hands the caller another Python object for an allocation
    index = next((i for i, t in enumerate(sources) if t is out or (
        t.data_ptr() == out.data_ptr() and t.shape == out.shape and t.dtype == out.dtype
        and t.stride() == out.stride())), None)
    if index is not None:
        return index, None
    first, end = _extent(out)  # a view of a source (the batched layout's [L, M, H], unbind's rows)
    index = next((i for i, t in enumerate(sources) if t.dtype == out.dtype
                  and extents[i][0] <= first and end <= extents[i][1]), None)
    if index is None:
        return None
    return index, (tuple(out.shape), out.stride(), (first - extents[index][0]) // out.element_size())


def _pool(allocations: tuple[Allocation, ...], out: set[int]) -> tuple[int, tuple[int, ...]]:
    """(bytes, offsets) of the scratch buffer (Plan.pool): the unfilled allocations other than the
    results' sources on the device most of them are on (the others are made one by one); none
    where fewer than two would share it."""
    scratch = [i for i, a in enumerate(allocations) if a.fill is None and i not in out]
    if scratch:
        device = collections.Counter(allocations[i].device for i in scratch).most_common(1)[0][0]
        scratch = [i for i in scratch if allocations[i].device == device]
    if len(scratch) < 2:
        return 0, (-1,) * len(allocations)
    offsets, end = [-1] * len(allocations), 0
    for i in scratch:
        a = allocations[i]
        offsets[i] = end
        size = torch.Size(a.shape).numel() * a.dtype.itemsize
        end += -(-max(size, 1) // _POOL_ALIGN) * _POOL_ALIGN
    return end, tuple(offsets)


def _replay(plan: Plan, tensors: list, ptrs: list):
    """The result, or None where the plan does not apply now (nothing launched)."""
    for name, value in plan.knobs:
        if knobs.get(name) != value:
            return None
    state = launcher._state
    if not state.get("ok") or launcher.hooked(state):
        return None
    device = state["device"]() if plan.launches else -1
    if device != plan.device:
        return None
    bases = list(ptrs)
    allocations: list[torch.Tensor | None] = []
    if plan.pool:  # alive until the launches are queued: the allocator reuses it in stream order
        pool = torch.empty(plan.pool, dtype=torch.uint8, device=plan.allocations[plan.offsets.index(0)].device)
        start = pool.data_ptr()
    for a, offset in zip(plan.allocations, plan.offsets, strict=True):
        if offset >= 0:
            allocations.append(None)
            bases.append(start + offset)
            continue
        t = torch.empty(a.shape, dtype=a.dtype, device=a.device) if a.fill is None else \
            torch.full(a.shape, a.fill, dtype=a.dtype, device=a.device)
        allocations.append(t)
        bases.append(t.data_ptr())
    addresses = [bases[s] + o if s >= 0 else 0 for s, o in plan.slots]
    mask = _MASK
    if tuple([a & mask for a in addresses if a]) != plan.residues:
        return None
    if plan.launches:
        stream = state["stream"](device)
        k = 0
        for launch in plan.launches:
            values = list(launch.values)
            for j in launch.pointers:
                values[j] = addresses[k]
                k += 1
            launch.run(*launch.grid, stream, launch.function, launch.metadata, None, None, None, *values)
    sources = tensors + allocations
    results = []
    for index, view in plan.out:
        out = sources[index]
        if view is not None:
            shape, stride, offset = view
            out = out.as_strided(shape, stride, out.storage_offset() + offset)
        results.append(out)
    return tuple(results) if plan.many else results[0]


def replayable(fn: Callable) -> Callable:
    """fn, replaying its recorded launches on calls of a signature seen twice (module docstring)."""
    plans: dict[tuple, Plan | Refused] = {}
    seen: dict[tuple, None] = {}
    lock = threading.Lock()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _state["on"] or knobs.get("TRITON_REPLAY") is False or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        signed = _signature(args, kwargs)
        if signed is None:
            return fn(*args, **kwargs)
        sig, tensors, ptrs = signed
        plan = plans.get(sig)
        if type(plan) is Plan:
            try:
                out = _replay(plan, tensors, ptrs)
            except Exception as exc:  # a launcher that refuses the call: the full path from now on
                _state["on"] = False
                warnings.warn(f"fusedmoe: replaying {fn.__name__}'s launches failed ({type(exc).__name__}: {exc}); "
                              "every call runs its full path from now on", RuntimeWarning, stacklevel=2)
                out = None
            return fn(*args, **kwargs) if out is None else out
        if plan is not None and any(knobs.get(name) != value for name, value in plan.knobs):
            plans.pop(sig, None)  # refused under other knob values (validation's syncs, ...): record again
            plan = None
            if sig not in seen and len(seen) >= _MAX_PLANS:
                del seen[next(iter(seen))]
            seen[sig] = None
        if plan is not None or sig not in seen:  # refused, or first seen: remember it
            if plan is None:
                if len(seen) >= _MAX_PLANS:
                    del seen[next(iter(seen))]
                seen[sig] = None
            return fn(*args, **kwargs)
        state = launcher._state
        if not state.get("ok") or launcher.hooked(state) or knobs.get("TRITON_LAUNCHER") is False:
            return fn(*args, **kwargs)  # launches through Triton's path now: record a later call
        if not lock.acquire(blocking=False):  # another thread records: this call runs as it is
            return fn(*args, **kwargs)
        try:
            with launcher.recording() as launches, knobs.reading() as reads, _Operations() as ops:
                out = fn(*args, **kwargs)
            built = _build(out, launches, reads, ops, tensors)
            if type(built) is Refused:
                built = built._replace(knobs=tuple(reads.items()))
        finally:
            lock.release()
        if len(plans) >= _MAX_PLANS:
            del plans[next(iter(plans))]
        plans[sig] = built
        return out

    def clear() -> None:
        plans.clear()
        seen.clear()

    wrapper.plans = lambda: dict(plans)  # signature -> Plan or Refused (tests, diagnosis)
    wrapper.clear = clear
    _ALL.append(clear)
    return wrapper


def clear() -> None:
    """Forget every replayable function's plans."""
    for forget in _ALL:
        forget()


__all__ = ["Allocation", "Plan", "Refused", "clear", "replayable"]
