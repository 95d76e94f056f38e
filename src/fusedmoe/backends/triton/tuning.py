"""Tuned tile tables: JSON files per device, written by `fusedmoe tune`, read as overrides.

    lookup(problem, device, scheme) -> (gemm1 tile, gemm2 tile) | None   (None: the heuristic)
    lookup_plan(problem, device, scheme) -> Tuned | None                  (the timed path's entry)

Files are `<device name>.json` in FUSEDMOE_TUNED_DIR (searched first; where it holds an entry for
the shape without a path, the rule decides the path, not a later table's entry naming one) and in
the packaged `tuned/` folder (FUSEDMOE_TUNED_PACKAGED=0: not read, so the heuristic can be A/B'd where the
packaged tables have entries). They are data only (json.load, never executed). An entry names its shape, its
activation dtype and its quantization scheme ("quant", absent = unquantized; format 1 tables
have none), and serves that scheme only. An entry's "path" (format 3) says which path its tiles
run and that the tuner timed both there: "aligned" (align + gemm1 + gemm2 + reduce) or "direct"
(the decode path: gemm1 by slot + gemm2 with the top-k sum, `experts.direct_reason`); without
it (formats 1 and 2) the tiles are the aligned path's and the path is left to the rule. Every
entry is held to the same validity predicate as the heuristic (`tiles.check_plan` with the
scheme's `tile_mode`): an invalid entry is reported once and ignored; a file that does not
parse, or was tuned with another Triton major.minor, is reported once and ignored whole. Among
the entries for a shape the one with the nearest token count (in log2) wins, if it is within a
factor of two. Where this GPU's tables have none for the shape, a sibling scheme's entries
(SCHEME_SIBLINGS: per-tensor fp8 runs per-channel fp8's kernels, its aligned ones; asymmetric
int4 symmetric int4's, both paths) and a sibling GPU's (SIBLINGS:
the same architecture, SM count, shared memory and L2) serve (FUSEDMOE_TUNED_SIBLINGS=0: not).
A 4-bit weight-only entry's "layout" ("fragments" / "checkpoint"; absent: the layout tables
before the field were tuned on, `weight_only.unnamed_entry_layout`) says which weight layout it was timed on, and it
serves only weights in that layout (`weight_only.w4_layout`): H200, int4 g32 laid as fragments
(FUSEDMOE_TRITON_W4_FRAGMENTS=all) ran Mixtral M=256 in 825 us on the checkpoint layout's entry
and 652 on the heuristic's plan for fragments
(results/2026-11-29_h200_69f18ef_check_int4_layout_fuzz.txt).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from pathlib import Path
from typing import NamedTuple

import torch

from fusedmoe import knobs
from fusedmoe.backends.triton.tiles import TileConfig, check_plan, tile_mode
from fusedmoe.quant.scheme import get_scheme

logger = logging.getLogger("fusedmoe")
PACKAGED = Path(__file__).parent / "tuned"
# 2: entries may carry "quant" (a reader of format 1 would take them for bf16 tiles); 3: "path"
# (a reader of format 2 would take a direct entry's tiles for the aligned path's)
FORMAT = 3
READ_FORMATS = (1, 2, 3)
PATHS = ("aligned", "direct")
ALL_PATHS = (*PATHS, None)  # None: a format 1-2 entry's, the aligned path's tiles with no path timed


class Tuned(NamedTuple):
    """One entry: its token count, tiles, and path ("aligned" / "direct"; None: the aligned
    path's tiles from a table that timed no other path)."""

    tokens: int
    gemm1: TileConfig
    gemm2: TileConfig
    path: str | None = None
    borrowed: str | None = None  # where it came from if not this GPU's entries for this scheme: a sibling
    # GPU's table (SIBLINGS), or "<device> (<scheme>)" for a sibling scheme's entry (SCHEME_SIBLINGS)
    layout: str | None = None  # 4-bit weight-only entries: the weights' layout it was timed on

    @property
    def direct(self) -> bool:
        return self.path == "direct"

    @property
    def source(self) -> str:
        """The table it came from, for `fusedmoe explain`: "tuned table" or "tuned table of <borrowed>"."""
        return "tuned table" if self.borrowed is None else f"tuned table of {self.borrowed}"


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


def parse_table(data: object, source: str, *, strict: bool = True
                ) -> dict[tuple, list[Tuned]]:
    """Validate a loaded table; returns {shape key: [Tuned, ...]}.

    Shape key: (dtype, experts, hidden, inter, top_k, gated, scheme name or None). Raises
    ValueError for a file that is not a table; for an invalid entry too when `strict`, else logs
    a warning and skips it.
    """
    if not isinstance(data, dict) or data.get("format") not in READ_FORMATS:
        raise ValueError(f"{source}: not a fusedmoe tuned table (format {' or '.join(map(str, READ_FORMATS))})")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{source}: 'entries' must be a list")
    table: dict[tuple, list[Tuned]] = {}
    for i, e in enumerate(entries):
        try:
            key, tuned = _parse_entry(e)
        except ValueError as exc:
            if strict:
                raise ValueError(f"{source}: entry {i} {exc}") from None
            logger.warning("fusedmoe: ignoring entry %d of tuned table %s: %s", i, source, exc)
            continue
        table.setdefault(key, []).append(tuned)
    return table


# Names resolved from a fixed table: a file never picks which torch attribute is looked up.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _int(value: object) -> int:
    # JSON integers only: 1e400 parses as inf (int() overflows), 1.5 or true are not sizes.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _tile(values: object) -> TileConfig:
    # 5 or 6 integers (split_k defaults to 1), then an optional true/false/null swap_ab, then an
    # optional group_m, then an optional true/false persistent, then an optional true/false
    # one_dot (TileConfig.as_list)
    if not isinstance(values, list) or not 5 <= len(values) <= 10:
        raise TypeError(f"{values!r} is not a tile list of 5-10 values")
    swap = values[6] if len(values) >= 7 else None
    if swap is not None and not isinstance(swap, bool):
        raise TypeError(f"swap_ab={swap!r} is not true/false")
    extra = {"group_m": _int(values[7])} if len(values) >= 8 else {}
    for i, name in ((8, "persistent"), (9, "one_dot")):
        if len(values) > i:
            if not isinstance(values[i], bool):
                raise TypeError(f"{name}={values[i]!r} is not true/false")
            extra[name] = values[i]
    return TileConfig(*map(_int, values[:6]), swap_ab=swap, **extra)


def _parse_entry(e: object) -> tuple[tuple, Tuned]:
    try:
        dtype = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        quant = e.get("quant")
        path = e.get("path")
        if not isinstance(e["gated"], bool):
            raise TypeError(f"gated={e['gated']!r} is not true/false")
        key = (e["dtype"], _int(e["experts"]), _int(e["hidden"]), _int(e["inter"]), _int(e["top_k"]),
               e["gated"])
        t1, t2 = _tile(e["gemm1"]), _tile(e["gemm2"])
        tokens = _int(e["tokens"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"is malformed ({exc!r})") from None
    if dtype is None:
        raise ValueError(f"has unknown dtype {e['dtype']!r} (expected one of {sorted(DTYPES)})")
    if tokens < 1:
        raise ValueError(f"has tokens={tokens} (must be >= 1)")
    if not isinstance(quant, str | None):
        raise ValueError(f"has quant={quant!r} (a scheme name, or absent for unquantized)")
    if path is not None and path not in PATHS:
        raise ValueError(f"has path={path!r} (one of {', '.join(PATHS)}, or absent)")
    try:
        scheme = get_scheme(quant)
        mode, group = tile_mode(scheme)
    except ValueError as exc:
        raise ValueError(f"has quant={quant!r}: {exc}") from None
    key += (None if scheme is None else scheme.name,)
    layout = entry_layout(e.get("layout"), scheme, *key[2:4], key[5])
    reason = check_plan(t1, t2, direct=path == "direct", dtype=dtype, gated=key[5], quant=mode, group=group,
                        running=None if scheme is None else scheme.name)
    if reason:
        raise ValueError(f"is invalid: {reason}")
    return key, Tuned(tokens, t1, t2, path, layout=layout)


def entry_layout(given: object, scheme, hidden: int, inter: int, gated: bool) -> str | None:
    """An entry's 4-bit weight layout: its "layout" ("fragments" / "checkpoint"), or where it
    names none (tables before it did) the layout such entries were timed on (`unnamed_entry_layout`).
    None for every other scheme, which may not name one."""
    from fusedmoe.backends.triton.weight_only import W4_LAYOUTS, is_w4_scheme, unnamed_entry_layout

    if not is_w4_scheme(scheme):
        if given is not None:
            raise ValueError(f"has layout={given!r}, which only 4-bit weight-only entries name")
        return None
    if given is None:
        return unnamed_entry_layout(scheme, hidden, inter, gated)
    if given not in W4_LAYOUTS:
        raise ValueError(f"has layout={given!r} (one of {', '.join(W4_LAYOUTS)}, or absent)")
    return given


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
        return parse_table(data, path, strict=False)
    except (OSError, ValueError, AttributeError, TypeError, RecursionError) as exc:
        # RecursionError: json.load on deeply nested arrays ("[[[[..." 10^5 deep).
        logger.warning("fusedmoe: ignoring tuned table %s: %s", path, exc)
        return {}


def table_paths(device_name: str) -> list[Path]:
    """The tuned tables of `device_name` that exist, first served first: FUSEDMOE_TUNED_DIR's,
    then the packaged one (FUSEDMOE_TUNED_PACKAGED=0: not)."""
    folders = ([Path(knobs.get("TUNED_DIR"))] if knobs.get("TUNED_DIR") else []) \
        + ([] if knobs.get("TUNED_PACKAGED") is False else [PACKAGED])
    return [path for path in (folder / device_file_name(device_name) for folder in folders) if path.is_file()]


def _tables(device_name: str) -> list[dict]:
    return [_load(str(path), path.stat().st_mtime) for path in table_paths(device_name)]


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _key(problem, scheme) -> tuple:
    return (str(problem.dtype).replace("torch.", ""), problem.num_local_experts, problem.hidden,
            problem.inter, problem.top_k, problem.gated, None if scheme is None else scheme.name)


def _tokens(problem) -> int:
    return max(1, problem.num_slots // max(1, problem.top_k))


# Devices of one architecture, SM count, shared memory and L2 whose tables stand in for each
# other's missing entries: an H100 SXM runs a shape the H200 table was tuned for (and none of its
# own was) on the H200's tiles rather than the heuristic's. FUSEDMOE_TUNED_SIBLINGS=0: own only.
SIBLINGS = {
    "NVIDIA H100 80GB HBM3": ("NVIDIA H200",),
    "NVIDIA H200": ("NVIDIA H100 80GB HBM3",),
}


# Schemes whose GEMMs are another's kernels on the same codes, and the paths of that scheme's
# entries that serve them where they have no entry of their own (held to their own tile
# predicate): per-tensor fp8 runs the per-channel path with a per-row scale (be85264) and has no
# direct path, so fp8 per channel's aligned entries; H200, whole call, alternating
# (2026-11-24_h200_95fe0bd_fp8_tensor_borrowed_ab.txt): M=16-4096 -2 to -23%. Asymmetric int4
# runs symmetric int4's kernels with one more load a group (W_ZERO) on both paths, so its entries
# of either: at Mixtral M=1 as fragments the direct entry's 16x64x128 at 3 stages (5 programs an
# SM) where the rule's 16x64x256 at 4 stages with the zero points' buffers fits one.
SCHEME_SIBLINGS: dict[str, tuple[str, tuple]] = {
    "fp8_w8a8_tensor": ("fp8_w8a8_channel", ("aligned", None)),
    "fp8_w8a8_tensor_static": ("fp8_w8a8_channel", ("aligned", None)),
    **{f"int4_w4a16_g{g}_zp": (f"int4_w4a16_g{g}", ALL_PATHS) for g in (32, 64, 128)},
}


def _find(problem, device: torch.device, scheme, paths: tuple, first_decides: bool = False) -> Tuned | None:
    """The nearest entry on `paths` in this GPU's tables, first table first, else a sibling's.
    first_decides: a table with any entry for the shape ends the search (lookup_plan: a
    FUSEDMOE_TUNED_DIR entry without a path is not passed over for a later table's entry naming
    one)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    from fusedmoe.backends.triton.weight_only import w4_layout

    key, tokens, layout = _key(problem, scheme), _tokens(problem), w4_layout(problem, scheme)
    name = _device_name(device)
    own = _tables(name)
    for table in own:
        found = nearest_entry(table, key, tokens, paths, layout)
        if found is not None:
            return found
        if first_decides and nearest_entry(table, key, tokens, ALL_PATHS, layout) is not None:
            return None  # a path-less entry here: the rule decides the path, not a later table's entry
    # siblings' entries only for shapes this GPU / scheme has no entry of any path for: where it
    # has one (a path-less aligned entry, say), its own table and the rule decide, as without them
    if knobs.get("TUNED_SIBLINGS") is False or any(nearest_entry(t, key, tokens, ALL_PATHS, layout) for t in own):
        return None
    # this GPU's entries of a sibling scheme, then each sibling GPU's of this scheme and its sibling
    kin, kin_paths = None, ()
    if scheme is not None and scheme.name in SCHEME_SIBLINGS:
        twin, served = SCHEME_SIBLINGS[scheme.name]
        kin, kin_paths = key[:-1] + (twin,), tuple(p for p in paths if p in served)
    sources = [(name, kin, kin_paths)] if kin else []
    for sibling in SIBLINGS.get(name, ()):
        sources += [(sibling, key, paths)] + ([(sibling, kin, kin_paths)] if kin else [])
    for source, k, p in sources:
        for table in _tables(source):
            found = nearest_entry(table, k, tokens, p, layout)
            if found is not None and (k == key or _fits(found, problem, scheme)):
                return found._replace(borrowed=source if k == key else f"{source} ({k[-1]})")
    return None


def _fits(entry: Tuned, problem, scheme) -> bool:
    """Whether another scheme's entry is a valid plan for `scheme` (its tile predicate)."""
    mode, group = tile_mode(scheme)
    return check_plan(entry.gemm1, entry.gemm2, direct=entry.direct, dtype=problem.dtype, gated=problem.gated,
                      quant=mode, group=group, running=scheme.name) is None


def entry(problem, device: torch.device, scheme=None, path: str = "aligned") -> Tuned | None:
    """The tuned entry of `scheme` (a `QuantScheme`, None = unquantized) for this shape on `path`
    ("aligned": entries of that path or of none; "direct": the direct path's), or None."""
    return _find(problem, device, scheme, ("aligned", None) if path == "aligned" else (path,))


def lookup(problem, device: torch.device, scheme=None, path: str = "aligned") -> tuple[TileConfig, TileConfig] | None:
    """`entry`'s tiles (gemm1, gemm2), or None: the heuristic."""
    found = entry(problem, device, scheme, path)
    return None if found is None else (found.gemm1, found.gemm2)


def lookup_plan(problem, device: torch.device, scheme=None) -> Tuned | None:
    """The nearest entry whose tuner timed both paths (it names its path), or None: the path is
    then the rule's (`experts.direct_wanted`). A direct entry decides no larger token count than
    its own (a direct GEMM2 program streams every slot of its token: more tokens, more repeats)."""
    found = _find(problem, device, scheme, PATHS, first_decides=True)
    if found is None or found.direct and _tokens(problem) > found.tokens:
        return None
    return found


MAX_OCTAVES = 1.0  # an entry tuned at M serves M/2 .. 2M; farther off, the heuristic knows better


def nearest_entry(table: dict, key: tuple, tokens: int, paths: tuple = ALL_PATHS,
                  layout: str | None = None) -> Tuned | None:
    """The entry for `key` on one of `paths` (and, given one, timed on the 4-bit weight `layout`)
    nearest to `tokens` in log2 (ties: the smaller), within one octave."""
    entries = [e for e in table.get(key, ()) if e.path in paths and (layout is None or e.layout == layout)]
    if not entries:
        return None
    distance = lambda e: abs(math.log2(e.tokens) - math.log2(tokens))  # noqa: E731
    best = min(entries, key=lambda e: (distance(e), e.tokens))
    if distance(best) > MAX_OCTAVES:
        return None
    return best


def nearest(table: dict, key: tuple, tokens: int) -> tuple[TileConfig, TileConfig] | None:
    """The aligned path's tiles of `nearest_entry`."""
    found = nearest_entry(table, key, tokens, ("aligned", None))
    return None if found is None else (found.gemm1, found.gemm2)
