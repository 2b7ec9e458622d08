"""Host memory per parameter of a trainer at steady state, next to the design's count.

    python scripts/bench_host_memory.py                    # ~300M params, clipping on, 3 steps
    python scripts/bench_host_memory.py --no-clip --json out.json

Builds a StreamedEngine holding a Llama-shaped model of about --params million parameters (state and
compute on the CPU device: the bus copy is a host buffer rewritten in place), runs a few training
steps on tiny batches, and reads the process's resident memory (/proc/self/status): VmRSS after
each step's host updates have finished (steady state) and VmHWM, the peak within the step (reset
before each step through /proc/self/clear_refs). Bytes per parameter are (RSS - RSS before the
model was built) / params, so the Python + JAX runtime is not counted.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.config import OptimizerConfig
from megatrain_jax.engine import StreamedEngine
from megatrain_jax.model import ModelConfig, make_block, make_stages
from megatrain_jax.train import build_optimizer


def proc_status(key: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=300, help="model size, millions")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=32, help="tokens per step (one sequence)")
    parser.add_argument("--no-clip", action="store_true", help="no global-norm clipping")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    clip = not args.no_clip

    one = ModelConfig(vocab_size=257, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                      num_layers=1, num_heads=args.hidden // 128, num_kv_heads=args.hidden // 128)
    layers = max(1, round(args.params * 1e6 / one.num_params(include_embeddings=False)))
    cfg = ModelConfig(**{**one.__dict__, "num_layers": layers})
    cpu = jax.devices("cpu")[0]
    jnp.zeros(1).block_until_ready()  # the backend is up before the baseline is read
    base = proc_status("VmRSS")

    first, last = make_stages(cfg, 0)
    engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(cfg, 0, i),
                            num_layers=cfg.num_layers, optimizer=build_optimizer(OptimizerConfig(), 100),
                            max_grad_norm=1.0 if clip else None, compute_dtype=jnp.bfloat16,
                            compute_device=cpu, host_device=cpu)
    del first, last
    n = sum(x.size for x in jax.tree.leaves(engine.params()))
    layer = sum(x.size for x in jax.tree.leaves(engine.params()["layers"][0]))
    built = proc_status("VmRSS")
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 1, args.seq + 1),
                                             dtype=np.int32)
    rows = []
    for step in range(1, args.steps + 1):
        reset_peak()
        t0 = time.perf_counter()
        out = engine.train_step(toks[..., :-1], toks[..., 1:])
        float(out["loss"])
        engine.wait()
        rows.append({"step": step, "seconds": time.perf_counter() - t0,
                     "rss_bytes_per_param": (proc_status("VmRSS") - base) / n,
                     "peak_bytes_per_param": (proc_status("VmHWM") - base) / n})
    engine.close()

    # The design's count: fp32 master + m + v (12), the bf16 bus copy (2), and gradients: with
    # clipping every unit's fp32 gradient is held until the global norm is known while the bus
    # copies are dropped (12 + 4); without, one layer's gradient at a time.
    design_steady = 12 + 2
    design_peak = 12 + 4 if clip else 12 + 2 + 4 * layer / n
    steady, peak = rows[-1]["rss_bytes_per_param"], max(r["peak_bytes_per_param"] for r in rows[1:] or rows)
    print(f"model: {n / 1e6:.1f}M params, {layers} layers of {layer / 1e6:.1f}M | AdamW fp32 master "
          f"+ m + v, bf16 bus copy, clipping {'on' if clip else 'off'} | jax {jax.__version__}")
    print(f"runtime before the model: {base / 2**20:.0f} MiB; after building it: "
          f"{(built - base) / n:.2f} B/param")
    print(f"{'step':>4s} {'seconds':>8s} {'RSS B/param':>12s} {'peak B/param':>13s}")
    for r in rows:
        print(f"{r['step']:4d} {r['seconds']:8.1f} {r['rss_bytes_per_param']:12.2f} "
              f"{r['peak_bytes_per_param']:13.2f}")
    print(f"steady state: {steady:.2f} B/param (design {design_steady}); "
          f"peak within a step: {peak:.2f} B/param (design {design_peak:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "layers": layers, "layer_params": layer, "clip": clip,
                       "baseline_rss_bytes": base, "built_bytes_per_param": (built - base) / n,
                       "steps": rows, "steady_bytes_per_param": steady, "peak_bytes_per_param": peak,
                       "design_steady": design_steady, "design_peak": design_peak,
                       "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
