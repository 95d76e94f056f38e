"""Checks shared by the GPU test files: relative error that fails on NaN/Inf, a poisoned
allocator so an output element a kernel never writes shows up as NaN, and CUDA-graph capture."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rel_err(out, ref):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# row_err bound as a multiple of a test's whole-tensor tolerance: one row's error spreads around
# the tensor's (rounding and quantization noise is per element), a wrong row reads ~1
ROW_FACTOR = 4.0


def row_err(out, ref) -> float:
    """The largest relative error of one row (token): a whole-tensor `rel_err` lets one wrong row
    of T hide under ~sqrt(2 / T) (0.06 at T = 512). Rows whose reference is below 1e-3 of the
    median row norm are measured against that floor instead of their own norm."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.numel() == 0:
        return 0.0
    diff = (out.double() - ref.double()).reshape(out.shape[0], -1).norm(dim=1)
    norm = ref.double().reshape(ref.shape[0], -1).norm(dim=1)
    floor = norm.median() * 1e-3
    return (diff / norm.clamp(min=floor.item() or 1e-30)).max().item()


def close(out, ref, tol: float) -> None:
    """Whole-tensor relative error within tol, and the worst row (token) within ROW_FACTOR * tol."""
    assert rel_err(out, ref) < tol
    assert row_err(out, ref) < ROW_FACTOR * tol


def poison_allocator(nbytes: int = 1 << 28) -> None:
    """Fill freed cache blocks with NaN so an output element the kernel never writes shows up."""
    torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its static output) of fn(): one warm-up call on a side stream (Triton JIT, tile
    lookup) outside the capture, then fn() captured. Replay with graph.replay()."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replayed(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """fn() captured in a CUDA graph (`capture`) and replayed once: the static output after it."""
    graph, out = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    return out


def replay_on_new_inputs(run: Callable[[], torch.Tensor], x, w, ids, num_experts: int,
                         want: Callable[[], torch.Tensor], tol: float) -> None:
    """`run()` captured, its inputs changed in place (routing redrawn, x doubled: dynamic scales
    follow the data), replayed: the static output `close` to `want()` on the new inputs (a graph
    that baked in a captured value fails here, not in a replay on the captured inputs)."""
    from fusedmoe import select_experts

    graph, static_out = capture(run)
    new_w, new_ids = select_experts(x, torch.randn(x.shape[0], num_experts, device=x.device), ids.shape[1])
    w.copy_(new_w)
    ids.copy_(new_ids)
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    close(static_out, want(), tol)
