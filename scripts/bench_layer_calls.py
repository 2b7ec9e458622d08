"""A layer's one call over a step's micro-batches, the loop a lax.scan or unrolled in the traced
program: compile time, the dispatching thread's time per call, and the call's own time; and the
dispatch of a bare jit of the same arguments (one add: what a call costs the dispatching thread
for its arguments alone, with no program to speak of).

    PYTHONPATH=. python3 scripts/bench_layer_calls.py --config configs/bench_1b.yaml [key=value ...]

Compiles the engine's layer_fwd and layer_bwd (engine/functions.py) both ways at the config's
micro-batch shape (data.micro_batches stacked), the layer's weights one flat array as the engine
passes them (engine/packing.py), then times each call's dispatch alone, queued
behind a chain of matmuls so that the device is busy (the time is the dispatching thread's), and
each call to completion. Prints one table; writes JSON with --json. Run once more with
XLA_FLAGS=--xla_gpu_enable_command_buffer= on a GPU, the rows tell a launch's cost per executable
(thunks or a command buffer updated for every call's new buffers) from its cost per argument.
"""

import argparse
import json
import os
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML config file (defaults apply without one)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--reps", type=int, default=5, help="timed calls of each")
    p.add_argument("--json", default=None, help="output file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatrain_jax.cli import run_cli
    return run_cli(lambda: bench(args))


def bench(args):
    import jax
    import jax.numpy as jnp
    from megatrain_jax.engine import packing
    from megatrain_jax.engine.functions import DeviceFunctions
    from megatrain_jax.flops import abstract_units
    from megatrain_jax.recipes import execution_for, load_config
    cfg = load_config(args.config, args.overrides)
    dev = jax.devices()[0]
    execution, _ = execution_for(cfg, dev.platform)
    stages_def, stages, block_def, block, constants, parts = abstract_units(cfg.model, execution)
    M, B, T, D = (cfg.data.micro_batches, cfg.data.batch_size, cfg.data.seq_len,
                  cfg.model.hidden_size)
    c = jnp.dtype(cfg.train.compute_dtype)
    flat = packing.Flat.of(block)
    w = (jnp.full((flat.size,), 0.01, c),  # a layer, and its Constants
         jax.tree.map(lambda k: jnp.zeros(k.shape, k.dtype), constants))
    xs = jax.random.normal(jax.random.key(0), (M, B, T, D), c)
    n = 4096 if dev.platform == "gpu" else 256
    a = jnp.ones((n, n), c)
    busy = jax.jit(lambda a: jax.lax.fori_loop(0, 200, lambda i, x: x @ a * 1e-4, a))
    rows = {}
    # the same arguments, one add: a jit's launch with nothing in it
    bare = jax.jit(lambda *args: jax.tree.leaves(args)[-1] + 1)
    makers = {"layer_fwd": lambda: (None, None, w, xs, None),
                 "layer_bwd": lambda: (None, None, w, xs, None, xs + 0, None)}
    for form in ("scan", "unrolled", "bare"):
        f = DeviceFunctions(stages_def, jax.tree.structure(stages), parts, block_def,
                            jnp.dtype(cfg.train.grad_dtype), unroll=form == "unrolled",
                            packing=flat)
        calls = {name: (bare if form == "bare" else getattr(f, name), make)
                 for name, make in makers.items()}
        for name, (fn, make) in calls.items():
            t0 = time.perf_counter()
            fn.lower(*make()).compile()
            compile_s = time.perf_counter() - t0
            jax.block_until_ready(fn(*make()))  # the jit's own cache filled
            queued = [make() for _ in range(args.reps)]
            jax.block_until_ready((queued, a))
            b = busy(a)
            t0 = time.perf_counter()
            out = [fn(*arguments) for arguments in queued]
            dispatch_s = (time.perf_counter() - t0) / args.reps
            jax.block_until_ready((out, b))
            t0 = time.perf_counter()
            for arguments in [make() for _ in range(args.reps)]:
                jax.block_until_ready(fn(*arguments))
            rows[f"{name} {form}"] = {"compile_s": compile_s, "dispatch_us": dispatch_s * 1e6,
                                      "call_ms": (time.perf_counter() - t0) / args.reps * 1e3}
    print(f"{dev.device_kind} ({dev.platform}), {M} micro-batches of {B} x {T:,}, hidden {D:,}")
    print(f"{'call':<22}{'compile s':>10}{'dispatch us':>13}{'call ms':>10}")
    for name, r in rows.items():
        print(f"{name:<22}{r['compile_s']:>10.2f}{r['dispatch_us']:>13.0f}{r['call_ms']:>10.1f}")
    if args.json:
        with open(args.json, "w") as out_file:
            json.dump({"config": args.config, "overrides": args.overrides, "jax": jax.__version__,
                       "platform": dev.platform, "micro_batch": [M, B, T],
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "calls": rows},
                      out_file, indent=1)


if __name__ == "__main__":
    sys.exit(main())
