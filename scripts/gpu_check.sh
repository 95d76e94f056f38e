#!/usr/bin/env bash
# A kernel change's check on a CUDA machine in one go: versions, the GPU tests, `fusedmoe bench
# --check` over the target presets for each scheme asked (every cell against the reference and its
# call repeated 8 times bit for bit, then timed), and a GPU fuzz. Each step writes its whole log
# under OUT and prints its tail; summary.txt says how each step ended. Runs in the current Python
# environment (the GPU machine's torch and Triton; nothing is installed).
#
#   OUT=dir bash scripts/gpu_check.sh [STEP ...]          STEP: env tests bench fuzz retune knob ncu
#                                                         (default: env tests bench fuzz)
#
# Settings (environment):
#   TESTS         arguments for scripts/test_gpu.sh (default: every test file), split as a shell splits
#                 words, quotes included (TESTS="tests/test_gpu_wo.py -k 'not w8a8'"), nothing expanded;
#                 PHASES its phases
#                 ("small big"; the whole suite takes ~17 minutes on an H200: split it over calls
#                 under a shorter limit, e.g. PHASES=small then PHASES=big, or TESTS by file)
#   QUANTS        comma-separated schemes for bench, "none" for bf16 (default: none)
#   PRESETS       comma-separated presets (default: bench's five targets)
#   TOKENS        token counts (default 1,16,256,1024,4096)
#   FUZZ_SECONDS  the fuzz starts no case after this (default 120); FUZZ_JOBS workers (default 4);
#                 FUZZ_SEED its first seed (default 0: pass one past the last run's to draw new cases)
#   LIMIT_TESTS, LIMIT_BENCH  seconds before a step is stopped (default 400, 300 a scheme)
#   CELLS         retune: "QUANT:PRESET:M ..." (QUANT none for bf16): `fusedmoe tune` of each cell into
#                 OUT/tuned (TUNE_JOBS compile workers, default 12; LIMIT_TUNE seconds, default 240),
#                 then ROUNDS (default 2) rounds of `fusedmoe bench` alternating the packaged tables and
#                 OUT/tuned on each cell (the first tuned run with --check); retune_summary.txt gives
#                 each cell's times (the rounds' JSON files packed in retune_runs.tgz); merge what wins
#                 with scripts/merge_tuned.py OUT/tuned/<device>.json
#   KNOB          knob: a fusedmoe knob's name (PDL, TRITON_RS_SYNC, ...: fusedmoe/knobs.py) timed at
#                 each of VALUES (default "unset 1 0"; unset = the variable removed) over CELLS
#                 ("QUANT:PRESETS:TOKENS ...", PRESETS and TOKENS comma lists: each entry one bench
#                 process, so "Q:gpt-oss-120b,qwen3-30b-a3b:1" times Qwen3 after gpt-oss in its
#                 process), ROUNDS rounds (default 2), the values' order reversed every other round;
#                 each value's first round --check'ed unless KNOB_CHECK=0 (a timing-only setting that
#                 may compute wrong rows); knob_summary.txt gives each cell's times by value
#   NCU_CELLS     ncu: "QUANT:PRESET:M ..." (QUANT none for bf16): ncu (--clock-control none) of
#                 NCU_RUNS (default 2) eager calls of each cell after a warm-up, through
#                 benchmarks/profile_kernels.py --profile-runs (PDL off); NCU_SECTIONS to change the
#                 sections, NCU_ARGS for more ncu arguments; each cell's report in ncu_<cell>.txt
# The exit status is nonzero if a step failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for the logs}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests bench fuzz)
rc=0

note() {  # note STEP STATUS: one line of summary.txt
    echo "$1: $2" | tee -a "$OUT/summary.txt"
    case "$2" in ok*) ;; *) rc=1 ;; esac
}

ended() {  # ended STATUS: how a step's command ended, in words
    case "$1" in
        0) echo ok ;;
        124|137) echo "stopped at its time limit (exit $1)" ;;
        *) echo "failed (exit $1)" ;;
    esac
}

step_env() {
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        python -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
        git log --oneline -1 2>/dev/null
        git status --short 2>/dev/null | head -20
    } 2>&1 | tee "$OUT/env.txt"
    python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    local r=$?
    [ $r -ne 0 ] && echo "gpu_check.sh: torch sees no CUDA device" | tee -a "$OUT/env.txt"
    note env "$(ended $r)"
}

split_words() {  # split_words TEXT: TEXT's words as a shell splits them (quotes, no expansion), NUL-ended
    python -c 'import shlex, sys; sys.stdout.write("".join(w + "\0" for w in shlex.split(sys.argv[1])))' "$1"
}

step_tests() {
    local args=()
    mapfile -d '' -t args < <(split_words "${TESTS:-}")
    timeout "${LIMIT_TESTS:-400}" bash scripts/test_gpu.sh "${args[@]}" > "$OUT/tests.log" 2>&1
    local r=$?
    grep -E "FAILED|ERROR|^SKIPPED| in [0-9.]+s" "$OUT/tests.log" | tail -20
    note tests "$(ended $r)"
}

step_bench() {
    local q r
    IFS=, read -r -a quants <<< "${QUANTS:-none}"
    for q in "${quants[@]}"; do
        local cmd=(python -m fusedmoe bench --backends triton --tokens "${TOKENS:-1,16,256,1024,4096}" --check
                   --json "$OUT/bench_$q.json")
        [ -n "${PRESETS:-}" ] && cmd+=(--presets "$PRESETS")
        [ "$q" != none ] && cmd+=(--quant "$q")
        echo "== ${cmd[*]}" | tee "$OUT/bench_$q.txt"
        timeout "${LIMIT_BENCH:-300}" "${cmd[@]}" 2>&1 | tr '\r' '\n' | grep -v '^\[ *[0-9]' >> "$OUT/bench_$q.txt"
        r=${PIPESTATUS[0]}
        tail -n +2 "$OUT/bench_$q.txt" | grep -v '^\s*$'
        note "bench $q" "$(ended "$r")"
    done
}

step_fuzz() {
    local seconds=${FUZZ_SECONDS:-120}
    timeout $((seconds + 120)) python -m fusedmoe fuzz --device cuda --seed "${FUZZ_SEED:-0}" --cases 100000 --jobs "${FUZZ_JOBS:-4}" \
        --time-limit "$seconds" --json "$OUT/fuzz.json" > "$OUT/fuzz.txt" 2>&1
    local r=$?
    tail -20 "$OUT/fuzz.txt"
    note fuzz "$(ended $r)"
}

step_retune() {
    local cell q p m r args failed=0
    mkdir -p "$OUT/tuned"
    for cell in $CELLS; do
        IFS=: read -r q p m <<< "$cell"
        args=(--model "$p" --tokens "$m" --jobs "${TUNE_JOBS:-12}" --out "$OUT/tuned")
        [ "$q" != none ] && args+=(--quant "$q")
        echo "== tune $cell" | tee -a "$OUT/retune.txt"
        timeout "${LIMIT_TUNE:-240}" python -m fusedmoe tune "${args[@]}" 2>&1 | tr '\r' '\n' | grep -v '^\[ *[0-9]' \
            | tee -a "$OUT/retune.txt" | grep -E "^M=|wrote|error"
        r=${PIPESTATUS[0]}
        note "tune $cell" "$(ended "$r")"
    done
    ls "$OUT"/tuned/*.json > /dev/null 2>&1 || { note retune "ok: nothing written"; return; }
    mkdir -p "$OUT/retune_runs"
    for round in $(seq "${ROUNDS:-2}"); do
        for cell in $CELLS; do
            IFS=: read -r q p m <<< "$cell"
            args=(--presets "$p" --tokens "$m" --backends triton)
            [ "$q" != none ] && args+=(--quant "$q")
            for table in packaged tuned; do
                local json="$OUT/retune_runs/${round}_${table}_${q}_${p}_${m}.json" extra=() env=(env)
                [ "$table" = tuned ] && env=(env FUSEDMOE_TUNED_DIR="$OUT/tuned")
                [ "$table" = tuned ] && [ "$round" = 1 ] && extra=(--check)
                echo "== round $round $table $cell" >> "$OUT/retune.txt"
                "${env[@]}" timeout "${LIMIT_BENCH:-300}" python -m fusedmoe bench "${args[@]}" "${extra[@]}" \
                    --json "$json" >> "$OUT/retune.txt" 2>&1
                r=$?
                [ $r -ne 0 ] && { note "bench round $round $table $cell" "$(ended "$r")"; failed=1; }
            done
        done
    done
    python - "$OUT" $CELLS <<'PY' | tee "$OUT/retune_summary.txt"
import glob, json, sys
out, cells = sys.argv[1], sys.argv[2:]
for cell in cells:
    q, p, m = cell.split(":")
    times = {}
    for table in ("packaged", "tuned"):
        for path in sorted(glob.glob(f"{out}/retune_runs/*_{table}_{q}_{p}_{m}.json")):
            rows = json.load(open(path))["rows"]
            times.setdefault(table, []).extend(r["us"] for r in rows if r.get("us") is not None)
    old, new = times.get("packaged", []), times.get("tuned", [])
    change = f" ({100 * (min(new) / min(old) - 1):+.1f}% best against best)" if old and new else ""
    print(f"{cell}: packaged {', '.join(f'{t:.1f}' for t in old) or '-'} us; "
          f"tuned {', '.join(f'{t:.1f}' for t in new) or '-'} us{change}")
PY
    # one archive of the rounds' JSON files: a machine may send back only a few files (the H200
    # sandbox: 8), and the tuned table must be one of them
    tar czf "$OUT/retune_runs.tgz" -C "$OUT" retune_runs && rm -r "$OUT/retune_runs"
    [ $failed = 0 ] && note retune "ok" || note retune "failed (a bench run above)"
}

step_knob() {
    local var="FUSEDMOE_$KNOB" round cell q p m r json value i failed=0 values
    read -r -a values <<< "${VALUES:-unset 1 0}"
    mkdir -p "$OUT/knob_runs"
    for round in $(seq "${ROUNDS:-2}"); do
        local order=("${values[@]}")
        if [ $((round % 2)) = 0 ]; then  # every other round the other way round: no value always runs first
            order=()
            for ((i = ${#values[@]} - 1; i >= 0; i--)); do order+=("${values[i]}"); done
        fi
        for cell in $CELLS; do
            IFS=: read -r q p m <<< "$cell"
            for value in "${order[@]}"; do
                local args=(--presets "$p" --tokens "$m" --backends triton) env=(env -u "$var")
                [ "$q" != none ] && args+=(--quant "$q")
                [ "$round" = 1 ] && [ "${KNOB_CHECK:-1}" = 1 ] && args+=(--check)
                [ "$value" != unset ] && env=(env "$var=$value")
                json="$OUT/knob_runs/${round}_${value}_${q}_${p//,/+}_${m//,/+}.json"
                echo "== round $round $var=$value $cell" >> "$OUT/knob.txt"
                "${env[@]}" timeout "${LIMIT_BENCH:-300}" python -m fusedmoe bench "${args[@]}" --json "$json" \
                    2>&1 | tr '\r' '\n' | grep -v '^\[ *[0-9]' >> "$OUT/knob.txt"
                r=${PIPESTATUS[0]}
                [ "$r" -ne 0 ] && { note "bench round $round $var=$value $cell" "$(ended "$r")"; failed=1; }
            done
        done
    done
    python - "$OUT" "$var" "${values[*]}" $CELLS <<'PY' | tee "$OUT/knob_summary.txt"
import glob, json, os, sys
out, var, values, cells = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4:]
for cell in cells:
    q, presets, tokens = cell.split(":")
    times = {}  # (preset, tokens) -> value -> [us, ...] in round order
    for value in values:
        name = f"{value}_{q}_{presets.replace(',', '+')}_{tokens.replace(',', '+')}.json"
        runs = [path for path in glob.glob(f"{out}/knob_runs/*_{name}")
                if os.path.basename(path).split("_", 1)[1:] == [name]]  # ROUND_NAME, not a longer name
        for path in sorted(runs, key=lambda path: int(os.path.basename(path).split("_", 1)[0])):
            for row in json.load(open(path))["rows"]:
                if row.get("us") is not None:
                    times.setdefault((row["preset"], row["tokens"]), {}).setdefault(value, []).append(row["us"])
    print(f"== {cell} ({var})")
    for preset in presets.split(","):
        for m in tokens.split(","):
            by_value = times.get((preset, int(m)), {})
            print(f"{q} {preset} M={m}: " + "; ".join(
                f"{value} {', '.join(f'{t:.1f}' for t in by_value.get(value, [])) or '-'} us" for value in values))
PY
    tar czf "$OUT/knob_runs.tgz" -C "$OUT" knob_runs && rm -r "$OUT/knob_runs"
    [ $failed = 0 ] && note "knob $KNOB" "ok" || note "knob $KNOB" "failed (a bench run above)"
}

step_ncu() {
    local cell q p m r name section sections=()
    if ! command -v ncu > /dev/null; then
        note ncu "failed (no ncu on PATH)"
        return
    fi
    for section in ${NCU_SECTIONS:-SpeedOfLight LaunchStats Occupancy SchedulerStats WarpStateStats MemoryWorkloadAnalysis}; do
        sections+=(--section "$section")
    done
    local extra
    read -r -a extra <<< "${NCU_ARGS:-}"
    for cell in $NCU_CELLS; do
        IFS=: read -r q p m <<< "$cell"
        local args=(--presets "$p" --tokens "$m" --profile-runs "${NCU_RUNS:-2}")
        [ "$q" != none ] && args+=(--quant "$q")
        name="$OUT/ncu_${q}_${p}_${m}.txt"
        echo "== ncu $cell" | tee "$name"
        timeout "${LIMIT_NCU:-300}" ncu --clock-control none --profile-from-start off "${sections[@]}" "${extra[@]}" \
            python benchmarks/profile_kernels.py "${args[@]}" >> "$name" 2>&1
        r=$?
        grep -E "^  [a-zA-Z_]+.*\(|Duration|Registers Per|Achieved Occupancy|DRAM Throughput" "$name" | head -40
        note "ncu $cell" "$(ended "$r")"
    done
}

refuse() { echo "gpu_check.sh: $*" >&2; exit 2; }

need_cells() {  # need_cells STEP VAR FORM REGEX: VAR is set and each of its entries matches REGEX
    local cell
    [ -n "${!2:-}" ] || refuse "$1 needs $2=\"$3 ...\""
    for cell in ${!2}; do
        [[ "$cell" =~ $4 ]] || refuse "$2 entry '$cell' is not $3"
    done
}

cell_re='^[a-z0-9_]+:[a-z0-9._-]+:[0-9]+$'  # QUANT:PRESET:M
cells_re='^[a-z0-9_]+:[a-z0-9._-]+(,[a-z0-9._-]+)*:[0-9]+(,[0-9]+)*$'  # QUANT:PRESETS:TOKENS
for s in "${steps[@]}"; do
    declare -F "step_$s" > /dev/null || refuse "unknown step '$s' (env, tests, bench, fuzz, retune, knob, ncu)"
    case "$s" in
        tests) split_words "${TESTS:-}" > /dev/null 2>&1 \
                   || refuse "TESTS does not split into words (an unclosed quote?): ${TESTS:-}" ;;
        retune) need_cells retune CELLS QUANT:PRESET:M "$cell_re" ;;
        ncu) need_cells ncu NCU_CELLS QUANT:PRESET:M "$cell_re" ;;
        knob)
            [[ "${KNOB:-}" =~ ^[A-Z0-9_]+$ ]] || refuse "knob needs KNOB=NAME (a fusedmoe knob, e.g. PDL), not '${KNOB:-}'"
            need_cells knob CELLS QUANT:PRESETS:TOKENS "$cells_re"
            for value in ${VALUES:-unset 1 0}; do
                [[ "$value" =~ ^[A-Za-z0-9_.-]+$ ]] || refuse "VALUES entry '$value' is not a plain word"
            done ;;
    esac
done
for s in "${steps[@]}"; do
    echo "######## $s $(date +%T)"
    "step_$s"
done
exit $rc
