"""scripts/gpu_check.sh, the routine GPU check of a kernel change, on a machine without CUDA: it
says which step failed and why, and exits nonzero (the GPU run itself is the device machine's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TEST_GPU = ROOT / "scripts" / "test_gpu.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script's failure paths without CUDA")


def run(tmp_path: Path, *steps: str, **env: str) -> subprocess.CompletedProcess:
    # the script runs `python`: the interpreter running these tests, first on PATH
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(["bash", str(SCRIPT), *steps], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path, "OUT": str(tmp_path), **env})


def test_each_step_says_how_it_ended_and_a_failure_is_the_exit_status(tmp_path):
    done = run(tmp_path, "env", "bench", QUANTS="none,mxfp4_w4a16", PRESETS="qwen3-30b-a3b", TOKENS="1")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary == ["env: failed (exit 1)", "bench none: failed (exit 2)", "bench mxfp4_w4a16: failed (exit 2)"]
    assert "torch sees no CUDA device" in (tmp_path / "env.txt").read_text()
    bench = (tmp_path / "bench_mxfp4_w4a16.txt").read_text()
    assert "--quant mxfp4_w4a16" in bench and "--presets qwen3-30b-a3b" in bench and "needs a CUDA device" in bench


def test_a_passing_step_leaves_the_exit_status_zero(tmp_path):
    done = run(tmp_path, "tests", TESTS="tests/test_gpu_wo.py -k wide_fragment_plan")  # GPU tests: skipped here
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "summary.txt").read_text() == "tests: ok\n"
    assert "skipped" in done.stdout and "deselected" in done.stdout  # the phase's summary line is printed


def test_tests_split_as_a_shell_line_quotes_included(tmp_path):
    # a -k expression with spaces is one argument; without the quotes' handling pytest would read
    # "'wide_fragment_plan" as a file and fail
    done = run(tmp_path, "tests", TESTS="tests/test_gpu_wo.py -k 'wide_fragment_plan and not no_such_test'")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped" in done.stdout and "deselected" in done.stdout
    refused = tmp_path / "refused"
    done = run(refused, "env", "tests", TESTS="tests/test_gpu_wo.py -k 'not w8a8")
    assert done.returncode == 2 and "TESTS does not split into words" in done.stderr
    assert not (refused / "summary.txt").exists()  # refused before env ran


def test_an_unknown_step_is_refused_before_any_runs(tmp_path):
    done = run(tmp_path, "env", "benchmark")
    assert done.returncode == 2 and "unknown step 'benchmark'" in done.stderr
    assert not (tmp_path / "summary.txt").exists()


def test_the_gpu_tests_run_by_phase(tmp_path):
    """scripts/test_gpu.sh's PHASES: each phase its own marker (here without xdist: one serial run
    a phase), a phase that collects nothing is no failure, and an unknown phase is refused before
    any test runs."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    def gpu_tests(phases: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(TEST_GPU), "tests/test_gpu_check_script.py"], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PATH": path, "PHASES": phases})

    marks = {"small": ["gpu and not bigmem"], "big": ["gpu and bigmem"], "small big": ["gpu"],
             "big small": ["gpu and bigmem", "gpu and not bigmem"]}
    for phases, want in marks.items():
        done = gpu_tests(phases)
        assert done.returncode == 0, (phases, done.stdout + done.stderr)
        assert [line.split("-m ")[1].strip("'") for line in done.stdout.splitlines()
                if line.startswith("test_gpu.sh: -m")] == want, (phases, done.stdout)
        assert done.stdout.count("deselected") == len(want), (phases, done.stdout)  # no GPU test in this file
    bad = gpu_tests("small huge")
    assert bad.returncode == 2 and "unknown phase 'huge'" in bad.stderr and "deselected" not in bad.stdout


def test_retune_tunes_each_cell_and_refuses_bad_cells_before_any_run(tmp_path):
    """The retune step: each CELLS entry tuned (here without CUDA: the tuner refuses, the step says
    so and the exit status is 1, and with no table written no bench runs); CELLS missing or not
    QUANT:PRESET:M is refused before any step runs."""
    done = run(tmp_path, "retune", CELLS="mxfp4_w4a16:qwen3-30b-a3b:256 none:mixtral-8x7b:16")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (tmp_path / "summary.txt").read_text().splitlines() == [
        "tune mxfp4_w4a16:qwen3-30b-a3b:256: failed (exit 2)", "tune none:mixtral-8x7b:16: failed (exit 2)",
        "retune: ok: nothing written"]
    log = (tmp_path / "retune.txt").read_text()
    assert "needs a CUDA device" in log and "round 1" not in log
    out = tmp_path / "with_table"  # a table there (as a GPU tune would leave): the bench rounds run
    (out / "tuned").mkdir(parents=True)
    (out / "tuned" / "NVIDIA_H200.json").write_text("{}")
    done = run(out, "retune", CELLS="mxfp4_w4a16:qwen3-30b-a3b:256", ROUNDS="1")
    assert done.returncode == 1
    assert (out / "summary.txt").read_text().splitlines()[1:] == [
        "bench round 1 packaged mxfp4_w4a16:qwen3-30b-a3b:256: failed (exit 2)",
        "bench round 1 tuned mxfp4_w4a16:qwen3-30b-a3b:256: failed (exit 2)", "retune: failed (a bench run above)"]
    assert "mxfp4_w4a16:qwen3-30b-a3b:256: packaged - us; tuned - us" in (out / "retune_summary.txt").read_text()
    # the rounds' JSON files in one archive (a machine may send back few files): the table, the
    # logs and the archive are all that is left
    assert sorted(p.name for p in out.iterdir()) == ["retune.txt", "retune_runs.tgz", "retune_summary.txt",
                                                     "summary.txt", "tuned"]
    for cells, why in ((None, "retune needs CELLS"), ("mxfp4_w4a16:qwen3-30b-a3b", "is not QUANT:PRESET:M")):
        out = tmp_path / f"bad{len(why)}"
        env = {} if cells is None else {"CELLS": cells}
        bad = run(out, "env", "retune", **env)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr
        assert not (out / "summary.txt").exists()  # refused before the env step ran


def test_knob_times_each_value_per_cell_and_refuses_bad_settings_before_any_run(tmp_path):
    """The knob step: one bench process per cell, value and round, the knob's variable set to the
    value (or removed for unset), the values' order reversed every other round, the first round
    --check'ed unless KNOB_CHECK=0; without CUDA every run fails and the summary says which, with
    no times. KNOB, CELLS and VALUES malformed are refused before any step runs."""
    done = run(tmp_path, "knob", KNOB="PDL", VALUES="unset 0", ROUNDS="2",
               CELLS="fp8_w8a8_block:qwen3-30b-a3b:1 none:gpt-oss-120b,qwen3-30b-a3b:1,4")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    ran = [line.split(": failed")[0] for line in summary[:-1]]
    assert ran == ["bench round 1 FUSEDMOE_PDL=unset fp8_w8a8_block:qwen3-30b-a3b:1",
                   "bench round 1 FUSEDMOE_PDL=0 fp8_w8a8_block:qwen3-30b-a3b:1",
                   "bench round 1 FUSEDMOE_PDL=unset none:gpt-oss-120b,qwen3-30b-a3b:1,4",
                   "bench round 1 FUSEDMOE_PDL=0 none:gpt-oss-120b,qwen3-30b-a3b:1,4",
                   "bench round 2 FUSEDMOE_PDL=0 fp8_w8a8_block:qwen3-30b-a3b:1",
                   "bench round 2 FUSEDMOE_PDL=unset fp8_w8a8_block:qwen3-30b-a3b:1",
                   "bench round 2 FUSEDMOE_PDL=0 none:gpt-oss-120b,qwen3-30b-a3b:1,4",
                   "bench round 2 FUSEDMOE_PDL=unset none:gpt-oss-120b,qwen3-30b-a3b:1,4"]
    assert summary[-1] == "knob PDL: failed (a bench run above)"
    log = (tmp_path / "knob.txt").read_text()
    assert log.count("needs a CUDA device") == 8
    assert (tmp_path / "knob_summary.txt").read_text().splitlines() == [
        "== fp8_w8a8_block:qwen3-30b-a3b:1 (FUSEDMOE_PDL)",
        "fp8_w8a8_block qwen3-30b-a3b M=1: unset - us; 0 - us",
        "== none:gpt-oss-120b,qwen3-30b-a3b:1,4 (FUSEDMOE_PDL)",
        *(f"none {p} M={m}: unset - us; 0 - us" for p in ("gpt-oss-120b", "qwen3-30b-a3b") for m in (1, 4))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["knob.txt", "knob_runs.tgz", "knob_summary.txt",
                                                          "summary.txt"]
    for env, why in (({"CELLS": "none:qwen3-30b-a3b:1"}, "knob needs KNOB=NAME"),
                     ({"KNOB": "pdl", "CELLS": "none:qwen3-30b-a3b:1"}, "knob needs KNOB=NAME"),
                     ({"KNOB": "PDL"}, "knob needs CELLS"),
                     ({"KNOB": "PDL", "CELLS": "none:qwen3-30b-a3b"}, "is not QUANT:PRESETS:TOKENS"),
                     ({"KNOB": "PDL", "CELLS": "none:qwen3-30b-a3b:1", "VALUES": "1 $(x)"}, "is not a plain word")):
        out = tmp_path / f"bad{len(os.listdir(tmp_path))}"
        bad = run(out, "env", "knob", **env)
        assert bad.returncode == 2 and why in bad.stderr, (env, bad.stderr)
        assert not (out / "summary.txt").exists()  # refused before the env step ran


def test_ncu_profiles_each_cell_through_profile_kernels(tmp_path):
    """The ncu step: ncu (here a stand-in that prints its arguments and runs the command) of
    benchmarks/profile_kernels.py --profile-runs for each cell, each report in its own file; no
    ncu on PATH is a failed step; NCU_CELLS missing or malformed is refused before any step runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ncu"
    fake.write_text('#!/usr/bin/env bash\necho "ncu $*"\nwhile [ "$1" != python ]; do shift; done\nexec "$@"\n')
    fake.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    out = tmp_path / "out"
    done = run(out, "ncu", NCU_CELLS="int8_w8a8:gpt-oss-120b:1 none:mixtral-8x7b:4", NCU_RUNS="3", PATH=path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (out / "summary.txt").read_text().splitlines() == [
        "ncu int8_w8a8:gpt-oss-120b:1: failed (exit 2)", "ncu none:mixtral-8x7b:4: failed (exit 2)"]
    report = (out / "ncu_int8_w8a8_gpt-oss-120b_1.txt").read_text()
    assert "--clock-control none --profile-from-start off --section SpeedOfLight" in report
    assert "profile_kernels.py --presets gpt-oss-120b --tokens 1 --profile-runs 3 --quant int8_w8a8" in report
    assert "needs a CUDA device" in report
    assert "--profile-runs 3\n" in (out / "ncu_none_mixtral-8x7b_4.txt").read_text()  # bf16: no --quant
    # no ncu: the step fails, saying so
    bare = f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin"
    done = run(tmp_path / "no_ncu", "ncu", NCU_CELLS="none:mixtral-8x7b:4", PATH=bare)
    assert done.returncode == 1 and (tmp_path / "no_ncu" / "summary.txt").read_text() == "ncu: failed (no ncu on PATH)\n"
    for env, why in (({}, "ncu needs NCU_CELLS"), ({"NCU_CELLS": "none:mixtral-8x7b:4,16"}, "is not QUANT:PRESET:M")):
        bad = run(tmp_path / f"bad{len(why)}", "env", "ncu", **env)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr
