#!/usr/bin/env bash
# Runs every test: the C++ suites (release, AddressSanitizer + UndefinedBehaviorSanitizer,
# ThreadSanitizer), the bounded fuzz runs, and the PyTorch suites. Installs what it needs.
#   LOOM_TEST_QUICK=1 skips the sanitizer builds and PyTorch's generic suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
JOBS=$(nproc)
start=$(date +%s)
section() { echo; echo "== $* ($(( $(date +%s) - start )) s)"; }

bash scripts/setup.sh

section "C++ tests, release build"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build/release
ctest --test-dir build/release -j "$JOBS" --output-on-failure --timeout 900

if [ "${LOOM_TEST_QUICK:-0}" != 1 ]; then
  section "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLOOM_SANITIZE=address,undefined \
    -DLOOM_BUILD_BENCH=OFF >/dev/null
  ninja -C build/asan
  ctest --test-dir build/asan -j "$JOBS" --output-on-failure --timeout 1200

  section "synchronisation under ThreadSanitizer (ranks as threads)"
  cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLOOM_SANITIZE=thread \
    -DLOOM_BUILD_BENCH=OFF >/dev/null
  ninja -C build/tsan loom_thread_tests
  ctest --test-dir build/tsan -R '^Threads\.' --output-on-failure --timeout 900
fi

section "PyTorch backend tests"
if [ "${LOOM_TEST_QUICK:-0}" = 1 ]; then export LOOM_SKIP_TORCH_SUITE=1; fi
(cd tests/python && OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -rs -p no:cacheprovider)

section "all tests passed"
