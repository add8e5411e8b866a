#!/usr/bin/env bash
# Installs what loom needs to build and test (Debian packages, Python packages) and builds
# and installs the Python package `loom` against the torch of this Python. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

need_apt=()
for tool in cmake ninja g++ clang clang-format; do command -v "$tool" >/dev/null || need_apt+=("$tool"); done
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(gtest)
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  echo "== installing system packages"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    cmake ninja-build g++ clang clang-format libclang-rt-14-dev libgtest-dev libgmock-dev >/dev/null
fi

echo "== installing Python packages"
# torch: keep an installed one (the device machines ship their own); otherwise the CPU
# wheel this project is tested with.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install -q torch==2.13.0
fi
"$PYTHON" -m pip install -q "scikit-build-core>=0.10" pybind11 pytest expecttest numpy tqdm matplotlib

echo "== building and installing loom for $("$PYTHON" -c 'import torch; print("torch", torch.__version__)')"
"$PYTHON" -m pip install -q --no-build-isolation --no-deps .
"$PYTHON" -c "import loom; print('loom ready: backend registered =', loom.is_available(), '| kernels:', loom._C.kernel_isa())"
