#!/usr/bin/env bash
# The GPU session script behind results/*.json: run on a GPU host from the repository root, with the wheels that
# ../shared/gpu/make-wheels.sh builds (EXTRA_WHEELS="liger-kernel==0.8.5 dashscope==2.0.2") carried in .whl/.
#   NAME=zero3_2xh200 CASES=labs-zero3,stock-zero3 STEPS=7 BUDGET=540 bash tools/gpu_bench.sh
#   NAME=f_sweep BENCH_ARGS="--sweep 4 --batch-per-gpu 8" STEPS=6 bash tools/gpu_bench.sh    (best against best)
# Writes $OUT/$NAME.json (labs bench's result, updated after every case) and $OUT/$NAME.log.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 3; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpus.csv" 2>&1
# DeepSpeed compiles FusedAdam (stock) and CPUAdam (offload) just in time, 40-110 s each on a fresh host: start
# both now, in the background, while the first case (which needs neither) runs. A later run waits on their lock.
if [ ! -e /tmp/opbuild.started ]; then
  touch /tmp/opbuild.started
  nohup python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder
FusedAdamBuilder().load(); CPUAdamBuilder().load(); print('ops built')" > "$OUT/opbuild.log" 2>&1 &
fi
timeout "${BUDGET:-540}" python3 -m labs bench --preset "${PRESET:-qwen2.5-7b}" --cases "${CASES:-}" ${BENCH_ARGS:-} \
  --steps "${STEPS:-7}" --out "$OUT/$NAME.json" --work /tmp/bench-work > "$OUT/$NAME.log" 2>&1
echo "bench exit code $?"
grep -E "^(===|case|stock|labs|lever|ratio|best)" "$OUT/$NAME.log" | tail -40
tail -5 "$OUT/opbuild.log" 2>/dev/null
