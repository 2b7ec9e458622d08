#!/usr/bin/env bash
# The GPU checklist of docs/benchmarks.md ("GPU figures still to be taken"), one device call per
# part, each under the device tool's 10-minute limit and its 8 files back:
#
#     bash scripts/gpu_checklist.sh 1    # jax on the machine, the engine's tests, transfers, 1B model
#     bash scripts/gpu_checklist.sh 2    # long context: Llama-3-8B shapes at 32K and 128K, the plan
#     bash scripts/gpu_checklist.sh 3    # the 4B model in an 11 GB device cap
#
# Everything goes to $OUT (default gpu_results/): part<N>.txt (every command's output, in order)
# and one JSON per benchmark. Each command has its own timeout, so a slow one leaves the others'
# output. Copy the JSON into docs/results/ and the tables into docs/benchmarks.md.
set -u
part=${1:?usage: bash scripts/gpu_checklist.sh 1|2|3}
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-100}
log="$OUT/part$part.txt"

run() {  # run <timeout s> <command...>: the command and its output appended to the log
    local limit=$1; shift
    echo "=== $(date -u +%FT%TZ) timeout ${limit}s: $*" >>"$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    echo "=== exit $?" >>"$log"
}

machine() {
    run 20 nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv
    run 10 free -g
    run 10 nproc
    run 60 python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__); print(jax.devices())"
}

# Llama-3-8B's layer and vocabulary shapes with 4 layers: the device peak does not depend on the
# depth, and the host state (about 31 GB) fits this machine's RAM (the whole model needs ~135 GB).
long_context() {  # long_context <name> <seq> <attention> <steps>
    run 240 python3 scripts/bench_long_context.py --config configs/llama3_8b.yaml \
        --seq-len "$2" --compute-dtype bfloat16 --attention "$3" --steps "$4" \
        --json "$OUT/$1.json" model.num_layers=4
}

case $part in
1)
    machine
    # the engine on this jax (0.11.2), CPU devices as in CI
    run 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_streaming.py tests/test_engine.py
    run 120 python3 scripts/bench_transfer.py --mb 512 --json "$OUT/transfer.json"
    run 240 python3 scripts/bench.py --config configs/bench_1b.yaml --steps 3 --json "$OUT/bench_1b.json"
    ;;
2)
    machine
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # the default 0.75 leaves ~20 GB unused
    long_context long_32k_auto 32768 auto 3
    long_context long_32k_blockwise 32768 blockwise 3
    long_context long_128k_auto 131072 auto 2
    run 90 python3 scripts/plan.py --config configs/llama3_8b.yaml --device local \
        --sweep 8192,32768,131072,524288 --json "$OUT/plan_local.json"
    ;;
3)
    machine
    run 300 python3 scripts/bench.py --config configs/bench_4b.yaml --device-mem-gb 11 \
        --baselines none --steps 2 --json "$OUT/bench_4b.json"
    run 200 python3 scripts/bench_optimizer.py --cores 16 --json "$OUT/optimizer_16.json"
    ;;
*)
    echo "unknown part $part (1, 2 or 3)" >&2
    exit 2
    ;;
esac
tail -n 40 "$log"
