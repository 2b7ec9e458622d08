"""Data parallel: bytes over each link per step and host RAM per process, predicted and measured.

    python scripts/bench_data_parallel.py                       # P = 1, 2, 4 processes (CPU)
    python scripts/bench_data_parallel.py --processes 1,2 --steps 3 --json out.json
    python scripts/bench_data_parallel.py --shard-optimizer       # replicated and sharded rows
    python scripts/bench_data_parallel.py --shard-optimizer --processes 1,2 --steps 1 \
        model.hidden_size=768 model.intermediate_size=2048 model.num_layers=8 \
        model.num_heads=12 model.num_kv_heads=4                 # a larger model (50.7M params)

For each P, trains the tiny config (configs/tiny.yaml, fp32; dotted key=value overrides after the
options change it, e.g. to a model large enough for RSS to show the host state) with P processes
of one compute device each, started by scripts/launch.py on 127.0.0.1 (gloo), and reports per
process:

- host -> device bytes per link per step: each device gets every unit's weights over its own link
  (the embedding twice, the head once, each block twice); predicted from the model's parameter
  counts, measured by the engine's counters (`engine.counters.bytes_h2d`, one link's bytes)
- device -> host bytes per process per step: the gradient, summed over the devices first, crosses
  once per process (predicted; measured by `bytes_d2h`)
- collective bytes each device sends per step (replicated: a ring all-reduce, 2 (D - 1) / D of
  the fp32 accumulators; sharded: a reduce-scatter, (D - 1) / D of them, and the all-gather of
  every fetch, (D - 1) / D of its bytes): predicted only, XLA does not count them
- host RAM per process: the plan's figure (master + optimizer + bus + gradients), the engine's own
  accounting of master + optax state (`nbytes(engine.state())`), and the process's RSS

Host state replicated (default): every process holds all of it, so the host figures do not fall
with P. With --shard-optimizer each P also runs with distributed.shard_optimizer=true (the host
state sharded over the processes, engine/shard.py): each link then carries 1 / P of the bus bytes
(every leaf's rows zero-padded to a multiple of P), the gradient crossing to a process is its rows
only, and the engine state per process is ~1 / P. (With P = 1 and one device there is nothing to
shard: that row is the replicated one only.)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = ["train.compute_dtype=float32", "train.attention=xla", "data.batch_size=8",
         "data.seq_len=128", "logging.tensorboard=false"]


def child(out_dir: str, steps: int, overrides: list):
    """One process of a run: a few steps, then its figures as JSON in out_dir."""
    import dataclasses

    import jax

    from megatrain_jax import distributed, plan as plan_lib
    from megatrain_jax.machines import machine_from_device
    from megatrain_jax.config import load_config
    from megatrain_jax.engine.transfer import nbytes
    from megatrain_jax.hostmem import rss_bytes
    from megatrain_jax.recipes import build_engine, load_dataset

    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [*BENCH, *overrides])
    distributed.initialize(cfg.distributed)
    devices, host = distributed.devices(cfg.distributed)
    me, processes = jax.process_index(), jax.process_count()
    engine = build_engine(cfg, compute_devices=devices, host_device=host)
    dataset = load_dataset(cfg)
    dataset.share = (me, processes)
    float(engine.train_step(*dataset.next_batch())["loss"])  # compiles
    engine.wait()
    before = dataclasses.replace(engine.counters)
    for _ in range(steps):
        float(engine.train_step(*dataset.next_batch())["loss"])
    engine.wait()
    per_step = lambda key: (getattr(engine.counters, key) - getattr(before, key)) / steps

    D = len(devices)
    per_device = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, batch_size=cfg.data.batch_size // D))
    run_plan = plan_lib.plan(per_device, machine_from_device(jax.local_devices()[0]))
    c = run_plan.counts
    grads = c.first + c.last + c.layers * c.layer  # parameters whose gradients cross
    h2d = c.compute * (2 * c.first + c.last + 2 * c.layers * c.layer)
    d2h = c.grad * grads
    collectives = 0 if D == 1 else 2 * (D - 1) / D * 4 * grads  # a ring all-reduce
    if engine.shards is not None:  # each link gets its piece of the padded rows, 1 / D of them
        first, last, layer = padded_counts(engine)
        fetched = 2 * first + last + 2 * c.layers * layer
        h2d = c.compute * fetched // D
        d2h = c.grad * (first + last + c.layers * layer) // processes
        # a ring reduce-scatter of the fp32 accumulators, and an all-gather of every fetch
        collectives = (D - 1) / D * (4 * (first + last + c.layers * layer) + c.compute * fetched)
    result = {
        "processes": processes, "process": me, "devices": D,
        "layout": "replicated" if engine.shards is None else "sharded",
        "h2d_per_link_predicted": h2d,
        "h2d_per_link_measured": per_step("bytes_h2d"),
        "d2h_per_process_predicted": d2h,
        "d2h_per_process_measured": per_step("bytes_d2h"),
        "allreduce_per_device_predicted": collectives,
        "host_plan": sum(v for k, v in run_plan.host.items() if k != "activations"),
        "host_state_engine": nbytes(engine.state()),
        "rss": rss_bytes(),
    }
    engine.close()
    with open(os.path.join(out_dir, f"p{me}.json"), "w") as f:
        json.dump(result, f)
    distributed.finish(cfg.distributed)


def padded_counts(engine) -> tuple:
    """Parameters of the first stage's part, the last's (a tied leaf in both) and one block,
    with every leaf's rows zero-padded as the sharded layout pads them (engine/shard.py)."""
    import math

    import jax

    shards, shapes = engine.shards, engine.param_shapes()
    padded = lambda tree: [math.prod(shards.padded_shape(x.shape)) for x in jax.tree.leaves(tree)]
    stages = padded(shapes["stages"])
    first = sum(stages[i] for i in engine.parts.first)
    last = sum(stages[i] for i in engine.parts.last)
    return first, last, sum(padded(shapes["layers"][0]))


def run(processes: int, steps: int, sharded: bool = False, overrides: tuple = ()) -> list:
    """The figures of every process of a P-process run (config `overrides`: key=value)."""
    with tempfile.TemporaryDirectory() as out:
        me = [os.path.abspath(__file__), "--child", out, "--steps", str(steps), *overrides]
        if sharded:
            me.append("distributed.shard_optimizer=true")
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        command = ([sys.executable, *me] if processes == 1 else
                   [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--nproc",
                    str(processes), "--", *me])
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"P={processes} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return [json.load(open(os.path.join(out, f"p{i}.json"))) for i in range(processes)]


def table(results: list) -> str:
    kb = lambda x: f"{x / 1e3:,.1f} kB"
    rows = ["| host state | P | h2d per link: predicted / measured | d2h per process: predicted / "
            "measured | collectives per device (predicted) | host RAM per process: plan / engine "
            "state / RSS |", "|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['layout']} | {r['processes']} | {kb(r['h2d_per_link_predicted'])} / "
                    f"{kb(r['h2d_per_link_measured'])} | {kb(r['d2h_per_process_predicted'])} / "
                    f"{kb(r['d2h_per_process_measured'])} | "
                    f"{kb(r['allreduce_per_device_predicted'])} | {kb(r['host_plan'])} / "
                    f"{kb(r['host_state_engine'])} / {r['rss'] / 1e9:.2f} GB |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2,4", help="comma-separated process counts")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one compiling)")
    parser.add_argument("--json", help="also write every process's figures here")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="each P also with distributed.shard_optimizer=true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.child:
        return child(args.child, args.steps, rest)
    results = []
    for p in [int(x) for x in args.processes.split(",")]:
        # one process of one device has nothing to shard: the sharded run would be this one
        for sharded in [False, True] if args.shard_optimizer and p > 1 else [False]:
            figures = run(p, args.steps, sharded, rest)
            results.append(max(figures, key=lambda r: r["rss"]))  # the largest process
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
