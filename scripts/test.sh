#!/usr/bin/env bash
# Runs every test: the C++ suites (release, AddressSanitizer + UndefinedBehaviorSanitizer,
# ThreadSanitizer), bounded libFuzzer runs of the wire-format parsers, and the PyTorch
# suites (PyTorch's generic suite and the framework recipes of docs/FRAMEWORKS.md included).
# Installs what it needs into $PYTHON (default the python3 on PATH).
#   LOOM_TEST_QUICK=1 skips the sanitizer builds, the fuzz runs and PyTorch's generic suite;
#   LOOM_FUZZ_SECONDS sets each fuzz run's length (default 30).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
JOBS=$(nproc)
start=$(date +%s)
section() { echo; echo "== $* ($(( $(date +%s) - start )) s)"; }
# ctest in build dir $1 (more ctest arguments follow). On failure the failed tests run once
# more, alone and verbose, so their output ends the log where it is easy to find; the
# script fails either way.
run_ctest() {
  local dir=$1; shift
  if ctest --test-dir "$dir" -j "$JOBS" --output-on-failure "$@"; then return 0; fi
  section "failed tests in $dir, run again alone"
  ctest --test-dir "$dir" --rerun-failed --output-on-failure -V "$@" | tail -n 400 || true
  return 1
}

bash scripts/setup.sh
bash scripts/setup_frameworks.sh
# As root (CI is), the multi-host tests build their hosts from network namespaces and may
# not skip; elsewhere they skip and say why.
if [ "$(id -u)" = 0 ]; then export LOOM_REQUIRE_NETNS=1; fi

section "C++ formatting (.clang-format)"
find include src torch_plugin tests bench \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
  xargs -0 clang-format --dry-run --Werror
echo "formatted"

section "C++ tests, release build"
# The build type and compiler of the pip package that setup.sh built (scikit-build-core runs
# g++ in Release): the tests run the optimisation users get, and ccache hands the library's
# objects back from that build instead of compiling them again (its CUDA kernels too, from
# LOOM_CUDA_KERNEL_CACHE).
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=g++ \
  -DLOOM_WITH_NET=ON >/dev/null
ninja -C build/release
run_ctest build/release --timeout 900
grep -h '^soak' build/release/Testing/Temporary/LastTest.log || true  # the soak's numbers

if [ "${LOOM_TEST_QUICK:-0}" != 1 ]; then
  # The sanitizer builds leave the CUDA path out (LOOM_CUDA=OFF): nothing of it can run
  # without a GPU, the release build above compiled it and ran its host-side tests, and its
  # kernels (two GPU architectures) cost each build minutes of nvcc on this machine.
  section "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLOOM_SANITIZE=address,undefined \
    -DLOOM_BUILD_BENCH=OFF -DLOOM_WITH_NET=ON -DLOOM_CUDA=OFF >/dev/null
  ninja -C build/asan
  export LOOM_SOAK_SECONDS=20  # a shorter soak than the release run's 120 s, for CI's budget
  run_ctest build/asan --timeout 1200
  grep -h '^soak' build/asan/Testing/Temporary/LastTest.log || true  # the soak's numbers

  section "synchronisation under ThreadSanitizer (ranks as threads)"
  cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLOOM_SANITIZE=thread \
    -DLOOM_BUILD_BENCH=OFF -DLOOM_CUDA=OFF >/dev/null
  ninja -C build/tsan loom_thread_tests
  run_ctest build/tsan -R '^Threads\.' --timeout 900

  section "bounded fuzz runs of the wire-format parsers (libFuzzer, ${LOOM_FUZZ_SECONDS:-30} s each)"
  cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Debug \
    -DLOOM_BUILD_TESTS=OFF -DLOOM_BUILD_BENCH=OFF -DLOOM_BUILD_FUZZERS=ON >/dev/null
  ninja -C build/fuzz store_protocol_fuzzer handshake_fuzzer net_wire_fuzzer
  # The three run side by side (each is one single-threaded process): the section takes one
  # run's time instead of three.
  fuzz() {  # target scratch-directory
    build/fuzz/tests/fuzz/$1_fuzzer -max_total_time="${LOOM_FUZZ_SECONDS:-30}" \
      -print_final_stats=1 "$2" "tests/fuzz/corpus/$1" >"$2.log" 2>&1
  }
  declare -A scratch pids
  for target in store_protocol handshake net_wire; do
    # New inputs go to a scratch directory; the checked-in seeds stay as they are.
    scratch[$target]=$(mktemp -d)
    fuzz "$target" "${scratch[$target]}" & pids[$target]=$!
  done
  for target in store_protocol handshake net_wire; do
    if ! wait "${pids[$target]}"; then
      tail -n 80 "${scratch[$target]}.log"
      kill "${pids[@]}" 2>/dev/null || true
      echo "$target fuzzer failed (reproducer: crash-* in $PWD)"; exit 1
    fi
    echo "$target: $(grep -E '^Done' "${scratch[$target]}.log")"
    rm -rf "${scratch[$target]}" "${scratch[$target]}.log"
  done
fi

section "PyTorch backend tests, frameworks included"
if [ "${LOOM_TEST_QUICK:-0}" = 1 ]; then export LOOM_SKIP_TORCH_SUITE=1; fi
# Every framework test runs: a missing framework is a failure here, not a skip. DeepSpeed
# compiles its CPU op into the build tree, not the user's cache.
export LOOM_REQUIRE_FRAMEWORKS=1 TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions"
# --durations: the log names the slowest tests, where CI's time goes (tests/README.md).
# Two pytest workers (pytest-xdist), each test on whichever is free: one alone left the
# 2-core CI machine a third idle (its tests' ranks wait on each other and on start-up), two
# took the suites 703 s instead of 935 (tests/README.md).
(cd tests/python && OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -rs -p no:cacheprovider --durations=15 \
  -n 2 --dist worksteal)

section "all tests passed"
