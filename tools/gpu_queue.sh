#!/usr/bin/env bash
# A GPU session as a queue of named jobs, for device calls of at most ~10 minutes each: every call runs
#   bash tools/gpu_queue.sh JOBFILE SECONDS
# which installs the carried wheels once per host, then runs the jobs of JOBFILE (lines "name|seconds|command")
# not yet done on this host, in order, starting a job only when its estimate fits in what is left of SECONDS.
# Each job's output goes to NAME.log and its exit code to NAME.rc in /tmp/gpu_queue.out, which lives as long as the
# host; /tmp/gpu_queue.done remembers the finished ones, so the next call picks up where this one stopped. The device
# tool brings back at most 8 files a call (round 5 lost a result that way), so the call's $OUT gets one file: a
# tarball of that whole folder, everything every call wrote so far.
set -u
JOBS=$1; LIMIT=${2:-540}; START=$(date +%s)
CALL_OUT=${OUT:-/tmp/out}; mkdir -p "$CALL_OUT"
export OUT=/tmp/gpu_queue.out; mkdir -p "$OUT"
trap 'tar czf "$CALL_OUT/gpu_queue_out.tgz" -C "$OUT" .' EXIT
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
if [ ! -e /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 3; }
  touch /tmp/site/.installed
  nvidia-smi --query-gpu=name,driver_version,memory.total,uuid --format=csv > "$OUT/gpus.csv" 2>&1
  free -g > "$OUT/host_memory.txt"; df -h /tmp > "$OUT/disk.txt"; nproc > "$OUT/nproc.txt"
  # the host's CPU model and clocks: CPU Adam's step depends on them (round 24's H100 host took 19% less time than round 26's H200 host)
  lscpu > "$OUT/cpu.txt" 2>&1
  # DeepSpeed builds FusedAdam and CPUAdam just in time (40-110 s each on a fresh host): start both in the background.
  nohup python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder
FusedAdamBuilder().load(); CPUAdamBuilder().load(); print('ops built')" > "$OUT/opbuild.log" 2>&1 &
  echo $! > /tmp/opbuild.pid
fi
# No job starts while that build runs: the compilers take every core, and a case that launches many small kernels
# from the CPU ran 24% slower beside them (run y2 of round 7, results/gpu/2026-12-02_y2_*.json).
while [ -e /tmp/opbuild.pid ] && kill -0 "$(cat /tmp/opbuild.pid)" 2>/dev/null; do sleep 2; done
touch /tmp/gpu_queue.done
while IFS='|' read -r name estimate command; do
  [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
  grep -qx "$name" /tmp/gpu_queue.done && continue
  left=$(( LIMIT - ($(date +%s) - START) ))
  if [ "$estimate" -gt "$left" ]; then echo "stop before $name: needs ~${estimate}s, ${left}s left"; break; fi
  echo "=== $name ($(date -u +%H:%M:%S), ~${estimate}s)"
  timeout $(( left - 5 )) bash -c "$command" > "$OUT/$name.log" 2>&1
  rc=$?; echo $rc > "$OUT/$name.rc"; echo "$name" >> /tmp/gpu_queue.done
  echo "    exit $rc after $(( $(date +%s) - START ))s"; grep -E "^done:|Error|error:|^labs:" "$OUT/$name.log" | tail -3
done < "$JOBS"
echo "queue call ended after $(( $(date +%s) - START ))s"
