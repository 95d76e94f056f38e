"""Checks shared by the GPU test files: relative error that fails on NaN/Inf, a poisoned
allocator so an output element a kernel never writes shows up as NaN, and CUDA-graph capture."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rel_err(out, ref):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


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
