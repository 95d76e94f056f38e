"""`fusedmoe.backends.triton.launcher.launch`: which launches take Triton's path and which the
cached compiled kernel's launcher, with what arguments. A stand-in JITFunction records both
(CPU); the GPU test runs the library both ways and compares outputs bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusedmoe import knobs
from fusedmoe.backends.triton import launcher


def kernel_source(x_ptr, out_ptr, n, scale, FLAG: bool = False, BLOCK: int = 64, MODE: str = "a"):
    pass


class FakeKernel:
    """A CompiledKernel: `run` is its launcher."""

    def __init__(self, log: list):
        self.log, self.function, self.packed_metadata = log, "function", "metadata"

    def run(self, *args):
        self.log.append(("direct", args))


class FakeJIT:
    """A JITFunction: `fn[grid](*args, **kwargs)` is Triton's path; it returns the kernel it ran."""

    def __init__(self):
        self.fn, self.pre_run_hooks, self.log = kernel_source, [], []
        self.kernel = FakeKernel(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.kernel
        return run


@pytest.fixture
def fake(monkeypatch):
    runtime = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    state = dict(ok=True, jit=FakeJIT, runtime=runtime, device=lambda: 0, stream=lambda device: 1234 + device)
    monkeypatch.setattr(launcher, "_state", state)
    monkeypatch.setattr(launcher, "_PLANS", {})
    return FakeJIT(), runtime


def aligned(n: int, dtype=torch.float32) -> torch.Tensor:
    """n fresh random values at an address that is a multiple of 128 bytes (CPU tensors are
    aligned to 64)."""
    buf = torch.randn(n + 64, dtype=dtype)
    skip = (-buf.data_ptr() % 128) // buf.element_size()
    return buf[skip:skip + n]


def ways(fn: FakeJIT) -> list[str]:
    return [entry[0] for entry in fn.log]


def replays_bitwise(call, launches: list, replayed) -> torch.Tensor:
    """The GPU replay tests' common part: `call()` once with replays off (the reference), then
    five times (seen, recorded, replayed three times), every output kept alive (a replay's fresh
    buffers never hold an earlier result) and bitwise the reference's; `launches` (what went
    through `launch()` during the last call) is empty from the third call on, and `replayed` (a
    replayable function) holds one Plan. Returns the reference."""
    from fusedmoe.backends.triton import replay

    with knobs.override(TRITON_REPLAY=False):
        reference = call()
        torch.cuda.synchronize()
    assert launches and reference.isfinite().all()
    kept = []
    for n in range(5):  # seen, recorded, then replayed
        kept.append(call())
        torch.cuda.synchronize()
        assert torch.equal(kept[-1], reference), f"call {n}"
        assert (len(launches) == 0) == (n >= 2), f"call {n}: {len(launches)} launches through launch()"
    plans = list(replayed.plans().values())
    assert len(plans) == 1 and isinstance(plans[0], replay.Plan), plans
    return reference


def counted_launches(monkeypatch, *modules) -> list:
    """The kernels launched through each module's `launch` (the name it imported), appended to the
    returned list as they are launched (the GPU replay tests clear it before each call)."""
    launches: list = []
    for module in modules:
        def counted(*args, _original=module.launch, **kwargs):
            launches.append(args[0])
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, "launch", counted)
    return launches


def test_a_repeat_calls_the_compiled_launcher_with_every_argument_in_order(fake):
    fn, _ = fake
    x, out = torch.randn(8), torch.empty(8)
    for _ in range(3):
        launcher.launch(fn, (5, 2), x, out, 8, 0.5, BLOCK=32, num_warps=4)
    assert ways(fn) == ["triton", "direct", "direct"]
    assert fn.log[0][1:] == ((5, 2), (x, out, 8, 0.5), {"BLOCK": 32, "num_warps": 4})
    # grid padded to three, the current stream, no launch metadata or hooks, then every parameter
    # in signature order with the defaults filled in, tensors as their addresses; num_warps is an
    # option, not a parameter
    assert fn.log[1][1] == (5, 2, 1, 1234, "function", "metadata", None, None, None, x.data_ptr(), out.data_ptr(),
                            8, 0.5, False, 32, "a")
    # keywords in any order, a positional parameter given by keyword: signature order all the same
    launcher.launch(fn, (1,), x, n=8, MODE="b", out_ptr=out, scale=2.0)
    launcher.launch(fn, (1,), x, n=8, MODE="b", out_ptr=out, scale=2.0)
    assert fn.log[-1][1][9:] == (x.data_ptr(), out.data_ptr(), 8, 2.0, False, 64, "b")


def test_what_changes_the_key_takes_triton_path_once(fake):
    fn, _ = fake
    x, out = aligned(64), aligned(64)
    base = dict(FLAG=True, MODE="b")
    launcher.launch(fn, (1,), x, out, 16, 1.0, **base)
    changed = [
        ((x[1:], out, 16, 1.0), base),  # an address no longer 16-byte aligned
        ((x[8:], out, 16, 1.0), base),  # 16-byte aligned, not 128 (a finer alignment rule stays safe)
        ((aligned(64, torch.float64), out, 16, 1.0), base),  # the dtype
        ((x, out, 1, 1.0), base),  # an int's value (Triton specialises 1 as a constant)
        ((x, out, True, 1.0), base),  # a bool equal to that int
        ((x, out, 16, 1.0), dict(base, MODE="c")),  # a constexpr
        ((x, out, 16, 1.0), dict(MODE="b", FLAG=True)),  # the keywords' order
        ((x, out, 16, 1.0), dict(base, num_stages=3)),  # a launch option
    ]
    for args, kwargs in changed:
        launcher.launch(fn, (1,), *args, **kwargs)
        launcher.launch(fn, (1,), *args, **kwargs)
    assert ways(fn) == ["triton"] + ["triton", "direct"] * len(changed)
    # the same key with new tensors at addresses of the same residue and another grid: a repeat
    launcher.launch(fn, (7,), aligned(64), aligned(64), 16, 1.0, **base)
    assert ways(fn)[-1] == "direct" and fn.log[-1][1][:3] == (7, 1, 1)


def test_a_nn_parameter_has_a_key_other_arguments_do_not(fake):
    fn, _ = fake
    w = torch.nn.Parameter(torch.randn(8))
    for _ in range(2):
        launcher.launch(fn, (1,), w, w, 8, 1.0)
    unknown = (torch.float32, [1, 2], SimpleNamespace(), object())
    for value in unknown:
        for _ in range(2):
            launcher.launch(fn, (1,), w, w, 8, 1.0, MODE=value)
    assert ways(fn) == ["triton", "direct"] + ["triton"] * 2 * len(unknown)


class HookChain:
    """Triton >= 3.5's launch hooks: a chain, empty when nothing is registered."""

    def __init__(self, calls=()):
        self.calls = list(calls)


@pytest.mark.parametrize("hooks", [(None, None), (HookChain(), HookChain())], ids=["none", "empty_chains"])
def test_no_launch_hook_is_a_none_or_an_empty_chain(fake, hooks):
    fn, runtime = fake
    runtime.launch_enter_hook, runtime.launch_exit_hook = hooks
    x = torch.randn(8)
    for _ in range(2):
        launcher.launch(fn, (1,), x, x, 8, 1.0)
    assert ways(fn) == ["triton", "direct"]


@pytest.mark.parametrize("switch", ["enter_hook", "exit_hook", "enter_chain", "exit_chain", "pre_run_hook", "knob",
                                    "grid_callable", "device"])
def test_triton_path_when_a_hook_the_knob_or_a_callable_grid_says_so(fake, switch):
    fn, runtime = fake
    x = torch.randn(8)
    grid = (1,)
    launcher.launch(fn, grid, x, x, 8, 1.0)
    if switch == "enter_hook":
        runtime.launch_enter_hook = print
    elif switch == "exit_hook":
        runtime.launch_exit_hook = print
    elif switch == "enter_chain":
        runtime.launch_enter_hook = HookChain([print])
    elif switch == "exit_chain":
        runtime.launch_exit_hook = HookChain([print])
    elif switch == "pre_run_hook":
        fn.pre_run_hooks.append(print)
    elif switch == "grid_callable":
        grid = lambda meta: (1,)  # noqa: E731
    elif switch == "device":  # another current device: its own key
        launcher._state["device"] = lambda: 1
    with knobs.override(TRITON_LAUNCHER=False if switch == "knob" else None):
        launcher.launch(fn, grid, x, x, 8, 1.0)
    assert ways(fn) == ["triton", "triton"]


def test_keys_are_bounded_and_other_objects_take_triton_path(fake, monkeypatch):
    fn, _ = fake
    monkeypatch.setattr(launcher, "_MAX_KEYS", 3)
    x = torch.randn(8)
    for n in (2, 3, 4, 5, 6):  # five keys, the last three remembered
        launcher.launch(fn, (1,), x, x, n, 1.0)
    for n in (6, 5, 4, 2, 4):  # 2 was evicted; it evicts 4, the oldest left
        launcher.launch(fn, (1,), x, x, n, 1.0)
    assert ways(fn) == ["triton"] * 5 + ["direct"] * 3 + ["triton"] * 2
    plan, = launcher._PLANS.values()
    assert len(plan.cache) == 3
    calls = []

    class Recorder:  # e.g. kernel_report's recorder: not a JITFunction
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(grid)

    for _ in range(2):
        launcher.launch(Recorder(), (3,), x)
    assert calls == [(3,), (3,)]


def test_a_launcher_that_refuses_the_call_turns_the_cache_off_with_a_warning(fake):
    fn, _ = fake
    x = torch.randn(8)

    def refuses(*args):
        raise TypeError("takes 12 positional arguments")

    fn.kernel.run = refuses
    launcher.launch(fn, (1,), x, x, 8, 1.0)
    with pytest.warns(RuntimeWarning, match="kernel_source.*TypeError: takes 12"):
        launcher.launch(fn, (1,), x, x, 8, 1.0)  # the direct call fails: relaunched through Triton
    launcher.launch(fn, (1,), x, x, 8, 1.0)
    assert ways(fn) == ["triton"] * 3 and launcher._state["ok"] is False


def test_no_triton_state_takes_triton_path(monkeypatch):
    monkeypatch.setattr(launcher, "_state", {"ok": False})
    fn = FakeJIT()
    for _ in range(2):
        launcher.launch(fn, (1,), torch.randn(4), torch.randn(4), 4, 1.0)
    assert ways(fn) == ["triton", "triton"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 300])  # 300: the aligned path's chunked alignment
@pytest.mark.parametrize("direct", [None, False])
def test_library_launches_bitwise_the_same_both_ways_and_repeats_skip_triton_run(monkeypatch, tokens, direct):
    """fused_experts through the cached launcher equals Triton's path bit for bit, and a repeat
    call goes through JITFunction.run not once. In place into a copy of the tokens: a launch that
    did nothing would leave the tokens, not the reference."""
    from triton.runtime.jit import JITFunction

    from fusedmoe import fused_experts, select_experts

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    E, H, inter, K = 20, 384, 192, 4
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**0.5
    logits = torch.randn(tokens, E, device="cuda", generator=gen)
    runs = []
    original = JITFunction.run

    def counted(self, *args, **kwargs):
        runs.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    outs = {}
    with knobs.override(TRITON_DIRECT=direct, TRITON_TMA=False):  # TMA descriptors have no key
        for way in (False, None, None):  # Triton's path; the first cached (keys made); repeats
            with knobs.override(TRITON_LAUNCHER=way):
                runs.clear()
                weights, ids = select_experts(x, logits, K)
                out = x.clone()
                fused_experts(out, w13, w2, weights, ids, backend="triton", inplace=True)
                torch.cuda.synchronize()
                outs.setdefault(way, []).append((out, len(runs)))
    (reference, through_triton), = outs[False]
    assert through_triton > 0 and reference.isfinite().all() and not torch.equal(reference, x)
    for out, _ in outs[None]:
        assert torch.equal(out, reference)
    assert outs[None][1][1] == 0  # the repeat: no launch through JITFunction.run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 300])
@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("inplace", [False, True])
def test_replayed_calls_equal_the_full_path_bitwise_and_launch_nothing_through_python(monkeypatch, tokens, direct,
                                                                                     inplace):
    """From the third call of a signature fused_experts replays the recorded launches
    (fusedmoe.backends.triton.replay): outputs bitwise those of the full path, on new tensors
    each call (new addresses), with no call of `launch`. Every output is kept alive, so a
    replay's fresh buffers never hold an earlier call's result."""
    from fusedmoe import fused_experts, select_experts
    from fusedmoe.backends.triton import experts, replay

    gen = torch.Generator(device="cuda").manual_seed(100 + tokens)
    E, H, inter, K = 20, 384, 192, 4
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**0.5
    weights, ids = select_experts(x, torch.randn(tokens, E, device="cuda", generator=gen), K)
    launches = counted_launches(monkeypatch, experts)

    def call() -> torch.Tensor:
        launches.clear()
        inp = x.clone()
        out = fused_experts(inp, w13, w2, weights.clone(), ids.clone(), backend="triton", inplace=inplace)
        assert (out is inp) == inplace
        return out

    replay.clear()
    with knobs.override(TRITON_DIRECT=direct, TRITON_TMA=False):
        reference = replays_bitwise(call, launches, experts.triton_experts)
    assert not torch.equal(reference, x)


QUANT_SCHEMES = ["fp8_w8a8_tensor", "fp8_w8a8_tensor_static", "fp8_w8a8_channel", "fp8_w8a8_block", "int8_w8a8",
                 "fp8_w8a16", "int8_w8a16", "int4_w4a16_g128", "mxfp4_w4a16", "nvfp4_w4a16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 300])
@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
def test_quantized_calls_replay_bitwise(monkeypatch, scheme, tokens):
    """The W8A8 and weight-only paths (`quant.triton_quant_experts`) replay from the third call
    of a signature, bitwise the full path's output, with no call of `launch`. The dynamic
    per-tensor scheme allocates its amax with torch.zeros: a filled allocation, made again."""
    from fusedmoe import fused_experts, select_experts
    from fusedmoe.backends.triton import experts, quant, replay
    from fusedmoe.quant.weights import quantize_weights

    gen = torch.Generator(device="cuda").manual_seed(200 + tokens)
    E, H, inter, K = 20, 384, 256, 4
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, device="cuda", generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, device="cuda", generator=gen) / inter**0.5
    amax = (torch.tensor(6.0), torch.tensor(10.0)) if scheme.endswith("static") else None
    q13, q2, params = quantize_weights(w13, w2, scheme, activation_amax=amax)
    weights, ids = select_experts(x, torch.randn(tokens, E, device="cuda", generator=gen), K)
    launches = counted_launches(monkeypatch, experts, quant)

    def call() -> torch.Tensor:
        launches.clear()
        return fused_experts(x.clone(), q13, q2, weights.clone(), ids.clone(), quant=params, backend="triton")

    replay.clear()
    with knobs.override(TRITON_TMA=False):
        replays_bitwise(call, launches, quant.triton_quant_experts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 300])
@pytest.mark.parametrize("scheme", [None, *QUANT_SCHEMES])
def test_batched_layout_calls_replay_bitwise(monkeypatch, scheme, tokens):
    """The batched layout's experts (`experts.triton_batched_experts`, `quant.triton_batched_quant_experts`)
    replay from the third call of a signature: their result is a view ([L * max_tokens, H] as
    [L, max_tokens, H]) of a zero-filled allocation, made again each replay; bitwise the full
    path's output, zero past each count, with no call of `launch`."""
    from fusedmoe import select_experts
    from fusedmoe.backends.triton import experts, quant, replay
    from fusedmoe.quant.weights import quantize_weights

    gen = torch.Generator(device="cuda").manual_seed(300 + tokens)
    E, H, inter, K = 20, 384, 256, 4
    w13 = torch.randn(E, 2 * inter, H, device="cuda", generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, device="cuda", generator=gen) / inter**0.5
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    _, ids = select_experts(x, torch.randn(tokens, E, device="cuda", generator=gen), K)
    counts = torch.bincount(ids.flatten().long(), minlength=E).to(torch.int32)  # each <= tokens
    x_b = torch.randn(E, tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    if scheme is None:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        replayed = experts.triton_batched_experts

        def run(xb, n):
            return experts.triton_batched_experts(xb, n, w13, w2, None, None, "silu", 1.702, None, tokens * K, K)
    else:
        amax = (torch.tensor(6.0), torch.tensor(10.0)) if scheme.endswith("static") else None
        q13, q2, p = quantize_weights(w13, w2, scheme, activation_amax=amax)
        replayed = quant.triton_batched_quant_experts

        def run(xb, n):
            return quant.triton_batched_quant_experts(
                xb, n, q13, q2, None, None, "silu", 1.702, None, scheme, p.w13_scale, p.w2_scale, p.a13_scale,
                p.a2_scale, w13_global_scale=p.w13_global_scale, w2_global_scale=p.w2_global_scale,
                num_slots=tokens * K, top_k=K)
    launches = counted_launches(monkeypatch, experts, quant)

    def call() -> torch.Tensor:
        launches.clear()
        return run(x_b.clone(), counts.clone())

    replay.clear()
    with knobs.override(TRITON_TMA=False):
        reference = replays_bitwise(call, launches, replayed)
    assert reference.shape == (E, tokens, H)
    rows = torch.arange(tokens, device="cuda")[None, :] >= counts[:, None].long()
    assert not reference[rows].any() and reference[~rows].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("scheme", [None, "fp8_w8a8_block", "int4_w4a16_g128"])
def test_the_whole_batched_path_replays(monkeypatch, scheme, tokens):
    """fused_experts(activation_format="batched") on one GPU: the dispatch (`batched.batched_dispatch`,
    four tensors back, two of them rows of one zero-filled allocation), the batched experts and
    the combine each replay from the third call; bitwise the full path, no call of `launch`."""
    from fusedmoe import fused_experts, select_experts
    from fusedmoe.backends.triton import batched, experts, quant, replay
    from fusedmoe.quant.weights import quantize_weights

    gen = torch.Generator(device="cuda").manual_seed(400 + tokens)
    E, H, inter, K = 20, 384, 256, 4
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, device="cuda", generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, device="cuda", generator=gen) / inter**0.5
    if scheme is None:
        q13, q2, params = w13.bfloat16(), w2.bfloat16(), None
    else:
        q13, q2, params = quantize_weights(w13, w2, scheme)
    weights, ids = select_experts(x, torch.randn(tokens, E, device="cuda", generator=gen), K)
    launches = counted_launches(monkeypatch, experts, quant, batched)

    def call() -> torch.Tensor:
        launches.clear()
        return fused_experts(x.clone(), q13, q2, weights.clone(), ids.clone(), quant=params, backend="triton",
                             activation_format="batched")

    replay.clear()
    with knobs.override(TRITON_TMA=False):
        reference = replays_bitwise(call, launches, batched.batched_dispatch)
    middle = experts.triton_batched_experts if scheme is None else quant.triton_batched_quant_experts
    for fn in (middle, batched.batched_combine):
        assert [type(p) for p in fn.plans().values()] == [replay.Plan], fn.__name__
    want = fused_experts(x.clone(), q13, q2, weights, ids, quant=params, backend="triton").float()
    assert (reference.float() - want).norm() / want.norm() < 2e-2  # the standard layout, other sum orders
