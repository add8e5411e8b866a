#!/usr/bin/env bash
# loom's CUDA path on a GPU host (run by hand there; CI has no GPU): builds and installs
# loom with its CUDA path into the current Python (which must have a CUDA build of torch),
# runs the correctness suite with 2, 3 and 4 ranks sharing GPU 0 (stepped, and with the fused
# kernels forced) and the benchmark against
# Gloo on the same CUDA tensors, and writes what they print to OUTDIR. docs/PERFORMANCE.md
# ("CUDA tensors") and tests/README.md quote these files. On a host of several GPUs, `nccl`
# runs loom against NCCL with one GPU per rank (P = 2 and 4, as many as there are GPUs) and
# the suite with a GPU per rank. `mps` runs the suite, the benchmark and the graph bench with
# the ranks sharing GPU 0 under NVIDIA's MPS, through a daemon of its own (private pipe and
# log folders, quit at the end; no GPU setting changes), where loom fuses small collectives;
# `mps-check` and `mps-bench` run its halves (the suite at P = 4 and 2 alone takes about
# 400 s on an H200, more than a device call of 10 minutes has beside the build). `roots`
# builds and runs only the rooted calls' agreement parts (ranks that name different roots,
# a root that never comes), stepped and with each fused broadcast forced, in one short call.
# `premul` builds and runs only PREMUL_SUM with factors on the GPU (and factors that differ by
# rank) on every reducing path: stepped (one step and many), fused one-shot, two-shot and ring.
#
#   bash scripts/cuda_check.sh OUTDIR [build|check|bench|nccl|mps|mps-check|mps-bench|roots|premul|all]
#   (default all; nccl and the mps modes build too, but are not part of all)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: cuda_check.sh OUTDIR [build|check|bench|nccl|mps|mps-check|mps-bench|roots|premul|all]}
what=${2:-all}
mkdir -p "$out"
PYTHON=${PYTHON:-python3}
# NVLink SHARP and multicast stay off on the shared GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ "$what" = build ] || [ "$what" = all ] || [ "$what" = nccl ] || [[ "$what" = mps* ]] ||
  [ "$what" = roots ] || [ "$what" = premul ]; then
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) SKBUILD_CMAKE_DEFINE="LOOM_CUDA=ON;LOOM_WITH_NET=OFF" \
    "$PYTHON" -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -5
fi
"$PYTHON" - <<'PY' | tee "$out/cuda_host.txt"
import torch, loom
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PY
if [ "$what" = check ] || [ "$what" = all ]; then
  "$PYTHON" tests/cuda/check_cuda.py --ranks ${RANKS:-2 3 4} 2>&1 | tee "$out/cuda_check.txt"
  # Multi-step paths with a small chunk (blocks cut into many steps), and the two-shot
  # all_reduce (uneven shares), which ranks sharing a GPU do not use by default.
  LOOM_CUDA_CHUNK_BYTES=65536 LOOM_CUDA_ONE_SHOT_BYTES=0 "$PYTHON" tests/cuda/check_cuda.py --ranks 3 \
    --parts reductions movement 2>&1 | tee "$out/cuda_check_small_chunk.txt"
  # The fused kernels (the default with a GPU per rank) forced on ranks sharing GPU 0, with
  # the default chunk and with one that cuts calls into many steps.
  LOOM_CUDA_FUSED=1 "$PYTHON" tests/cuda/check_cuda.py --ranks 2 3 \
    --parts reductions premul movement p2p mismatch factor_mismatch device_factor_mismatch \
    tag_mismatch killed 2>&1 | tee "$out/cuda_check_fused.txt"
  LOOM_CUDA_FUSED=1 LOOM_CUDA_CHUNK_BYTES=65536 "$PYTHON" tests/cuda/check_cuda.py --ranks 3 \
    --parts reductions movement p2p 2>&1 | tee "$out/cuda_check_fused_small_chunk.txt"
  # The fused two-shot all_reduce (more than two ranks, each with a GPU, large calls) at every
  # size, with both chunks. Ranks sharing a GPU run one at a time, so only a GPU per rank
  # shows races between the ranks' blocks (the nccl mode below).
  for chunk in 8388608 65536; do
    LOOM_CUDA_FUSED=1 LOOM_CUDA_ONE_SHOT_BYTES=0 LOOM_CUDA_FUSED_TWO_SHOT_BYTES=0 \
      LOOM_CUDA_CHUNK_BYTES=$chunk "$PYTHON" tests/cuda/check_cuda.py --ranks 3 4 \
      --parts reductions mismatch killed 2>&1 | tee "$out/cuda_check_fused_two_shot_$chunk.txt"
  done
  # The chained broadcast (more than two ranks, each with a GPU, from 32 MiB) at every size,
  # in many steps.
  LOOM_CUDA_FUSED=1 LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES=0 LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES=0 \
    LOOM_CUDA_CHUNK_BYTES=65536 "$PYTHON" tests/cuda/check_cuda.py --ranks 3 4 \
    --parts movement mismatch killed 2>&1 | tee "$out/cuda_check_fused_chain.txt"
  # Ranks that take themselves for a broadcast's root, in fused calls of more steps than
  # slots (one shot at P = 2, two shots and the chain at P = 3): named, never a hang.
  LOOM_CUDA_FUSED=1 LOOM_CUDA_CHUNK_BYTES=65536 LOOM_CHECK_ROOTED_ELEMENTS=3000000 \
    "$PYTHON" tests/cuda/check_cuda.py --ranks 2 --parts self_rooted_broadcast 2>&1 \
    | tee "$out/cuda_check_fused_self_rooted.txt"
  for shape in LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES; do
    env LOOM_CUDA_FUSED=1 LOOM_CUDA_CHUNK_BYTES=65536 LOOM_CHECK_ROOTED_ELEMENTS=3000000 \
      LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES=0 "$shape=0" "$PYTHON" tests/cuda/check_cuda.py \
      --ranks 3 --parts self_rooted_broadcast 2>&1 | tee -a "$out/cuda_check_fused_self_rooted.txt"
  done
  # The ring all_reduce (more than two ranks, each with a GPU, from 32 MiB) at every size,
  # in many steps.
  LOOM_CUDA_FUSED=1 LOOM_CUDA_ONE_SHOT_BYTES=0 LOOM_CUDA_FUSED_RING_ALL_REDUCE_BYTES=0 \
    LOOM_CUDA_CHUNK_BYTES=65536 "$PYTHON" tests/cuda/check_cuda.py --ranks 3 4 \
    --parts reductions mismatch killed 2>&1 | tee "$out/cuda_check_fused_ring.txt"
fi
if [ "$what" = roots ]; then
  roots="self_rooted_broadcast self_rooted_scatter rooted_mismatch late_root late_scatter_root"
  # shellcheck disable=SC2086  # the parts split into words on purpose
  "$PYTHON" tests/cuda/check_cuda.py --ranks 2 3 --parts $roots 2>&1 | tee "$out/cuda_roots.txt"
  for env in "LOOM_CUDA_FUSED=1" "LOOM_CUDA_FUSED=1 LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES=0" \
    "LOOM_CUDA_FUSED=1 LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES=0 LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES=0"; do
    for elements in 1000 3000000; do  # one step, and (64 KiB chunks) more steps than slots
      # shellcheck disable=SC2086  # the assignments split into words on purpose
      env $env LOOM_CUDA_CHUNK_BYTES=65536 LOOM_CHECK_ROOTED_ELEMENTS=$elements "$PYTHON" \
        tests/cuda/check_cuda.py --ranks 3 --parts self_rooted_broadcast late_root 2>&1 \
        | tee -a "$out/cuda_roots.txt"
    done
  done
fi
if [ "$what" = premul ]; then
  # Ranks, then settings: two-shot and the ring need three ranks or more.
  for run in "2 3|LOOM_CUDA_FUSED=0" "3|LOOM_CUDA_FUSED=0 LOOM_CUDA_CHUNK_BYTES=65536 LOOM_CUDA_ONE_SHOT_BYTES=0" \
    "2 3|LOOM_CUDA_FUSED=1" "3|LOOM_CUDA_FUSED=1 LOOM_CUDA_CHUNK_BYTES=65536" \
    "3|LOOM_CUDA_FUSED=1 LOOM_CUDA_ONE_SHOT_BYTES=0 LOOM_CUDA_FUSED_TWO_SHOT_BYTES=0" \
    "3|LOOM_CUDA_FUSED=1 LOOM_CUDA_ONE_SHOT_BYTES=0 LOOM_CUDA_FUSED_RING_ALL_REDUCE_BYTES=0 LOOM_CUDA_CHUNK_BYTES=65536"; do
    echo "== ranks ${run%%|*}, ${run#*|}" | tee -a "$out/cuda_premul.txt"
    # shellcheck disable=SC2086  # the ranks and settings split into words on purpose
    env ${run#*|} "$PYTHON" tests/cuda/check_cuda.py --ranks ${run%%|*} \
      --parts premul factor_mismatch device_factor_mismatch 2>&1 | tee -a "$out/cuda_premul.txt"
  done
fi
if [ "$what" = nccl ]; then
  "$PYTHON" tests/cuda/bench_nccl.py --ranks 2 4 --max-bytes "${MAX_BYTES:-1G}" --out "$out" \
    --ops all_reduce all_gather reduce_scatter broadcast all_to_all send_recv 2>&1 \
    | grep -v " done$" | tee "$out/cuda_vs_nccl.txt"
  for json in "$out"/cuda_vs_nccl_p*.json; do "$PYTHON" tests/cuda/bench_nccl.py --plot "$json"; done
  gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
  ranks=$(seq 2 "$(( gpus < 4 ? gpus : 4 ))" | tr '\n' ' ')
  # shellcheck disable=SC2086
  "$PYTHON" tests/cuda/check_cuda.py --gpu-per-rank --ranks $ranks 2>&1 \
    | tee "$out/cuda_check_gpu_per_rank.txt"
  if [ "$gpus" -ge 3 ]; then  # the chained broadcast and the ring all_reduce at every size, in many steps
    # shellcheck disable=SC2046  # the ranks split into words on purpose
    LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES=0 LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES=0 \
      LOOM_CUDA_CHUNK_BYTES=65536 "$PYTHON" tests/cuda/check_cuda.py --gpu-per-rank \
      --ranks $(seq 3 "$(( gpus < 4 ? gpus : 4 ))" | tr '\n' ' ') --parts movement mismatch killed \
      2>&1 | tee "$out/cuda_check_gpu_per_rank_chain.txt"
    # shellcheck disable=SC2046
    LOOM_CUDA_ONE_SHOT_BYTES=0 LOOM_CUDA_FUSED_RING_ALL_REDUCE_BYTES=0 LOOM_CUDA_CHUNK_BYTES=65536 \
      "$PYTHON" tests/cuda/check_cuda.py --gpu-per-rank \
      --ranks $(seq 3 "$(( gpus < 4 ? gpus : 4 ))" | tr '\n' ' ') --parts reductions mismatch killed \
      2>&1 | tee "$out/cuda_check_gpu_per_rank_ring.txt"
  fi
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$PYTHON" tests/cuda/bench_cuda.py --ranks 2 4 --max-bytes "${MAX_BYTES:-64M}" --out "$out" 2>&1 \
    | tail -80
fi
if [[ "$what" = mps* ]]; then
  command -v nvidia-cuda-mps-control > /dev/null || { echo "no nvidia-cuda-mps-control here" >&2; exit 1; }
  # A short private folder: the daemon's pipes are sockets, whose paths must stay short.
  mps=$(mktemp -d /tmp/loom-mps.XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY="$mps" CUDA_MPS_LOG_DIRECTORY="$mps/log"
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control; sleep 1; rm -rf "$mps"' EXIT
  if [ "$what" != mps-bench ]; then
    # shellcheck disable=SC2086  # the ranks split into words on purpose
    "$PYTHON" tests/cuda/check_cuda.py --ranks ${RANKS:-4 2} 2>&1 | tee "$out/cuda_check_mps.txt"
  fi
  if [ "$what" != mps-check ]; then
    "$PYTHON" tests/cuda/bench_cuda.py --ranks 2 4 --max-bytes "${MAX_BYTES:-64M}" 2>&1 \
      | tee "$out/cuda_bench_mps.txt" | tail -80
    # Replayed graphs wait for their peers with spinning kernels: without MPS each wait
    # costs a time slice (docs/PERFORMANCE.md, "CUDA graphs"); under MPS the ranks run side
    # by side.
    "$PYTHON" tests/cuda/bench_graphs.py --ranks 2 4 2>&1 | tee "$out/cuda_graphs_mps.txt"
  fi
fi
