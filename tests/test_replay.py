"""`fusedmoe.backends.triton.replay`: which calls replay their recorded launches, with which
addresses, and which run their full path. Stand-in JITFunctions record both ways (CPU); the GPU
test in tests/test_launcher.py runs the library both ways and compares outputs bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusedmoe import knobs
from fusedmoe.backends.triton import launcher, replay


def gemm_source(x_ptr, w_ptr, a_ptr, n, FLAG: bool = False, BLOCK: int = 16):
    pass


def sum_source(a_ptr, out_ptr, x_ptr, n, SCALE: float = 1.0):
    pass


class FakeKernel:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.function, self.packed_metadata = name, log, name, "metadata"
        self.fail = False

    def run(self, *args):
        if self.fail:
            raise TypeError("takes 12 positional arguments")
        self.log.append(("direct", self.name, args))


class FakeJIT:
    def __init__(self, source, log: list):
        self.fn, self.pre_run_hooks, self.log = source, [], log
        self.kernel = FakeKernel(source.__name__, log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", self.fn.__name__, grid))
            return self.kernel
        return run


@pytest.fixture
def fake(monkeypatch):
    runtime = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    state = dict(ok=True, jit=FakeJIT, runtime=runtime, device=lambda: 0, stream=lambda device: 77)
    monkeypatch.setattr(launcher, "_state", state)
    monkeypatch.setattr(launcher, "_PLANS", {})
    monkeypatch.setitem(replay._state, "on", True)
    # CPU allocations are 64-byte aligned (the CUDA caching allocator's are 512): addresses
    # compared modulo 64 here, so a new buffer's address keeps its key
    monkeypatch.setattr(launcher, "_RESIDUE", (63).__and__)
    monkeypatch.setattr(replay, "_MASK", 63)
    monkeypatch.setattr(replay, "_MIN_DEVICE", -1)  # CPU tensors stand in for CUDA ones
    log: list = []
    return SimpleNamespace(log=log, gemm=FakeJIT(gemm_source, log), sum=FakeJIT(sum_source, log), runtime=runtime)


def make_path(fake, extra=None):
    """An experts-like path: a buffer, a view, a knob read, two launches, out new or given."""

    @replay.replayable
    def path(x, w, out=None, flag=False):
        knobs.get("TRITON_DIRECT")
        a = torch.empty(x.shape[0], 4)
        out = torch.empty_like(x) if out is None else out
        launcher.launch(fake.gemm, (x.shape[0],), x, w, a, x.shape[0], FLAG=flag)
        if extra is not None:
            extra(x)
        launcher.launch(fake.sum, (2, 1), a, out, x.reshape(-1), 3, SCALE=0.5)
        return out

    return path


def aligned(*shape) -> torch.Tensor:
    """Fresh random values at an address that is a multiple of 64 bytes."""
    n = torch.Size(shape).numel()
    buf = torch.randn(n + 64)
    skip = (-buf.data_ptr() % 64) // buf.element_size()
    return buf[skip:skip + n].view(shape)


def ways(log: list) -> list[str]:
    return [entry[0] for entry in log]


def test_the_third_call_replays_with_its_own_addresses(fake):
    path = make_path(fake)
    w = aligned(8)
    for _ in range(2):  # first seen, then recorded (the launcher: Triton's path, then its cache)
        path(aligned(3, 5), w)
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Plan) and len(plan.launches) == 2 and len(plan.allocations) == 2
    assert dict(plan.knobs).keys() >= {"TRITON_DIRECT", "TRITON_LAUNCHER"}
    fake.log.clear()
    x = aligned(3, 5)
    out = path(x, w)
    assert ways(fake.log) == ["direct", "direct"]
    (_, g, gemm_args), (_, s, sum_args) = fake.log
    assert (g, s) == ("gemm_source", "sum_source")
    # grid, stream, function, metadata, no hooks, then the parameters: addresses of this call
    assert gemm_args[:9] == (3, 1, 1, 77, "gemm_source", "metadata", None, None, None)
    a_ptr = gemm_args[11]
    assert gemm_args[9:] == (x.data_ptr(), w.data_ptr(), a_ptr, 3, False, 16)
    assert sum_args[:3] == (2, 1, 1)
    assert sum_args[9:] == (a_ptr, out.data_ptr(), x.data_ptr(), 3, 0.5)
    assert a_ptr not in (x.data_ptr(), w.data_ptr(), out.data_ptr())
    assert out.shape == x.shape and out.dtype == x.dtype


def test_what_changes_the_signature_or_the_plan_runs_the_full_path(fake):
    path = make_path(fake)
    w = aligned(8)
    for _ in range(3):
        path(aligned(3, 5), w)
    fake.log.clear()
    cases = [
        lambda: path(aligned(4, 5), w),  # another shape: first seen
        lambda: path(aligned(3, 5), w, flag=True),  # another value
        lambda: path(aligned(3, 5), w.double()),  # another dtype
    ]
    for case in cases:
        fake.log.clear()
        case()
        assert "triton" in ways(fake.log)  # a new launch key: the full path through Triton
    fake.log.clear()
    with knobs.override(TRITON_DIRECT=False):  # a knob the recording read, now another value
        path(aligned(3, 5), w)
    assert ways(fake.log) == ["direct", "direct"] and len(path.plans()) == 1  # the others seen once
    x = aligned(3, 5)
    fake.log.clear()
    path(x[:, :].as_strided((3, 5), (5, 1), 1), w)  # an address 4 bytes past the alignment: refused
    assert "triton" in ways(fake.log)


def test_out_given_and_shared_addresses_are_signatures_of_their_own(fake):
    path = make_path(fake)
    w = aligned(8)
    for _ in range(3):
        x = aligned(3, 5)
        assert path(x, w, out=x) is x  # in place: out is x
    fake.log.clear()
    x, out = aligned(3, 5), aligned(3, 5)
    for _ in range(3):
        assert path(x, w, out=out) is out
    *_, (_, _, sum_args) = fake.log
    assert sum_args[9 + 1] == out.data_ptr() and sum_args[9 + 2] == x.data_ptr()
    plans = [p for p in path.plans().values() if isinstance(p, replay.Plan)]
    assert len(plans) == 2 and {p.out for p in plans} == {((0, None),), ((2, None),)}  # x (shared with out), then out


@pytest.mark.parametrize("why", ["operation", "foreign_pointer", "unkeyed_argument"])
def test_a_path_that_cannot_be_replayed_runs_whole_every_time(fake, why):
    foreign = aligned(16)
    if why == "operation":
        path = make_path(fake, extra=lambda x: x + 1)
    elif why == "foreign_pointer":
        path = make_path(fake, extra=lambda x: launcher.launch(fake.sum, (1,), foreign, foreign, foreign, 1))
    else:
        path = make_path(fake)
    w = aligned(8)
    for _ in range(4):
        if why == "unkeyed_argument":
            path(aligned(3, 5), w, flag=[1])
        else:
            path(aligned(3, 5), w)
    plans = list(path.plans().values())
    if why == "unkeyed_argument":
        assert plans == []
    else:
        (plan,) = plans
        assert isinstance(plan, replay.Refused)
        assert ("add" if why == "operation" else "in no tensor argument") in plan.reason
    fake.log.clear()
    path(aligned(3, 5), w, **({"flag": [1]} if why == "unkeyed_argument" else {}))
    assert len(fake.log) == (3 if why == "foreign_pointer" else 2)  # every launch through launch()


@pytest.mark.parametrize("switch", ["replay_knob", "launcher_knob", "hook", "device"])
def test_switches_that_turn_a_replay_back_into_the_full_path(fake, switch):
    path = make_path(fake)
    w = aligned(8)
    for _ in range(3):
        path(aligned(3, 5), w)
    calls = []
    original = launcher.launch

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    if switch == "hook":
        fake.runtime.launch_enter_hook = print
    elif switch == "device":
        launcher._state["device"] = lambda: 1
    override = {"replay_knob": dict(TRITON_REPLAY=False), "launcher_knob": dict(TRITON_LAUNCHER=False)}.get(switch, {})
    import unittest.mock

    with knobs.override(**override), unittest.mock.patch.object(launcher, "launch", counted):
        path(aligned(3, 5), w)
    assert len(calls) == 2  # both launches went through launch(): no replay


def test_a_replay_that_fails_turns_replays_off_with_a_warning(fake):
    path = make_path(fake)
    w = aligned(8)
    for _ in range(2):
        path(aligned(3, 5), w)
    fake.gemm.kernel.fail = True  # the compiled kernel's launcher now refuses the call
    with pytest.warns(RuntimeWarning, match="replaying path's launches failed"):
        path(aligned(3, 5), w)  # then the full path (the launcher turns itself off too)
    assert replay._state["on"] is False
    fake.log.clear()
    path(aligned(3, 5), w)
    assert ways(fake.log) == ["triton", "triton"]


def test_cpu_tensors_run_the_path_as_it_is(fake, monkeypatch):
    """On CPU the kernels run in Triton's interpreter, whose launches never take the launcher's
    fast path: no signature, no recording (a dispatch mode over an interpreted call is slow)."""
    monkeypatch.setattr(replay, "_MIN_DEVICE", 0)
    path = make_path(fake)
    w = aligned(8)
    for _ in range(4):
        path(aligned(3, 5), w)
    assert path.plans() == {}


def test_an_empty_call_replays_its_allocation_only(fake):
    @replay.replayable
    def path(x):
        return torch.empty_like(x)

    for _ in range(3):
        out = path(aligned(0, 5))
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Plan) and plan.launches == () and out.shape == (0, 5)


@pytest.mark.parametrize("switch", ["launcher_knob", "hook"])
def test_a_call_while_launches_take_tritons_path_is_not_recorded(fake, switch):
    """A call made while the launcher is off or a hook is set records nothing (it would record
    Triton-path launches and refuse the signature for good); a later call records."""
    path = make_path(fake)
    w = aligned(8)
    path(aligned(3, 5), w)  # seen
    if switch == "hook":
        fake.runtime.launch_enter_hook = print
        path(aligned(3, 5), w)
        fake.runtime.launch_enter_hook = None
    else:
        with knobs.override(TRITON_LAUNCHER=False):
            path(aligned(3, 5), w)
    assert path.plans() == {}
    path(aligned(3, 5), w)  # recorded now
    fake.log.clear()
    path(aligned(3, 5), w)
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Plan) and ways(fake.log) == ["direct", "direct"]


def test_filled_allocations_are_made_again_with_their_fill(fake):
    """torch.zeros / torch.full (an amax the kernels accumulate into) are allocations with a
    fill: a replay fills its new buffers the same way. A fill from a tensor reads it on the host
    (aten._local_scalar_dense): refused."""

    @replay.replayable
    def path(x, fill_from_tensor=False):
        amax = torch.zeros(2, x.shape[0])
        rows = torch.full((x.shape[0],), 7, dtype=torch.int32)
        if fill_from_tensor:
            torch.full_like(x, x[0, 0])
        launcher.launch(fake.gemm, (1,), x, amax[1], rows, x.shape[0])
        return amax

    for _ in range(3):
        out = path(aligned(3, 5))
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Plan)
    assert [(a.shape, a.dtype, a.fill) for a in plan.allocations] == [((2, 3), torch.float32, 0),
                                                                       ((3,), torch.int32, 7)]
    assert torch.equal(out, torch.zeros(2, 3))
    fake.log.clear()
    out = path(aligned(3, 5))
    ((way, _, args),) = fake.log
    assert way == "direct" and args[10] == out.data_ptr() + 3 * 4  # amax[1] of this call's buffer
    for _ in range(3):
        path(aligned(3, 5), fill_from_tensor=True)
    refused = [p for p in path.plans().values() if isinstance(p, replay.Refused)]
    assert len(refused) == 1 and "_local_scalar_dense" in refused[0].reason


def test_scratch_allocations_share_one_buffer(fake):
    """Allocations that are neither returned nor filled are parts of one buffer in a replay, at
    512-byte offsets (addresses keep their residues); the result is a tensor of its own."""

    @replay.replayable
    def path(x, w):
        a = torch.empty(x.shape[0], 40)  # 480 bytes at x.shape[0] = 3: the next part starts at 512
        b = torch.empty(5, dtype=torch.int32)
        amax = torch.zeros(2)
        out = torch.empty_like(x)
        launcher.launch(fake.gemm, (1,), x, w, a, x.shape[0])
        launcher.launch(fake.sum, (1,), b, out, amax, 3)
        return out

    w = aligned(8)
    for _ in range(2):
        path(aligned(3, 5), w)
    (plan,) = path.plans().values()
    assert plan.pool == 1024 and plan.offsets == (0, 512, -1, -1)
    fake.log.clear()
    out = path(aligned(3, 5), w)
    (_, _, gemm_args), (_, _, sum_args) = fake.log
    a_ptr, b_ptr, out_ptr, amax_ptr = gemm_args[11], sum_args[9], sum_args[10], sum_args[11]
    assert b_ptr - a_ptr == 512 and out_ptr == out.data_ptr()
    assert len({a_ptr, b_ptr, out_ptr, amax_ptr}) == 4 and not a_ptr <= out_ptr < a_ptr + 1024


def test_scratch_allocations_pool_on_their_device_and_the_rest_stand_alone():
    """One allocation on another device (the CPU scalar a host-side check once made inside a CUDA
    call) no longer keeps the others from sharing one buffer: it is made alone."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    allocations = (replay.Allocation((4, 8), torch.float32, cpu), replay.Allocation((), torch.float32, meta),
                   replay.Allocation((16,), torch.int32, cpu), replay.Allocation((3,), torch.float32, cpu, 0.0))
    assert replay._pool(allocations, set()) == (1024, (0, -1, 512, -1))
    assert replay._pool(allocations, {0}) == (0, (-1, -1, -1, -1))  # one left to share: no pool


def test_tile_choice_and_checks_make_no_torch_allocations():
    """The host-side tile logic runs no torch operation: inside a recorded call each one would be
    an allocation a replay makes again (a CPU scalar per check_tile, made for its element size)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fusedmoe.backends.triton.experts import (
        GemmProblem,
        batch_invariant_tiles,
        direct_heuristic,
    )
    from fusedmoe.backends.triton.tiles import check_plan, heuristic
    from fusedmoe.quant.scheme import get_scheme

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        for quant, group in ((None, None), ("w4", 32), ("w8", None), ("block", None)):
            t1 = heuristic(64, 8, 768, 2048, torch.bfloat16, gated=True, quant=quant, group=group)
            t2 = heuristic(64, 8, 2048, 768, torch.bfloat16, gated=False, quant=quant, group=group)
            assert check_plan(t1, t2, direct=False, dtype=torch.bfloat16, gated=True, quant=quant, group=group) is None
        problem = GemmProblem(8, 8, 2048, 768, 8, True, torch.bfloat16)
        direct_heuristic(problem, get_scheme("int4_w4a16_g32"), 132)
        batch_invariant_tiles(problem, get_scheme("mxfp4_w4a16"), torch.device("cpu"))
    assert seen == []


def test_a_refusal_under_other_knob_values_records_again(fake):
    """A call with validation on reads a tensor on the host (a sync the replay cannot keep): the
    signature is refused while the knob holds that value, and recorded again once it changes."""

    @replay.replayable
    def path(x, w):
        if knobs.get("VALIDATE"):
            bool((x > -1e9).all())  # a validation-style host read
        a = torch.empty(x.shape[0], 4)
        launcher.launch(fake.gemm, (1,), x, w, a, x.shape[0])
        return a

    w = aligned(8)
    with knobs.override(VALIDATE=True):
        for _ in range(3):
            path(aligned(3, 5), w)
        (plan,) = path.plans().values()
        assert isinstance(plan, replay.Refused) and dict(plan.knobs)["VALIDATE"] is True
    fake.log.clear()
    path(aligned(3, 5), w)  # VALIDATE off: recorded now (the launch goes through launch())
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Plan) and dict(plan.knobs)["VALIDATE"] is None
    with knobs.override(VALIDATE=True):  # the plan read VALIDATE: the full path, validation included
        calls = []
        original = launcher.launch
        import unittest.mock

        with unittest.mock.patch.object(launcher, "launch", lambda *a, **k: calls.append(a) or original(*a, **k)):
            path(aligned(3, 5), w)
        assert len(calls) == 1


def test_a_result_that_views_an_allocation_is_that_view_of_the_new_one(fake):
    """The batched layout returns y [L*M, H] viewed [L, M, H]: the plan keeps the view (shape,
    strides, offset) and a replay returns the same view of its own allocation."""

    @replay.replayable
    def path(x, w):
        y = torch.zeros(x.shape[0] * 2, x.shape[1])
        launcher.launch(fake.gemm, (1,), x, w, y, x.shape[0])
        return y[2:].view(x.shape[0] - 1, 2, x.shape[1]).transpose(0, 1)

    w = aligned(8)
    for _ in range(2):
        want = path(aligned(3, 5), w)
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Plan) and plan.out == ((2, ((2, 2, 5), (5, 10, 1), 10)),) and not plan.many
    fake.log.clear()
    out = path(aligned(3, 5), w)
    ((way, _, args),) = fake.log
    assert way == "direct" and out.data_ptr() == args[11] + 10 * 4
    assert (out.shape, out.stride(), out.dtype) == (want.shape, want.stride(), want.dtype)
    assert torch.equal(out, want)  # zeros both
    base = out._base if out._base is not None else out
    assert base.data_ptr() == args[11] and base.numel() == 30


def test_a_tuple_of_results_is_a_tuple_again(fake):
    """The batched dispatch returns (buffer, counts, rows, raw counts): two allocations and two
    rows of a third (unbind); a replay returns the same tuple of its own tensors, none of them
    in the scratch buffer."""

    @replay.replayable
    def path(x, w):
        buf = torch.empty(2, x.shape[0], x.shape[1])
        dest = torch.full((x.shape[0],), -1, dtype=torch.int64)
        raw, counts = torch.zeros(2, 4, dtype=torch.int32).unbind(0)
        scratch = torch.empty(7), torch.empty(3)
        launcher.launch(fake.gemm, (1,), x, w, buf, x.shape[0])
        launcher.launch(fake.sum, (1,), dest, counts, scratch[0], 2)
        launcher.launch(fake.sum, (1,), raw, scratch[1], x, 2)
        return buf, counts, dest, raw

    w = aligned(8)
    for _ in range(2):
        want = path(aligned(3, 5), w)
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Plan) and plan.many
    assert [index for index, _ in plan.out] == [2, 4, 3, 4] and plan.out[1][1] == ((4,), (1,), 4)
    assert plan.offsets == (-1, -1, -1, 0, 512)  # buf, dest, the zeros, then the scratch pair
    fake.log.clear()
    got = path(aligned(3, 5), w)
    assert type(got) is tuple and len(got) == 4
    for g, t in zip(got, want, strict=True):
        assert (g.shape, g.stride(), g.dtype) == (t.shape, t.stride(), t.dtype)
    (_, _, a1), (_, _, a2), (_, _, a3) = fake.log
    assert a1[11] == got[0].data_ptr() and a2[9:11] == (got[2].data_ptr(), got[1].data_ptr())
    assert a3[9] == got[3].data_ptr() == got[1].data_ptr() - 16
    assert torch.equal(got[2], torch.full((3,), -1)) and not got[1].any() and not got[3].any()


def test_a_result_from_elsewhere_is_refused(fake):
    """A result that is no argument, allocation or view of one (a tensor held outside the call)
    cannot be made again: refused, the full path every call."""
    held = aligned(4, 5)

    @replay.replayable
    def path(x, w):
        launcher.launch(fake.gemm, (1,), x, w, w, x.shape[0])
        return held[1:]

    w = aligned(8)
    for _ in range(3):
        out = path(aligned(3, 5), w)
    (plan,) = path.plans().values()
    assert isinstance(plan, replay.Refused) and "view of one" in plan.reason
    assert out.data_ptr() == held[1:].data_ptr()
