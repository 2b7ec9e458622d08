"""Sample from a run's checkpoint or a Hugging Face model directory, with a KV cache, the layers
streamed through the device as in training.

    python scripts/generate.py --run runs/tiny --prompt "CYNIC, n." [--step N]
    python scripts/generate.py --hf models/Qwen2.5-0.5B --prompt "..." [--max-new-tokens 100
                               --temperature 0.8 --top-p 0.95 --seed 0 --dtype bfloat16]

The same as `megatrain generate ...` (megatrain_jax.commands.generate).
"""

from megatrain_jax.cli import script_exit
from megatrain_jax.commands import generate as main

if __name__ == "__main__":
    script_exit(main)
