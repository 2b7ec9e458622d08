"""Plan a run's host RAM and device memory before starting it (megatrain_jax.plan).

    python scripts/plan.py --config configs/llama3_8b.yaml [key=value ...] [--device h100]
    python scripts/plan.py --config configs/llama3_8b.yaml data.seq_len=131072 --host-memory-gb 128
    python scripts/plan.py --config configs/qwen2_5_7b.yaml --sweep 8192,32768,131072,524288
    python scripts/plan.py --config configs/bench_1b.yaml --step-time [--rates RESULTS_DIR]
    python scripts/plan.py --config configs/dense_120b.yaml --device h200 --host-memory-gb 1500 \
        --largest-model

--device is a preset (h100, h200, gh200; default h100) or `local`: this machine's first device.
--sweep prints one row per sequence length instead of the full report. --largest-model adds the
most layers (model.num_layers) of the config's width that fit, as layers and parameters. --json
writes the plan (or the sweep's plans) as JSON. Nothing of the model is allocated; on a CPU it
takes seconds to a minute for an 8B model (it compiles the step's functions to read their
workspaces). --step-time predicts the step time instead (megatrain_jax.step_time; `--help` lists
the rates). The same as `megatrain plan ...` (megatrain_jax.commands.plan).
"""

from megatrain_jax.cli import script_exit
from megatrain_jax.commands import plan as main

if __name__ == "__main__":
    script_exit(main)
