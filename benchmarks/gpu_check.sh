#!/usr/bin/env bash
# Every check that needs a GPU, as one command for a lent GPU machine (its image has torch, triton, Lightning,
# transformers and pytest; nothing is installed). Results go to $OUT (else benchmarks/results/gpu/): the `gpu`
# test tier's log, `ds-plugin bench kernels` (kernels-<device>-<date>.json/.png), `ds-plugin bench fp8 --json`,
# and the quantizer's Triton-vs-torch timing. Commit them with the device name, versions and date they record.
# Sized for 8 minutes on one H100/H200: each step has its own time limit, so one stuck step cannot eat the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT_DIR="$out"
# One Triton compile cache for every step: the kernels the tests compile, the benchmark finds compiled.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/ds_plugin_triton_cache}"
status=0
: > "$out/gpu_steps.txt"
step() {  # step SECONDS NAME 'COMMAND': run it under a time limit; log its status and duration
  local limit=$1 name=$2 start=$SECONDS rc=0
  timeout "$limit" bash -c "$3" || rc=$?
  echo "== $name: rc=$rc, $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/gpu_steps.txt"
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu_device.txt"
step 150 "gpu tests" 'python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT_DIR/gpu_tests.log"'
step 195 "bench kernels" 'python3 -m ds_plugin.cli bench kernels --out-dir "$OUT_DIR" > "$OUT_DIR/kernels.txt"'
step 70 "bench fp8" 'python3 -m ds_plugin.cli bench fp8 --json > "$OUT_DIR/fp8_gpu.json"'
step 60 "quantizer" 'python3 -m benchmarks.gpu_check > "$OUT_DIR/quant_gpu.json"'
tail -n 3 "$out/gpu_tests.log"; tail -n 8 "$out/kernels.txt"; cat "$out/gpu_steps.txt"
head -c 1500 "$out/fp8_gpu.json"; echo; head -c 1500 "$out/quant_gpu.json"; echo
exit $status
