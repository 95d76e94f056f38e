"""Launching the jitted kernels with less host time: `launch(fn, grid, *args, **kwargs)` does what
`fn[grid](*args, **kwargs)` does.

Triton's `JITFunction.run` spends tens of microseconds of Python on every launch: it binds and
specialises each argument, builds the cache key, compares every module global the kernel's source
reaches with its value at compile time (a `tl.constexpr.__ne__` each), and builds the launch
metadata. An eager decode call is three launches for ~25 us of GPU work, so this is most of its
host time (benchmarks/bench_launch_host.py: GEMM1's launch 84 us through `run`, 11 us through the
compiled kernel's own launcher, on an H200 host).

The first launch with a given argument key goes through `fn[grid]`, which returns the
`CompiledKernel` it ran; later launches with the same key call that kernel's launcher
(`CompiledKernel.run`, the call `JITFunction.run` ends with) directly, with each tensor passed as
its address (an int: Triton's launcher then skips its `data_ptr()` call and the driver's
pointer-attribute query, which the first launch made). The key is strictly finer than Triton's
specialisation, so a repeat always runs the kernel `run` would have chosen:

- the type of every argument, the names of the keyword arguments (launch options such as
  num_warps included), the number of positional ones, and the current device;
- a tensor: its dtype, whether it is on a CUDA device, and its address modulo 128 (Triton
  specialises pointers on 16-byte alignment; the residue decides any alignment up to 128 bytes,
  and the caching allocator's blocks share it, so it costs no repeats);
- an int, float, bool, str or None: its exact value (Triton specialises ints on ==1, on
  divisibility by 16 and on their width; the exact value covers those and any other).

The per-launch work is shaped for host time: the argument types select a plan, made once per
kernel and type signature, that knows which positions hold tensors, which hold plain values, and
how the values map to the kernel's parameters; a launch then builds one tuple of types, one of
plain values (C-level `itemgetter`s) and loops over the tensors only.

Any other argument (a TMA `TensorDescriptor`, a Triton dtype), a callable grid, a launch hook set
in `triton.knobs.runtime` (profilers such as proton; an empty `HookChain` is none), a pre-run
hook, the interpreter, or FUSEDMOE_TRITON_LAUNCHER=0 takes Triton's path every time. A Triton
without these objects, or whose compiled-kernel launcher refuses the call (another signature),
turns this off for the process (the latter with a warning, relaunching through Triton). Not
re-checked on a repeat: module globals of the kernel changed after its first launch (the library
never changes them) and Triton's debug knobs changed mid-process.

`recording()` collects the launches one thread makes (`Launched`: the compiled kernel's launcher,
grid and every parameter value with tensors as addresses), for `fusedmoe.backends.triton.replay`,
which replays an eager call's launches with the next call's addresses.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import warnings
from typing import Any, NamedTuple

import torch

from fusedmoe import knobs

_MAX_KEYS = 256  # per plan; a new key beyond it (prefill at ever new M) evicts the oldest
_PLAIN = frozenset((int, float, bool, str, type(None)))
# (id(JITFunction), number of positional arguments, keyword names..., argument types...) -> _Plan,
# or None where an argument's type has no key. Module-level kernels live as long as the process,
# so their ids are never reused.
_PLANS: dict[tuple, Any] = {}
_state: dict[str, Any] = {}
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE_CUDA = operator.attrgetter("dtype", "is_cuda")
_RESIDUE = (127).__and__


def _triton_state() -> dict | None:
    """Triton's launch-time objects, looked up once (None where this Triton lacks them)."""
    if "ok" not in _state:
        try:
            from triton import knobs as triton_knobs
            from triton.runtime.driver import driver
            from triton.runtime.jit import JITFunction

            runtime = triton_knobs.runtime
            runtime.launch_enter_hook, runtime.launch_exit_hook  # noqa: B018 (this Triton has them)
            device = driver.active.get_current_device  # torch.cuda.current_device: lazy init, then the raw call
            if torch.cuda.is_initialized() and hasattr(torch._C, "_cuda_getDevice"):
                device = torch._C._cuda_getDevice
            _state.update(ok=True, jit=JITFunction, runtime=runtime, device=device,
                          stream=driver.active.get_current_stream)
        except (ImportError, AttributeError, RuntimeError):
            _state["ok"] = False
    return _state if _state["ok"] else None


def _getter(indices: list[int]):
    """vals -> tuple(vals[i] for i in indices), C-level (itemgetter returns a bare item for one
    index: wrapped)."""
    if not indices:
        return lambda vals: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda vals: (vals[i],)
    return operator.itemgetter(*indices)


class _Plan:
    """One kernel's launches with one shape of arguments (count, keyword names, types)."""

    __slots__ = ("tensor_at", "tensors", "plain", "defaults", "size", "order", "cache")

    def __init__(self, fn, n_args: int, names: tuple, types: tuple):
        import inspect

        self.tensor_at = [i for i, t in enumerate(types) if t not in _PLAIN]
        self.tensors = _getter(self.tensor_at)
        self.plain = _getter([i for i, t in enumerate(types) if t in _PLAIN])
        # the compiled kernel's launcher takes every parameter in signature order: positional
        # arguments, then each later one from the keywords or its default; keywords that are
        # not parameters (launch options: num_warps, launch_pdl) are key only
        params = list(inspect.signature(fn.fn).parameters.values())
        at = {name: n_args + j for j, name in enumerate(names)}
        defaults, order = [], list(range(min(n_args, len(params))))
        for p in params[n_args:]:
            if p.name in at:
                order.append(at[p.name])
            else:
                order.append(len(types) + len(defaults))
                defaults.append(p.default)
        self.defaults = tuple(defaults)
        self.size = len(types) + len(defaults)  # arguments, then defaults: what `order` indexes
        self.order = _getter(order)
        self.cache: dict[tuple, tuple] = {}


def _plan(fn, shape: tuple, n_args: int, names: tuple, types: tuple) -> _Plan | None:
    for t in types:
        if t not in _PLAIN and not issubclass(t, torch.Tensor):
            plan = None  # a TMA descriptor, a Triton dtype, ...: Triton's path every time
            break
    else:
        plan = _Plan(fn, n_args, names, types)
    _PLANS[shape] = plan
    return plan


def argument_key(fn, args: tuple, kwargs: dict) -> tuple:
    """(plan, key, the tensors' addresses, the argument values) of a launch (module docstring);
    plan None where an argument has no key."""
    vals = (*args, *kwargs.values())
    plan = _PLANS.get((id(fn), len(args), *kwargs, *map(type, vals)), _PLANS)
    if plan is _PLANS:
        types = tuple(map(type, vals))
        plan = _plan(fn, (id(fn), len(args), *kwargs, *types), len(args), tuple(kwargs), types)
    if plan is None:
        return None, None, None, vals
    # C-level loops (map over a method, an attrgetter, int.__and__), no bytecode per tensor
    tensors = plan.tensors(vals)
    ptrs = list(map(_DATA_PTR, tensors))
    key = (plan.plain(vals), *map(_DTYPE_CUDA, tensors), *map(_RESIDUE, ptrs))
    return plan, key, ptrs, vals


def hooked(state: dict) -> bool:
    """A Triton launch hook is set (profilers such as proton): a callable, or a `HookChain`
    (Triton >= 3.5: never None) with calls in it."""
    runtime = state["runtime"]
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) \
        or (leave is not None and bool(getattr(leave, "calls", True)))


class Launched(NamedTuple):
    """One launch as the compiled kernel's launcher took it (`recording`): `values` in signature
    order with every tensor as its address; `pointers` the positions in `values` that are
    tensors' addresses."""

    run: Any
    function: Any
    metadata: Any
    kernel: Any
    grid: tuple[int, int, int]
    values: tuple
    pointers: tuple[int, ...]
    device: int


# `recording`: (the recording thread's id, its list); each launch of that thread appends a
# Launched, or None (Triton's own path)
_recorder: tuple[int, list] | None = None


@contextlib.contextmanager
def recording():
    """Collect this thread's launches made inside (a Launched each; None for one that went
    through Triton's own path: a hook, the knob, an argument without a key). One recording at a
    time."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("launcher.recording() is already recording")
    launches: list = []
    _recorder = (threading.get_ident(), launches)
    try:
        yield launches
    finally:
        _recorder = None


def _note(launched: Launched | None) -> None:
    recorder = _recorder
    if recorder is not None and recorder[0] == threading.get_ident():
        recorder[1].append(launched)


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """`fn[grid](*args, **kwargs)`; a repeat of a key runs its compiled kernel's launcher directly."""
    state = _state if _state.get("ok") else _triton_state()
    if state is None or type(fn) is not state["jit"] or type(grid) is not tuple \
            or getattr(fn, "pre_run_hooks", None) or hooked(state) or knobs.get("TRITON_LAUNCHER") is False:
        _triton_path(fn, grid, args, kwargs)
        return
    plan, key, ptrs, vals = argument_key(fn, args, kwargs)
    if plan is None:
        _triton_path(fn, grid, args, kwargs)
        return
    device = state["device"]()
    key = (device, *key)
    entry = plan.cache.get(key)
    if entry is None:
        kernel = fn[grid](*args, **kwargs)
        if not hasattr(kernel, "packed_metadata"):
            if _recorder is not None:
                _note(None)
            return
        if len(plan.cache) >= _MAX_KEYS:
            del plan.cache[next(iter(plan.cache))]
        # the kernel too: its module stays loaded while the entry holds its function
        entry = plan.cache[key] = (kernel.run, kernel.function, kernel.packed_metadata, kernel)
        if _recorder is not None:
            _note(_launched(entry, plan, _in_order(plan, vals, ptrs), grid, device))
        return
    run, function, metadata, _ = entry
    values = _in_order(plan, vals, ptrs)
    grid_0 = grid[0]
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    try:
        run(grid_0, grid_1, grid_2, state["stream"](device), function, metadata, None, None, None, *values)
    except Exception as exc:  # a Triton whose launcher takes other arguments: its own path from now on
        _state["ok"] = False
        warnings.warn(f"fusedmoe: launching {fn.fn.__name__} through its compiled kernel's launcher failed "
                      f"({type(exc).__name__}: {exc}); every launch goes through Triton's JITFunction.run "
                      "from now on", RuntimeWarning, stacklevel=2)
        _triton_path(fn, grid, args, kwargs)
        return
    if _recorder is not None:
        _note(_launched(entry, plan, values, grid, device))


def _triton_path(fn, grid, args: tuple, kwargs: dict) -> None:
    fn[grid](*args, **kwargs)
    if _recorder is not None:
        _note(None)


def _in_order(plan: _Plan, vals: tuple, ptrs: list) -> tuple:
    """Every parameter's value in signature order (defaults filled in), tensors as addresses."""
    full = [*vals, *plan.defaults]
    for i, ptr in zip(plan.tensor_at, ptrs, strict=True):
        full[i] = ptr
    return plan.order(full)


def _launched(entry: tuple, plan: _Plan, values: tuple, grid: tuple, device: int) -> Launched:
    positions = plan.order(range(plan.size))  # the argument (or default) behind each parameter
    tensor_at = set(plan.tensor_at)
    pointers = tuple(j for j, i in enumerate(positions) if i in tensor_at)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    return Launched(*entry, grid3, tuple(values), pointers, device)


def clear() -> None:
    """Forget every cached launch (tests; a kernel recompiled under changed Triton knobs)."""
    _PLANS.clear()
