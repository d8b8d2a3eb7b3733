#!/usr/bin/env bash
# Everything a CUDA GPU must show, in one run (README, "Testing on a GPU"):
#
#     bash benchmarks/gpu_check.sh [RESULTS_DIR] [STEP...]
#
# Run from the repository root with shardwise installed (`pip install -e '.[test]'` on a CUDA
# build of torch). Steps, in this order unless named: tests (every gpu-marked test), bench
# (`shardwise bench`, inject + graphs, fp16, batch 1/8/32), kernels (benchmarks/kernel_cuda.py),
# kernels-graphs (decode attention timed inside CUDA graphs), kernels-paths (quant_linear with
# each path forced, in graphs; not a default step), floor (benchmarks/cuda_step_floor.py: the
# captured step's replay floor against the decode loops; not a default step), quant (the bench with int8 and
# int4 weights), prefill (the bench at a 2k-token prompt), moe (the Mixtral-shaped preset in
# bf16), offload (weights streamed from pinned host memory), serve (benchmarks/serve_load.py
# on the preset saved with a tokenizer from $TOKENIZER, default .whl/tokenizer). Each step has its own time limit, writes its log and JSON under
# RESULTS_DIR (default benchmarks/results/gpu-<date>) and a failing step does not stop the next;
# the exit code is non-zero when any step failed. With ARCHIVE=FILE.tgz set, the results folder is
# archived there after every step (for machines that hand back a few files only).
set -u
out=${1:-benchmarks/results/gpu-$(date +%Y-%m-%d-%H%M)}
shift || true
steps=${*:-tests bench kernels kernels-graphs quant prefill moe offload serve}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-6}" "$out/$name.log"
    [ "$rc" -eq 0 ] || status=1
    if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$(dirname "$out")" "$(basename "$out")"; fi
}

python3 - <<'EOF' | tee "$out/env.txt"
import torch, triton, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__)
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF

preset=llama-22l-2048h-gqa
bench() {  # bench NAME SECONDS ARGS...
    local name=$1 limit=$2
    shift 2
    step "bench-$name" "$limit" shardwise bench --preset $preset --device cuda --dtype fp16 \
        --inject --graphs --no-progress --no-chart --output "$out/cuda-$name-$preset.json" "$@"
}

for s in $steps; do
    case $s in
    tests)
        # a module that cannot import here (a serving extra missing) must not stop the rest
        step tests "${TESTS_LIMIT:-170}" python3 -m pytest -m gpu -q -p no:cacheprovider \
            -n "${WORKERS:-12}" --timeout 150 -rfE --continue-on-collection-errors \
            --junitxml="$out/gpu-tests.xml" ${TESTS:-tests} ;;
    bench)
        bench fp16-inject-graphs 110 --batch 1 8 32 --prompt-len 128 --new-tokens 64 ;;
    quant)
        bench int8-inject-graphs "${QUANT_LIMIT:-120}" --quant int8 --batch 1 8 32 --prompt-len 128 --new-tokens 64
        bench int4-inject-graphs "${QUANT_LIMIT:-120}" --quant int4 --batch 1 8 32 --prompt-len 128 --new-tokens 64 ;;
    prefill)
        bench prefill2k-fp16 60 --batch 1 --prompt-len 2048 --new-tokens 8 ;;
    kernels)
        TAIL=120 step kernels 110 python3 benchmarks/kernel_cuda.py \
            --output "$out/cuda-kernels.json" ;;
    kernels-paths)  # quant_linear's paths forced (GEMV, GEMM, dequantize + torch.mm), in graphs
        TAIL=60 step kernels-paths "${KERNELS_LIMIT:-150}" python3 benchmarks/kernel_cuda.py \
            --graphs --parts quant --paths ${KERNEL_MODELS:+--models $KERNEL_MODELS} \
            ${KERNEL_LAYERS:+--layers $KERNEL_LAYERS} \
            --output "$out/cuda-kernels-quant-paths.json" ;;
    floor)  # where a decode token's time goes: the captured step's replay floor vs the loops
        TAIL=8 step floor "${FLOOR_LIMIT:-90}" python3 benchmarks/cuda_step_floor.py \
            --preset $preset --dtype fp16 --batch 1 8 32 --output "$out/cuda-step-floor-$preset.json" ;;
    kernels-graphs)  # decode attention as the captured step runs it (no launch cost)
        TAIL=30 step kernels-graphs 60 python3 benchmarks/kernel_cuda.py --graphs --parts decode \
            --output "$out/cuda-kernels-decode-graphs.json" ;;
    moe)  # the Mixtral-shaped preset in bf16 against HF's default experts (issue: >= 3x)
        step bench-moe "${MOE_LIMIT:-150}" shardwise bench --preset mixtral-18l-1024h-8e \
            --device cuda --dtype bf16 --inject --graphs --batch 1 8 --prompt-len 128 \
            --new-tokens 64 --no-progress --no-chart \
            --output "$out/cuda-moe-bf16-inject-graphs-mixtral-18l-1024h-8e.json" ;;
    offload)  # weights streamed from pinned host memory, against the pinned-copy probe
        step bench-offload-cpu "${OFFLOAD_LIMIT:-200}" shardwise bench --preset $preset \
            --device cuda --dtype fp16 --inject --offload cpu --batch 1 8 32 --prompt-len 128 \
            --new-tokens 64 --no-progress --no-chart \
            --output "$out/cuda-offload-cpu-fp16-inject-$preset.json" ;;
    serve)  # the preset (>= 1B) served to 64 streams; HF, serving one request at a time, at 1
        step serve-model 120 python3 benchmarks/preset_folder.py $preset /tmp/serve-$preset \
            --tokenizer "${TOKENIZER:-.whl/tokenizer}" --dtype fp16
        TAIL=14 step serve-load "${SERVE_LIMIT:-240}" python3 benchmarks/serve_load.py \
            --model /tmp/serve-$preset --concurrency 1 8 64 --requests-per-stream 2 \
            --max-tokens 64 --repeats 1 --baseline-levels 1 --client-processes 4 \
            --output "$out/cuda-serve-load-$preset.json" ;;
    *) echo "unknown step $s (tests, bench, kernels, kernels-paths, floor, kernels-graphs, quant, prefill, moe, offload, serve)"
       status=2 ;;
    esac
done
exit $status
