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
# on PYTHONPATH. PHASES picks the phases (default "small big"; "small": the tests not marked bigmem,
# "big": those): on an H200 the whole suite takes ~17 minutes (small ~12 on 6 workers), so a caller
# with a shorter limit per command runs them apart. The exit status is nonzero if a phase fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests)
PHASES=${PHASES:-small big}
for phase in $PHASES; do
    case "$phase" in
        small|big) ;;
        *) echo "test_gpu.sh: unknown phase '$phase' in PHASES (small, big)" >&2; exit 2 ;;
    esac
done
mark() { [ "$1" = small ] && echo "gpu and not bigmem" || echo "gpu and bigmem"; }
rc=0
if ! python -c "import xdist" 2>/dev/null; then
    echo "test_gpu.sh: pytest-xdist not importable: serial runs"
    if [ "$PHASES" = "small big" ]; then
        marks=("gpu")
    else
        marks=(); for phase in $PHASES; do marks+=("$(mark "$phase")"); done
    fi
    for m in "${marks[@]}"; do
        echo "test_gpu.sh: -m '$m'"
        python -m pytest -q -m "$m" "${args[@]}"
        r=$?; [ $r -ne 0 ] && [ $r -ne 5 ] && rc=$r  # 5: no test collected: not a failure
    done
    exit $rc
fi
big_default=$(python -c "import torch; print(2 if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 1)")
JOBS=${JOBS:-6}
BIG_JOBS=${BIG_JOBS:-$big_default}
# exit status 5: no test collected in that phase (e.g. -k selected only big tests): not a failure
for phase in $PHASES; do
    jobs=$JOBS; [ "$phase" = big ] && jobs=$BIG_JOBS
    echo "test_gpu.sh: -m '$(mark "$phase")' on $jobs workers"
    python -m pytest -q -p xdist -n "$jobs" -m "$(mark "$phase")" "${args[@]}"
    r=$?; [ $r -ne 0 ] && [ $r -ne 5 ] && rc=$r
done
exit $rc
