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
(`CompiledKernel.run`, the call `JITFunction.run` ends with) directly. The key is strictly finer
than Triton's specialisation, so a repeat always runs the kernel `run` would have chosen:

- a tensor: its dtype and its address modulo 128 (Triton specialises pointers on 16-byte
  alignment; the residue decides any alignment up to 128 bytes, and the caching allocator's
  blocks share it, so it costs no repeats);
- an int, float, bool, str or None: its type and exact value (Triton specialises ints on ==1,
  on divisibility by 16 and on their width; the exact value covers those and any other);
- the names of the keyword arguments (launch options such as num_warps included), the number of
  positional ones, and the current device.

Any other argument (a TMA `TensorDescriptor`, a Triton dtype), a callable grid, a launch hook set
in `triton.knobs.runtime` (profilers such as proton; an empty `HookChain` is none), a pre-run
hook, the interpreter, or FUSEDMOE_TRITON_LAUNCHER=0 takes Triton's path every time. A Triton
without these objects, or whose compiled-kernel launcher refuses the call (another signature),
turns this off for the process (the latter with a warning, relaunching through Triton). Not
re-checked on a repeat: module globals of the kernel changed after its first launch (the library
never changes them) and Triton's debug knobs changed mid-process.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fusedmoe import knobs

# Kernels' cached launches: id(JITFunction) -> {key: (CompiledKernel, tail)}. Module-level
# kernels live as long as the process, so their ids are never reused.
_CACHES: dict[int, dict] = {}
_MAX_KEYS = 256  # per kernel; a new key beyond it (prefill at ever new M) evicts the oldest
_TAILS: dict[tuple, tuple] = {}
_PLAIN = frozenset((int, float, bool, str, type(None)))
_TENSOR = torch.Tensor
_state: dict[str, Any] = {}


def _triton_state() -> dict | None:
    """Triton's launch-time objects, looked up once (None where this Triton lacks them)."""
    if "ok" not in _state:
        try:
            from triton import knobs as triton_knobs
            from triton.runtime.driver import driver
            from triton.runtime.jit import JITFunction

            runtime = triton_knobs.runtime
            runtime.launch_enter_hook, runtime.launch_exit_hook  # noqa: B018 (this Triton has them)
            _state.update(ok=True, jit=JITFunction, runtime=runtime,
                          device=driver.active.get_current_device, stream=driver.active.get_current_stream)
        except (ImportError, AttributeError, RuntimeError):
            _state["ok"] = False
    return _state if _state["ok"] else None


def argument_key(args: tuple, kwargs: dict) -> tuple | None:
    """The launch's key (module docstring), or None where an argument has no key. Two entries an
    argument: its type and value, or a tensor's dtype and address modulo 128."""
    parts: list = [len(args), *kwargs]
    append = parts.append
    for v in (*args, *kwargs.values()):
        t = type(v)
        if t in _PLAIN:
            append(t)
            append(v)
        elif t is _TENSOR or isinstance(v, _TENSOR):  # a subclass too (nn.Parameter)
            append(v.dtype)
            append(v.data_ptr() & 127)
        else:
            return None
    return tuple(parts)


def _tail(fn, args: tuple, kwargs: dict) -> tuple:
    """(name, default, from kwargs) of each parameter after the positional ones, in order; one
    signature inspection per kernel and call shape."""
    shape = (id(fn), len(args), tuple(kwargs))
    tail = _TAILS.get(shape)
    if tail is None:
        import inspect

        params = list(inspect.signature(fn.fn).parameters.values())
        tail = _TAILS[shape] = tuple((p.name, p.default, p.name in kwargs) for p in params[len(args):])
    return tail


def _hooked(hook) -> bool:
    """A launch hook is set: a callable, or a `HookChain` (Triton >= 3.5's knobs: never None,
    empty when nothing is registered) with calls in it."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """`fn[grid](*args, **kwargs)`; a repeat of a key runs its compiled kernel's launcher directly."""
    state = _triton_state()
    if state is None or type(fn) is not state["jit"] or type(grid) is not tuple or getattr(fn, "pre_run_hooks", None) \
            or _hooked(state["runtime"].launch_enter_hook) or _hooked(state["runtime"].launch_exit_hook):
        fn[grid](*args, **kwargs)
        return
    if knobs.get("TRITON_LAUNCHER") is False:
        fn[grid](*args, **kwargs)
        return
    key = argument_key(args, kwargs)
    if key is None:
        fn[grid](*args, **kwargs)
        return
    device = state["device"]()
    key = (device, key)
    cache = _CACHES.setdefault(id(fn), {})
    entry = cache.get(key)
    if entry is None:
        kernel = fn[grid](*args, **kwargs)
        if hasattr(kernel, "packed_metadata"):
            if len(cache) >= _MAX_KEYS:
                del cache[next(iter(cache))]
            cache[key] = (kernel, _tail(fn, args, kwargs))
        return
    kernel, tail = entry
    values = [*args, *[kwargs[name] if named else default for name, default, named in tail]]
    grid_0 = grid[0]
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    try:
        kernel.run(grid_0, grid_1, grid_2, state["stream"](device), kernel.function, kernel.packed_metadata,
                   None, None, None, *values)
    except Exception as exc:  # a Triton whose launcher takes other arguments: its own path from now on
        _state["ok"] = False
        warnings.warn(f"fusedmoe: launching {fn.fn.__name__} through its compiled kernel's launcher failed "
                      f"({type(exc).__name__}: {exc}); every launch goes through Triton's JITFunction.run "
                      "from now on", RuntimeWarning, stacklevel=2)
        fn[grid](*args, **kwargs)


def clear() -> None:
    """Forget every cached launch (tests; a kernel recompiled under changed Triton knobs)."""
    _CACHES.clear()
    _TAILS.clear()
