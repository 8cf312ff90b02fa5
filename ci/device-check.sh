#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine without a package registry
# (the device tool's machines). Run from the repository root, with .device/ carried:
#   bash ci/device-check.sh [STEP ...] [-- PYTEST_ARGS ...]
# STEPs: doctor; demo (python -m tilescale_examples.demo: the README's main job); tests (GPU suite of every package, ranks sharing the GPUs); tests-4 (one
# rank per GPU); tests-core, tests-host, tests-lang, tests-examples (one package, shared);
# tests-moe (the MoE dispatch/combine GPU tests alone, shared); tests-reduce (the reduction and all-gather GPU tests, shared);
# tests-decode (AllReduceResidualRMSNorm, GemmAllReduce), tests-gemm-ar (GemmAllReduce alone), tests-norm (AllReduceResidualRMSNorm alone), tests-exchange (the put exchange's ops: AllGather, AllToAll, UlyssesAllToAll), tests-flash (the flash-attention kernel alone, both pipelines), tests-sp-async (SPAllGatherAttention's GPU test at 1, 2 and 4 ranks sharing a GPU, its async-pipeline cases among them), tests-sequence (UlyssesAllToAll, flash attention, SPAllGatherAttention, SPFlashDecode), tests-moe-ll (MoELowLatency), tests-overlap-emulated (the fused
# plans of AllGatherGEMM and GemmReduceScatter on emulated peers), tests-overlap-async (those plans with the
# async GEMM pipeline), tests-graphs (CUDA graphs and torch.compile), tests-compile-decode (torch.compile of a
# decode block through matmul_all_reduce and the fused norm's operators, 1 and 2 ranks sharing a GPU),
# tests-other (all-to-all, overlapped GEMMs, TMA all-reduce), tests-gemm (the async-pipeline and stream-K GEMMs), tests-tma (the lean launcher's TMA
# descriptors and frozen launches), tests-lang-rest (tilescale-lang's GPU suite but upstream's
# programs), tests-upstream (upstream's programs alone), tests-lang-new (AOT bundles, the lean launcher,
# the autotuner, upstream's NVSHMEM-path programs) -- the ops and modules whose GPU tests are newest;
# bench (every benchmark); bench-NAME (one); bench-overlap-1 (ag_gemm and gemm_rs on one rank:
# the world-1 goal); bench-overlap-1-stages4 (the same with 4 pipeline stages); bench-overlap-1-async (the same with the async GEMM pipeline); bench-overlap-wide (the emulated fused plans at n 28672, 2/4/8 ranks); bench-tuned-1 (ag_gemm on one rank with the autotuner's tiles, n 3584 and
# 7168); bench-gemm_allreduce-tiles (GemmAllReduce's decode rows with longer runs of b per
# block); bench-gemm_allreduce-split (GemmAllReduce with k split against unsplit, 1 and 2 ranks);
# bench-gemm_allreduce-1 (GemmAllReduce at one rank, every decode m, k split and not: the one-rank kernels);
# bench-gemm_allreduce-2shot (GemmAllReduce's one-shot against its two-shot reduction, 2 and 4 emulated ranks);
# bench-gemm_allreduce-ranks (GemmAllReduce across 2 real ranks against matmul + TileScale's and NCCL's all-reduce:
# one rank per GPU on a 2-GPU machine, where it gives TWO_SHOT_FROM_BYTES[2]; ranks sharing one GPU check it only);
# bench-decode-ranks (the fused norm across 2 real ranks against TileScale's, torch symmetric memory's and NCCL's
# all-reduce then torch's add and rms_norm; likewise one rank per GPU on a 2-GPU machine);
# bench-since-move (the benchmarks whose published tables predate the examples' restructuring);
# bench-concurrent (the all-reduce algorithms with emulated ranks at once: the Lamport size table);
# bench-concurrent-norm (the same for the fused norm's exchanges); bench-concurrent-eager (both at 4
# ranks with the rounds launched eagerly instead of replayed from a CUDA graph);
# bench-decode-lamport (the fused norm's one-shot and Lamport exchanges at one rank);
# bench-attention-fast (the flash-attention kernel compiled without and with fast math);
# bench-attention-pipelines (the flash-attention kernel on the sync and the async pipeline);
# bench-decode-threads (the fused norm with 512 and 1024 threads per block, hidden 8192, 1-16 tokens);
# bench-call-numbers (the reduction kernels' call numbers on the device against passed by the host:
# benchmarks.emulated's A/B table, 2/4/8 ranks up to 64 MiB);
# bench-gemm (the library GEMM kernels -- stock TileLang, async WGMMA, persistent, each also with a TMA-store
# epilogue, and stream-K -- against torch.matmul, one GPU); bench-gemm-sustain (the GEMM kernels run back to back for 1 s each with the SM clock and board
# power sampled: a kernel slower per cycle, or one clocked lower); bench-gemm-224 (the one-tile and persistent
# kernels with 128 x 224 tiles, which divide n 3584/7168/28672
# into 16/32/128 column blocks); bench-gemm-row (the same kernels with the compute warpgroups splitting
# each tile by rows, one m64n256 WGMMA per k16, as CUTLASS);
# bench-moe-ll (the low-latency MoE mode against the normal mode, the copy and torch);
# bench-moe-ll-blocks (the same at 1 and 32 tokens with grids of 132, 32 and 8 blocks);
# bench-cold-start (the serving ops built from a precompiled cache against their compile: the carried
# .tlcache when it holds the compile record of `cold_start --compile-only --cache DIR`, else compiled here);
# unverified (the checks written but not yet run on a GPU); all (default: doctor demo tests
# bench). Logs go to $OUT (or ./device-logs) and a summary
# table is printed last.
set -uo pipefail
steps=() pytest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --) shift; pytest_args=("$@"); break ;;
    *) steps+=("$1"); shift ;;
  esac
done
[[ ${#steps[@]} -eq 0 || " ${steps[*]} " == *" all "* ]] && steps=(doctor demo tests bench)
# unverified: the GPU checks written but not yet run on a GPU (or changed since), most important
# first; each step fits one device call of 600 s: GemmAllReduce at one rank (tests-gemm-ar; its
# worlds 2 and 4 passed), the decode ops' torch operators under torch.compile (tests-compile-decode) and the
# tables (bench-gemm_allreduce-1, -2shot, bench-ulysses) and the real-rank GemmAllReduce benchmark's first run
# (bench-gemm_allreduce-ranks, ranks sharing the GPU: its checks) and the fused norm's (bench-decode-ranks);
# SPAllGatherAttention on the async attention
# pipeline at 4 ranks sharing a GPU (its worlds 1 and 2 passed; the cases of tests-sp-async) and
# the attention table at every length (bench-attention-pipelines); the low-latency MoE's grid at
# decode sizes (bench-moe-ll-blocks); the GEMM kernels' SM clock and power under a sustained run;
# the rest of the tilescale-lang GPU suite in two steps (the others, whose first 25 tests passed
# before a shortened time limit cut the run, and upstream's programs, test_gpu_upstream.py, alone).
unverified=(tests-gemm-ar tests-compile-decode bench-gemm_allreduce-1 bench-ulysses bench-gemm_allreduce-2shot bench-gemm_allreduce-ranks bench-decode-ranks tests-sp-async bench-attention-pipelines bench-moe-ll-blocks bench-gemm-sustain tests-lang-rest tests-upstream)
if [[ " ${steps[*]} " == *" unverified "* ]]; then
  steps=("${unverified[@]}")
  [[ ${#steps[@]} -eq 0 ]] && echo "device-check: no unverified steps"
fi
logs=${OUT:-device-logs}
mkdir -p "$logs"
source .device/install.sh || exit 1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# One TileLang cache for every step and the GPU tests' ranks (TILESCALE_TEST_KERNEL_CACHE), kept in
# the repository's .tlcache: a machine kept warm between calls compiles a kernel once, and a
# .tlcache carried from an earlier call (see the end of this script) or filled on a CPU machine
# with nvcc (TileLang's cache keys hold no GPU) is used as it is.
# A cache carried compressed (.tlcache.tar.xz, made with `tar cJf .tlcache.tar.xz .tlcache`:
# compiled kernels shrink about 20x, and a device call carries at most 64 MiB) is unpacked first.
mkdir -p .tlcache
[[ -f .tlcache.tar.xz ]] && tar -xJf .tlcache.tar.xz
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tlcache}
export TILESCALE_TEST_KERNEL_CACHE=${TILESCALE_TEST_KERNEL_CACHE:-$TILELANG_CACHE_DIR}
# Every cached file marked unread, so that the end of the call can list the kernels it used
# ($logs/tlcache-used.txt: `python3 ci/kernel_cache_usage.py prune .tlcache USED.txt ...` keeps
# only those, when the carried cache nears the 64 MiB a call carries).
python3 ci/kernel_cache_usage.py stamp "$TILELANG_CACHE_DIR" > /dev/null || true
cache_start=$(date +%s)
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
# examples: 6 collectives x 1, 2, 4 ranks sharing a GPU (about 25 s each on an H200), plus the
# overlapped GEMMs (test_overlap_gpu.py, about 3 minutes; `-- -k overlap` runs them alone).
# The reductions: size classes and 1000 back-to-back calls on 2 and 4 ranks, emulated peers; the MoE tests
# (about 6 minutes on one H200: worlds 1, 2, 4, full size, 200 back-to-back calls with stragglers, small batches on a 2-block grid).
declare -A limit=([core]=240 [host]=240 [lang]=450 [examples]=1200)
gpu_tests() {  # step name, TILESCALE_SHARE_GPUS value
  for p in core host lang examples; do
    run_step "$1-$p" env TILESCALE_SHARE_GPUS="$2" timeout -k 10 "${limit[$p]}" python3 -m pytest \
      "packages/tilescale-$p/tests" -m "gpu and not chaos" -q -rfEs --tb=short -p no:cacheprovider \
      --tilescale-record "$logs" --junitxml "$logs/junit-$1-$p.xml" "${pytest_args[@]}"
  done
}
for step in "${steps[@]}"; do
  case "$step" in
    doctor) run_step doctor timeout -k 10 180 python3 -m tilescale_core.doctor ;;
    demo) run_step demo timeout -k 10 300 python3 -m tilescale_examples.demo --json "$logs/demo.json" ;;
    tests) gpu_tests tests 1 ;;
    tests-4) gpu_tests tests-4 0 ;;
    chaos) run_step chaos env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
             packages/tilescale-examples/tests/test_chaos.py -m chaos -q -s -rfEs --tb=short -p no:cacheprovider ;;
    bench) for b in heap signals putget allgather reducescatter alltoall allreduce ag_gemm gemm_rs gemm overlap_emulated emulated reduce_ceiling moe moe_phases remote_tma gpu_barrier decode decode_ranks gemm_allreduce gemm_allreduce_ranks ulysses launch cold_start attention sp_attention concurrent; do
             run_step "bench-$b" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.$b"
           done ;;
    bench-overlap-1) for b in ag_gemm gemm_rs; do
               run_step "bench-$b-1" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.$b" --ranks 1
             done ;;
    bench-overlap-1-stages4) for b in ag_gemm gemm_rs; do  # the same with 4 pipeline stages (the default has 3)
               run_step "bench-$b-1-stages4" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.$b" --ranks 1 \
                 --tiles 128x256x64:4:256
             done ;;
    bench-overlap-1-async) for b in ag_gemm gemm_rs; do  # the same with the async GEMM pipeline (4 stages)
               run_step "bench-$b-1-async" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.$b" --ranks 1 \
                 --pipeline async --tiles 128x256x64:4:256
             done ;;
    bench-overlap-wide) run_step bench-overlap-wide timeout -k 10 560 python3 -m \
                          tilescale_examples.benchmarks.overlap_emulated --n 28672 --iters 10 ;;  # GEMM outlasts the copies
    bench-tuned-1) for n in 3584 7168; do  # the autotuner's tiles against torch.matmul at world 1 (k 8192)
             run_step "bench-ag_gemm-1-tuned-n$n" timeout -k 10 560 python3 -m tilescale_examples.benchmarks.ag_gemm \
               --ranks 1 --tune --n "$n" --m-local 1024,4096
           done ;;
    bench-gemm_allreduce-tiles) run_step "$step" timeout -k 10 300 python3 -m tilescale_examples.benchmarks.gemm_allreduce \
                                  --ranks 1 --m 1 16 64 128 --tiles 64x128x64:4:128 64x128x128:3:128 64x256x64:4:128 ;;
    bench-gemm_allreduce-split) run_step "$step" timeout -k 10 560 python3 -m \
                                  tilescale_examples.benchmarks.gemm_allreduce --ranks 1 2 --m 1 4 16 64 128 --split-k 1 auto ;;
    bench-gemm_allreduce-ranks) run_step "$step" timeout -k 10 560 python3 -m \
                                  tilescale_examples.benchmarks.gemm_allreduce_ranks --ranks 2 ;;  # one rank per GPU where there are 2
    bench-decode-ranks) run_step "$step" timeout -k 10 560 python3 -m tilescale_examples.benchmarks.decode_ranks \
                          --ranks 2 ;;  # one rank per GPU where there are 2
    bench-gemm_allreduce-1) run_step "$step" timeout -k 10 560 python3 -m tilescale_examples.benchmarks.gemm_allreduce \
                              --ranks 1 --split-k 1 auto ;;
    bench-gemm_allreduce-2shot) run_step "$step" timeout -k 10 560 python3 -m \
                                  tilescale_examples.benchmarks.gemm_allreduce --ranks 2 4 --m 1 16 64 128 256 512 \
                                  --split-k 1 --reduction one_shot two_shot ;;
    bench-attention-fast) run_step "$step" timeout -k 10 400 python3 -m tilescale_examples.benchmarks.attention \
                            --seq 4096 8192 16384 --fast-math off on ;;
    bench-attention-pipelines) run_step "$step" timeout -k 10 500 python3 -m tilescale_examples.benchmarks.attention \
                                 --pipeline sync async ;;
    bench-decode-threads) for t in 512 1024; do  # the fused norm's block size at hidden 8192, small batches
                            run_step "bench-decode-t$t" timeout -k 10 280 python3 -m tilescale_examples.benchmarks.decode \
                              --hidden 8192 --tokens 1 4 16 --threads "$t"
                          done ;;
    bench-decode-lamport) for a in one_shot lamport; do  # the two exchanges of the fused norm, one rank, same machine
                            run_step "bench-decode-1-$a" timeout -k 10 280 python3 -m tilescale_examples.benchmarks.decode \
                              --ranks 1 --tokens 1 4 16 64 --algorithm "$a"
                          done ;;
    bench-concurrent-norm) run_step "$step" timeout -k 10 560 python3 -m tilescale_examples.benchmarks.concurrent \
                             --op norm --min-bytes 8192 --max-bytes 131072 ;;
    bench-gemm-sustain) run_step "$step" timeout -k 10 400 python3 -m tilescale_examples.benchmarks.gemm --m 4096 \
                          --n 7168 28672 --kernels stock stock-tma async persistent persistent-tma --sustain 1 ;;
    bench-gemm-row) run_step "$step" timeout -k 10 300 python3 -m tilescale_examples.benchmarks.gemm --warp-policy row ;;
    bench-gemm-224) run_step "$step" timeout -k 10 300 python3 -m tilescale_examples.benchmarks.gemm \
                      --tiles 128x224x64:4:256 --kernels stock async persistent ;;
    bench-concurrent) run_step "$step" timeout -k 10 560 python3 -m tilescale_examples.benchmarks.concurrent ;;
    bench-concurrent-eager) for o in norm allreduce; do  # rounds launched eagerly: isolates the CUDA graph replays
                              run_step "bench-concurrent-eager-$o" timeout -k 10 280 python3 -m \
                                tilescale_examples.benchmarks.concurrent --op "$o" --ranks 4 --launch eager \
                                --min-bytes 8192 --max-bytes 65536 --case-timeout 60
                            done ;;
    bench-since-move) for b in heap signals putget allgather reducescatter alltoall remote_tma gpu_barrier ag_gemm \
                               gemm_rs; do
                        run_step "bench-$b" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.$b"
                      done ;;
    bench-moe-ll) run_step "$step" timeout -k 10 300 python3 -m tilescale_examples.benchmarks.moe --mode low_latency \
                    --tokens 1,32,128,1024 --routing uniform ;;
    bench-moe-ll-blocks) for g in 132 32 8; do  # the low-latency kernels' grid at decode sizes (default: the SM count)
                           run_step "$step-$g" timeout -k 10 200 python3 -m tilescale_examples.benchmarks.moe \
                             --mode low_latency --tokens 1,32 --routing uniform --ll-blocks "$g"
                         done ;;
    bench-call-numbers) run_step "$step" timeout -k 10 560 python3 -m tilescale_examples.benchmarks.emulated \
                          --ranks 2 4 8 --max-bytes 67108864 --no-graph ;;  # the A/B table up to 64 MiB
    bench-cold-start) cold=()  # the carried cache's compile record (cold_start --compile-only --cache DIR), if any
                      [[ -f "$TILELANG_CACHE_DIR/cold_start.json" ]] && cold=(--cache "$TILELANG_CACHE_DIR" --sm-count 132)
                      run_step "$step" timeout -k 10 400 python3 -m tilescale_examples.benchmarks.cold_start "${cold[@]}" ;;
    bench-*) run_step "$step" timeout -k 10 300 python3 -m "tilescale_examples.benchmarks.${step#bench-}" ;;
    tests-moe) run_step tests-moe env TILESCALE_SHARE_GPUS=1 timeout -k 10 480 python3 -m pytest \
                 packages/tilescale-examples/tests/test_moe.py -m gpu -q -rfEs --tb=short -p no:cacheprovider \
                 --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-decode) run_step tests-decode env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                    packages/tilescale-examples/tests/test_decode_norm_gpu.py \
                    packages/tilescale-examples/tests/test_gemm_allreduce_gpu.py \
                    -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-gemm-ar) run_step tests-gemm-ar env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                    packages/tilescale-examples/tests/test_gemm_allreduce_gpu.py \
                    -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-exchange) run_step tests-exchange env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                      packages/tilescale-examples/tests/test_{allgather,alltoall,ulysses}.py \
                      -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-norm) run_step tests-norm env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                  packages/tilescale-examples/tests/test_decode_norm_gpu.py \
                  -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-sequence) run_step tests-sequence env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                      packages/tilescale-examples/tests/test_ulysses.py packages/tilescale-examples/tests/test_flash_attention.py packages/tilescale-examples/tests/test_flash_decode.py packages/tilescale-examples/tests/test_sp_attention.py \
                      -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-sp-async) run_step tests-sp-async env TILESCALE_SHARE_GPUS=1 timeout -k 10 560 python3 -m pytest \
                      packages/tilescale-examples/tests/test_sp_attention.py \
                      -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-flash) run_step tests-flash env TILESCALE_SHARE_GPUS=1 timeout -k 10 300 python3 -m pytest \
                   packages/tilescale-examples/tests/test_flash_attention.py \
                   packages/tilescale-examples/tests/test_flash_attention_async.py \
                   -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-compile-decode) run_step tests-compile-decode env TILESCALE_SHARE_GPUS=1 timeout -k 10 560 python3 -m pytest \
                            packages/tilescale-examples/tests/test_graphs.py -k decode_block \
                            -m gpu -q -s -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-graphs) run_step tests-graphs env TILESCALE_SHARE_GPUS=1 timeout -k 10 560 python3 -m pytest \
                    packages/tilescale-examples/tests/test_graphs.py \
                    -m gpu -q -s -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-other) run_step tests-other env TILESCALE_SHARE_GPUS=1 timeout -k 10 560 python3 -m pytest \
                   packages/tilescale-examples/tests/test_{alltoall,overlap_gpu,tma_allreduce}.py \
                   -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-overlap-emulated) run_step tests-overlap-emulated timeout -k 10 540 python3 -m pytest \
                              packages/tilescale-examples/tests/test_overlap_emulated.py \
                              -m gpu -q -rfEs --tb=short -p no:cacheprovider "${pytest_args[@]}" ;;
    tests-overlap-async) run_step tests-overlap-async timeout -k 10 400 python3 -m pytest \
                           packages/tilescale-examples/tests/test_overlap_emulated.py -k async \
                           -m gpu -q -rfEs --tb=short -p no:cacheprovider "${pytest_args[@]}" ;;
    tests-moe-ll) run_step tests-moe-ll env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                    packages/tilescale-examples/tests/test_moe_low_latency_gpu.py \
                    -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-gemm) run_step tests-gemm timeout -k 10 400 python3 -m pytest \
                  packages/tilescale-examples/tests/test_gemm_async.py packages/tilescale-examples/tests/test_gemm_persistent.py \
                  packages/tilescale-examples/tests/test_stream_k.py \
                      -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-tma) run_step tests-tma env TILESCALE_SHARE_GPUS=1 timeout -k 10 300 python3 -m pytest \
                 packages/tilescale-lang/tests/test_tma_descriptors.py packages/tilescale-lang/tests/test_lean.py \
                 -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-lang-new) run_step tests-lang-new env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                      packages/tilescale-lang/tests/test_aot.py packages/tilescale-lang/tests/test_lean.py packages/tilescale-lang/tests/test_autotune_gpu.py \
                      packages/tilescale-lang/tests/test_gpu_upstream.py \
                      -m gpu -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-lang-rest) run_step tests-lang-rest env TILESCALE_SHARE_GPUS=1 timeout -k 10 540 python3 -m pytest \
                       packages/tilescale-lang/tests --ignore packages/tilescale-lang/tests/test_gpu_upstream.py \
                       -m "gpu and not chaos" -q -rfEs --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-upstream) run_step tests-upstream env TILESCALE_SHARE_GPUS=1 timeout -k 10 560 python3 -m pytest \
                      packages/tilescale-lang/tests/test_gpu_upstream.py \
                      -m gpu -q -rfEs --durations=0 --tb=short -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    tests-reduce) run_step tests-reduce env TILESCALE_SHARE_GPUS=1 timeout -k 10 240 python3 -m pytest \
                    packages/tilescale-examples/tests/test_{allreduce,reducescatter,emulated,reduce_ceiling,allgather}.py \
                    -m "gpu and not chaos" -q -s -rfEs --durations=0 --tb=short -p no:cacheprovider "${pytest_args[@]}" ;;
    tests-*) p=${step#tests-}; run_step "$step" env TILESCALE_SHARE_GPUS=1 timeout -k 10 "${limit[$p]}" \
               python3 -m pytest "packages/tilescale-$p/tests" -m "gpu and not chaos" -q -rfEs --tb=short \
               -p no:cacheprovider --tilescale-record "$logs" "${pytest_args[@]}" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
# The kernels this call compiled, newest first up to 15 MiB, as $logs/tlcache-new.tar: unpack it
# into .tlcache (tar -C .tlcache -xf tlcache-new.tar) to carry them to the next machine.
python3 ci/pack_kernel_cache.py "$TILELANG_CACHE_DIR" "$cache_start" "$logs/tlcache-new.tar" || true
python3 ci/kernel_cache_usage.py used "$TILELANG_CACHE_DIR" "$cache_start" > "$logs/tlcache-used.txt" || true
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
