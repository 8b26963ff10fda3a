#!/usr/bin/env bash
# Every check that needs a GPU, as one command for a lent GPU machine (its image has torch, triton, Lightning,
# transformers and pytest; nothing is installed). Results go to $OUT (else benchmarks/results/gpu/): the `gpu`
# test tier's log, `ds-plugin bench fp8 --json`, and the quantizer's Triton-vs-torch timing. Commit them with the
# device name, versions and date they record.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu_device.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu_tests.log" || status=1
python3 -c "import sys; from ds_plugin.cli import main; sys.exit(main())" bench fp8 --json > "$out/fp8_gpu.json" || status=1
python3 benchmarks/gpu_check.py > "$out/quant_gpu.json" || status=1
tail -n 3 "$out/gpu_tests.log"; head -c 2000 "$out/fp8_gpu.json"; echo; head -c 3000 "$out/quant_gpu.json"
exit $status
