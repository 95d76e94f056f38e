#!/usr/bin/env bash
# The GPU tests (`pytest -m gpu`), in the current Python environment (the GPU machine's torch and
# Triton; nothing is installed), parallel where pytest-xdist can be imported.
#
#   bash scripts/test_gpu.sh [pytest args: files, -k ...]      (default: every test file)
#
# With xdist: the tests marked `bigmem` (full-size preset weights, > 2^31-element tensors: up to
# ~35 GB a process) run after the others, on BIG_JOBS workers (default 2 where the GPU has more than
# 100 GB, else 1), and the rest on JOBS workers (default 6): six workers holding big tests at once
# ran an H200 out of memory. Compilation is most of these tests' time, and it runs on the CPU, so
# workers share one GPU well. Without xdist: one serial run. A GPU machine without network can take
# xdist from the two pure-Python wheels (`pip download pytest-xdist execnet`) unzipped into a folder
# on PYTHONPATH. The exit status is nonzero if either phase fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests)
if ! python -c "import xdist" 2>/dev/null; then
    echo "test_gpu.sh: pytest-xdist not importable: one serial run"
    python -m pytest -q -m gpu "${args[@]}"
    r=$?
    [ $r -eq 5 ] && exit 0  # no test collected: not a failure, as in the two phases below
    exit $r
fi
big_default=$(python -c "import torch; print(2 if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 1)")
JOBS=${JOBS:-6}
BIG_JOBS=${BIG_JOBS:-$big_default}
rc=0
# exit status 5: no test collected in that phase (e.g. -k selected only big tests): not a failure
python -m pytest -q -p xdist -n "$JOBS" -m "gpu and not bigmem" "${args[@]}"
r=$?; [ $r -ne 0 ] && [ $r -ne 5 ] && rc=$r
python -m pytest -q -p xdist -n "$BIG_JOBS" -m "gpu and bigmem" "${args[@]}"
r=$?; [ $r -ne 0 ] && [ $r -ne 5 ] && rc=$r
exit $rc
