#!/usr/bin/env bash
# Wait (at most $1 seconds, default 480) for the autotuner that tools/gpu_round6.jobs started, then bring back its
# folder and everything the queue wrote, as one tarball in the call's $OUT.
LIMIT=${1:-480}; START=$(date +%s)
while kill -0 "$(cat /tmp/autotune3b.pid)" 2>/dev/null && [ $(( $(date +%s) - START )) -lt "$LIMIT" ]; do sleep 5; done
kill -0 "$(cat /tmp/autotune3b.pid)" 2>/dev/null && echo "autotuner still running after ${LIMIT}s" || echo "autotuner finished"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > /tmp/gpu_queue.out/gpus_now.csv 2>&1
mkdir -p /tmp/gpu_queue.out/autotune3b
for f in autotune.json autotune.log command.txt; do cp /tmp/runs/autotune3b/$f /tmp/gpu_queue.out/autotune3b/ 2>/dev/null; done
# the experiments' configs, metrics, labs metrics and errors (not the partial folder's shims)
(cd /tmp/runs && ls -d autotune3b/results .autotune3b.partial-*/results 2>/dev/null | head -1 | xargs -r -I{} tar czf /tmp/gpu_queue.out/autotune3b/results.tgz {})
tail -c 3000 /tmp/gpu_queue.out/autotune3b.txt
tar czf "$OUT/round6.tgz" -C /tmp/gpu_queue.out .
