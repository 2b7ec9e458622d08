"""Train a model on the streamed engine.

    python scripts/train.py --config configs/tiny.yaml [key=value ...]

Overrides are dotted config keys: `train.steps=20 run_dir=/tmp/run data.seq_len=256`.
The same as `megatrain train ...` (megatrain_jax.commands.train).
Runs itself again at once with glibc's allocations on transparent huge pages
(megatrain_jax.hostmem.with_huge_pages; MEGATRAIN_HUGE_PAGES=0 runs it as started).
"""

if __name__ == "__main__":
    from megatrain_jax import hostmem
    hostmem.with_huge_pages()

from megatrain_jax.cli import script_exit  # noqa: E402
from megatrain_jax.commands import train as main  # noqa: E402

if __name__ == "__main__":
    script_exit(main)
