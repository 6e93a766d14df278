#!/usr/bin/env bash
# Round 11 (2026-12-03; the 1-GPU kind, one call on a fresh host, what was left of the session's device time):
# DeepSpeed's native pinned-memory backend (DS_PIN_MEMORY_BACKEND=native: page-locked at each buffer's own size)
# against round 10's off20b (PyTorch's pinned allocator, a power of two per buffer): the same Qwen2.5-3B ZeRO-2
# offload run, same config and micro-batch, 4 steps (the optimizer's host buffers exist from the first), the host's
# memory sampled each second by tools/host_memory.sh. labs.memory predicts 52.3 GiB of host state for it (64.0 with
# PyTorch's rounding; off20b measured 65.5 GiB resident). Everything is written straight into $OUT, so a cut-off
# call still returns what it sampled. Run from the project root with the wheels of ../shared/gpu/make-wheels.sh in .whl.
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpus.csv" 2>&1
free -g > "$OUT/free.txt"; nproc > "$OUT/nproc.txt"; date -u +%FT%TZ > "$OUT/started.txt"
bash tools/host_memory.sh > "$OUT/host_samples.txt" 2>/dev/null & sampler=$!
DS_PIN_MEMORY_BACKEND=native timeout "${TRAIN_SECONDS:-220}" python3 -m labs train --preset qwen2.5-3b \
  --config bench/labs_zero2_offload.json --loss liger --kernels liger --activation-checkpointing none \
  --micro-batch 8 --steps 4 --out /tmp/runs/native4 > "$OUT/job.log" 2>&1
echo "rc=$?" >> "$OUT/job.log"
kill "$sampler"
cp -r /tmp/runs/native4 "$OUT/" 2>/dev/null
date -u +%FT%TZ > "$OUT/ended.txt"
