#!/usr/bin/env bash
# Every GPU check of ds_plugin as one command, for a lent GPU machine (one H100/H200; its image has torch, triton,
# Lightning, Accelerate, transformers, peft and pytest; nothing is installed or fetched):
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh            # on the GPU
#     OUT=/some/dir bash benchmarks/gpu_check.sh --dry-run  # the same script on a CPU: every step's CPU path
#
# Steps, in order, each its own process under its own time limit (seconds, on the GPU):
#   env 30            device name, capability, driver, torch/triton/CUDA versions; fails on a GPU run without CUDA
#   gpu_tests 150     the `gpu` test tier (pytest -m gpu tests)
#   bench_kernels 150 `ds-plugin bench kernels`: fp6/int4/int8 GEMMs vs bf16 on Llama-2-70B shapes; at M = 1, 16
#                     and 128 also from CUDA graphs (device time only: what the host adds per call shows)
#   quantizer 25      benchmarks/gpu_check.py: the ZeRO++ quantizer's Triton form vs torch, kernel error
#   fp8 35            `ds-plugin bench fp8 --json --hidden 4096 --steps 20`: FP8 training steps vs bf16
#   train 120         benchmarks/gpu_train.py: the engine (ZeRO-3 on FSDP2, NCCL, world size 1) training LoRA on a
#                     1.1B Llama with its frozen base stored bf16, int8, int4, nf4 and fp6; int8, int4 and fp6
#                     again on the torch reference (the kernels' check)
#   big_model 90      benchmarks/big_model.py (issue 15/19): streaming load of a Llama-2-7B-wide checkpoint cut to 8
#                     of its 32 layers (1.9B parameters: writing all 13.5 GB would not fit the limit), INT4 base
# The limits add up to 600 s (`timeout -k 10`): a ceiling, not the expected time. On the first H200 (2026-12-04)
# the steps took 400 s in all, each limit about 1.2-1.6x its step's time there (gpu_tests: 92 s with Triton's cache
# warm, past 100 s cold; bench_kernels: 93 s, before its CUDA-graph timings were added), so about 7 minutes is
# expected. A step past its limit fails the run; rerun it alone with GPU_CHECK_STEPS=<step>
# GPU_CHECK_LIMIT_<step>=SECONDS. A dry run triples them (a 2-core CPU machine).
#
# Failures cannot hide: no step runs through a pipe (stdout and stderr go to files, so the status recorded is the
# command's own), DS_PLUGIN_STRICT_KERNELS=1 makes a failed kernel launch raise instead of falling back to the torch
# reference, and the report (benchmarks/gpu_report.py) fails the run on any step's non-zero status or timeout, on a
# kernel benchmark row not on the "triton" backend, on a LoRA run whose int8/int4/fp6 layers did not launch the
# kernels, and on a quantized LoRA run whose loss is outside its stated distance of the bf16 run's. The last lines
# name every failed step; the exit status is 1 then.
#
# Triton's cold compiles are bounded by compiling each kernel tiling once per run: one TRITON_CACHE_DIR for every
# step; the gpu tier, the quantizer check and the training step use the kernels' first-guess tiling (DS_PLUGIN_KERNEL_AUTOTUNE=0: one
# compile per kernel shape class instead of one per candidate tiling); only `bench kernels`, whose figures are the
# speed claims, autotunes (its candidate tilings compile inside its own 150 s).
#
# Output, at most 4 files in $OUT (else benchmarks/results/gpu/; the machine returns at most 8): gpu_check.json
# (every figure; a field the run could not measure is null with a reason), gpu_check.png (when matplotlib imports),
# steps.log (every step's command, output and status), gpu_tests.log (the gpu tier's pytest output). Intermediate
# files live in a temporary folder. The JSON is rewritten after every step, so a run cut short keeps what finished.
#
# For tests and reruns: GPU_CHECK_STEPS=name,name runs only those steps (the others are recorded as not selected and
# the report says the run is incomplete); GPU_CHECK_FAIL_STEP=name,name replaces those steps' commands with one that
# exits 1 (the test of this script's failure path); GPU_CHECK_PYTHON is the interpreter (default python3).
set -uo pipefail

main() {  # the whole script in one function: bash parses it before running, so editing the file mid-run is safe
  local out=""
  [ -z "${OUT:-}" ] || out=$(realpath -m -- "$OUT")  # before the cd: a relative OUT is the caller's
  cd "$(dirname "$0")/.." || exit 2
  mode=gpu
  for arg in "$@"; do
    case "$arg" in
      --dry-run) mode=dry-run ;;
      -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
      *) echo "gpu_check.sh: unknown argument '$arg'; the only option is --dry-run" >&2; exit 2 ;;
    esac
  done

  out="${out:-$PWD/benchmarks/results/gpu}"
  mkdir -p "$out" || exit 2
  py="${GPU_CHECK_PYTHON:-python3}"
  work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
  trap 'rm -rf "$work"' EXIT
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DS_PLUGIN_STRICT_KERNELS=1
  export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/ds_plugin_triton_cache}"
  rm -f "$out/gpu_check.json" "$out/gpu_check.png" "$out/steps.log" "$out/gpu_tests.log"
  : > "$out/steps.log"
  : > "$work/steps.tsv"
  scale=1
  [ "$mode" = dry-run ] && scale=3
  failed=()

  log() { printf '%s\n' "$*" >> "$out/steps.log"; }

  selected() {  # selected NAME: whether GPU_CHECK_STEPS (if set) names it
    [ -z "${GPU_CHECK_STEPS:-}" ] || [[ ",$GPU_CHECK_STEPS," == *",$1,"* ]]
  }

  fails() {  # fails NAME: whether GPU_CHECK_FAIL_STEP names it
    [[ ",${GPU_CHECK_FAIL_STEP:-}," == *",$1,"* ]]
  }

  merge() {  # rewrite gpu_check.json from what has finished so far
    "$py" -m benchmarks.gpu_report merge --work "$work" --out "$out" --mode "$mode" "$@" >> "$work/report.out" 2>&1
  }

  skip() {  # skip NAME REASON: record the step as skipped, with its reason
    if fails "$1" && selected "$1"; then step "$1" 20 true; return; fi  # the hook: them too
    printf '%s\tskip\t0\t0\t%s\n' "$1" "$2" >> "$work/steps.tsv"
    log "== $1: skipped: $2"
    merge
  }

  step() {  # step NAME LIMIT COMMAND...: run COMMAND (no shell, no pipe) under its limit; record its real status
    local name=$1 limit=$2 var="GPU_CHECK_LIMIT_$1" rc=0 start=$SECONDS
    shift 2
    limit=$(( ${!var:-$limit} * scale ))
    if ! selected "$name"; then
      skip "$name" "not selected (GPU_CHECK_STEPS=$GPU_CHECK_STEPS)"
      return
    fi
    fails "$name" && set -- "$py" -c "raise SystemExit('GPU_CHECK_FAIL_STEP=$name')"
    log "== $name (limit ${limit} s): $*"
    timeout -k 10 "$limit" "$@" > "$work/$name.stdout" 2> "$work/$name.stderr" || rc=$?
    if [ "$name" = gpu_tests ]; then cp "$work/$name.stdout" "$out/gpu_tests.log"; else cat "$work/$name.stdout" >> "$out/steps.log"; fi
    cat "$work/$name.stderr" >> "$out/steps.log"
    printf '%s\t%s\t%s\t%s\t\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$work/steps.tsv"
    log "== $name: rc=$rc, $((SECONDS - start)) s (limit $limit s)"
    echo "gpu_check: $name rc=$rc ($((SECONDS - start)) s of $limit)"
    [ "$rc" -eq 0 ] || failed+=("$name")
    merge
  }

  step env 30 "$py" -m benchmarks.gpu_report env --mode "$mode"
  step gpu_tests 150 env DS_PLUGIN_KERNEL_AUTOTUNE=0 "$py" -m pytest -q -p no:cacheprovider -m gpu --durations=15 \
    --junitxml="$work/gpu_tests.xml" tests
  mkdir -p "$work/kernels"
  step bench_kernels 150 "$py" -m ds_plugin.cli bench kernels --out-dir "$work/kernels"
  if [ "$mode" = gpu ]; then
    step quantizer 25 env DS_PLUGIN_KERNEL_AUTOTUNE=0 "$py" -m benchmarks.gpu_check
  else
    skip quantizer "CPU dry run: benchmarks/gpu_check.py times the Triton quantizer against torch on CUDA only"
  fi
  step fp8 35 "$py" -m ds_plugin.cli bench fp8 --json --hidden 4096 --steps 20
  train=(--device cuda --size full --steps 8 --warmup 2)
  [ "$mode" = gpu ] || train=(--device cpu --size tiny --steps 3 --warmup 1)
  step train 120 env DS_PLUGIN_KERNEL_AUTOTUNE=0 "$py" -m benchmarks.gpu_train "${train[@]}" --out "$work/train.json"
  if [ ! -f benchmarks/big_model.py ]; then
    skip big_model "benchmarks/big_model.py not in this checkout (issue 15/19)"
  elif [ "$mode" = dry-run ]; then
    skip big_model "7B checkpoint not written on CPU dry run"
  else
    step big_model 90 "$py" -m benchmarks.big_model --json --device cuda --world-size 1 --format int4 --layers 8 --no-qlora
  fi

  report_rc=0
  "$py" -m benchmarks.gpu_report merge --work "$work" --out "$out" --mode "$mode" --final > "$work/report.final" 2>&1 ||
    report_rc=$?
  cat "$work/report.out" "$work/report.final" >> "$out/steps.log"
  cat "$work/report.final"
  if [ "$report_rc" -ne 0 ] || [ "${#failed[@]}" -ne 0 ]; then
    # The failed steps: the report's (it also fails checks inside a step), with any the report missed (it crashed).
    names=$("$py" -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1]))["failed_steps"]))' \
      "$out/gpu_check.json" 2> /dev/null)
    for name in "${failed[@]}"; do [[ " $names " == *" $name "* ]] || names="$names $name"; done
    [ "$report_rc" -eq 0 ] || [ -n "${names// /}" ] || names="report (see steps.log)"
    echo "gpu_check.sh ($mode): FAILED steps: $(echo $names | sed 's/ /, /g')"
    exit 1
  fi
  echo "gpu_check.sh ($mode): every step passed; $out/gpu_check.json"
}

main "$@"
