#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine without a package registry
# (the device tool's machines). Run from the repository root, with .device/ carried:
#   bash ci/device-check.sh [STEP ...] [-- PYTEST_ARGS ...]
# STEPs: doctor, tests (GPU suite, ranks sharing the GPUs), tests-4 (one rank per GPU),
# bench, all (default: doctor tests bench). Logs go to $OUT (or ./device-logs) and a summary
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
tests=(packages/tilescale-core/tests packages/tilescale-host/tests packages/tilescale-lang/tests packages/tilescale-examples/tests)
for step in "${steps[@]}"; do
  case "$step" in
    doctor) run_step doctor python3 -m tilescale_core.doctor ;;
    tests) run_step tests env TILESCALE_SHARE_GPUS=1 python3 -m pytest "${tests[@]}" -m gpu -q -rs \
             -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-4) run_step tests-4 env TILESCALE_SHARE_GPUS=0 python3 -m pytest "${tests[@]}" -m gpu -q -rs \
             -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    bench) for b in heap signals putget; do
             run_step "bench-$b" python3 -m "tilescale_examples.benchmarks.$b"
           done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
