#!/usr/bin/env bash
# Sets everything up, then runs loom's main job: loom vs Gloo through torch.distributed,
# side by side (table, plot and JSON in ./bench-out). Arguments go to `python -m loom.bench`
# (try --help), e.g.:  bash scripts/bench.sh --ranks 4 --max-bytes 64M
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m loom.bench "$@"
