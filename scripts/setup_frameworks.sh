#!/usr/bin/env bash
# Installs the training frameworks whose recipes docs/FRAMEWORKS.md gives (and
# tests/python/test_frameworks.py runs), at the versions they were tested with, into $PYTHON
# (default the python3 on PATH). Run after scripts/setup.sh, which installs torch. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

echo "== installing the frameworks of docs/FRAMEWORKS.md"
# With torch already installed, none of these asks for another one.
"$PYTHON" -m pip install -q accelerate==1.15.0 transformers==5.23.0 lightning==2.6.6
# DeepSpeed is published as source only. Built without build isolation, it compiles against
# the torch installed here (isolated, pip would fetch another torch to build it); with no
# ops prebuilt (DS_BUILD_OPS=0) it compiles the one it needs on first use.
"$PYTHON" -m pip install -q setuptools wheel
DS_BUILD_OPS=0 "$PYTHON" -m pip install -q --no-build-isolation deepspeed==0.19.8
