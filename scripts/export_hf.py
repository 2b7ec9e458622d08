"""Export a checkpoint as a Hugging Face model directory (safetensors shards + index + config.json).

    python scripts/export_hf.py --run-dir runs/ft --out hf_out [--step N] [--dtype bfloat16]
                                [--shard-size 2GB]

Reads only the parameters of the checkpoint, a shard at a time; needs no GPU. The result loads with
`transformers.AutoModelForCausalLM.from_pretrained(out)`. The same as `megatrain export ...`
(megatrain_jax.commands.export).
"""

from megatrain_jax.cli import script_exit
from megatrain_jax.commands import export as main

if __name__ == "__main__":
    script_exit(main)
