#!/usr/bin/env bash
# Repeat the fault-prone suites (tests/slurm and tests/rl by default) N times, optionally beside K
# CPU-bound processes, and print one summary line per run and one for all: a flaky test shows up
# here, not in CI. The cluster must be up (bash tests/cluster/up.sh).
#
#   bash tests/repeat.sh                 # 5 runs on an otherwise idle machine
#   bash tests/repeat.sh -n 2 --load 2   # 2 runs beside two busy-looping processes
#   bash tests/repeat.sh -n 3 tests/slurm/test_rl_slurm.py
#
# Each run's full pytest output lands in logs/repeat/<stamp>/run<i>.log; the summary goes to
# stdout and to logs/repeat/<stamp>/summary.txt (paste it into docs/RELIABILITY.md).
set -uo pipefail
cd "$(dirname "$0")/.."

runs=5 load=0
suites=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) runs=$2; shift 2 ;;
    --load) load=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) suites+=("$1"); shift ;;
  esac
done
[ ${#suites[@]} -gt 0 ] || suites=(tests/slurm tests/rl)

stamp=$(date -u +%Y%m%dT%H%M%SZ)
dir=logs/repeat/$stamp
mkdir -p "$dir"
busy=()
cleanup() { [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}" 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq 1 "$load"); do
  python3 -c 'while True: pass' &
  busy+=($!)
done

commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo "+dirty")
head="repeat: $(date -u +%Y-%m-%dT%H:%MZ) commit $commit, $(nproc) cores, $load CPU-bound processes beside, suites: ${suites[*]}"
echo "$head" | tee "$dir/summary.txt"
green=0
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  HOBSON_REQUIRE_SLURM=1 python3 -m pytest -q -p no:cacheprovider "${suites[@]}" >"$dir/run$i.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] && green=$((green + 1))
  line=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$dir/run$i.log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
  failed=$(grep -E '^FAILED ' "$dir/run$i.log" | cut -d' ' -f2 | tr '\n' ' ')
  echo "run $i/$runs: exit $rc, $(( $(date +%s) - t0 )) s: ${line:-no summary line} ${failed:+(failed: $failed)}" \
    | tee -a "$dir/summary.txt"
done
echo "repeat: $green of $runs runs green" | tee -a "$dir/summary.txt"
[ "$green" -eq "$runs" ]
