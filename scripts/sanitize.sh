#!/usr/bin/env bash
# compute-sanitizer over every Triton kernel (scripts/sanitize_driver.py): memcheck, racecheck,
# initcheck; one log per tool under sanitize-logs/. Needs a CUDA GPU and compute-sanitizer on
# PATH (CUDA toolkit). Arguments go to the driver (e.g. --big for the int32-overflow case).
# SANITIZE_TOOLS picks the tools (default: all three).
# Exit status: non-zero if any tool reports an error or the driver fails.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p sanitize-logs
status=0
tools=${SANITIZE_TOOLS:-memcheck racecheck initcheck}
# Run every case once outside the sanitizer, checked against the float64 reference: Triton's
# on-disk cache then serves the instrumented runs (compiling under racecheck made it slow), and
# those run the kernels only (the reference's float64 cuBLAS GEMMs under racecheck took ~80 s
# per prefill-sized case).
python scripts/sanitize_driver.py "$@" > sanitize-logs/warmup.out 2>&1 || status=1
[[ $status -ne 0 ]] && echo "the uninstrumented run failed: sanitize-logs/warmup.out"
for tool in $tools; do
    extra=()
    # Triton kernels allocate nothing on the device themselves; torch's caching allocator
    # hands out uninitialized pools, so initcheck follows only device-side reads.
    [[ $tool == memcheck ]] && extra=(--leak-check no)
    [[ $tool == racecheck ]] && extra=(--racecheck-report all)
    echo "== $tool"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" "${extra[@]}" \
        --error-exitcode 99 --log-file "sanitize-logs/$tool.log" \
        python scripts/sanitize_driver.py --kernels-only "$@" > "sanitize-logs/$tool.out" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "sanitize-logs/$tool.log" || true
    echo "   exit $rc (log: sanitize-logs/$tool.log, driver output: sanitize-logs/$tool.out)"
    [[ $rc -ne 0 ]] && status=1
done
exit $status
