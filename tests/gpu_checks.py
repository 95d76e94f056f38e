"""Checks shared by the GPU test files: relative error that fails on NaN/Inf, and a poisoned
allocator so an output element a kernel never writes shows up as NaN."""

from __future__ import annotations

import torch


def rel_err(out, ref):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poison_allocator(nbytes: int = 1 << 28) -> None:
    """Fill freed cache blocks with NaN so an output element the kernel never writes shows up."""
    torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
