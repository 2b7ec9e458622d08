"""Export a checkpoint as a Hugging Face model directory (safetensors shards + index + config.json).

    python scripts/export_hf.py --run-dir runs/ft --out hf_out [--step N] [--dtype bfloat16]
                                [--shard-size 2GB]

Reads only the parameters of the checkpoint, a shard at a time; needs no GPU. The result loads with
`transformers.AutoModelForCausalLM.from_pretrained(out)`.
"""

import argparse

from megatrain_jax.cli import run_cli, script_exit
from megatrain_jax.hf import EXPORT_DTYPES, export_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="the run directory (holds checkpoints/)")
    parser.add_argument("--out", required=True, help="the HF directory to write (new or empty)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES))
    parser.add_argument("--shard-size", default="2GB", help="largest shard, e.g. 2GB, 500MB")
    args = parser.parse_args(argv)
    return run_cli(lambda: export_checkpoint(args.run_dir, args.out, step=args.step,
                                             dtype=args.dtype, shard_size=args.shard_size))


if __name__ == "__main__":
    script_exit(main)
