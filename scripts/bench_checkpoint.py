"""Extra peak host memory (RSS) that saving a checkpoint needs, per save mode.

    python scripts/bench_checkpoint.py [--layers 4 --hidden 1024 --limit-mb MB --out bench_checkpoint.json]

Orbax writes at most one unit's state at a time, as train.py sets it (`--limit-mb 0`: no limit).

Each mode runs in a fresh process (allocator pools of one mode would hide the next one's peak):
the engine is built and trained two steps (everything compiled, every buffer allocated), then the
kernel's peak-RSS counter is reset (/proc/self/clear_refs) and the mode runs:

    sync               checkpoint.async=false: save() blocks until the checkpoint is committed
    async idle         async save, then wait for it (nothing runs meanwhile)
    async + training   async save, then train steps at once (updates during the write), then wait
    training only      the same train steps without a save: the baseline for the row above

extra = VmHWM during the mode - VmRSS just before it. For "async + training" the figure that the
save costs is its extra minus the "training only" extra (a step has its own transient memory).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time

MODES = ("sync", "async idle", "async + training", "training only")


def child(args):
    import jax

    from megatrain_jax import checkpoint, hostmem
    from megatrain_jax.config import load_config
    from megatrain_jax.recipes import build_engine, load_dataset

    cfg = load_config(None, [
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={args.hidden * 11 // 4}", "model.num_heads=8", "model.num_kv_heads=8",
        "data.seq_len=32", "data.batch_size=1", "train.compute_dtype=float32", "train.steps=100"])
    engine, dataset = build_engine(cfg), load_dataset(cfg)
    step = lambda: jax.block_until_ready(engine.train_step(*dataset.next_batch()))
    for _ in range(2):
        step()
    engine.wait()
    state = engine.state()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(state["layers"][0]))
    del state
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        # As train.py does: Orbax writes at most one unit's state at a time (0: no limit).
        limit = (checkpoint.largest_unit_bytes(engine) if args.limit_mb is None else
                 int(args.limit_mb * 2**20) or None)
        manager = checkpoint.make_manager(d, async_save=args.mode != "sync", write_bytes=limit)
        rss0 = hostmem.rss_bytes()
        hostmem.reset_peak()
        t0 = time.perf_counter()
        if args.mode != "training only":
            checkpoint.save(manager, 1, engine)
        t_return = time.perf_counter() - t0
        if args.mode in ("async + training", "training only"):
            for _ in range(args.train_steps):
                step()
            engine.wait()
        manager.wait_until_finished()
        t_total = time.perf_counter() - t0
        peak = hostmem.peak_rss_bytes()
        manager.close()
    print(json.dumps({"mode": args.mode, "state_mb": state_bytes / 2**20, "layer_mb": layer_bytes / 2**20,
                      "rss_before_mb": rss0 / 2**20,
                      "write_limit_mb": None if limit is None else limit / 2**20,
                      "extra_peak_mb": (peak - rss0) / 2**20,
                      "save_returns_s": t_return, "total_s": t_total, "jax": jax.__version__}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--limit-mb", type=float, default=None,
                        help="bytes Orbax writes at once; default one unit's state (as train.py), 0: no limit")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (a temp dir in it)")
    parser.add_argument("--out", default="bench_checkpoint.json")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one child
    args = parser.parse_args()
    if args.mode:
        return child(args)
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--train-steps", str(args.train_steps)]
        if args.limit_mb is not None:
            cmd += ["--limit-mb", str(args.limit_mb)]
        if args.dir:
            cmd += ["--dir", args.dir]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    r = rows[0]
    limit = "none" if r["write_limit_mb"] is None else f"{r['write_limit_mb']:.0f} MB"
    print(f"state {r['state_mb']:.0f} MB saved ({args.layers} layers, one layer's state "
          f"{r['layer_mb']:.0f} MB), Orbax write limit {limit}, RSS before a save "
          f"{r['rss_before_mb']:.0f} MB")
    print(f"{'mode':<18} {'extra peak RSS':>15} {'save() returns':>15} {'until committed':>16}")
    for r in rows:
        print(f"{r['mode']:<18} {r['extra_peak_mb']:>12.0f} MB {r['save_returns_s']:>13.2f} s "
              f"{r['total_s']:>14.2f} s")
    with open(args.out, "w") as f:
        json.dump({"layers": args.layers, "hidden": args.hidden, "train_steps": args.train_steps,
                   "jax": rows[0]["jax"],
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
