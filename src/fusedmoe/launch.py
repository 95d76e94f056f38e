"""A built-in launcher: run `fn(rank, world_size, *args)` in `world_size` processes that share a
fresh process group, and return what each rank returned. Bounded in time: a rank that hangs
(a collective some rank never joined) fails the launch instead of blocking it.

    results = launch(fn, 4, args=(...,), backend="gloo", timeout_s=60)   # [result of rank 0, ...]

gloo runs on the CPU; nccl needs one CUDA device per rank (rank r uses cuda:r). `torchrun`
users do not need this: they initialize the group themselves.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    """A rank raised, died or ran out of time; the message holds each failing rank's report."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, args: tuple, backend: str, port: int,
            out_dir: str, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.set_num_threads(1)  # N ranks on a few cores: oversubscription slows every collective
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise


def launch(fn: Callable, world_size: int, *, args: tuple = (), backend: str = "gloo",
           timeout_s: float = 120.0) -> list:
    """Run fn(rank, world_size, *args) on `world_size` fresh processes; their return values, by rank.

    fn must be importable by name (a module-level function) and return picklable values.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; expected 'gloo' or 'nccl'")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' with world_size={world_size} needs {world_size} CUDA "
                         f"devices, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="fusedmoe-launch-") as out_dir:
        ctx = mp.start_processes(
            _worker, args=(fn, world_size, args, backend, free_port(), out_dir, timeout_s),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        failure = None
        while True:
            try:
                if ctx.join(timeout=0.2):
                    break
            except mp.ProcessRaisedException as exc:  # a rank raised: stop the others
                failure = str(exc)
                break
            except mp.ProcessExitedException as exc:
                failure = str(exc)
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f} s"
                break
        if failure is not None:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
        reports = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            report = torch.load(path, weights_only=False) if os.path.exists(path) else None
            reports.append(report)
    if failure is not None or not all(r and r["ok"] for r in reports):
        lines = [f"launch of {world_size} {backend} ranks failed: {failure or 'a rank raised'}"]
        for rank, r in enumerate(reports):
            if r is None:
                lines.append(f"rank {rank}: no report (killed or hung)")
            elif not r["ok"]:
                lines.append(f"rank {rank}:\n{r['error']}")
        raise LaunchError("\n".join(lines))
    return [r["result"] for r in reports]
