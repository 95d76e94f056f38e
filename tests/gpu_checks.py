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
