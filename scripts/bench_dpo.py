"""Peak host RAM of DPO's reference pass next to that of its training steps.

    python scripts/bench_dpo.py                          # ~100M params, on the default device
    python scripts/bench_dpo.py --hidden 2048 --layers 16 --json out.json

The trainer's own path on the bundled preference pairs (configs/dpo_tiny.yaml's data and
tokenizer) with a Llama-shaped model of --layers layers of width --hidden: the engine is built
(recipes.build_engine), then the reference pass runs (dpo.prepare_reference: one streamed forward
pass of the starting weights, no second copy of the model), then --steps training steps. VmHWM
(the kernel's peak RSS) is reset before each phase and read after it; RSS before the engine is
built is the baseline (Python, JAX, the data). The reference pass holds the engine's host state
and a forward's transfers; training adds the gradients on the host and the optimizer update, so
its peak is the larger. On a machine without an accelerator the compute runs on CPU device 0 and
the state lives on CPU device 1, so that every transfer is a real copy.
"""

import argparse
import json
import os
import sys
import tempfile
import time


def run(args) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)  # before the backend starts (CPU only)
    from megatrain_jax import dpo, hostmem
    from megatrain_jax.config import load_config
    from megatrain_jax.recipes import build_engine, load_data

    hostmem.set_mmap_threshold(1 << 20)  # as train() sets it
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_dir = tempfile.mkdtemp(prefix="bench-dpo-")
    data = os.path.join(run_dir, "pairs.jsonl")  # the first --pairs bundled pairs
    with open(os.path.join(root, "megatrain_jax", "texts", "dpo_tiny.jsonl"), encoding="utf-8") as f:
        lines = f.readlines()[:args.pairs]
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(lines)
    heads = max(1, args.hidden // 64)
    cfg = load_config(os.path.join(root, "configs", "dpo_tiny.yaml"), [
        f"model.hidden_size={args.hidden}", f"model.intermediate_size={int(2.75 * args.hidden)}",
        f"model.num_layers={args.layers}", f"model.num_heads={heads}",
        f"model.num_kv_heads={heads}", f"data.batch_size={args.batch_size}",
        f"train.steps={args.steps}", f"train.compute_dtype={args.compute_dtype}",
        f"run_dir={run_dir}", f"data.path={data}", "train.offload_activations=false"])
    cpu = jax.devices("cpu")
    devices = ({"compute_device": cpu[0], "host_device": cpu[1]}
               if jax.devices()[0].platform == "cpu" else {})
    dataset, _ = load_data(cfg)
    baseline = hostmem.rss_bytes()
    engine = build_engine(cfg, **devices)
    built = hostmem.rss_bytes()

    hostmem.reset_peak()
    t0 = time.perf_counter()
    dpo.prepare_reference(cfg, engine, dataset, log=lambda line: None)
    reference_s = time.perf_counter() - t0
    reference_peak = hostmem.peak_rss_bytes()

    hostmem.reset_peak()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        float(engine.train_step(*dataset.next_batch_with_context())["loss"])
    engine.wait()
    train_s = time.perf_counter() - t0
    train_peak = hostmem.peak_rss_bytes()
    engine.close()
    return {"params": cfg.model.num_params(), "device": jax.devices()[0].device_kind,
            "sequences": len(dataset.rows["inputs"]), "seq_len": cfg.data.seq_len,
            "baseline_rss_bytes": baseline, "engine_rss_bytes": built,
            "reference_peak_rss_bytes": reference_peak, "train_peak_rss_bytes": train_peak,
            "reference_s": reference_s, "train_s": train_s, "steps": args.steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="rows per step (pairs x 2)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=64, help="bundled pairs the reference pass scores")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args(argv)
    if args.hidden < 64 or args.hidden % 64 or args.layers < 1 or args.steps < 1:
        p.error("--hidden must be a multiple of 64, --layers and --steps >= 1")
    if args.batch_size % 2 or args.pairs < args.batch_size // 2:
        p.error("--batch-size must be even and --pairs at least --batch-size / 2")
    r = run(args)
    gb = lambda n: f"{n / 1e9:.2f} GB"
    base = r["baseline_rss_bytes"]
    print(f"{r['params'] / 1e6:.1f}M params on {r['device']}, {r['sequences']} sequences of "
          f"{r['seq_len']} tokens")
    print(f"  engine built:    RSS {gb(r['engine_rss_bytes'])} "
          f"(+{gb(r['engine_rss_bytes'] - base)} over the baseline {gb(base)})")
    print(f"  reference pass:  peak RSS {gb(r['reference_peak_rss_bytes'])} "
          f"(+{gb(r['reference_peak_rss_bytes'] - base)}), {r['reference_s']:.1f} s")
    print(f"  training steps:  peak RSS {gb(r['train_peak_rss_bytes'])} "
          f"(+{gb(r['train_peak_rss_bytes'] - base)}), {r['train_s'] / r['steps']:.2f} s/step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
