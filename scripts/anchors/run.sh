#!/usr/bin/env bash
# Every CPU anchor of the CPU-speed issue beside loom, one P, in one go (one device call):
#   bash scripts/anchors/run.sh P OUT [MAX_BYTES]
# loom's engine (loom-bench), loom through torch (c10d, torch.ops.loom and loom.ops) and Gloo
# (python -m loom.bench, Gloo in processes of its own), DeepSpeed's shm all_reduce, oneCCL
# over Intel MPI and over libfabric's shm provider, and Open MPI through mpi4py; then
# scripts/anchors/table.py OUT.
# env: ANCHORS  folder holding oneccl-bench/ and ds-bench/, as ../shared/anchors' fetch.sh
#               assemble them (default .device/anchors)
#      ENGINE_BENCH  the engine's benchmark (default build/release/bench/loom-bench)
# Before each stage scripts/anchors/quiet.py kills what earlier stages left running and names
# any other process using CPU. loom must be installed in the running Python.
# OMP_WAIT_POLICY=PASSIVE for every run (as README.md tells loom's users; DeepSpeed's and
# loom's benches are torch processes alike).
set -uo pipefail
P="${1:?usage: run.sh P OUT [MAX_BYTES]}"
OUT="$(mkdir -p "${2:?usage: run.sh P OUT [MAX_BYTES]}" && cd "$2" && pwd)"
MAX="${3:-67108864}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
ANCHORS="${ANCHORS:-$ROOT/.device/anchors}"
ENGINE_BENCH="${ENGINE_BENCH:-$ROOT/build/release/bench/loom-bench}"
export OMP_WAIT_POLICY=PASSIVE
t0=$(date +%s)
# The programs of every stage, whose leftovers quiet.py kills before the next one starts.
STAGES=(loom-bench loom.bench ds_allreduce_bench oneccl_bench hydra_pmi_proxy mpiexec mpirun orted mpi4py_bench)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; python3 "$HERE/quiet.py" --kill "${STAGES[@]}"; }
# --after-barrier: rank 0's median of single calls, each after a barrier, as the anchors
# (mpi4py_bench.py, oneCCL's and DeepSpeed's benchmarks) and python -m loom.bench time theirs.
step "loom engine: loom-bench -n $P -b 8 -e $MAX -f 2 -o all_reduce,all_gather,reduce_scatter,broadcast,all_to_all --after-barrier"
"$ENGINE_BENCH" -n "$P" -b 8 -e "$MAX" -f 2 -o all_reduce,all_gather,reduce_scatter,broadcast,all_to_all \
    --after-barrier -J "$OUT/engine.jsonl" > "$OUT/engine.txt" 2>&1 || echo "loom-bench failed: $(tail -3 "$OUT/engine.txt")"
# loom and Gloo in separate processes: a Gloo process group's TCP loop thread wakes about
# 100 times a second even while idle, and with one rank per core those wake-ups land on the
# cores loom's ranks wait on (docs/PERFORMANCE.md, "P = 8 and 16 again").
step "loom through torch: python3 -m loom.bench --ranks $P --max-bytes $MAX --backends loom,direct,eager"
(cd /tmp && python3 -m loom.bench --ranks "$P" --max-bytes "$MAX" --backends loom,direct,eager --quiet \
    --out "$OUT/torch" > "$OUT/torch.txt" 2>&1) || echo "loom.bench failed: $(tail -3 "$OUT/torch.txt")"
step "Gloo through torch: python3 -m loom.bench --ranks $P --max-bytes $MAX --backends gloo"
(cd /tmp && python3 -m loom.bench --ranks "$P" --max-bytes "$MAX" --backends gloo --quiet \
    --out "$OUT/torch_gloo" > "$OUT/torch_gloo.txt" 2>&1) || echo "loom.bench (Gloo) failed: $(tail -3 "$OUT/torch_gloo.txt")"
step "DeepSpeed: ds-bench/run.sh $P $MAX"
bash "$ANCHORS/ds-bench/run.sh" "$P" "$MAX" > "$OUT/deepspeed.txt" 2>&1 || echo "DeepSpeed failed: $(tail -3 "$OUT/deepspeed.txt")"
step "oneCCL: oneccl-bench/run.sh $P $MAX mpi ofi_shm"
INFO=0 bash "$ANCHORS/oneccl-bench/run.sh" "$P" "$MAX" mpi ofi_shm > "$OUT/oneccl.txt" 2>&1 || echo "oneCCL failed: $(tail -3 "$OUT/oneccl.txt")"
step "Open MPI: mpirun -np $P python3 scripts/anchors/mpi4py_bench.py $MAX"
mpirun --allow-run-as-root --oversubscribe -np "$P" python3 "$HERE/mpi4py_bench.py" "$MAX" > "$OUT/openmpi.txt" 2>&1 \
    || echo "Open MPI failed: $(tail -3 "$OUT/openmpi.txt")"
step "table"
python3 "$HERE/table.py" "$OUT" > "$OUT/table.md" || echo "table failed"
step "done"
