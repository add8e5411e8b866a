#!/usr/bin/env bash
# Installs what loom needs to build and test (Debian packages, Python packages) and builds
# and installs the Python package `loom` against the torch of this Python ($PYTHON, default
# the python3 on PATH: activate a virtual environment first to install there). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Made absolute, so that it still names the same interpreter from another directory.
case $PYTHON in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac

# Asks this Python something from a directory outside the checkout: run here, any folder of
# the checkout that is named like a package would be imported in its place.
outside=$(mktemp -d)
trap 'rm -rf "$outside"' EXIT
ask_python() { (cd "$outside" && "$PYTHON" "$@"); }

need_apt=()
for tool in cmake ninja g++ clang clang-format ccache; do command -v "$tool" >/dev/null || need_apt+=("$tool"); done
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(gtest)
# The network transport: libfabric, OpenSSL's libcrypto; iproute2 for the multi-host tests.
command -v pkg-config >/dev/null && pkg-config --exists libfabric || need_apt+=(libfabric)
[ -f /usr/include/openssl/hmac.h ] || need_apt+=(openssl)
command -v ip >/dev/null || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  echo "== installing system packages (missing: ${need_apt[*]})"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    cmake ninja-build g++ clang clang-format ccache libclang-rt-14-dev libgtest-dev libgmock-dev \
    pkg-config libfabric-dev libfabric-bin libssl-dev iproute2 >/dev/null
fi

echo "== installing Python packages into $(ask_python -c 'import sys; print(sys.prefix)')"
# torch: keep an installed one (the GPU hosts ship their own CUDA build); otherwise the version
# this project is tested with, from pip's index: PyPI's default torch on Linux x86-64 is the
# CUDA build (gigabytes); this project's machines serve the CPU wheel, and elsewhere
# PIP_INDEX_URL=https://download.pytorch.org/whl/cpu asks for it. `torch.__version__` proves
# it is the real package.
if ! ask_python -c "import torch; torch.__version__" 2>/dev/null; then
  echo "no torch in this Python: installing torch==2.13.0 from pip's index (for the CPU build set" \
    "PIP_INDEX_URL=https://download.pytorch.org/whl/cpu; PyPI's default is the CUDA build)"
  ask_python -m pip install -q torch==2.13.0
fi
ask_python -m pip install -q "scikit-build-core>=0.10" pybind11 pytest pytest-xdist expecttest numpy \
  tqdm matplotlib

echo "== building and installing loom for $(ask_python -c 'import torch; print("torch", torch.__version__)')"
"$PYTHON" -m pip install -q --no-build-isolation --no-deps .
ask_python -c "import loom; print('loom ready: backend registered =', loom.is_available(), '| kernels:', loom._C.kernel_isa())"
