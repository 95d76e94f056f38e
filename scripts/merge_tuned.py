"""Merge the entries of a tuned table (`fusedmoe tune --out DIR` on a GPU) into a packaged one.

    python scripts/merge_tuned.py NEW.json [--into TABLE.json] [--dry-run]

TABLE defaults to the packaged table of NEW's device (src/fusedmoe/backends/triton/tuned/<device>.json).
Both must be fusedmoe tables of one device and one Triton minor version (a plan tuned under
another Triton can regress: tuning.py's module docstring), every entry of NEW must parse
(`tuning.parse_table`, strict), and an entry replaces the one serving the same scheme, shape,
4-bit layout and token count (`tune.entry_key`). Prints what it replaced and added; the merged
table keeps TABLE's metadata but its date. Runs without a GPU.
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
from fusedmoe.tune import merge_entries  # noqa: E402


def _minor(version: str) -> list[str]:
    return str(version).split(".")[:2]


def merge(new_path: Path, into: Path | None = None, *, dry_run: bool = False) -> tuple[Path, list, list]:
    """Merge NEW into TABLE (module docstring); (TABLE's path, replaced keys, added keys)."""
    new = json.loads(new_path.read_text())
    parse_table(new, str(new_path))
    device = new.get("device")
    if not isinstance(device, str) or not device:
        raise ValueError(f"{new_path}: no device name")
    into = into or Path(PACKAGED) / device_file_name(device)
    old = json.loads(into.read_text()) if into.is_file() else {
        "format": FORMAT, "device": device, "triton": new.get("triton"), "torch": new.get("torch"), "entries": []}
    parse_table(old, str(into))
    if old.get("device") != device:
        raise ValueError(f"{new_path} was tuned on {device!r}, {into} is {old.get('device')!r}'s table")
    if _minor(old.get("triton", "")) != _minor(new.get("triton", "")):
        raise ValueError(f"{new_path} was tuned under Triton {new.get('triton')}, {into} holds Triton "
                         f"{old.get('triton')}'s plans: keep them apart")
    entries, replaced, added = merge_entries(old["entries"], new["entries"])
    if not dry_run:
        merged = {**old, "format": FORMAT, "date": time.strftime("%Y-%m-%d"), "entries": entries}
        into.write_text(json.dumps(merged, indent=1) + "\n")
    return into, replaced, added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path)
    parser.add_argument("--into", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    try:
        into, replaced, added = merge(args.new, args.into, dry_run=args.dry_run)
    except (OSError, ValueError) as exc:
        print(f"merge_tuned.py: {exc}", file=sys.stderr)
        return 2
    verb = "would merge" if args.dry_run else "merged"
    print(f"{verb} {len(replaced) + len(added)} entries into {into}: {len(replaced)} replaced, {len(added)} added")
    for what, keys in (("replaced", replaced), ("added", added)):
        for key in keys:
            print(f"  {what}: {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
