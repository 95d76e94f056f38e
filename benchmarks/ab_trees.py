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

    python benchmarks/ab_trees.py summarize log.txt     # old / new per cell from such a log

`summarize` reads the rows of `fusedmoe bench` tables and of `bench_gemm_tiles.py` under those
headers (other lines are skipped) and prints, per cell, the best time of each side over its
rounds, the change, and each side's spread (max - min) over rounds.
"""

from __future__ import annotations

import argparse
import io
import os
import re
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


_HEADER = re.compile(r"== (old|new) round \d+")
# the scheme a run times: fusedmoe bench's "...; triton runs <scheme>", bench_gemm_tiles' "<gpu>; torch ..; <scheme>"
_SCHEME = re.compile(r"triton runs (\S+)$|; torch [^;]+; (\S+)$")
# fusedmoe bench: preset backend M E_act us TFLOP/s GB/s %roof ...
_BENCH = re.compile(r"^(\S+)\s+(\S+)\s+(\d+)\s+\d+\s+([\d.]+)\s+[\d.]+\s+\d+\s+[\d.]+\s")
# bench_gemm_tiles.py: preset M=.. H=.. I=.. gemmN tile  a /  b us
_TILES = re.compile(r"^(\S+)\s+M=(\d+)\s+H=\d+\s+I=\d+\s+(gemm\d)\s+(\S+(?: P=\d+)?)\s+([\d.]+) /\s+([\d.]+) us")


def parse_log(text: str) -> dict[tuple, dict[str, list[float]]]:
    """{cell: {"old": [us, ...], "new": [...]}} from a `run` log: a `fusedmoe bench` row's cell
    is (scheme, preset, backend, M), a `bench_gemm_tiles.py` row's (scheme, preset, M, gemm,
    tile) with the better of its two timings; the scheme from the run's own header line (else
    "-"). A header may follow other output on its line."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    side = scheme = None
    for line in text.splitlines():
        header = _HEADER.search(line)
        if header:
            side, scheme = header[1], "-"
            continue
        if side is None:
            continue
        named = _SCHEME.search(line)
        if named:
            scheme = named[1] or named[2]
            continue
        m = _TILES.match(line)
        if m:
            cell = (scheme, m[1], int(m[2]), m[3], m[4])
            cells.setdefault(cell, {}).setdefault(side, []).append(min(float(m[5]), float(m[6])))
            continue
        m = _BENCH.match(line)
        if m and m[1] != "preset":
            cells.setdefault((scheme, m[1], m[2], int(m[3])), {}).setdefault(side, []).append(float(m[4]))
    return cells


def summarize(text: str) -> str:
    """`parse_log`'s cells with both sides as lines: cell, best old / new (us), change, spreads."""
    lines = []
    for cell, sides in parse_log(text).items():
        if set(sides) != {"old", "new"}:
            continue
        old, new = min(sides["old"]), min(sides["new"])
        spread = [max(v) - min(v) for v in (sides["old"], sides["new"])]
        lines.append(f"{' '.join(map(str, cell)):64} old {old:8.1f} new {new:8.1f} {(new / old - 1) * 100:+6.1f}%"
                     f"  spread {spread[0]:5.1f} / {spread[1]:5.1f}")
    return "\n".join(lines)


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
    m = sub.add_parser("summarize", help="old / new per cell of a run's log")
    m.add_argument("log", type=Path)
    args = ap.parse_args(argv)
    if args.action == "prepare":
        print(prepare(args.rev, args.dir))
        return 0
    if args.action == "summarize":
        print(summarize(args.log.read_text()))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("run: give the command after --")
    return run(args.old, args.new, args.rounds, command)


if __name__ == "__main__":
    sys.exit(main())
