#!/usr/bin/env bash
# loom across hosts, beside Gloo in the same layout: hosts made of network namespaces on
# this machine (root and iproute2), 2 hosts x 4 ranks and 4 x 2, with the links as they are
# and shaped to 10 Gb/s (tc tbf). Runs loom-bench (the engine) and python -m loom.bench
# (loom and Gloo through torch.distributed) and writes what they print to OUTDIR; the
# figures of docs/PERFORMANCE.md ("Across hosts") come from here.
#
#   bash scripts/bench_hosts.sh OUTDIR [build|open|shaped|all]   (default all)
#
# build: builds loom-bench (build/hosts/bench) and a wheel of the Python package with the
# network transport (build/hosts-dist), and installs the wheel; open: the unshaped runs;
# shaped: the 10 Gb/s runs (all_reduce). The runs use what build left there.
# DEBS=DIR unpacks the .deb files in DIR first and uses them (for hosts that cannot install
# Debian's libfabric, OpenSSL and iproute2: the GPU hosts). MAX_BYTES bounds the sweeps
# (default 256M for loom-bench, a quarter of it through torch, where Gloo is slow); LAYOUTS
# picks the layouts as "HOSTS RANKS" pairs, comma-separated (default "2 8,4 8").
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench_hosts.sh OUTDIR [build|open|shaped|all]}
what=${2:-all}
mkdir -p "$out"
PYTHON=${PYTHON:-python3}
max=${MAX_BYTES:-256M}
torch_max=${TORCH_MAX_BYTES:-64M}

# shellcheck source=scripts/debs_env.sh
source scripts/debs_env.sh

if [ "$what" = build ] || [ "$what" = all ]; then
  jobs=$(nproc)
  # shellcheck disable=SC2086
  cmake -S . -B build/hosts -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_BUILD_TESTS=OFF \
    -DLOOM_WITH_NET=ON ${CMAKE_ARGS:-} >/dev/null
  ninja -C build/hosts -j "$jobs" loom-bench
  rm -rf build/hosts-dist
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs SKBUILD_CMAKE_DEFINE="LOOM_WITH_NET=ON" \
    "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps -w build/hosts-dist .
  "$PYTHON" -m pip install -q --no-deps --force-reinstall build/hosts-dist/*.whl
fi

IFS=, read -r -a layouts <<<"${LAYOUTS:-2 8,4 8}"  # hosts, ranks
if [ "$what" = open ] || [ "$what" = all ]; then
  for layout in "${layouts[@]}"; do
    read -r hosts ranks <<<"$layout"
    tag="${hosts}x$((ranks / hosts))"
    build/hosts/bench/loom-bench --hosts "$hosts" -n "$ranks" -b 8 -e "$max" -f 4 -R 5 -T 20 \
      2>&1 | tee "$out/loom_bench_${tag}.txt"
    (cd "$out" && "$PYTHON" -m loom.bench --ranks "$ranks" --hosts "$hosts" \
      --max-bytes "$torch_max" --quiet --out "torch_${tag}") 2>&1 | tee "$out/torch_${tag}.txt"
  done
fi

if [ "$what" = shaped ] || [ "$what" = all ]; then
  for layout in "${layouts[@]}"; do
    read -r hosts ranks <<<"$layout"
    tag="${hosts}x$((ranks / hosts))_10g"
    build/hosts/bench/loom-bench --hosts "$hosts" -n "$ranks" --link-gbit 10 -o all_reduce \
      -b 1M -e "$max" -f 4 -R 5 -T 50 2>&1 | tee "$out/loom_bench_${tag}.txt"
    (cd "$out" && "$PYTHON" -m loom.bench --ranks "$ranks" --hosts "$hosts" --link-gbit 10 \
      --ops all_reduce --min-bytes 1M --max-bytes "$torch_max" --quiet --out "torch_${tag}") \
      2>&1 | tee "$out/torch_${tag}.txt"
  done
fi
