#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine without a package registry
# (the device tool's machines). Run from the repository root, with .device/ carried:
#   bash ci/device-check.sh [STEP ...] [-- PYTEST_ARGS ...]
# STEPs: doctor; tests (GPU suite of every package, ranks sharing the GPUs); tests-4 (one
# rank per GPU); tests-core, tests-host, tests-lang, tests-examples (one package, shared);
# bench (every benchmark); bench-NAME (one); all (default: doctor tests bench). Logs go to $OUT (or ./device-logs) and a summary
# table is printed last.
set -uo pipefail
steps=() pytest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --) shift; pytest_args=("$@"); break ;;
    *) steps+=("$1"); shift ;;
  esac
done
[[ ${#steps[@]} -eq 0 || " ${steps[*]} " == *" all "* ]] && steps=(doctor tests bench)
logs=${OUT:-device-logs}
mkdir -p "$logs"
source .device/install.sh || exit 1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  -e packages/tilescale-core -e packages/tilescale-host -e packages/tilescale-lang \
  -e packages/tilescale-examples > "$logs/install.log" 2>&1 || { cat "$logs/install.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
summary=()
run_step() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" 2>&1 | tee "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$logs/$name.log" | tail -1)")")
}
# One pytest per package, each under its own deadline, so one hang cannot eat the whole call.
# examples: 6 collectives x 1, 2, 4 ranks sharing a GPU (about 25 s each on an H200).
declare -A limit=([core]=240 [host]=240 [lang]=450 [examples]=600)
gpu_tests() {  # step name, TILESCALE_SHARE_GPUS value
  for p in core host lang examples; do
    run_step "$1-$p" env TILESCALE_SHARE_GPUS="$2" timeout -k 10 "${limit[$p]}" python3 -m pytest \
      "packages/tilescale-$p/tests" -m gpu -q -rfEs --tb=short -p no:cacheprovider \
      --tilescale-record "$logs" --junitxml "$logs/junit-$1-$p.xml" "${pytest_args[@]}"
  done
}
for step in "${steps[@]}"; do
  case "$step" in
    doctor) run_step doctor timeout -k 10 180 python3 -m tilescale_core.doctor ;;
    tests) gpu_tests tests 1 ;;
    tests-4) gpu_tests tests-4 0 ;;
    bench) for b in heap signals putget allgather reducescatter alltoall allreduce ag_gemm remote_tma gpu_barrier; do
             run_step "bench-$b" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.$b"
           done ;;
    bench-*) run_step "$step" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.${step#bench-}" ;;
    tests-*) p=${step#tests-}; run_step "$step" env TILESCALE_SHARE_GPUS=1 timeout -k 10 "${limit[$p]}" \
               python3 -m pytest "packages/tilescale-$p/tests" -m gpu -q -rfEs --tb=short \
               -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
