"""A/B of two source trees in one GPU session: a command run alternately against an old tree's
`src/` and this one's, so clock drift shows as spread, not as a difference between the trees.

    python benchmarks/ab_trees.py prepare --rev fb2ab66            # here: .ab/fb2ab66/src (git archive)
    # on the device (carry: [".ab"]):
    python benchmarks/ab_trees.py run --old .ab/fb2ab66/src --rounds 2 -- \
        python -m fusedmoe bench --quant mxfp4_w4a16 --presets deepseek-v3 --tokens 16,64 --backends triton

`run` sets PYTHONPATH to each tree's src in turn (old, new, old, new, ...) and prints every
run's output under a "== old round 1" / "== new round 1" header; a command that writes files
should name them by `$AB_SIDE` and `$AB_ROUND` (exported to it). The benchmark scripts run from
this tree either way: the trees differ in the library only. `.ab/` is git-ignored.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare(rev: str, folder: Path) -> Path:
    """`src/` of git revision `rev` unpacked under folder (default .ab/<rev>); returns its src."""
    folder = folder or ROOT / ".ab" / rev
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        try:
            tar.extractall(folder, filter="data")
        except TypeError:  # Python before the extraction filters (git's own archive: trusted)
            tar.extractall(folder)  # noqa: S202
    return folder / "src"


def run(old: Path, new: Path, rounds: int, command: list[str]) -> int:
    """The command against old and new alternately, `rounds` times each; the worst return code."""
    for tree in (old, new):
        if not (tree / "fusedmoe" / "__init__.py").is_file():
            raise SystemExit(f"{tree} holds no fusedmoe package (a tree's src/, e.g. from `prepare`)")
    worst = 0
    for i in range(1, rounds + 1):
        for side, tree in (("old", old), ("new", new)):
            env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "AB_SIDE": side, "AB_ROUND": str(i)}
            print(f"== {side} round {i} ({tree})", flush=True)
            worst = max(worst, subprocess.run(command, env=env).returncode)
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="action", required=True)
    p = sub.add_parser("prepare", help="unpack a revision's src/ under .ab/<rev>")
    p.add_argument("--rev", required=True)
    p.add_argument("--dir", type=Path, default=None)
    r = sub.add_parser("run", help="run a command against the old tree and this one, alternately")
    r.add_argument("--old", type=Path, required=True, help="the old tree's src/ (from prepare)")
    r.add_argument("--new", type=Path, default=ROOT / "src")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args(argv)
    if args.action == "prepare":
        print(prepare(args.rev, args.dir))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("run: give the command after --")
    return run(args.old, args.new, args.rounds, command)


if __name__ == "__main__":
    sys.exit(main())
