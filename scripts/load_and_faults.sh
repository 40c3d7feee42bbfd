#!/usr/bin/env bash
# Load and faults, measured: the default job (moebench run --ablate)
#   1. beside a CPU hog (one busy loop per core) and a disk writer (256 MB files, fsync'ed, in a loop);
#   2. killed with SIGKILL mid-run under the same load, then resumed;
#   3. with its results folder on a nearly full filesystem (a small tmpfs this script mounts and
#      removes; where mounting is refused, `ulimit -f` caps the file size instead), then resumed
#      after space is freed.
# Each phase checks that nothing finished is lost (every JSONL line parses, every complete trial
# has every item once), that a failure is one clear line with exit code 2, and that --resume
# completes the run. docs/reliability.md records what it measured.
#
# Usage: scripts/load_and_faults.sh                                         # the default job
#        MOEBENCH_ARGS="--limit 48 --repeats 2" scripts/load_and_faults.sh  # a shorter job
# Needs: moebench installed (pip install -e .), python3; root for the tmpfs (else ulimit -f).
set -uo pipefail

read -r -a extra <<< "${MOEBENCH_ARGS:-}"
job=(--ablate "${extra[@]}")
work="$(mktemp -d /tmp/moebench-faults.XXXXXX)"
small="$work/small"
hogs=()
mounted=0
failures=0

stop_hogs() {
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null; done
    hogs=()
    rm -f "$work"/disk-writer.bin
}
cleanup() {
    stop_hogs
    if [ "$mounted" = 1 ]; then umount "$small"; fi
    rm -rf "$work"
}
trap cleanup EXIT

start_hogs() {
    for _ in $(seq "$(nproc)"); do
        (while :; do :; done) &
        hogs+=($!)
    done
    (while :; do
        dd if=/dev/zero of="$work/disk-writer.bin" bs=1M count=256 conv=fsync status=none
        rm -f "$work/disk-writer.bin"
    done) &
    hogs+=($!)
}

result() {  # result NAME OK [DETAIL]
    if [ "$2" = 0 ]; then echo "PASS  $1${3:+: $3}"; else echo "FAIL  $1${3:+: $3}"; failures=$((failures + 1)); fi
}

# verify RUN_DIR complete|partial: prints what the folder holds; exit 0 if it holds what it must
verify() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
from collections import Counter
from pathlib import Path

run, mode = Path(sys.argv[1]), sys.argv[2]
manifest = json.loads((run / "manifest.json").read_text())

def records(name):
    path = run / name
    if not path.exists():
        return []
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            sys.exit(f"{path}:{lineno}: a line that does not parse (torn or corrupt)")
    return rows

trials, samples = records("trials.jsonl"), records("samples.jsonl")
done = {(t["config"], t["trial"]) for t in trials}
per_trial = Counter((s["config"], s["trial"]) for s in samples)
duplicates = len(samples) - len({(s["config"], s["trial"], s["item_id"]) for s in samples})
items = manifest["suite"].get("num_items") or max(per_trial.values(), default=0)
total = manifest["repeats"] * len(manifest["configs"])
whole = all(per_trial[key] == items for key in done)
print(f"      {len(done)} of {total} trials complete, {len(samples)} samples, {items} items per trial, "
      f"{duplicates} duplicates, complete trials whole: {whole}")
ok = whole and duplicates == 0 and len(trials) == len(done)
if mode == "complete":
    ok = ok and len(done) == total and len(samples) == total * items and (run / "summary.json").exists()
sys.exit(0 if ok else 1)
EOF
}

trials_done() { [ -f "$1/trials.jsonl" ] && wc -l < "$1/trials.jsonl" || echo 0; }

echo "moebench load and faults: job = moebench run ${job[*]}; $(nproc) cores; work folder $work"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

# ---------------------------------------------------------------- 1. under load
start_hogs
start=$(date +%s)
moebench run "${job[@]}" --out "$work/results" --run-id loaded > "$work/loaded.out" 2> "$work/loaded.err"
code=$?
loaded_s=$(( $(date +%s) - start ))
echo "1. under a CPU hog ($(nproc) busy loops) and a disk writer: exit $code after ${loaded_s} s (load $(cut -d' ' -f1-3 /proc/loadavg))"
result "the loaded run finishes" "$code" "$(tail -n 1 "$work/loaded.err")"
verify "$work/results/loaded" complete; result "the loaded run holds every sample once" $?

# ---------------------------------------------------------------- 2. SIGKILL mid-run, resume
moebench run "${job[@]}" --out "$work/results" --run-id killed > /dev/null 2> "$work/killed.err" &
runner=$!
for _ in $(seq 6000); do  # until the first trial is complete
    [ "$(trials_done "$work/results/killed")" -ge 1 ] && break
    kill -0 "$runner" 2>/dev/null || break
    sleep 0.1
done
kill -9 "$runner" 2>/dev/null
wait "$runner" 2>/dev/null
echo "2. killed with SIGKILL after $(trials_done "$work/results/killed") complete trials"
verify "$work/results/killed" partial; result "after kill -9 every line parses and complete trials are whole" $?
moebench run --resume "$work/results/killed" > /dev/null 2> "$work/resume-killed.err"
result "resume after kill -9 finishes" $? "$(tail -n 1 "$work/resume-killed.err")"
verify "$work/results/killed" complete; result "the resumed run holds every sample once" $?
stop_hogs

# ---------------------------------------------------------------- 3. a nearly full filesystem
full_bytes=$(du -sb "$work/results/loaded" | cut -f1)
cap=$(( full_bytes / 3 ))
mkdir -p "$small"
if mount -t tmpfs -o size="$cap" tmpfs "$small" 2>/dev/null; then
    mounted=1
    how="a ${cap}-byte tmpfs (the whole run needs ${full_bytes} bytes)"
    moebench run "${job[@]}" --out "$small" --run-id full > /dev/null 2> "$work/full.err"
    code=$?
else
    largest=$(find "$work/results/loaded" -type f -printf '%s\n' | sort -n | tail -n 1)
    blocks=$(( largest / 3 / 1024 ))
    how="ulimit -f ${blocks} KiB (mount refused; the largest file of a whole run is ${largest} bytes)"
    (ulimit -f "$blocks"; exec moebench run "${job[@]}" --out "$small" --run-id full) > /dev/null 2> "$work/full.err"
    code=$?
fi
error_line=$(grep -v '^\s*$' "$work/full.err" | grep -c "moebench: error:")
echo "3. results on $how: exit $code"
echo "      $(grep "moebench: error:" "$work/full.err" | head -n 1)"
[ "$code" = 2 ] && [ "$error_line" = 1 ] && ! grep -q Traceback "$work/full.err"
result "a full disk is one error line with exit 2, no traceback" $?
grep -q "continue with: moebench run --resume" "$work/full.err"; result "the error says how to continue" $?
verify "$small/full" partial; result "on the full disk every line parses and complete trials are whole" $?
if [ "$mounted" = 1 ]; then
    mount -o remount,size=$(( full_bytes * 3 )) "$small"
    moebench run --resume "$small/full" > /dev/null 2> "$work/resume-full.err"
else
    moebench run --resume "$small/full" > /dev/null 2> "$work/resume-full.err"
fi
result "resume after space is freed finishes" $? "$(tail -n 1 "$work/resume-full.err")"
verify "$small/full" complete; result "the resumed run holds every sample once" $?

echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$failures" -gt 0 ]; then
    echo "$failures checks FAILED"
    exit 1
fi
echo "every check passed"
