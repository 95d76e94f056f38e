"""Tuned tile tables: JSON files per device, written by `fusedmoe tune`, read as overrides.

    lookup(problem, device) -> (gemm1 tile, gemm2 tile) | None     (None: use the heuristic)

Files are `<device name>.json` in FUSEDMOE_TUNED_DIR (searched first) and in the packaged
`tuned/` folder. They are data only (json.load, never executed). Every entry is held to the same
validity predicate as the heuristic (`tiles.check_tile`); a file that does not parse, or was tuned
with another Triton major.minor, is reported once and ignored. Among the entries for a shape the
one with the nearest token count (in log2) wins, if it is within a factor of two.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from pathlib import Path

import torch

from fusedmoe import knobs
from fusedmoe.backends.triton.tiles import TileConfig, check_tile

logger = logging.getLogger("fusedmoe")
PACKAGED = Path(__file__).parent / "tuned"
FORMAT = 1


def device_file_name(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name).strip("_") + ".json"


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:  # pragma: no cover - the Triton backend needs it anyway
        return "none"


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def parse_table(data: object, source: str) -> dict[tuple, list[tuple[int, TileConfig, TileConfig]]]:
    """Validate a loaded table; returns {shape key: [(tokens, tile1, tile2), ...]}. Raises ValueError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{source}: not a fusedmoe tuned table (format {FORMAT})")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{source}: 'entries' must be a list")
    table: dict[tuple, list] = {}
    for i, e in enumerate(entries):
        try:
            dtype = getattr(torch, e["dtype"])
            key = (e["dtype"], int(e["experts"]), int(e["hidden"]), int(e["inter"]), int(e["top_k"]),
                   bool(e["gated"]))
            t1, t2 = TileConfig(*map(int, e["gemm1"])), TileConfig(*map(int, e["gemm2"]))
            tokens = int(e["tokens"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{source}: entry {i} is malformed ({exc!r})") from None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{source}: entry {i} has unknown dtype {e['dtype']!r}")
        for name, tile, operands, split in (("gemm1", t1, 2 if key[-1] else 1, True), ("gemm2", t2, 1, False)):
            reason = check_tile(tile, dtype=dtype, operands=operands, allow_split=split)
            if reason:
                raise ValueError(f"{source}: entry {i} {name} tile {tile} is invalid: {reason}")
        if t1.block_m != t2.block_m:
            raise ValueError(f"{source}: entry {i} has different block_m for the two GEMMs")
        table.setdefault(key, []).append((tokens, t1, t2))
    return table


@functools.cache
def _load(path: str, mtime: float) -> dict:
    del mtime  # cache key: a rewritten file is read again
    try:
        with open(path) as f:
            data = json.load(f)
        if _major_minor(str(data.get("triton", ""))) != _major_minor(_triton_version()):
            logger.info("fusedmoe: ignoring %s: tuned with Triton %s, running %s (re-run fusedmoe tune)",
                        path, data.get("triton"), _triton_version())
            return {}
        return parse_table(data, path)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        logger.warning("fusedmoe: ignoring tuned table %s: %s", path, exc)
        return {}


def _tables(device_name: str) -> list[dict]:
    folders = []
    if knobs.get("TUNED_DIR"):
        folders.append(Path(knobs.get("TUNED_DIR")))
    folders.append(PACKAGED)
    out = []
    for folder in folders:
        path = folder / device_file_name(device_name)
        if path.is_file():
            out.append(_load(str(path), path.stat().st_mtime))
    return out


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def lookup(problem, device: torch.device) -> tuple[TileConfig, TileConfig] | None:
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    key = (str(problem.dtype).replace("torch.", ""), problem.num_local_experts, problem.hidden,
           problem.inter, problem.top_k, problem.gated)
    tokens = max(1, problem.num_slots // max(1, problem.top_k))
    for table in _tables(_device_name(device)):
        found = nearest(table, key, tokens)
        if found is not None:
            return found
    return None


MAX_OCTAVES = 1.0  # an entry tuned at M serves M/2 .. 2M; farther off, the heuristic knows better


def nearest(table: dict, key: tuple, tokens: int) -> tuple[TileConfig, TileConfig] | None:
    """The entry for `key` nearest to `tokens` in log2 (ties: the smaller), within one octave."""
    entries = table.get(key)
    if not entries:
        return None
    distance = lambda e: abs(math.log2(e[0]) - math.log2(tokens))  # noqa: E731
    best = min(entries, key=lambda e: (distance(e), e[0]))
    if distance(best) > MAX_OCTAVES:
        return None
    return best[1], best[2]
