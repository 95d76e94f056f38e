"""Merge the entries of a tuned table (`fusedmoe tune --out DIR` on a GPU) into a packaged one,
or drop entries from one.

    python scripts/merge_tuned.py NEW.json [--into TABLE.json] [--dry-run]
    python scripts/merge_tuned.py [NEW.json] --drop QUANT:PRESET:TOKENS [--drop ...] [--into TABLE.json]

TABLE defaults to the packaged table of NEW's device (src/fusedmoe/backends/triton/tuned/<device>.json;
without NEW, NVIDIA H200's). Both must be fusedmoe tables of one device and one Triton minor
version (a plan tuned under another Triton can regress: tuning.py's module docstring), every
entry of NEW must parse (`tuning.parse_table`, strict), and an entry replaces the one serving the
same scheme, shape, 4-bit layout and token count (`tune.entry_key`). --drop removes the entries
of scheme QUANT ("bf16": unquantized) at the preset's benchmark shape (`fusedmoe bench`: E, H,
I / its bench TP, top_k) and exactly TOKENS, every dtype and layout: an entry a GPU A/B found no
faster than the rule it overrides (a table serves its entries over the rule, so a tie can only go
by dropping it). A spec that matches nothing is an error. Drops apply before NEW's merge. Prints
what it dropped, replaced and added; the table keeps its metadata but its date. Runs without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fusedmoe.backends.triton.tuning import FORMAT, PACKAGED, device_file_name, parse_table  # noqa: E402
from fusedmoe.tune import entry_key, merge_entries  # noqa: E402


def _minor(version: str) -> list[str]:
    return str(version).split(".")[:2]


def _drop_matcher(spec: str):
    """QUANT:PRESET:TOKENS -> a predicate on table entries (module docstring)."""
    from fusedmoe.bench import preset_shapes
    from fusedmoe.quant.scheme import SCHEMES

    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"--drop {spec!r}: expected QUANT:PRESET:TOKENS")
    quant, preset, tokens = parts
    if quant != "bf16" and quant not in SCHEMES:
        raise ValueError(f"--drop {spec!r}: unknown scheme {quant!r} (bf16 or one of {sorted(SCHEMES)})")
    if not tokens.isdigit() or int(tokens) < 1:
        raise ValueError(f"--drop {spec!r}: TOKENS must be a positive integer, got {tokens!r}")
    try:
        experts, top_k, hidden, inter, _ = preset_shapes(preset)[preset]
    except ValueError as exc:
        raise ValueError(f"--drop {spec!r}: {exc}") from None
    want = ("" if quant == "bf16" else quant, experts, hidden, inter, top_k, int(tokens))
    return lambda e: (e.get("quant") or "", e["experts"], e["hidden"], e["inter"], e["top_k"], e["tokens"]) == want


def merge(new_path: Path | None, into: Path | None = None, *, dry_run: bool = False,
          drop: tuple[str, ...] = ()) -> tuple[Path, list, list, list]:
    """Drop DROP's entries from TABLE, then merge NEW into it (module docstring); (TABLE's path,
    dropped keys, replaced keys, added keys)."""
    if new_path is None and not drop:
        raise ValueError("nothing to do: give NEW.json, --drop, or both")
    new = None
    device = "NVIDIA H200"
    if new_path is not None:
        new = json.loads(new_path.read_text())
        parse_table(new, str(new_path))
        device = new.get("device")
        if not isinstance(device, str) or not device:
            raise ValueError(f"{new_path}: no device name")
    into = into or Path(PACKAGED) / device_file_name(device)
    if new is None and not into.is_file():
        raise ValueError(f"{into}: no such table to drop entries from")
    old = json.loads(into.read_text()) if into.is_file() else {
        "format": FORMAT, "device": device, "triton": new.get("triton"), "torch": new.get("torch"), "entries": []}
    parse_table(old, str(into))
    if new is not None:
        if old.get("device") != device:
            raise ValueError(f"{new_path} was tuned on {device!r}, {into} is {old.get('device')!r}'s table")
        if _minor(old.get("triton", "")) != _minor(new.get("triton", "")):
            raise ValueError(f"{new_path} was tuned under Triton {new.get('triton')}, {into} holds Triton "
                             f"{old.get('triton')}'s plans: keep them apart")
    entries, dropped = old["entries"], []
    for spec in drop:
        matches = _drop_matcher(spec)
        hit = [e for e in entries if matches(e)]
        if not hit:
            raise ValueError(f"--drop {spec!r}: no entry of {into} serves it")
        dropped += [entry_key(e) for e in hit]
        entries = [e for e in entries if not matches(e)]
    entries, replaced, added = merge_entries(entries, new["entries"] if new is not None else [])
    if not dry_run:
        merged = {**old, "format": FORMAT, "date": time.strftime("%Y-%m-%d"), "entries": entries}
        into.write_text(json.dumps(merged, indent=1) + "\n")
    return into, dropped, replaced, added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path, nargs="?", default=None)
    parser.add_argument("--into", type=Path, default=None)
    parser.add_argument("--drop", action="append", default=[], metavar="QUANT:PRESET:TOKENS")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    try:
        into, dropped, replaced, added = merge(args.new, args.into, dry_run=args.dry_run, drop=tuple(args.drop))
    except (OSError, ValueError) as exc:
        print(f"merge_tuned.py: {exc}", file=sys.stderr)
        return 2
    verb = "would merge" if args.dry_run else "merged"
    print(f"{verb} {len(replaced) + len(added)} entries into {into}: {len(replaced)} replaced, {len(added)} added"
          + (f", {len(dropped)} dropped" if dropped else ""))
    for what, keys in (("dropped", dropped), ("replaced", replaced), ("added", added)):
        for key in keys:
            print(f"  {what}: {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
