#!/usr/bin/env bash
# loom-bench of two commits run in turns on the same machine, so that a change is judged
# against the machine's run-to-run swing rather than against a figure from another day.
#
#   bash scripts/bench_ab.sh OUTDIR REV_A REV_B [ROUNDS] -- LOOM-BENCH-ARGUMENTS...
#   e.g. bash scripts/bench_ab.sh ab main HEAD 2 -- --hosts 2 -n 8 -o all_reduce -b 1M -e 64M -f 4
#
# Builds loom-bench of each revision from `git archive` (committed work only) in
# build/ab/<commit>, runs A B A B ... (ROUNDS pairs, default 2) with the same arguments,
# appends every run's output to OUTDIR/A.txt and OUTDIR/B.txt, and prints, per operation and
# size, each revision's out-of-place times (µs, medians of the runs' medians) and B/A.
# DEBS=DIR as for bench_hosts.sh; RUN_LIMIT bounds each run (seconds, default 600).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bench_ab.sh OUTDIR REV_A REV_B [ROUNDS] -- LOOM-BENCH-ARGUMENTS..."
out=${1:?$usage}
rev_a=${2:?$usage}
rev_b=${3:?$usage}
shift 3
rounds=2
if [ "${1:-}" != "--" ]; then rounds=${1:?$usage}; shift; fi
[ "${1:-}" = "--" ] || { echo "$usage" >&2; exit 2; }
shift
mkdir -p "$out"
: >"$out/A.txt"
: >"$out/B.txt"

# shellcheck source=scripts/debs_env.sh
source scripts/debs_env.sh

# Builds loom-bench of revision $1 and prints its path.
build_at() {
  local commit dir
  commit=$(git rev-parse --short=12 "$1^{commit}")
  dir=build/ab/$commit
  if [ ! -x "$dir/build/bench/loom-bench" ]; then
    rm -rf "$dir/src" && mkdir -p "$dir/src"
    git archive "$commit" | tar -x -C "$dir/src"
    # shellcheck disable=SC2086
    cmake -S "$dir/src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DLOOM_BUILD_TESTS=OFF -DLOOM_WITH_NET=ON -DLOOM_CUDA=OFF ${CMAKE_ARGS:-} >"$dir/cmake.log" 2>&1 ||
      { tail -20 "$dir/cmake.log" >&2; exit 1; }
    ninja -C "$dir/build" loom-bench >"$dir/build.log" 2>&1 || { tail -30 "$dir/build.log" >&2; exit 1; }
  fi
  echo "$dir/build/bench/loom-bench"
}

echo "== building A = $rev_a and B = $rev_b"
bench_a=$(build_at "$rev_a")
bench_b=$(build_at "$rev_b")
for ((round = 1; round <= rounds; ++round)); do
  for side in A B; do
    bench=$bench_a
    [ "$side" = B ] && bench=$bench_b
    echo "== round $round/$rounds: $side ($bench $*)"
    echo "#### round $round" >>"$out/$side.txt"
    timeout "${RUN_LIMIT:-600}" "$bench" "$@" >>"$out/$side.txt" 2>&1 ||
      echo "   (this run failed or ran out of time: see $out/$side.txt)"
  done
done

python3 - "$out/A.txt" "$out/B.txt" <<'PY'
import re, statistics, sys
def rows(path):
    times, op = {}, None
    for line in open(path):
        m = re.match(r"# (\w+)  \w+  \w+", line)
        if m:
            op = m.group(1)
            continue
        parts = line.split()
        if op and len(parts) >= 4 and parts[0].isdigit():
            times.setdefault((op, int(parts[0])), []).append(float(parts[2]))
    return times
a, b = rows(sys.argv[1]), rows(sys.argv[2])
print(f"{'op':<16}{'bytes':>12}{'A us':>12}{'B us':>12}{'B/A':>8}   (out of place, medians over runs)")
for key in sorted(a, key=lambda k: (k[0], k[1])):
    if key not in b:
        continue
    ta, tb = statistics.median(a[key]), statistics.median(b[key])
    print(f"{key[0]:<16}{key[1]:>12}{ta:>12.2f}{tb:>12.2f}{tb / ta:>8.2f}")
PY
