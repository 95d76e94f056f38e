"""Shared pytest setup: `cases.py` is importable from every test file (this folder is on
sys.path); tests marked `gpu` skip without CUDA; `no_kernel` makes any experts kernel fail;
without CUDA, Triton runs in its interpreter (TRITON_INTERPRET=1) for the whole session."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton interpreter is chosen when triton is first imported, and transformers (test_hf.py)
# imports triton at collection, before the interpreter test modules set this themselves.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_tile_caches():
    """Tile choices are memoized per process (`experts.memoized_tiles`); tests that monkeypatch
    the SM count or the device name must not see another test's choice."""
    from fusedmoe.backends.triton.experts import clear_tile_caches

    clear_tile_caches()
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """GPU tests compile `FusedMoE.forward` for many configurations in one session; without a
    reset they share its code object's cache and hit dynamo's recompile limit (8)."""
    if "gpu" in request.keywords:
        torch._dynamo.reset()
    yield


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


@pytest.fixture
def no_kernel(monkeypatch):
    """Replace every experts kernel by `raise AssertionError("kernel ran")`.

    Input errors must be raised by validation, before any compute: under this fixture an error
    that only a kernel would hit shows up as AssertionError instead of the expected one. Covers
    the cpu and torch backends and every other `Experts` implementation imported so far.
    """
    import fusedmoe.backends.cpu
    import fusedmoe.backends.torch_ref  # noqa: F401
    from fusedmoe.modular import Experts

    def kernel_ran(*args, **kwargs):
        raise AssertionError("kernel ran")

    for cls in _subclasses(Experts):
        if "apply" in vars(cls):
            monkeypatch.setattr(cls, "apply", kernel_ran)
